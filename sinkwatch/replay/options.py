"""Every option of a replay, declared once: ``ReplayOptions`` (name, type, default, one-line help, who reads it, CLI flag).

``sinkwatch replay`` (and ``--plan``), ``replay``, ``replay_plan``, ``prepare_replay`` and the engines' unit (``replay_revision``,
``write_manifest``, ``failed_tasks``, ``finalize``) all take this one object; ``sinkwatch.cli`` generates the CLI's flags from
its fields, so a new option is one new field. ``__post_init__`` validates, once: a bad value fails before the hub is asked.

One dataclass, not one per command: a plan says what replay *with the same options* would do. A field's ``only`` says who
reads it: ``replay`` (wandb, progress, ablate: the plan measures nothing), ``plan`` (workers, bandwidth_mb_s, tflops:
estimates only), None: both. A keyword given to an entry point that does not read it is refused, naming its reader
(``replay(workers=4)`` would look like four workers); an ``options=`` object is taken whole by either. The engines' unit
reads replay's options but not the selection (revisions, log_spaced, all_revisions, shard): that is the manifest's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..models.loading import DTYPES
from ..probe.config import PROTOCOLS, MonitorConfig
from .fetch import FetchConfig
from .plan import DEFAULT_BANDWIDTH_MB_S
from .revisions import Revision
from .workers import parse_shard

REPLAY, PLAN, UNIT = "replay", "plan", "unit"  # who reads an option (``only``), and who is given keywords
WANDB_MODES = ("offline", "online", "disabled")
SAME_AS_FIELD = object()  # the CLI's default is the field's


def _option(default: Any = None, help: str = "", *, only: str | None = None, flag: str | None = None, group: str | None = None,
            factory=None, cli_default: Any = SAME_AS_FIELD, **cli: Any):  # fmt: skip
    """A field of ``ReplayOptions``: its help, who reads it, its CLI flag (None: Python only), argparse group (``sinkwatch.cli.GROUPS``;
    "selection": mutually exclusive) and extras; ``cli_default``: the CLI's own default where it differs (the CLI derives the value)."""
    meta = {"help": help, "only": only, "flag": flag, "group": group, "cli": cli, "cli_default": cli_default}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _names(text: str) -> list[str] | None:
    return [r.strip() for r in text.split(",") if r.strip()] or None


@dataclass(frozen=True, kw_only=True)
class ReplayOptions:
    """How to replay a model (or a ``Recipe``): what to measure, where, and how to fetch it. None: the recipe's."""

    # ---- which revisions (the manifest records the selection; at most one of the three) ----
    revisions: Sequence[str | Revision] | None = _option(
        None, "comma-separated revisions (default: the recipe's, or every branch with a step in its name; main and tags only when named)",
        flag="--revisions", group="selection", type=_names,
    )  # fmt: skip
    log_spaced: int | None = _option(
        None, "replay ~N log-spaced revisions of those listed by the hub", flag="--log-spaced", group="selection", type=int
    )
    all_revisions: bool = _option(
        False, "every published revision of the model (every branch with a step: Pythia-1b's 154), not the recipe's list "
        "(the packaged recipes keep the paper's ten)", flag="--all-revisions", group="selection", action="store_true",
    )  # fmt: skip
    # ---- where and what ----
    out_dir: str | os.PathLike = _option("runs/replay", "store directory (the CLI's default: runs/NAME)", flag="--out", cli_default=None)
    probes: Sequence | None = _option(None, "probe recipes or probe sets (the CLI: --probe, --n, --seq-len, --vocab-range, --text, --bos)")
    dtype: str | None = _option(None, "weights dtype (default: the recipe's)", flag="--dtype", choices=tuple(DTYPES))
    device: str | None = _option(None, "cpu, cuda, cuda:1 ... (default: cuda if available)", flag="--device")
    shard: tuple[int, int] | str | None = _option(
        None, "K/N: this worker's stride of the manifest's tasks (every N-th from K), then what is still missing; torchrun's "
        "RANK/WORLD_SIZE and srun's SLURM_PROCID/SLURM_NTASKS give it without this option", flag="--shard",
    )  # fmt: skip
    cache_dir: str | None = _option(
        None, "a Hugging Face cache read before downloading, never written (offline replay: set HF_HUB_OFFLINE=1 and it is the "
        "only source)", flag="--cache-dir",
    )  # fmt: skip
    tokens_per_step: int | None = _option(
        None, "tokens per optimizer step, for revisions named by step only", flag="--tokens-per-step", type=int
    )
    batch_tokens: int | None = _option(
        None, "tokens per probe forward (lower it to save memory; the recipe's protocol stays)", flag="--batch-tokens", type=int
    )
    monitor_config: MonitorConfig | None = _option(None, "the Monitor's config (default: the recipe's batch_tokens, the protocol's)")
    protocol: str | None = _option(
        None, "paper: Xu 2026's exact precision choices (eager float16 attention for float16 models, PR on the first 500 "
        "sequences in float16); sinkwatch: float32 statistics, PR on every sequence (default: the recipe's; packaged recipes: "
        "paper). A probe or dtype option that changes a recipe's measurement labels the records protocol: custom (with what "
        "changed), and is refused with --protocol paper", flag="--protocol", choices=PROTOCOLS,
    )  # fmt: skip
    wandb: str = _option(
        "disabled", "log the replay to W&B on a tokens axis (the CLI's default: as WANDB_MODE says, else offline)",
        only=REPLAY, flag="--wandb", choices=WANDB_MODES, cli_default=None,
    )  # fmt: skip
    progress: bool | None = _option(
        None, "no progress bars (default: on for replay and --task, off for a Python engine task: its log is no terminal)",
        only=REPLAY, flag="--no-progress", action="store_const", const=False,
    )  # fmt: skip
    ablate: bool | None = _option(
        None, "group ablation of the >= 50x induction circuit at the ablation revision, into DIR/ablation.json "
        "(default: on under protocol paper when the recipe names an ablation revision, as the packaged recipes do)",
        only=REPLAY, flag="--ablate", action=argparse.BooleanOptionalAction,
    )  # fmt: skip
    ablation_revision: str | None = _option(
        None, "where to ablate (default: the recipe's; else the last revision)", flag="--ablation-revision"
    )
    # ---- a local run ----
    lightning_module: str | None = _option(
        None, "the LightningModule of a folder of Lightning .ckpt files (loaded with Class.load_from_checkpoint)",
        flag="--lightning-module", metavar="PKG.MODULE:CLASS",
    )  # fmt: skip
    live_store: str | None = _option(
        None, "the live run's store (its callback out_dir): the natural windows it froze, for save_pretrained folders "
        "(checkpoints with a trainer state carry them already)", flag="--live-store",
    )  # fmt: skip
    skip_duplicates: bool = _option(
        False, "do not measure revisions whose weight files are another revision's (flagged from the hub's metadata before any "
        "download); by default they are measured, flagged, and left out of the trajectory", flag="--skip-duplicates",
        action="store_true",
    )  # fmt: skip
    # ---- at scale ----
    fetch: FetchConfig = _option(
        help="retries, prefetch and the task folders (the CLI: --retries, --no-prefetch, --keep-cache, --cache-root)", factory=FetchConfig
    )  # fmt: skip
    max_memory: int | str | None = _option(
        None, "memory each device may use (24GiB, 500MB; default: what it has free): a revision that cannot fit is refused before "
        "download", flag="--max-memory", group="scale",
    )  # fmt: skip
    workers: int | None = _option(
        None, "how many workers will share the store (default: the launcher's)", only=PLAN, flag="--workers", group="scale", type=int
    )  # fmt: skip
    bandwidth_mb_s: float | None = _option(
        None, f"download MB/s per worker for the time estimate (default {DEFAULT_BANDWIDTH_MB_S:g})", only=PLAN, flag="--bandwidth",
        group="scale", type=float,
    )  # fmt: skip
    tflops: float | None = _option(
        None, "probe TFLOP/s for the time estimate (default: cpu 0.2, cuda 50)", only=PLAN, flag="--tflops", group="scale", type=float
    )  # fmt: skip
    rewrite_manifest: bool = _option(
        False, "update the plan: moved branches, rewritten checkpoints, more revisions (--log-spaced 16 after 8, --all-revisions); "
        "existing tasks keep their names and indices, new ones are appended; refused while a task runs",
        flag="--rewrite-manifest", group="engines", action="store_true",
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.revisions is not None:
            if isinstance(self.revisions, (str, bytes)) or not isinstance(self.revisions, Sequence):
                raise TypeError(f"revisions must be a list of revision names (or Revisions), got {self.revisions!r}")
            self._set("revisions", tuple(self.revisions))
            if self.all_revisions or self.log_spaced:
                raise ValueError("give revisions, or all_revisions / log_spaced (which choose among every published revision), not both")
        _check_int("log_spaced", self.log_spaced, "replay N log-spaced revisions; None: every listed revision")
        _check_int("tokens_per_step", self.tokens_per_step, "None: the recipe's, or the names' token counts")
        _check_int("batch_tokens", self.batch_tokens, "None: the recipe's")
        _check_int("workers", self.workers, "None: the launcher's")
        for name in ("bandwidth_mb_s", "tflops"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
                raise ValueError(f"{name} must be a number > 0 (None: the default estimate), got {v!r}")
        for name in ("all_revisions", "skip_duplicates", "rewrite_manifest"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("progress", "ablate"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True, False or None (the default), got {getattr(self, name)!r}")
        if self.probes is not None:
            if isinstance(self.probes, (str, bytes)) or not isinstance(self.probes, Sequence):
                raise TypeError(f"probes must be a list of probe recipes or probe sets, got {self.probes!r}")
            self._set("probes", tuple(self.probes))
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (None: the recipe's), got {self.dtype!r}")
        if self.protocol is not None and self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)} (None: the recipe's), got {self.protocol!r}")
        if self.wandb not in WANDB_MODES:
            raise ValueError(f"wandb must be one of {', '.join(WANDB_MODES)}, got {self.wandb!r}")
        if isinstance(self.shard, str):
            self._set("shard", parse_shard(self.shard))
        elif self.shard is not None:
            k, n = _pair(self.shard)
            if not 0 <= k < n:
                raise ValueError(f"shard must be (K, N) with 0 <= K < N, got {self.shard!r}")
            self._set("shard", (k, n))
        for name in ("out_dir", "cache_dir", "live_store"):
            v = getattr(self, name)
            if not (v is None and name != "out_dir") and not isinstance(v, (str, os.PathLike)):
                raise TypeError(f"{name} must be a path, got {v!r}")
        for name in ("device", "ablation_revision"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a string, got {getattr(self, name)!r}")
        if self.lightning_module is not None and (not isinstance(self.lightning_module, str) or ":" not in self.lightning_module):
            raise ValueError(f"lightning_module must be 'pkg.module:Class', got {self.lightning_module!r}")
        if self.max_memory is not None and (isinstance(self.max_memory, bool) or not isinstance(self.max_memory, (int, str))):
            raise TypeError(f"max_memory must be bytes (an int) or a size like '24GiB', got {self.max_memory!r}")
        if self.monitor_config is not None and not isinstance(self.monitor_config, MonitorConfig):
            raise TypeError(f"monitor_config must be a MonitorConfig, got {self.monitor_config!r}")
        if self.fetch is None:  # older callers' fetch=None: the defaults
            self._set("fetch", FetchConfig())
        elif not isinstance(self.fetch, FetchConfig):
            raise TypeError(f"fetch must be a FetchConfig, got {self.fetch!r}")

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: a value normalised in __post_init__, once

    def loop(self, *, progress: bool) -> dict[str, Any]:
        """What the measuring loop reads (``measure.Measurer``'s keywords); ``progress``: the caller's default
        when ``self.progress`` is None (replay: on; an engine's task: off)."""
        shown = progress if self.progress is None else self.progress
        return {"out_dir": self.out_dir, "device": self.device, "cache_dir": self.cache_dir, "wandb": self.wandb, "progress": shown,
                "fetch": self.fetch, "max_memory": self.max_memory}  # fmt: skip

    # ---- who gives them ----------------------------------------------------------------------------------
    @classmethod
    def given(cls, options: ReplayOptions | None, kwargs: dict[str, Any], *, reader: str, what: str) -> ReplayOptions:
        """``options`` (default: all defaults) with ``kwargs`` laid over it, as ``what`` (a function of ``reader``: replay, plan
        or unit) takes them; an unknown keyword, or one only the other command reads, is a TypeError naming the valid ones."""
        if options is not None and not isinstance(options, ReplayOptions):
            raise TypeError(f"{what}: options must be a ReplayOptions, got {type(options).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - set(fields))
        if unknown:
            raise TypeError(f"{what} got unknown option(s) {', '.join(unknown)}; the options of a replay are: {', '.join(fields)}")
        foreign = sorted(k for k in kwargs if fields[k].metadata["only"] not in (None, reader, *(() if reader != UNIT else (REPLAY,))))
        if foreign:
            readers = {REPLAY: "replay (sinkwatch replay)", PLAN: "replay_plan (sinkwatch replay --plan)"}
            which = [f"{k} (an option of {readers[fields[k].metadata['only']]})" for k in foreign]
            raise TypeError(f"{what} does not read {', '.join(which)}")
        base = options or cls()
        return dataclasses.replace(base, **kwargs) if kwargs else base


def _check_int(name: str, value, default: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be an int >= 1 ({default}), got {value!r}")


def _pair(shard) -> tuple[int, int]:
    if isinstance(shard, Sequence) and len(shard) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in shard):
        return shard[0], shard[1]
    raise TypeError(f"shard must be (K, N) or 'K/N', got {shard!r}")


__all__ = ["PLAN", "REPLAY", "UNIT", "ReplayOptions"]
