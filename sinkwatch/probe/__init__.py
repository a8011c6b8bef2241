"""The one-probe engine (docs/design.md §1): ``Monitor.probe`` runs fixed probe sets through a model once and
returns a ``Snapshot``. The same engine serves the callbacks, replay and the one-shot CLI.

- ``config``: ``MonitorConfig``, how a probe runs;
- ``monitor``: ``Monitor``, the probe sets, the captured forwards, the values and the stage views;
- ``runs``: one entry per probe kind (sink and P0, induction, repeated, natural): what it adds to the
  capture and the values it computes;
- ``collectors``: the parts that ride a captured forward (attention statistics, norms, head outputs);
- ``share``: a data-parallel rank's share of the sequences and the combination of the shares;
- ``memory``: what a probe needs in memory, checked before it runs;
- ``snapshot``: ``Snapshot``, one probe's values and the record they become.

Framework-free: under data or tensor parallelism the live core hands ``Monitor.probe`` a guarded target and a
``ProbeShare`` (``sinkwatch.distributed``); nothing here imports the rank protocol.
"""

from .config import MonitorConfig
from .monitor import Monitor
from .snapshot import Snapshot

__all__ = ["Monitor", "MonitorConfig", "Snapshot"]
