"""Which weights each replay record measured, and labels that never lie, against
the stand-in hub (tests/local_hub.py) and local folders of tiny models the tests save themselves.

- every record carries the commit its branch resolved to (downloaded by that commit), a fingerprint
  of its weights (from the hub's metadata, before any download), the versions and the device;
- a branch that moves to new weights is measured again, and the report says it moved;
- duplicated branches (pythia#205) and a shared shard (pythia#206) are flagged as groups, left out
  of the trajectory, and ``skip_duplicates`` never downloads them;
- ``main`` stays out of a listed trajectory (the report keeps its token axis);
- a local folder of checkpoints is a run; ``--revisions`` on one model folder is refused;
- ``--probe`` lays over a recipe's probes (custom label, refused under --protocol paper);
  ``--batch-tokens`` keeps the recipe's protocol and ablation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from pathlib import Path

import pytest
from local_hub import LocalHub, patched_endpoint
from tiny_models import build

from sinkwatch import InductionProbe
from sinkwatch.cli import main
from sinkwatch.replay import FetchConfig, failed_revisions, merged_records, read_ablation, record_files, replay, replay_plan
from sinkwatch.report import build_report
from sinkwatch.reporting.jsonl import read_jsonl


def store_rows(store) -> list[dict]:
    """Every row of a replay store, in file order (each worker writes its own records file)."""
    return [r for p in record_files(store) for r in read_jsonl(p)]

PROBES = [InductionProbe(n=8, seq_len=64)]
TPS = 1000  # tokens per step of these made-up runs
SHARD = "model-00001-of-00002.safetensors"


def fingerprint_of(files: dict[str, bytes]) -> str:
    """The fingerprint as docs/design.md §8 defines it, computed here from the bytes (not from hub metadata)."""
    lines = sorted(f"{p}\t{hashlib.sha256(b).hexdigest()}" for p, b in files.items() if p.endswith(".safetensors"))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def folder_bytes(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """save_pretrained folders of tiny Llamas with different weights; two of them in two shards."""
    root = tmp_path_factory.mktemp("weights")
    out = {}
    for seed in range(4):
        build("llama", seed=seed).save_pretrained(root / f"w{seed}")
        out[f"w{seed}"] = folder_bytes(root / f"w{seed}")
    for seed in (4, 5, 6):
        build("llama", seed=seed).save_pretrained(root / f"s{seed}", max_shard_size="100KB")
        out[f"s{seed}"] = folder_bytes(root / f"s{seed}")
    assert sum(p.endswith(".safetensors") for p in out["s4"]) == 2, sorted(out["s4"])
    # pythia#206: a branch whose first shard is another branch's first shard (the rest its own)
    out["s6_with_s4_first_shard"] = {**out["s6"], SHARD: out["s4"][SHARD]}
    return out


@pytest.fixture(scope="module")
def hub(weights):
    with LocalHub() as h:
        for branch, w in (("step0", "w0"), ("step100", "w1"), ("main", "w1")):
            h.add_revision("org/plain", branch, weights[w])
        # pythia#205: step branches serving the final weights
        for branch, w in (("step100", "w0"), ("step200", "w1"), ("step300", "w3"), ("step150", "w3"), ("step250", "w3"), ("main", "w3")):
            h.add_revision("org/dup", branch, weights[w])
        for branch, w in (("step10", "s4"), ("step20", "s5"), ("step30", "s6_with_s4_first_shard")):
            h.add_revision("org/shard", branch, weights[w])
        for branch, w in (("step100", "w0"), ("step200", "w1")):
            h.add_revision("org/moving", branch, weights[w])
        olmo2 = (
            ("stage1-step0-tokens0B", "w0"),
            ("stage1-step100-tokens1B", "w1"),
            ("stage2-ingredient1-step50-tokens1B", "w2"),
            ("stage2-ingredient2-step50-tokens1B", "w3"),
            ("main", "w2"),
        )
        for branch, w in olmo2:
            h.add_revision("org/olmo2", branch, weights[w])
        with patched_endpoint(h.endpoint):
            yield h


def run(model, out, **kw):
    kw.setdefault("probes", PROBES)
    return replay(model, out_dir=out, cache_dir=str(out / "hf_cache"), tokens_per_step=TPS, progress=False, **kw)


def test_records_name_the_commit_the_weights_versions_and_device(hub, weights, tmp_path):
    rows = run("org/plain", tmp_path / "store")
    assert [r["revision"] for r in rows] == ["step0", "step100"]  # main (no step) stays out of a listed trajectory
    for r, w in zip(rows, ("w0", "w1")):
        assert r["status"] == "ok" and r["commit"] == hub.commit_of("org/plain", r["revision"])
        assert r["weights_fingerprint"] == fingerprint_of(weights[w])
        assert r["duplicate_of"] is None and r["device"] == "cpu"
        assert set(r["versions"]) >= {"sinkwatch", "torch", "transformers"}
        # the weights were downloaded by the commit the branch resolved to when listed
        assert f"/org/plain/resolve/{r['commit']}/model.safetensors" in hub.downloads()
    # the report keeps its token axis: main, the final weights under another name, is no point at step 0
    md = build_report([tmp_path / "store"], tmp_path / "rep").read_text()
    assert "training step (tokens unknown" not in md and "| main |" not in md


def as_process(monkeypatch, pid: int) -> None:
    """Replay as if from another process (each CLI run is one): its records go to records.HOST.PID.jsonl."""
    import sinkwatch.replay.measure as measure_module

    detect = measure_module.detect_worker
    monkeypatch.setattr(measure_module, "detect_worker", lambda: dataclasses.replace(detect(), pid=pid))


def test_a_branch_that_moves_to_new_weights_is_measured_again_and_the_report_says_so(hub, weights, tmp_path, monkeypatch):
    as_process(monkeypatch, 9)
    first = run("org/moving", tmp_path)
    old = hub.commit_of("org/moving", "step200")
    assert [r["revision"] for r in first] == ["step100", "step200"]
    new = hub.move_branch("org/moving", "step200", weights["w2"])
    # the plan is the store's manifest, written once: the move is picked up by an explicit rewrite, which the plan shows
    plan = replay_plan("org/moving", out_dir=tmp_path, probes=PROBES, tokens_per_step=TPS)
    assert [(p.rev.name, p.state) for p in plan.revisions] == [("step100", "done"), ("step200", "done")]
    plan = replay_plan("org/moving", out_dir=tmp_path, probes=PROBES, tokens_per_step=TPS, rewrite_manifest=True)
    assert [(p.rev.name, p.state) for p in plan.revisions] == [("step100", "done"), ("step200", "to do")]
    assert run("org/moving", tmp_path) == []  # the manifest's commits, all recorded: nothing to do, no hub request
    # a later process, whose records file (records.HOST.10.jsonl) sorts before the first one's (.9.)
    as_process(monkeypatch, 10)
    again = run("org/moving", tmp_path, rewrite_manifest=True)
    assert [(r["revision"], r["commit"]) for r in again] == [("step200", new)]  # step100 did not move: done
    assert again[0]["weights_fingerprint"] == fingerprint_of(weights["w2"])
    assert f"/org/moving/resolve/{new}/model.safetensors" in hub.downloads()
    assert run("org/moving", tmp_path) == []  # measured at the new commit: done now
    merged = {r["revision"]: r for r in merged_records(tmp_path)}
    assert merged["step200"]["commit"] == new
    md = build_report([tmp_path], tmp_path / "rep").read_text()
    line = next(x for x in md.splitlines() if x.startswith("| step200 |") and "moved" in x)
    assert f"moved: {old[:10]} -> {new[:10]}" in line  # in the order measured, whatever the records files are called


def test_a_moved_branch_whose_new_weights_fail_is_reported_failed(hub, weights, tmp_path):
    """The old commit's record is still drawn (the latest that succeeded); the report must say the
    branch's new weights failed. It said nothing: failures were matched to successes by name alone."""
    hub.add_revision("org/movefail", "step100", weights["w0"])
    run("org/movefail", tmp_path)
    new = hub.move_branch("org/movefail", "step100", weights["w1"])
    hub.fail(f"{new}/model.safetensors", times=10_000, status=503, method="GET")
    try:
        rows = run("org/movefail", tmp_path, fetch=FetchConfig(retries=0), rewrite_manifest=True)
    finally:
        hub.clear_faults()
    assert [(r["revision"], r["status"], r["commit"]) for r in rows] == [("step100", "failed", new)]
    assert list(failed_revisions(tmp_path)) == ["step100"]
    md = build_report([tmp_path], tmp_path / "rep").read_text()
    assert "- `step100`:" in md[md.index("Failed revisions") :]


def test_duplicated_branches_are_flagged_as_a_group_and_left_out_of_the_trajectory(hub, tmp_path):
    """pythia#205: step150 and step250 serve the final weights (step300's, main's). The final step keeps them; every
    other step serving them is a wrong branch, flagged, and the group measured once (one task)."""
    with pytest.warns(RuntimeWarning, match=r"step150, step250, step300, main serve identical weights — step150, step250 flagged "
                      r"\(duplicate_of=main\)"):  # fmt: skip
        rows = run("org/dup", tmp_path)
    by = {r["revision"]: r for r in rows}
    assert sorted(by) == ["step100", "step150", "step200", "step250", "step300"]
    for name in ("step150", "step250"):
        assert by[name]["duplicate_of"] == "main" and by[name]["duplicate_group"] == ["step150", "step250", "step300", "main"]
        assert by[name]["duplicate_kind"] == "identical"
    assert by["step100"]["duplicate_of"] is None and by["step200"]["duplicate_of"] is None and by["step300"]["duplicate_of"] is None
    assert by["step250"]["measured_as"] == by["step300"]["measured_as"] == "step150"  # one task, measured once
    assert [r["revision"] for r in merged_records(tmp_path)] == ["step100", "step200", "step300"]  # the trajectory and its stages
    md = build_report([tmp_path], tmp_path / "rep").read_text()
    section = md[md.index("Duplicated weights") :]
    assert "step150, step250, step300" in section and "main" in section
    # skip_duplicates: flagged from the hub's metadata before any download, never fetched
    before = len(hub.downloads())
    skipped = run("org/dup", tmp_path / "skip", skip_duplicates=True)
    assert sorted(r["revision"] for r in skipped) == ["step100", "step200", "step300"]
    fetched = hub.downloads()[before:]
    assert fetched and not [p for p in fetched if any(hub.commit_of("org/dup", b) in p for b in ("step150", "step250"))]


def test_a_shared_shard_flags_the_branch_that_is_not_the_final_step(hub, tmp_path):
    """pythia#206: step10's first shard is the final step's (step30's): step10 is the wrong branch."""
    with pytest.warns(RuntimeWarning, match=rf"step10, step30 share weight files \({SHARD}\) — step10 flagged \(duplicate_of=step30\)"):
        rows = run("org/shard", tmp_path)
    by = {r["revision"]: r for r in rows}
    assert by["step10"]["duplicate_of"] == "step30" and by["step10"]["duplicate_kind"] == f"shared files: {SHARD}"
    assert by["step20"]["duplicate_of"] is None and by["step30"]["duplicate_of"] is None
    assert [r["revision"] for r in merged_records(tmp_path)] == ["step20", "step30"]


def test_the_plan_can_flag_duplicates_from_metadata_alone(hub, tmp_path):
    """What ``--plan`` calls (replay-cluster): listing with commits, fingerprints from the hub's
    metadata, the duplicate groups — no weights downloaded."""
    from sinkwatch.models.hub import list_refs
    from sinkwatch.replay import Revision
    from sinkwatch.replay.provenance import find_duplicates, fingerprints
    from sinkwatch.replay.revisions import select_revisions

    before = len(hub.downloads())
    refs = list_refs("org/dup")
    revs = select_revisions(refs).chosen
    main_ref = [Revision("main", commit=refs["main"])]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every fingerprint read from metadata: no warning
        fp = fingerprints("org/dup", [*revs, *main_ref], offline=False)
    flags = find_duplicates(revs, fp, aliases=main_ref)
    assert sorted(flags) == ["step150", "step250"] and {g.duplicate_of for g in flags.values()} == {"main"}
    assert len(hub.downloads()) == before
    # and `sinkwatch replay --plan` shows them, or drops them with --skip-duplicates
    from sinkwatch.replay import format_plan

    def weights_fetched() -> int:
        return sum(p.endswith(".safetensors") for p in hub.downloads())

    weights_before = weights_fetched()
    plan = replay_plan("org/dup", out_dir=tmp_path, probes=PROBES, tokens_per_step=TPS)
    flagged = {p.rev.name: p.duplicate_of for p in plan.revisions if p.duplicate_of}
    assert flagged == dict.fromkeys(["step150", "step250"], "main")
    assert "step250" in format_plan(plan) and "(duplicate of main)" in format_plan(plan)
    skipped = replay_plan("org/dup", out_dir=tmp_path, probes=PROBES, tokens_per_step=TPS, skip_duplicates=True)
    assert not {"step150", "step250"} & {p.rev.name for p in skipped.revisions} and "step300" in {p.rev.name for p in skipped.revisions}
    assert weights_fetched() == weights_before  # no weights fetched by either plan


def test_parallel_runs_are_their_own_series_with_stages_over_stage1_then_their_own(hub, tmp_path):
    """OLMo-2's stage-2 ingredients: each its own trajectory after stage 1, tokens continued from stage 1's end."""
    rows = run("org/olmo2", tmp_path)
    assert [(r["revision"], r.get("run"), r["tokens"]) for r in rows] == [
        ("stage1-step0-tokens0B", None, 0),
        ("stage1-step100-tokens1B", None, 10**9),
        ("stage2-ingredient1-step50-tokens1B", "stage2-ingredient1", 2 * 10**9),
        ("stage2-ingredient2-step50-tokens1B", "stage2-ingredient2", 2 * 10**9),
    ]
    assert all(r["duplicate_of"] is None for r in rows)  # main = ingredient1's weights: an alias, not a duplicate
    assert [r["revision"] for r in merged_records(tmp_path)] == [r["revision"] for r in rows]
    md = build_report([tmp_path], tmp_path / "rep").read_text()
    for run_name in ("stage2-ingredient1", "stage2-ingredient2"):
        assert f"## org/olmo2 [{run_name}]" in md
    section = md[md.index("## org/olmo2 [stage2-ingredient1]") :]
    table = section[: section.index("## org/olmo2 [stage2-ingredient2]")]
    assert "stage2-ingredient1-step50-tokens1B" in table and "stage1-step100" not in table and "ingredient2" not in table


# ---- local folders -----------------------------------------------------------------------------------------
def test_a_folder_of_checkpoints_is_a_run_and_a_rewritten_checkpoint_is_measured_again(tmp_path):
    """`sinkwatch replay DIR` over checkpoint-N/ folders took DIR for a hub id; now each folder is a
    revision in step order, its commit the fingerprint of its files."""
    run_dir = tmp_path / "run"
    for step, seed in ((1000, 1), (200, 0)):
        build("llama", seed=seed).save_pretrained(run_dir / f"checkpoint-{step}")
    argv = ["replay", str(run_dir), "--out", str(tmp_path / "store"), "--n", "8", "--seq-len", "64"]
    argv += ["--tokens-per-step", str(TPS), "--wandb", "disabled", "--no-progress"]
    assert main(argv) == 0
    recs = store_rows(tmp_path / "store")
    assert [(r["revision"], r["step"], r["tokens"]) for r in recs] == [
        ("checkpoint-200", 200, 200 * TPS),
        ("checkpoint-1000", 1000, 1000 * TPS),
    ]
    assert recs[0]["commit"] == recs[0]["weights_fingerprint"] == fingerprint_of(folder_bytes(run_dir / "checkpoint-200"))
    assert main(argv) == 0 and len(store_rows(tmp_path / "store")) == 2  # done
    # the same folder spelled another way is the same run (it was refused: "made another way (model: run -> run/)")
    for spelling in (f"{run_dir}/", os.path.relpath(run_dir)):
        assert main([argv[0], spelling, *argv[2:]]) == 0 and len(store_rows(tmp_path / "store")) == 2
    build("llama", seed=2).save_pretrained(run_dir / "checkpoint-1000")  # rewritten in place
    with pytest.warns(RuntimeWarning, match="checkpoint-1000 changed on disk since .* --rewrite-manifest"):
        assert main(argv) == 0 and len(store_rows(tmp_path / "store")) == 2  # the plan's weights, recorded: nothing new
    assert main([*argv, "--rewrite-manifest"]) == 0
    recs = store_rows(tmp_path / "store")
    assert [r["revision"] for r in recs] == ["checkpoint-200", "checkpoint-1000", "checkpoint-1000"]


def test_revisions_on_one_model_folder_are_refused(tmp_path, capsys):
    """It measured the same weights under both names (two identical records)."""
    build("llama", seed=0).save_pretrained(tmp_path / "model")
    argv = ["replay", str(tmp_path / "model"), "--revisions", "step100,step200", "--out", str(tmp_path / "store")]
    argv += ["--n", "8", "--seq-len", "64", "--wandb", "disabled", "--no-progress"]
    assert main(argv) == 2
    assert "one checkpoint" in capsys.readouterr().err
    assert not list((tmp_path / "store").glob("records*.jsonl"))


def test_the_paper_protocol_replays_and_ablates_a_model_without_sdpa(hub, tmp_path):
    """gpt-oss has no sdpa (learned sinks): loaded with eager attention, it is probed through it. The
    paper protocol's float16 PR pass and the ablation's screen switched it to sdpa afterwards, which
    it cannot run: every revision was recorded failed, and so was the ablation."""
    import families

    for branch, seed in (("step100", 0), ("main", 1)):
        families.build("gpt_oss", seed=seed).save_pretrained(tmp_path / branch)
        hub.add_revision("org/oss", branch, tmp_path / branch)
    rows = run("org/oss", tmp_path / "store", protocol="paper", dtype="float16", ablate=True, ablation_revision="main")
    assert [(r["revision"], r["status"]) for r in rows] == [("step100", "ok")], rows[0].get("error")
    assert rows[0]["pr_dtype"] == "float16" and rows[0]["sink_learned_alpha"]
    ablation = read_ablation(tmp_path / "store")  # main is no measured revision: its screen is probed for the ablation
    assert ablation["status"] == "ok" and ablation["screen"] == "probed for the ablation", ablation.get("error")


def test_an_ablation_at_a_branch_that_moved_is_run_again_and_names_its_commit(hub, weights, tmp_path):
    """The packaged OLMo/OLMoE recipes ablate at ``main``, and OLMoE's main was rewritten. The ablation was
    keyed by the branch name alone: after main moved, a rerun kept the old weights' ablation as done, and
    ablation.json never said which commit it measured."""
    for branch, w in (("step100", "w0"), ("main", "w1")):
        hub.add_revision("org/abl", branch, weights[w])
    run("org/abl", tmp_path, ablate=True, ablation_revision="main")
    old = hub.commit_of("org/abl", "main")
    new = hub.move_branch("org/abl", "main", weights["w2"])
    assert run("org/abl", tmp_path, ablate=True, ablation_revision="main", rewrite_manifest=True) == []  # step100 is done
    assert [p for p in hub.downloads("model.") if new in p], "the moved main was never fetched: its old ablation was kept as done"
    ablation = read_ablation(tmp_path)
    assert ablation["status"] == "ok" and ablation["commit"] == new
    kept = json.loads((tmp_path / f"ablation.{old[:12]}.json").read_text())  # the earlier result stays, named by its commit
    assert kept["status"] == "ok" and kept["commit"] == old


# ---- labels that never lie ----------------------------------------------------------------------------------
@pytest.fixture()
def recipe(tmp_path):
    path = tmp_path / "tiny-paper.yaml"
    path.write_text(
        "model: org/plain\nprotocol: paper\nablation_revision: step100\ndtype: float32\nrevisions: [step100]\n"
        f"tokens_per_step: {TPS}\nprobes:\n  induction: {{n: 24, seq_len: 64, seed: 42}}\n"
    )
    return str(path)


def cli(recipe, out, *extra):
    return main(["replay", recipe, "--out", str(out), "--cache-dir", str(out / "hf_cache"), "--wandb", "disabled", "--no-progress", *extra])


def test_probe_options_lay_over_the_recipe_and_label_the_records_custom(hub, recipe, tmp_path, capsys):
    """`--probe induction,repeated` rebuilt the probes from CLI defaults (the induction probe dropped
    from the recipe's n to 500) while records said protocol: paper."""
    assert cli(recipe, tmp_path / "a", "--probe", "induction,repeated", "--seq-len", "64", "--no-ablate") == 0
    rec = store_rows(tmp_path / "a")[0]
    assert rec["replay_key"]["probes"]["induction"]["n"] == 24  # the recipe's induction probe, kept
    assert rec["protocol"] == "custom" and rec["protocol_base"] == "paper"
    assert any(c.startswith("repeated probe: absent") for c in rec["protocol_changes"]), rec["protocol_changes"]
    assert rec["pr_dtype"] == "float16"  # computed with the paper's precision choices, and labelled as changed
    md = build_report([tmp_path / "a"], tmp_path / "rep").read_text()
    assert "protocol **custom**" in md and "repeated probe: absent" in md
    # under an explicit --protocol paper the same option is refused: the label would promise the paper's measurement
    assert cli(recipe, tmp_path / "b", "--probe", "induction,repeated", "--seq-len", "64", "--protocol", "paper") == 2
    assert "--protocol paper promises" in capsys.readouterr().err
    assert cli(recipe, tmp_path / "c", "--n", "16", "--protocol", "paper") == 2
    assert not list((tmp_path / "b").glob("records*.jsonl")) and not list((tmp_path / "c").glob("records*.jsonl"))


def test_batch_tokens_changes_memory_only(hub, recipe, tmp_path):
    """`--batch-tokens N` switched the recipe to the sinkwatch protocol and skipped its ablation."""
    assert cli(recipe, tmp_path, "--batch-tokens", "4096") == 0
    rec = store_rows(tmp_path)[0]
    assert rec["protocol"] == "paper" and rec["replay_key"]["protocol"] == "paper" and rec["pr_dtype"] == "float16"
    ablation = json.loads((tmp_path / "ablation.json").read_text())
    assert ablation["status"] == "ok" and ablation["revision"] == "step100" and ablation["protocol"] == "paper"


def test_report_lists_revisions_outside_the_trajectory(hub, tmp_path):
    """`main`, when named, is measured and listed apart: never drawn at step 0."""
    rows = run("org/plain", tmp_path, revisions=["step0", "step100", "main"])
    assert [r["revision"] for r in rows] == ["step0", "step100", "main"] and rows[-1]["step"] is None
    md = build_report([tmp_path], tmp_path / "rep").read_text()
    assert "training step (tokens unknown" not in md
    assert "Outside the trajectory" in md and "| main |" in md[md.index("Outside the trajectory") :]


def test_local_checkpoint_names_and_where_their_tokens_come_from():
    """Steps of local checkpoint names; tokens: --tokens-per-step, else the live callback's count,
    else the trainer's own (HF num_input_tokens_seen, OLMo-core global_train_tokens_seen); step 0 is 0."""
    from sinkwatch.replay.local import _State, _tokens, local_step

    names = {"checkpoint-1000": 1000, "step100": 100, "model_step_250": 250, "epoch=2-step=1500.ckpt": 1500, "iter_0002400": 2400}
    assert {n: local_step(n) for n in names} == names
    assert local_step("final") is None and local_step("last.ckpt") is None
    callback, trainer_count = _State(step=5, trainer_tokens=4096, sinkwatch={"tokens_seen": 2560}), _State(step=5, trainer_tokens=4096)
    assert _tokens(5, callback, 100) == 500  # --tokens-per-step wins
    assert _tokens(5, callback, None) == 2560  # what the live records at this step said
    assert _tokens(5, trainer_count, None) == 4096 and _tokens(5, _State(step=5), None) is None
    assert _tokens(0, trainer_count, None) == 0 and _tokens(None, callback, 100) is None
