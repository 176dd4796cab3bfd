"""The end-of-run summary of one record: lines for the terminal, and the same in TensorBoard with the memory
anatomy as a table and a figure. Both loops print it (the Lightning callback and the Accelerate loop)."""

from collections.abc import Mapping
from typing import Any

from modelwright.fmt import duration, pct, sig
from modelwright.record import ANATOMY_CATEGORIES
from modelwright.techniques import setup_words

#: Below this share of their threads' time, a CPU run's measured steps waited for their cores (the machine was
#: busy with something else): the times are flagged as contended. A free 2-core machine gives 0.95-1.0.
CONTENDED_BELOW = 0.8
#: TensorBoard's time-series dashboard with its smoothing at 0 (its default 0.6 hides where curves end),
#: showing the run's own scalars (Lightning's epoch and learning-rate cards would come first, the rest
#: collapsed).
TENSORBOARD_URL = "http://localhost:6006/?smoothing=0&tagFilter=train|val|perf|mem#timeseries"


def anatomy_rows(record: Mapping) -> list[tuple[str, float]]:
    """The categories of the captured step's peak, largest first, without the data (``inputs``: not in the
    peak) and without empty ones."""
    anatomy = (record.get("memory") or {}).get("anatomy_mib") or {}
    rows = [(name, value) for name, value in anatomy.items()
            if name in ANATOMY_CATEGORIES and name != "inputs" and value]
    return sorted(rows, key=lambda row: -row[1])


def summary_lines(record: Mapping, record_path: str | None, log_dir: str | None) -> list[str]:
    """The summary: a status line, then one indented line per aspect of the run."""
    techniques = record.get("techniques") or {}
    timing = record.get("timing") or {}
    lines = [
        f"technique   {', '.join(setup_words(techniques, spelled=True))}",
        f"step time   median {sig(timing.get('step_time_median_ms'))} ms, "
        f"p90 {sig(timing.get('step_time_p90_ms'))}, min {sig(timing.get('step_time_min_ms'))}, "
        f"max {sig(timing.get('step_time_max_ms'))} "
        f"({timing.get('measured_steps')} steps after {timing.get('warmup_steps')} warm-up)",
    ]
    if timing.get("epoch_time_s") is not None:
        lines.append(_epoch_line(timing))
    lines.append(f"throughput  {sig(timing.get('samples_per_s'))} samples/s")
    lines.append(_memory_line(record))
    lines.append(_mfu_line(record.get("flops") or {}))
    contended = contention(record)
    if contended:
        lines.append(f"warning     {contended}")
    lines.append(f"record      {record_path or 'not written (fast_dev_run)'}")
    if log_dir:
        lines.append(f"tensorboard uv run tensorboard --logdir {log_dir}   then open {TENSORBOARD_URL}")
    error = f" ({record['error']})" if record.get("error") else ""
    return [f"Run {record.get('run_id')}: {record.get('status')}{error}", *("  " + line for line in lines)]


def _epoch_line(timing: Mapping) -> str:
    validations = timing.get("epoch_validations") or 0
    share = pct((timing.get("epoch_validation_s") or 0) / timing["epoch_time_s"])
    return (f"epoch       {duration(timing['epoch_time_s'])} ({timing.get('epoch_steps')} steps and "
            f"{validations} validation{'s' if validations != 1 else ''}, {share} of it validating)")


def _memory_line(record: Mapping) -> str:
    memory = record.get("memory") or {}
    top = ", ".join(f"{name.replace('_', ' ')} {sig(value)}" for name, value in anatomy_rows(record)[:3])
    line = f"memory      peak {sig(memory.get('peak_allocated_mib'))} MiB ({memory.get('peak_source')})"
    if top:
        line += f": {top}"
    inputs = (memory.get("anatomy_mib") or {}).get("inputs")
    if inputs:
        line += f"; the data, {sig(inputs)} MiB, is not in the peak"
    return line


def _mfu_line(flops: Mapping) -> str:
    source = flops.get("peak_flops_source")
    if not source:
        return "MFU         – (no peak FLOP/s)"
    peak_tflops = (flops.get("peak_flops_per_s") or 0) / 1e12
    return (f"MFU         {pct(flops.get('mfu'))} of {sig(peak_tflops)} TFLOP/s "
            f"({source}: {flops.get('peak_flops_method')})")


def contention(record: Mapping) -> str | None:
    """Why a CPU run's step times are not what a free machine gives, or None: its measured steps had less than
    :data:`CONTENDED_BELOW` of their threads' CPU time."""
    utilization = (record.get("timing") or {}).get("step_cpu_utilization")
    on_cpu = (record.get("hardware") or {}).get("accelerator") == "cpu"
    if not on_cpu or utilization is None or utilization >= CONTENDED_BELOW:
        return None
    return (f"the measured steps got {pct(utilization)} of their threads' CPU time: the cores were shared, "
            "so the step times are slower than this machine gives when free")


def write_tensorboard(writer: Any, record: Mapping, lines: list[str], step: int) -> None:
    """The summary, the anatomy as a table and as one stacked bar (the data drawn apart, beside it) and the
    single figures (FLOPs, peak FLOP/s, medians) as text, into a ``SummaryWriter`` at ``step``."""
    writer.add_text("run/summary", "\n".join(f"    {line}" for line in lines), step)
    writer.add_text("run/figures", _figures_table(record), step)
    rows = anatomy_rows(record)
    if rows:
        inputs = ((record.get("memory") or {}).get("anatomy_mib") or {}).get("inputs")
        body = "".join(f"| {name} | {value:.1f} |\n" for name, value in rows)
        table = "| category | MiB |\n|:--|--:|\n" + body
        if inputs:
            table += f"| (the data: inputs, not in the peak) | {inputs:.1f} |\n"
        writer.add_text("mem/anatomy", table, step)
        writer.add_figure("mem/anatomy", anatomy_figure(record), step)
    writer.flush()


def _figures_table(record: Mapping) -> str:
    """The run's one-value figures, which would be single dots as scalars."""
    timing = record.get("timing") or {}
    flops = record.get("flops") or {}
    memory = record.get("memory") or {}
    figures = [
        ("step time, median (ms)", sig(timing.get("step_time_median_ms"))),
        ("step time, p90 (ms)", sig(timing.get("step_time_p90_ms"))),
        ("samples/s (median step)", sig(timing.get("samples_per_s"))),
        ("time per epoch (s)", sig(timing.get("epoch_time_s"))),
        ("MFU (median step)", pct(flops.get("mfu"))),
        ("FLOPs per optimizer step", sig(flops.get("flops_per_step"))),
        ("peak FLOP/s of the device", sig(flops.get("peak_flops_per_s"))),
        ("peak memory (MiB)", sig(memory.get("peak_allocated_mib"))),
    ]
    return "| figure | value |\n|:--|--:|\n" + "".join(f"| {name} | {value} |\n" for name, value in figures)


def anatomy_figure(record: Mapping) -> Any:
    """One horizontal bar: the peak's categories stacked, largest first, with a legend below that shows. Small
    in inches, so that its text stays readable when TensorBoard scales it to a card (about 336 × 210 px)."""
    from itertools import accumulate

    from matplotlib.figure import Figure  # no pyplot: no GUI backend, nothing global changed

    rows = anatomy_rows(record)
    memory = record.get("memory") or {}
    figure = Figure(figsize=(4.2, 2.6), layout="constrained")
    axes = figure.add_subplot()
    starts = accumulate((value for _, value in rows), initial=0.0)
    for (name, value), left in zip(rows, starts, strict=False):
        axes.barh(0, value, left=left, label=f"{name.replace('_', ' ')} {value:.1f}")
    title = (f"tensor memory at the peak of step {memory.get('anatomy_step')}: "
             f"{sig(memory.get('peak_allocated_mib'))} MiB")
    axes.set(yticks=[], xlabel="MiB")
    axes.set_title(title, fontsize=10)
    figure.legend(loc="outside lower center", ncols=2, fontsize=10, frameon=False)
    return figure
