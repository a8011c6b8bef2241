"""What the README promises on its first screen, checked: its length, its test command, its probe
cost, and that no text in the repository points at a file users do not have."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_the_quick_start_fits_in_60_lines():
    section = README[README.index("## Quick start") : README.index("\n## ", README.index("## Quick start") + 1)]
    assert len(section.rstrip().splitlines()) <= 60


def test_the_readme_test_command_is_what_ci_runs():
    """`.ci/run` is one call of scripts/test.sh with the README's flags."""
    (readme_cmd,) = re.findall(r"```bash\n(bash scripts/test\.sh[^\n]*)\n```", README)
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert len(ci) == 1 and ci[0].startswith('exec bash "$(dirname "$0")/../scripts/test.sh"')
    assert ci[0].split("scripts/test.sh\"", 1)[1].split("#")[0].split() == readme_cmd.split()[2:]


def test_the_probe_cost_is_the_default_probes_tokens():
    """The README's tokens per probe are the live default probe sets' (and the BOS-free twin's) sizes."""
    from sinkwatch.probes import LIVE_PROBES

    sizes = [n * t for n, t in LIVE_PROBES.values()]
    n_nat, t_nat = LIVE_PROBES["natural"]
    total = sum(sizes) + n_nat * (t_nat - 1)  # the twin: the natural windows without their first token
    flat = " ".join(README.split())
    assert f"At the defaults, {total:,} tokens" in flat
    for label, kind in (("induction", "induction"), ("repeated-random", "repeated"), ("natural windows", "natural")):
        n, t = LIVE_PROBES[kind]
        assert f"{label} {n} × {t}" in flat, (label, n, t)
    assert f"a {n_nat} × {t_nat - 1} BOS-free twin" in flat

def test_no_text_points_at_the_design_contract_users_do_not_have():
    """Code, docs, tests and recipes cite the repository's own docs (docs/design.md), never `SPEC §N`."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    bad = []
    for name in files:
        path = ROOT / name
        if path.is_symlink() or path.suffix not in {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt", ""}:
            continue
        text = path.read_text(errors="replace")
        if name != "tests/test_front_door.py" and re.search(r"SPEC §|\.\./shared/", text):
            bad.append(name)
    assert not bad, f"files citing SPEC or ../shared: {bad}"
