"""What a finished run tells its user, from its record: a few lines on the terminal, and in TensorBoard a
custom-scalars layout (perf/, mem/, train/val), the summary as text and the memory anatomy as one figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger

from modelwright.record import ANATOMY_CATEGORIES

LAYOUT = {
    "perf": {
        "step time (ms)": ["Multiline", ["perf/step_time_ms", "perf/step_time_(median|p90)_ms"]],
        "throughput (samples/s)": ["Multiline", ["perf/samples_per_s"]],
        "MFU": ["Multiline", ["perf/mfu"]],
    },
    "mem": {"peak (MiB)": ["Multiline", ["mem/peak_(allocated|reserved)_mib", "mem/process_rss_peak_mib"]]},
    "train / val": {"loss": ["Multiline", ["(train|val)/loss"]], "accuracy": ["Multiline", ["(train|val)/acc"]]},
}


def tensorboards(loggers: list) -> list:
    """The ``SummaryWriter`` of each TensorBoard logger."""
    return [lg.experiment for lg in loggers if isinstance(lg, TensorBoardLogger)]


def anatomy_rows(memory: dict[str, Any], top: int | None = None) -> list[tuple[str, float]]:
    """The anatomy's categories with memory, largest first."""
    anatomy = memory.get("anatomy_mib") or {}
    rows = sorted(((k, v) for k, v in anatomy.items() if k in ANATOMY_CATEGORIES and v), key=lambda kv: -kv[1])
    return rows[:top]


def summary_lines(record: dict[str, Any], record_path: str | None, log_dir: str | None) -> list[str]:
    """The end-of-run summary: techniques, step time and spread, throughput, memory, MFU, where things went."""
    from modelwright.report.fmt import pct, sig

    tech, timing, flops, memory = (record.get(k) or {} for k in ("techniques", "timing", "flops", "memory"))
    top = ", ".join(f"{k} {sig(v)}" for k, v in anatomy_rows(memory, 3))
    peak_source = flops.get("peak_flops_source")
    lines = [
        f"technique   {tech.get('precision')}, micro-batch {tech.get('micro_batch_size')} x accumulate "
        f"{tech.get('accumulate_grad_batches')}, checkpointing {tech.get('gradient_checkpointing')}, "
        f"{tech.get('strategy')} x {tech.get('world_size')}",
        f"step time   median {sig(timing.get('step_time_median_ms'))} ms, p90 {sig(timing.get('step_time_p90_ms'))}, "
        f"min {sig(timing.get('step_time_min_ms'))}, max {sig(timing.get('step_time_max_ms'))} "
        f"({timing.get('measured_steps')} steps after {timing.get('warmup_steps')} warm-up)",
        f"throughput  {sig(timing.get('samples_per_s'))} samples/s",
        f"memory      peak {sig(memory.get('peak_allocated_mib'))} MiB ({memory.get('peak_source')})"
        + (f": {top}" if top else ""),
        f"MFU         {pct(flops.get('mfu'))} of {sig((flops.get('peak_flops_per_s') or 0) / 1e12)} TFLOP/s "
        f"({peak_source}: {flops.get('peak_flops_method')})" if peak_source else "MFU         – (no peak FLOP/s)",
        f"record      {record_path or 'not written (fast_dev_run)'}",
    ]
    if log_dir:
        lines.append(f"tensorboard uv run tensorboard --logdir {log_dir}")
    status = record.get("status")
    head = f"Run {record.get('run_id')}: {status}" + (f" ({record.get('error')})" if record.get("error") else "")
    return [head, *("  " + line for line in lines)]


def anatomy_figure(memory: dict[str, Any]):
    """One stacked bar: where the tensor memory of the captured step went, at its peak."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 1.8), layout="constrained")
    ax = fig.add_subplot()
    left = 0.0
    for name, mib in anatomy_rows(memory):
        ax.barh(0, mib, left=left, label=f"{name} {mib:.1f}")
        left += mib
    ax.set(yticks=[], xlabel="MiB", title=f"memory at the peak of step {memory.get('anatomy_step')}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.6), ncol=4, fontsize="small", frameon=False)
    return fig


def write_tensorboard(writers: list, record: dict[str, Any], lines: list[str], step: int) -> None:
    """The summary as text and the anatomy as a table and a stacked-bar figure, in every TensorBoard run."""
    memory = record.get("memory") or {}
    rows = anatomy_rows(memory)
    table = "| category | MiB |\n|:--|--:|\n" + "".join(f"| {k} | {v:.1f} |\n" for k, v in rows)
    for writer in writers:
        writer.add_text("run/summary", "\n".join(f"    {line}" for line in lines), step)
        if rows:
            writer.add_text("mem/anatomy", table, step)
            writer.add_figure("mem/anatomy", anatomy_figure(memory), step)
        writer.flush()


def relative(path: str | Path | None) -> str | None:
    """``path`` relative to the working directory where it lies inside it (shorter to read and to copy)."""
    if path is None:
        return None
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)
