"""`sinkwatch probe` on a local save_pretrained directory."""

import json
import subprocess
import sys

import pytest
from tiny_models import build

from sinkwatch.cli import main
from sinkwatch.snapshot import RECORD_KEYS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, char_tokenizer):
    d = tmp_path_factory.mktemp("tiny_neox")
    build("gpt_neox").save_pretrained(d)
    char_tokenizer.save_pretrained(d)
    return d


def test_probe_writes_the_record_and_prints_a_summary(model_dir, tmp_path, capsys):
    """`sinkwatch probe` writes the full record and prints the summary."""
    text = tmp_path / "t.txt"
    text.write_text("In the beginning was the word, and the word was with code. " * 30)
    out = tmp_path / "rec.json"
    rc = main(
        [
            "probe",
            str(model_dir),
            "--probe",
            "induction,repeated,natural",
            "--n",
            "6",
            "--seq-len",
            "64",
            "--text",
            str(text),
            "--vocab-range",
            "100",
            "200",
            "--dtype",
            "float32",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "attention sinks" in printed and "induction heads" in printed and "prefix matching" in printed
    record = json.loads(out.read_text())
    missing = [k for k in RECORD_KEYS if k not in record]
    assert not missing, missing  # p0_stage / induction_state too (docs/design.md §10: the rules applied to this probe alone)
    assert (record["p0_stage"], record["induction_state"]) == (record["p0_stage_now"], record["induction_state_now"])
    assert record["probe"] == "natural+induction+repeated"
    assert record["n_layers"] == 2 and record["n_heads"] == 4
    assert record["p0_stage_now"] in ("none", "early", "transitional", "final")
    # where it ran (docs/design.md §10: every record, not only replay's): the versions, the device, the kernel
    assert {"sinkwatch", "torch", "transformers"} <= set(record["versions"]) and record["device"] == "cpu"
    assert record["stats_backend"] == "torch"


def test_probe_in_bfloat16(model_dir, tmp_path):
    """`sinkwatch probe --dtype bfloat16` gives a record with a valid sink rate."""
    out = tmp_path / "bf16.json"
    assert main(["probe", str(model_dir), "--n", "4", "--seq-len", "64", "--dtype", "bfloat16", "--out", str(out)]) == 0
    assert 0 <= json.loads(out.read_text())["sink_rate"] <= 1


def test_probe_errors_are_clear(model_dir, capsys):
    """Bad --seq-len, a natural probe without --text and a bad --vocab-range exit 2 with advice."""
    assert main(["probe", str(model_dir), "--seq-len", "512"]) == 2
    assert "context of 128" in capsys.readouterr().err
    assert main(["probe", str(model_dir), "--probe", "natural"]) == 2
    assert "--text" in capsys.readouterr().err
    assert main(["probe", str(model_dir), "--vocab-range", "100", "100000"]) == 2
    assert "HI <= 256" in capsys.readouterr().err


def test_console_entry_point(model_dir, tmp_path):
    """`python -m sinkwatch probe` runs end to end in a subprocess."""
    out = tmp_path / "r.json"
    res = subprocess.run(
        [sys.executable, "-m", "sinkwatch", "probe", str(model_dir), "--n", "4", "--seq-len", "64", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(out.read_text())["probe"] == "induction"
