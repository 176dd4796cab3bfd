"""Memory, communication, time and cost model for DP, ZeRO-1/2/3 (FSDP), TP and PP at N devices.

To run: ``uv run python -m modelwright plan [--record results/<hw>/records.jsonl] [--devices 1 8 64]``

The model is fed by numbers measured on one device (a run record, or plain numbers in a :class:`JobSpec`)
and predicts, per rank, the memory anatomy, the bytes each rank sends per optimizer step, the step time,
the throughput, and the time and cost of a training job. It is standard library only so that docs
generators and tests can use it without torch.

Conventions and approximations (each function's docstring repeats the one it relies on):

* MiB = 2^20 bytes; GB = 1e9 bytes (the ZeRO paper's unit); GiB = 2^30 bytes (device memory sizes).
* A *step* is one optimizer step: ``accumulate_grad_batches`` micro-batches of ``micro_batch_size`` per rank.
* Parameter state per parameter comes from :data:`PARAM_STATE_BYTES`, keyed by (precision, optimizer).
* ZeRO stage k shards optimizer state (1), + gradients (2), + weights (3) over the data-parallel degree N
  (Rajbhandari et al. 2020); FSDP's full sharding is ZeRO-3.
* TP and PP are modelled pure, at degree N (all devices in one tensor-parallel group or one pipeline).
* Communication volume is the bytes *sent* per rank per step; time = volume / NCCL bus bandwidth, which
  is how NCCL defines bus bandwidth, so the 2(N-1)/N of a ring is in the volume, not in the bandwidth.
* Weak scaling for DP/ZeRO: per-device batch fixed, compute time per step equals the measured one.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from modelwright.errors import ConfigError

MIB = 2**20
GIB = 2**30
GB = 1e9

RESNET18_CIFAR_PARAMS = 11_173_962

# ---------------------------------------------------------------------------------------------------------
# Parameter state: bytes per parameter by (precision, optimizer)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamStateBytes:
    """Bytes each parameter costs, split the way ZeRO shards them.

    Attributes:
        weights: bytes of the weights the forward pass reads (what ZeRO-3 all-gathers).
        gradients: bytes of gradient storage (what ZeRO-2 shards), including any fp32 accumulation buffer.
        optimizer: bytes of optimizer state, fp32 master weights included (ZeRO's k; what ZeRO-1 shards).
        grad_comm: bytes per gradient element on the wire in the all-reduce / reduce-scatter.
        regime: one line saying which training regime this is.
    """

    weights: float
    gradients: float
    optimizer: float
    grad_comm: float
    regime: str

    @property
    def total(self) -> float:
        """Bytes per parameter with nothing sharded."""
        return self.weights + self.gradients + self.optimizer


PRECISIONS: tuple[str, ...] = (
    "32-true",
    "bf16-mixed",
    "16-mixed",
    "bf16-true",
    "16-true",
    "playbook-mixed",
    "playbook-mixed-fp32-grads",
)
OPTIMIZERS: tuple[str, ...] = ("adamw", "sgd", "sgd-nomomentum")
_PRECISION_ALIASES = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed", "playbook": "playbook-mixed"}
_OPTIMIZER_ALIASES = {"adam": "adamw", "sgd-momentum": "sgd", "sgd_nomomentum": "sgd-nomomentum"}

_FP32 = "fp32 weights, grads and optimizer state (our 32-true runs)"
# torch autocast keeps fp32 parameters and fp32 .grad and casts copies on the fly, so the persistent state
# of our measured *-mixed runs is that of fp32; the 16-bit copies are temporaries.
_AUTOCAST = "torch autocast (our bf16-mixed / 16-mixed runs): fp32 weights and grads, as in 32-true"
_HALF = "bf16-true / 16-true: weights, grads and optimizer state all in 16 bits"
_PLAYBOOK = "Playbook mixed precision: 16-bit weights and grads, fp32 master weights and optimizer state"
_PLAYBOOK_FP32_GRADS = "Playbook mixed precision plus an fp32 gradient accumulation buffer"

PARAM_STATE_BYTES: dict[tuple[str, str], ParamStateBytes] = {
    # (precision, optimizer):                          weights, grads, optimizer, grad bytes on the wire
    ("32-true", "adamw"): ParamStateBytes(4, 4, 8, 4, _FP32),
    ("32-true", "sgd"): ParamStateBytes(4, 4, 4, 4, _FP32),
    ("32-true", "sgd-nomomentum"): ParamStateBytes(4, 4, 0, 4, _FP32),
    ("bf16-mixed", "adamw"): ParamStateBytes(4, 4, 8, 4, _AUTOCAST),
    ("bf16-mixed", "sgd"): ParamStateBytes(4, 4, 4, 4, _AUTOCAST),
    ("bf16-mixed", "sgd-nomomentum"): ParamStateBytes(4, 4, 0, 4, _AUTOCAST),
    ("16-mixed", "adamw"): ParamStateBytes(4, 4, 8, 4, _AUTOCAST),
    ("16-mixed", "sgd"): ParamStateBytes(4, 4, 4, 4, _AUTOCAST),
    ("16-mixed", "sgd-nomomentum"): ParamStateBytes(4, 4, 0, 4, _AUTOCAST),
    ("bf16-true", "adamw"): ParamStateBytes(2, 2, 4, 2, _HALF),
    ("bf16-true", "sgd"): ParamStateBytes(2, 2, 2, 2, _HALF),
    ("bf16-true", "sgd-nomomentum"): ParamStateBytes(2, 2, 0, 2, _HALF),
    ("16-true", "adamw"): ParamStateBytes(2, 2, 4, 2, _HALF),
    ("16-true", "sgd"): ParamStateBytes(2, 2, 2, 2, _HALF),
    ("16-true", "sgd-nomomentum"): ParamStateBytes(2, 2, 0, 2, _HALF),
    # optimizer = fp32 master (4) + fp32 state: ZeRO's k = 12 for Adam
    ("playbook-mixed", "adamw"): ParamStateBytes(2, 2, 12, 2, _PLAYBOOK),
    ("playbook-mixed", "sgd"): ParamStateBytes(2, 2, 8, 2, _PLAYBOOK),
    ("playbook-mixed", "sgd-nomomentum"): ParamStateBytes(2, 2, 4, 2, _PLAYBOOK),
    # grads = bf16 (2) + fp32 accumulation buffer (4), reduced in fp32
    ("playbook-mixed-fp32-grads", "adamw"): ParamStateBytes(2, 6, 12, 4, _PLAYBOOK_FP32_GRADS),
    ("playbook-mixed-fp32-grads", "sgd"): ParamStateBytes(2, 6, 8, 4, _PLAYBOOK_FP32_GRADS),
    ("playbook-mixed-fp32-grads", "sgd-nomomentum"): ParamStateBytes(2, 6, 4, 4, _PLAYBOOK_FP32_GRADS),
}
"""Bytes per parameter keyed by (precision, optimizer).

Two families of regimes live here:

* What our runs hold: ``32-true``, and Lightning's ``bf16-mixed`` / ``16-mixed`` (torch autocast keeps fp32
  weights and fp32 grads, so these equal ``32-true``: AdamW 16 B, SGD+momentum 12 B, SGD 8 B);
  ``bf16-true`` / ``16-true`` keep everything in 16 bits (AdamW 2 + 2 + 2 + 2 = 8 B).
* The textbook mixed-precision regime with fp32 master weights (Ultra-Scale Playbook, ZeRO paper):
  ``playbook-mixed`` (AdamW 2 + 2 + 4 + 8 = 16 B, k = 12) and ``playbook-mixed-fp32-grads`` (20 B).
"""


def normalize_precision(precision: str) -> str:
    """Lightning's precision spelling (``"32"``, ``"bf16"``...) to a key of :data:`PARAM_STATE_BYTES`."""
    name = str(precision).strip().lower()
    name = _PRECISION_ALIASES.get(name, name)
    if name not in PRECISIONS:
        raise ConfigError(f"precision: unknown {precision!r}; valid: {', '.join(PRECISIONS)}")
    return name


def normalize_optimizer(optimizer: str) -> str:
    """An optimizer name to a key of :data:`PARAM_STATE_BYTES` (``adam`` counts as ``adamw``)."""
    name = str(optimizer).strip().lower()
    name = _OPTIMIZER_ALIASES.get(name, name)
    if name not in OPTIMIZERS:
        raise ConfigError(f"optimizer: unknown {optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
    return name


def param_state_bytes(precision: str, optimizer: str) -> ParamStateBytes:
    """The bytes-per-parameter entry for a (precision, optimizer) pair; aliases accepted."""
    return PARAM_STATE_BYTES[(normalize_precision(precision), normalize_optimizer(optimizer))]


# ---------------------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------------------

STRATEGIES: tuple[str, ...] = ("dp", "zero1", "zero2", "fsdp", "tp", "pp")
STRATEGY_LABELS: dict[str, str] = {
    "dp": "DP (DDP)",
    "zero1": "ZeRO-1",
    "zero2": "ZeRO-2",
    "fsdp": "ZeRO-3 / FSDP",
    "tp": "TP",
    "pp": "PP",
}
_STRATEGY_ALIASES = {
    "auto": "dp",
    "ddp": "dp",
    "ddp_spawn": "dp",
    "single_device": "dp",
    "zero3": "fsdp",
    "fsdp2": "fsdp",
    "model_parallel": "fsdp",  # Lightning's ModelParallelStrategy, used here with fully_shard
    "deepspeed_stage_1": "zero1",
    "deepspeed_stage_2": "zero2",
    "deepspeed_stage_3": "fsdp",
}


def normalize_strategy(strategy: str) -> str:
    """A planner or Lightning strategy name (``ddp``, ``fsdp2``, ``deepspeed_stage_2``...) to a planner's."""
    name = str(strategy).strip().lower()
    name = _STRATEGY_ALIASES.get(name, name)
    if name not in STRATEGIES:
        raise ConfigError(f"strategy: unknown {strategy!r}; valid: {', '.join(STRATEGIES)}")
    return name


def state_bytes_per_rank(
    num_params: float, state: ParamStateBytes, strategy: str, devices: int
) -> dict[str, float]:
    """Bytes of weights, gradients and optimizer state one rank holds.

    With Ψ parameters, w/g/k bytes per parameter and N devices:
    DP ``(w+g+k)Ψ`` · ZeRO-1 ``wΨ + gΨ + kΨ/N`` · ZeRO-2 ``wΨ + (g+k)Ψ/N`` · ZeRO-3/FSDP ``(w+g+k)Ψ/N``;
    TP and PP (pure, degree N) divide all three by N, assuming an even split of the parameters.

    Returns:
        ``{"parameters", "gradients", "optimizer_state"}`` in bytes.
    """
    s = normalize_strategy(strategy)
    n = _check_devices(devices)
    w, g, k = state.weights * num_params, state.gradients * num_params, state.optimizer * num_params
    shard = {
        "dp": (1, 1, 1),
        "zero1": (1, 1, n),
        "zero2": (1, n, n),
        "fsdp": (n, n, n),
        "tp": (n, n, n),
        "pp": (n, n, n),
    }[s]
    return {"parameters": w / shard[0], "gradients": g / shard[1], "optimizer_state": k / shard[2]}


def pipeline_bubble_fraction(stages: int, microbatches: int, interleave: int = 1) -> float:
    """Idle fraction of a pipeline relative to its ideal compute time: ``(p-1)/(v·m)``.

    Args:
        stages: pipeline stages p.
        microbatches: micro-batches per step m.
        interleave: model chunks per device v (1 = plain 1F1B / GPipe; v > 1 = interleaved 1F1B).
    """
    if stages < 1 or microbatches < 1 or interleave < 1:
        raise ConfigError("pipeline: stages, microbatches and interleave must be >= 1")
    return (stages - 1) / (interleave * microbatches)


def ring_allreduce_bytes(message_bytes: float, devices: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``message_bytes``: ``2·(N-1)/N·message``."""
    n = _check_devices(devices)
    return 2 * (n - 1) / n * message_bytes


def ring_collective_bytes(message_bytes: float, devices: int) -> float:
    """Bytes each rank sends in a ring reduce-scatter or all-gather of the full ``message_bytes``."""
    n = _check_devices(devices)
    return (n - 1) / n * message_bytes


def comm_time_s(volume_bytes: float, bus_bandwidth_gb_per_s: float) -> float:
    """Seconds to move ``volume_bytes`` per rank at an NCCL-style bus bandwidth in GB/s (1e9 B/s)."""
    if bus_bandwidth_gb_per_s <= 0:
        raise ConfigError("bus_bandwidth_gb_per_s: must be > 0")
    return volume_bytes / (bus_bandwidth_gb_per_s * GB)


def step_time_s(compute_s: float, comm_s: float, overlap_fraction: float) -> float:
    """Compute plus the communication that is not hidden behind it.

    ``overlap_fraction`` of the communication overlaps compute, but never more than the compute time.
    """
    if not 0.0 <= overlap_fraction <= 1.0:
        raise ConfigError("overlap_fraction: must be in [0, 1]")
    exposed_s = max(comm_s * (1 - overlap_fraction), comm_s - compute_s)
    return compute_s + exposed_s


def train_time_s(samples_per_s: float, epochs: float, dataset_size: int) -> float:
    """Seconds to see ``epochs`` × ``dataset_size`` samples at ``samples_per_s``."""
    if samples_per_s <= 0:
        return math.inf
    return epochs * dataset_size / samples_per_s


def cost_usd(devices: int, hours: float, usd_per_device_hour: float) -> float:
    """Cost of a job: devices × hours × price per device-hour."""
    return devices * hours * usd_per_device_hour


# ---------------------------------------------------------------------------------------------------------
# Prices: published third-party listings (they move; each carries its date)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DevicePrice:
    """A published price range per device-hour, with its date and source (prices move)."""

    usd_per_hour_low: float
    usd_per_hour_high: float
    date: str
    source: str


PRICE_DATE = "2026-05"
PRICE_SOURCE = "third-party GPU cloud listings, May 2026"
DEFAULT_PRICES: dict[str, DevicePrice] = {
    "A100 80GB": DevicePrice(1.10, 3.00, PRICE_DATE, PRICE_SOURCE),
    "H100 SXM": DevicePrice(2.50, 5.00, PRICE_DATE, PRICE_SOURCE),
    "H200": DevicePrice(3.50, 7.00, PRICE_DATE, PRICE_SOURCE),
    "H100 (AWS p5.48xlarge on demand, per GPU)": DevicePrice(
        98.32 / 8,
        98.32 / 8,
        PRICE_DATE,
        "AWS p5.48xlarge (8×H100) on demand $98.32/h",
    ),
}
DEFAULT_DEVICE = "H100 SXM"
DEFAULT_USD_PER_DEVICE_HOUR = DEFAULT_PRICES[DEFAULT_DEVICE].usd_per_hour_low

# ---------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------

# A transformer layer saves about 34·s·b·h bytes of activations (16-bit, no recomputation) and its output,
# the tensor TP all-reduces and PP sends, is s·b·h elements = 2·s·b·h bytes (Korthikanti et al. 2022).
BOUNDARY_FRACTION = 2 / 34
# Of those 34 bytes, TP without sequence parallelism shards 24 (the 10 around LayerNorm/dropout stay whole).
TP_SHARDED_ACTIVATION_FRACTION = 24 / 34


@dataclass(frozen=True)
class JobSpec:
    """A training job as measured on one device; plain numbers, so it can be built without a record.

    Attributes:
        num_params: parameter count Ψ.
        precision: a key of :data:`PRECISIONS` (or a Lightning alias).
        optimizer: a key of :data:`OPTIMIZERS` (``sgd`` is SGD with momentum).
        micro_batch_size: samples per micro-batch per rank.
        accumulate_grad_batches: micro-batches per optimizer step.
        activation_bytes_per_sample: activation bytes at the measured peak, per sample of the micro-batch
            (checkpointing, if it was on, is already in this number).
        temporaries_bytes: other bytes at the peak (workspaces, casts); kept as measured at every scale.
        step_time_ms: single-device time of one optimizer step (all its micro-batches).
        num_layers: layers, used only to size a pipeline-stage boundary; None = one layer per stage.
        model_name: label for tables.
        source: where the numbers came from (a run id, "defaults"...).
    """

    num_params: int
    precision: str = "32-true"
    optimizer: str = "adamw"
    micro_batch_size: int = 1
    accumulate_grad_batches: int = 1
    activation_bytes_per_sample: float = 0.0
    temporaries_bytes: float = 0.0
    step_time_ms: float = 0.0
    num_layers: int | None = None
    model_name: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", normalize_precision(self.precision))
        object.__setattr__(self, "optimizer", normalize_optimizer(self.optimizer))
        for name in ("num_params", "micro_batch_size", "accumulate_grad_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("activation_bytes_per_sample", "temporaries_bytes", "step_time_ms"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")

    @property
    def state(self) -> ParamStateBytes:
        """Bytes per parameter of this job's (precision, optimizer)."""
        return PARAM_STATE_BYTES[(self.precision, self.optimizer)]

    @property
    def microbatch_activation_bytes(self) -> float:
        """Activation bytes of one micro-batch on one unsharded replica."""
        return self.activation_bytes_per_sample * self.micro_batch_size


@dataclass(frozen=True)
class Assumptions:
    """Inputs that are not measured: network, overlap, price, device size and parallelism knobs.

    Attributes:
        bus_bandwidth_gb_per_s: NCCL bus bandwidth per rank in GB/s (1e9 B/s). The default, 50, is one
            400 Gb/s InfiniBand port per GPU between nodes; NVLink inside a node is several times more.
        overlap_fraction: share of communication hidden behind compute (0 = none; DDP buckets overlap).
        usd_per_device_hour: price per device-hour; default the low end of the H100 SXM listing.
        price_label: what the price is, with its date and source.
        device_memory_gib: memory of one device, for "fits" and the largest model that fits.
        pp_microbatches: micro-batches per pipeline step; None = 4 × stages (the Playbook's rule of thumb).
        pp_interleave: model chunks per device v for interleaved 1F1B.
        tp_activation_sharded_fraction: share of activation bytes TP divides by its degree
            (24/34 without sequence parallelism; 1.0 with it).
    """

    bus_bandwidth_gb_per_s: float = 50.0
    overlap_fraction: float = 0.0
    usd_per_device_hour: float = DEFAULT_USD_PER_DEVICE_HOUR
    price_label: str = (
        f"{DEFAULT_DEVICE}, low end of ${DEFAULT_PRICES[DEFAULT_DEVICE].usd_per_hour_low:.2f}–"
        f"{DEFAULT_PRICES[DEFAULT_DEVICE].usd_per_hour_high:.2f}/h; {PRICE_DATE}; {PRICE_SOURCE}"
    )
    device_memory_gib: float = 80.0
    pp_microbatches: int | None = None
    pp_interleave: int = 1
    tp_activation_sharded_fraction: float = TP_SHARDED_ACTIVATION_FRACTION

    def microbatches_for(self, stages: int) -> int:
        """Pipeline micro-batches per step at ``stages`` stages."""
        return self.pp_microbatches if self.pp_microbatches else 4 * stages


# ---------------------------------------------------------------------------------------------------------
# Predictions
# ---------------------------------------------------------------------------------------------------------


def _check_devices(devices: int) -> int:
    if int(devices) != devices or devices < 1:
        raise ConfigError(f"devices: must be an integer >= 1, got {devices!r}")
    return int(devices)


def activation_bytes_per_rank(spec: JobSpec, strategy: str, devices: int, assumptions: Assumptions) -> float:
    """Activation bytes one rank holds at its peak.

    DP and ZeRO keep one full micro-batch. TP divides ``tp_activation_sharded_fraction`` of it by N.
    PP (1F1B) keeps min(p, m) micro-batches in flight on the first stage, each 1/p of the model.
    """
    s = normalize_strategy(strategy)
    n = _check_devices(devices)
    act = spec.microbatch_activation_bytes
    if s == "tp":
        f = assumptions.tp_activation_sharded_fraction
        return act * ((1 - f) + f / n)
    if s == "pp":
        return act * min(n, assumptions.microbatches_for(n)) / n
    return act


def predict_memory_mib(
    spec: JobSpec, strategy: str, devices: int, assumptions: Assumptions | None = None
) -> dict[str, float]:
    """Per-rank memory anatomy in MiB for ``strategy`` at ``devices`` ranks.

    The sum is the Playbook-style budget: all gradients are counted although at a measured peak
    (``zero_grad(set_to_none=True)``, peak at the start of backward) part of them may not exist yet.

    Returns:
        ``{"parameters", "gradients", "optimizer_state", "activations", "temporaries", "total"}`` in MiB.
    """
    a = assumptions or Assumptions()
    out = {
        k: v / MIB for k, v in state_bytes_per_rank(spec.num_params, spec.state, strategy, devices).items()
    }
    out["activations"] = activation_bytes_per_rank(spec, strategy, devices, a) / MIB
    out["temporaries"] = spec.temporaries_bytes / MIB
    out["total"] = sum(out.values())
    return out


def comm_bytes_per_step(
    spec: JobSpec, strategy: str, devices: int, assumptions: Assumptions | None = None
) -> float:
    """Bytes one rank sends per optimizer step.

    Approximations (Ψ params, w weight bytes, c gradient bytes on the wire, A micro-batch activation
    bytes, r accumulation micro-batches, ring factor (N-1)/N per reduce-scatter or all-gather):

    * DP: one all-reduce of the gradients per step (``no_sync`` while accumulating): ``2·c·Ψ·(N-1)/N``.
    * ZeRO-1: reduce-scatter of gradients + all-gather of updated weights, once per step:
      ``(c + w)·Ψ·(N-1)/N`` (= DP's 2Ψ when c = w).
    * ZeRO-2: gradients are sharded, so the reduce-scatter runs every micro-batch:
      ``(r·c + w)·Ψ·(N-1)/N``.
    * ZeRO-3/FSDP: all-gather weights in forward and in backward, reduce-scatter gradients, every
      micro-batch: ``r·(2w + c)·Ψ·(N-1)/N`` (1.5 × DP when c = w and r = 1).
    * TP (Megatron-style): 2 all-reduces in forward and 2 in backward per layer, each of one layer-output
      activation. Summed over layers the all-reduced tensor is ``BOUNDARY_FRACTION`` × the micro-batch's
      saved activations (the transformer ratio 2/34; only a stand-in for CNNs):
      ``r · 4 · 2·(N-1)/N · BOUNDARY_FRACTION · A``.
    * PP: per micro-batch each stage sends one boundary activation forward and its gradient backward:
      ``m · 2 · BOUNDARY_FRACTION · A / L`` with L = ``spec.num_layers`` or, unknown, the stage count.
    """
    a = assumptions or Assumptions()
    s = normalize_strategy(strategy)
    n = _check_devices(devices)
    if n == 1:
        return 0.0
    st = spec.state
    grads = st.grad_comm * spec.num_params  # one full gradient message on the wire
    weights = st.weights * spec.num_params  # one full weight message on the wire
    r = spec.accumulate_grad_batches
    if s == "dp":
        return ring_allreduce_bytes(grads, n)
    if s == "zero1":
        return ring_collective_bytes(grads + weights, n)
    if s == "zero2":
        return ring_collective_bytes(r * grads + weights, n)
    if s == "fsdp":
        return r * ring_collective_bytes(2 * weights + grads, n)
    act = spec.microbatch_activation_bytes
    if s == "tp":
        return r * 4 * ring_allreduce_bytes(BOUNDARY_FRACTION * act, n)
    layers = spec.num_layers or n
    return a.microbatches_for(n) * 2 * BOUNDARY_FRACTION * act / layers


@dataclass(frozen=True)
class StepPrediction:
    """Everything the planner predicts for one (strategy, devices) pair; times per optimizer step."""

    strategy: str
    devices: int
    memory_mib: dict[str, float]
    comm_bytes: float
    comm_s: float
    compute_s: float
    bubble_fraction: float
    step_s: float
    samples_per_step: int
    samples_per_s: float
    fits: bool


def predict_step(
    spec: JobSpec, strategy: str, devices: int, assumptions: Assumptions | None = None
) -> StepPrediction:
    """Memory, communication, step time and throughput for ``strategy`` at ``devices`` ranks.

    Time model:

    * DP / ZeRO (weak scaling: per-device batch fixed): compute = the measured single-device step;
      samples per step = N × micro-batch × accumulation.
    * TP: one replica split N ways; compute = measured step / N (ideal split), same samples per step.
    * PP: one replica in N stages fed m micro-batches; compute = m × (micro-batch time / N) × (1 + bubble),
      bubble ``(p-1)/(v·m)``; samples per step = m × micro-batch.

    Step time adds the communication not hidden by ``overlap_fraction`` (see :func:`step_time_s`).
    """
    a = assumptions or Assumptions()
    s = normalize_strategy(strategy)
    n = _check_devices(devices)
    memory = predict_memory_mib(spec, s, n, a)
    comm = comm_bytes_per_step(spec, s, n, a)
    comm_s = comm_time_s(comm, a.bus_bandwidth_gb_per_s)
    step_single_s = spec.step_time_ms / 1000
    microbatch_s = step_single_s / spec.accumulate_grad_batches
    bubble = 0.0
    if s in ("dp", "zero1", "zero2", "fsdp"):
        compute_s = step_single_s
        samples = n * spec.micro_batch_size * spec.accumulate_grad_batches
    elif s == "tp":
        compute_s = step_single_s / n
        samples = spec.micro_batch_size * spec.accumulate_grad_batches
    else:
        m = a.microbatches_for(n)
        bubble = pipeline_bubble_fraction(n, m, a.pp_interleave)
        compute_s = m * microbatch_s / n * (1 + bubble)
        samples = m * spec.micro_batch_size
    step_s = step_time_s(compute_s, comm_s, a.overlap_fraction)
    return StepPrediction(
        strategy=s,
        devices=n,
        memory_mib=memory,
        comm_bytes=comm,
        comm_s=comm_s,
        compute_s=compute_s,
        bubble_fraction=bubble,
        step_s=step_s,
        samples_per_step=samples,
        samples_per_s=samples / step_s if step_s > 0 else math.inf,
        fits=memory["total"] * MIB <= a.device_memory_gib * GIB,
    )


def max_params_that_fit(
    spec: JobSpec, strategy: str, devices: int, assumptions: Assumptions | None = None
) -> int:
    """Largest parameter count whose per-rank memory fits ``assumptions.device_memory_gib``.

    Activations and temporaries are held at the spec's measured values (they do not grow with Ψ here),
    so this answers "how big can the parameters get before this strategy no longer fits". 0 when the
    activations and temporaries alone do not fit.
    """
    a = assumptions or Assumptions()
    per_param = sum(state_bytes_per_rank(1, spec.state, strategy, devices).values())
    fixed = activation_bytes_per_rank(spec, strategy, devices, a) + spec.temporaries_bytes
    room = a.device_memory_gib * GIB - fixed
    return max(0, int(room // per_param))


def compare(predicted_mib: Mapping[str, float], measured_mib: Mapping[str, float]) -> dict[str, float]:
    """Relative error ``(predicted - measured) / measured`` for every key the two have in common.

    A measured 0 gives 0.0 when the prediction is 0 too, else ``inf``. If ``measured_mib`` has no
    ``total``, the sum of its other values is used.
    """
    measured = dict(measured_mib)
    if "total" in predicted_mib and "total" not in measured:
        measured["total"] = sum(measured.values())
    errors: dict[str, float] = {}
    for key in predicted_mib:
        if key not in measured:
            continue
        m, p = float(measured[key]), float(predicted_mib[key])
        if m == 0:
            errors[key] = 0.0 if p == 0 else math.inf
        else:
            errors[key] = (p - m) / m
    return errors


# ---------------------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------------------


def _need(mapping: Mapping, path: str):
    """``mapping`` followed along dotted ``path``; a KeyError that names the whole path when absent."""
    node = mapping
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise KeyError(f"record is missing {path!r}")
        node = node[part]
    return node


def _get(mapping: Mapping, path: str, default=None):
    try:
        return _need(mapping, path)
    except KeyError:
        return default


def spec_from_record(record: Mapping) -> JobSpec:
    """A :class:`JobSpec` from a run record (the dict ``measure.py`` writes).

    Reads ``techniques.{precision, optimizer, micro_batch_size, accumulate_grad_batches, model_name}``,
    ``memory.model_parameters``, ``memory.anatomy_mib.{activations, temporaries}`` and
    ``timing.step_time_median_ms`` (or, without it, ``timing.samples_per_s``).

    The measured step may be one micro-batch (Lightning's batch hooks) or one optimizer step. When both
    ``step_time_median_ms`` and ``samples_per_s`` are present, the one whose samples-per-step matches
    ``samples_per_s`` better decides; otherwise one micro-batch is assumed and multiplied by the
    accumulation. Feed a single-device record: a multi-rank record's step time already includes its
    communication. ``techniques.momentum == 0`` with ``sgd`` selects ``sgd-nomomentum``.

    Raises:
        KeyError: naming the dotted path of a required key that is missing.
    """
    micro = int(_need(record, "techniques.micro_batch_size"))
    accum = int(_get(record, "techniques.accumulate_grad_batches", 1) or 1)
    optimizer = str(_need(record, "techniques.optimizer"))
    if normalize_optimizer(optimizer) == "sgd" and _get(record, "techniques.momentum") in (0, 0.0):
        optimizer = "sgd-nomomentum"
    activations_mib = float(_need(record, "memory.anatomy_mib.activations"))
    temporaries_mib = float(_get(record, "memory.anatomy_mib.temporaries", 0.0) or 0.0)

    step_ms = _get(record, "timing.step_time_median_ms")
    samples_per_s = _get(record, "timing.samples_per_s")
    if step_ms is None and samples_per_s is None:
        raise KeyError("record is missing 'timing.step_time_median_ms' (and 'timing.samples_per_s')")
    if step_ms is None:
        step_ms = micro * accum / float(samples_per_s) * 1000
    else:
        step_ms = float(step_ms)
        per_micro = True
        if samples_per_s and accum > 1:
            measured_samples = float(samples_per_s) * step_ms / 1000
            per_micro = abs(math.log(measured_samples / micro)) <= abs(
                math.log(measured_samples / (micro * accum))
            )
        if per_micro:
            step_ms *= accum
    return JobSpec(
        num_params=int(_need(record, "memory.model_parameters")),
        precision=str(_need(record, "techniques.precision")),
        optimizer=optimizer,
        micro_batch_size=micro,
        accumulate_grad_batches=accum,
        activation_bytes_per_sample=activations_mib * MIB / micro,
        temporaries_bytes=temporaries_mib * MIB,
        step_time_ms=step_ms,
        model_name=str(_get(record, "techniques.model_name", "") or ""),
        source=str(record.get("run_id", "") or ""),
    )


def measured_memory_mib(record: Mapping) -> dict[str, float]:
    """The record's measured anatomy in MiB with a ``total`` (the sum) added, keyed like the prediction."""
    anatomy = _need(record, "memory.anatomy_mib")
    out = {k: float(v) for k, v in anatomy.items() if k != "total"}
    out["total"] = float(anatomy["total"]) if "total" in anatomy else sum(out.values())
    return out


def predict_record_memory_mib(
    record: Mapping,
    strategy: str | None = None,
    world_size: int | None = None,
    assumptions: Assumptions | None = None,
) -> dict[str, float]:
    """Per-rank memory anatomy (MiB) predicted for a record's job under ``strategy`` at ``world_size``.

    Both default to the record's own ``techniques.strategy`` / ``techniques.world_size``, so
    ``compare(predict_record_memory_mib(r), measured_memory_mib(r))`` sets prediction beside measurement.
    """
    spec = spec_from_record(record)
    if strategy is None:
        strategy = str(_need(record, "techniques.strategy"))
    if world_size is None:
        world_size = int(_get(record, "techniques.world_size", 1) or 1)
    return predict_memory_mib(spec, strategy, world_size, assumptions)


def _record_field(record: Mapping, key: str):
    """A top-level record key, or the same key under ``techniques``."""
    if key in record:
        return record[key]
    return _get(record, f"techniques.{key}")


def load_record(path: str | Path, run_id: str | None = None) -> dict:
    """One record from a JSON-lines file (damaged lines are reported and skipped by ``read_records``).

    Without ``run_id``: the study's ``baseline`` run if there is one, else the first record with status
    "ok", loop "lightning", strategy auto (or single-device) and world size 1. With it: the record whose
    ``run_id`` matches.

    Raises:
        FileNotFoundError: the file does not exist.
        ConfigError: no record matches (the message names the file and the filter).
    """
    from modelwright.record import read_records

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--record: no such file {str(p)!r}")
    records = read_records(p)
    if run_id is not None:
        matches = [r for r in records if str(r.get("run_id")) == run_id]
    else:
        matches = [
            r for r in records
            if _record_field(r, "status") == "ok"
            and _record_field(r, "loop") == "lightning"
            and str(_get(r, "techniques.strategy", "auto")) in ("auto", "single_device")
            and int(_get(r, "techniques.world_size", 1) or 1) == 1
        ]
        matches.sort(key=lambda r: _get(r, "study.name") != "baseline")
    if not matches:
        wanted = f"run_id {run_id!r}" if run_id is not None else "status ok, loop lightning, world_size 1"
        raise ConfigError(f"--record: no record with {wanted} in {str(p)!r}")
    return matches[0]


def default_records_file(root: str | Path = "results") -> Path | None:
    """The first ``results/<hardware>/records.jsonl`` (sorted by name), or None."""
    found = sorted(Path(root).glob("*/records.jsonl"))
    return found[0] if found else None


# ---------------------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------------------


def _count(n: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g} {suffix}"
    return f"{n:.0f}"


def format_duration(seconds: float) -> str:
    """Seconds as the largest fitting unit, three significant digits (``"2.5 min"``, ``"3.1 days"``)."""
    if seconds < 1:
        return f"{seconds * 1000:.3g} ms"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.3g} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.3g} h"
    return f"{seconds / 86400:.3g} days"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def markdown_tables(
    spec: JobSpec,
    devices: Sequence[int] = (1, 8, 64),
    assumptions: Assumptions | None = None,
    epochs: float = 100,
    dataset_size: int = 50_000,
    strategies: Sequence[str] = STRATEGIES,
) -> str:
    """The planner's tables as Markdown: inputs, per-device memory, communication/time/cost, largest model.

    Args:
        spec: the measured job.
        devices: device counts N to tabulate.
        assumptions: bandwidth, overlap, price, device memory and parallelism knobs.
        epochs: epochs of the training job priced in the cost table.
        dataset_size: samples per epoch.
        strategies: which of :data:`STRATEGIES` to show.
    """
    a = assumptions or Assumptions()
    ns = [_check_devices(n) for n in devices]
    st = spec.state
    usd = a.usd_per_device_hour
    preds = [(s, n, predict_step(spec, s, n, a)) for s in strategies for n in ns]
    out = [
        "### Inputs",
        "",
        f"- model: {spec.model_name or 'unnamed'}, {spec.num_params:,} parameters"
        + (f" (from {spec.source})" if spec.source else ""),
        f"- regime: {spec.precision} + {spec.optimizer}: {st.weights:g} + {st.gradients:g} + "
        f"{st.optimizer:g} = {st.total:g} B/parameter; {st.regime}",
        f"- per rank: micro-batch {spec.micro_batch_size} × accumulation {spec.accumulate_grad_batches}; "
        f"activations {spec.activation_bytes_per_sample / MIB:.3g} MiB/sample; "
        f"measured single-device step {spec.step_time_ms:.4g} ms",
        f"- network: {a.bus_bandwidth_gb_per_s:g} GB/s bus bandwidth per rank, {a.overlap_fraction:.0%} "
        f"of communication overlapped; device memory {a.device_memory_gib:g} GiB",
        f"- pipeline: {'4 × stages' if not a.pp_microbatches else a.pp_microbatches} micro-batches, "
        f"interleave {a.pp_interleave}; TP shards {a.tp_activation_sharded_fraction:.0%} of activations",
        f"- price: ${a.usd_per_device_hour:.2f} per device-hour ({a.price_label})",
        "",
        "### Per-device memory (MiB)",
        "",
        _table(
            [
                "strategy",
                "N",
                "parameters",
                "gradients",
                "optimizer",
                "activations",
                "temporaries",
                "total",
                "fits",
            ],
            [
                [STRATEGY_LABELS[s], str(n)]
                + [
                    f"{p.memory_mib[k]:,.1f}"
                    for k in (
                        "parameters",
                        "gradients",
                        "optimizer_state",
                        "activations",
                        "temporaries",
                        "total",
                    )
                ]
                + ["yes" if p.fits else "no"]
                for s, n, p in preds
            ],
        ),
        "",
        f"### Communication, time and cost ({epochs:g} epochs of {dataset_size:,} samples)",
        "",
        _table(
            [
                "strategy",
                "N",
                "comm/step (MiB)",
                "comm time",
                "compute",
                "bubble",
                "step time",
                "samples/s",
                "train time",
                "cost (USD)",
            ],
            [
                [
                    STRATEGY_LABELS[s],
                    str(n),
                    f"{p.comm_bytes / MIB:,.1f}",
                    format_duration(p.comm_s),
                    format_duration(p.compute_s),
                    f"{p.bubble_fraction:.0%}",
                    format_duration(p.step_s),
                    f"{p.samples_per_s:,.1f}",
                    format_duration(train_time_s(p.samples_per_s, epochs, dataset_size)),
                    f"{cost_usd(n, train_time_s(p.samples_per_s, epochs, dataset_size) / 3600, usd):,.2f}",
                ]
                for s, n, p in preds
            ],
        ),
        "",
        f"### Largest parameter count that fits {a.device_memory_gib:g} GiB per device",
        "",
        "Activations and temporaries held at the measured values; a strategy becomes necessary once the "
        "model outgrows the row above it.",
        "",
        _table(
            ["strategy"] + [f"N = {n}" for n in ns],
            [
                [STRATEGY_LABELS[s]] + [_count(max_params_that_fit(spec, s, n, a)) for n in ns]
                for s in strategies
            ],
        ),
        "",
    ]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------



def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block): ``prog: error: --flag: why``."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = OneLineParser(
        prog="python -m modelwright plan",
        description="Predict per-device memory, communication, step time and cost of DP, ZeRO-1/2/3 (FSDP), "
        "TP and PP at N devices; prints Markdown.",
    )
    src = p.add_argument_group("the job (a record, or plain numbers)")
    src.add_argument("--record", help="records.jsonl to read the measured job from")
    src.add_argument(
        "--run-id", help="the record's run_id (default: first ok lightning record at world size 1)"
    )
    src.add_argument(
        "--params", type=_positive_int, help=f"parameter count (default {RESNET18_CIFAR_PARAMS:,})"
    )
    src.add_argument("--precision", choices=PRECISIONS + tuple(_PRECISION_ALIASES), help="default 32-true")
    src.add_argument("--optimizer", choices=OPTIMIZERS + tuple(_OPTIMIZER_ALIASES), help="default adamw")
    src.add_argument("--micro-batch-size", type=_positive_int, help="default: the record's")
    src.add_argument("--accumulate-grad-batches", type=_positive_int, help="default 1")
    src.add_argument(
        "--activation-mib-per-sample", type=float, help="default: the record's"
    )
    src.add_argument(
        "--step-time-ms",
        type=positive_float,
        help="single-device optimizer step; default: the record's",
    )
    src.add_argument("--num-layers", type=_positive_int, help="layers, to size a pipeline boundary")
    scale = p.add_argument_group("scale, network and price")
    scale.add_argument("--devices", type=_positive_int, nargs="+", default=[1, 8, 64], help="device counts N")
    scale.add_argument("--epochs", type=positive_float, default=100.0)
    scale.add_argument("--dataset-size", type=_positive_int, default=50_000)
    scale.add_argument(
        "--price-per-hour",
        type=positive_float,
        default=DEFAULT_USD_PER_DEVICE_HOUR,
        help=f"USD per device-hour (default {DEFAULT_USD_PER_DEVICE_HOUR:.2f}: {DEFAULT_DEVICE}, "
        f"{PRICE_DATE})",
    )
    scale.add_argument("--bus-bandwidth-gb-per-s", type=positive_float, default=50.0)
    scale.add_argument(
        "--overlap", type=_fraction, default=0.0, help="communication overlap fraction in [0, 1]"
    )
    scale.add_argument("--device-memory-gib", type=positive_float, default=80.0)
    scale.add_argument("--pp-microbatches", type=_positive_int, help="default 4 × stages")
    scale.add_argument("--pp-interleave", type=_positive_int, default=1)
    scale.add_argument(
        "--tp-activation-sharded-fraction", type=_fraction, default=TP_SHARDED_ACTIVATION_FRACTION
    )
    return p


def _spec_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> JobSpec:
    if args.record:
        try:
            record = load_record(args.record, args.run_id)
            spec = spec_from_record(record)
        except (OSError, ConfigError) as err:
            parser.error(str(err))
        except KeyError as err:
            parser.error(f"--record: {err.args[0]}")
    elif args.params is not None and args.activation_mib_per_sample is not None and args.step_time_ms is not None:
        if args.run_id:
            parser.error("--run-id: needs --record")
        spec = JobSpec(num_params=args.params, model_name="hypothetical", source="command-line numbers")
    else:
        default = default_records_file()
        if default is None:
            parser.error(
                "--record: no results/*/records.jsonl to read; run `python -m modelwright study` or give "
                "--record, or --params with --activation-mib-per-sample and --step-time-ms"
            )
        args.record = str(default)
        return _spec_from_args(args, parser)
    overrides = {
        "num_params": args.params,
        "precision": args.precision,
        "optimizer": args.optimizer,
        "micro_batch_size": args.micro_batch_size,
        "accumulate_grad_batches": args.accumulate_grad_batches,
        "step_time_ms": args.step_time_ms,
        "num_layers": args.num_layers,
    }
    if args.activation_mib_per_sample is not None:
        if args.activation_mib_per_sample < 0:
            parser.error("--activation-mib-per-sample: must be >= 0")
        overrides["activation_bytes_per_sample"] = args.activation_mib_per_sample * MIB
    if args.params is not None and spec.source != "command-line numbers":
        overrides["model_name"] = f"hypothetical, with the activations and step time of {spec.model_name}"
    try:
        return replace(spec, **{k: v for k, v in overrides.items() if v is not None})
    except ConfigError as err:
        parser.error(str(err))


def main(argv: Sequence[str] | None = None) -> int:
    """Print the planner's Markdown tables; bad arguments exit 2 with a one-line error naming the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    spec = _spec_from_args(args, parser)
    default_price = args.price_per_hour == DEFAULT_USD_PER_DEVICE_HOUR
    assumptions = Assumptions(
        bus_bandwidth_gb_per_s=args.bus_bandwidth_gb_per_s,
        overlap_fraction=args.overlap,
        usd_per_device_hour=args.price_per_hour,
        price_label=Assumptions().price_label if default_price else "given on the command line",
        device_memory_gib=args.device_memory_gib,
        pp_microbatches=args.pp_microbatches,
        pp_interleave=args.pp_interleave,
        tp_activation_sharded_fraction=args.tp_activation_sharded_fraction,
    )
    sys.stdout.write(markdown_tables(spec, args.devices, assumptions, args.epochs, args.dataset_size))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
