"""torchtitan 0.3.0 capture: on torchtitan's own debug models (llama3: MHA, the scale the layer
leaves to FlexAttention; qwen3: GQA, QK-norm, an explicit head_dim scale), built by its model registry,
every record key equals an independent float64 computation from explicit attention weights.

FlexAttention runs eagerly here (``flex_attention`` uncompiled, in both runs): its ``torch.compile``d
kernel takes ~45 s per shape to build on this CPU, and has no backward on CPU at all."""

import dataclasses
import math

import independent as ind
import numpy as np
import pytest
import torch

pytest.importorskip("torchtitan")

from sinkwatch import InductionProbe, Monitor, MonitorConfig, NaturalProbe, RepeatedRandomProbe  # noqa: E402
from sinkwatch.capture import TorchtitanTarget, UnsupportedModelError, resolve_target  # noqa: E402

PROB_ATOL, RATIO_RTOL, RATIO_ATOL, LOSS_ATOL = 2e-5, 1e-4, 1e-6, 1e-4


@pytest.fixture(autouse=True)
def eager_flex(monkeypatch):
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common.attention import FlexAttention

    monkeypatch.setattr(FlexAttention, "_compiled_flex_attn", staticmethod(flex_attention))


def debug_model(family: str, seed: int = 0, **shrink):
    if family == "llama3":
        from torchtitan.models.llama3 import model_registry
    else:
        from torchtitan.models.qwen3 import model_registry
    config = model_registry("debugmodel", attn_backend="flex").model
    config.layers = config.layers[:2]  # two of its layers: the same blocks, a shorter test
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()
    with torch.no_grad():  # sharper queries than the init: attention far from uniform, so the checks bite
        for layer in model.layers.values():
            for p in layer.attention.qkv_linear.parameters():
                p.mul_(4.0)
    return model.eval()


def eager_run(model, tokens: torch.Tensor) -> dict:
    """Attention (N, L, H, S, S) float64, block outputs, wo inputs, logits: an explicit causal softmax."""
    from torchtitan.models.common.attention import FlexAttention

    layers = [model.layers[k] for k in sorted(model.layers.keys(), key=int)]
    attn, resid, oproj = {}, {}, {}
    current = {}

    def explicit(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **kw):
        q, k, v = q.transpose(1, 2).double(), k.transpose(1, 2).double(), v.transpose(1, 2).double()  # (B, N, L, H)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        s = q @ k.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
        S = s.shape[-1]
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        p = torch.softmax(s, dim=-1)
        attn[current["layer"]] = p
        return (p @ v).float().transpose(1, 2)

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__("layer", i)))
        handles.append(layer.register_forward_hook(lambda m, a, o, i=i: resid.__setitem__(i, o.double())))
        handles.append(layer.attention.wo.register_forward_pre_hook(lambda m, a, i=i: oproj.__setitem__(i, a[0].double())))
    original = FlexAttention.forward
    FlexAttention.forward = explicit
    try:
        with torch.no_grad():
            B, S = tokens.shape
            logits = model(tokens, attention_masks=model.get_attention_masks(torch.arange(S).expand(B, S)))
    finally:
        FlexAttention.forward = original
        for h in handles:
            h.remove()
    L = len(layers)
    return {
        "attn": torch.stack([attn[i] for i in range(L)], dim=1).numpy(),
        "resid": torch.stack([resid[i] for i in range(L)], dim=1).numpy(),
        "oproj": torch.stack([oproj[i] for i in range(L)], dim=1).numpy(),
        "logits": logits.double().numpy(),
    }


def close(a, b, *, atol=0.0, rtol=0.0):
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    assert a.shape == b.shape, (a.shape, b.shape)
    np.testing.assert_allclose(a, b, atol=atol, rtol=rtol)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_torchtitan_debug_model_record_matches_float64(family):
    model = debug_model(family)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    probes = [
        InductionProbe(n=6, seq_len=64, vocab_range=(2, V)),
        RepeatedRandomProbe(n=4, seq_len=24, vocab_range=(2, V)),
        NaturalProbe(tokens=torch.randint(2, V, (2000,), generator=g), n=4, seq_len=32),
    ]
    monitor = Monitor(probes, config=MonitorConfig(batch_tokens=600))
    record = monitor.probe(model).to_record()
    assert record["model"] == f"torchtitan.{type(model).__name__}" and record["n_layers"] == 2
    sets = {s.kind: s for s in monitor.probe_sets(V)}

    nat = sets["natural"]
    run = eager_run(model, nat.tokens)
    close(record["sink_alpha"], ind.sink_metrics(run["attn"])["sink_alpha"], atol=PROB_ATOL)
    p0 = ind.p0_metrics(run["resid"], nat.tokens.numpy())
    close(record["p0_norm_ratio"], p0["p0_norm_ratio"], rtol=RATIO_RTOL)

    probe = sets["induction"]
    run = eager_run(model, probe.tokens)
    toks = probe.tokens.numpy()
    ab = np.array(
        [
            int(np.flatnonzero(toks[n, :-1] == probe.fields["token_b"][n])[0]) - 1
            if (toks[n, :-1] == probe.fields["token_b"][n]).sum() == 1
            else probe.fields["ab"][n]
            for n in range(len(toks))
        ]
    )
    sel = ind.selectivity_metrics(run["attn"], toks, ab, probe.fields["token_b"])
    for cls, expected in sel["selectivity"].items():
        close(record["selectivity"][cls], expected, rtol=RATIO_RTOL, atol=RATIO_ATOL)
    close(record["pr"], ind.participation_ratio(run["oproj"], record["n_heads"]), rtol=RATIO_RTOL)
    valid = sel["valid"]
    target = ind.target_metrics(run["logits"][valid, -1], probe.fields["token_b"][valid])
    assert record["induction_target"]["loss"] == pytest.approx(target["loss"], abs=LOSS_ATOL)

    rep = sets["repeated"]
    run = eager_run(model, rep.tokens)
    pm = ind.prefix_metrics(run["attn"], run["logits"], rep.tokens.numpy(), rep.params["half_len"])
    close(record["induction_score"], pm["induction_score"], atol=PROB_ATOL)
    assert record["icl_score"] == pytest.approx(pm["icl_score"], abs=LOSS_ATOL)


def test_other_torchtitan_models_are_refused_by_name():
    model = debug_model("llama3")
    assert isinstance(resolve_target(model), TorchtitanTarget)
    model.lm_head = None  # a pipeline stage without the output layer
    with pytest.raises(UnsupportedModelError, match="pipeline stage"):
        resolve_target(model)
    from torchtitan.models.common.decoder import Decoder

    other = type("DeepSeekV3Model", (Decoder,), {})  # the name is what is checked
    model.__class__ = other
    with pytest.raises(UnsupportedModelError, match="DeepSeekV3Model is not supported"):
        resolve_target(model)


def test_the_probe_reaches_the_logits_when_the_trainer_skips_lm_head():
    """With ChunkedLossWrapper (the stock debug configs' loss) the Trainer sets ``model._skip_lm_head`` and
    the forward returns hidden states; the probe turns it off for its own forwards only."""
    model = debug_model("llama3")
    V = model.config.vocab_size
    probes = [InductionProbe(n=4, seq_len=64, vocab_range=(2, V))]
    want = Monitor(probes).probe(model).to_record()
    model._skip_lm_head = True
    got = Monitor(probes).probe(model).to_record()
    assert model._skip_lm_head is True
    assert got["induction_target"]["loss"] == want["induction_target"]["loss"] and got["sink_alpha"] == want["sink_alpha"]


def test_the_context_is_the_rope_cache_the_trainer_sized():
    """Trainer's ``update_from_config`` sizes the RoPE cache to ``training.seq_len``: a longer probe is refused
    up front instead of failing inside the rotary embedding."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.training.seq_len = 48
    config.model_spec.model.layers = config.model_spec.model.layers[:1]
    config.model_spec.model.update_from_config(config=config)
    model = config.model_spec.model.build()
    model.init_states()
    assert resolve_target(model).context == 48
    with pytest.raises(ValueError, match="context of 48"):
        Monitor([InductionProbe(n=2, seq_len=64, vocab_range=(2, 100))]).probe(model)


@pytest.fixture
def trainer_module():
    import sinkwatch.torchtitan

    return sinkwatch.torchtitan


def _stand_in_trainer(tmp_path, steps: int, every: int):
    """torchtitan's own unit-test pattern (tests/unit_tests/test_invalid_loss.py): a bare Trainer with only
    what train_step touches; here the real debug model and its real config, forward_backward_step
    standing in for the real one (FlexAttention has no backward on CPU) but calling the real
    post_dataloading_process first, as it does."""
    from unittest.mock import MagicMock

    from torchtitan.models.llama3 import model_registry

    from sinkwatch.torchtitan import SinkWatchOptions, SinkWatchTrainer

    trainer = object.__new__(SinkWatchTrainer)
    model = debug_model("llama3")
    trainer.model_parts = [model]
    trainer.model_config = model_registry("debugmodel", attn_backend="flex").model
    trainer.optimizers = MagicMock()
    trainer.lr_schedulers = MagicMock()
    trainer.lr_schedulers.get_metrics.return_value = {}
    trainer.checkpointer = MagicMock()
    trainer.config = MagicMock()
    trainer.config.training.max_norm = 1.0
    trainer.config.training.steps = steps
    trainer.config.parallelism.spmd_backend = "none"
    trainer.config.sinkwatch = SinkWatchOptions(every_n_steps=every, out_dir=str(tmp_path / "sw"), wandb="disabled", console=False)
    trainer.device = torch.device("cpu")
    trainer.gradient_accumulation_steps = 1
    trainer.num_pipeline_parallel_microbatches = 1
    trainer.step = 0
    trainer.ntokens_seen = 0
    pd = MagicMock()
    pd.dp_enabled = pd.pp_enabled = pd.cp_enabled = pd.tp_enabled = pd.dp_cp_enabled = pd.ep_enabled = False
    pd.dp_replicate = pd.dp_shard = 1
    pd.get_optional_mesh.return_value = None
    trainer.parallel_dims = pd
    trainer.metrics_processor = MagicMock()
    trainer.metrics_processor.should_log.return_value = False

    def forward_backward_step(*, input_dict, labels, global_valid_tokens):
        inputs, labels, extra = trainer.post_dataloading_process(input_dict, labels)
        assert "attention_masks" in extra  # built from positions, as in training
        return torch.tensor(1.0)

    trainer.forward_backward_step = forward_backward_step
    # the default probe sets but smaller (eager FlexAttention on CPU is slow); natural windows from the batches
    V = model.config.vocab_size
    small = [InductionProbe(n=6, seq_len=64, vocab_range=(2, V)), RepeatedRandomProbe(n=4, seq_len=32, vocab_range=(2, V))]
    live = dataclasses.replace(trainer.config.sinkwatch.live_config(), probes=None)
    trainer.sinkwatch_setup(live)
    trainer.sinkwatch._build_monitor = lambda: Monitor([*small, trainer.sinkwatch.natural], config=live.monitor)
    return trainer, model


def _batches(V, B=2, L=64):
    g = torch.Generator().manual_seed(5)
    while True:
        ids = torch.randint(2, V, (B, L + 1), generator=g)
        yield {"input": ids[:, :-1], "positions": torch.arange(L).expand(B, L)}, ids[:, 1:]


def test_sinkwatch_trainer_train_step_with_torchtitan_stand_ins(tmp_path, trainer_module):
    """Probes at 0 (the first batch, before its forward), every 2 steps and the last; scalars through
    metrics_processor.logger at those steps; tokens counted from post_dataloading_process; no hook left
    on the model after a probe; records equal a direct probe of the same (unchanged) weights."""
    from unittest.mock import MagicMock, patch

    from sinkwatch.reporting.jsonl import read_jsonl

    trainer, model = _stand_in_trainer(tmp_path, steps=3, every=2)
    data = _batches(model.config.vocab_size)
    clip = patch("torchtitan.trainer.dist_utils.clip_grad_norm_", return_value=torch.tensor(1.0))
    with patch("torchtitan.trainer.sl", MagicMock()), clip:
        for step in (1, 2, 3):
            trainer.step = step
            trainer.train_step(data)
    records = read_jsonl(tmp_path / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, 2, 3]
    assert [r["tokens"] for r in records] == [0, 2 * 128, 3 * 128]
    assert set(records[0]["probe_hashes"]) == {"induction", "repeated", "natural"}
    logged = [(c.args[1], c.args[0]) for c in trainer.metrics_processor.logger.log.call_args_list]
    assert [s for s, _ in logged] == [0, 2, 3] and all("sinkwatch/sink_rate" in m for _, m in logged)
    assert all(not layer.attention.inner_attention._forward_hooks for layer in model.layers.values())
    assert records[0]["sink_alpha"] == records[-1]["sink_alpha"]  # the optimizer is a stand-in: same weights, same record


def test_sinkwatch_trainer_refuses_pipeline_and_context_parallelism(tmp_path, trainer_module):
    """Pipeline and context parallelism are refused with the reason (tensor parallelism runs, with and without
    sequence parallelism: tests/test_torchtitan_fsdp.py), and tensor parallelism outside the partial_dtensor backend."""
    from sinkwatch.torchtitan import SinkWatchTrainer

    trainer, _ = _stand_in_trainer(tmp_path, steps=1, every=1)
    refusals = (("pp", "pipeline parallelism .a rank does not hold every layer"), ("cp", "context parallelism .a rank holds a slice"))
    for kind, why in refusals:
        setattr(trainer.parallel_dims, f"{kind}_enabled", True)
        with pytest.raises(ValueError, match=why):
            SinkWatchTrainer.sinkwatch_setup(trainer)
        setattr(trainer.parallel_dims, f"{kind}_enabled", False)
    # tensor parallelism on the spmd_types backend (torchtitan's default; it cannot build a model on CPU with torch 2.13):
    # plain local tensors whose layout sinkwatch cannot read
    trainer.parallel_dims.tp_enabled = True
    trainer.config.parallelism.spmd_backend = "spmd_types"
    with pytest.raises(ValueError, match="spmd_backend='partial_dtensor' only"):
        SinkWatchTrainer.sinkwatch_setup(trainer)
    trainer.parallel_dims.tp_enabled = False


def test_module_flag_through_torchtitans_config_manager(capsys, tmp_path):
    """``--module sinkwatch.torchtitan --config <a llama3/qwen3 config of torchtitan's>``, parsed by torchtitan's own
    ConfigManager (what ``python -m torchtitan.train`` runs): the stock config as a SinkWatchTrainer.Config, whose
    ``build()`` (train.py's next call) constructs a SinkWatchTrainer, with every sinkwatch option settable."""
    import dataclasses

    from torchtitan.config import ConfigManager
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from sinkwatch.torchtitan import SinkWatchOptions, SinkWatchTrainer

    def parse(*args: str):
        return ConfigManager().parse_args(["--module", "sinkwatch.torchtitan", *args])

    config = parse(
        "--config", "llama3_debugmodel", "--training.steps", "5", "--sinkwatch.every_n_steps", "7", "--sinkwatch.log_spaced", "20",
        "--sinkwatch.no-probe-at-start", "--sinkwatch.no-probe-at-end", "--sinkwatch.out_dir", str(tmp_path), "--sinkwatch.no-natural",
        "--sinkwatch.wandb", "offline", "--sinkwatch.no-console", "--sinkwatch.raise-on-error",
    )  # fmt: skip
    assert type(config) is SinkWatchTrainer.Config and type(config)._owner is SinkWatchTrainer
    assert type(dataclasses.replace(config)) is SinkWatchTrainer.Config  # build() = _owner(config=replace(self))
    assert config.sinkwatch == SinkWatchOptions(
        every_n_steps=7, log_spaced=20, probe_at_start=False, probe_at_end=False, out_dir=str(tmp_path), natural=False, wandb="offline",
        console=False, raise_on_error=True,
    )  # fmt: skip
    stock = llama3_debugmodel()
    assert config.training.steps == 5 and config.model_spec.name == "llama3" and config.model_spec.flavor == stock.model_spec.flavor
    assert type(config.loss) is type(stock.loss) and config.optimizer == stock.optimizer and config.parallelism == stock.parallelism

    qwen = parse("--config", "qwen3_debugmodel")
    assert type(qwen) is SinkWatchTrainer.Config and qwen.model_spec.name == "qwen3" and qwen.sinkwatch == SinkWatchOptions()

    with pytest.raises(SystemExit):  # checked at parse time, before any GPU is touched
        parse("--config", "llama3_debugmodel", "--sinkwatch.every_n_steps", "0")
    assert "every_n_steps must be None or a positive int" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--config", "llama3_debugmodel", "--sinkwatch.wandb", "sometimes")
    with pytest.raises(ValueError, match="llama3_debugmodel"):  # an unknown name: the error lists what there is
        parse("--config", "llama3_nope")
