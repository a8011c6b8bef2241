"""The ``lightning.fabric.callbacks_factory`` entry point: every ``lightning.Fabric(...)`` in a process
whose environment sets ``SINKWATCH_FABRIC`` gets a ``SinkWatchFabricCallback``, so a Fabric script
(``litgpt pretrain ...``) is monitored with no code change:

    SINKWATCH_FABRIC=1 litgpt pretrain ...                                   # the callback's defaults
    SINKWATCH_FABRIC='{"every_n_steps": 100, "out_dir": "out/sinkwatch"}' litgpt pretrain ...

The value is ``1``/``true``/``on`` (defaults) or a JSON object of the callback's scalar options
(``every_n_steps``, ``out_dir``, ``wandb``, ``max_steps``, ...). Unset, empty, ``0``/``false``/``off``:
no callback. This module imports nothing until the variable asks for the callback, and the factory
never raises: a bad value is one warning and Fabric runs without sinkwatch.
"""

from __future__ import annotations

import os

ENV = "SINKWATCH_FABRIC"
_OFF = {"", "0", "false", "off", "no"}
_ON = {"1", "true", "on", "yes"}


def callbacks() -> list:
    """The callbacks Fabric adds to every ``Fabric(...)``: ``[SinkWatchFabricCallback(**options)]`` or ``[]``."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() in _OFF:
        return []
    try:
        if value.lower() in _ON:
            options = {}
        else:
            import json

            options = json.loads(value)
            if not isinstance(options, dict):
                raise ValueError(f"expected 1 or a JSON object of options, got {value!r}")
        from .fabric import SCALAR_OPTIONS, SinkWatchFabricCallback

        allowed = (*SCALAR_OPTIONS, "max_steps")
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown}; {ENV} may set {sorted(allowed)}")
        return [SinkWatchFabricCallback(**options)]
    except Exception as exc:  # noqa: BLE001 - never break a user's Fabric over a bad variable
        import warnings

        warnings.warn(
            f"sinkwatch: {ENV}={value!r} is not usable ({type(exc).__name__}: {exc}); Fabric runs without sinkwatch",
            RuntimeWarning,
            stacklevel=2,
        )
        return []
