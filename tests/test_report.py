"""The report: table.md from a fixed records file, the row selection rules, plots and the README section."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from modelwright import report
from modelwright.errors import ConfigError
from modelwright.record import read_records

DATA = Path(__file__).resolve().parent / "data"
FIXTURE = DATA / "records_fixture.jsonl"
SLUG = "cpu-example-2cores"


@pytest.fixture
def records() -> list[dict]:
    return read_records(FIXTURE)


def test_table_md_matches_the_expected_text(records):
    expected = (DATA / "table_expected.md").read_text(encoding="utf-8")
    assert report.render_table_md(records, SLUG) == expected


def test_rows_take_the_latest_config_and_the_median_of_repeats(records):
    rows = {r.name: r for r in report.build_rows(records)}
    assert list(rows) == ["baseline", "amp", "checkpointing-block", "all"]  # plan order, stray record ignored
    amp = rows["amp"]
    assert amp.values["repeats"] == 2  # the superseded config's record is not among them
    assert amp.values["step_time_median_ms"] == pytest.approx(2950.0)  # median of 2900 and 3000
    assert amp.values["step_time_min_ms"] == 2800.0 and amp.values["step_time_max_ms"] == 3200.0
    assert amp.reference == "baseline" and rows["all"].reference == "baseline"
    assert not rows["checkpointing-block"].ok and rows["checkpointing-block"].status == "failed"
    assert rows["baseline"].values["epoch_s"] == pytest.approx(50_000 / 41.29)


def test_budget_rows_settle_on_the_last_attempt(records):
    rows = report.build_rows(records)
    budget = {b.name: b for b in report.build_budget_rows(records, rows)}
    assert budget["all"].attempts == 2 and budget["all"].probe and not budget["baseline"].probe
    assert budget["all"].predicted_batch == 470 and budget["all"].fits
    assert budget["all"].effective_batch == 470 * 4
    assert budget["all"].vs_reference == pytest.approx(470 / 76)
    assert budget["baseline"].measured_peak_mib <= budget["baseline"].budget_mib


def test_generate_writes_table_summary_plots_and_readme(tmp_path):
    out = tmp_path / "results" / SLUG
    out.mkdir(parents=True)
    shutil.copy(FIXTURE, out / "records.jsonl")
    readme = tmp_path / "README.md"
    readme.write_text("# Title\n\nSome text.\n", encoding="utf-8")
    written = report.generate(out, readme=readme)
    names = {p.name for p in written}
    assert names >= {"table.md", "summary.json", "README.md", *report.PLOTS}
    for name in report.PLOTS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    amp = next(r for r in summary["runs"] if r["name"] == "amp")
    assert amp["memory_vs_reference"] == pytest.approx(446.44 / 706.54, rel=1e-3)
    assert summary["process_time_s"] == pytest.approx(40 + 40 + 42 + 12.5 + 55 + 25 + 20 + 90 + 85)

    text = readme.read_text()
    assert text.startswith("# Title\n\nSome text.\n\n## Results\n\n<!-- results:start -->\n")
    assert f"![{report.PLOTS['step_time.png']}](results/{SLUG}/step_time.png)" in text
    assert "| amp | bf16-mixed, 128, AdamW for-loop | 446.4 | 0.63× |" in text
    assert "2-core CPU" in text and "torch 2.15.0" in text

    # Regenerating replaces the section in place and leaves the rest alone.
    readme.write_text(text.replace("Some text.", "Edited text.") + "\nAfter.\n")
    report.generate(out, readme=readme, plots=False)
    again = readme.read_text()
    assert again.count(report.START_MARKER) == 1 and again.endswith("<!-- results:end -->\n\nAfter.\n")
    assert "Edited text." in again


def test_update_readme_refuses_a_lone_marker(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- results:start -->\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="only one of the results markers"):
        report.update_readme(readme, "x\n")


def test_report_cli_names_a_missing_records_file(tmp_path, capsys):
    assert report.main([str(tmp_path / "nowhere"), "--no-readme"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "no records.jsonl" in err and err.count("\n") == 1
