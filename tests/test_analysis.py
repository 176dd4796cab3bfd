"""The scaling analysis and the README: generated parts up to date, figures from records, planner estimates marked."""

from __future__ import annotations

import shutil

import pytest

from modelwright import REPO_ROOT
from modelwright.errors import ConfigError
from modelwright.report import readme, tables
from test_report import rec, write

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def test_analysis_is_short_and_answers_the_six_questions():
    text = (REPO_ROOT / "docs" / "scaling-analysis.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    for question in ("What must fit in device memory", "Why does mixed precision save",
                     "gradient accumulation simulate", "Data, tensor and pipeline parallelism",
                     "What does gradient checkpointing trade", "Why does a 40% cut in memory matter"):
        assert question in text
    for section in ("scaleout", "attention"):
        assert f"<!-- {section}:start -->" in text
    assert "On the 2-core CPU" not in text and "PR 86550" not in text  # one label for two machines; a PR is no doc


MARKED = [d for d in DOCS if ":start -->" in d.read_text(encoding="utf-8")]


@pytest.mark.parametrize("doc", MARKED, ids=lambda d: d.name)
def test_generated_sections_are_up_to_date(doc, tmp_path):
    copy = tmp_path / doc.relative_to(REPO_ROOT)
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(doc, copy)
    readme.write_sections(copy, readme.Sections(REPO_ROOT / "results", doc.parent))
    fresh = copy.read_text(encoding="utf-8")
    assert fresh == doc.read_text(encoding="utf-8"), "stale: run `uv run python -m modelwright report`"


def test_every_inline_figure_resolves_to_a_record():
    sections = readme.Sections(REPO_ROOT / "results", REPO_ROOT)
    names = {name for doc in DOCS for _, name in readme.figure_markers(doc.read_text(encoding="utf-8"), doc)}
    assert names
    for name in names:
        assert sections(name) not in ("–", ""), name


def test_scaleout_marks_every_estimate_and_grows_the_global_batch():
    record = rec("amp", 1000, 400, precision="bf16-mixed")
    record["flops"]["flops_per_step"] = 426e9
    record["memory"]["model_parameters"] = 11_173_962
    record["techniques"].update(optimizer="adamw")
    text = tables.scaleout_table(record)
    assert text is not None, "the record has what the planner needs: the table must be there"
    rows = [line.split("|")[1:-1] for line in text.splitlines()[2:] if line.startswith("| ")]
    assert [int(r[0]) for r in rows] == [1, 8, 512] and [int(r[1].replace(",", "")) for r in rows] == [128, 1024, 65536]
    assert rows[0][5].strip() == "5.5 ms (estimate)"  # 426 GFLOP at 32.3 PFLOP / 420 s, on an A100
    assert "A100 80GB" in text and "200 Gb/s HDR" in text  # the network of the GPU whose rate it is
    assert rows[1][6].strip() != "100% (estimate)"  # the last gradient bucket cannot hide behind backward
    assert all("(estimate)" in c for r in rows for c in r[3:])


def test_sections_without_results_say_so(tmp_path):
    folder = write(tmp_path / "results" / "cpu-x", [rec("baseline", 2000, 700)])
    (folder / "main_job.json").write_text('{"command": "uv run', encoding="utf-8")  # torn: read as absent
    sections = readme.Sections(tmp_path / "results", tmp_path)
    assert "Not measured yet" in sections("attention") and sections("unknown") is None
    assert sections("mainjob") == "No main-job measurement recorded yet."
    assert sections("overhead") == "No overhead measurement recorded yet."
    with pytest.raises(ConfigError, match="unknown field"):
        sections("v:cpu-x:baseline:nonsense")
    with pytest.raises(ConfigError, match="an inline figure is"):  # was a TypeError traceback
        sections("v:cpu-x:baseline")
