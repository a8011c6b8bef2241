"""ReplayOptions: every replay option declared once, behind the CLI, ``replay``, ``replay_plan`` and the engines' unit."""

import dataclasses

import pytest

from sinkwatch.cli import FETCH_FLAGS, build_parser, from_args
from sinkwatch.replay import FetchConfig, ReplayOptions, replay, replay_plan
from sinkwatch.replay.options import PLAN, REPLAY

FIELDS = {f.name: f for f in dataclasses.fields(ReplayOptions)}
# options a Python caller gives as one object; the CLI gives their parts (probe options, FETCH_FLAGS) or none
PYTHON_ONLY = {"probes", "monitor_config", "fetch"}


def _replay_parser():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices["replay"]


def test_every_option_is_a_flag_of_sinkwatch_replay_and_the_flags_fill_the_options():
    flags = {s: a for a in _replay_parser()._actions for s in a.option_strings}
    for name, f in FIELDS.items():
        assert f.metadata["help"], f"ReplayOptions.{name} has no help"
        if name in PYTHON_ONLY:
            assert f.metadata["flag"] is None
            continue
        action = flags[f.metadata["flag"]]  # a KeyError here: a field the CLI does not offer
        assert action.dest == name and f.metadata["help"] in action.help
        if f.metadata["only"] == PLAN:
            assert action.help.startswith("with --plan")
    for flag, *_ in FETCH_FLAGS:
        assert flag in flags
    argv = ["replay", "org/m", "--revisions", "step1,step2", "--out", "o", "--dtype", "float16", "--device", "cpu",
            "--shard", "1/4", "--cache-dir", "c", "--tokens-per-step", "7", "--batch-tokens", "64", "--protocol", "sinkwatch",
            "--wandb", "online", "--no-progress", "--no-ablate", "--ablation-revision", "step2", "--skip-duplicates",
            "--max-memory", "1GiB", "--workers", "3", "--bandwidth", "50", "--tflops", "2", "--rewrite-manifest", "--keep-cache",
            "--cache-root", "r", "--no-prefetch", "--retries", "2", "--plan"]  # fmt: skip
    o = from_args(build_parser().parse_args(argv), wandb="online")
    assert o == ReplayOptions(
        revisions=("step1", "step2"), out_dir="o", dtype="float16", device="cpu", shard=(1, 4), cache_dir="c", tokens_per_step=7,
        batch_tokens=64, protocol="sinkwatch", wandb="online", progress=False, ablate=False, ablation_revision="step2",
        skip_duplicates=True, max_memory="1GiB", workers=3, bandwidth_mb_s=50.0, tflops=2.0, rewrite_manifest=True,
        fetch=FetchConfig(keep_cache=True, cache_root="r", prefetch=False, retries=2),
    )  # fmt: skip
    # nothing given: the recipe's values (None) and FetchConfig's defaults
    bare = from_args(build_parser().parse_args(["replay", "org/m"]), out_dir="runs/m", wandb="offline")
    assert bare == ReplayOptions(out_dir="runs/m", wandb="offline")


def test_replay_and_the_plan_refuse_an_unknown_option_or_one_the_other_reads(tmp_path):
    with pytest.raises(TypeError, match="unknown option.*revison.*the options of a replay are: revisions"):
        replay("org/m", out_dir=tmp_path, revison="step1")
    with pytest.raises(TypeError, match=r"replay\(\) does not read workers \(an option of replay_plan"):
        replay("org/m", out_dir=tmp_path, workers=4)
    with pytest.raises(TypeError, match=r"replay_plan\(\) does not read wandb \(an option of replay \(sinkwatch replay\)\)"):
        replay_plan("org/m", out_dir=tmp_path, wandb="online")
    with pytest.raises(TypeError, match="options must be a ReplayOptions"):
        replay("org/m", options={"out_dir": tmp_path})
    assert {n for n, f in FIELDS.items() if f.metadata["only"] == REPLAY} == {"wandb", "progress", "ablate"}
    assert {n for n, f in FIELDS.items() if f.metadata["only"] == PLAN} == {"workers", "bandwidth_mb_s", "tflops"}


def test_keywords_lay_over_an_options_object_and_the_unit_reads_replays_options():
    base = ReplayOptions(out_dir="a", wandb="online", workers=2)
    o = ReplayOptions.given(base, {"out_dir": "b"}, reader=REPLAY, what="replay()")
    assert (o.out_dir, o.wandb, o.workers) == ("b", "online", 2)  # an object is taken whole, plan-only fields too
    unit = ReplayOptions.given(None, {"ablate": True, "progress": True, "revisions": ["step1"]}, reader="unit", what="finalize()")
    assert unit.ablate and unit.progress and unit.revisions == ("step1",)
    with pytest.raises(TypeError, match="tflops"):
        ReplayOptions.given(None, {"tflops": 1.0}, reader="unit", what="replay_revision()")
    assert o.loop(progress=True)["progress"] is True and ReplayOptions(progress=False).loop(progress=True)["progress"] is False


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"shard": "3/2"}, ValueError, "--shard must be K/N with 0 <= K < N"),
        ({"shard": (2, 2)}, ValueError, "0 <= K < N"),
        ({"shard": 3}, TypeError, "shard must be"),
        ({"log_spaced": 0}, ValueError, "log_spaced must be an int >= 1"),
        ({"log_spaced": True}, ValueError, "log_spaced must be an int >= 1"),
        ({"tokens_per_step": -1}, ValueError, "tokens_per_step must be"),
        ({"workers": 0}, ValueError, "workers must be"),
        ({"tflops": 0}, ValueError, "tflops must be a number > 0"),
        ({"protocol": "xu"}, ValueError, "protocol must be one of sinkwatch, paper"),
        ({"dtype": "float64"}, ValueError, "dtype must be one of float32, float16, bfloat16"),
        ({"wandb": "on"}, ValueError, "wandb must be one of"),
        ({"revisions": "step1"}, TypeError, "revisions must be a list"),
        ({"revisions": ["step1"], "log_spaced": 4}, ValueError, "not both"),
        ({"revisions": ["step1"], "all_revisions": True}, ValueError, "not both"),
        ({"probes": "induction"}, TypeError, "probes must be a list"),
        ({"ablate": "yes"}, TypeError, "ablate must be True, False or None"),
        ({"lightning_module": "pkg.Model"}, ValueError, "pkg.module:Class"),
        ({"max_memory": 1.5}, TypeError, "max_memory must be"),
        ({"fetch": {"retries": 2}}, TypeError, "fetch must be a FetchConfig"),
        ({"out_dir": None}, TypeError, "out_dir must be a path"),
    ],
)
def test_a_bad_option_is_refused_when_the_options_are_made(kwargs, error, match):
    with pytest.raises(error, match=match):
        ReplayOptions(**kwargs)


def test_options_are_normalised_once():
    o = ReplayOptions(shard="1/3", revisions=["step1"], fetch=None)
    assert o.shard == (1, 3) and o.revisions == ("step1",) and o.fetch == FetchConfig()
    assert ReplayOptions(shard=[0, 2]).shard == (0, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.out_dir = "elsewhere"
