"""Communication, step time and cost of DP, ZeRO-1/2/3 (FSDP), TP and PP at N devices, from one measured device.

Conventions: a *step* is one optimizer step (``accumulate_grad_batches`` micro-batches per rank); communication is
the bytes one rank sends, and time = bytes / NCCL bus bandwidth (NCCL's definition, so a ring's 2(N-1)/N is in the
volume). Weak scaling for DP/ZeRO: the per-device batch is fixed and compute per step is the measured step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from modelwright.errors import require
from modelwright.planner.memory import (
    GB,
    GIB,
    MIB,
    PARAM_STATE_BYTES,
    ParamStateBytes,
    check_devices,
    normalize_optimizer,
    normalize_precision,
    normalize_strategy,
    state_bytes_per_rank,
)


@dataclass(frozen=True)
class DevicePrice:
    """A published price range per device-hour, with its date and source (prices move)."""

    usd_per_hour_low: float
    usd_per_hour_high: float
    date: str
    source: str


PRICE_DATE = "2026-05"
PRICE_SOURCE = "third-party GPU cloud listings, May 2026"
DEFAULT_PRICES = {
    "A100 80GB": DevicePrice(1.10, 3.00, PRICE_DATE, PRICE_SOURCE),
    "H100 SXM": DevicePrice(2.50, 5.00, PRICE_DATE, PRICE_SOURCE),
    "H200": DevicePrice(3.50, 7.00, PRICE_DATE, PRICE_SOURCE),
    "H100 (AWS p5.48xlarge on demand, per GPU)": DevicePrice(98.32 / 8, 98.32 / 8, PRICE_DATE,
                                                             "AWS p5.48xlarge (8×H100) on demand $98.32/h"),
}
DEFAULT_DEVICE = "H100 SXM"
#: Per-GPU link rates in GB/s, one direction: (NVLink/NVSwitch inside a node, InfiniBand between nodes, source).
_NDR = "one 400 Gb/s NDR InfiniBand port per GPU (DGX H100)"
FABRICS = {
    "A100 80GB": (300.0, 25.0, "NVIDIA A100 datasheet: NVLink 600 GB/s both ways; one 200 Gb/s HDR port per GPU"),
    "H100 SXM": (450.0, 50.0, f"NVIDIA H100 datasheet: NVLink 900 GB/s both ways; {_NDR}"),
    "H200": (450.0, 50.0, f"NVIDIA H200 datasheet: NVLink 900 GB/s both ways; {_NDR}"),
}
#: DDP starts each bucket's all-reduce as soon as its gradients are ready, hiding it behind the rest of backward
#: (Li et al., "PyTorch Distributed", VLDB 2020, §3.2.3); FSDP prefetches the next all-gather the same way.
OVERLAP_SOURCE = "bucketed all-reduce overlapped with backward (Li et al., VLDB 2020); backward = 2/3 of compute"
BACKWARD_SHARE = 2 / 3  # backward ≈ 2 × forward FLOPs (the 6·N·tokens rule: 2 forward, 4 backward)


@dataclass(frozen=True)
class Assumptions:
    """What is not measured: network, overlap, price, device size and parallelism knobs (each with its source).

    Attributes:
        device: a key of :data:`DEFAULT_PRICES` / :data:`FABRICS`.
        gpus_per_node: devices joined by NVLink; a group larger than this crosses InfiniBand.
        intra_node_gb_per_s, inter_node_gb_per_s: bus bandwidth per rank, GB/s (None: the device's fabric).
        overlap_fraction: share of the backward pass that communication can hide behind (1 = all of it).
        usd_per_device_hour: price (None: the low end of the device's listing).
        device_memory_gib: memory of one device.
        pp_microbatches: micro-batches per pipeline step (None: 4 × stages); pp_interleave: chunks per device.
    """

    device: str = DEFAULT_DEVICE
    gpus_per_node: int = 8
    intra_node_gb_per_s: float | None = None
    inter_node_gb_per_s: float | None = None
    overlap_fraction: float = 1.0
    usd_per_device_hour: float | None = None
    device_memory_gib: float = 80.0
    pp_microbatches: int | None = None
    pp_interleave: int = 1

    def bandwidth(self, devices: int) -> float:
        """Bus bandwidth (GB/s) of a collective over ``devices`` ranks: NVLink inside a node, else InfiniBand."""
        intra, inter, _ = FABRICS.get(self.device, FABRICS[DEFAULT_DEVICE])
        if devices <= self.gpus_per_node:
            return self.intra_node_gb_per_s or intra
        return self.inter_node_gb_per_s or inter

    @property
    def price(self) -> float:
        return self.usd_per_device_hour or DEFAULT_PRICES[self.device].usd_per_hour_low

    @property
    def sources(self) -> list[str]:
        p = DEFAULT_PRICES[self.device]
        price = (f"${self.price:.2f}/device-hour given" if self.usd_per_device_hour else
                 f"{self.device} ${p.usd_per_hour_low:.2f}–{p.usd_per_hour_high:.2f}/h, low end; {p.source} ({p.date})")
        return [f"network: {FABRICS.get(self.device, FABRICS[DEFAULT_DEVICE])[2]}; {self.gpus_per_node} per node",
                f"overlap: {self.overlap_fraction:.0%} of backward; {OVERLAP_SOURCE}", f"price: {price}"]


@dataclass(frozen=True)
class JobSpec:
    """A training job as measured on one device; plain numbers, so it can be built without a record.

    Attributes:
        num_params: parameter count Ψ.
        precision, optimizer: keys of the bytes-per-parameter table (aliases accepted).
        micro_batch_size, accumulate_grad_batches: per rank.
        activation_bytes_per_sample: activations at the peak per sample; temporaries_bytes: the rest, fixed.
        step_time_ms: one optimizer step on one device; step_time_source: its record id or "assumed: ...".
        num_layers: blocks a pipeline can cut between (None: unknown, PP not planned).
        min_width: channels of the narrowest layer, the most TP can split it (None: unknown, TP not planned).
        boundary_bytes_per_sample: the largest activation crossing a block boundary (PP traffic, TP all-reduce).
        model_name, source: labels.
    """

    num_params: int
    precision: str = "32-true"
    optimizer: str = "adamw"
    micro_batch_size: int = 1
    accumulate_grad_batches: int = 1
    activation_bytes_per_sample: float = 0.0
    temporaries_bytes: float = 0.0
    step_time_ms: float = 0.0
    step_time_source: str = ""
    num_layers: int | None = None
    min_width: int | None = None
    boundary_bytes_per_sample: float = 0.0
    model_name: str = ""
    source: str = ""
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", normalize_precision(self.precision))
        object.__setattr__(self, "optimizer", normalize_optimizer(self.optimizer))
        for name in ("num_params", "micro_batch_size", "accumulate_grad_batches"):
            require(getattr(self, name) >= 1, f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("activation_bytes_per_sample", "temporaries_bytes", "step_time_ms"):
            require(getattr(self, name) >= 0, f"{name}: must be >= 0, got {getattr(self, name)}")

    @property
    def state(self) -> ParamStateBytes:
        return PARAM_STATE_BYTES[(self.precision, self.optimizer)]

    @property
    def microbatch_activation_bytes(self) -> float:
        return self.activation_bytes_per_sample * self.micro_batch_size


def pipeline_bubble_fraction(stages: int, microbatches: int, interleave: int = 1) -> float:
    """Idle time of a pipeline relative to its ideal compute: ``(p-1)/(v·m)``; its share of the total is b/(1+b)."""
    require(stages >= 1 and microbatches >= 1 and interleave >= 1, "pipeline: stages, microbatches, interleave >= 1")
    return (stages - 1) / (interleave * microbatches)


def ring_allreduce_bytes(message_bytes: float, devices: int) -> float:
    """Bytes each rank sends in a ring all-reduce: ``2·(N-1)/N·message``."""
    n = check_devices(devices)
    return 2 * (n - 1) / n * message_bytes


def cannot_split(spec: JobSpec, strategy: str, devices: int, a: Assumptions) -> str | None:
    """Why ``strategy`` cannot split this model ``devices`` ways, or None when it can."""
    s = normalize_strategy(strategy)
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
    """Bytes one rank sends per optimizer step (Ψ params, c grad bytes and w weight bytes on the wire, r micro-batches).

    DP ``2cΨ(N-1)/N`` (``no_sync`` while accumulating); ZeRO-1 ``(c+w)Ψ(N-1)/N``; ZeRO-2 ``(rc+w)Ψ(N-1)/N``;
    ZeRO-3/FSDP ``r(2w+c)Ψ(N-1)/N`` with w = 2 under mixed precision (FSDP gathers 16-bit weights,
    ``MixedPrecisionPolicy(param_dtype=bf16)``, gradients reduced in fp32); TP: the boundary activation all-reduced
    twice forward and twice backward per block; PP: one boundary activation and its gradient per micro-batch.
    """
    a = assumptions or Assumptions()
    s, n = normalize_strategy(strategy), check_devices(devices)
    if n == 1:
        return 0.0
    st, psi, r, ring = spec.state, spec.num_params, spec.accumulate_grad_batches, (n - 1) / n
    grads, weights = st.grad_comm * psi, st.weights * psi
    if s == "dp":
        return 2 * ring * grads
    if s == "zero1":
        return ring * (grads + weights)
    if s == "zero2":
        return ring * (r * grads + weights)
    if s == "fsdp":
        wire = 2 * psi if spec.precision.endswith("-mixed") else weights
        return r * ring * (2 * wire + grads)
    boundary = spec.boundary_bytes_per_sample * spec.micro_batch_size
    if s == "tp":
        return r * (spec.num_layers or 1) * 4 * ring_allreduce_bytes(boundary, n)
    return (a.pp_microbatches or 4 * n) * 2 * boundary


@dataclass(frozen=True)
class StepPrediction:
    """One (strategy, devices) pair; times per optimizer step. ``unsplittable`` says why it cannot be built."""

    strategy: str
    devices: int
    memory_mib: dict[str, float]
    comm_bytes: float
    comm_s: float
    compute_s: float
    bubble_fraction: float
    bubble_share: float
    step_s: float
    samples_per_step: int
    samples_per_s: float
    fits: bool
    unsplittable: str | None = None


def predict_memory_mib(spec: JobSpec, strategy: str, devices: int, assumptions: Assumptions | None = None):
    """Per-rank memory anatomy (MiB): sharded model state + activations (split by TP/PP) + temporaries."""
    a, s, n = assumptions or Assumptions(), normalize_strategy(strategy), check_devices(devices)
    out = {k: v / MIB for k, v in state_bytes_per_rank(spec.num_params, spec.state, s, n).items()}
    act = spec.microbatch_activation_bytes
    if s == "tp":
        act /= n
    elif s == "pp":
        act *= min(n, a.pp_microbatches or 4 * n) / n  # 1F1B: min(p, m) micro-batches in flight, 1/p of the model
    out["activations"], out["temporaries"] = act / MIB, spec.temporaries_bytes / MIB
    out["total"] = sum(out.values())
    return out


def predict_step(spec: JobSpec, strategy: str, devices: int, assumptions: Assumptions | None = None) -> StepPrediction:
    """Memory, communication, step time and throughput for ``strategy`` at ``devices`` ranks.

    DP/ZeRO: compute = the measured step, samples = N × batch; TP: compute / N; PP: m micro-batches through N stages,
    compute ``m·t_micro/N·(1+bubble)``. Communication hides behind ``overlap_fraction`` of the backward pass.
    """
    a, s, n = assumptions or Assumptions(), normalize_strategy(strategy), check_devices(devices)
    comm = comm_bytes_per_step(spec, s, n, a)
    comm_s = comm / (a.bandwidth(n) * GB)
    step1 = spec.step_time_ms / 1000
    bubble, samples, compute = 0.0, n * spec.micro_batch_size * spec.accumulate_grad_batches, step1
    if s == "tp":
        compute, samples = step1 / n, spec.micro_batch_size * spec.accumulate_grad_batches
    elif s == "pp":
        m = a.pp_microbatches or 4 * n
        bubble = pipeline_bubble_fraction(n, m, a.pp_interleave)
        compute, samples = m * step1 / spec.accumulate_grad_batches / n * (1 + bubble), m * spec.micro_batch_size
    hidden = a.overlap_fraction * BACKWARD_SHARE * compute if s in ("dp", "zero1", "zero2", "fsdp") else 0.0
    step = compute + max(0.0, comm_s - hidden)
    memory = predict_memory_mib(spec, s, n, a)
    return StepPrediction(s, n, memory, comm, comm_s, compute, bubble, bubble / (1 + bubble), step, samples,
                          samples / step if step > 0 else math.inf, memory["total"] * MIB <= a.device_memory_gib * GIB,
                          cannot_split(spec, s, n, a))


def max_params_that_fit(spec: JobSpec, strategy: str, devices: int, assumptions: Assumptions | None = None) -> int:
    """Largest parameter count whose per-rank memory fits the device, activations held at the measured values."""
    a = assumptions or Assumptions()
    per_param = sum(state_bytes_per_rank(1, spec.state, strategy, devices).values())
    fixed = predict_memory_mib(spec, strategy, devices, a)
    room = a.device_memory_gib * GIB - (fixed["activations"] + fixed["temporaries"]) * MIB
    return max(0, int(room // per_param))


def train_time_s(samples_per_s: float, epochs: float, dataset_size: int) -> float:
    return epochs * dataset_size / samples_per_s if samples_per_s > 0 else math.inf


def cost_usd(devices: int, hours: float, usd_per_device_hour: float) -> float:
    return devices * hours * usd_per_device_hour


def describe_model(profile: Mapping | None) -> dict:
    """``num_layers``, ``min_width`` and ``boundary_bytes_per_sample`` of a profiled model (empty without one)."""
    if not profile:
        return {}
    blocks = profile.get("segments", {}).get("block", [])
    widths = [u.get("width") for u in profile["units"] if u.get("width")]
    return {"num_layers": len(blocks) or None, "min_width": min(widths) if widths else None,
            "boundary_bytes_per_sample": max((b["input_bytes"] for b in blocks), default=0) / profile["batch_size"]}
