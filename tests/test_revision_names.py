"""Revision names of the runs people publish: steps, tokens, stages, parallel runs
and training order, over branch lists copied from the hub (shuffled here, as a listing may return them).

Sources of the lists: EleutherAI/pythia-* (``stepN``), allenai/OLMo-1B-0724-hf (``stepN-tokensNB``),
allenai/OLMo-2-1124-7B and OLMo-2-0425-1B (``stageK-…-stepN-tokensNB``, stage-2 ``ingredient1/2/3``),
allenai/OLMo-3 (``stage1-stepN``, ``stage2-ingredient1-step0``), HuggingFaceTB/SmolLM2-1.7B-intermediate-checkpoints
(``step-N``), HuggingFaceFW ablation models (``step-001000-2BT``), Megatron conversions (``iter_0002400``),
OpenLLM-France/Lucie-7B (``step0050000``, ``extension_step0001220``: a recipe pattern), the HF Trainer
(``checkpoint-N``)."""

import random

import pytest

from sinkwatch.replay import load_recipe, revision_step, revision_tokens, select_log_spaced, training_order

B = 10**9

PYTHIA = (
    ["step0", "step1", "step2", "step4", "step8", "step16", "step32", "step64", "step128", "step256", "step512"]
    + [f"step{k}000" for k in (1, 2, 3, 10, 38, 71, 107, 143)]
    + ["main"]
)
OLMO1 = ["step1000-tokens2B", "step2000-tokens4B", "step5000-tokens10B", "step11000-tokens23B", "step1454000-tokens3048B", "main"]
OLMO2_STAGE1 = ["stage1-step150-tokens1B", "stage1-step15000-tokens63B", "stage1-step842000-tokens3532B", "stage1-step928646-tokens3896B"]
OLMO2_STAGE2 = [f"stage2-ingredient{i}-step{s}-tokens{t}B" for i in (1, 2, 3) for s, t in ((1000, 5), (2000, 9), (6000, 26), (11931, 50))]
SMOLLM2 = [f"step-{k * 250000}" for k in range(1, 21)] + ["step-125000", "main"]
FINEWEB = ["step-000000-0BT", "step-001000-2BT", "step-010000-21BT", "step-100000-210BT", "step-167000-350BT", "main"]
MEGATRON = ["iter_0002400", "iter_0012000", "iter_0373000", "iter_0000200"]
HF_TRAINER = ["checkpoint-500", "checkpoint-1000", "checkpoint-10000", "checkpoint-5000"]


def shuffled(names, seed=0):
    out = list(names)
    random.Random(seed).shuffle(out)
    return out


@pytest.mark.parametrize(
    "names, steps",
    [
        (PYTHIA, [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000, 2000, 3000, 10000, 38000, 71000, 107000, 143000]),
        (OLMO1, [1000, 2000, 5000, 11000, 1454000]),
        (SMOLLM2, [125000] + [k * 250000 for k in range(1, 21)]),
        (FINEWEB, [0, 1000, 10000, 100000, 167000]),
        (MEGATRON, [200, 2400, 12000, 373000]),
        (HF_TRAINER, [500, 1000, 5000, 10000]),
    ],
    ids=["pythia", "olmo1", "smollm2", "fineweb", "megatron", "hf-trainer"],
)
def test_each_scheme_parses_steps_and_orders_by_them_with_main_left_out(names, steps):
    ordered = training_order(shuffled(names))
    assert [revision_step(n) for n in ordered if revision_step(n) is not None] == steps
    assert [n for n in ordered if revision_step(n) is None] == (["main"] if "main" in names else [])  # step-less last
    # --log-spaced keeps N of the steps of any scheme (it returned nothing for step-N names), never main
    picked = select_log_spaced(shuffled(names), 4)
    assert len(picked) == 4 and "main" not in picked
    assert revision_step(picked[0]) == steps[0] and revision_step(picked[-1]) == steps[-1]
    from sinkwatch.replay import parse_revisions

    revs = parse_revisions(shuffled(names))
    assert [r.step for r in revs if r.step is not None] == steps


def test_tokens_from_the_name_in_every_unit_people_use():
    assert revision_tokens("step11000-tokens23B") == 23 * B
    assert revision_tokens("step-001000-2BT") == 2 * B and revision_tokens("step-167000-350BT") == 350 * B
    assert revision_tokens("step-000000-0BT") == 0
    assert revision_tokens("stage1-step928646-tokens3896B") == 3896 * B
    assert revision_tokens("iter_0373000", 4 * 1024 * 1024) == 373000 * 4 * 1024 * 1024  # step x tokens per step
    assert revision_tokens("checkpoint-1000") is None  # no tokens in the name, none given
    assert revision_step("iter_0373000") == 373000 and revision_step("checkpoint-1000") == 1000 and revision_step("step-0") == 0
    for name in ("main", "v1.0", "stage1", "refs/pr/1", "stepwise"):
        assert revision_step(name) is None, name


def test_olmo2_ingredients_are_parallel_runs_whose_tokens_continue_from_the_end_of_stage1():
    from sinkwatch.replay import parse_revision, parse_revisions

    revs = parse_revisions(shuffled(OLMO2_STAGE1 + OLMO2_STAGE2 + ["main"]))
    by = {r.name: r for r in revs}
    # stage 1 is the main trajectory; each ingredient is its own run, after stage 1 in training order
    assert [r.name for r in revs if r.run is None and r.step is not None] == OLMO2_STAGE1
    for i in (1, 2, 3):
        run = [r for r in revs if r.run == f"stage2-ingredient{i}"]
        assert [r.step for r in run] == [1000, 2000, 6000, 11931]
        assert [r.stage for r in run] == [2] * 4
        # stage 2's names count from the start of stage 2: 3896B (stage 1's end) + 5B ... + 50B
        assert [r.tokens for r in run] == [(3896 + t) * B for t in (5, 9, 26, 50)]
    order = [r.name for r in revs]
    assert order.index("stage1-step928646-tokens3896B") < min(order.index(n) for n in OLMO2_STAGE2)
    assert order[-1] == "main" and by["main"].step is None and by["main"].run is None
    assert by["stage1-step15000-tokens63B"].tokens == 63 * B and by["stage1-step15000-tokens63B"].stage == 1
    # OLMo-2-0425-1B: the same scheme at another size
    one_b = parse_revisions(
        ["stage2-ingredient1-step23852-tokens51B", "stage1-step1907359-tokens4001B", "stage2-ingredient1-step2000-tokens5B"]
    )
    assert [(r.name, r.tokens) for r in one_b] == [
        ("stage1-step1907359-tokens4001B", 4001 * B),
        ("stage2-ingredient1-step2000-tokens5B", 4006 * B),
        ("stage2-ingredient1-step23852-tokens51B", 4052 * B),
    ]
    # each ingredient's stages are derived over stage 1 and then its own revisions, never another ingredient's
    from sinkwatch.replay.revisions import lineage

    two = [r.name for r in lineage(revs, "stage2-ingredient2")]
    assert two == OLMO2_STAGE1 + [n for n in OLMO2_STAGE2 if "ingredient2" in n]
    assert [r.name for r in lineage(revs, None)] == OLMO2_STAGE1
    # log-spaced selection happens within each run: the ingredients are not mixed into stage 1's steps
    picked = [parse_revision(n) for n in select_log_spaced(shuffled(OLMO2_STAGE1 + OLMO2_STAGE2), 2)]
    assert sorted((r.run or "", r.step) for r in picked) == sorted(
        [("", 150), ("", 928646)] + [(f"stage2-ingredient{i}", s) for i in (1, 2, 3) for s in (1000, 11931)]
    )


def test_stage2_tokens_are_unknown_without_stage1_and_olmo3_names_without_tokens_use_tokens_per_step():
    from sinkwatch.replay import parse_revisions

    alone = parse_revisions(["stage2-ingredient2-step2000-tokens9B"])
    assert alone[0].tokens is None and alone[0].step == 2000  # never 9B drawn as if training had started there
    olmo3 = parse_revisions(
        ["stage1-step337000", "stage1-step656000", "stage2-ingredient1-step0", "stage2-ingredient1-step7000"], tokens_per_step=1000
    )
    assert [(r.name, r.run, r.tokens) for r in olmo3] == [
        ("stage1-step337000", None, 337_000_000),
        ("stage1-step656000", None, 656_000_000),
        ("stage2-ingredient1-step0", "stage2-ingredient1", 656_000_000),
        ("stage2-ingredient1-step7000", "stage2-ingredient1", 663_000_000),
    ]


def test_a_recipe_revision_pattern_names_any_other_scheme(tmp_path):
    """Lucie-7B publishes ``step0050000`` and a continued run ``extension_step0001220``: with the
    default schemes the extension's step would interleave with the main run; a recipe pattern makes
    it its own run. Named groups: step, tokens, stage, run."""
    from sinkwatch.replay import parse_revision, parse_revisions

    recipe = tmp_path / "lucie.yaml"
    recipe.write_text("model: OpenLLM-France/Lucie-7B\nrevision_pattern: '(?:(?P<run>extension)_)?step(?P<step>\\d+)'\n")
    pattern = load_recipe(str(recipe)).revision_pattern
    names = [f"step{k * 50000:07d}" for k in range(1, 16)] + ["step0753851", "extension_step0001220", "main"]
    revs = parse_revisions(shuffled(names), pattern=pattern)
    assert [r.step for r in revs if r.run is None and r.step is not None] == [k * 50000 for k in range(1, 16)] + [753851]
    ext = [r for r in revs if r.run == "extension"]
    assert [(r.name, r.step) for r in ext] == [("extension_step0001220", 1220)]
    assert revs[-1].name == "main" and revs[-1].step is None
    # tokens and stage groups: Gaperon's ``step-024000_tokens-0100B-phase1``
    gaperon = parse_revision("step-024000_tokens-0100B-phase1", pattern=r"step-(?P<step>\d+)_tokens-(?P<tokens>\d+B)-phase(?P<stage>\d+)")
    assert (gaperon.step, gaperon.tokens, gaperon.stage) == (24000, 100 * B, 1)
    with pytest.raises(ValueError, match="named group"):
        load_recipe_text(tmp_path, "model: x/y\nrevision_pattern: 'step(\\d+)'\n")
    with pytest.raises(ValueError, match="not a valid regular expression"):
        load_recipe_text(tmp_path, "model: x/y\nrevision_pattern: 'step(?P<step>\\d+'\n")


def load_recipe_text(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return load_recipe(str(path))


def test_user_recipes_live_in_a_recipe_directory_named_by_an_environment_variable(tmp_path, monkeypatch):
    from sinkwatch.replay import is_recipe, packaged_recipes

    (tmp_path / "smollm2-1.7b.yaml").write_text(
        "model: HuggingFaceTB/SmolLM2-1.7B-intermediate-checkpoints\nlog_spaced: 8\ntokens_per_step: 2097152\n"
    )
    assert not is_recipe("smollm2-1.7b")
    monkeypatch.setenv("SINKWATCH_RECIPES", str(tmp_path))
    assert is_recipe("smollm2-1.7b") and "smollm2-1.7b" in packaged_recipes()
    r = load_recipe("smollm2-1.7b")
    assert r.model == "HuggingFaceTB/SmolLM2-1.7B-intermediate-checkpoints" and r.name == "smollm2-1.7b" and r.log_spaced == 8
    assert load_recipe("pythia-1b").model == "EleutherAI/pythia-1b"  # the packaged ones still load
    monkeypatch.setenv("SINKWATCH_RECIPES", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="SINKWATCH_RECIPES"):
        load_recipe("smollm2-1.7b")


# ---- the selection rule a replay runs (select_revisions: the manifest's, and the plan's) ----------------------------
def _refs(names):
    return {n: f"{i:040x}" for i, n in enumerate(names)}


def test_the_selection_is_every_revision_with_a_step_or_the_named_ones_and_main_is_an_alias():
    from sinkwatch.replay import select_revisions

    refs = _refs(PYTHIA)
    sel = select_revisions(refs)
    assert [r.name for r in sel.chosen] == [n for n in PYTHIA if n != "main"]  # training order; no stepless ref
    assert [r.name for r in sel.aliases] == ["main"] and "main" not in {r.name for r in sel.listed}
    assert all(r.commit == refs[r.name] for r in sel.chosen)
    named = select_revisions(refs, ["step1000", "main"])  # a named stepless ref is measured (last), no alias
    assert [r.name for r in named.chosen] == ["step1000", "main"] and named.aliases == []
    assert "step143000" in {r.name for r in named.listed}  # the whole run stays listed (duplicate groups)
    picked = select_revisions(refs, log_spaced=4)
    assert [r.name for r in picked.chosen] == [r.name for r in select_log_spaced(sel.chosen, 4)]


def test_a_commit_id_is_40_lowercase_hex_digits_and_a_ref_of_that_spelling_is_its_ref():
    from sinkwatch.models.hub import is_commit_id
    from sinkwatch.replay import select_revisions

    commit = "0123456789abcdef0123456789abcdef01234567"
    refs = _refs(["step10", "step20"])
    by = {r.name: r for r in select_revisions(refs, ["step10", commit, commit.upper()]).chosen}
    assert by[commit].commit == commit  # fetched by itself
    assert by[commit.upper()].commit is None  # not the hub's spelling: no commit (it would be a second done key)
    assert by["step10"].commit == refs["step10"]
    branch = "deadbeef" * 5  # a branch whose name looks like a commit: resolved as the branch
    refs[branch] = "f" * 40
    assert {r.name: r.commit for r in select_revisions(refs, [branch]).chosen} == {branch: "f" * 40}
    assert is_commit_id(commit) and not is_commit_id(commit.upper()) and not is_commit_id(commit[:39]) and not is_commit_id("main")


def test_a_local_run_lists_every_checkpoint_and_has_no_aliases():
    from sinkwatch.replay import Revision, select_revisions

    local = [Revision("checkpoint-10", step=10), Revision("checkpoint-20", step=20), Revision("final")]
    sel = select_revisions(local)
    assert sel.listed == local and sel.aliases == [] and [r.name for r in sel.chosen] == ["checkpoint-10", "checkpoint-20"]
    assert [r.name for r in select_revisions(local, ["final"]).chosen] == ["final"]
