"""Replay through a real local Hugging Face cache of a tiny model trained by the tests (docs/design.md §8)."""

import os
import subprocess
import sys

import numpy as np
import pytest
from trajectory import TOKENS_PER_STEP, hf_cache_from_checkpoints

import sinkwatch.monitor
from sinkwatch import InductionProbe, RepeatedRandomProbe
from sinkwatch import metrics as M
from sinkwatch.cli import main
from sinkwatch.replay import (
    StoreMismatchError,
    check_ablation,
    list_revisions,
    load_recipe,
    merged_records,
    packaged_recipes,
    read_ablation,
    record_files,
    replay,
    revision_step,
    revision_tokens,
    select_log_spaced,
    training_order,
)
from sinkwatch.report import _fmt, build_report
from sinkwatch.reporting.jsonl import read_jsonl

PROBES = [InductionProbe(n=24, seq_len=128), RepeatedRandomProbe(n=8, seq_len=64)]


def store_rows(store) -> list[dict]:
    """Every row of a replay store (one file per record, records/KEY.json), in the order they were written."""
    return sorted((r for p in record_files(store) for r in read_jsonl(p)), key=lambda r: r.get("written_at", 0.0))


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
    assert [r.name for r in training_order(revs)] == ["step0", "step100", "step300", "step600", "step900", "step1300"]
    assert all(len(r.commit) == 40 for r in revs)  # each with the commit its ref names (the cache's refs/<rev> file)


def test_replay_writes_one_record_per_revision_and_a_rerun_does_nothing(cache, tmp_path):
    """Replay writes one record per revision and a rerun skips every finished one."""
    rows = run(cache, tmp_path)
    assert [r["revision"] for r in rows] == ["step0", "step100", "step300", "step600", "step900", "step1300"]
    assert all(r["status"] == "ok" for r in rows)
    records = store_rows(tmp_path)
    assert len(records) == 6 and len(record_files(tmp_path)) == 6  # one file per record
    assert [r["tokens"] for r in records] == [revision_step(r["revision"]) * TOKENS_PER_STEP for r in records]
    assert records[-1]["induction_state"] == "formed" and records[0]["induction_state"] == "absent"
    assert len({r["probe_hash"] for r in records}) == 1
    before = store_rows(tmp_path)
    assert run(cache, tmp_path) == []  # a rerun skips every revision already done
    assert store_rows(tmp_path) == before


def test_records_equal_live_probes_of_the_same_weights(cache, trajectory_run, tmp_path):
    """A number computed live at step N equals the one replay computes on the checkpoint of step N."""
    from transformers import AutoModelForCausalLM

    from sinkwatch import Monitor

    rows = run(cache, tmp_path, revisions=["step600"])
    model = AutoModelForCausalLM.from_pretrained(trajectory_run[1]["step600"])
    live = Monitor(PROBES).probe(model).to_record()
    for key in ("sink_rate", "icl_score", "n_induction_ge50"):
        assert rows[0][key] == pytest.approx(live[key]), key


def test_an_exception_mid_revision_leaves_no_partial_record(cache, tmp_path, monkeypatch):
    """A failure mid-revision records the revision as failed and writes nothing partial."""
    original = sinkwatch.monitor.Monitor._forward
    calls = {"n": 0}

    def failing_forward(self, target, probe, *, with_sinks, share=None):
        calls["n"] += 1
        if calls["n"] == 6:  # revision 3, after its first probe set was computed
            raise RuntimeError("injected failure mid-revision")
        return original(self, target, probe, with_sinks=with_sinks, share=share)

    monkeypatch.setattr(sinkwatch.monitor.Monitor, "_forward", failing_forward)
    with pytest.warns(RuntimeWarning, match="injected failure"):
        rows = run(cache, tmp_path)
    assert [r["status"] for r in rows] == ["ok", "ok", "failed", "ok", "ok", "ok"]
    ok = [r for r in store_rows(tmp_path) if r.get("status") == "ok"]
    assert "step300" not in {r["revision"] for r in ok}  # nothing half-written for the failed revision
    monkeypatch.setattr(sinkwatch.monitor.Monitor, "_forward", original)
    # a crash while appending leaves a torn last line: it is ignored and that revision is redone
    with open(record_files(tmp_path)[0], "a") as f:
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
    """A shard is a stride: shard 0/2 alone measures its own (0, 300, 900), then what nobody began, from the end;
    shard 1/2, late, finds nothing to do. The report merges them and re-derives the stages."""
    a = run(cache, tmp_path, shard=(0, 2))
    b = run(cache, tmp_path, shard=(1, 2))
    assert [r["revision"] for r in a] == ["step0", "step300", "step900", "step1300", "step600", "step100"]
    assert b == []
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
    recs = store_rows(out)
    assert [r["revision"] for r in recs] == ["step0", "step600", "step1300"] and recs[1]["tokens"] == 600 * TOKENS_PER_STEP
    assert main(["report", str(out), str(out), "--out", str(tmp_path / "rep")]) == 0  # several stores overlay
    assert (tmp_path / "rep" / "report.md").exists()


def test_no_network_fails_fast_with_advice(tmp_path):
    """Online mode against an endpoint that refuses at once (the discard port on localhost): the
    advice path runs, and the test never reaches the real hub even where a network exists."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"
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
    assert "hf download" in res.stderr and "huggingface-cli" not in res.stderr  # the current huggingface_hub command
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


# ---- protocol, resume keys and the head-by-head comparison ----------------------------
def test_a_rerun_with_another_protocol_or_probe_set_is_refused_naming_the_difference(cache, tmp_path):
    """11.1: a quick n = 8 replay followed by another measurement into the same store used to skip
    every revision and report the n = 8 numbers as the new ones."""
    quick = [InductionProbe(n=8, seq_len=64)]
    rows = run_with(cache, tmp_path, quick, revisions=["step0", "step1300"])
    assert [r["protocol"] for r in rows] == ["sinkwatch", "sinkwatch"] and rows[0]["replay_key"]["probes"]["induction"]["n"] == 8
    assert run_with(cache, tmp_path, quick, revisions=["step0", "step1300"]) == []  # the same measurement: done
    with pytest.raises(StoreMismatchError, match="induction probe n: 8 -> 16"):
        run_with(cache, tmp_path, [InductionProbe(n=16, seq_len=64)], revisions=["step0", "step1300"])
    with pytest.raises(StoreMismatchError, match="protocol: sinkwatch -> paper"):
        run_with(cache, tmp_path, quick, revisions=["step0"], protocol="paper")
    with pytest.raises(StoreMismatchError, match="dtype: float32 -> bfloat16"):
        run_with(cache, tmp_path, quick, revisions=["step0"], dtype="bfloat16")
    assert len(store_rows(tmp_path)) == 2  # nothing written by the refused runs
    repo, cache_dir = cache
    rc = main(
        [
            "replay",
            repo,
            "--revisions",
            "step0",
            "--out",
            str(tmp_path),
            "--cache-dir",
            cache_dir,
            "--n",
            "16",
            "--seq-len",
            "64",
            "--no-progress",
            "--wandb",
            "disabled",
        ]
    )
    assert rc == 2  # the CLI reports the refusal as an error


def test_a_paper_protocol_replay_records_its_protocol_and_a_float16_pr_on_the_first_500(cache, tmp_path):
    rows = run_with(cache, tmp_path, [InductionProbe(n=8, seq_len=64)], revisions=["step1300"], protocol="paper")
    r = rows[0]
    assert r["status"] == "ok" and r["protocol"] == "paper" and r["pr_dtype"] == "float16" and r["pr_sequences"] == 8
    assert r["dtype"] == "float32" and len(r["pr"]) == r["n_layers"]
    report = build_report([tmp_path]).read_text()
    assert "protocol **paper**" in report


def run_with(cache, out, probes, **kw):
    repo, cache_dir = cache
    return replay(repo, out_dir=out, probes=probes, cache_dir=cache_dir, tokens_per_step=TOKENS_PER_STEP, progress=False, **kw)


def planted_reference(records, repo, planted=(1, 1)):
    """Published figures and per-head tables for the fixture model built from its own records, with
    one listed head's induction selectivity moved across 30x/50x/100x (the planted mismatch)."""
    cols = ["layer", "head", "induction", "previous", "duplicate", "first", "self", "local"]
    L, H = records[0]["n_layers"], records[0]["n_heads"]
    per_revision, revisions = {}, []
    for r in records:
        sel = {c: np.asarray(r["selectivity"][c], dtype=float) for c in M.SELECTIVITY_CLASSES}
        table = [[l, h] + [float(sel[c][l, h]) for c in cols[2:]] for l in range(L) for h in range(H)]
        l, h = planted
        row = table[l * H + h]
        row[2] = 1.0 if row[2] >= 30 else 500.0
        per_revision[r["revision"]] = {"heads": [[l_, h_, 0.0] for l_ in range(L) for h_ in range(H)], "all_heads": table}
        revisions.append({"revision": r["revision"], "tokens_b": r["tokens"] / 1e9, "sink_heads": 0, "ind_ge30": 0})
    reference = {
        "models": {repo: {"layers": L, "heads_per_layer": H, "revisions": revisions, "final_sink_heads_per_layer": [0] * L}},
        "milestones_tokens_b": {},
    }
    return reference, {"all_heads_columns": cols, "per_revision": {repo: per_revision}, "pr_trajectories": {}, "ablation_sweep": {}}


def test_the_head_by_head_comparison_names_a_planted_mismatch(cache, tmp_path):
    repo, _ = cache
    run(cache, tmp_path / "store", revisions=["step0", "step600", "step1300"])
    reference, per_head = planted_reference(merged_records(tmp_path / "store"), repo)
    md = build_report([tmp_path / "store"], tmp_path / "rep", reference=reference, per_head=per_head).read_text()
    assert (tmp_path / "rep" / "head_comparison_0.png").stat().st_size > 5000
    section = md[md.index("### Head by head vs the paper") :]
    assert "head_comparison_0.png" in section and "largest relative deviation" in section
    for rev in ("step0", "step600", "step1300"):
        line = next(x for x in section.splitlines() if x.startswith(f"| {rev} |"))
        assert "L1H1 induction" in line  # named, not averaged away
        other = [d for d in line.split("|")[3].split(";") if d.strip() and not d.strip().startswith("L1H1")]
        assert other == []  # no other head differs from its own numbers
    assert "sinkwatch's protocol" in section  # a sinkwatch-protocol number beside a paper number says so


def test_report_of_a_replay_without_tokens_labels_steps_and_says_what_does_not_apply(cache, tmp_path):
    """11.12: a model without a recipe (tokens unknown) — the axis says it shows steps, step 0 stays
    on the log axis, findings that cannot apply are n/a with the reason."""
    repo, cache_dir = cache
    replay(repo, out_dir=tmp_path / "store", probes=PROBES, cache_dir=cache_dir, progress=False, revisions=["step0", "step600", "step1300"])
    md = build_report([tmp_path / "store"], tmp_path / "rep").read_text()
    assert "figures show the training step (tokens unknown: replay with --tokens-per-step)" in md
    from sinkwatch import findings as F

    na = F.findings(F.trajectory_from_records(merged_records(tmp_path / "store")))["not_applicable"]
    for key, why in na.items():  # every finding that does not apply shows n/a with its reason
        if key != "pr_lead":
            assert f"| {key} |" in md and f"n/a ({why})" in md, key
    from sinkwatch.report import Store, _x_label, _xaxis
    from sinkwatch.reporting.figures import _plt

    store = Store(tmp_path / "store")
    assert not store.has_tokens and _x_label([store]).startswith("training step")
    fig, ax = _plt().subplots()
    ax.plot(store.x(), [1, 2, 3])
    _xaxis(ax, [store])
    assert ax.get_xscale() == "symlog" and 0.0 in list(ax.get_xticks())  # step 0 is on the axis
    labels = [t for t in ax.get_xticks()]
    assert len(labels) <= 8
    _plt().close(fig)


# ---- the paper's group ablation, run by replay (docs/design.md §5) -------------------------------------------
def _names(pairs):
    return [f"L{l}H{h}" for l, h in pairs]


def test_a_paper_replay_runs_the_group_ablation_with_the_fourth_control_draw_and_resumes(cache, tmp_path, monkeypatch):
    """The fixture model is trained until induction forms, so its final >= 50x set is non-empty with
    the paper's own threshold (no test-only threshold)."""
    repo, _ = cache
    probes = [InductionProbe(n=24, seq_len=128)]
    rows = run_with(cache, tmp_path, probes, revisions=["step600", "step1300"], protocol="paper", ablate=True, ablation_revision="step1300")
    a = read_ablation(tmp_path)
    rec = next(r for r in rows if r["revision"] == "step1300")
    sel = np.asarray(rec["selectivity"]["induction"], dtype=float)
    expected = _names(zip(*np.nonzero(sel >= 50)))
    assert expected, "the trained fixture has no >= 50x induction head: the test would not exercise the ablation"
    assert a["status"] == "ok" and a["kind"] == "ablation" and a["dtype"] == "float16" and a["protocol"] == "paper"
    assert a["screen"] == "record" and a["revision"] == "step1300" and a["heads"] == expected
    fourth = M.paper_control_sets(M.screen_sets(sel), rec["n_heads"])[50.0]
    assert a["control_heads"] == _names(fourth)
    assert a["ablated"]["top1"] < a["baseline"]["top1"]  # the induction circuit carries the copy
    # the per-revision records are untouched: no ablation row, every record keeps its replay key
    records = store_rows(tmp_path)
    assert len(records) == 2 and all("replay_key" in r and r.get("kind") != "ablation" for r in records)
    # resumable: a rerun neither re-probes a revision nor redoes the ablation
    before = (tmp_path / "ablation.json").read_text()

    def no_second_ablation(*args, **kw):
        raise AssertionError("the ablation was redone")

    monkeypatch.setattr(sinkwatch.monitor.Monitor, "ablate", no_second_ablation)
    assert (
        run_with(cache, tmp_path, probes, revisions=["step600", "step1300"], protocol="paper", ablation_revision="step1300", ablate=True)
        == []
    )
    assert (tmp_path / "ablation.json").read_text() == before
    with pytest.raises(StoreMismatchError, match="ablation revision: step1300 -> step900"):
        check_ablation(tmp_path, {**a["ablation_key"], "revision": "step900"})
    # the report: ours beside the paper's figures, head-set differences named
    reference, per_head = planted_reference(merged_records(tmp_path), repo)
    paper_circuit = expected[:-1] + ["L0H0"] if "L0H0" not in expected else expected[:-1]
    reference["models"][repo]["induction_circuit_ge50"] = paper_circuit
    reference["models"][repo]["ablation_top1"] = {
        "baseline": 0.5,
        "circuit_ablated": 0.125,
        "matched_random": 0.375,
        "matched_random_heads": {str(l): [h] for l, h in fourth[:1]},
        "revision": "step1300",
        "dtype": "float16",
        "n_examples": 24,
        "source": "planted for the test",
    }
    md = build_report([tmp_path], tmp_path / "rep", reference=reference, per_head=per_head).read_text()
    section = md[md.index("### Group ablation") :]
    line = next(x for x in section.splitlines() if x.startswith("| circuit ablated |"))
    assert f"only ours: {expected[-1]}" in line and ("only the paper's: L0H0" in line or "L0H0" in expected)
    assert "| 0.125 |" in line
    base = next(x for x in section.splitlines() if x.startswith("| baseline |"))
    assert f"| {_fmt(a['baseline']['top1'])} | 0.5 |" in base
    control = next(x for x in section.splitlines() if x.startswith("| matched random |"))
    assert (len(fourth) == 1 and "| same |" in control) or "only ours: " + ", ".join(_names(fourth[1:])) in control


def test_an_ablation_revision_outside_the_replay_is_screened_there(cache, tmp_path):
    """An ablation revision the replay did not probe (the paper's OLMo/OLMoE `main`) gets its own
    screen, equal to a replay record of that revision, and kept in ablation.json."""
    probes = [InductionProbe(n=24, seq_len=128)]
    run_with(cache, tmp_path / "a", probes, revisions=["step1300"], protocol="paper", ablate=True, ablation_revision="step900")
    a = read_ablation(tmp_path / "a")
    assert a["status"] == "ok" and a["screen"] == "probed for the ablation" and a["revision"] == "step900"
    rec = run_with(cache, tmp_path / "b", probes, revisions=["step900"], protocol="paper", ablate=False)[0]
    assert a["screen_induction"] == rec["selectivity"]["induction"]
    sel = np.asarray(rec["selectivity"]["induction"], dtype=float)
    assert a["heads"] == _names(zip(*np.nonzero(sel >= 50)))
    assert not (tmp_path / "b" / "ablation.json").exists()  # --no-ablate
