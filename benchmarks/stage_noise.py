"""Probe-to-probe noise of every key the stage rules read, on real trajectories, and the hold bands it
asks for (docs/stages.md, "Noise and hysteresis").

    python benchmarks/stage_noise.py            # print the tables
    python benchmarks/stage_noise.py --write    # rewrite docs/stages.md's generated block

Noise: on each trajectory (the committed P0 trajectories, tests/data/p0_trajectories/*, and the
demo's induction runs, tests/data/induction_trajectories/*), the robust second-difference scale of
each key over consecutive probes, sigma = 1.4826 median|x[t+1] - 2 x[t] + x[t-1]| / sqrt(6): a
trend that is locally linear cancels, what is left is noise (a white series of sd s gives s). A
ratio (sink rate, norm ratio, selectivity) is measured on its log: its noise is relative.

Bands: a stage's hold rule moves each threshold by the timeline's hold factor f (docs/stages.md,
"Hold rules"); the band is that move, in the key's own units (log units for ratios), on its
narrower side. A band of at least ``K_SIGMA`` sigma keeps a reading that sits on a threshold from
leaving the stage on noise: with patience 2, two probes in a row beyond 3 sigma, ~2e-6 a probe.
The largest f whose bands all reach it is the noise's bound on the hold factor.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common, when loaded from elsewhere (the tests)
from common import generated_block  # noqa: E402

from sinkwatch import StageConfig  # noqa: E402
from sinkwatch.stages import _Lean, circuit, judged_view  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "stages.md"
K_SIGMA = 3.0
FACTORS = tuple(round(0.3 + 0.05 * i, 2) for i in range(14))  # 0.3 ... 0.95


TIMELINE_DATA = {"p0": "p0_trajectories", "induction": "induction_trajectories"}  # each timeline's keys on its own runs


def trajectories(timeline: str) -> dict[str, list[dict]]:
    out = {}
    for path in sorted((ROOT / "tests" / "data" / TIMELINE_DATA[timeline]).glob("*/records.jsonl")):
        out[path.parent.name] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def robust_sigma(xs, near=None) -> float | None:
    """1.4826 median|second difference| / sqrt(6) over consecutive finite values; with ``near``, only the
    triples whose middle value it accepts (the region where the threshold decides). None below 3 triples."""
    x = np.asarray([np.nan if v is None or not math.isfinite(v) else v for v in xs], dtype=float)
    middles = [i for i in range(1, len(x) - 1) if np.isfinite(x[i - 1 : i + 2]).all() and (near is None or near(x[i]))]
    d2 = [x[i + 1] - 2 * x[i] + x[i - 1] for i in middles]
    if len(d2) < 3:
        return None
    return float(1.4826 * np.median(np.abs(d2)) / math.sqrt(6))


@dataclass(frozen=True)
class Key:
    """A key the rules read: how to get it from a record, its threshold, and how the hold rule moves it."""

    name: str
    timeline: str
    threshold: str  # the StageConfig field
    log: bool = False  # noise and band in log units (a ratio)
    kind: str = "plain"  # how _Lean moves the threshold: plain | unit (a fraction) | ratio (a norm ratio)


def p0_numbers(record: dict, cfg: StageConfig) -> dict:
    anchor, view = judged_view(record)
    if view.get("sink_profile") is None or view.get("p0_norm_ratio") is None:
        return {}
    profile = np.nan_to_num(np.asarray(view["sink_profile"], dtype=float))
    top = float(profile.max())
    second = float(np.sort(profile)[-2]) if profile.size > 1 else 0.0
    c = circuit(view, cfg, bos=anchor == "bos")
    e = c["p0_emergence_block"]
    rho = view["p0_norm_ratio"]
    cons = view.get("p0_direction_consistency_centered")
    return {
        "sink_top": top if top >= cfg.sink_rate_floor else None,  # below the floor there is no sink to be noisy about
        "second_ratio": second / top if top >= cfg.sink_rate_floor else None,
        "concentration": c["p0_concentration"] if e is not None else None,
        "rho_e": rho[e] if e is not None else None,
        "persistence": c["p0_persistence"] if e is not None else None,
        "consistency": cons[e] if e is not None and cons is not None and anchor != "bos" else None,
    }


def induction_numbers(record: dict) -> dict:
    out = {}
    if "selectivity" in record:
        sel = np.nan_to_num(np.asarray(record["selectivity"]["induction"], dtype=float), nan=0.0)
        out["selectivity_max"] = float(sel.max()) if sel.max() > 0 else None
    if record.get("induction_score") is not None:
        out["prefix_score_max"] = float(np.nanmax(np.asarray(record["induction_score"], dtype=float)))
    if record.get("icl_score") is not None:
        out["icl_score"] = float(record["icl_score"])
    return out


KEYS = (
    Key("sink_top", "p0", "established_sink_rate", log=True, kind="unit"),
    Key("sink_top", "p0", "sink_rate_floor", log=True, kind="unit"),
    Key("second_ratio", "p0", "second_sink_ratio", kind="unit"),
    Key("concentration", "p0", "final_min_concentration", kind="unit"),
    Key("rho_e", "p0", "circuit_min_norm_ratio", log=True, kind="ratio"),
    Key("persistence", "p0", "circuit_min_persistence", kind="unit"),
    Key("consistency", "p0", "circuit_min_consistency", kind="unit"),
    Key("selectivity_max", "induction", "formed_min_selectivity", log=True),
    Key("selectivity_max", "induction", "forming_min_selectivity", log=True),
    Key("prefix_score_max", "induction", "prefix_min_score"),
    Key("icl_score", "induction", "prefix_max_icl"),
)


def band(key: Key, t: float, f: float) -> float:
    """The hold rule's move of threshold ``t`` at factor ``f``, on its narrower side, in the key's units."""
    lean = _Lean(f)
    moves = [lean.move(t, want, unit=key.kind == "unit", ratio=key.kind == "ratio") for want in (True, False)]
    if key.log:
        sides = [abs(math.log(m) - math.log(t)) for m in moves if m > 0]
    else:
        sides = [abs(m - t) for m in moves]
    return min(sides)


def measure() -> tuple[list[dict], dict[str, float]]:
    cfg = StageConfig()
    runs = {t: trajectories(t) for t in TIMELINE_DATA}
    rows, bound = [], {"p0": 1.0, "induction": 1.0}
    for key in KEYS:
        t = getattr(cfg, key.threshold)
        sigmas = {}
        for name, records in runs[key.timeline].items():
            nums = [p0_numbers(r, cfg) if key.timeline == "p0" else induction_numbers(r) for r in records]
            xs = [n.get(key.name) for n in nums]
            if key.log:
                xs = [math.log(x) if x is not None and x > 0 else None for x in xs]
            s = robust_sigma(xs, None if key.timeline == "p0" else near(key, t))
            if s is not None:
                sigmas[name] = s
        if not sigmas:
            rows.append({"key": key.name, "timeline": key.timeline, "threshold": f"{key.threshold} = {t:g}", "log": key.log,
                         "sigma": None, "worst": None, "n_runs": 0, "band_at_default": None, "f_max": None})  # fmt: skip
            continue
        worst = max(sigmas, key=sigmas.get)
        ok = [f for f in FACTORS if band(key, t, f) >= K_SIGMA * sigmas[worst]]
        f_max = max(ok) if ok else None
        bound[key.timeline] = min(bound[key.timeline], f_max if f_max is not None else 0.0)
        rows.append({
            "key": key.name, "timeline": key.timeline, "threshold": f"{key.threshold} = {t:g}", "log": key.log,
            "sigma": sigmas[worst], "worst": worst, "n_runs": len(sigmas),
            "band_at_default": band(key, t, cfg.p0_hold_factor if key.timeline == "p0" else cfg.hold_factor),
            "f_max": f_max,
        })  # fmt: skip
    return rows, bound


def near(key: Key, t: float):
    """The induction keys' decision region: the demo's runs cross their thresholds in a probe or two and then
    sit far from them (ICL at -4, where its jitter is 0.3 nats and decides nothing), so their noise is taken
    where the threshold decides: within a factor 3 of it for a ratio (log units), within |t| of it otherwise."""
    if key.log:
        return lambda x: abs(x - math.log(t)) <= math.log(3)
    return lambda x: abs(x - t) <= abs(t)


def table(rows: list[dict], bound: dict[str, float]) -> str:
    cfg = StageConfig()
    lines = [
        f"| key | threshold | noise σ (largest, which run; of n) | band at the default f | largest f with band ≥ {K_SIGMA:g}σ |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        unit = " (log)" if r["log"] else ""
        if r["sigma"] is None:
            lines.append(f"| `{r['key']}`{unit} | `{r['threshold']}` | not measured: no run comes near it | – | – |")
            continue
        f_max = f"none ≥ {FACTORS[0]:g}" if r["f_max"] is None else f"{r['f_max']:g}"
        lines.append(
            f"| `{r['key']}`{unit} | `{r['threshold']}` | {r['sigma']:.4f} ({r['worst']}; of {r['n_runs']}) | "
            f"{r['band_at_default']:.4f} | {f_max} |"
        )
    lines += [
        "",
        f"Noise bound on the hold factor: P0 ≤ {bound['p0']:g} (default `p0_hold_factor` = {cfg.p0_hold_factor:g}); "
        f"induction ≤ {bound['induction']:g} (default `hold_factor` = {cfg.hold_factor:g}).",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="rewrite docs/stages.md's generated block")
    a = ap.parse_args(argv)
    block = table(*measure())
    if a.write:
        DOC.write_text(generated_block(DOC, "noise", block))
    else:
        sys.stdout.write(block + "\n")


if __name__ == "__main__":
    main()
