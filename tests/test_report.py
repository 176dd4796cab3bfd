"""The report: rows from records against hand-computed figures, the noise verdict, provenance, the marker writer."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from modelwright import fmt, report, study_rows
from modelwright.__main__ import main as cli
from modelwright.errors import ConfigError
from modelwright.record import read_records
from modelwright.report import readme, tables

DATA = Path(__file__).resolve().parent / "data"
FIXTURE = DATA / "records_fixture.jsonl"


def rec(name: str, step_ms: float, peak: float, repeat: int = 0, index: int = 0, commit: str | None = "c0ffee",
        definitions: int = 3, precision: str = "32-true", compile_: bool = False, loss=(2.4, 2.3, 2.2, 2.1)) -> dict:
    """A minimal study record: every figure the tests check is set here by hand."""
    r = {
        "status": "ok", "run_id": f"{name}-r{repeat}",
        "techniques": {"model_name": "resnet18", "precision": precision, "micro_batch_size": 128,
                       "accumulate_grad_batches": 1, "effective_batch_size": 128, "compile": compile_,
                       "world_size": 1, "optimizer_impl": "torch.optim.AdamW[for-loop]"},
        "hardware": {"accelerator": "cpu", "device_name": "Example CPU", "cpu_model": "Example CPU", "cpu_cores": 2},
        "versions": {"torch": "2.15.0", "lightning": "2.6.6", "python": "3.11.7"},
        "timing": {"step_time_median_ms": step_ms, "samples_per_s": 128e3 / step_ms},
        "flops": {"mfu": 0.5, "peak_flops_per_s": 2e11, "achieved_flops_per_s": 1e11},
        "memory": {"peak_allocated_mib": peak, "anatomy_mib": {"parameters": 40.0, "gradients": 40.0,
                   "optimizer_state": 80.0, "activations": peak - 160.0, "temporaries": 0.0, "total": peak}},
        "history": {"train/loss": [[i + 1, v] for i, v in enumerate(loss)]},
        "study": {"name": name, "kind": "run", "index": index, "repeat": repeat, "config_hash": name,
                  "process_wall_s": 10.0, "warmup_steps": 1, "measured_steps": 10, "plan": "plan.yaml"},
    }
    if commit:
        r["provenance"] = {"commit": commit, "dirty": False, "command": "uv run python -m modelwright study",
                           "definitions": definitions}
    return r


def small_study() -> list[dict]:
    """Baseline repeats 2000/2100/2200 ms: median 2100, spread 200/2100 = 9.5%."""
    return [rec("baseline", 2000, 700, 0), rec("baseline", 2100, 700, 1), rec("baseline", 2200, 700, 2),
            rec("fused", 2150, 690, 0, index=1), rec("fused", 2150, 690, 1, index=1),
            rec("amp", 1400, 350, 0, index=2, precision="bf16-mixed"),
            rec("amp", 1600, 350, 1, index=2, precision="bf16-mixed"),
            rec("checkpointing-block", 2600, 500, 0, index=3), rec("checkpointing-block", 2500, 500, 1, index=3),
            rec("compile", 2100, 700, 0, index=4, compile_=True),
            rec("short", 2100, 700, 0, index=5, loss=(2.4, 2.3, 2.2))]


def write(folder: Path, records: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return folder


def cells(text: str, run: str) -> list[str]:
    line = next(x for x in text.splitlines() if x.startswith(f"| {run} "))
    return [c.strip() for c in line.strip("|").split("|")]


def test_main_table_rows_match_hand_computed_figures():
    rows = study_rows.build_rows(small_study())
    text = tables.main_table(rows)
    base = cells(text, "baseline")
    assert base[2:9] == ["700", "1.0×", "2,100", "2,000–2,200 (3)", "1.0×", "reference", "no measurable change"]
    # fused's repeats, 2150 and 2150, against the baseline's of the same rounds, 2000 and 2100: slower in both
    assert cells(text, "fused")[6:9] == ["1.02×", "1.02–1.07× (2 pairs)", "slower"]
    fast = cells(text, "amp")
    assert fast[2:9] == ["350", "0.50×", "1,500", "1,400–1,600 (2)", "0.71×", "0.700–0.762× (2 pairs)", "faster"]
    assert cells(text, "checkpointing-block")[6:9] == ["1.2×", "1.19–1.30× (2 pairs)", "slower"]  # 2600/2000, 2500/2100
    assert cells(text, "compile")[2] == "not measured"  # the tracker saw eager code
    assert base[10] == "50%" and "| MFU |" in text
    assert base[11:13] == ["not measured", "not measured"]  # no epoch record: no time or cost per epoch
    assert base[14] == "2.20"  # mean loss of steps 2..4: (2.3 + 2.2 + 2.1) / 3
    assert cells(text, "short")[14] == "–"  # 3 steps × 128 samples ≠ the baseline's 4 × 128


def test_verdict_needs_the_baselines_repeat_spread():
    band = study_rows.SpreadBand(-0.076, 0.070)  # repeats 2,800 and 3,240 about a median of 3,030
    assert study_rows.verdict(1.07, band) == "no measurable change"  # was "slower" when 3 steps of one run decided
    assert study_rows.verdict(0.93, band) == "no measurable change"
    assert study_rows.verdict(0.92, band) == "faster" and study_rows.verdict(1.08, band) == "slower"
    assert study_rows.verdict(0.56, None) == "no verdict: 1 repeat"


def test_the_band_is_the_repeats_min_and_max_about_their_median_not_twice_it():
    """The committed baseline's repeats, 3,241 / 3,030 / 2,799 ms, spread -7.6% / +7.0% about their median:
    (max − min) / median would call it ±15%."""
    steps = (3241.47, 3030.14, 2799.26)
    records = [rec("baseline", ms, 700, repeat) for repeat, ms in enumerate(steps)]
    records += [rec("accumulate", 3030.14 * 1.10, 320, repeat, index=1) for repeat in range(3)]
    rows = {row.name: row for row in study_rows.build_rows(records)}
    band = rows["baseline"].band
    assert (band.low, band.high) == (pytest.approx(2799.26 / 3030.14 - 1), pytest.approx(3241.47 / 3030.14 - 1))
    assert band.text() == "-7.6% / +7.0%"
    # 1.10× the baseline leaves the band (+7.0%); the doubled band (±15%) would have called it no change
    assert rows["accumulate"].verdict == "slower"


def test_a_baseline_of_one_repeat_gives_no_verdict():
    text = tables.main_table(study_rows.build_rows([rec("baseline", 2000, 700), rec("amp", 1000, 400, index=1)]))
    assert cells(text, "amp")[5:9] == ["– (1 repeat)", "0.50×", "– (1 repeat)", "no verdict: 1 repeat"]


def test_mixed_commits_are_refused_in_one_line_unless_allowed(tmp_path):
    records = small_study()
    records[3]["provenance"]["commit"] = "deadbeef"
    records[4]["provenance"]["definitions"] = 2  # older definitions: a group of their own
    folder = write(tmp_path / "results" / "cpu-x", records)
    with pytest.raises(ConfigError) as err:
        report.generate(folder, plots=False)
    message = str(err.value)
    assert "\n" not in message and "records.jsonl" in message and "3 commits/definitions" in message
    report.generate(folder, plots=False, allow_mixed=True)
    table = (folder / "table.md").read_text()
    assert "| fused [b,c] |" in table and "| baseline [a] |" in table and "- [c] commit c0ffee, definitions 2" in table


def test_cli_exit_status_and_one_line_error(tmp_path, capsys):
    records = small_study()
    records[0]["provenance"]["definitions"] = 1
    write(tmp_path / "results" / "cpu-x", records)
    doc = tmp_path / "README.md"
    doc.write_text("<!-- figures: cpu-x -->\nx <!-- v amp.time --><!-- /v --> <!-- v amp.verdict --><!-- /v -->\n",
                   encoding="utf-8")
    args = ["report", "--results", str(tmp_path / "results"), "--readme", str(doc), "--plots", "false"]
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "definitions 1" in err
    assert cli([*args, "--allow_mixed", "true"]) == 0
    assert "-->0.71×<!--" in doc.read_text() and "-->faster<!--" in doc.read_text()


def test_header_states_commands_and_total_wall_time(tmp_path):  # 11 runs × 10 s
    folder = write(tmp_path / "cpu-x", small_study())
    report.generate(folder, plots=False)
    table = (folder / "table.md").read_text()
    assert "`uv run python -m modelwright study`" in table and "total wall time of the runs: 110 s" in table
    assert "- Records: commit c0ffee, definitions 3" in table


def test_marker_writer_is_idempotent_and_leaves_the_rest(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("Intro.\n<!-- a:start -->\nold\n<!-- a:end -->\nIt took <!-- b:start -->?<!-- b:end --> s.\n"
                   "<!-- other:start -->keep<!-- other:end -->\n", encoding="utf-8")
    render = {"a": "| t |\n", "b": "3.5"}.get
    assert readme.write_sections(doc, render)
    text = doc.read_text()
    assert text == ("Intro.\n<!-- a:start -->\n| t |\n<!-- a:end -->\nIt took <!-- b:start -->3.5<!-- b:end --> s.\n"
                    "<!-- other:start -->keep<!-- other:end -->\n")
    assert not readme.write_sections(doc, render) and doc.read_text() == text


def test_marker_writer_refuses_a_file_without_markers(tmp_path):
    doc = tmp_path / "plain.md"
    doc.write_text("no markers here\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"plain\.md: no <!-- name:start -->") as err:
        readme.write_sections(doc, lambda name: "x")
    assert "\n" not in str(err.value)


def test_inline_values_fill_a_hand_written_sentence(tmp_path):
    write(tmp_path / "results" / "cpu-x", small_study())
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- figures: cpu-x -->\nbf16 took\n<!-- v amp.time --><!-- /v -->\nof the step "
                   "(<!-- v amp.band --><!-- /v -->) at <!-- v cpu-x:amp.peak -->?<!-- /v -->.\n", encoding="utf-8")
    readme.update([doc], tmp_path / "results")
    text = doc.read_text()
    assert "\n<!-- v amp.time -->0.71×<!-- /v -->\n" in text and "<!-- v cpu-x:amp.peak -->350 MiB<!-- /v -->" in text
    assert "<!-- v amp.band -->-6.7% / +6.7%<!-- /v -->" in text  # the run's own repeats: 1400 and 1600 about 1500
    doc.write_text("no study named: <!-- v amp.time -->?<!-- /v -->\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"doc\.md: <!-- v amp.time --> before any <!-- figures: SLUG --> line"):
        readme.update([doc], tmp_path / "results")
    doc.write_text("<!-- figures: cpu-x -->\n<!-- v amp -->?<!-- /v -->\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="an inline figure is run.field"):
        readme.update([doc], tmp_path / "results")


def test_fixture_rows_take_the_latest_config_and_the_median_of_repeats():
    records = read_records(FIXTURE)
    rows = {r.name: r for r in study_rows.build_rows(records)}
    assert list(rows) == ["baseline", "amp", "checkpointing-block", "all"]  # plan order, stray record ignored
    amp = rows["amp"]
    assert amp.figures.repeats == 2 and amp.figures.step_ms == pytest.approx(2950.0)  # 2900 and 3000, not 9999
    assert amp.figures.step_lo == 2900.0 and amp.figures.step_hi == 3000.0
    assert amp.reference is rows["baseline"] and rows["all"].reference is rows["baseline"]
    assert rows["checkpointing-block"].status == "failed"
    budget = {b.name: b for b in study_rows.build_budget_rows(records, list(rows.values()))}
    assert budget["all"].attempts == 2 and budget["baseline"].attempts == 1  # the probe (attempt 0) not counted
    assert budget["all"].batch == 470 and budget["all"].fits
    assert budget["all"].vs_reference == pytest.approx(470 / 76)


def test_generate_writes_table_summary_plots_and_readme(tmp_path):
    out = tmp_path / "results" / "cpu-example-2cores"
    out.mkdir(parents=True)
    shutil.copy(FIXTURE, out / "records.jsonl")
    doc = tmp_path / "README.md"
    doc.write_text("# Title\n\n<!-- results:start -->\nSTALE\n<!-- results:end -->\n\nAfter.\n", encoding="utf-8")
    names = {p.name for p in report.generate(out, readme=doc)}
    assert names >= {"table.md", "summary.json", "README.md", *report.PLOTS}
    for name in report.PLOTS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    amp = next(r for r in summary["runs"] if r["name"] == "amp")
    assert amp["memory_vs_reference"] == pytest.approx((446.29 + 446.49) / 2 / 706.54, rel=1e-3)
    assert summary["process_time_s"] == pytest.approx(40 + 40 + 42 + 12.5 + 55 + 25 + 90 + 85)  # not the probe's 20
    text = doc.read_text()
    assert "STALE" not in text and text.endswith("<!-- results:end -->\n\nAfter.\n")
    assert "### CPU results: Example CPU 9000" in text
    assert "![Peak tensor memory per run, by what holds it](results/cpu-example-2cores/memory_anatomy.png)" in text
    assert "| checkpointing-block | failed |" in (out / "table.md").read_text()


def test_attention_table_tolerates_absence_and_reads_the_benchmark():
    assert tables.attention_table(None) is None and tables.attention_table({"results": []}) is None
    result = {"results": [
        {"impl": "naive", "seq": 256, "status": "ok", "peak_mib": 40.0, "median_ms": 12.0},
        {"impl": "sdpa", "seq": 256, "status": "ok", "peak_mib": 10.0, "median_ms": 9.0},
        {"impl": "naive", "seq": 4096, "status": "oom"},
        {"impl": "sdpa", "seq": 4096, "status": "ok", "peak_mib": 150.0, "median_ms": 400.0}]}
    text = tables.attention_table(copy.deepcopy(result))
    assert "| 256 | 40.0 | 10.0 | 12.0 | 9.00 |" in text and "| 4096 | oom | 150 | oom | 400 |" in text


def test_formatters_round_to_significant_digits_and_dash_what_is_missing():
    assert [fmt.sig(x) for x in (0.9996, 123456, 0.00123456, 0)] == ["1.00", "123,000", "0.00123", "0"]
    assert {fmt.sig(x) for x in (None, True, float("nan"), float("inf"), "1")} == {"–"}
    assert [fmt.ratio(x) for x in (1.0, 1.041, 0.998, 0.98, 1.06)] == ["1.0×", "1.04×", "0.998×", "0.98×", "1.1×"]
    assert fmt.ratio(0.5649) == "0.56×" and fmt.pct(0.873) == "87%" and fmt.pct(0.05, signed=True) == "+5.0%"
    assert [fmt.duration(s) for s in (0.85, 60, 150, 3 * 3600, 3.1 * 86400)] == ["850 ms", "60 s", "2.5 min", "3 h",
                                                                                "3.1 days"]
    assert fmt.count(11_173_962) == "11.2 M" and fmt.usd(12.5) == "$12.50" and fmt.usd(1234.7) == "$1,235"
    assert fmt.table(["a", "b"], [["x|y", 1]]) == "| a | b |\n|:--|--:|\n| x\\|y | 1 |"


def test_a_check_folder_inside_a_study_gives_figures_and_predictions_not_a_results_section(tmp_path):
    amp = rec("amp", 60000, 450, index=1, precision="bf16-mixed", commit="b0b")
    amp["prediction"] = {"predicted_mib": {"total": 459.0}}
    write(tmp_path / "cpu-x", small_study()[:3])
    write(tmp_path / "cpu-x" / "bf16-check", [amp])
    sections = readme.Sections(tmp_path, tmp_path)
    assert sections.value("cpu-x/bf16-check", "amp", "step") == "60,000 ms"
    assert "| amp | cpu-x/bf16-check | 459 | 450 | +2.0% | not by category | total within |" in sections("predictions")
    assert "bf16-check" not in sections("results") and "`cpu-x`" in sections("results")


def test_prediction_table_judges_every_category_not_the_total(tmp_path):
    """A total within 5% can hide a category that misses: the row names its worst category and fails."""
    amp = rec("amp", 60000, 450, precision="bf16-mixed")  # measured: 40 + 40 + 80 + 290 activations + 0
    amp["prediction"] = {"predicted_mib": {"parameters": 40.0, "gradients": 40.0, "optimizer_state": 80.0,
                                           "activations": 289.0, "temporaries": 10.0, "total": 459.0}}
    write(tmp_path / "cpu-x", [amp])
    row = cells(readme.Sections(tmp_path, tmp_path)("predictions"), "amp")
    assert row[2:5] == ["459", "450", "+2.0%"]  # the total alone would pass
    assert row[5] == "temporaries 10.0 vs 0 MiB (+10 MiB)"  # 8 MiB over its 2 MiB tolerance
    assert row[6] == "misses: temporaries"  # activations 1 MiB under: within 5% of 290


def epoch_record(name: str, time_s: float, steps: int, validation_s: float, index: int = 0) -> dict:
    """A study's full-epoch record of plan entry ``name`` (``study.kind`` epoch)."""
    record = rec(name, 2000, 700, index=index)
    record["run_id"] = f"{name}-epoch"
    record["study"] = {**record["study"], "kind": "epoch", "config_hash": f"{name}-epoch"}
    record["timing"].update(epoch_time_s=time_s, epoch_steps=steps, epoch_validation_s=validation_s,
                            epoch_validations=2)
    return record


def test_time_and_cost_per_epoch_from_the_latest_epoch_record(tmp_path):
    records = small_study()
    records += [epoch_record("baseline", 90.0, 32, 6.0), epoch_record("baseline", 72.0, 32, 8.0)]  # the latest
    failed = epoch_record("amp", 10.0, 32, 1.0, index=2)
    failed["status"] = "failed"
    records.append(failed)
    rows = study_rows.build_rows(records)
    text = tables.main_table(rows)
    # 72 s on 2 vCPU at $0.0408 per vCPU-hour: $0.00163; 1,000 samples at 128 / 2.1 s = 61 samples/s: 16.4 s
    assert cells(text, "baseline")[11:14] == ["72 s", "$0.0016", "$0.00037"]
    assert cells(text, "amp")[11:13] == ["not measured", "not measured"]  # its only epoch record failed
    epochs = tables.epoch_table(rows)
    assert "| baseline | 72 s | 32 | 2 s | 2 | 8 s | 11% | baseline-epoch |" in epochs  # (72 − 8) / 32
    notes = " ".join(tables.price_notes(rows))
    assert "2 vCPU at $0.0816/h" in notes and "2026-06-17" in notes
    folder = write(tmp_path / "cpu-x", records)
    report.generate(folder, plots=False)
    summary = json.loads((folder / "summary.json").read_text())
    baseline = next(run for run in summary["runs"] if run["name"] == "baseline")
    assert baseline["epoch"]["time_s"] == 72.0 and baseline["epoch"]["validation_share"] == pytest.approx(8 / 72)
    assert baseline["cost_usd"]["per_epoch"] == pytest.approx(72 / 3600 * 2 * 0.0408)
    assert baseline["cost_usd"]["estimate"] is True
    assert "## Time per epoch" in (folder / "table.md").read_text()


def test_a_category_is_within_only_inside_its_tolerance_on_either_side():
    """5% of the measured MiB or 2 MiB, whichever is larger, over or under: an under-prediction as large as
    FSDP2's first temporaries (6 predicted, 39 measured) misses."""
    from modelwright.report.predictions import CategoryError, verdict_text, worst

    assert CategoryError("activations", 105, 100).within and CategoryError("activations", 95, 100).within
    assert not CategoryError("activations", 106, 100).within and not CategoryError("activations", 94, 100).within
    assert CategoryError("gradients", 1.0, 2.9).within and not CategoryError("gradients", 0.5, 2.9).within
    errors = [CategoryError("activations", 100, 100), CategoryError("temporaries", 6.0, 39.0)]
    assert worst(errors).category == "temporaries" and verdict_text(errors) == "misses: temporaries"


def test_a_section_is_not_rewritten_from_a_less_complete_study(tmp_path, capsys):
    """Before: a study of two runs replaced a README's eleven-row table with a two-row one, and its figures of
    the other runs with dashes."""
    write(tmp_path / "full" / "cpu-x", small_study())
    doc = tmp_path / "README.md"
    doc.write_text("<!-- figures: cpu-x -->\n<!-- techniques:cpu-x:start -->\n<!-- techniques:cpu-x:end -->\n"
                   "fused took <!-- v fused.time --><!-- /v -->, amp <!-- v amp.time --><!-- /v -->.\n",
                   encoding="utf-8")
    readme.update([doc], tmp_path / "full")
    full = doc.read_text()
    assert "| fused |" in full and "fused took <!-- v fused.time -->1.02×" in full
    write(tmp_path / "scratch" / "cpu-x", small_study()[:3] + small_study()[5:7])  # baseline and amp
    readme.update([doc], tmp_path / "scratch")
    assert doc.read_text() == full, "the two-run study left every section of the eleven-run one"
    err = capsys.readouterr().err
    assert "README.md: techniques:cpu-x kept: the new text lacks fused, checkpointing-block" in err
    assert "v:cpu-x:fused:time kept" in err
    emptied = full.replace(full[full.index("| run"):full.index("<!-- techniques:cpu-x:end")], "")
    doc.write_text(emptied, encoding="utf-8")  # a section emptied by hand is filled from any study
    readme.update([doc], tmp_path / "scratch")
    assert "| amp |" in doc.read_text() and "| fused |" not in doc.read_text()


def test_a_verdict_pairs_each_repeat_with_the_baselines_of_its_round():
    """The machine slowed in round 2 for both runs: paired, the run is 1.10× in every round (slower); against
    the baseline's min/max band (+20%), 2200/2000 = 1.10× was called no measurable change."""
    records = [rec("baseline", ms, 700, repeat) for repeat, ms in enumerate((2000, 2400, 2000))]
    records += [rec("accumulate", ms * 1.10, 320, repeat, index=1) for repeat, ms in enumerate((2000, 2400, 2000))]
    rows = {row.name: row for row in study_rows.build_rows(records)}
    interval = rows["accumulate"].interval
    assert (interval.low, interval.high, interval.pairs) == (pytest.approx(1.10), pytest.approx(1.10), 3)
    assert rows["accumulate"].verdict == "slower"
    assert study_rows.verdict(1.10, rows["baseline"].band) == "no measurable change"  # the old band's word


def test_an_interval_that_contains_one_is_no_measurable_change_and_is_reproducible():
    records = [rec("baseline", ms, 700, repeat) for repeat, ms in enumerate((2000, 2100, 2200))]
    records += [rec("fused", ms, 700, repeat, index=1) for repeat, ms in enumerate((2300, 1900, 2150))]
    first = study_rows.build_rows(records)[1]
    again = study_rows.build_rows(records)[1]
    assert first.interval == again.interval  # a seeded bootstrap: the report regenerates to the same text
    assert first.interval.low < 1 < first.interval.high and first.verdict == "no measurable change"
    # the interval's ends are ratios of resampled medians: here within the paired ratios 0.905 and 1.15
    assert 1900 / 2100 <= first.interval.low and first.interval.high <= 2300 / 2000
    summary = tables.technique_summary(study_rows.build_rows(records), [])
    assert "| fused | 1.0× | 1.02× (no measurable change) | " in summary


def test_each_plan_pairs_its_rows_with_its_own_baseline():
    """A second plan's rows were compared with the first plan's baseline, recorded half an hour earlier."""
    records = [rec("baseline", 2000, 700, repeat) for repeat in range(2)]
    extra = [rec("extra-baseline", 3000, 700, repeat) for repeat in range(2)]
    extra += [rec("contiguous", 3000, 700, repeat, index=1) for repeat in range(2)]
    for record in extra:
        record["study"]["plan"] = "plan_extra.yaml"
    rows = {row.name: row for row in study_rows.build_rows(records + extra)}
    assert rows["contiguous"].reference is rows["extra-baseline"]
    assert rows["contiguous"].verdict == "no measurable change"  # 1.5× against the other plan's baseline
    assert rows["extra-baseline"].reference is rows["extra-baseline"]
    assert rows["baseline"].reference is rows["baseline"]


def test_the_cost_example_follows_the_formula():
    """time = FLOPs / (N × peak × MFU × efficiency); cost = time × N × price; a sample costs 1/efficiency more
    on 512 GPUs than on one."""
    records = [rec("baseline", 2000, 700, repeat) for repeat in range(3)] + [epoch_record("baseline", 72.0, 32, 8.0)]
    for record in records:
        record["flops"]["flops_per_step"] = 426e9
        record["memory"]["model_parameters"] = 11_173_962
        record["techniques"]["optimizer"] = "adamw"
    (row,) = study_rows.build_rows(records)
    text = tables.cost_table(row)
    assert cells(text, "2 vCPU, this machine (measured)")[3:5] == ["72 s", "$0.0016"]  # 72 s × $0.0816/h
    rate = tables.gpu_rate(row.records[0], "A100 80GB", (1, 512))
    assert rate.mfu == pytest.approx(32.3e15 / 420 / 312e12)
    seconds = 4096 * 426e9 / 128 / (312e12 * rate.mfu)
    assert cells(text, "1 × A100 80GB")[3:5] == [fmt.duration(seconds), fmt.usd(seconds / 3600 * 1.10)]
    efficiency = rate.efficiencies[512]
    assert 0 < efficiency < 1
    full = tables.gpu_cost_cells(rate, 512, 426e9 / 128, (1_500_000,))
    assert full[2] == fmt.pct(efficiency)
    assert full[4] == fmt.usd(1_500_000 * 426e9 / 128 / (312e12 * rate.mfu) / efficiency / 3600 * 1.10)


def test_report_rebuilds_a_study_written_inside_another_folder_and_leaves_a_check_alone(tmp_path):
    """``study --results results/extra`` writes results/extra/<slug>/: the report rebuilds its table and a
    figure can name it; a few runs kept inside a study's folder without a study.json are not a study."""
    results = tmp_path / "results"
    write(results / "cpu-x", small_study())
    extra = write(results / "extra" / "cpu-x", small_study())
    (extra / "study.json").write_text("{}\n", encoding="utf-8")
    check = write(results / "cpu-x" / "check", small_study())
    doc = tmp_path / "README.md"
    doc.write_text("<!-- figures: cpu-x -->\nx <!-- v extra/cpu-x:amp.verdict --><!-- /v -->\n", encoding="utf-8")
    assert cli(["report", "--results", str(results), "--readme", str(doc), "--plots", "false"]) == 0
    assert (extra / "table.md").is_file() and (results / "cpu-x" / "table.md").is_file()
    assert not (check / "table.md").exists()
    assert "-->faster<!--" in doc.read_text()
