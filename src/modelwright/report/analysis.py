"""docs/scaling-analysis.md: what each technique bought, how the job spreads over many GPUs, what it costs.

To run: ``uv run python -m modelwright analysis [--results results/<slug>] [--records extra.jsonl]
[--out docs/scaling-analysis.md] [--epochs 30]``

Every figure of ours in the document is computed here, from run records (``results/<slug>/records.jsonl``
as the study writes them, plus any ``--records`` files) and from :mod:`modelwright.planner`'s memory,
communication and cost model. A statement that depends on an outcome ("mixed precision saved memory but
not time") is decided from the records when the document is written, not in advance. The only numbers
typed into this file are published figures (:data:`PUBLISHED`, :data:`SOURCES`), always shown as such,
beside ours, with their source.

Without ``--results`` every ``results/*/`` folder holding a ``records.jsonl`` is used. The economics use a
GPU folder (``hardware.accelerator == "cuda"``) when there is one; with CPU records only they price the CPU
job and give a GPU estimate that rests on a published throughput, and say so.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from modelwright import planner, report
from modelwright.errors import ConfigError, require
from modelwright.record import get_path as _get
from modelwright.record import read_records

DEFAULT_RESULTS_ROOT = Path("results")
DEFAULT_OUT = Path("docs/scaling-analysis.md")
DEFAULT_EPOCHS = 30.0
DEVICE_COUNTS = (1, 8, 64)
#: CIFAR-10's training set: the data these models are shaped for.
DATASET_SIZE = report.EPOCH_SAMPLES
#: Item 6's goal for predicted vs measured per-rank memory.
TOLERANCE = 0.10
#: Differences below this count as a match whatever their ratio: a category of a few KiB is not judged by it.
ABS_TOLERANCE_MIB = 1.0
#: A change in peak memory smaller than this fraction reads as "unchanged".
MEMORY_NOISE = 0.02
#: Without min–max spreads, a step-time change smaller than this fraction reads as noise.
TIME_NOISE = 0.05
#: Plan-order strategies shown in the spreading tables.
SPREAD_STRATEGIES = ("dp", "zero1", "zero2", "fsdp", "tp", "pp")
#: Pipeline example used in the text: stages and micro-batches per step (the planner's 4 × stages rule).
PP_EXAMPLE_STAGES = 8

# ---------------------------------------------------------------------------------------------------------
# Published figures: citations with their sources, never our measurements
# ---------------------------------------------------------------------------------------------------------

SOURCES: dict[str, str] = {
    "hf": 'Hugging Face, "Efficient training on a single GPU" (transformers docs, v4.21; V100 16 GB, bert-large, '
    "512 samples × 512 tokens, one epoch)",
    "chen": "Chen et al., 2016, Training Deep Nets with Sublinear Memory Cost (arXiv 1604.06174)",
    "playbook": "Hugging Face / nanotron, The Ultra-Scale Playbook",
    "zero": "Rajbhandari et al., 2020, ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
    "nvidia": "NVIDIA DeepLearningExamples, ResNet-50 on ImageNet, A100 80GB",
    "pytorch-cpu": "PyTorch documentation on CPU autocast (PR 86550)",
    "airbench": "airbench (Keller Jordan), CIFAR-10 on one A100",
    "ddp": "Li et al., PyTorch Distributed (VLDB 2020)",
    "horovod": "Horovod (Uber)",
    "fsdp": "Zhao et al., 2023, PyTorch FSDP",
    "mfu": "PaLM (TPU v4); Llama 3 (H100); torchtitan (A100, H100)",
    "a100": "NVIDIA A100 datasheet",
    "prices": f"third-party GPU cloud listings, {planner.PRICE_DATE}",
}


@dataclass(frozen=True)
class HFRun:
    """One row of the Hugging Face single-GPU table: throughput and peak memory as published."""

    label: str
    samples_per_s: float
    memory_mb: float


PUBLISHED: dict[str, Any] = {
    "hf": {
        "vanilla": HFRun("batch 4", 8.86, 14_949),
        "accumulate": HFRun("batch 1 × accumulation 4", 7.75, 8_681),
        "accumulate+checkpointing": HFRun("+ gradient checkpointing", 5.99, 6_775),
        "fp16": HFRun("fp16, batch 4", 18.64, 13_939),
        "all": HFRun("accumulation + checkpointing + fp16", 10.09, 7_275),
    },
    "hf_checkpointing_cost": "about 20%",
    "chen": {"memory_from_gb": 48, "memory_to_gb": 7, "time_increase": 0.30, "layers": 1_000},
    "playbook_recompute_cost": (0.30, 0.40),
    "playbook_selective": {"activation_saving": 0.70, "compute_increase": 0.027},
    "nvidia_resnet50": {"tf32_img_per_s": 938, "amp_img_per_s": 2_470, "scale8_tf32": 7.72, "scale8_amp": 6.72},
    "airbench_resnet18": {"pflop": 32.3, "minutes": 7.0, "accuracy": "96%"},
    "adam_bytes_per_param": {"32-true": 16, "mixed": 16, "mixed-fp32-grads": 20},
    "zero_example": {"params": 7.5e9, "devices": 64, "gb": (120, 31.4, 16.6, 1.9)},
    "ddp_scaling": "near-linear scaling to 256 GPUs",
    "horovod_scaling": "90% scaling efficiency at 512 GPUs (Inception V3, ResNet-101); 68% for VGG-16",
    "fsdp_scaling": "performance comparable to DDP, near-linear TFLOPS scaling",
    "mfu": "PaLM 540B 46.2%; Llama 3 405B 38–43% (bf16, H100); torchtitan Llama 3 8B FSDP2 on 64 A100 56–58%",
    "a100_bf16_peak_flops": 312e12,
}

#: Sustained rate of airbench's standard ResNet-18 on one A100: 32.3 PFLOP in 7 minutes.
AIRBENCH_RESNET18_FLOPS_PER_S = (
    PUBLISHED["airbench_resnet18"]["pflop"] * 1e15 / (PUBLISHED["airbench_resnet18"]["minutes"] * 60)
)
#: The device the CPU-only GPU estimate assumes (the airbench figure's GPU).
ESTIMATE_DEVICE = "A100 80GB"

# ---------------------------------------------------------------------------------------------------------
# Small formatting helpers
# ---------------------------------------------------------------------------------------------------------


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _f(value: Any, fmt: str, suffix: str = "") -> str:
    v = _finite(value)
    return "–" if v is None else f"{v:{fmt}}{suffix}"


def _x(ratio: float | None) -> str:
    v = _finite(ratio)
    return _f(v, ".0f" if v is not None and v >= 20 else ".2f", "×")


def _pct(fraction: float | None, signed: bool = False) -> str:
    """A fraction as a percentage: whole percent, one decimal below 10% (so that small values do not read 0%)."""
    v = _finite(fraction)
    if v is None:
        return "–"
    p = 100 * v
    digits = 0 if abs(p) >= 9.95 else (1 if abs(p) >= 0.05 else 2)
    if round(p, digits) == 0:
        return "0%"  # neither "-0%" nor "0.00%"
    return f"{p:+.{digits}f}%" if signed and p != 0 else f"{p:.{digits}f}%"


def _duration(seconds: float | None) -> str:
    v = _finite(seconds)
    return "–" if v is None else planner.format_duration(v)


def _ms(value: float | None) -> str:
    """Milliseconds to three significant figures at most (a CPU's seconds and a GPU's milliseconds alike)."""
    v = _finite(value)
    if v is None:
        return "–"
    return f"{v:,.0f}" if v >= 100 else (f"{v:.1f}" if v >= 10 else f"{v:.2f}")


def _count(n: float | None) -> str:
    v = _finite(n)
    if v is None:
        return "–"
    for scale, suffix in ((1e12, " T"), (1e9, " B"), (1e6, " M"), (1e3, " k")):
        if v >= scale:
            return f"{v / scale:.3g}{suffix}"
    return f"{v:.0f}"


def _usd(value: float | None) -> str:
    v = _finite(value)
    if v is None:
        return "–"
    return f"${v:,.2f}" if v < 100 else f"${v:,.0f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str | None = None) -> str:
    align = align or "l" + "r" * (len(header) - 1)
    marks = {"l": ":--", "r": "--:", "c": ":-:"}
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(marks[a] for a in align) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |" for cells in rows]
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> float | None:
    a, b = _finite(a), _finite(b)
    return a / b if a is not None and b else None


def _display(path: Path, fallback: str) -> str:
    """``path`` relative to the working directory when it lies inside it, else ``fallback`` (no absolute paths)."""
    cwd = Path.cwd().resolve()
    full = path.resolve()
    return full.relative_to(cwd).as_posix() if full.is_relative_to(cwd) else fallback


# ---------------------------------------------------------------------------------------------------------
# Studies: one results folder each
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Study:
    """One hardware's results folder, with the report's row selection applied."""

    folder: Path
    records: list[dict]
    rows: list[report.Row]
    budget: list[report.BudgetRow]
    conditions: dict[str, Any]

    @property
    def slug(self) -> str:
        return self.folder.name

    @property
    def hardware(self) -> Mapping:
        return self.conditions.get("hardware") or {}

    @property
    def is_gpu(self) -> bool:
        return self.hardware.get("accelerator") == "cuda"

    @property
    def label(self) -> str:
        hw = self.hardware
        if self.is_gpu:
            return str(hw.get("device_name") or "GPU")
        return f"{hw.get('cpu_cores') or '?'}-core CPU"

    @property
    def ok_rows(self) -> list[report.Row]:
        return [r for r in self.rows if r.ok]

    @property
    def models(self) -> list[str]:
        return list(dict.fromkeys(str(r.model) for r in self.ok_rows))

    @property
    def primary_model(self) -> str | None:
        return self.models[0] if self.models else None

    def row(self, name: str | None) -> report.Row | None:
        return next((r for r in self.ok_rows if r.name == name), None)

    def reference(self, row: report.Row) -> report.Row | None:
        return self.row(row.reference)


def load_study(folder: Path) -> Study:
    """The study records of ``folder/records.jsonl`` as rows (raises ConfigError naming the file)."""
    path = folder / "records.jsonl"
    require(folder.is_dir(), f"--results: no such folder {folder.as_posix()!r}")
    require(path.is_file(), f"--results: {folder.as_posix()!r} holds no records.jsonl (run the study first)")
    records = read_records(path)
    require(
        bool(report.study_records(records)), f"{path.as_posix()}: no study records (records with a 'study' section)"
    )
    rows = report.build_rows(records)
    require(any(r.ok for r in rows), f"{path.as_posix()}: no run finished with status ok")
    return Study(folder, records, rows, report.build_budget_rows(records, rows), report.conditions(records))


def find_result_folders(root: Path) -> list[Path]:
    """Every ``root/<slug>/`` holding a ``records.jsonl``, sorted (raises ConfigError when there is none)."""
    require(root.is_dir(), f"--results: no {root.as_posix()!r} folder (run `uv run python -m modelwright study` first)")
    folders = sorted(p for p in root.iterdir() if p.is_dir() and (p / "records.jsonl").is_file())
    require(bool(folders), f"--results: no {root.as_posix()}/<slug>/records.jsonl (run the study first)")
    return folders


# ---------------------------------------------------------------------------------------------------------
# What changed between a run and its reference, and what it bought
# ---------------------------------------------------------------------------------------------------------


def _impl(value: Any) -> str:
    text = str(value)
    if "[" in text:
        return f"{text.rsplit('.', 1)[-1].split('[')[0]} {text.split('[', 1)[1].rstrip(']')}"
    return text


def changes(record: Mapping, reference: Mapping) -> dict[str, str]:
    """What a run changed against its reference, by technique: ``{"precision": "precision 32-true → bf16-mixed"}``."""
    t, r = record.get("techniques") or {}, reference.get("techniques") or {}
    out: dict[str, str] = {}
    if t.get("precision") != r.get("precision"):
        out["precision"] = f"precision {r.get('precision')} → {t.get('precision')}"
    m0, m1 = r.get("micro_batch_size"), t.get("micro_batch_size")
    a0, a1 = r.get("accumulate_grad_batches") or 1, t.get("accumulate_grad_batches") or 1
    if a0 != a1:
        out["accumulation"] = f"batch {m0}×{a0} → {m1}×{a1} (micro-batch × accumulation)"
    elif m0 != m1:
        out["batch"] = f"batch {m0} → {m1}"
    if (t.get("gradient_checkpointing") or "off") != (r.get("gradient_checkpointing") or "off"):
        out["checkpointing"] = (
            f"checkpointing {r.get('gradient_checkpointing') or 'off'} → {t.get('gradient_checkpointing') or 'off'}"
        )
    for key in ("channels_last", "compile"):
        if bool(t.get(key)) != bool(r.get(key)):
            out[key] = f"{key} {'on' if t.get(key) else 'off'}"
    m0, m1 = report.cpu_malloc(reference), report.cpu_malloc(record)
    if m0 and m1 and m0 != m1:
        out["cpu_malloc"] = f"cpu_malloc {m0} → {m1}"
    if t.get("optimizer_impl") != r.get("optimizer_impl"):
        out["optimizer_impl"] = f"optimizer {_impl(r.get('optimizer_impl'))} → {_impl(t.get('optimizer_impl'))}"
    if (t.get("world_size") or 1) != (r.get("world_size") or 1) or t.get("strategy") != r.get("strategy"):
        out["distributed"] = f"{t.get('strategy')} × {t.get('world_size') or 1}"
    return out


@dataclass
class Outcome:
    """A run against its reference: ratios and what they mean, with the run-to-run spread taken into account."""

    memory_ratio: float | None
    time_ratio: float | None
    activation_ratio: float | None
    time_state: str | None  # "faster", "slower", "same" (within spread), None (not measured)

    @property
    def memory_saved(self) -> bool:
        return self.memory_ratio is not None and self.memory_ratio < 1 - MEMORY_NOISE

    @property
    def time_saved(self) -> bool:
        return self.time_state == "faster"

    def memory_text(self) -> str:
        r = self.memory_ratio
        if r is None:
            return "peak memory not measured"
        if abs(r - 1) < MEMORY_NOISE:
            return f"peak memory unchanged ({_x(r)})"
        return f"peak memory {'down' if r < 1 else 'up'} {_pct(abs(1 - r))}"

    def time_text(self) -> str:
        r = self.time_ratio
        if self.time_state is None:
            return "step time not measured"
        if self.time_state == "same":
            return f"step time within the run-to-run spread ({_x(r)})"
        return f"step {'faster' if self.time_state == 'faster' else 'slower'} by {_pct(abs(1 - r))} ({_x(r)})"


def outcome(row: report.Row, ref: report.Row) -> Outcome:
    """Compare a row with its reference row (both ok)."""
    v, rv = row.values, ref.values
    t, rt = _finite(v.get("step_time_median_ms")), _finite(rv.get("step_time_median_ms"))
    ratio = _ratio(t, rt)
    state = None
    if ratio is not None:
        lo, hi = _finite(v.get("step_time_min_ms")), _finite(v.get("step_time_max_ms"))
        rlo, rhi = _finite(rv.get("step_time_min_ms")), _finite(rv.get("step_time_max_ms"))
        if None not in (lo, hi, rlo, rhi) and row is not ref:
            overlap = lo <= rhi and rlo <= hi
        else:
            overlap = abs(ratio - 1) < TIME_NOISE
        state = "same" if overlap else ("faster" if ratio < 1 else "slower")
    act = _ratio(v["anatomy_mib"].get("activations"), rv["anatomy_mib"].get("activations"))
    return Outcome(_ratio(v.get("peak_mib"), rv.get("peak_mib")), ratio, act, state)


def technique_rows(study: Study, kinds: set[str], model: str | None = None) -> list[report.Row]:
    """The ok rows of ``model`` (default: the study's first) that change exactly ``kinds`` against their reference."""
    model = model or study.primary_model
    out = []
    for row in study.ok_rows:
        ref = study.reference(row)
        if ref is None or row is ref or str(row.model) != model:
            continue
        if set(changes(row.records[0], ref.records[0])) == kinds:
            out.append(row)
    return out


def amp_row(study: Study) -> report.Row | None:
    """The run that adds 16-bit mixed precision alone (bf16 first)."""
    rows = technique_rows(study, {"precision"})
    rows.sort(key=lambda r: _get(r.records[0], "techniques.precision") != "bf16-mixed")
    rows = [r for r in rows if "mixed" in str(_get(r.records[0], "techniques.precision"))]
    return rows[0] if rows else None


def reference_row(study: Study) -> report.Row | None:
    """The primary model's reference row."""
    first = next((r for r in study.ok_rows if str(r.model) == study.primary_model), None)
    return study.reference(first) if first else None


def main_job_row(study: Study) -> report.Row | None:
    """The project's main job: the primary model with bf16 mixed precision; else its reference."""
    return amp_row(study) or reference_row(study)


def representative(row: report.Row) -> dict:
    """The row's record whose step time is closest to the row's median (repeats differ a little)."""
    med = _finite(row.values.get("step_time_median_ms"))
    if med is None or len(row.records) == 1:
        return row.records[0]
    return min(row.records, key=lambda r: abs((_finite(_get(r, "timing.step_time_median_ms")) or math.inf) - med))


# ---------------------------------------------------------------------------------------------------------
# Section: what each technique bought
# ---------------------------------------------------------------------------------------------------------


def techniques_section(study: Study) -> str:
    out = [f"### {study.label} (`{study.slug}`)", ""]
    for model in study.models:
        rows = [r for r in study.ok_rows if str(r.model) == model]
        if len(study.models) > 1:
            out += [f"#### {model}", ""]
        body = []
        results: list[tuple[report.Row, Outcome, dict[str, str]]] = []
        for row in rows:
            ref = study.reference(row)
            if ref is None:
                continue
            o = outcome(row, ref)
            ch = changes(row.records[0], ref.records[0]) if row is not ref else {}
            results.append((row, o, ch))
            v = row.values
            spread = (
                f" ({_ms(v['step_time_min_ms'])}–{_ms(v['step_time_max_ms'])})"
                if _finite(v.get("step_time_min_ms")) is not None and _finite(v.get("step_time_max_ms")) is not None
                else ""
            )
            body.append(
                [
                    row.name,
                    "reference" if row is ref else ("; ".join(ch.values()) or "same techniques as the reference"),
                    _f(v.get("peak_mib"), ",.1f"),
                    _x(o.memory_ratio),
                    _f(v["anatomy_mib"].get("activations"), ",.1f"),
                    _ms(v.get("step_time_median_ms")) + spread,
                    _x(o.time_ratio),
                    "–" if row is ref else f"{o.memory_text()}; {o.time_text()}",
                ]
            )
        out += [
            _table(
                [
                    "run",
                    "what changes",
                    "peak MiB",
                    "memory vs ref",
                    "activations MiB",
                    "step ms, median (min–max)",
                    "time vs ref",
                    "outcome",
                ],
                body,
                "llrrrrrl",
            ),
            "",
        ]
        others = [(r, o) for r, o, _ in results if r.name != r.reference]
        saved = [(r, o) for r, o in others if o.memory_saved]
        faster = [r.name for r, o in others if o.time_saved]
        slower = [r.name for r, o in others if o.time_state == "slower"]
        lines = []
        if saved:
            best, bo = min(saved, key=lambda p: p[1].memory_ratio)
            lines.append(
                f"The largest cut in peak memory came from `{best.name}`: {_pct(1 - bo.memory_ratio)} "
                f"({_f(best.values.get('peak_mib'), ',.1f')} MiB against "
                f"{_f(study.reference(best).values.get('peak_mib'), ',.1f')})."
            )
        else:
            lines.append("No run lowered peak memory by more than the noise.")
        lines.append(
            "Faster than the reference beyond its run-to-run spread: "
            + (", ".join(f"`{n}`" for n in faster) if faster else "none")
            + "; slower: "
            + (", ".join(f"`{n}`" for n in slower) if slower else "none")
            + "."
        )
        failed = [r for r in study.rows if not r.ok and str(r.model) == model]
        if failed:
            lines.append(
                "Not measured (the run did not finish): "
                + "; ".join(f"`{r.name}` ({r.status}{': ' + r.error if r.error else ''})" for r in failed)
                + "."
            )
        out += [" ".join(lines), ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------
# Section: predicted vs measured per-rank memory
# ---------------------------------------------------------------------------------------------------------

MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations+temporaries", "total")

#: Likely reasons for a miss, by (category, direction); "over" = the prediction is higher than the measurement.
MISS_REASONS: dict[tuple[str, str], str] = {
    ("parameters", "under"): "more weight bytes were alive at the peak than the planner's share: FSDP gathers the "
    "full weights of the block it runs (the planner counts one shard), or a 16-bit copy of the weights was kept",
    ("parameters", "over"): "fewer weight bytes than the regime's bytes per parameter: the weights are kept in "
    "fewer bytes than assumed, or the tracker filed part of them under another category",
    ("gradients", "over"): "the peak came before backward had produced every gradient (gradients are freed with "
    "set_to_none and re-created layer by layer), so fewer gradient bytes were alive than the planner's full set",
    ("gradients", "under"): "a second gradient copy was alive at the peak: DDP's communication buckets (unless "
    "gradient_as_bucket_view) or an accumulation buffer",
    ("optimizer_state", "over"): "less optimizer state was alive than the planner's bytes per parameter: the state "
    "is created lazily at the first update, or the tracker filed part of it elsewhere",
    ("optimizer_state", "under"): "more than the optimizer's state per parameter was counted: a foreach or fused "
    "update's temporaries were filed as optimizer state",
    ("activations+temporaries", "over"): "activations were assumed to grow linearly with the micro-batch from the "
    "single-device run; the sharded or distributed run kept fewer (e.g. its gathered weights were freed earlier)",
    ("activations+temporaries", "under"): "activations were assumed to grow linearly with the micro-batch from the "
    "single-device run; the distributed run kept more (communication buffers, gathered weights counted there)",
    ("total", "under"): "the measured peak holds what the planner leaves out: buffers, the input batch, "
    "allocator blocks and library workspaces",
    ("total", "over"): "the planner counts every gradient and all optimizer state at once; at the measured peak "
    "part of them did not exist yet",
}


@dataclass
class MemoryCheck:
    """Predicted beside measured per-rank memory for one record."""

    label: str
    setup: str
    hardware: str
    predicted: dict[str, float] | None
    measured: dict[str, float]
    measured_peak: float | None
    basis: str  # "own record" or "from <run>"
    error: str | None = None

    def pair(self, key: str) -> tuple[float | None, float | None]:
        if key == "total":
            return (self.predicted or {}).get("total"), self.measured_peak
        if key == "activations+temporaries":
            p = self.predicted
            pv = None if p is None else p.get("activations", 0.0) + p.get("temporaries", 0.0)
            return pv, self.measured.get("activations", 0.0) + self.measured.get("temporaries", 0.0)
        return (self.predicted or {}).get(key), self.measured.get(key)

    def rel_error(self, key: str) -> float | None:
        p, m = self.pair(key)
        p, m = _finite(p), _finite(m)
        if p is None or m is None:
            return None
        if m == 0:
            return 0.0 if p == 0 else None
        return (p - m) / m

    def within(self, key: str) -> bool | None:
        p, m = self.pair(key)
        p, m = _finite(p), _finite(m)
        if p is None or m is None:
            return None
        if abs(p - m) < ABS_TOLERANCE_MIB:
            return True
        err = self.rel_error(key)
        return err is not None and abs(err) <= TOLERANCE

    def judged(self) -> tuple[str, ...]:
        """Categories that are real predictions (activations are inputs when the record predicts itself)."""
        if self.basis == "own record":
            return ("parameters", "gradients", "optimizer_state", "total")
        return MEMORY_CATEGORIES


def _hardware_label(record: Mapping) -> str:
    hw = record.get("hardware") or {}
    if hw.get("accelerator") == "cuda":
        return str(hw.get("device_name") or "GPU")
    return f"{hw.get('cpu_cores') or '?'}-core CPU"


def _has_anatomy(record: Mapping) -> bool:
    a = _get(record, "memory.anatomy_mib")
    return (
        record.get("status") == "ok"
        and isinstance(a, Mapping)
        and _finite(a.get("activations")) is not None
        and _finite(_get(record, "memory.model_parameters")) is not None
    )


def _record_label(record: Mapping) -> str:
    s = record.get("study")
    if not isinstance(s, Mapping):
        return str(record.get("run_id") or "record")
    name = str(s.get("name"))
    micro = _get(record, "techniques.micro_batch_size")
    if s.get("kind") == "budget":
        what = "probe" if s.get("attempt") == 0 else f"largest-batch run {s.get('attempt')}"
        return f"{name} ({what}, batch {micro})"
    repeats = int(s.get("repeats") or 1)
    return f"{name} (repeat {int(s.get('repeat') or 0) + 1})" if repeats > 1 else name


def current_records(study: Study) -> list[dict]:
    """The study records the report uses (superseded configs dropped), in file order; budget runs included."""
    used = {id(r) for row in study.rows for r in row.records}
    out = []
    for r in report.study_records(study.records):
        kind = r["study"].get("kind", "run")
        if kind == "run" and id(r) not in used:
            continue
        out.append(r)
    return out


def _single_device_reference(record: Mapping, pool: Sequence[dict]) -> dict | None:
    """The latest ok single-device record of the same model and techniques (batch aside), to predict from."""
    t = record.get("techniques") or {}
    keys = (
        "model_name", "precision", "optimizer", "optimizer_impl", "gradient_checkpointing", "channels_last", "compile"
    )
    matches = [
        r
        for r in pool
        if _has_anatomy(r)
        and int(_get(r, "techniques.world_size", 1) or 1) == 1
        and (_get(r, "techniques.accumulate_grad_batches") or 1) == 1
        and all(_get(r, f"techniques.{k}") == t.get(k) for k in keys)
    ]
    # A table run (timed, the row readers know) before a largest-batch run; the latest of them.
    runs = [r for r in matches if _get(r, "study.kind", "run") == "run"]
    return (runs or matches or [None])[-1]


def _with_timing(record: Mapping) -> dict:
    """``record`` with a placeholder step time where it has none: the planner's spec needs one, memory does not
    depend on it, and the study's largest-batch runs are not timed."""
    timing = dict(record.get("timing") or {})
    if _finite(timing.get("step_time_median_ms")) is None and _finite(timing.get("samples_per_s")) is None:
        timing["step_time_median_ms"] = 1.0
        return {**record, "timing": timing}
    return dict(record)


def memory_checks(studies: Sequence[Study], extra: Sequence[dict]) -> list[MemoryCheck]:
    """Predicted vs measured memory for every ok record with an anatomy (plus cross-predictions for multi-rank)."""
    pool: list[dict] = [r for s in studies for r in current_records(s)] + list(extra)
    hardware = {id(r): s.label for s in studies for r in current_records(s)}
    checks: list[MemoryCheck] = []
    for record in pool:
        if not _has_anatomy(record):
            continue
        hw = hardware.get(id(record)) or _hardware_label(record)
        label, setup = _record_label(record), report.setup_text(record)
        measured = planner.measured_memory_mib(record)
        peak = report.peak_mib(record)
        try:
            predicted = planner.predict_record_memory_mib(_with_timing(record))
            checks.append(MemoryCheck(label, setup, hw, predicted, measured, peak, "own record"))
        except (ConfigError, KeyError, TypeError, ValueError) as err:
            msg = err.args[0] if err.args else type(err).__name__
            checks.append(MemoryCheck(label, setup, hw, None, measured, peak, "own record", f"not modelled: {msg}"))
            continue
        world = int(_get(record, "techniques.world_size", 1) or 1)
        ref = _single_device_reference(record, pool) if world > 1 else None
        if ref is not None:
            spec = planner.spec_from_record(_with_timing(ref))
            spec = replace(
                spec,
                micro_batch_size=int(_get(record, "techniques.micro_batch_size")),
                accumulate_grad_batches=int(_get(record, "techniques.accumulate_grad_batches", 1) or 1),
            )
            pred = planner.predict_memory_mib(spec, str(_get(record, "techniques.strategy")), world)
            checks.append(MemoryCheck(label, setup, hw, pred, measured, peak, f"from {_record_label(ref)}"))
    return checks


def memory_section(studies: Sequence[Study], extra: Sequence[dict]) -> str:
    checks = memory_checks(studies, extra)
    out = [
        "Per rank, in MiB, predicted / measured. The planner (`modelwright.planner.predict_record_memory_mib`) "
        "predicts parameters, gradients and optimizer state from the parameter count, the precision and the "
        "optimizer (bytes per parameter), sharded by the strategy over the world size. Activations and temporaries "
        "are inputs to it, taken from the record itself, so on a single device they match by construction; they "
        "become a prediction in the rows marked *from …*, where a multi-rank run is predicted from a single-device "
        "record with its activations scaled to the rank's micro-batch. The total is compared with the measured "
        "peak (the CUDA allocator's peak on a GPU, the memory tracker's on a CPU). "
        f"A category is within tolerance when the error is at most {_pct(TOLERANCE)} or the difference is under "
        f"{ABS_TOLERANCE_MIB:g} MiB.",
        "",
    ]
    if not checks:
        return "\n".join(out + ["No record with a memory anatomy was found.", ""])
    several = len({c.hardware for c in checks}) > 1
    body = []
    for c in checks:
        setup = f"{c.hardware}: {c.setup}" if several else c.setup
        if c.predicted is None:
            body.append([c.label, setup, c.basis] + ["–"] * 5 + ["–", c.error or "–"])
            continue
        cells = []
        for key in MEMORY_CATEGORIES:
            p, m = c.pair(key)
            cells.append(f"{_f(p, ',.1f')} / {_f(m, ',.1f')}")
        judged = c.judged()
        ok = all(c.within(k) for k in judged)
        misses = [k.replace("_", " ") for k in judged if c.within(k) is False]
        body.append(
            [c.label, setup, "own record" if c.basis == "own record" else f"*{c.basis}*"]
            + cells
            + [_pct(c.rel_error("total"), signed=True), "yes" if ok else "no: " + ", ".join(misses)]
        )
    out += [
        _table(
            [
                "run",
                "setup",
                "predicted from",
                "parameters",
                "gradients",
                "optimizer state",
                "activations + temporaries",
                "total / measured peak",
                "error (total)",
                f"within {_pct(TOLERANCE)}",
            ],
            body,
            "lllrrrrrrl",
        ),
        "",
    ]
    judged = [c for c in checks if c.predicted is not None]
    n_ok = sum(all(c.within(k) for k in c.judged()) for c in judged)
    n_total_ok = sum(bool(c.within("total")) for c in judged)
    out.append(
        f"{n_ok} of {len(judged)} predictions are within {_pct(TOLERANCE)} in every judged category; "
        f"{n_total_ok} of {len(judged)} in the total."
        + ("" if len(judged) == len(checks) else f" {len(checks) - len(judged)} record(s) could not be modelled.")
    )
    if not any(c.basis != "own record" for c in checks):
        out.append(
            "No multi-rank record (DDP, FSDP2) is among these records, so sharding is predicted here but not yet "
            "checked against a measurement (`--records` adds such records)."
        )
    misses = []
    for c in judged:
        for key in c.judged():
            if c.within(key) is False:
                p, m = c.pair(key)
                err = c.rel_error(key)
                direction = "over" if (p or 0) > (m or 0) else "under"
                where = f" on {c.hardware}" if several else ""
                misses.append(
                    f"- `{c.label}`{where} ({c.basis}), {key.replace('_', ' ')}: predicted {_f(p, ',.1f')} MiB, "
                    f"measured {_f(m, ',.1f')} MiB ({_pct(err, signed=True) if err is not None else 'no ratio'}). "
                    f"Likely: {MISS_REASONS.get((key, direction), 'not explained by the model')}."
                )
    if misses:
        out += ["", "Where the model misses, and the likely reason:", "", *misses]
    else:
        out += ["", "No judged category misses."]
    out.append("")
    budget = [(s, b) for s in studies for b in s.budget if b.predicted_peak_mib is not None]
    if budget:
        rows = []
        for s, b in budget:
            err = _ratio(b.predicted_peak_mib, b.measured_peak_mib)
            err = None if err is None else err - 1
            within = "–" if err is None else ("yes" if abs(err) <= TOLERANCE else "no")
            rows.append(
                [
                    b.name,
                    s.label if len(studies) > 1 else s.slug,
                    "–" if b.from_batch is None else str(b.from_batch),
                    "–" if b.predicted_batch is None else str(b.predicted_batch),
                    _f(b.predicted_peak_mib, ",.1f"),
                    _f(b.measured_peak_mib, ",.1f"),
                    _pct(err, signed=True),
                    within,
                ]
            )
        out += [
            "Across batch sizes: the study predicts the peak of a larger batch from a measured one (activations and "
            "backward temporaries per sample, the rest fixed), then measures it. Its last prediction per run:",
            "",
            _table(
                [
                    "run",
                    "hardware",
                    "measured at batch",
                    "predicted for batch",
                    "predicted peak MiB",
                    "measured peak MiB",
                    "error",
                    f"within {_pct(TOLERANCE)}",
                ],
                rows,
                "llrrrrrl",
            ),
            "",
        ]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------
# The planning job: a GPU measurement, or a CPU measurement with a published GPU rate
# ---------------------------------------------------------------------------------------------------------


@dataclass
class PlanningJob:
    """What the spreading and economics sections plan with."""

    study: Study
    row: report.Row
    record: dict
    spec: planner.JobSpec | None  # step time on the GPU (measured, or estimated); None when it cannot be had
    measured_on_gpu: bool
    device: str  # the price list's device name
    price: planner.DevicePrice
    device_memory_gib: float
    flops_per_sample: float | None
    cpu_samples_per_s: float | None = None

    def assumptions(self, usd_per_hour: float | None = None) -> planner.Assumptions:
        p = self.price
        return planner.Assumptions(
            usd_per_device_hour=usd_per_hour if usd_per_hour is not None else p.usd_per_hour_low,
            price_label=f"{self.device}, ${p.usd_per_hour_low:.2f}–{p.usd_per_hour_high:.2f}/h; {SOURCES['prices']}",
            device_memory_gib=self.device_memory_gib,
        )


def _price_for(device_name: str) -> str:
    name = device_name.upper()
    for key, needle in (("H200", "H200"), ("H100 SXM", "H100"), ("A100 80GB", "A100")):
        if needle in name:
            return key
    return planner.DEFAULT_DEVICE


def planning_job(studies: Sequence[Study]) -> PlanningJob | None:
    gpu = [s for s in studies if s.is_gpu]
    study = gpu[0] if gpu else studies[0]
    row = main_job_row(study)
    if row is None:
        return None
    record = representative(row)
    flops = _finite(_get(record, "flops.flops_per_step"))
    t = record.get("techniques") or {}
    samples_per_step = (t.get("micro_batch_size") or 0) * (t.get("accumulate_grad_batches") or 1)
    per_sample = flops / samples_per_step if flops and samples_per_step else None
    try:
        spec = planner.spec_from_record(record)
    except (ConfigError, KeyError, TypeError, ValueError):
        spec = None
    if study.is_gpu:
        # The median over repeats, as in the study's table, not the one record's own step time.
        sps = _finite(row.values.get("samples_per_s"))
        if spec is not None and sps:
            spec = replace(spec, step_time_ms=spec.micro_batch_size * spec.accumulate_grad_batches / sps * 1000)
        device = _price_for(str(study.hardware.get("device_name") or ""))
        mem = _finite(study.hardware.get("device_memory_mib"))
        mem_gib = mem / 1024 if mem else planner.Assumptions().device_memory_gib
        return PlanningJob(study, row, record, spec, True, device, planner.DEFAULT_PRICES[device], mem_gib, per_sample)
    device = ESTIMATE_DEVICE
    cpu_sps = _finite(row.values.get("samples_per_s"))
    if spec is not None and flops:
        est_ms = flops / AIRBENCH_RESNET18_FLOPS_PER_S * 1000
        spec = replace(spec, step_time_ms=est_ms, source=f"{spec.source}, step time estimated from a published rate")
    else:
        spec = replace(spec, step_time_ms=0.0) if spec is not None else None
    return PlanningJob(
        study,
        row,
        record,
        spec,
        False,
        device,
        planner.DEFAULT_PRICES[device],
        planner.Assumptions().device_memory_gib,
        per_sample,
        cpu_sps,
    )


# ---------------------------------------------------------------------------------------------------------
# Section: spreading the job over many GPUs
# ---------------------------------------------------------------------------------------------------------


def spreading_section(job: PlanningJob | None) -> str:
    if job is None or job.spec is None:
        return "No ok record with a memory anatomy and timing to plan with.\n"
    spec, a = job.spec, job.assumptions()
    st = spec.state
    state_mib = st.total * spec.num_params / planner.MIB
    act_mib = spec.microbatch_activation_bytes / planner.MIB
    per_sample_mib = spec.activation_bytes_per_sample / planner.MIB
    device_mib = a.device_memory_gib * 1024
    timed = spec.step_time_ms > 0
    out = [
        f"Planned with the planner (`modelwright.planner`) from the `{job.row.name}` run on the {job.study.label}, "
        f"{report.setup_text(job.record)}: {spec.num_params:,} parameters at {st.total:g} bytes each "
        f"({st.weights:g} weights + {st.gradients:g} gradients + {st.optimizer:g} optimizer state; {st.regime}) = "
        f"{state_mib:,.1f} MiB of model state, and {act_mib:,.1f} MiB of activations for a micro-batch of "
        f"{spec.micro_batch_size} ({per_sample_mib:.3g} MiB per sample). "
        f"Device memory: {a.device_memory_gib:.3g} GiB"
        + (" (the record's GPU)." if job.measured_on_gpu else f" (an {job.device}; no GPU was measured).")
        + f" Network: {a.bus_bandwidth_gb_per_s:g} GB/s of bus bandwidth per GPU (one 400 Gb/s InfiniBand port), "
        f"{_pct(a.overlap_fraction)} of the communication overlapped with compute"
        + (", so times are upper bounds." if a.overlap_fraction == 0 else "."),
        "",
    ]
    preds = {(s, n): planner.predict_step(spec, s, n, a) for s in SPREAD_STRATEGIES for n in DEVICE_COUNTS}
    single = preds[("dp", 1)]
    body = []
    for s in SPREAD_STRATEGIES:
        for n in DEVICE_COUNTS:
            if n == 1 and s != "dp":
                continue
            p = preds[(s, n)]
            eff = _ratio(p.samples_per_s, n * single.samples_per_s) if timed else None
            body.append(
                [
                    "one GPU" if n == 1 else planner.STRATEGY_LABELS[s],
                    str(n),
                    f"{p.memory_mib['total']:,.1f}",
                    f"{p.comm_bytes / planner.MIB:,.1f}",
                    _duration(p.comm_s) if n > 1 else "–",
                    _duration(p.step_s) if timed else "–",
                    _f(p.samples_per_s, ",.0f") if timed else "–",
                    _pct(eff) if eff is not None else "–",
                ]
            )
    step_note = (
        "measured on this GPU"
        if job.measured_on_gpu
        else f"estimated from a published {job.device} rate (see the economics below)"
    )
    out += [
        f"Per GPU, per optimizer step; the single-GPU step is {step_note}. DP and ZeRO keep the micro-batch per "
        "GPU fixed (weak scaling); TP and PP split one replica over the N GPUs. Efficiency = samples/s ÷ "
        "(N × one GPU's).",
        "",
        _table(
            [
                "strategy",
                "N",
                "memory per GPU MiB",
                "sent per GPU MiB",
                "comm time",
                "step time",
                "samples/s",
                "efficiency",
            ],
            body,
            "lrrrrrrr",
        ),
        "",
    ]
    limits = {(s, n): planner.max_params_that_fit(spec, s, n, a) for s in SPREAD_STRATEGIES for n in DEVICE_COUNTS}
    out += [
        f"Largest parameter count whose model state fits {a.device_memory_gib:.3g} GiB per GPU, activations held at "
        "this job's:",
        "",
        _table(
            ["strategy"] + [f"N = {n}" for n in DEVICE_COUNTS],
            [[planner.STRATEGY_LABELS[s]] + [_count(limits[(s, n)]) for n in DEVICE_COUNTS] for s in SPREAD_STRATEGIES],
        ),
        "",
    ]
    dp_limit = limits[("dp", 1)]
    max_micro = (
        int((device_mib - state_mib - spec.temporaries_bytes / planner.MIB) // per_sample_mib)
        if (per_sample_mib > 0)
        else None
    )
    dp8, fsdp8 = preds[("dp", 8)], preds[("fsdp", 8)]
    fsdp_comm = _ratio(preds[("fsdp", 64)].comm_bytes, preds[("dp", 64)].comm_bytes)
    m = a.microbatches_for(PP_EXAMPLE_STAGES)
    bubble = planner.pipeline_bubble_fraction(PP_EXAMPLE_STAGES, m, a.pp_interleave)
    dp_fits = spec.num_params <= dp_limit
    lines = [
        "**What this means for this model.** "
        + (
            f"With {_count(spec.num_params)} parameters the model state is {_pct(state_mib / device_mib)} of one "
            f"GPU's memory and the model is {_pct(spec.num_params / dp_limit)} of the largest one plain data "
            f"parallelism fits ({_count(dp_limit)}): every GPU can hold a full replica, so **DDP** is the way to "
            "spread it. Each GPU trains on its own slice of the data and all-reduces the gradients once per step"
            if dp_fits
            else f"At {_count(spec.num_params)} parameters the model does not fit one GPU with plain data "
            "parallelism; it needs sharding"
        )
        + f": {dp8.comm_bytes / planner.MIB:,.1f} MiB sent per GPU per step at N = 8"
        + (f", {_duration(dp8.comm_s)} against a {_duration(dp8.compute_s)} step" if timed else "")
        + ".",
        f"**ZeRO / FSDP** become necessary when the model outgrows a replica: above {_count(dp_limit)} parameters "
        f"on {a.device_memory_gib:.3g} GiB GPUs with this job's activations. ZeRO-1 (optimizer state sharded) "
        f"stretches that to {_count(limits[('zero1', 8)])} on 8 GPUs, ZeRO-2 (and gradients) to "
        f"{_count(limits[('zero2', 8)])}, full sharding (ZeRO-3, FSDP) to {_count(limits[('fsdp', 8)])} on 8 and "
        f"{_count(limits[('fsdp', 64)])} on 64. The price is traffic: FSDP gathers the weights in forward and "
        f"backward, {_x(fsdp_comm)} the bytes of DDP per step here"
        + (f" ({_duration(fsdp8.comm_s)} per step at N = 8)" if timed else "")
        + ". For this model it would buy nothing but that traffic.",
        "**Tensor parallelism** (splitting each layer's matrices over GPUs) becomes necessary when one layer's "
        "weights or one micro-batch's activations outgrow a GPU even after sharding, or when the global batch of "
        "data parallelism grows past what still trains well; it needs the fast links inside one node because it "
        "communicates inside every layer. "
        + (
            f"Here one sample's activations are {per_sample_mib:.3g} MiB, so one GPU holds a micro-batch of about "
            f"{max_micro:,} samples before its memory runs out"
            if max_micro
            else "Here the activations alone do not fit a GPU"
        )
        + ". The planner's TP figures above use a transformer's ratio of layer-output to saved activations "
        f"({planner.BOUNDARY_FRACTION:.3f}) as a stand-in, which a CNN only roughly follows.",
        f"**Pipeline parallelism** (consecutive layers on consecutive GPUs) is for models too deep or too big for "
        f"one node's TP group; its cost is the bubble, (p − 1)/m: with {PP_EXAMPLE_STAGES} stages and {m} "
        f"micro-batches {_pct(bubble)} of the ideal compute time is idle. A network of "
        f"{_count(spec.num_params)} parameters has no use for it.",
    ]
    out += ["\n\n".join(lines), ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------
# Section: economics
# ---------------------------------------------------------------------------------------------------------


def _scaling_table(job: PlanningJob, epochs: float) -> tuple[str, dict[int, Any]]:
    spec = job.spec
    assert spec is not None
    low = job.assumptions(job.price.usd_per_hour_low)
    high_price = job.price.usd_per_hour_high
    rows, by_n = [], {}
    single = planner.predict_step(spec, "dp", 1, low)
    for n in DEVICE_COUNTS:
        p = planner.predict_step(spec, "dp", n, low)
        hours = planner.train_time_s(p.samples_per_s, epochs, DATASET_SIZE) / 3600
        cost_low = planner.cost_usd(n, hours, job.price.usd_per_hour_low)
        cost_high = planner.cost_usd(n, hours, high_price)
        speedup = _ratio(p.samples_per_s, single.samples_per_s)
        by_n[n] = {"pred": p, "hours": hours, "cost_low": cost_low, "cost_high": cost_high, "speedup": speedup}
        cost = _usd(cost_low) if cost_low == cost_high else f"{_usd(cost_low)}–{_usd(cost_high)}"
        rows.append(
            [
                str(n),
                f"{p.samples_per_step:,}",
                _duration(p.step_s),
                f"{p.samples_per_s:,.0f}",
                _x(speedup),
                _pct(_ratio(speedup, n)),
                _duration(hours * 3600),
                f"{n * hours:,.2f}",
                cost,
            ]
        )
    table = _table(
        [
            "GPUs",
            "global batch",
            "step time",
            "samples/s",
            "speed-up",
            "efficiency",
            f"{epochs:g} epochs",
            "GPU-hours",
            f"cost ({job.device})",
        ],
        rows,
        "rrrrrrrrr",
    )
    return table, by_n


def _economics_reading(by_n: Mapping[int, Any], n_max: int) -> str:
    one, big = by_n[1], by_n[n_max]
    eff = _ratio(big["speedup"], n_max)
    time_cut = _ratio(big["hours"], one["hours"])
    cost_up = _ratio(big["cost_low"], one["cost_low"])
    if cost_up is not None and cost_up > 1 + 1e-9:
        verdict = (
            f"{n_max} GPUs finish in {_pct(time_cut)} of one GPU's time but cost {_x(cost_up)} as much: the GPU-hours "
            f"lost to communication ({_pct(1 - eff)} of them at N = {n_max}) are paid for."
        )
    else:
        verdict = f"{n_max} GPUs finish in {_pct(time_cut)} of one GPU's time at no extra cost in this model."
    return verdict + " "


def economics_section(job: PlanningJob | None, studies: Sequence[Study], epochs: float, cpu_usd: float | None) -> str:
    if job is None:
        return "No ok run to price.\n"
    samples = epochs * DATASET_SIZE
    out = [
        f"The job: {epochs:g} epochs of CIFAR-10's {DATASET_SIZE:,} training samples ({samples:,.0f} samples), "
        f"the main job `{job.row.name}` ({report.setup_text(job.record)}). Data parallel, weak scaling: each GPU "
        "keeps the measured micro-batch, so the global batch grows with N. Prices: "
        f"{job.device} at ${job.price.usd_per_hour_low:.2f}–{job.price.usd_per_hour_high:.2f} per GPU-hour "
        f"({SOURCES['prices']}; prices move).",
        "",
    ]
    if not job.measured_on_gpu:
        cpu_sps = job.cpu_samples_per_s
        cpu_s = planner.train_time_s(cpu_sps, epochs, DATASET_SIZE) if cpu_sps else None
        slugs = ", ".join(f"`{s.slug}`" for s in studies)
        line = (
            f"**Only CPU measurements exist** ({slugs}). On the {job.study.label} the main job ran at "
            f"{_f(cpu_sps, ',.1f')} samples/s, so {epochs:g} epochs would take {_duration(cpu_s)} on that machine"
        )
        if cpu_usd is not None and cpu_s is not None:
            line += f", {_usd(cpu_s / 3600 * cpu_usd)} at the given ${cpu_usd:.2f} per machine-hour."
        else:
            line += (
                "; our cited prices are for GPUs only, so the CPU job is given in machine-hours "
                f"({_f(cpu_s / 3600 if cpu_s else None, ',.1f')}) and not priced "
                "(`--cpu-usd-per-hour` prices it)."
            )
        out += [line, ""]
        if job.spec is None or job.spec.step_time_ms <= 0:
            out += ["The record has no FLOP count, so no GPU estimate can be made from a published rate.", ""]
            return "\n".join(out)
        ab = PUBLISHED["airbench_resnet18"]
        model = str(_get(job.record, "techniques.model_name") or "")
        step_samples = job.spec.micro_batch_size * job.spec.accumulate_grad_batches
        gpu_vs_cpu = _ratio(step_samples / (job.spec.step_time_ms / 1000), job.cpu_samples_per_s)
        out += [
            f"**GPU estimate from published figures, not a measurement.** Assumption: one {job.device} sustains the "
            f"rate airbench's standard ResNet-18 baseline reached on one A100, {ab['pflop']:g} PFLOP in "
            f"{ab['minutes']:g} min = {AIRBENCH_RESNET18_FLOPS_PER_S / 1e12:.0f} TFLOP/s ({SOURCES['airbench']}). "
            f"Our record counts {_f(job.flops_per_sample / 1e9 if job.flops_per_sample else None, '.3g')} GFLOP per "
            f"training sample, so one optimizer step of {step_samples} samples would take "
            f"{_duration(job.spec.step_time_ms / 1000)}"
            + ("" if model.startswith("resnet") else f" (a ResNet-18 rate applied to {model}: rougher still)")
            + f". The estimate puts one GPU at {_x(gpu_vs_cpu)} this CPU's throughput.",
            "",
        ]
    else:
        v = job.row.values
        out += [
            f"**Measured on the {job.study.label}:** one GPU ran the main job at {_f(v.get('samples_per_s'), ',.0f')} "
            f"samples/s (median step {_f(v.get('step_time_median_ms'), ',.1f')} ms over "
            f"{v.get('measured_steps')} measured steps).",
            "",
        ]
        cpu = [s for s in studies if not s.is_gpu]
        for s in cpu:
            crow = main_job_row(s)
            if crow is not None:
                ratio = _ratio(v.get("samples_per_s"), crow.values.get("samples_per_s"))
                out += [f"On the {s.label} (`{s.slug}`) the same run was {_x(ratio)} slower.", ""]
        if job.flops_per_sample:
            est_sps = AIRBENCH_RESNET18_FLOPS_PER_S / job.flops_per_sample
            out += [
                f"For scale: at airbench's published ResNet-18 rate on an A100 "
                f"({AIRBENCH_RESNET18_FLOPS_PER_S / 1e12:.0f} TFLOP/s) this job would run {est_sps:,.0f} samples/s; "
                f"the measurement is {_x(_ratio(v.get('samples_per_s'), est_sps))} that.",
                "",
            ]
    if job.spec is None or job.spec.step_time_ms <= 0:
        return "\n".join(out + ["The main job's record has no step time to scale.", ""])
    table, by_n = _scaling_table(job, epochs)
    n_max = DEVICE_COUNTS[-1]
    steps_per_epoch = DATASET_SIZE / by_n[n_max]["pred"].samples_per_step
    out += [
        table,
        "",
        _economics_reading(by_n, n_max)
        + f"At N = {n_max} the global batch is {by_n[n_max]['pred'].samples_per_step:,} samples, "
        f"{steps_per_epoch:.3g} optimizer steps per epoch: "
        "whether such a batch reaches the same accuracy in the same epochs (it needs a scaled learning rate and "
        f"warm-up) is not measured here, so the {n_max}-GPU row is the cost of the arithmetic, not a promise of the "
        "result. Start-up, data loading, validation and checkpoints are left out.",
        "",
    ]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------
# Section: short answers
# ---------------------------------------------------------------------------------------------------------


def _prefix(study: Study, studies: Sequence[Study]) -> str:
    return f"On the {study.label}: " if len(studies) > 1 else ""


def _qa(question: str, answer: str, measured: Sequence[str]) -> list[str]:
    """A question, our general answer, then what the records say, one bullet per finding."""
    out = [f"### {question}", "", answer, ""]
    if measured:
        out += [f"- {line[0].upper()}{line[1:]}" for line in measured] + [""]
    return out


def _memory_dominance(studies: Sequence[Study]) -> list[str]:
    lines = []
    for s in studies:
        ref = reference_row(s)
        if ref is None:
            continue
        a = ref.values["anatomy_mib"]
        state = sum(_finite(a.get(k)) or 0.0 for k in ("parameters", "gradients", "optimizer_state"))
        act = _finite(a.get("activations")) or 0.0
        total = _finite(ref.values.get("anatomy_total_mib")) or (state + act)
        micro = _get(ref.records[0], "techniques.micro_batch_size") or 0
        dominant = "activations dominate" if act > state else "weights, gradients and optimizer state dominate"
        line = (
            f"{_prefix(s, studies)}in `{ref.name}` ({report.setup_text(ref.records[0])}) {dominant}: activations "
            f"{act:,.1f} MiB ({_pct(_ratio(act, total))} of the {total:,.1f} MiB at the peak) against "
            f"{state:,.1f} MiB of weights, gradients and optimizer state."
        )
        if act and micro:
            line += f" The two would be equal at a micro-batch of about {state / (act / micro):,.0f}."
        lines.append(line)
    return lines


def _mixed_precision_findings(studies: Sequence[Study]) -> list[str]:
    lines = []
    for s in studies:
        amp, ref = amp_row(s), reference_row(s)
        if amp is None or ref is None:
            lines.append(f"{_prefix(s, studies)}no mixed-precision run beside a reference was measured.")
            continue
        o = outcome(amp, ref)
        state_same = all(
            _finite(amp.values["anatomy_mib"].get(k)) == _finite(ref.values["anatomy_mib"].get(k))
            for k in ("parameters", "gradients", "optimizer_state")
        )
        text = (
            f"{_prefix(s, studies)}`{amp.name}` against `{ref.name}`: activations {_x(o.activation_ratio)}, "
            f"{o.memory_text()}, {o.time_text()}"
            + ("; weights, gradients and optimizer state unchanged, as expected." if state_same else ".")
        )
        device = "GPU" if s.is_gpu else "CPU"
        if o.memory_saved and not o.time_saved:
            text += f" So on this {device} mixed precision saved memory but not time."
            if not s.is_gpu:
                ra, rr = representative(amp), representative(ref)
                pa, pr = _finite(_get(ra, "flops.peak_flops_per_s")), _finite(_get(rr, "flops.peak_flops_per_s"))
                measured = {_get(ra, "flops.peak_flops_source"), _get(rr, "flops.peak_flops_source")} == {
                    "measured-matmul"
                }
                if measured and pa and pr and pa < pr:
                    text += (
                        f" The records show why: a 16-bit matrix multiply ran at {pa / 1e9:,.0f} GFLOP/s on this CPU "
                        f"against {pr / 1e9:,.0f} for fp32."
                    )
                text += (
                    " A CPU without 16-bit matrix units multiplies bf16 no faster than fp32, and autocast adds the "
                    f"casts: the {SOURCES['pytorch-cpu']} says CPU autocast is slower than fp32 without AVX512-BF16. "
                    "The memory saving does not depend on the hardware."
                )
        elif o.memory_saved and o.time_saved:
            text += f" On this {device} it saved both."
        elif not o.memory_saved:
            text += " It did not lower the peak here: something other than the saved activations set it."
        lines.append(text)
    return lines


def _technique_findings(
    studies: Sequence[Study], kinds: set[str], missing: str, detail: str | None = None
) -> list[str]:
    lines = []
    for s in studies:
        rows = technique_rows(s, kinds)
        for row in rows:
            ref = s.reference(row)
            o = outcome(row, ref)
            what = _get(row.records[0], detail) if detail else report.setup_text(row.records[0])
            lines.append(
                f"{_prefix(s, studies)}`{row.name}` ({what}) against `{ref.name}`: activations "
                f"{_x(o.activation_ratio)}, {o.memory_text()}, {o.time_text()}."
            )
        if not rows:
            lines.append(f"{_prefix(s, studies)}{missing}")
    return lines


def _forty_percent_findings(studies: Sequence[Study]) -> list[str]:
    lines = []
    for s in studies:
        ref = reference_row(s)
        if ref is None:
            continue
        cuts = [(r, outcome(r, ref)) for r in s.ok_rows if r.reference == ref.name and r is not ref]
        big = [(r, o) for r, o in cuts if o.memory_ratio is not None and o.memory_ratio <= 0.6]
        lines.append(
            f"{_prefix(s, studies)}runs that cut the peak by 40% or more: "
            + (", ".join(f"`{r.name}` ({_pct(1 - o.memory_ratio)})" for r, o in big) if big else "none")
            + "."
        )
        fits = [b for b in s.budget if b.fits and b.vs_reference]
        if fits:
            lines.append(
                f"{_prefix(s, studies)}under the study's {fits[0].budget_mib:,.0f} MiB budget the largest micro-batch "
                "was, against the reference's: "
                + ", ".join(f"`{b.name}` {b.predicted_batch} ({_x(b.vs_reference)})" for b in fits)
                + "."
            )
    z = PUBLISHED["zero_example"]
    mixed = planner.param_state_bytes("playbook-mixed", "adamw")
    a = planner.Assumptions()
    state = z["params"] * mixed.total
    per_gpu = a.device_memory_gib * planner.GIB
    lines.append(
        f"a worked example with the planner's bytes per parameter: a {_count(z['params'])}-parameter model in mixed "
        f"precision with Adam holds {mixed.total:g} B per parameter, {state / planner.GIB:,.0f} GiB of model state; "
        f"fully sharded over {a.device_memory_gib:.3g} GiB GPUs it needs at least {math.ceil(state / per_gpu)} GPUs "
        f"before any activations, {math.ceil(0.6 * state / per_gpu)} with 40% less."
    )
    return lines


def answers_section(studies: Sequence[Study], job: PlanningJob | None) -> str:
    out: list[str] = []
    out += _qa(
        "What must fit in device memory during training, and which dominates here?",
        "Three things: the model's weights and their gradients, the optimizer's state (AdamW keeps two moments per "
        "weight), and the activations the forward pass saves for backward, plus short-lived temporaries. The first "
        "two grow with the parameter count, not with the batch; activations grow with the batch and the input size.",
        _memory_dominance(studies),
    )
    out += _qa(
        "Why does mixed precision save both memory and time, and what did it save here?",
        "Under autocast the matrix multiplies and convolutions run in 16 bits, and the activations they save for "
        "backward are 16-bit tensors: half the bytes of what is usually the largest consumer of memory. The weights, "
        "gradients and optimizer state stay in fp32, so that part does not shrink. Time falls on hardware with "
        "16-bit matrix units (tensor cores), which multiply 16-bit numbers several times faster than fp32, and "
        "because half the bytes move through memory.",
        _mixed_precision_findings(studies),
    )
    out += _qa(
        "What does gradient accumulation simulate, and why does it matter on a small GPU?",
        "It simulates a batch k times larger than fits: k micro-batches run forward and backward one after the "
        "other, their gradients add up, and the optimizer steps once. The update equals that of the big batch "
        "(layers that normalise over the batch, like BatchNorm, see micro-batch statistics instead). On a small GPU "
        "it keeps the effective batch, and with it the learning-rate recipe, while only one micro-batch's "
        "activations are alive at a time; the cost is smaller kernels that keep the device less busy.",
        _technique_findings(studies, {"accumulation"}, "no accumulation-only run finished."),
    )
    parallel: list[str] = []
    if job is not None and job.spec is not None:
        a = job.assumptions()
        dp_limit = planner.max_params_that_fit(job.spec, "dp", 1, a)
        fits = job.spec.num_params <= dp_limit
        parallel.append(
            f"for this job, by the planner: plain data parallelism works up to about {_count(dp_limit)} parameters "
            f"on {a.device_memory_gib:.3g} GiB GPUs and the model has {_count(job.spec.num_params)}, "
            + (
                "so DDP is the answer and the other three would only add communication."
                if fits
                else "so it needs sharding (FSDP) at least."
            )
        )
    out += _qa(
        "Data, tensor and pipeline parallelism: what are they and when is each needed?",
        "Data parallelism gives every GPU a full replica and a different slice of each batch, and averages the "
        "gradients; it is what to reach for when one GPU is too slow, and it is enough while a replica fits. "
        "Sharded data parallelism (ZeRO, FSDP) keeps that scheme but splits the weights, gradients and optimizer "
        "state across the GPUs, for models whose state no longer fits one. Tensor parallelism splits each layer's "
        "matrices, for layers or activations too big for one GPU, at the price of communication inside every layer "
        "(so it stays inside a node's fast links). Pipeline parallelism puts consecutive layers on consecutive GPUs "
        "and streams micro-batches through them, for models too big even for a node's tensor-parallel group, at "
        "the price of an idle bubble.",
        parallel,
    )
    out += _qa(
        "What does gradient checkpointing trade for what?",
        "It trades compute for memory: instead of keeping every activation for backward, it keeps only each "
        "segment's input and runs the segment's forward again during backward. Activation memory falls to about one "
        "segment's worth plus the boundaries; the price is one more forward pass, about a third more compute when "
        "backward costs twice the forward.",
        _technique_findings(
            studies, {"checkpointing"}, "no checkpointing-only run finished.", "techniques.gradient_checkpointing"
        ),
    )
    out += _qa(
        "Why does a 40% cut in memory matter beyond convenience?",
        "Because memory decides which hardware and which parallelism a job needs, and both cost money and time. A "
        "smaller footprint lets a larger micro-batch fit, which keeps the GPU busy and makes accumulation "
        "unnecessary; it lets the job run on a smaller, cheaper GPU; and for large models it postpones sharding and "
        "model parallelism, whose communication is paid on every step. Under full sharding the number of GPUs needed "
        "just to hold a model is proportional to its bytes, so 40% less memory is up to 40% fewer GPUs.",
        _forty_percent_findings(studies),
    )
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------
# Section: our figures beside published ones
# ---------------------------------------------------------------------------------------------------------


def _ours(studies: Sequence[Study], fn) -> str:
    parts = []
    for s in studies:
        value = fn(s)
        if value:
            parts.append(f"{s.label}: {value}" if len(studies) > 1 else value)
    return "; ".join(parts) or "not measured"


def _technique_figure(study: Study, rows: list[report.Row]) -> str | None:
    if not rows:
        return None
    row = rows[-1]
    ref = study.reference(row)
    o = outcome(row, ref)
    sps = _ratio(row.values.get("samples_per_s"), ref.values.get("samples_per_s"))
    return f"`{row.name}`: memory {_x(o.memory_ratio)}, throughput {_x(sps)}"


def published_section(studies: Sequence[Study], job: PlanningJob | None) -> str:
    hf = PUBLISHED["hf"]
    v = hf["vanilla"]

    def hf_vs(run: HFRun, base: HFRun = v) -> str:
        return (
            f"{run.label}: memory {run.memory_mb / base.memory_mb:.2f}× ({run.memory_mb:,.0f} vs {base.memory_mb:,.0f} "
            f"MB), throughput {run.samples_per_s / base.samples_per_s:.2f}× ({run.samples_per_s:g} vs "
            f"{base.samples_per_s:g} samples/s)"
        )

    nv = PUBLISHED["nvidia_resnet50"]
    chen = PUBLISHED["chen"]
    lo, hi = PUBLISHED["playbook_recompute_cost"]
    sel = PUBLISHED["playbook_selective"]
    rows = [
        [
            "Mixed precision",
            _ours(studies, lambda s: _technique_figure(s, [r] if (r := amp_row(s)) else [])),
            f"{hf_vs(hf['fp16'])}. ResNet-50 on A100: {nv['amp_img_per_s']:,} vs {nv['tf32_img_per_s']:,} img/s "
            f"AMP vs TF32 ({nv['amp_img_per_s'] / nv['tf32_img_per_s']:.2f}×)",
            f"{SOURCES['hf']}; {SOURCES['nvidia']}",
        ],
        [
            "Gradient accumulation",
            _ours(studies, lambda s: _technique_figure(s, technique_rows(s, {"accumulation"}))),
            hf_vs(hf["accumulate"]),
            SOURCES["hf"],
        ],
        [
            "Gradient checkpointing",
            _ours(studies, lambda s: _technique_figure(s, technique_rows(s, {"checkpointing"}))),
            f"on top of accumulation, {hf_vs(hf['accumulate+checkpointing'], hf['accumulate'])}; cost "
            f"{PUBLISHED['hf_checkpointing_cost']}. {chen['layers']:,}-layer ResNet {chen['memory_from_gb']} GB → "
            f"{chen['memory_to_gb']} GB for +{chen['time_increase']:.0%} time. Full recomputation "
            f"+{lo:.0%}–{hi:.0%} compute; selective recomputation (GPT-3 175B) saved "
            f"{sel['activation_saving']:.0%} of activation memory for +{sel['compute_increase']:.1%} compute",
            f"{SOURCES['hf']}; {SOURCES['chen']}; {SOURCES['playbook']}",
        ],
        [
            "All three",
            _ours(
                studies,
                lambda s: _technique_figure(s, technique_rows(s, {"precision", "accumulation", "checkpointing"})),
            ),
            hf_vs(hf["all"]),
            SOURCES["hf"],
        ],
    ]

    def state_bytes(s: Study) -> str | None:
        ref = reference_row(s)
        if ref is None:
            return None
        rec = ref.records[0]
        psi = _finite(_get(rec, "memory.model_parameters"))
        a = ref.values["anatomy_mib"]
        state = sum(_finite(a.get(k)) or 0.0 for k in ("parameters", "gradients", "optimizer_state"))
        if not psi:
            return None
        return (
            f"`{ref.name}` ({_get(rec, 'techniques.precision')}, {_get(rec, 'techniques.optimizer')}): "
            f"{state * planner.MIB / psi:.1f} B per parameter measured"
        )

    ab = PUBLISHED["adam_bytes_per_param"]
    rows.append(
        [
            "Model state per parameter, Adam",
            _ours(studies, state_bytes),
            f"fp32 {ab['32-true']} B; mixed precision {ab['mixed']} B; with fp32 gradient accumulation "
            f"{ab['mixed-fp32-grads']} B",
            f"{SOURCES['playbook']}; {SOURCES['zero']}",
        ]
    )
    z = PUBLISHED["zero_example"]
    mixed = planner.param_state_bytes("playbook-mixed", "adamw")
    ours_zero = [
        sum(planner.state_bytes_per_rank(z["params"], mixed, s, z["devices"]).values()) / planner.GB
        for s in ("dp", "zero1", "zero2", "fsdp")
    ]
    rows.append(
        [
            f"ZeRO, {_count(z['params'])} parameters, N = {z['devices']} (GB per GPU, DP → ZeRO-1 → 2 → 3)",
            "planner: " + " → ".join(f"{g:.3g}" for g in ours_zero),
            " → ".join(f"{g:g}" for g in z["gb"]),
            SOURCES["zero"],
        ]
    )
    if job is not None and job.spec is not None and job.spec.step_time_ms > 0:
        p8 = planner.predict_step(job.spec, "dp", 8, job.assumptions())
        p1 = planner.predict_step(job.spec, "dp", 1, job.assumptions())
        rows.append(
            [
                "Data-parallel speed-up on 8 GPUs",
                f"planner, DDP, no overlap: {_x(_ratio(p8.samples_per_s, p1.samples_per_s))} "
                + ("(from the GPU measurement)" if job.measured_on_gpu else "(from the published-rate estimate)"),
                f"ResNet-50: {nv['scale8_tf32']}× TF32, {nv['scale8_amp']}× AMP. DDP: {PUBLISHED['ddp_scaling']}. "
                f"Horovod: {PUBLISHED['horovod_scaling']}. FSDP: {PUBLISHED['fsdp_scaling']}",
                f"{SOURCES['nvidia']}; {SOURCES['ddp']}; {SOURCES['horovod']}; {SOURCES['fsdp']}",
            ]
        )

    def flops_rate(s: Study) -> str | None:
        row = main_job_row(s)
        if row is None:
            return None
        rec = representative(row)
        achieved = _finite(_get(rec, "flops.achieved_flops_per_s"))
        mfu = _finite(row.values.get("mfu"))
        if achieved is None:
            return None
        return f"`{row.name}`: {achieved / 1e12:.3g} TFLOP/s achieved" + (f", MFU {_pct(mfu)}" if mfu else "")

    ab18 = PUBLISHED["airbench_resnet18"]
    rows.append(
        [
            "Training throughput (FLOP/s, MFU)",
            _ours(studies, flops_rate),
            f"airbench ResNet-18 on A100: {ab18['pflop']:g} PFLOP in {ab18['minutes']:g} min ≈ "
            f"{AIRBENCH_RESNET18_FLOPS_PER_S / 1e12:.0f} TFLOP/s, "
            f"{_pct(AIRBENCH_RESNET18_FLOPS_PER_S / PUBLISHED['a100_bf16_peak_flops'])} of the A100's "
            f"{PUBLISHED['a100_bf16_peak_flops'] / 1e12:.0f} TFLOP/s bf16 peak. MFU at scale: {PUBLISHED['mfu']}",
            f"{SOURCES['airbench']}; {SOURCES['a100']}; {SOURCES['mfu']}",
        ]
    )
    intro = (
        "Published figures come from other models, hardware and conditions (the Hugging Face table is bert-large on "
        "a V100; ours is the study's model on the hardware named above); they show the direction and rough size to "
        "expect, not a target. Ratios of published figures are computed here from the numbers as published."
    )
    return "\n".join(
        [
            intro,
            "",
            _table(["what", "ours (computed from our records)", "published", "source"], rows, "llll"),
            "",
        ]
    )


# ---------------------------------------------------------------------------------------------------------
# The document
# ---------------------------------------------------------------------------------------------------------


def render(
    studies: Sequence[Study],
    extra: Sequence[dict] = (),
    epochs: float = DEFAULT_EPOCHS,
    command: str = "uv run python -m modelwright analysis",
    out_dir: Path | None = None,
    extra_names: Sequence[str] = (),
    cpu_usd_per_hour: float | None = None,
) -> str:
    """The whole document for these studies (deterministic: the same records give the same text)."""
    require(bool(studies), "--results: no results folder to analyse")
    job = planning_job(studies)
    out_dir = out_dir or Path.cwd()
    sources = []
    for s in studies:
        rel = Path(os.path.relpath((s.folder / "records.jsonl").resolve(), out_dir.resolve())).as_posix()
        n_ok = sum(1 for r in report.study_records(s.records) if r.get("status") == "ok")
        sources += [
            f"**{s.label}**, [`{s.slug}/records.jsonl`]({rel}) ({n_ok} ok records):",
            "",
            report.conditions_text(s.conditions),
            "",
        ]
    for name in extra_names:
        sources += [f"Extra records: `{name}`.", ""]
    parts = [
        "# Scaling analysis",
        "",
        f"_Generated by `{command}` from the records below and the planner's model "
        "(`src/modelwright/planner/`); do not edit by hand: rerun the command after a new study. Every figure "
        "marked as ours is computed from the records; published figures are quoted with their sources._",
        "",
        "## The records",
        "",
        *sources,
        "## What each technique bought",
        "",
        "Each run against the reference run of its model (marked *reference*), from the study's table: peak tensor "
        "memory, activations, and the median step time with its min–max over the measured steps. A step time whose "
        "range overlaps the reference's is read as unchanged.",
        "",
        *[techniques_section(s) for s in studies],
        "## Predicted vs measured memory per rank",
        "",
        memory_section(studies, extra),
        "## Spreading the job over many GPUs",
        "",
        spreading_section(job),
        f"## Economics: {epochs:g} epochs on 1, 8 and 64 GPUs",
        "",
        economics_section(job, studies, epochs, cpu_usd_per_hour),
        "## Short answers",
        "",
        answers_section(studies, job),
        "## Our figures beside published ones",
        "",
        published_section(studies, job),
    ]
    return "\n".join(parts).rstrip() + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = planner.OneLineParser(
        prog="python -m modelwright analysis",
        description="Write docs/scaling-analysis.md from the study's records and the planner's model.",
    )
    p.add_argument(
        "--results",
        action="append",
        type=Path,
        help="results/<slug> folder holding records.jsonl (repeatable; default: every results/*/)",
    )
    p.add_argument("--records", action="append", type=Path, default=[], help="extra records .jsonl (e.g. DDP runs)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the document to write (default {DEFAULT_OUT})")
    p.add_argument(
        "--epochs", type=planner.positive_float, default=DEFAULT_EPOCHS, help="epochs priced in the economics"
    )
    p.add_argument(
        "--cpu-usd-per-hour", type=planner.positive_float, help="price of the CPU machine, to price the CPU job"
    )
    return p


def _command(args: argparse.Namespace) -> str:
    parts = ["uv run python -m modelwright analysis"]
    for folder in args.results or []:
        parts.append(f"--results {_display(folder, f'results/{folder.name}')}")
    for path in args.records:
        parts.append(f"--records {_display(path, path.name)}")
    if args.out != DEFAULT_OUT:
        parts.append(f"--out {_display(args.out, args.out.name)}")
    if args.epochs != DEFAULT_EPOCHS:
        parts.append(f"--epochs {args.epochs:g}")
    if args.cpu_usd_per_hour is not None:
        parts.append(f"--cpu-usd-per-hour {args.cpu_usd_per_hour:g}")
    return " ".join(parts)


def generate(args: argparse.Namespace) -> Path:
    """Load the records, render the document and write it atomically; returns its path."""
    folders = list(args.results) if args.results else find_result_folders(DEFAULT_RESULTS_ROOT)
    studies = [load_study(Path(f)) for f in folders]
    extra: list[dict] = []
    for path in args.records:
        require(path.is_file(), f"--records: no such file {path.as_posix()!r}")
        extra += read_records(path)
    out: Path = args.out
    text = render(
        studies,
        extra,
        args.epochs,
        _command(args),
        out.parent,
        [_display(p, p.name) for p in args.records],
        args.cpu_usd_per_hour,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Write the document; bad input exits 2 with one line naming the flag or file."""
    args = build_parser().parse_args(argv)
    try:
        out = generate(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(out.as_posix())
    return 0


if __name__ == "__main__":
    sys.exit(main())
