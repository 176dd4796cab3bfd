"""docs/scaling-analysis.md from records: sections, figures matching the records, outcome-dependent wording, errors."""

from __future__ import annotations

import copy
import json
import re
import shutil
import statistics
from pathlib import Path

import pytest

from modelwright import planner
from modelwright.report import analysis
from modelwright.record import read_records

FIXTURE = Path(__file__).resolve().parent / "data" / "records_fixture.jsonl"
SLUG = "cpu-example-2cores"
SECTIONS = (
    "# Scaling analysis",
    "## The records",
    "## What each technique bought",
    "## Predicted vs measured memory per rank",
    "## Spreading the job over many GPUs",
    "## Economics: 30 epochs on 1, 8 and 64 GPUs",
    "## Short answers",
    "## Our figures beside published ones",
)
QUESTIONS = (
    "What must fit in device memory during training",
    "Why does mixed precision save both memory and time",
    "What does gradient accumulation simulate",
    "Data, tensor and pipeline parallelism",
    "What does gradient checkpointing trade for what",
    "Why does a 40% cut in memory matter",
)


def _write(folder: Path, records: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """A working directory with results/<slug>/records.jsonl = the fixture."""
    (tmp_path / "results" / SLUG).mkdir(parents=True)
    shutil.copy(FIXTURE, tmp_path / "results" / SLUG / "records.jsonl")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _run(*args: str) -> str:
    assert analysis.main([*args, "--out", "docs/scaling-analysis.md"]) == 0
    return Path("docs/scaling-analysis.md").read_text(encoding="utf-8")


def _no_leaks(text: str) -> None:
    for word in ("nan", "None", "inf", "null"):
        assert not re.search(rf"\b{word}\b", text), word
    assert "ANCHORS" not in text and "/tmp" not in text and "pytest" not in text  # the project speaks of itself


def test_fixture_document_has_every_section_and_the_records_numbers(workdir, capsys):
    text = _run("--results", f"results/{SLUG}")
    assert capsys.readouterr().out.strip() == "docs/scaling-analysis.md"
    positions = [text.index(s) for s in SECTIONS]
    assert positions == sorted(positions)
    for q in QUESTIONS:
        assert q in text
    _no_leaks(text)
    # the command, hardware and versions of the records
    assert f"uv run python -m modelwright analysis --results results/{SLUG}" in text
    assert "CPU: Example CPU 9000, 2 cores" in text and "torch 2.15.0" in text and "lightning 2.6.6" in text
    assert f"(../results/{SLUG}/records.jsonl)" in text
    # the baseline's measured peak, the amp run's ratio (the median of its two repeats), the failed run
    assert "| baseline | reference | 706.5 | 1.00× | 536.0 | 3,100 (3,000–3,400) |" in text
    assert "| amp | precision 32-true → bf16-mixed | 446.4 | 0.63× |" in text
    assert "`checkpointing-block` (failed" in text
    # the superseded 32-true amp record (step 9,999 ms, activations 999) is not used anywhere
    assert "9,999" not in text and "999.0" not in text
    # CPU only: the CPU job is timed from the amp median (43.4 samples/s) and the GPU figure is labelled an estimate
    assert "Only CPU measurements exist" in text and "GPU estimate from published figures, not a measurement" in text
    assert f"{30 * 50_000 / 43.405 / 3600:.3g} h" in text
    assert "So on this CPU mixed precision saved memory but not time." in text


def test_predicted_vs_measured_memory_rows(workdir):
    text = _run()
    section = text[text.index("## Predicted vs measured") : text.index("## Spreading")]
    rec = next(r for r in read_records(FIXTURE) if r["run_id"] == "baseline-b0b0b0b0b0b0-r0")
    pred = planner.predict_record_memory_mib(rec)
    row = next(line for line in section.splitlines() if line.startswith("| baseline | 32-true, 128"))
    assert f"{pred['optimizer_state']:,.1f} / 85.3" in row and f"{pred['total']:,.1f} / 706.5" in row
    assert row.endswith("| yes |")
    # the budget runs are untimed but still predicted; the study's batch prediction is checked too
    assert "| all (largest-batch run 2, batch 470) |" in section
    assert "| all | cpu-example-2cores | 32 | 470 | 509.8 | 498.5 | +2.3% | yes |" in section
    assert "not yet checked against a measurement" in section


def test_multi_rank_records_are_predicted_from_the_single_device_run_and_misses_are_explained(workdir):
    base = next(r for r in read_records(FIXTURE) if r["run_id"] == "baseline-b0b0b0b0b0b0-r0")
    ddp = copy.deepcopy(base)
    ddp.pop("study")
    ddp["run_id"] = "ddp-x2"
    ddp["techniques"].update(strategy="ddp", world_size=2, micro_batch_size=64, effective_batch_size=128)
    ddp["memory"]["anatomy_mib"].update(activations=268.0, total=438.54)
    ddp["memory"]["peak_allocated_mib"] = 438.54
    fsdp = copy.deepcopy(ddp)
    fsdp["run_id"] = "fsdp2-x2"
    fsdp["techniques"]["strategy"] = "model_parallel"
    # measured: full weights gathered at the peak, half the gradients and state
    fsdp["memory"]["anatomy_mib"].update(parameters=42.6, gradients=21.3, optimizer_state=42.65, total=374.59)
    fsdp["memory"]["peak_allocated_mib"] = 374.59
    _write(Path("extra"), [ddp, fsdp])
    text = _run("--records", "extra/records.jsonl")
    _no_leaks(text)
    assert "--records extra/records.jsonl" in text
    rows = [line for line in text.splitlines() if line.startswith("| ddp-x2 |") or line.startswith("| fsdp2-x2 |")]
    assert len(rows) == 4  # own record + from the single-device baseline, for each
    from_base = [r for r in rows if "*from baseline*" in r]
    assert len(from_base) == 2
    ddp_from = next(r for r in from_base if r.startswith("| ddp-x2"))
    assert "268.0 / 268.0" in ddp_from and ddp_from.endswith("| yes |")  # 536 MiB at 128 → 268 at 64
    fsdp_from = next(r for r in from_base if r.startswith("| fsdp2-x2"))
    assert "21.3 / 42.6" in fsdp_from and "no: parameters" in fsdp_from
    assert "`fsdp2-x2` (from baseline), parameters: predicted 21.3 MiB, measured 42.6 MiB (-50%)" in text
    assert "FSDP gathers the full weights" in text


def test_outcome_wording_follows_the_records(workdir):
    records = read_records(FIXTURE)
    for r in records:
        if r["run_id"].startswith("amp-a1"):
            r["timing"].update(step_time_median_ms=1500.0, step_time_min_ms=1400.0, step_time_max_ms=1600.0)
            r["timing"]["samples_per_s"] = 128 / 1.5
    _write(Path("results") / SLUG, records)
    text = _run()
    assert "saved memory but not time" not in text
    assert "On this CPU it saved both." in text
    assert "Faster than the reference beyond its run-to-run spread: `amp`" in text


def test_a_gpu_folder_is_used_for_the_economics(workdir):
    gpu = []
    for r in read_records(FIXTURE):
        r = copy.deepcopy(r)
        r["hardware"].update(
            accelerator="cuda", device_name="NVIDIA H100 80GB HBM3", device_memory_mib=81559.0, num_devices=1
        )
        r["versions"]["cuda"] = "12.8"
        if r.get("timing", {}).get("step_time_median_ms"):
            for key in ("step_time_median_ms", "step_time_p90_ms", "step_time_min_ms", "step_time_max_ms"):
                r["timing"][key] /= 500
            r["timing"]["samples_per_s"] *= 500
        gpu.append(r)
    _write(Path("results") / "cuda-nvidia-h100", gpu)
    text = _run("--epochs", "10")
    _no_leaks(text)
    assert "Only CPU measurements exist" not in text
    assert "**Measured on the NVIDIA H100 80GB HBM3:**" in text
    assert "## Economics: 10 epochs on 1, 8 and 64 GPUs" in text and "--epochs 10" in text
    assert "cost (H100 SXM)" in text and "$2.50–5.00 per GPU-hour" in text
    assert "CUDA 12.8" in text and "CPU: Example CPU 9000" in text  # both folders are described
    # one GPU for 10 epochs at the amp run's median throughput over its two repeats (500 × the CPU's)
    sps = statistics.median(r["timing"]["samples_per_s"] for r in gpu if r["run_id"].startswith("amp-a1"))
    hours = 10 * 50_000 / sps / 3600
    assert f"one GPU ran the main job at {sps:,.0f} samples/s" in text
    row = re.search(r"^\| 1 \| 128 \| ([^|]+) \| ([\d,]+) \| 1\.00× \| 100% \| ([^|]+) \| ([^|]+) \|", text, re.M)
    assert row and row[1] == analysis._duration(128 / sps) and abs(float(row[2].replace(",", "")) - sps) <= 1
    assert row[3] == analysis._duration(hours * 3600) and row[4] == f"{hours:,.2f}"
    assert "| 5.90 (5.60–6.40) |" in text  # GPU milliseconds keep their digits


def test_the_output_is_deterministic_and_the_planners_zero_example_is_shown(workdir):
    first = _run()
    assert _run() == first
    assert "planner: 120 → 31.4 → 16.6 → 1.88" in first and "| 120 → 31.4 → 16.6 → 1.9 |" in first


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--results", "results/nowhere"], "--results: no such folder 'results/nowhere'"),
        (["--records", "missing.jsonl"], "--records: no such file 'missing.jsonl'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(workdir, capsys, args, message):
    assert analysis.main([*args, "--out", "docs/x.md"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not Path("docs/x.md").exists()


def test_no_results_folder_at_all(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert analysis.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'results'" in err


def test_bad_flag_value_exits_2(workdir, capsys):
    with pytest.raises(SystemExit) as exc:
        analysis.main(["--epochs", "zero"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
