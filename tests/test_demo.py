"""`sinkwatch demo` with a reduced step count: records, events and a report that agree."""


from sinkwatch.cli import main
from sinkwatch.demo import DemoWindows, stdlib_bytes
from sinkwatch.reporting.jsonl import read_jsonl


def test_demo_writes_records_and_a_consistent_report(tmp_path, capsys):
    """`sinkwatch demo` writes records at every probe step and a report whose rows and figures match them."""
    out = tmp_path / "demo"
    out.mkdir()
    earlier = '{"model": "an earlier demo", "step": 0, "n_layers": 3}\n'
    (out / "records.jsonl").write_text(earlier)  # an earlier run's store: kept, moved aside, never deleted
    assert main(["demo", "--steps", "40", "--every", "20", "--out", str(out), "--wandb", "offline"]) == 0
    printed = capsys.readouterr().out
    assert "report:" in printed and str(out / "report" / "report.md") in printed
    records = read_jsonl(out / "records.jsonl")
    assert [r["step"] for r in records] == [0, 20, 40]
    assert [r["tokens"] for r in records] == [0, 20 * 16 * 128, 40 * 16 * 128]
    assert records[0]["probe"] == "natural+induction+repeated"
    report = (out / "report" / "report.md").read_text()
    for r in records:  # one table row per record, with its numbers
        assert f"| {r['step']} |" in report
    for png in ("sink_rate.png", "induction_score_and_icl.png", "stage_timeline.png", "sink_and_induction_heads.png"):
        assert (out / "report" / png).stat().st_size > 5000
    assert list((out / "report").glob("heatmap_*_step40_sink_alpha.png"))
    assert list((out / "wandb").glob("offline-run-*"))  # a real offline W&B run
    (aside,) = (out / "earlier-runs").iterdir()
    assert (aside / "records.jsonl").read_text() == earlier


def test_demo_data_is_deterministic_and_half_periodic():
    """Demo windows are seeded, about half periodic, and bytes."""
    corpus = stdlib_bytes(limit=200_000)
    a, b = DemoWindows(corpus, 200, seed=3), DemoWindows(corpus, 200, seed=3)
    assert all((a[i] == b[i]).all() for i in range(0, 200, 17))
    periodic = sum(1 for i in range(200) if any((a[i][p:] == a[i][:-p]).all() for p in range(8, 64)))
    assert 70 <= periodic <= 130
    assert int(corpus.max()) < 256
