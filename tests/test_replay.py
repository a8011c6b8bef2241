"""Replay through a real local Hugging Face cache of a tiny model trained by the tests (SPEC §8)."""

import os
import subprocess
import sys

import pytest
from trajectory import TOKENS_PER_STEP, hf_cache_from_checkpoints

import sinkwatch.monitor
from sinkwatch import InductionProbe, RepeatedRandomProbe
from sinkwatch.cli import main
from sinkwatch.replay import (
    list_revisions,
    load_recipe,
    merged_records,
    packaged_recipes,
    replay,
    revision_step,
    revision_tokens,
    select_log_spaced,
    training_order,
)
from sinkwatch.report import build_report
from sinkwatch.reporting.jsonl import read_jsonl

PROBES = [InductionProbe(n=24, seq_len=128), RepeatedRandomProbe(n=8, seq_len=64)]


@pytest.fixture(scope="module")
def cache(trajectory_run, tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_cache")
    repo = hf_cache_from_checkpoints(trajectory_run[1], d)
    return repo, str(d)


def run(cache, out, **kw):
    repo, cache_dir = cache
    return replay(repo, out_dir=out, probes=PROBES, cache_dir=cache_dir, tokens_per_step=TOKENS_PER_STEP, progress=False, **kw)


def test_revisions_are_listed_from_the_local_cache(cache):
    """Revisions are listed from the local cache in training order."""
    repo, cache_dir = cache
    revs = list_revisions(repo, cache_dir=cache_dir)
    assert training_order(revs) == ["step0", "step100", "step300", "step600", "step900", "step1300"]


def test_replay_writes_one_record_per_revision_and_a_rerun_does_nothing(cache, tmp_path):
    """Replay writes one record per revision and a rerun skips every finished one."""
    rows = run(cache, tmp_path)
    assert [r["revision"] for r in rows] == ["step0", "step100", "step300", "step600", "step900", "step1300"]
    assert all(r["status"] == "ok" for r in rows)
    records = read_jsonl(tmp_path / "records.jsonl")
    assert len(records) == 6
    assert [r["tokens"] for r in records] == [revision_step(r["revision"]) * TOKENS_PER_STEP for r in records]
    assert records[-1]["induction_state"] == "formed" and records[0]["induction_state"] == "absent"
    assert len({r["probe_hash"] for r in records}) == 1
    before = (tmp_path / "records.jsonl").read_text()
    assert run(cache, tmp_path) == []  # a rerun skips every revision already done
    assert (tmp_path / "records.jsonl").read_text() == before


def test_records_equal_live_probes_of_the_same_weights(cache, trajectory_run, tmp_path):
    """A number computed live at step N equals the one replay computes on the checkpoint of step N."""
    from transformers import AutoModelForCausalLM

    from sinkwatch import Monitor

    rows = run(cache, tmp_path, revisions=["step600"])
    model = AutoModelForCausalLM.from_pretrained(trajectory_run[1]["step600"])
    live = Monitor(PROBES).probe(model, track=False).to_record()
    for key in ("sink_rate", "icl_score", "n_induction_ge50"):
        assert rows[0][key] == pytest.approx(live[key]), key


def test_an_exception_mid_revision_leaves_no_partial_record(cache, tmp_path, monkeypatch):
    """A failure mid-revision records the revision as failed and writes nothing partial."""
    original = sinkwatch.monitor.Monitor._run
    calls = {"n": 0}

    def failing_run(self, target, probe, *, with_sinks):
        calls["n"] += 1
        if calls["n"] == 6:  # revision 3, after its first probe set was computed
            raise RuntimeError("injected failure mid-revision")
        return original(self, target, probe, with_sinks=with_sinks)

    monkeypatch.setattr(sinkwatch.monitor.Monitor, "_run", failing_run)
    with pytest.warns(RuntimeWarning, match="injected failure"):
        rows = run(cache, tmp_path)
    assert [r["status"] for r in rows] == ["ok", "ok", "failed", "ok", "ok", "ok"]
    ok = [r for r in read_jsonl(tmp_path / "records.jsonl") if r.get("status") == "ok"]
    assert "step300" not in {r["revision"] for r in ok}  # nothing half-written for the failed revision
    monkeypatch.setattr(sinkwatch.monitor.Monitor, "_run", original)
    # a crash while appending leaves a torn last line: it is ignored and that revision is redone
    with open(tmp_path / "records.jsonl", "a") as f:
        f.write('{"model": "x", "revision": "step13')
    retried = run(cache, tmp_path)
    assert [r["revision"] for r in retried] == ["step300"] and retried[0]["status"] == "ok"
    assert [r["revision"] for r in merged_records(tmp_path)] == ["step0", "step100", "step300", "step600", "step900", "step1300"]


def test_a_missing_revision_is_recorded_as_failed(cache, tmp_path):
    """A revision that does not exist is recorded as failed with its name."""
    with pytest.warns(RuntimeWarning, match="step77"):
        rows = run(cache, tmp_path, revisions=["step0", "step77", "step1300"])
    assert [(r["revision"], r["status"]) for r in rows] == [("step0", "ok"), ("step77", "failed"), ("step1300", "ok")]
    assert "step77" in rows[1]["error"]


def test_shards_split_the_revisions_and_the_report_merges_them(cache, tmp_path):
    """Shards split the revisions; the report merges them and re-derives the stages."""
    a = run(cache, tmp_path, shard=(0, 2))
    b = run(cache, tmp_path, shard=(1, 2))
    assert [r["revision"] for r in a] == ["step0", "step300", "step900"]
    assert [r["revision"] for r in b] == ["step100", "step600", "step1300"]
    assert (tmp_path / "records.shard-0-of-2.jsonl").exists() and (tmp_path / "records.shard-1-of-2.jsonl").exists()
    merged = merged_records(tmp_path)
    assert [r["revision"] for r in merged] == ["step0", "step100", "step300", "step600", "step900", "step1300"]
    states = [r["induction_state"] for r in merged]  # re-derived over the merged sequence
    assert states[0] == "absent" and states[-1] == "formed"
    report = build_report([tmp_path])
    text = report.read_text()
    for fig in ("sink_and_induction_heads.png", "final_sink_heads_per_layer.png", "stage_timeline.png", "induction_score_and_icl.png"):
        assert (report.parent / fig).stat().st_size > 1000 and fig in text
    assert "step1300" in text and "Findings" in text


def test_cli_replay_and_report(cache, tmp_path):
    """`sinkwatch replay` then `sinkwatch report` from the command line."""
    repo, cache_dir = cache
    out = tmp_path / "store"
    rc = main(
        [
            "replay",
            repo,
            "--revisions",
            "step0,step600,step1300",
            "--out",
            str(out),
            "--cache-dir",
            cache_dir,
            "--probe",
            "induction,repeated",
            "--n",
            "8",
            "--seq-len",
            "64",
            "--tokens-per-step",
            str(TOKENS_PER_STEP),
            "--no-progress",
            "--wandb",
            "offline",
        ]
    )
    assert rc == 0
    recs = read_jsonl(out / "records.jsonl")
    assert [r["revision"] for r in recs] == ["step0", "step600", "step1300"] and recs[1]["tokens"] == 600 * TOKENS_PER_STEP
    assert main(["report", str(out), str(out), "--out", str(tmp_path / "rep")]) == 0  # several stores overlay
    assert (tmp_path / "rep" / "report.md").exists()


def test_no_network_fails_fast_with_advice(tmp_path):
    """Without network replay exits 2 at once with HF_HUB_OFFLINE advice and writes nothing."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    res = subprocess.run(
        [sys.executable, "-m", "sinkwatch", "replay", "recipes/pythia-1b.yaml", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert res.returncode == 2
    assert "cannot reach the Hugging Face hub" in res.stderr and "HF_HUB_OFFLINE=1" in res.stderr
    assert not list(tmp_path.glob("records*.jsonl"))


def test_recipes_and_revision_names():
    """Packaged recipes load, and revision names parse to steps and tokens."""
    assert set(packaged_recipes()) >= {"pythia-1b", "olmo-1b-0724", "olmoe-1b-7b-0924"}
    r = load_recipe("olmo-1b-0724")
    assert r.model == "allenai/OLMo-1B-0724-hf" and r.dtype == "float16" and len(r.revisions) == 10
    assert r.probes["induction"] == {"n": 2000, "seq_len": 256, "seed": 42}
    assert load_recipe("recipes/pythia-1b.yaml").revisions[-1] == "step143000"
    assert revision_tokens("step11000-tokens23B") == 23_000_000_000
    assert revision_tokens("step3000", 2097152) == 6_291_456_000
    assert revision_step("step1454000-tokens3048B") == 1454000
    revs = [f"step{s}" for s in [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000, 2000, 5000, 10000, 143000]] + ["main"]
    picked = select_log_spaced(revs, 5)
    assert picked[0] == "step0" and picked[-1] == "step143000" and len(picked) == 5
    with pytest.raises(FileNotFoundError, match="no recipe"):
        load_recipe("gpt-7")
