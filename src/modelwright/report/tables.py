"""The markdown tables of the report, built from the rows of :mod:`modelwright.study_rows`."""

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from modelwright import planner
from modelwright.fmt import DASH, duration, finite, pct, ratio, sig, table, usd
from modelwright.measure.flops import datasheet_peaks
from modelwright.planner.prices import DEFAULT_PRICES, GPU_NAMES, PRICE_SOURCE, MachinePrice, machine_price
from modelwright.record import get_path
from modelwright.study_rows import CONFIDENCE, LOSS_STEPS, UNPAIRED, BudgetRow, Row, div, provenance_group
from modelwright.techniques import setup_words

__all__ = ["anatomy_table", "attention_table", "budget_table", "main_table", "scaleout_table", "setup_text"]
#: airbench's "standard ResNet-18" baseline on one A100 (Keller Jordan, airbench README, 2024): 32.3 PFLOP in
#: 7 min. The scale-out table's GPU step is a record's FLOPs at that rate: an estimate, never a measurement.
PUBLISHED_A100_FLOPS_PER_S = 32.3e15 / (7 * 60)


def setup_text(record: Mapping) -> str:
    """The run's techniques in a few words: ``bf16-mixed, 32×4, ckpt block, AdamW foreach``."""
    return ", ".join(setup_words(record.get("techniques") or {}, get_path(record, "config.cpu_malloc")))


def comparable_loss(row: Row) -> float | None:
    """The row's training loss where it has seen as many samples as its reference row, else None."""
    reference_samples = row.reference.figures.loss_samples if row.reference else None
    samples = row.figures.loss_samples
    return row.figures.loss if samples is not None and samples == reference_samples else None


def interval_text(row: Row) -> str:
    """The paired interval on the row's step over its reference's, as a table cell."""
    if row is row.reference:
        return "reference"
    if row.reference is not None and not row.paired:
        return f"{DASH} ({UNPAIRED})"
    return f"{DASH} (1 repeat)" if row.interval is None else row.interval.text()


def repeat_spread(row: Row) -> str:
    figures = row.figures
    if row.band is None:
        return f"{DASH} (1 repeat)"
    return f"{sig(figures.step_lo)}–{sig(figures.step_hi)} ({figures.repeats})"


class RowCost(NamedTuple):
    """What a row's runs cost at the listed price of the devices they used: an estimate."""

    per_epoch: float | None  # the measured epoch's wall time
    per_1000_samples: float | None  # the steady-state step's samples/s
    price: MachinePrice


def devices_used(record: Mapping) -> int:
    return int(get_path(record, "techniques.world_size", 1) or 1)


def row_cost(row: Row) -> RowCost | None:
    """The row's cost per epoch and per 1,000 samples; None where its device has no price."""
    record = row.records[0]
    price = machine_price(record.get("hardware") or {}, devices_used(record))
    if price is None:
        return None
    samples_per_s = row.figures.samples_per_s
    per_1000 = price.usd_per_hour * 1000 / samples_per_s / 3600 if samples_per_s else None
    per_epoch = None
    if row.epoch is not None:
        epoch_price = machine_price(row.epoch.record.get("hardware") or {}, devices_used(row.epoch.record))
        per_epoch = epoch_price.usd_per_hour * row.epoch.time_s / 3600 if epoch_price else None
    return RowCost(per_epoch, per_1000, price)


def epoch_text(row: Row) -> str:
    return duration(row.epoch.time_s) if row.epoch else "not measured"


def cost_cells(row: Row) -> list[str]:
    cost = row_cost(row)
    if cost is None:
        return [DASH, DASH]
    if cost.per_epoch is not None:
        per_epoch = usd(cost.per_epoch)
    else:  # no epoch run, or one on a device without a price
        per_epoch = "not measured" if row.epoch is None else DASH
    return [per_epoch, usd(cost.per_1000_samples)]


def price_notes(rows: Sequence[Row]) -> list[str]:
    """One line per price the rows' costs use, and one for the devices without a price."""
    priced = {cost.price.source: cost.price for row in rows if row.ok and (cost := row_cost(row))}
    notes = [f"Cost (estimate): {price.what} at ${price.usd_per_hour:.4g}/h; {source}."
             for source, price in priced.items()]
    if any(row.ok and row_cost(row) is None for row in rows):
        known = ", ".join(GPU_NAMES)
        notes.append(f"Cost: – where the device has no listed price (GPUs priced: {known}).")
    return notes


def technique_summary(rows: Sequence[Row], budget: Sequence[BudgetRow]) -> str:
    """One line per run against its baseline: memory, step time (with the verdict), time per epoch, the
    largest batch under the budget and the cost per epoch, each as a ratio."""
    largest = {entry.name: entry.vs_reference for entry in budget if entry.fits}
    body = []
    for row in (row for row in rows if row.ok and row.reference is not None and row is not row.reference):
        cost = row_cost(row)
        reference_cost = row_cost(row.reference)
        epoch_ratio = None
        if row.epoch is not None and row.reference.epoch is not None:
            epoch_ratio = div(row.epoch.time_s, row.reference.epoch.time_s)
        cost_ratio = div(cost and cost.per_epoch, reference_cost and reference_cost.per_epoch)
        body.append([row.name, ratio(row.vs("peak_mib")), f"{ratio(row.vs('step_ms'))} ({row.verdict})",
                     interval_text(row), ratio(epoch_ratio), ratio(largest.get(row.name)), ratio(cost_ratio)])
    header = ["run, against the baseline", "peak memory", "step time", f"its {pct(CONFIDENCE)} interval",
              "time per epoch", "largest batch under the budget", "cost per epoch"]
    return table(header, body, "lrllrrr")


def main_table(rows: Sequence[Row], marks: Mapping[str, str] | None = None) -> str:
    body = []
    for row in (row for row in rows if row.ok):
        figures = row.figures
        # An ok run without a peak is a compiled one: the tracker saw eager code only.
        peak = "not measured" if figures.peak_mib is None else sig(figures.peak_mib)
        letters = sorted({(marks or {}).get(provenance_group(record)) for record in row.records} - {None})
        name = row.name + (f" [{','.join(letters)}]" if letters else "")
        body.append([name, setup_text(row.records[0]), peak, ratio(row.vs("peak_mib")), sig(figures.step_ms),
                     repeat_spread(row), ratio(row.vs("step_ms")), interval_text(row), row.verdict,
                     sig(figures.samples_per_s),
                     pct(figures.mfu), epoch_text(row), *cost_cells(row), sig(comparable_loss(row))])
    header = ["run", "setup", "peak MiB", "memory vs base", "step ms (median of repeats)",
              "repeat medians min–max (n)", "time vs base", f"{pct(CONFIDENCE)} interval, paired repeats",
              "verdict", "samples/s", "MFU", "time per epoch",
              "cost per epoch (est.)", "cost per 1,000 samples (est.)",
              f"train loss, last {LOSS_STEPS} steps"]
    return table(header, body, "llrrrrrllrrrrrr")


def epoch_table(rows: Sequence[Row]) -> str | None:
    """Each measured epoch's composition: optimizer steps, their time with data loading, the validations."""
    body = []
    for row in (row for row in rows if row.ok and row.epoch):
        epoch = row.epoch
        steps = DASH if epoch.steps is None else epoch.steps
        validations = DASH if epoch.validations is None else epoch.validations
        body.append([row.name, duration(epoch.time_s), steps, duration(epoch.training_step_s), validations,
                     duration(epoch.validation_s), pct(epoch.validation_share), epoch.record.get("run_id")])
    header = ["run", "time per epoch", "optimizer steps", "per step, data loading included", "validations",
              "validation time", "validation share", "epoch run"]
    return table(header, body, "lrrrrrrl") if body else None


def anatomy_table(rows: Sequence[Row]) -> str:
    ok = [row for row in rows if row.ok]
    keys = list(dict.fromkeys(key for row in ok for key in row.figures.anatomy))
    body = []
    for row in ok:
        left = row.figures.end_activations
        cells = [sig(row.figures.anatomy.get(key)) for key in keys]
        left_text = sig(left) + (" (artifact)" if left is not None and left > 1 else "")
        body.append([row.name, *cells, sig(row.figures.peak_mib), left_text])
    header = ["run", *(key.replace("_", " ") for key in keys), "peak", "activations left after the step"]
    return table(header, body)


def budget_outcome(row: BudgetRow) -> str:
    """Whether the run a few percent over the largest batch exceeded the budget, as a table cell."""
    if row.over_batch is None:
        return "not run"
    if row.over_mib is None:
        return f"unknown: batch {row.over_batch} recorded no peak"
    exceeds = "yes" if row.over_mib > row.budget_mib else "no"
    return f"{exceeds}: batch {row.over_batch}, {sig(row.over_mib)} MiB"


def budget_table(budget: Sequence[BudgetRow]) -> str:
    body = []
    for row in budget:
        if row.fits:
            under = "yes"
        else:
            under = "no" if row.measured_mib is not None else row.status
        body.append([row.name, DASH if row.batch is None else row.batch, sig(row.predicted_mib),
                     sig(row.measured_mib), under, row.attempts, ratio(row.vs_reference),
                     budget_outcome(row)])
    header = ["run", "largest batch", "predicted peak MiB", "confirmed peak MiB", "under budget",
              "confirming runs", "batch vs base", "a few % more exceeds it"]
    return table(header, body, "lrrrcrrl")


def attention_table(result: Mapping | None) -> str | None:
    """Per sequence length, each implementation's peak MiB and median step ms (``benchmarks/attention.py``'s
    ``results`` of ``{"impl", "seq", "status", "peak_mib", "median_ms"}``); None when there is no result."""
    results = [entry for entry in (result or {}).get("results") or [] if isinstance(entry, Mapping)]
    if not results:
        return None
    implementations = list(dict.fromkeys(entry.get("impl") for entry in results))
    lengths = sorted({entry.get("seq") for entry in results})
    cells = {(entry.get("impl"), entry.get("seq")): entry for entry in results}

    def cell(implementation: str, length: Any, key: str) -> str:
        found = cells.get((implementation, length), {"status": DASH})
        return sig(found.get(key)) if found.get("status") == "ok" else str(found.get("status"))

    body = [[length, *(cell(implementation, length, "peak_mib") for implementation in implementations),
             *(cell(implementation, length, "median_ms") for implementation in implementations)]
            for length in lengths]
    header = ["sequence length", *(f"{implementation} peak MiB" for implementation in implementations),
              *(f"{implementation} step ms" for implementation in implementations)]
    return table(header, body)


def scaleout_row(prediction: Any, one_device_samples_per_s: float) -> list[str]:
    efficiency = prediction.samples_per_s / (prediction.devices * one_device_samples_per_s)
    return [prediction.devices, f"{prediction.samples_per_step:,}", sig(prediction.comm_bytes / 2**20),
            f"{sig(prediction.comm_s * 1e3, 2)} ms (estimate)",
            f"{sig(prediction.comm_exposed_s * 1e3, 2)} ms (estimate)",
            f"{sig(prediction.step_s * 1e3, 2)} ms (estimate)", f"{pct(efficiency)} (estimate)"]


def scaleout_table(record: Mapping, devices: Sequence[int] = (1, 8, 512)) -> str | None:
    """Data parallelism of this record's job at ``devices`` A100s, by the planner, from an estimated A100 step
    (:data:`PUBLISHED_A100_FLOPS_PER_S`) and the A100's network; None where the record lacks its FLOPs or
    what the planner needs."""
    flops = finite(get_path(record, "flops.flops_per_step"))
    if not flops:
        return None
    try:
        measured = planner.spec_from_record(record)
    except KeyError as err:
        print(f"report: no scale-out table ({err})", file=sys.stderr)
        return None
    spec = dataclasses.replace(measured, step_time_ms=1e3 * flops / PUBLISHED_A100_FLOPS_PER_S)
    # The step's rate and the network are the same GPU's: airbench measured its rate on an A100.
    assumptions = planner.Assumptions(device="A100 80GB")
    predictions = [planner.predict_step(spec, "dp", gpus, assumptions) for gpus in devices]
    body = [scaleout_row(prediction, predictions[0].samples_per_s) for prediction in predictions]
    fabric = planner.scale.FABRICS[assumptions.device]
    knobs = (f"{assumptions.device}, {fabric.intra_node_gb_per_s:g} GB/s per GPU inside a node of "
             f"{assumptions.gpus_per_node} and {fabric.inter_node_gb_per_s:g} GB/s per GPU between nodes "
             f"({fabric.source}); {planner.scale.LATENCY_SOURCE}; gradients in 25 MiB buckets, the last one "
             f"exposed, the others hidden behind up to {assumptions.overlap_fraction:.0%} of backward "
             "(backward = 2/3 of the step); rings only: from NCCL 2.4 on, trees take over where a ring's "
             "2(N−1) latencies dominate, so at hundreds of GPUs the latency here is an upper bound")
    header = ["GPUs", "global batch", "gradient MiB sent per GPU per step", "communication per step",
              "of it exposed", "step time", "scaling efficiency"]
    return table(header, body) + f"\n\nPlanner assumptions: {knobs}."


#: The cost example's GPUs, and its full training: 30 epochs of 50,000 samples, CIFAR-10's training set (an
#: epoch count we state, not an accuracy we measured).
COST_GPUS = ("A100 80GB", "H100 SXM")
FULL_TRAINING_SAMPLES = 30 * 50_000


class GpuRate(NamedTuple):
    """What one GPU sustains on the job and what N of them lose to communication."""

    device: str
    peak_flops_per_s: float
    mfu: float
    efficiencies: dict[int, float]


def gpu_rate(record: Mapping, device: str, devices: Sequence[int]) -> GpuRate:
    """The GPU's bf16 datasheet peak at airbench's A100 MFU (:data:`PUBLISHED_A100_FLOPS_PER_S` over the
    A100's peak: an assumption on any other GPU), and the planner's data-parallel scaling efficiency at each
    device count for a step of that rate on that GPU's network."""
    mfu = PUBLISHED_A100_FLOPS_PER_S / datasheet_peaks("A100")["bfloat16"]
    peak = datasheet_peaks(device)["bfloat16"]
    flops = get_path(record, "flops.flops_per_step")
    spec = dataclasses.replace(planner.spec_from_record(record), step_time_ms=1e3 * flops / (peak * mfu))
    assumptions = planner.Assumptions(device=device)
    rates = {count: planner.predict_step(spec, "dp", count, assumptions).samples_per_s for count in devices}
    return GpuRate(device, peak, mfu, {count: rates[count] / (count * rates[1]) for count in devices})


def gpu_cost_cells(rate: GpuRate, gpus: int, flops_per_sample: float, samples: Sequence[int]) -> list[str]:
    """Time and cost of ``samples`` on ``gpus`` of ``rate``: FLOPs / (N × peak × MFU × efficiency), and that
    time × N × the listed price per GPU-hour (low end)."""
    price = DEFAULT_PRICES[rate.device][0]
    efficiency = rate.efficiencies[gpus]
    cells = [f"{gpus} × {rate.device}", f"${price:.2f}", pct(efficiency)]
    for count in samples:
        seconds = count * flops_per_sample / (gpus * rate.peak_flops_per_s * rate.mfu * efficiency)
        cells += [duration(seconds), usd(seconds / 3600 * gpus * price)]
    return cells


def cost_table(row: Row, devices: Sequence[int] = (1, 8, 512)) -> str | None:
    """The worked cost example: one measured epoch of the row's job and a full training, on this machine
    (measured) and on 1, 8 and 512 GPUs of two kinds (estimates); None without a measured epoch or FLOPs."""
    record = row.records[0]
    cost = row_cost(row)
    flops = row.figures.flops_per_step
    batch = get_path(record, "techniques.effective_batch_size")
    if row.epoch is None or not row.epoch.samples or cost is None or not flops or not batch:
        return None
    samples = (row.epoch.samples, FULL_TRAINING_SAMPLES)
    per_sample_s = row.epoch.time_s / row.epoch.samples
    price = cost.price.usd_per_hour
    machine = [f"{cost.price.what}, this machine (measured)", usd(price), DASH]
    for count in samples:
        machine += [duration(per_sample_s * count), usd(per_sample_s * count / 3600 * price)]
    body = [machine]
    for device in COST_GPUS:
        rate = gpu_rate(record, device, devices)
        body += [gpu_cost_cells(rate, gpus, flops / batch, samples) for gpus in devices]
    header = ["devices", "price per device-hour", "scaling efficiency",
              f"one epoch ({row.epoch.samples:,} samples): time", "cost",
              f"full training ({FULL_TRAINING_SAMPLES:,} samples): time", "cost"]
    rate = gpu_rate(record, COST_GPUS[0], (1,))
    notes = (f"GPU rows are estimates: {sig(flops / batch / 1e9)} GFLOP per sample (counted in the "
             f"`{row.name}` record) at {pct(rate.mfu)} of the GPU's bf16 datasheet peak (airbench's "
             "ResNet-18 on one A100; the same MFU assumed on the H100), the planner's data-parallel "
             f"efficiency, and the low end of each listing: {PRICE_SOURCE}. This machine's full training is "
             "its measured epoch's rate scaled to the samples.")
    return table(header, body, "lrrrrrr") + f"\n\n{notes}"
