"""One store per run: a fresh start moves an earlier run's store aside, a resume
keeps appending, and ``sinkwatch report`` draws each run and each ``config_hash`` as its own series.

Through the real trainers, each at its own moment of loading callback state: Lightning restores it
before ``on_fit_start`` (single device), the HF callback applies it in ``on_train_begin`` after
setup, OLMo-core loads it before ``pre_train``. The JSONL store decides fresh-or-resume at its first
line, after all of those.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
from tiny_models import build
from train_helpers import CopyDataset, LitLM, loader, trainer

from sinkwatch import InductionProbe
from sinkwatch.report import Store, build_report
from sinkwatch.reporting.jsonl import read_jsonl

PROBES = [InductionProbe(n=4, seq_len=64)]
OTHER_PROBES = [InductionProbe(n=6, seq_len=64)]  # a resume with other probes: a new config_hash
COMMON = dict(every_n_steps=2, wandb="disabled", console=False)
EARLIER_RUNS = "earlier-runs"  # docs/live.md: where a fresh start moves an earlier run's store


def steps(path: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(path)]


def moved_aside(out: Path) -> list[Path]:
    return sorted((out / EARLIER_RUNS).glob("*")) if (out / EARLIER_RUNS).exists() else []


def moved_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "held the records of an earlier run" in str(w.message)]


def report_series(md: str) -> dict[str, list[str]]:
    """The report read back: each section's trajectory table, first column (step or revision)."""
    series: dict[str, list[str]] = {}
    for block in re.split(r"^## ", md, flags=re.M)[1:]:
        lines = block.splitlines()
        if not any(line.startswith("| revision / step") for line in lines):
            continue
        start = next(i for i, line in enumerate(lines) if line.startswith("| revision / step")) + 2  # past the header rule
        rows = []
        for line in lines[start:]:
            if not line.startswith("|"):
                break
            rows.append(line.split("|")[1].strip())
        series[lines[0]] = rows
    return series


# ---- Lightning ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lightning_store(tmp_path_factory):
    """Two fresh fits into one out_dir, then a resume (with other probes) of the second."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from sinkwatch.lightning import SinkWatchCallback

    root = tmp_path_factory.mktemp("lightning_store")
    out = root / "sw"

    def fit(run: str, max_steps: int, probes, ckpt_path=None):
        cb = SinkWatchCallback(out_dir=str(out), probes=probes, **COMMON)
        ckpt = ModelCheckpoint(dirpath=root / run / "ckpt", every_n_train_steps=2, save_top_k=-1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer(root / run, [cb, ckpt], max_steps=max_steps, enable_checkpointing=True).fit(
                LitLM(build("llama")), loader(batch_size=2), ckpt_path=ckpt_path
            )
        return caught

    first = fit("a", 4, PROBES)
    after_first = read_jsonl(out / "records.jsonl")
    second = fit("b", 4, PROBES)
    after_second = read_jsonl(out / "records.jsonl")
    resumed = fit("c", 6, OTHER_PROBES, ckpt_path=str(root / "b" / "ckpt" / "epoch=0-step=2.ckpt"))
    return dict(
        out=out, root=root, first=first, second=second, resumed=resumed, after_first=after_first, after_second=after_second
    )


def test_lightning_fresh_start_moves_the_earlier_store_aside(lightning_store):
    s = lightning_store
    assert [r["step"] for r in s["after_first"]] == [0, 2, 4] and not moved_warnings(s["first"])
    assert [r["step"] for r in s["after_second"]] == [0, 2, 4]  # the second run's own records only
    (aside,) = moved_aside(s["out"])
    assert read_jsonl(aside / "records.jsonl") == s["after_first"]  # the first run's, whole and unchanged
    assert json.loads((aside / "probes.json").read_text())["probe_hashes"] == s["after_first"][0]["probe_hashes"]  # its probe sets too
    notes = moved_warnings(s["second"])
    assert len(notes) == 1 and str(aside) in notes[0], notes


def test_lightning_resume_keeps_appending(lightning_store):
    s = lightning_store
    assert len(moved_aside(s["out"])) == 1 and not moved_warnings(s["resumed"])  # a resume moves nothing aside
    records = read_jsonl(s["out"] / "records.jsonl")
    assert [r["step"] for r in records] == [0, 2, 4, 6]
    assert records[:2] == s["after_second"][:2]  # the resumed run's history, kept as written
    assert steps(s["out"] / "records.superseded.jsonl") == [4]  # rolled back past the step-2 checkpoint
    hashes = [r["config_hash"] for r in records]
    assert hashes[0] == hashes[1] != hashes[2] == hashes[3]
    # probes.json is the resumed run's (its new probe sets), written into its own store, never a moved one
    assert json.loads((s["out"] / "probes.json").read_text())["probe_hashes"] == records[-1]["probe_hashes"]


def test_report_draws_each_config_hash_as_its_own_series(lightning_store):
    s = lightning_store
    records = read_jsonl(s["out"] / "records.jsonl")
    md = build_report([s["out"]], s["root"] / "report").read_text()
    model = records[0]["model"]
    a, b = records[0]["config_hash"], records[-1]["config_hash"]
    assert report_series(md) == {f"{model} [{a}]": ["0", "2"], f"{model} [{b}]": ["4", "6"]}
    assert f"config_hash {a}, steps 0-2" in md and f"config_hash {b}, steps 4-6" in md


def test_report_splits_runs_appended_to_one_file(lightning_store, tmp_path):
    """A store written before this fix (each fresh run appended to the same file, same config_hash)
    reads back as one series per run, not one zig-zag trajectory."""
    s = lightning_store
    (aside,) = moved_aside(s["out"])
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    # the first run's lines, then the second's (with its resume), in one file: what the old code wrote
    (legacy / "records.jsonl").write_text((aside / "records.jsonl").read_text() + (s["out"] / "records.jsonl").read_text())
    md = build_report([legacy], tmp_path / "report").read_text()
    series = report_series(md)
    assert list(series.values()) == [["0", "2", "4"], ["0", "2"], ["4", "6"]], series
    # the moved-aside store is a store of its own, one series
    (alone,) = Store(aside).segments()
    assert [r["step"] for r in alone.records] == [0, 2, 4]


# ---- transformers Trainer -------------------------------------------------------------------------------
def test_hf_fresh_start_moves_aside_and_resume_appends(tmp_path):
    from transformers import Trainer, TrainingArguments

    from sinkwatch.hf import SinkWatchTrainerCallback

    out = tmp_path / "sw"

    def train(run: str, max_steps: int, resume=None):
        args = TrainingArguments(
            output_dir=str(tmp_path / run), max_steps=max_steps, per_device_train_batch_size=2, learning_rate=3e-3, use_cpu=True,
            report_to=[], save_strategy="steps", save_steps=2, seed=11, disable_tqdm=True, dataloader_num_workers=0,
        )  # fmt: skip
        cb = SinkWatchTrainerCallback(out_dir=str(out), probes=PROBES, **COMMON)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Trainer(model=build("llama"), args=args, train_dataset=CopyDataset(n=32), callbacks=[cb]).train(resume_from_checkpoint=resume)
        return caught

    assert not moved_warnings(train("a", 2))
    first = read_jsonl(out / "records.jsonl")
    second = train("b", 4)
    assert steps(out / "records.jsonl") == [0, 2, 4]
    # the last step was probed before the Trainer saved it: its checkpoint holds that probe
    state = json.loads((tmp_path / "b" / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["stateful_callbacks"]["SinkWatchTrainerCallback"]["attributes"]["sinkwatch_state"]["last_probed_step"] == 4
    (aside,) = moved_aside(out)
    assert read_jsonl(aside / "records.jsonl") == first
    assert len(moved_warnings(second)) == 1
    assert not moved_warnings(train("c", 4, resume=str(tmp_path / "b" / "checkpoint-2")))
    assert steps(out / "records.jsonl") == [0, 2, 4] and len(moved_aside(out)) == 1
    assert steps(out / "records.superseded.jsonl") == [4]  # run b's step 4, rolled back and probed again


# ---- OLMo-core ------------------------------------------------------------------------------------------
def test_olmo_core_fresh_start_moves_aside_and_resume_appends(tmp_path):
    pytest.importorskip("olmo_core")
    from olmo_core_helpers import build_trainer

    from sinkwatch.olmo_core import SinkWatchCallback

    out = tmp_path / "sw"

    def fit(work: str, n_steps: int):
        cb = SinkWatchCallback(out_dir=str(out), probes=PROBES, raise_on_error=True, **COMMON)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t = build_trainer(tmp_path / work, {"sinkwatch": cb}, steps=n_steps)  # one checkpoint: the final step
            t.fit()
        return t, caught

    _, first_warnings = fit("a", 2)
    assert not moved_warnings(first_warnings)
    first = read_jsonl(out / "records.jsonl")
    assert [r["step"] for r in first] == [0, 2]
    _, second_warnings = fit("b", 2)  # a new save folder: a fresh run
    assert steps(out / "records.jsonl") == [0, 2]
    (aside,) = moved_aside(out)
    assert read_jsonl(aside / "records.jsonl") == first and len(moved_warnings(second_warnings)) == 1
    resumed, resumed_warnings = fit("b", 4)  # the same save folder: OLMo-core resumes from its step-2 checkpoint
    assert resumed.checkpoint_loaded and not moved_warnings(resumed_warnings)
    # the step-2 probe was in that checkpoint (probed before the checkpointer saved): kept, not redone
    assert steps(out / "records.jsonl") == [0, 2, 4] and len(moved_aside(out)) == 1
    assert not (out / "records.superseded.jsonl").exists()


def test_a_reporter_added_by_the_user_still_appends(tmp_path):
    """``JSONLReporter`` built directly (``reporters=[...]``) keeps its old behaviour: it appends."""
    from sinkwatch.reporting.jsonl import JSONLReporter

    for step in (0, 1):
        JSONLReporter(tmp_path).log_record({"step": step})
    assert steps(tmp_path / "records.jsonl") == [0, 1] and not moved_aside(tmp_path)
