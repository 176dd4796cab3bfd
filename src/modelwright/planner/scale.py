"""Communication, step time and cost of DP, ZeRO-1/2/3 (FSDP), TP and PP at N devices, from one measured
device. A step is one optimizer step; communication is the bytes one rank sends, at NCCL's bus bandwidth (so a
ring's 2(N-1)/N is in the volume). DP and ZeRO scale weakly: per-device batch fixed, compute = the measured
step."""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from modelwright.fmt import count, duration, sig, table, usd
from modelwright.planner.memory import MIB, STRATEGIES, normalize, param_state_bytes, state_bytes_per_rank
from modelwright.planner.prices import DEFAULT_PRICES, HOW_TO_PRICE, PRICE_SOURCE
from modelwright.record import get_path

STRATEGY_LABELS = {"dp": "DP (DDP)", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "fsdp": "ZeRO-3 / FSDP",
                   "tp": "TP", "pp": "PP"}
_NDR = "one 400 Gb/s NDR InfiniBand port per GPU (DGX H100)"
#: Per-GPU link rates in GB/s, one direction: NVLink/NVSwitch inside a node, InfiniBand between nodes.
class Fabric(NamedTuple):
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
OVERLAP_SOURCE = ("bucketed all-reduce overlapped with backward (Li et al., VLDB 2020); backward = 2/3 of "
                  "compute")
BACKWARD_SHARE = 2 / 3  # backward ≈ 2 × forward FLOPs (the 6·N·tokens rule: 2 forward, 4 backward)


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

    def __post_init__(self) -> None:
        for key in ("precision", "optimizer"):
            object.__setattr__(self, key, normalize(key, getattr(self, key)))

    state = property(lambda self: param_state_bytes(self.precision, self.optimizer))


#: The record keys a :class:`JobSpec` needs, in the order a missing one is reported.
SPEC_KEYS = ("techniques.micro_batch_size", "techniques.optimizer", "techniques.precision",
             "memory.model_parameters", "memory.anatomy_mib.activations", "timing.step_time_median_ms")


def model_shape(profile: Mapping | None) -> dict:
    """What TP and PP could split, from a record's profile: blocks, the narrowest layer, the largest
    boundary."""
    if not profile:
        return {}
    blocks = profile["segments"].get("block", [])
    widths = [unit["width"] for unit in profile["units"] if unit.get("width")]
    boundary = max((block["input_bytes"] for block in blocks), default=0)
    return {"num_layers": len(blocks) or None, "min_width": min(widths, default=None),
            "boundary_bytes_per_sample": boundary / profile["batch_size"]}


def spec_from_record(record: Mapping) -> JobSpec:
    """A :class:`JobSpec` from a single-device run record, its step time labelled as measured in that run."""
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
        **model_shape(record.get("profile")),
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


def comm_bytes_per_step(spec: JobSpec, strategy: str, devices: int,
                        assumptions: Assumptions | None = None) -> float:
    """Bytes one rank sends per optimizer step (Ψ params, c grad bytes and w weight bytes on the wire, r
    micro-batches): DP ``2cΨ(N-1)/N`` (``no_sync`` while accumulating); ZeRO-1 ``(c+w)Ψ(N-1)/N``; ZeRO-2
    ``(rc+w)Ψ(N-1)/N``; ZeRO-3/FSDP ``r(2w+c)Ψ(N-1)/N`` with w = 2 under mixed precision (FSDP gathers
    16-bit weights, ``MixedPrecisionPolicy(param_dtype=bf16)``, gradients reduced in fp32); TP: the
    boundary activation ring all-reduced twice forward and twice backward per block; PP: one boundary
    activation and its gradient per micro-batch."""
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
    return (assumptions or Assumptions()).microbatches(devices) * 2 * boundary  # pp


@dataclass(frozen=True)
class StepPrediction:
    """One (strategy, devices) pair; times per optimizer step."""

    strategy: str
    devices: int
    memory_mib: dict[str, float]
    comm_bytes: float
    comm_s: float
    bubble_share: float
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
    elif strategy == "pp":  # 1F1B: min(p, m) micro-batches in flight, 1/p of the model
        activations *= min(devices, assumptions.microbatches(devices)) / devices
    memory["activations"] = activations / MIB
    memory["temporaries"] = spec.temporaries_bytes / MIB
    return {**memory, "total": sum(memory.values())}


def predict_step(spec: JobSpec, strategy: str, devices: int,
                 assumptions: Assumptions | None = None) -> StepPrediction:
    """Memory, communication, step time and throughput for ``strategy`` at ``devices`` ranks. Compute: DP/ZeRO
    the measured step on N × the batch; TP the step / N; PP m micro-batches through N stages,
    ``m·t_micro/N·(1+bubble)``."""
    assumptions = assumptions or Assumptions()
    strategy = normalize("strategy", strategy)
    devices = int(devices)
    comm = comm_bytes_per_step(spec, strategy, devices, assumptions)
    comm_s = comm / (assumptions.bandwidth(devices) * 1e9)  # bus bandwidth in GB/s
    per_rank = spec.micro_batch_size * spec.accumulate_grad_batches
    compute = spec.step_time_ms / 1000
    bubble = 0.0
    samples = devices * per_rank
    if strategy == "tp":
        compute = compute / devices
        samples = per_rank
    elif strategy == "pp":
        microbatches = assumptions.microbatches(devices)
        bubble = pipeline_bubble_fraction(devices, microbatches)
        compute = microbatches * compute / spec.accumulate_grad_batches / devices * (1 + bubble)
        samples = microbatches * spec.micro_batch_size
    hidden = assumptions.overlap_fraction * BACKWARD_SHARE * compute if strategy not in ("tp", "pp") else 0.0
    step = compute + max(0.0, comm_s - hidden)
    memory = predict_memory_mib(spec, strategy, devices, assumptions)
    fits = memory["total"] <= assumptions.device_memory_gib * 1024
    return StepPrediction(strategy, devices, memory, comm, comm_s, bubble / (1 + bubble), step, samples,
                          samples / step if step > 0 else math.inf, fits,
                          cannot_split(spec, strategy, devices, assumptions))


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


def scaling_rows(spec: JobSpec, devices: Sequence[int], assumptions: Assumptions, epochs: float,
                 dataset_size: int, priced: bool) -> tuple[list[list], list[list]]:
    """The memory table's and the time table's rows, one per strategy and device count."""
    estimate = " (est.)"
    price_per_hour = assumptions.usd_per_device_hour or DEFAULT_PRICES[assumptions.device][0]
    memory_rows, time_rows = [], []
    for strategy in STRATEGIES:
        for ranks in devices:
            prediction = predict_step(spec, strategy, ranks, assumptions)
            label = STRATEGY_LABELS[strategy]
            if prediction.unsplittable:
                memory_rows.append([label, ranks, prediction.unsplittable, *["–"] * 5])
                time_rows.append([label, ranks, prediction.unsplittable, *["–"] * 6])
                continue
            hours = epochs * dataset_size / prediction.samples_per_s / 3600
            memory = [sig(prediction.memory_mib[key]) for key in
                      ("parameters", "gradients", "optimizer_state", "activations", "total")]
            memory_rows.append([label, ranks, *memory, "yes" if prediction.fits else "no"])
            bubble = f"{sig(100 * prediction.bubble_share, 2)}%" if strategy == "pp" else "–"
            cost = usd(ranks * hours * price_per_hour) + estimate if priced else "–"
            time_rows.append([label, ranks, sig(prediction.comm_bytes / MIB),
                              duration(prediction.comm_s) + estimate, bubble,
                              duration(prediction.step_s) + estimate,
                              sig(prediction.samples_per_s) + estimate,
                              duration(hours * 3600) + estimate, cost])
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
    time_header = ["strategy", "N", "comm/step (MiB)", "comm time", "bubble (share of step)", "step time",
                   "samples/s", "train time", "cost"]
    return "\n".join([
        f"- model: {spec.model_name or 'unnamed'}, {spec.num_params:,} parameters; {spec.precision} + "
        f"{spec.optimizer}: {state.weights:g} + {state.gradients:g} + {state.optimizer:g} = {state.total:g} "
        f"B/parameter ({state.regime})",
        f"- measured: per-rank batch {spec.micro_batch_size} × {spec.accumulate_grad_batches}; activations "
        f"{sig(spec.activation_bytes_per_sample / MIB)} MiB/sample; step {sig(spec.step_time_ms)} ms "
        f"({spec.step_time_source or 'assumed'})",
        f"- assumed: network: {FABRICS[assumptions.device].source}; {assumptions.gpus_per_node} per node",
        f"- assumed: overlap: {assumptions.overlap_fraction:.0%} of backward; {OVERLAP_SOURCE}",
        f"- assumed: price: {price_text(assumptions)}",
        *([] if priced else [f"- cost: {HOW_TO_PRICE}"]),
        "- estimates: every time, throughput and cost below is an estimate from the figures above",
        "", "### Per-device memory (MiB)", "",
        table(memory_header, memory_rows),
        "", f"### Communication, time and cost ({epochs:g} epochs of {dataset_size:,} samples)", "",
        table(time_header, time_rows),
        "", f"### Largest parameter count that fits {assumptions.device_memory_gib:g} GiB per device", "",
        table(["strategy", *(f"N = {ranks}" for ranks in devices)], largest), ""])
