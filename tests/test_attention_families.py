"""Learned sinks, soft-capping, gated attention and hybrid stacks, probed by `sinkwatch probe` (docs/design.md §2).

For each family of tests/families.py built there (gpt-oss, Gemma 2, Qwen3-Next, Jamba, Bamba,
Zamba2, Falcon-H1), a tiny random model with its feature made to matter is saved with
``save_pretrained`` and probed by the CLI on that folder. Every per-head statistic of the record
equals one computed in float64 from the model's own eager attention (``output_attentions=True`` on
a float64 copy), re-derived by tests/independent.py; blocks without softmax attention are null.

gpt-oss's eager attention returns the probabilities of the keys with the sink column dropped
*after* the softmax: each row sums to 1 minus the sink's share, which is what sinkwatch reports
beside them (``sink_learned_alpha``).
"""

from __future__ import annotations

import copy
import json

import independent as ind
import numpy as np
import pytest
import torch
from families import BUILT_HERE, FAMILIES, VOCAB, build

from sinkwatch import Monitor, StageTracker
from sinkwatch.capture import UnsupportedModelError
from sinkwatch.cli import main
from sinkwatch.hf import SinkWatchTrainerCallback
from sinkwatch.probes import InductionProbe, NaturalProbe, RepeatedRandomProbe
from sinkwatch.reporting.jsonl import read_jsonl

# Named tolerances: sinkwatch's float32 statistics of the float32 model vs eager attention of its
# float64 copy (the difference is the float32 forward's own rounding)
PROB_ATOL = 2e-5  # attention probabilities and their means
RATIO_RTOL = 1e-4  # selectivity, PR, norm ratios: ratios of float32 means
RATIO_ATOL = 1e-6  # ... near-zero cells
GATE_ATOL = 1e-6  # mean gates: sigmoid in float32 vs float64
LOSS_ATOL = 1e-4  # ICL score (nats)
N, T = 6, 64  # sequences per probe, tokens per sequence (the repeated probe: two copies of 32)
TEXT = (
    "Sinks form when heads need somewhere to put attention they do not want to spend. A learned sink logit gives them "
    "one outside the sequence; a gate lets them write nothing at all; a recurrent block sees position zero alone too. "
    "Which of these a model uses decides whether position zero still becomes the anchor of later heads. "
) * 6


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "natural.txt"
    path.write_text(TEXT)
    return path


def probe_sets(text_file, tokenizer) -> dict:
    """The probe sets `sinkwatch probe --probe induction,repeated,natural --n N --seq-len T` builds."""
    recipes = [InductionProbe(n=N, seq_len=T), RepeatedRandomProbe(n=N, seq_len=T)]
    recipes.append(NaturalProbe(text_file=str(text_file), tokenizer=tokenizer, n=N, seq_len=T))
    return {r.kind: r.build(VOCAB) for r in recipes}


def probe_with_cli(name, tmp_path_factory, char_tokenizer, text_file) -> tuple[torch.nn.Module, dict]:
    """Build, save and probe one family through `sinkwatch probe` (several micro-batches per probe)."""
    model = build(name)
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder)
    char_tokenizer.save_pretrained(folder)
    out = folder / "record.json"
    argv = ["probe", str(folder), "--probe", "induction,repeated,natural", "--n", str(N), "--seq-len", str(T)]
    argv += ["--text", str(text_file), "--dtype", "float32", "--batch-tokens", str(3 * T), "--out", str(out)]
    assert main(argv) == 0
    return model, json.loads(out.read_text())


# ---- the independent side: eager attention of a float64 copy --------------------------------------
def eager64(model, name: str, tokens: torch.Tensor) -> dict:
    """Attention (N, Ls, H, S, S) of the softmax blocks, block outputs (N, L, S, d), output-projection
    inputs (N, Ls, S, H*D), gates (N, Ls, S, H, D) for gated attention, logits; all float64."""
    family = FAMILIES[name]
    m = copy.deepcopy(model).double()
    m.set_attn_implementation("eager")
    if hasattr(m, "set_experts_implementation"):
        m.set_experts_implementation("eager")  # the grouped-mm experts refuse float64
    blocks = ind.blocks_of(m)
    softmax = family.softmax_layers or tuple(range(len(blocks)))
    resid, oproj, gates = {}, {}, {}
    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_hook(lambda mod, a, o, i=i: resid.__setitem__(i, (o[0] if isinstance(o, tuple) else o))))
        if i not in softmax:
            continue
        attention = block.get_submodule(family.attention)
        handles.append(attention.o_proj.register_forward_pre_hook(lambda mod, a, i=i: oproj.__setitem__(i, a[0])))
        if family.gated:  # Qwen3-Next: q_proj yields [query | gate] per head; the gate is its sigmoid
            D = attention.head_dim

            def read_gate(mod, a, o, i=i, D=D):
                gates[i] = torch.sigmoid(o.view(*o.shape[:2], -1, 2 * D)[..., D:])

            handles.append(attention.q_proj.register_forward_hook(read_gate))
    try:
        with torch.no_grad():
            out = m(input_ids=tokens, output_attentions=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    assert len(out.attentions) == len(softmax)  # one per softmax block, in block order
    return {
        "softmax": softmax,
        "attn": torch.stack(out.attentions, dim=1).numpy(),
        "resid": torch.stack([resid[i] for i in range(len(blocks))], dim=1).numpy(),
        "oproj": torch.stack([oproj[i] for i in softmax], dim=1).numpy(),
        "gate": torch.stack([gates[i] for i in softmax], dim=1).numpy() if family.gated else None,
        "logits": out.logits.numpy(),
    }


def xlogx(p: np.ndarray) -> np.ndarray:
    return np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)


def close(a, b, *, atol=0.0, rtol=0.0):
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    assert a.shape == b.shape, (a.shape, b.shape)
    np.testing.assert_allclose(a, b, atol=atol, rtol=rtol)


def rows(record_value, softmax):
    """The softmax blocks' rows of an [L] or [L][H] record array."""
    return [record_value[l] for l in softmax]


def check_nulls(record, softmax):
    """Blocks without softmax attention are null in every attention-derived array, and only there."""
    L = record["n_layers"]
    others = [l for l in range(L) if l not in softmax]
    per_head = ["sink_alpha", "pr", "induction_score", "attention_entropy", "best_class"]
    per_head += [f"selectivity.{c}" for c in record["selectivity"]]
    per_head += [k for k in ("sink_learned_alpha", "attn_gate_mean") if k in record]
    for key in per_head:
        value = record["selectivity"][key.split(".")[1]] if key.startswith("selectivity.") else record[key]
        assert len(value) == L, key
        for l in range(L):
            if l in others:
                assert value[l] == [None] * record["n_heads"], (key, l)
            else:
                assert all(v is not None for v in value[l]), (key, l)
    for key in ("sink_rate_per_layer", "sink_heads_per_layer"):
        assert [l for l, v in enumerate(record[key]) if v is None] == others, key
    for key in ("p0_norm_ratio", "p0_direction_consistency"):  # residual stream: every block
        assert len(record[key]) == L and all(v is not None for v in record[key]), key


def check_record(name, model, record, text_file, tokenizer):
    family = FAMILIES[name]
    softmax = list(family.softmax_layers or range(model.config.num_hidden_layers))
    assert record["softmax_layers"] == softmax
    assert record["n_layers"] == model.config.num_hidden_layers and record["n_heads"] == model.config.num_attention_heads
    sets = probe_sets(text_file, tokenizer)
    assert record["probe_hashes"] == {k: s.hash for k, s in sets.items()}  # the CLI probed exactly these tokens
    check_nulls(record, softmax)
    H = record["n_heads"]

    # --- sinks (learned ones too), gates and the P0 circuit, from the natural probe
    nat = sets["natural"]
    run = eager64(model, name, nat.tokens)
    sinks = ind.sink_metrics(run["attn"])
    close(rows(record["sink_alpha"], softmax), sinks["sink_alpha"], atol=PROB_ATOL)
    assert record["sink_rate"] == pytest.approx(sinks["sink_rate"])
    close(record["sink_profile"], sinks["sink_profile"])
    close(rows(record["sink_rate_per_layer"], softmax), sinks["sink_rate_per_layer"])
    assert record["sink_center"] == sinks["sink_center"]
    if family.sinks:
        learned = 1.0 - run["attn"].sum(-1)  # (N, Ls, H, S): the sink's share of every row
        close(rows(record["sink_learned_alpha"], softmax), learned.mean(-1).mean(0), atol=PROB_ATOL)
        assert record["sink_learned_rate"] == pytest.approx(float((learned.mean(-1) > 0.3).mean()))
    else:
        assert "sink_learned_alpha" not in record and "sink_learned_rate" not in record
    if family.gated:
        close(rows(record["attn_gate_mean"], softmax), run["gate"].mean(axis=(2, 4)).mean(0), atol=GATE_ATOL)
    else:
        assert "attn_gate_mean" not in record
    p0 = ind.p0_metrics(run["resid"], nat.tokens.numpy())
    close(record["p0_norm_ratio"], p0["p0_norm_ratio"], rtol=RATIO_RTOL)
    close(record["p0_direction_consistency"], p0["p0_direction_consistency"], atol=1e-5)

    # --- selectivity screen, entropy and PR (after the gate), from the induction probe
    probe = sets["induction"]
    run = eager64(model, name, probe.tokens)
    toks = probe.tokens.numpy()
    token_b = probe.fields["token_b"]
    once = [(toks[n, :-1] == token_b[n]).sum() == 1 for n in range(len(toks))]
    ab = np.array([int(np.flatnonzero(toks[n, :-1] == token_b[n])[0]) - 1 if once[n] else probe.fields["ab"][n] for n in range(len(toks))])
    sel = ind.selectivity_metrics(run["attn"], toks, ab, token_b)
    for cls, expected in sel["selectivity"].items():
        close(rows(record["selectivity"][cls], softmax), expected, rtol=RATIO_RTOL, atol=RATIO_ATOL)
    assert np.array_equal(np.array(rows(record["best_class"], softmax), dtype=object), sel["best_class"])
    assert [n for n in record["sink_heads_per_layer"] if n is not None] == sel["sink_heads_per_layer"]
    # fractions over the softmax heads, head names with their real block index
    assert record["bos_fraction_raw"] == pytest.approx(sel["bos_fraction_raw"])
    assert record["bos_fraction_bestclass"] == pytest.approx(sel["bos_fraction_bestclass"])
    assert record["induction_heads"] == [f"L{softmax[int(h[1:].split('H')[0])]}H{h.split('H')[1]}" for h in sel["induction_heads"]]
    assert (record["n_induction_ge30"], record["n_induction_ge50"]) == (sel["n_induction_ge30"], sel["n_induction_ge50"])
    row = run["attn"][:, :, :, T - 1, :]  # (N, Ls, H, T): the query row
    rest = np.clip(1.0 - row.sum(-1), 0.0, None)  # the learned sink's share (0 without one)
    entropy = -(xlogx(row).sum(-1) + xlogx(rest))  # over the keys and the learned sink
    close(rows(record["attention_entropy"], softmax), entropy.mean(0), atol=10 * PROB_ATOL)
    close(rows(record["pr"], softmax), ind.participation_ratio(run["oproj"], H), rtol=RATIO_RTOL)

    # --- prefix matching and ICL, from the repeated-random probe
    rep = sets["repeated"]
    run = eager64(model, name, rep.tokens)
    pm = ind.prefix_metrics(run["attn"], run["logits"], rep.tokens.numpy(), rep.params["half_len"])
    close(rows(record["induction_score"], softmax), pm["induction_score"], atol=PROB_ATOL)
    assert record["icl_score"] == pytest.approx(pm["icl_score"], abs=LOSS_ATOL)


@pytest.mark.parametrize("name", BUILT_HERE)
def test_cli_record_equals_float64_eager(name, tmp_path_factory, char_tokenizer, text_file):
    """`sinkwatch probe` on a saved tiny model: every per-head statistic equals float64 eager attention's;
    blocks without softmax attention are null; counts and fractions are over the softmax heads."""
    model, record = probe_with_cli(name, tmp_path_factory, char_tokenizer, text_file)
    check_record(name, model, record, text_file, char_tokenizer)
    check_feature_matters(name, model, record)


def check_feature_matters(name, model, record):
    """Each family's feature changes the numbers: a probe that ignored it would be far off."""
    family = FAMILIES[name]
    if family.sinks:  # heads whose learned sink takes a third of every row or more
        assert max(max(row) for row in record["sink_learned_alpha"]) > 0.3
    if family.gated:  # gates spread over (0, 1): PR before the gate would weigh dims differently
        gates = [g for row in record["attn_gate_mean"] if row[0] is not None for g in row]
        assert min(gates) < 0.25 and max(gates) > 0.75, gates
    if name == "gemma2":  # soft-capping at 1.0 flattens rows that the sharpened queries make peaked
        ids = torch.randint(2, VOCAB, (2, T), generator=torch.Generator().manual_seed(0))
        m = copy.deepcopy(model)
        m.set_attn_implementation("eager")
        with torch.no_grad():
            capped = m(input_ids=ids, output_attentions=True, use_cache=False).attentions
            for layer in m.model.layers:
                layer.self_attn.attn_logit_softcapping = None
            uncapped = m(input_ids=ids, output_attentions=True, use_cache=False).attentions
        assert max(float((a - b).abs().max()) for a, b in zip(capped, uncapped)) > 0.5


def test_a_live_gpt_oss_in_eager_attention_is_probed_with_its_sinks():
    """A gpt-oss model as a live run holds it (eager attention, in memory): the sink logit joins every
    denominator, so the first-class selectivity and alpha_0 equal eager attention's (which drops the
    sink column only after its softmax)."""
    model = build("gpt_oss")
    assert model.config._attn_implementation == "eager"
    monitor = Monitor([InductionProbe(n=N, seq_len=T)])
    record = monitor.probe(model).to_record()
    probe = monitor.probe_sets(VOCAB)[0]
    run = eager64(model, "gpt_oss", probe.tokens)
    close(record["sink_alpha"], ind.sink_metrics(run["attn"])["sink_alpha"], atol=PROB_ATOL)
    sel = ind.selectivity_metrics(run["attn"], probe.tokens.numpy(), probe.fields["ab"], probe.fields["token_b"])
    close(record["selectivity"]["first"], sel["selectivity"]["first"], rtol=RATIO_RTOL, atol=RATIO_ATOL)


def test_one_attention_module_run_in_several_blocks():
    """Zamba(2)'s shared transformer: one attention module object run by blocks 1 and 3 (the same
    computation as the tied copies a checkpoint loads). Calls map to the block they run in, so the
    record equals the tied-copies model's, with blocks 0 and 2 null."""
    tied = build("zamba2")
    shared = copy.deepcopy(tied)
    layers = shared.model.layers
    layers[3].shared_transformer = layers[1].shared_transformer  # weights were tied: same numbers
    probes = [InductionProbe(n=3, seq_len=T)]
    a = Monitor(probes).probe(shared).to_record()
    b = Monitor(probes).probe(tied).to_record()
    assert a["softmax_layers"] == b["softmax_layers"] == [1, 3]
    for key in ("sink_alpha", "pr", "p0_norm_ratio"):
        close(np.asarray(a[key], dtype=float), np.asarray(b[key], dtype=float), atol=1e-6, rtol=1e-5)
    assert a["sink_alpha"][0] == [None] * a["n_heads"]


def test_an_attention_that_bypasses_sinkwatch_in_one_block_is_refused():
    """A block holding the same attention class as the softmax blocks but whose call never reaches
    sinkwatch is named, never silently reported as a null row."""
    model = build("jamba")
    attention = model.model.layers[3].self_attn
    original = attention.forward

    def bypass(hidden_states, *args, **kwargs):  # sdpa straight from torch, around AttentionInterface
        saved = attention.config._attn_implementation
        attention.config._attn_implementation = "sdpa"
        try:
            return original(hidden_states, *args, **kwargs)
        finally:
            attention.config._attn_implementation = saved

    attention.forward = bypass
    with pytest.raises(UnsupportedModelError, match=r"block 3 holds a JambaAttention like blocks \[1\]"):
        Monitor([InductionProbe(n=2, seq_len=T)]).probe(model)


def hf_run(tmp_path, name: str, with_callback: bool) -> tuple[list, dict]:
    """4 optimizer steps of the HF Trainer on the copy task (context 64); the callback at its defaults
    (the default probes: induction 100 x 64, repeated 32 x 64, natural windows from the first batch)
    but every 2 steps, no W&B, no console."""
    from train_helpers import CopyDataset
    from transformers import Trainer, TrainingArguments

    model = build(name, max_position_embeddings=T).train()
    # the default grouped-mm experts' backward is not deterministic on CPU (two plain gpt-oss runs
    # differ in the experts' bias by 5e-10); the eager experts are, so any difference is the callback's
    model.set_experts_implementation("eager")
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=4, learning_rate=3e-3, use_cpu=True,
        report_to=[], save_strategy="no", logging_steps=1, seed=11, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    callback = SinkWatchTrainerCallback(every_n_steps=2, out_dir=str(tmp_path / "sw"), wandb="disabled", console=False)
    cbs = [callback] if with_callback else []
    trainer = Trainer(model=model, args=args, train_dataset=CopyDataset(n=64, half=T // 2), callbacks=cbs)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_next"])
def test_hf_training_is_bit_identical_with_the_callback(name, tmp_path):
    """A tiny gpt-oss (learned sinks, eager attention) and a tiny Qwen3-Next (hybrid, gated) train
    bit-identically with and without the callback at its defaults, which records every 2 steps."""
    la, pa = hf_run(tmp_path / "plain", name, False)
    lb, pb = hf_run(tmp_path / "watched", name, True)
    assert la == lb and len(la) == 4
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n
    records = read_jsonl(tmp_path / "watched" / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, 2, 4]
    assert all("error" not in r for r in records)
    assert records[0]["probe"] == "natural+induction+repeated"
    family = FAMILIES[name]
    for r in records:
        assert r["softmax_layers"] == list(family.softmax_layers or range(r["n_layers"]))
        assert ("sink_learned_alpha" in r) == family.sinks and ("attn_gate_mean" in r) == family.gated


def test_a_hybrid_record_survives_every_consumer(tmp_path):
    """Null rows of a hybrid stack (Jamba: softmax in blocks 1 and 3) go through the stage tracker,
    the JSONL, the console lines, the W&B scalars, heatmaps and head-class table, `sinkwatch report`,
    the findings and group ablation; counts are over the softmax heads and nothing reads a null as a fault."""
    import wandb

    from sinkwatch import findings
    from sinkwatch.monitor import has_non_finite
    from sinkwatch.records import head_class_rows, n_sink_heads, softmax_heads
    from sinkwatch.report import build_report
    from sinkwatch.reporting.console import one_line, summary
    from sinkwatch.reporting.figures import close as close_figures
    from sinkwatch.reporting.figures import record_heatmaps
    from sinkwatch.reporting.jsonl import JSONLReporter
    from sinkwatch.reporting.wandb_run import scalars

    model = build("jamba")
    natural = NaturalProbe(tokens=torch.randint(2, VOCAB, (1000,), generator=torch.Generator().manual_seed(1)), n=4, seq_len=40)
    monitor = Monitor([InductionProbe(n=4, seq_len=T), RepeatedRandomProbe(n=2, seq_len=32), natural])
    jsonl = JSONLReporter(tmp_path / "store")
    snap = monitor.probe(model, step=0, tokens=0)
    assert not has_non_finite(snap.values)  # null rows are not NaN activations
    tracker = StageTracker(monitor.config.stages)
    first = snap.to_record()
    tracker.update(first)  # the tracker consumes the record
    jsonl.log_record(first)  # JSON without NaN: nulls
    later = {**first, "step": 10, "tokens": 2560}  # a second probe of the same weights
    tracker.update(later)
    jsonl.log_record(later)
    records = read_jsonl(tmp_path / "store" / "records.jsonl")
    assert [r["step"] for r in records] == [0, 10] and records[-1]["softmax_layers"] == [1, 3]
    record = records[-1]
    assert record["p0_stage"] in ("none", "early", "transitional", "final")
    assert softmax_heads(record) == 8 and n_sink_heads(record) == sum(n for n in record["sink_heads_per_layer"] if n is not None)
    assert "sink heads" in summary(record) and "softmax attention in blocks [1, 3]" in summary(record) and "sinkwatch:" in one_line(record)
    flat = scalars(record)
    assert "sinkwatch/sink_rate_per_layer/L1" in flat and "sinkwatch/sink_rate_per_layer/L0" not in flat
    assert "sinkwatch/p0_norm_ratio/L0" in flat  # the residual stream is per block
    figures = record_heatmaps(record)
    images = [wandb.Image(f) for f in figures.values()]
    close_figures(figures)
    rows = head_class_rows(record)
    table = wandb.Table(columns=["layer", "head", "best_class", *record["selectivity"]], data=rows)
    assert len(images) == 3 and {r[0] for r in rows} == {1, 3} and len(table.data) == 8
    trajectory = findings.trajectory_from_records(records)
    assert trajectory.total_heads == 8 and findings.l0_l1_floor(trajectory) in (True, False)
    # group ablation: a softmax block's head works; a Mamba block's head is refused (zeroing it there
    # would silently change nothing)
    result = monitor.ablate(model, ["L1H0"])
    assert result["heads"] == ["L1H0"] and result["control_heads"][0].startswith("L1H")
    with pytest.raises(ValueError, match=r"block 0 has no softmax attention \(softmax blocks: \[1, 3\]\)"):
        monitor.ablate(model, ["L0H1"])
    report = build_report([tmp_path / "store"], tmp_path / "report")
    text = report.read_text()
    assert "| 10 | 2.56K |" in text and "final_sink_fraction" in text and "heatmap_0_step10_sink_alpha.png" in text
    assert (report.parent / "final_sink_heads_per_layer.png").exists()  # null blocks: no bar

