"""Communication, step time and cost of DP, ZeRO-1/2/3 (FSDP), TP and PP at N devices, from one measured
device. A step is one optimizer step; communication is the bytes one rank sends, at NCCL's bus bandwidth (so a
ring's 2(N-1)/N is in the volume). DP and ZeRO scale weakly: per-device batch fixed, compute = the measured
step."""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from modelwright.fmt import count, duration, pct, sig, table, usd
from modelwright.planner.memory import (
    MIB,
    STATE_WORDS,
    STRATEGIES,
    normalize,
    param_state_bytes,
    state_bytes_per_rank,
)
from modelwright.planner.prices import DEFAULT_PRICES, HOW_TO_PRICE, PRICE_SOURCE
from modelwright.record import get_path

STRATEGY_LABELS = {"dp": "DP (DDP)", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "fsdp": "ZeRO-3 / FSDP",
                   "tp": "TP", "pp": "PP"}
_NDR = "one 400 Gb/s NDR InfiniBand port per GPU (DGX H100)"


class Fabric(NamedTuple):
    """Per-GPU link rates in GB/s, one direction: NVLink/NVSwitch inside a node, and between nodes each GPU's
    own InfiniBand port (a rail-optimised node has a NIC per GPU, so every rank's ring traffic has a port
    of its own)."""

    intra_node_gb_per_s: float
    inter_node_gb_per_s: float
    source: str


FABRICS = {
    "A100 80GB": Fabric(300.0, 25.0,
                        "NVIDIA A100 datasheet: NVLink 600 GB/s both ways; one 200 Gb/s HDR port per GPU"),
    "H100 SXM": Fabric(450.0, 50.0, f"NVIDIA H100 datasheet: NVLink 900 GB/s both ways; {_NDR}"),
    "H200": Fabric(450.0, 50.0, f"NVIDIA H200 datasheet: NVLink 900 GB/s both ways; {_NDR}"),
}
# DDP starts each bucket's all-reduce as soon as its gradients are ready, hiding it behind the rest of
# backward (Li et al., "PyTorch Distributed", VLDB 2020, §3.2.3); FSDP prefetches the next all-gather the
# same way.
OVERLAP_SOURCE = ("bucketed all-reduce overlapped with the rest of backward, the last bucket's not (Li et "
                  "al., VLDB 2020); backward = 2/3 of compute")
BACKWARD_SHARE = 2 / 3  # backward ≈ 2 × forward FLOPs (the 6·N·tokens rule: 2 forward, 4 backward)
#: α, the latency of one ring step. Between nodes: one small message end to end over InfiniBand (HDR on A100
#: clusters, NDR on H100), a few µs of NIC, PCIe and NCCL protocol, upper end; a switch hop adds only about
#: 0.1–0.2 µs of it. Inside a node: NVLink's 5–10 µs end to end for a small collective, upper end, over a ring
#: of 8's 2(8−1) steps. Both from factryze.ai's Scale Atlas ("Tree-Reduce Latency"), whose ring model this is:
#: T ≈ 2(P−1)·α + 2(P−1)/P·bytes/bandwidth.
INTER_NODE_STEP_LATENCY_S = 5e-6
INTRA_NODE_STEP_LATENCY_S = 10e-6 / (2 * (8 - 1))
LATENCY_SOURCE = ("α per ring step: 5 µs between nodes (a small InfiniBand message end to end, a few µs; a "
                  "switch hop adds only 0.1–0.2 µs), 0.71 µs inside one (NVLink 10 µs end to end over 14 "
                  "steps); factryze.ai Scale Atlas, Tree-Reduce Latency")
#: DDP's default gradient bucket, 25 MiB (``bucket_cap_mb``; Li et al., VLDB 2020): one ring collective each.
DDP_BUCKET_BYTES = 25 * MIB


@dataclass(frozen=True)
class Assumptions:
    """What is not measured; None takes the ``device``'s fabric, the low end of its price listing."""

    device: str = "H100 SXM"
    gpus_per_node: int = 8  # a larger group crosses InfiniBand
    intra_node_gb_per_s: float | None = None
    inter_node_gb_per_s: float | None = None
    overlap_fraction: float = 1.0  # the share of the backward pass communication can hide behind
    usd_per_device_hour: float | None = None
    device_memory_gib: float = 80.0
    pp_microbatches: int | None = None  # None: 4 × stages

    def bandwidth(self, devices: int) -> float:
        fabric = FABRICS[self.device]
        if devices <= self.gpus_per_node:
            return self.intra_node_gb_per_s or fabric.intra_node_gb_per_s
        return self.inter_node_gb_per_s or fabric.inter_node_gb_per_s

    def microbatches(self, stages: int) -> int:
        return self.pp_microbatches or 4 * stages

    def step_latency_s(self, devices: int) -> float:
        """α of one ring step: a ring that crosses nodes waits for its slowest, inter-node, hop."""
        return INTRA_NODE_STEP_LATENCY_S if devices <= self.gpus_per_node else INTER_NODE_STEP_LATENCY_S


@dataclass(frozen=True)
class JobSpec:
    """A training job as measured on one device; ``num_layers``/``min_width`` None: unknown, not planned."""

    num_params: int
    precision: str = "32-true"
    optimizer: str = "adamw"
    micro_batch_size: int = 1
    accumulate_grad_batches: int = 1
    activation_bytes_per_sample: float = 0.0
    temporaries_bytes: float = 0.0
    step_time_ms: float = 0.0
    step_time_source: str = ""
    num_layers: int | None = None  # blocks a pipeline can cut between
    min_width: int | None = None  # the narrowest layer's channels, the most TP can split it
    # The largest activation crossing a block boundary (PP and TP traffic).
    boundary_bytes_per_sample: float = 0.0
    model_name: str = ""
    # State bytes per parameter where measured (Adafactor's depend on shapes).
    optimizer_bytes: float | None = None

    def __post_init__(self) -> None:
        for key in ("precision", "optimizer"):
            object.__setattr__(self, key, normalize(key, getattr(self, key)))

    state = property(lambda self: param_state_bytes(self.precision, self.optimizer, self.optimizer_bytes))


#: The record keys a :class:`JobSpec` needs, in the order a missing one is reported.
SPEC_KEYS = ("techniques.micro_batch_size", "techniques.optimizer", "techniques.precision",
             "memory.model_parameters", "memory.anatomy_mib.activations", "timing.step_time_median_ms")


def model_shape(profile: Mapping | None) -> dict:
    """What TP and PP could split, from the saved-tensor profile the studies of schema 2 wrote beside their
    records (``profile.json``): blocks, the narrowest layer, the largest boundary. Newer records: the network
    itself (:func:`modelwright.measure.shape.network_shape`)."""
    if not profile:
        return {}
    blocks = profile["segments"].get("block", [])
    widths = [unit["width"] for unit in profile["units"] if unit.get("width")]
    boundary = max((block["input_bytes"] for block in blocks), default=0)
    return {"num_layers": len(blocks) or None, "min_width": min(widths, default=None),
            "boundary_bytes_per_sample": boundary / profile["batch_size"]}


def measured_optimizer_bytes(record: Mapping, optimizer: str) -> float | None:
    """An optimizer's state bytes per parameter as the record measured them, where the optimizer's state is
    not a fixed number of words per parameter (Adafactor)."""
    if optimizer in STATE_WORDS:
        return None
    measured = get_path(record, "memory.anatomy_mib.optimizer_state")
    params = (get_path(record, "techniques.trainable_parameters")
              or get_path(record, "memory.model_parameters"))
    if measured is None:
        raise KeyError(f"record is missing 'memory.anatomy_mib.optimizer_state' ({optimizer}'s state)")
    if not params:
        raise KeyError(f"record is missing 'memory.model_parameters' ({optimizer}'s state per parameter)")
    return measured * MIB / params


def spec_from_record(record: Mapping, shape: Mapping | None = None) -> JobSpec:
    """A :class:`JobSpec` from a single-device run record, its step time labelled as measured in that run;
    ``shape``: what TP and PP could split (:func:`~modelwright.measure.shape.network_shape`; default: the
    record's saved-tensor profile, if it has one)."""
    values = {key: get_path(record, key) for key in SPEC_KEYS}
    missing = [key for key, value in values.items() if value is None]
    if missing:  # a KeyError naming the first required key missing
        raise KeyError(f"record is missing {missing[0]!r}")
    optimizer = values["techniques.optimizer"]
    if optimizer == "sgd" and get_path(record, "config.model.momentum") in (0, 0.0):
        optimizer = "sgd-nomomentum"
    micro = int(values["techniques.micro_batch_size"])
    device_name = get_path(record, "hardware.device_name", "?")
    return JobSpec(
        num_params=int(values["memory.model_parameters"]),
        precision=str(values["techniques.precision"]),
        optimizer=str(optimizer),
        micro_batch_size=micro,
        accumulate_grad_batches=int(get_path(record, "techniques.accumulate_grad_batches", 1) or 1),
        activation_bytes_per_sample=float(values["memory.anatomy_mib.activations"]) * MIB / micro,
        temporaries_bytes=float(get_path(record, "memory.anatomy_mib.temporaries") or 0.0) * MIB,
        step_time_ms=float(values["timing.step_time_median_ms"]),
        step_time_source=f"measured, run {record.get('run_id', '?')} on {device_name}",
        model_name=str(get_path(record, "techniques.model_name", "") or ""),
        optimizer_bytes=measured_optimizer_bytes(record, str(optimizer)),
        **(dict(shape) if shape is not None else model_shape(record.get("profile"))),
    )


def pipeline_bubble_fraction(stages: int, microbatches: int, interleave: int = 1) -> float:
    """Idle time of a pipeline relative to its ideal compute: ``(p-1)/(v·m)``."""
    return (stages - 1) / (interleave * microbatches)


def cannot_split(spec: JobSpec, strategy: str, devices: int, assumptions: Assumptions) -> str | None:
    """Why ``strategy`` cannot split this model ``devices`` ways, or None when it can."""
    strategy = normalize("strategy", strategy)
    if strategy == "tp" and devices > 1:
        if spec.min_width is None:
            return "TP: the model's layer widths are unknown"
        if devices > assumptions.gpus_per_node:
            return f"TP: {devices} ranks cross nodes; TP's per-layer all-reduces stay inside a node"
        if spec.min_width % devices or spec.min_width // devices < 8:
            return f"TP: the narrowest layer has {spec.min_width} channels; {devices} ranks leave < 8 each"
    if strategy == "pp" and devices > 1 and (spec.num_layers is None or devices > spec.num_layers):
        return f"PP: {devices} stages but {spec.num_layers or 'unknown'} blocks to cut between"
    return None


def comm_bytes_per_step(spec: JobSpec, strategy: str, devices: int) -> float:
    """Bytes one rank sends per optimizer step (Ψ params, c grad bytes and w weight bytes on the wire, r
    micro-batches): DP ``2cΨ(N-1)/N`` (``no_sync`` while accumulating); ZeRO-1 ``(c+w)Ψ(N-1)/N``; ZeRO-2
    ``(rc+w)Ψ(N-1)/N``; ZeRO-3/FSDP ``r(2w+c)Ψ(N-1)/N`` with w = 2 under mixed precision (FSDP gathers
    16-bit weights, ``MixedPrecisionPolicy(param_dtype=bf16)``, gradients reduced in fp32); TP: the
    boundary activation ring all-reduced twice forward and twice backward per block; PP: each stage sends
    the step's boundary activations forward and their gradients back."""
    strategy = normalize("strategy", strategy)
    devices = int(devices)
    if devices == 1:
        return 0.0
    ring = (devices - 1) / devices
    micro_batches = spec.accumulate_grad_batches
    gradient_bytes = spec.state.grad_comm * spec.num_params
    weight_bytes = spec.state.weights * spec.num_params
    gathered_bytes = 2 * spec.num_params if spec.precision.endswith("-mixed") else weight_bytes
    boundary = spec.boundary_bytes_per_sample * spec.micro_batch_size
    if strategy == "dp":
        return 2 * ring * gradient_bytes
    if strategy == "zero1":
        return ring * (gradient_bytes + weight_bytes)
    if strategy == "zero2":
        return ring * (micro_batches * gradient_bytes + weight_bytes)
    if strategy == "fsdp":
        return micro_batches * ring * (2 * gathered_bytes + gradient_bytes)
    if strategy == "tp":
        return micro_batches * (spec.num_layers or 1) * 4 * 2 * ring * boundary
    return 2 * boundary * micro_batches  # pp: the whole step's samples, in micro-batches or not


def collective_units(spec: JobSpec, strategy: str) -> int:
    """How many collectives a step issues one after another, each paying the ring's latency: DDP's gradient
    buckets (ZeRO-1/2 reduce-scatter and gather them the same way); FSDP's per-block all-gather, all-gather
    and reduce-scatter per micro-batch; TP's four all-reduces per block per micro-batch."""
    blocks = spec.num_layers or 1
    micro_batches = spec.accumulate_grad_batches
    if strategy in ("dp", "zero1", "zero2"):
        gradient_bytes = spec.state.grad_comm * spec.num_params
        return max(1, math.ceil(gradient_bytes / DDP_BUCKET_BYTES))
    if strategy == "fsdp":
        return 3 * blocks * micro_batches
    return 4 * blocks * micro_batches  # tp


class CommTime(NamedTuple):
    """A step's communication: all of it (bytes at the bus bandwidth, plus each ring step's latency), and the
    part the step waits for."""

    total_s: float
    exposed_s: float


def communication_time(spec: JobSpec, strategy: str, devices: int, assumptions: Assumptions,
                       compute_s: float) -> CommTime:
    """The step's communication time and what of it backward cannot hide."""
    comm_bytes = comm_bytes_per_step(spec, strategy, devices)
    if devices == 1:
        return CommTime(0.0, 0.0)
    bandwidth_s = comm_bytes / (assumptions.bandwidth(devices) * 1e9)  # bus bandwidth in GB/s
    if strategy == "pp":  # point to point: one message each way per micro-batch, no ring
        latency_s = 2 * assumptions.microbatches(devices) * assumptions.step_latency_s(devices)
        return CommTime(bandwidth_s + latency_s, bandwidth_s + latency_s)
    units = collective_units(spec, strategy)
    # A ring collective over N ranks takes 2(N−1) steps, each paying the latency α beside its bytes.
    latency_s = units * 2 * (devices - 1) * assumptions.step_latency_s(devices)
    total_s = bandwidth_s + latency_s
    if strategy == "tp":  # each all-reduce sits between two layers: nothing to hide behind
        return CommTime(total_s, total_s)
    # The last bucket (block) is ready only when backward ends, so its collective cannot overlap; the others
    # hide behind the backward that remains, of the last micro-batch only (no_sync defers the rest).
    last_s = total_s / units
    backward_s = assumptions.overlap_fraction * BACKWARD_SHARE * compute_s / spec.accumulate_grad_batches
    return CommTime(total_s, last_s + max(0.0, total_s - last_s - backward_s))


@dataclass(frozen=True)
class StepPrediction:
    """One (strategy, devices) pair; times per optimizer step. ``bubble_of_compute`` is the pipeline's idle
    time over its ideal compute, ``(p-1)/m``; ``bubble_of_step`` the same idle time over the whole step,
    ``(p-1)/(m+p-1)``."""

    strategy: str
    devices: int
    memory_mib: dict[str, float]
    comm_bytes: float
    comm_s: float
    comm_exposed_s: float
    bubble_of_compute: float
    bubble_of_step: float
    step_s: float
    samples_per_step: int
    samples_per_s: float
    fits: bool
    unsplittable: str | None = None  # why this strategy cannot be built for the model, or None


def predict_memory_mib(spec: JobSpec, strategy: str, devices: int,
                       assumptions: Assumptions | None = None) -> dict[str, float]:
    """Per-rank memory (MiB): sharded model state + activations (split by TP/PP) + temporaries, and
    ``total``."""
    assumptions = assumptions or Assumptions()
    strategy = normalize("strategy", strategy)
    devices = int(devices)
    state = state_bytes_per_rank(spec.num_params, spec.state, strategy, devices)
    memory = {key: value / MIB for key, value in state.items()}
    activations = spec.activation_bytes_per_sample * spec.micro_batch_size
    if strategy == "tp":
        activations /= devices
    elif strategy == "pp":
        # The step's samples in m micro-batches; 1F1B keeps min(p, m) of them in flight on the first stage,
        # which holds 1/p of the model.
        microbatches = assumptions.microbatches(devices)
        per_microbatch = activations * spec.accumulate_grad_batches / microbatches
        activations = per_microbatch * min(devices, microbatches) / devices
    memory["activations"] = activations / MIB
    memory["temporaries"] = spec.temporaries_bytes / MIB
    return {**memory, "total": sum(memory.values())}


class Compute(NamedTuple):
    """One rank's compute per optimizer step and the samples that step trains."""

    seconds: float
    samples: int
    bubble_of_compute: float = 0.0


def compute_per_step(spec: JobSpec, strategy: str, devices: int, assumptions: Assumptions) -> Compute:
    """DP and ZeRO: the measured step on N × the batch (weak scaling). TP: the measured batch, 1/N of each
    layer per rank. PP: the measured batch in m micro-batches through N stages of 1/N of the model; each
    micro-batch takes its share of the measured step (step time assumed proportional to the batch), and
    the pipeline fills and drains in (p-1) micro-batch slots: ``t/N · (1 + (p-1)/m)``."""
    step_s = spec.step_time_ms / 1000
    per_rank = spec.micro_batch_size * spec.accumulate_grad_batches
    if strategy == "tp":
        return Compute(step_s / devices, per_rank)
    if strategy == "pp":
        bubble = pipeline_bubble_fraction(devices, assumptions.microbatches(devices))
        return Compute(step_s / devices * (1 + bubble), per_rank, bubble)
    return Compute(step_s, devices * per_rank)


def predict_step(spec: JobSpec, strategy: str, devices: int,
                 assumptions: Assumptions | None = None) -> StepPrediction:
    """Memory, communication, step time and throughput for ``strategy`` at ``devices`` ranks
    (:func:`compute_per_step`, :func:`communication_time`)."""
    assumptions = assumptions or Assumptions()
    strategy = normalize("strategy", strategy)
    devices = int(devices)
    compute = compute_per_step(spec, strategy, devices, assumptions)
    comm = communication_time(spec, strategy, devices, assumptions, compute.seconds)
    step_s = compute.seconds + comm.exposed_s
    memory = predict_memory_mib(spec, strategy, devices, assumptions)
    bubble = compute.bubble_of_compute
    return StepPrediction(
        strategy=strategy, devices=devices, memory_mib=memory,
        comm_bytes=comm_bytes_per_step(spec, strategy, devices), comm_s=comm.total_s,
        comm_exposed_s=comm.exposed_s, bubble_of_compute=bubble, bubble_of_step=bubble / (1 + bubble),
        step_s=step_s, samples_per_step=compute.samples,
        samples_per_s=compute.samples / step_s if step_s > 0 else math.inf,
        fits=memory["total"] <= assumptions.device_memory_gib * 1024,
        unsplittable=cannot_split(spec, strategy, devices, assumptions))


def max_params(spec: JobSpec, strategy: str, devices: int, assumptions: Assumptions) -> int:
    """The largest parameter count whose sharded state fits beside the measured activations and
    temporaries."""
    held = predict_memory_mib(spec, strategy, devices, assumptions)
    room = (assumptions.device_memory_gib * 1024 - held["activations"] - held["temporaries"]) * MIB
    return max(0, int(room // sum(state_bytes_per_rank(1, spec.state, strategy, devices).values())))


def price_text(assumptions: Assumptions) -> str:
    low, high = DEFAULT_PRICES[assumptions.device]
    if assumptions.usd_per_device_hour:
        return f"${assumptions.usd_per_device_hour:.2f}/device-hour given"
    return f"{assumptions.device} ${low:.2f}–{high:.2f}/h, low end; {PRICE_SOURCE}"


TIME_HEADER = ["strategy", "N", "comm/step (MiB)", "comm time, exposed", "bubble ÷ ideal compute, (p-1)/m",
               "bubble ÷ step, (p-1)/(m+p-1)", "step time", "samples/s", "train time", "cost"]


def time_row(prediction: StepPrediction, epochs: float, dataset_size: int,
             price_per_hour: float | None) -> list:
    """One row of the time table; ``price_per_hour`` None: not priced."""
    estimate = " (est.)"
    hours = epochs * dataset_size / prediction.samples_per_s / 3600
    pipelined = prediction.strategy == "pp"
    comm = f"{duration(prediction.comm_s)}, {duration(prediction.comm_exposed_s)} exposed{estimate}"
    cost = "–" if price_per_hour is None else usd(prediction.devices * hours * price_per_hour) + estimate
    return [STRATEGY_LABELS[prediction.strategy], prediction.devices, sig(prediction.comm_bytes / MIB), comm,
            pct(prediction.bubble_of_compute) if pipelined else "–",
            pct(prediction.bubble_of_step) if pipelined else "–",
            duration(prediction.step_s) + estimate, sig(prediction.samples_per_s) + estimate,
            duration(hours * 3600) + estimate, cost]


def scaling_rows(spec: JobSpec, devices: Sequence[int], assumptions: Assumptions, epochs: float,
                 dataset_size: int, priced: bool) -> tuple[list[list], list[list]]:
    """The memory table's and the time table's rows, one per strategy and device count."""
    price_per_hour = assumptions.usd_per_device_hour or DEFAULT_PRICES[assumptions.device][0]
    memory_rows, time_rows = [], []
    for strategy in STRATEGIES:
        for ranks in devices:
            prediction = predict_step(spec, strategy, ranks, assumptions)
            label = STRATEGY_LABELS[strategy]
            if prediction.unsplittable:
                memory_rows.append([label, ranks, prediction.unsplittable, *["–"] * 5])
                time_rows.append([label, ranks, prediction.unsplittable, *["–"] * (len(TIME_HEADER) - 3)])
                continue
            memory = [sig(prediction.memory_mib[key]) for key in
                      ("parameters", "gradients", "optimizer_state", "activations", "total")]
            memory_rows.append([label, ranks, *memory, "yes" if prediction.fits else "no"])
            time_rows.append(time_row(prediction, epochs, dataset_size, price_per_hour if priced else None))
    return memory_rows, time_rows


def markdown_tables(spec: JobSpec, devices: Sequence[int] = (1, 8, 64),
                    assumptions: Assumptions | None = None, epochs: float = 100, dataset_size: int = 50_000,
                    priced: bool = True) -> str:
    """The scaling tables: per-rank memory, communication, step time and cost, largest model that fits. A
    strategy that cannot split this model says why; ``priced=False`` leaves cost out (a CPU step is not priced
    at GPU rates)."""
    assumptions = assumptions or Assumptions()
    state = spec.state
    memory_rows, time_rows = scaling_rows(spec, devices, assumptions, epochs, dataset_size, priced)
    largest = [[STRATEGY_LABELS[strategy],
                *(count(max_params(spec, strategy, ranks, assumptions)) for ranks in devices)]
               for strategy in STRATEGIES[:4]]
    memory_header = ["strategy", "N", "parameters", "gradients", "optimizer", "activations", "total", "fits"]
    return "\n".join([
        f"- model: {spec.model_name or 'unnamed'}, {spec.num_params:,} parameters; {spec.precision} + "
        f"{spec.optimizer}: {state.weights:g} + {state.gradients:g} + {state.optimizer:g} = {state.total:g} "
        f"B/parameter ({state.regime})",
        f"- measured: per-rank batch {spec.micro_batch_size} × {spec.accumulate_grad_batches}; activations "
        f"{sig(spec.activation_bytes_per_sample / MIB)} MiB/sample; step {sig(spec.step_time_ms)} ms "
        f"({spec.step_time_source or 'assumed'})",
        f"- assumed: network: {FABRICS[assumptions.device].source}; {assumptions.gpus_per_node} per node",
        f"- assumed: latency: {LATENCY_SOURCE}",
        f"- assumed: overlap: {assumptions.overlap_fraction:.0%} of backward; {OVERLAP_SOURCE}",
        f"- assumed: price: {price_text(assumptions)}",
        *([] if priced else [f"- cost: {HOW_TO_PRICE}"]),
        "- estimates: every time, throughput and cost below is an estimate from the figures above",
        "", "### Per-device memory (MiB)", "",
        table(memory_header, memory_rows),
        "", f"### Communication, time and cost ({epochs:g} epochs of {dataset_size:,} samples)", "",
        table(TIME_HEADER, time_rows),
        "", f"### Largest parameter count that fits {assumptions.device_memory_gib:g} GiB per device", "",
        table(["strategy", *(f"N = {ranks}" for ranks in devices)], largest), ""])
