"""The scaling analysis and the README: generated parts up to date, figures from records, planner estimates marked."""

from __future__ import annotations

import re
import shutil
import statistics

import pytest

from modelwright import REPO_ROOT, fmt
from modelwright.errors import ConfigError
from modelwright.record import get_path, read_records
from modelwright.report import readme, tables
from test_report import rec, write

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


ANALYSIS = REPO_ROOT / "docs" / "scaling-analysis.md"
SLUG = "cpu-amd-epyc-avx512-2cores"


def test_analysis_is_short_and_answers_the_six_questions():
    text = ANALYSIS.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 390  # the cost section and the longer answers included
    for question in ("What must fit in device memory during training, and which dominates here?",
                     "Why does mixed precision save both memory and time, and what did it save here?",
                     "What does gradient accumulation simulate, and why does it matter on a small GPU?",
                     "Data, tensor and pipeline parallelism: what are they and when is each needed?",
                     "What does gradient checkpointing trade for what?",
                     "Why does a 40% cut in memory matter beyond convenience?"):
        assert question in text
    for section in ("scaleout", "attention", f"cost:{SLUG}", f"predictions:{SLUG}"):
        assert f"<!-- {section}:start -->" in text
    assert "cpu-amd-epyc-avx2-2cores |" not in text  # the old model's AVX2 rows: one sentence now
    assert "per switch hop)" not in text and "out-of-sample test:" in text
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


def figure(text: str, name: str) -> str:
    """The value the document shows between ``<!-- v name -->`` and ``<!-- /v -->``."""
    (value,) = re.findall(rf"<!-- v {re.escape(name)} -->(.*?)<!-- /v -->", text)
    return value


def test_the_new_figures_of_the_analysis_agree_with_the_records():
    """Recomputed here from records.jsonl itself, not through the report's code."""
    text = ANALYSIS.read_text(encoding="utf-8")
    records = [record for record in read_records(REPO_ROOT / "results" / SLUG / "records.jsonl")
               if get_path(record, "study.kind") == "run" and record.get("status") == "ok"]
    by_run = {}
    for record in records:
        by_run.setdefault(record["study"]["name"], []).append(record)
    optimizer = statistics.median(r["memory"]["anatomy_mib"]["optimizer_state"] for r in by_run["baseline"])
    assert figure(text, "baseline.optimizer_zero1_8") == fmt.sig(optimizer / 8, suffix=" MiB")  # ZeRO-1, N = 8
    history = {name: group[0]["history"]["train/loss"] for name, group in by_run.items()}
    assert figure(text, "accumulate.last_loss") == fmt.sig(history["accumulate"][-1][1])
    assert figure(text, "baseline.last_loss") == fmt.sig(history["baseline"][-1][1])
    assert history["checkpointing-block"] == history["baseline"] != history["accumulate"]
    assert figure(text, "checkpointing-block.loss_match") == "bit-identical"
    steps = {name: statistics.median(r["timing"]["step_time_median_ms"] for r in group)
             for name, group in by_run.items()}
    assert figure(text, "checkpointing-block.time_change") == fmt.pct(
        steps["checkpointing-block"] / steps["baseline"] - 1, signed=True)
    # every paired ratio of a row lies within [min, max] of its interval's possible ends
    base = {r["study"]["repeat"]: r["timing"]["step_time_median_ms"] for r in by_run["baseline"]}
    paired = [r["timing"]["step_time_median_ms"] / base[r["study"]["repeat"]] for r in by_run["accumulate"]]
    low, high = figure(text, "accumulate.interval").split(" ")[0].rstrip("×").split("–")
    assert fmt.sig(min(paired)) == low and fmt.sig(max(paired)) == high  # 3 pairs: the range of their ratios


def test_the_cost_rows_follow_from_the_baselines_record_and_the_cited_prices():
    text = ANALYSIS.read_text(encoding="utf-8")
    records = read_records(REPO_ROOT / "results" / SLUG / "records.jsonl")
    baseline = next(r for r in records if get_path(r, "study.name") == "baseline" and r["status"] == "ok"
                    and get_path(r, "study.kind") == "run")
    epoch = next(r for r in records if get_path(r, "study.name") == "baseline" and get_path(r, "study.kind") == "epoch")
    section = text.split(f"<!-- cost:{SLUG}:start -->")[1].split(f"<!-- cost:{SLUG}:end -->")[0]
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in section.splitlines() if line.startswith("| ")}
    machine = rows["2 vCPU, this machine (measured)"]
    assert machine[2:4] == [fmt.duration(epoch["timing"]["epoch_time_s"]),
                            fmt.usd(epoch["timing"]["epoch_time_s"] / 3600 * 0.0816)]
    flops_per_sample = baseline["flops"]["flops_per_step"] / baseline["techniques"]["effective_batch_size"]
    mfu = 32.3e15 / 420 / 312e12  # airbench's ResNet-18 on one A100, over the A100's bf16 peak
    samples = epoch["timing"]["epoch_steps"] * 128
    for device, peak, price in (("A100 80GB", 312e12, 1.10), ("H100 SXM", 989.4e12, 2.50)):
        seconds = samples * flops_per_sample / (peak * mfu)
        assert rows[f"1 × {device}"][2:4] == [fmt.duration(seconds), fmt.usd(seconds / 3600 * price)]
        efficiency = float(rows[f"512 × {device}"][1].rstrip("%")) / 100
        assert efficiency < float(rows[f"8 × {device}"][1].rstrip("%")) / 100 < 1


def test_the_default_study_would_have_taken_no_extra_repeats():
    """The README says the default study's wall time stands under the extra-repeats rule: no default-plan row of
    the study it reports is undecided after its three repeats, so the rule adds no run there."""
    from modelwright.study import undecided
    from modelwright.study_rows import build_rows

    records = read_records(REPO_ROOT / "results" / SLUG / "records.jsonl")
    runs = [record for record in records if get_path(record, "study.kind") == "run"
            and get_path(record, "study.plan") == "configs/study/plan_default.yaml"]
    rows = [row for row in build_rows(runs) if row.ok and row.reference not in (None, row)]
    assert len(rows) == 5 and all(row.interval is not None for row in rows)
    assert [row.name for row in rows if undecided(row)] == []
    assert "after three repeats no row of the default plan was undecided" in (REPO_ROOT / "README.md").read_text()
