"""Communication, step time and cost of DP, ZeRO-1/2/3 (FSDP), TP and PP at N devices, from one measured device. A
step is one optimizer step; communication is the bytes one rank sends, at NCCL's bus bandwidth (so a ring's 2(N-1)/N
is in the volume). DP and ZeRO scale weakly: per-device batch fixed, compute = the measured step."""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from modelwright.planner.memory import MIB, STRATEGIES, normalize, param_state_bytes, state_bytes_per_rank
from modelwright.record import get_path
from modelwright.report.fmt import count, duration, sig, table, usd

STRATEGY_LABELS = {"dp": "DP (DDP)", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "fsdp": "ZeRO-3 / FSDP", "tp": "TP",
                   "pp": "PP"}
#: USD per device-hour (low, high) in the dated source: prices move.
DEFAULT_PRICES = {"A100 80GB": (1.10, 3.00), "H100 SXM": (2.50, 5.00), "H200": (3.50, 7.00)}
PRICE_SOURCE = "third-party GPU cloud listings (2026-05)"
_NDR = "one 400 Gb/s NDR InfiniBand port per GPU (DGX H100)"
#: Per-GPU link rates in GB/s, one direction: (NVLink/NVSwitch inside a node, InfiniBand between nodes, source).
FABRICS = {
    "A100 80GB": (300.0, 25.0, "NVIDIA A100 datasheet: NVLink 600 GB/s both ways; one 200 Gb/s HDR port per GPU"),
    "H100 SXM": (450.0, 50.0, f"NVIDIA H100 datasheet: NVLink 900 GB/s both ways; {_NDR}"),
    "H200": (450.0, 50.0, f"NVIDIA H200 datasheet: NVLink 900 GB/s both ways; {_NDR}"),
}
# DDP starts each bucket's all-reduce as soon as its gradients are ready, hiding it behind the rest of backward
# (Li et al., "PyTorch Distributed", VLDB 2020, §3.2.3); FSDP prefetches the next all-gather the same way.
OVERLAP_SOURCE = "bucketed all-reduce overlapped with backward (Li et al., VLDB 2020); backward = 2/3 of compute"
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
        nvlink, ib, _ = FABRICS[self.device]
        return (self.intra_node_gb_per_s or nvlink) if devices <= self.gpus_per_node else self.inter_node_gb_per_s or ib

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
    boundary_bytes_per_sample: float = 0.0  # the largest activation crossing a block boundary (PP and TP traffic)
    model_name: str = ""

    def __post_init__(self) -> None:
        for key in ("precision", "optimizer"):
            object.__setattr__(self, key, normalize(key, getattr(self, key)))

    state = property(lambda self: param_state_bytes(self.precision, self.optimizer))


def spec_from_record(record: Mapping) -> JobSpec:
    """A :class:`JobSpec` from a single-device run record, its step time labelled as measured in that run."""
    need = ("techniques.micro_batch_size", "techniques.optimizer", "techniques.precision", "memory.model_parameters",
            "memory.anatomy_mib.activations", "timing.step_time_median_ms")
    micro, optimizer, precision, params, activations, step_ms = values = [get_path(record, k) for k in need]
    if None in values:  # a KeyError naming the first required key missing
        raise KeyError(f"record is missing {need[values.index(None)]!r}")
    if optimizer == "sgd" and get_path(record, "config.model.momentum") in (0, 0.0):
        optimizer = "sgd-nomomentum"
    prof, shape = record.get("profile"), {}
    if prof:  # what TP and PP could split
        blocks, widths = prof["segments"].get("block", []), [u["width"] for u in prof["units"] if u.get("width")]
        shape = {"num_layers": len(blocks) or None, "min_width": min(widths, default=None),
                 "boundary_bytes_per_sample": max((b["input_bytes"] for b in blocks), default=0) / prof["batch_size"]}
    return JobSpec(
        num_params=int(params), precision=str(precision), optimizer=str(optimizer), micro_batch_size=int(micro),
        accumulate_grad_batches=int(get_path(record, "techniques.accumulate_grad_batches", 1) or 1),
        activation_bytes_per_sample=float(activations) * MIB / int(micro), step_time_ms=float(step_ms), **shape,
        temporaries_bytes=float(get_path(record, "memory.anatomy_mib.temporaries") or 0.0) * MIB,
        model_name=str(get_path(record, "techniques.model_name", "") or ""), step_time_source=f"measured, run "
        f"{record.get('run_id', '?')} on {get_path(record, 'hardware.device_name', '?')}")


def pipeline_bubble_fraction(stages: int, microbatches: int, interleave: int = 1) -> float:
    """Idle time of a pipeline relative to its ideal compute: ``(p-1)/(v·m)``."""
    return (stages - 1) / (interleave * microbatches)


def cannot_split(spec: JobSpec, strategy: str, devices: int, a: Assumptions) -> str | None:
    """Why ``strategy`` cannot split this model ``devices`` ways, or None when it can."""
    s = normalize("strategy", strategy)
    if s == "tp" and devices > 1:
        if spec.min_width is None:
            return "TP: the model's layer widths are unknown"
        if devices > a.gpus_per_node:
            return f"TP: {devices} ranks cross nodes; TP's per-layer all-reduces stay inside a node"
        if spec.min_width % devices or spec.min_width // devices < 8:
            return f"TP: the narrowest layer has {spec.min_width} channels; {devices} ranks leave < 8 each"
    if s == "pp" and devices > 1 and (spec.num_layers is None or devices > spec.num_layers):
        return f"PP: {devices} stages but {spec.num_layers or 'unknown'} blocks to cut between"
    return None


def comm_bytes_per_step(spec: JobSpec, strategy: str, devices: int, assumptions: Assumptions | None = None) -> float:
    """Bytes one rank sends per optimizer step (Ψ params, c grad bytes and w weight bytes on the wire, r micro-batches):
    DP ``2cΨ(N-1)/N`` (``no_sync`` while accumulating); ZeRO-1 ``(c+w)Ψ(N-1)/N``; ZeRO-2 ``(rc+w)Ψ(N-1)/N``;
    ZeRO-3/FSDP ``r(2w+c)Ψ(N-1)/N`` with w = 2 under mixed precision (FSDP gathers 16-bit weights,
    ``MixedPrecisionPolicy(param_dtype=bf16)``, gradients reduced in fp32); TP: the boundary activation ring
    all-reduced twice forward and twice backward per block; PP: one boundary activation and its gradient per
    micro-batch."""
    s, n = normalize("strategy", strategy), int(devices)
    if n == 1:
        return 0.0
    st, psi, r, ring = spec.state, spec.num_params, spec.accumulate_grad_batches, (n - 1) / n
    grads, weights = st.grad_comm * psi, st.weights * psi
    boundary = spec.boundary_bytes_per_sample * spec.micro_batch_size
    return {"dp": 2 * ring * grads, "zero1": ring * (grads + weights), "zero2": ring * (r * grads + weights),
            "fsdp": r * ring * (2 * (2 * psi if spec.precision.endswith("-mixed") else weights) + grads),
            "tp": r * (spec.num_layers or 1) * 4 * 2 * ring * boundary,
            "pp": (assumptions or Assumptions()).microbatches(n) * 2 * boundary}[s]


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


def predict_memory_mib(spec: JobSpec, strategy: str, devices: int, assumptions: Assumptions | None = None):
    """Per-rank memory (MiB): sharded model state + activations (split by TP/PP) + temporaries, and ``total``."""
    a, s, n = assumptions or Assumptions(), normalize("strategy", strategy), int(devices)
    out = {k: v / MIB for k, v in state_bytes_per_rank(spec.num_params, spec.state, s, n).items()}
    act = spec.activation_bytes_per_sample * spec.micro_batch_size
    if s == "tp":
        act /= n
    elif s == "pp":
        act *= min(n, a.microbatches(n)) / n  # 1F1B: min(p, m) micro-batches in flight, 1/p of the model
    out["activations"], out["temporaries"] = act / MIB, spec.temporaries_bytes / MIB
    return {**out, "total": sum(out.values())}


def predict_step(spec: JobSpec, strategy: str, devices: int, assumptions: Assumptions | None = None) -> StepPrediction:
    """Memory, communication, step time and throughput for ``strategy`` at ``devices`` ranks. Compute: DP/ZeRO the
    measured step on N × the batch; TP the step / N; PP m micro-batches through N stages, ``m·t_micro/N·(1+bubble)``."""
    a, s, n = assumptions or Assumptions(), normalize("strategy", strategy), int(devices)
    comm_s = (comm := comm_bytes_per_step(spec, s, n, a)) / (a.bandwidth(n) * 1e9)  # bus bandwidth in GB/s
    per_rank, compute, bubble = spec.micro_batch_size * spec.accumulate_grad_batches, spec.step_time_ms / 1000, 0.0
    samples = n * per_rank
    if s == "tp":
        compute, samples = compute / n, per_rank
    elif s == "pp":
        bubble = pipeline_bubble_fraction(n, m := a.microbatches(n))
        compute, samples = m * compute / spec.accumulate_grad_batches / n * (1 + bubble), m * spec.micro_batch_size
    hidden = a.overlap_fraction * BACKWARD_SHARE * compute if s not in ("tp", "pp") else 0.0
    step, memory = compute + max(0.0, comm_s - hidden), predict_memory_mib(spec, s, n, a)
    return StepPrediction(s, n, memory, comm, comm_s, bubble / (1 + bubble), step, samples,
                          samples / step if step > 0 else math.inf, memory["total"] <= a.device_memory_gib * 1024,
                          cannot_split(spec, s, n, a))


def markdown_tables(spec: JobSpec, devices: Sequence[int] = (1, 8, 64), assumptions: Assumptions | None = None,
                    epochs: float = 100, dataset_size: int = 50_000, priced: bool = True) -> str:
    """The scaling tables: per-rank memory, communication, step time and cost, largest model that fits. A strategy
    that cannot split this model says why; ``priced=False`` leaves cost out (a CPU step is not priced at GPU rates)."""
    a, st, est = assumptions or Assumptions(), spec.state, " (est.)"
    low, high = DEFAULT_PRICES[a.device]
    price_per_hour = a.usd_per_device_hour or low
    price = (f"${price_per_hour:.2f}/device-hour given" if a.usd_per_device_hour else
             f"{a.device} ${low:.2f}–{high:.2f}/h, low end; {PRICE_SOURCE}")
    rows_mem, rows_time = [], []
    for s, n in ((s, n) for s in STRATEGIES for n in devices):
        p = predict_step(spec, s, n, a)
        if p.unsplittable:
            rows_mem.append([STRATEGY_LABELS[s], n, p.unsplittable, *["–"] * 5])
            rows_time.append([STRATEGY_LABELS[s], n, p.unsplittable, *["–"] * 6])
            continue
        hours = epochs * dataset_size / p.samples_per_s / 3600
        rows_mem.append([STRATEGY_LABELS[s], n, *(sig(p.memory_mib[k]) for k in (
            "parameters", "gradients", "optimizer_state", "activations", "total")), "yes" if p.fits else "no"])
        rows_time.append([STRATEGY_LABELS[s], n, sig(p.comm_bytes / MIB), duration(p.comm_s) + est,
                          f"{sig(100 * p.bubble_share, 2)}%" if s == "pp" else "–", duration(p.step_s) + est,
                          sig(p.samples_per_s) + est, duration(hours * 3600) + est,
                          usd(n * hours * price_per_hour) + est if priced else "not priced"])

    def max_params(s: str, n: int) -> int:  # activations held at the measured values
        held = predict_memory_mib(spec, s, n, a)
        room = (a.device_memory_gib * 1024 - held["activations"] - held["temporaries"]) * MIB
        return max(0, int(room // sum(state_bytes_per_rank(1, st, s, n).values())))

    return "\n".join([
        f"- model: {spec.model_name or 'unnamed'}, {spec.num_params:,} parameters; {spec.precision} + {spec.optimizer}"
        f": {st.weights:g} + {st.gradients:g} + {st.optimizer:g} = {st.total:g} B/parameter ({st.regime})",
        f"- measured: per-rank batch {spec.micro_batch_size} × {spec.accumulate_grad_batches}; activations "
        f"{sig(spec.activation_bytes_per_sample / MIB)} MiB/sample; step {sig(spec.step_time_ms)} ms "
        f"({spec.step_time_source or 'assumed'})",
        f"- assumed: network: {FABRICS[a.device][2]}; {a.gpus_per_node} per node",
        f"- assumed: overlap: {a.overlap_fraction:.0%} of backward; {OVERLAP_SOURCE}", f"- assumed: price: {price}",
        "- estimates: every time, throughput and cost below is an estimate from the figures above",
        "", "### Per-device memory (MiB)", "",
        table(["strategy", "N", "parameters", "gradients", "optimizer", "activations", "total", "fits"], rows_mem),
        "", f"### Communication, time and cost ({epochs:g} epochs of {dataset_size:,} samples)", "",
        table(["strategy", "N", "comm/step (MiB)", "comm time", "bubble (share of step)", "step time", "samples/s",
               "train time", "cost"], rows_time),
        "", f"### Largest parameter count that fits {a.device_memory_gib:g} GiB per device", "",
        table(["strategy", *(f"N = {n}" for n in devices)],
              [[STRATEGY_LABELS[s], *(count(max_params(s, n)) for n in devices)] for s in STRATEGIES[:4]]), ""])
