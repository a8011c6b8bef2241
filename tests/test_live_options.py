"""The live core's decisions that both adapters share: options, W&B mode rules, which rank probes (docs/design.md §7)."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest
from tiny_models import build

from sinkwatch.distributed import rank_facts
from sinkwatch.live import LiveConfig, LiveMonitor
from sinkwatch.probes import InductionProbe
from sinkwatch.reporting.wandb_run import WANDB_MODES, wandb_reporter
from sinkwatch.stages import StageConfig


def _callbacks():
    from sinkwatch.hf import SinkWatchTrainerCallback
    from sinkwatch.lightning import SinkWatchCallback

    return SinkWatchCallback, SinkWatchTrainerCallback


def test_the_options_are_documented_once_in_live_config():
    """LiveConfig's Args section names every field (and the ``stages`` shortcut); no adapter repeats one of
    them as an Args entry of its own: each points at LiveConfig and says only what it does differently."""
    listed = set(re.findall(r"^\s{8}(\w+):", LiveConfig.__doc__, flags=re.M))
    assert listed == {f.name for f in fields(LiveConfig)} | {"stages"}
    from sinkwatch.fabric import SinkWatchFabricCallback
    from sinkwatch.megatron import SinkWatchMegatron
    from sinkwatch.olmo_core import SinkWatchCallback as OLMoCoreCallback

    for cls in (*_callbacks(), SinkWatchFabricCallback, OLMoCoreCallback, SinkWatchMegatron):
        assert "LiveConfig" in cls.__doc__, cls
        repeated = set(re.findall(r"^\s{8}(\w+):", cls.__doc__, flags=re.M)) & listed
        assert not repeated, (cls, repeated)


@pytest.mark.parametrize("which", [0, 1], ids=["lightning", "hf"])
def test_callback_takes_a_config_and_overrides(which):
    """``Callback(config, **overrides)``: the config's fields, replaced by the keywords (stages too)."""
    cls = _callbacks()[which]
    base = LiveConfig(every_n_steps=7, console=False, wandb="disabled")
    assert cls(base).config is base
    cb = cls(base, every_n_steps=3, stages=StageConfig(sink_rate_floor=0.2))
    assert (cb.config.every_n_steps, cb.config.console, cb.config.wandb) == (3, False, "disabled")
    assert cb.config.monitor.stages.sink_rate_floor == 0.2
    assert cls(every_n_steps=3).config == LiveConfig(every_n_steps=3)


@pytest.mark.parametrize("which", [0, 1], ids=["lightning", "hf"])
def test_callback_rejects_a_config_of_another_type(which):
    """A config that is not a LiveConfig is a TypeError that names the expected type."""
    with pytest.raises(TypeError, match="LiveConfig"):
        _callbacks()[which]({"every_n_steps": 3})


def test_hf_json_options_are_the_scalar_fields():
    """The options saved as JSON in TrainerState are exactly LiveConfig's scalar-typed fields."""
    from sinkwatch.hf import _JSON_OPTIONS

    assert _JSON_OPTIONS == (
        "every_n_steps", "log_spaced", "probe_at_start", "probe_at_end", "out_dir", "tokens_per_step", "natural", "natural_n",
        "natural_seq_len", "wandb", "wandb_project", "heatmap_every", "console", "raise_on_error",
        "preflight", "split_probe", "fault_timeout_s",
    )  # fmt: skip


def test_hf_state_saves_the_options_the_user_set():
    """state() carries the user's JSON-able options; with a config, all of its JSON-able fields."""
    from sinkwatch.hf import _JSON_OPTIONS, SinkWatchTrainerCallback

    cb = SinkWatchTrainerCallback(every_n_steps=3, probes=[InductionProbe(n=8, seq_len=64)], console=False)
    assert cb.state()["args"] == {"_restored": True, "every_n_steps": 3, "console": False}
    cfg = LiveConfig(every_n_steps=4)
    args = SinkWatchTrainerCallback(cfg).state()["args"]
    assert args == {"_restored": True, **{k: getattr(cfg, k) for k in _JSON_OPTIONS}}


def test_wandb_mode_rules(monkeypatch):
    """auto: the trainer's run, offline unless WANDB_MODE is set; online/offline: sinkwatch's mode; disabled: none."""
    pytest.importorskip("wandb")
    trainer_run = object()
    monkeypatch.delenv("WANDB_MODE", raising=False)
    auto = wandb_reporter("auto", trainer_run=trainer_run)
    assert (auto._given_run, auto.mode) == (trainer_run, "offline")
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_reporter("auto").mode == "auto"  # wandb.init without mode=: WANDB_MODE decides
    for mode in ("online", "offline"):
        r = wandb_reporter(mode, trainer_run=trainer_run)
        assert (r._given_run, r.mode) == (None, mode)
    assert wandb_reporter("disabled", trainer_run=trainer_run) is None
    with pytest.raises(ValueError, match="wandb must be one of"):
        wandb_reporter("sometimes")
    with pytest.raises(ValueError, match=re.escape(str(WANDB_MODES))):
        LiveConfig(wandb="sometimes")


def test_rank_facts_of_an_unsharded_model():
    """Without shards only global rank 0 probes and reports."""
    model = build("llama")
    zero, other = rank_facts(model, is_global_zero=True, world_size=2), rank_facts(model, is_global_zero=False, world_size=2)
    assert (zero.sharding, zero.probes_here, zero.reports_here) == (None, True, True)
    assert (other.probes_here, other.reports_here) == (False, False)


def test_setup_decides_which_rank_probes(tmp_path):
    """LiveMonitor.setup alone decides: a non-zero rank of an unsharded model never probes."""
    probes = [InductionProbe(n=8, seq_len=64)]
    for is_zero, n_probes in ((True, 1), (False, 0)):
        live = LiveMonitor(LiveConfig(out_dir=str(tmp_path / str(is_zero)), probes=probes, wandb="disabled", console=False))
        live.setup(build("llama"), is_global_zero=is_zero, world_size=2)
        live.step_end(0)
        assert (live.rank.probes_here, live.n_probes) == (is_zero, n_probes)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_split_probe_false_is_refused_only_under_tensor_parallelism(tmp_path, monkeypatch, tp_size):
    """split_probe=False: refused with tensor-parallel groups (their ranks must probe together), allowed for
    Megatron's data parallelism alone (TP size 1: rank 0 may probe every sequence alone)."""
    import sinkwatch.live.monitor as live_module
    from sinkwatch.distributed import TensorParallel

    class Reached(Exception):
        pass

    def reached(*_a, **_k):
        raise Reached

    monkeypatch.setattr(live_module, "check_layout", lambda *a, **k: None)  # the world of 2 x 2 ranks is not here
    monkeypatch.setattr(live_module.ProbeLayout, "of", reached)
    live = LiveMonitor(
        LiveConfig(out_dir=str(tmp_path), probes=[InductionProbe(n=8, seq_len=64)], wandb="disabled", console=False, split_probe=False)
    )
    tp = TensorParallel(None, 0, tp_size, 0, 2)
    if tp_size > 1:
        with pytest.raises(ValueError, match="split_probe=False cannot apply"):
            live.setup(build("llama"), is_global_zero=True, world_size=2, tensor_parallel=tp)
    else:
        with pytest.raises(Reached):
            live.setup(build("llama"), is_global_zero=True, world_size=2, tensor_parallel=tp)
