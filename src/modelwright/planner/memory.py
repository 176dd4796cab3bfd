"""Memory per rank: bytes per parameter, ZeRO/FSDP sharding, and the peak of a step predicted from one
profile."""

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from modelwright.errors import require
from modelwright.planner.step_profile import Segment, StepProfile, read_profile
from modelwright.record import get_path

MIB = 2**20


class Regime(NamedTuple):
    """Bytes per parameter of one precision: ``word`` per optimizer-state word, ``wire`` per gradient sent."""

    weights: int
    gradients: int
    master: int
    word: int
    wire: int
    description: str


# Torch autocast keeps fp32 weights and .grad and casts copies on the fly, so the persistent state of *-mixed
# runs is that of 32-true.
REGIMES = {
    "32-true": Regime(4, 4, 0, 4, 4, "fp32 weights, grads and optimizer state"),
    "bf16-mixed": Regime(4, 4, 0, 4, 4,
                         "torch autocast: fp32 weights and grads, 16-bit copies made on the fly"),
    "bf16-true": Regime(2, 2, 0, 2, 2, "weights, grads and optimizer state all in 16 bits"),
    "playbook-mixed": Regime(2, 2, 4, 4, 2,
                             "16-bit weights and grads, fp32 master weights and optimizer state"),
    "playbook-mixed-fp32-grads": Regime(2, 6, 4, 4, 4,
                                        "as playbook-mixed plus an fp32 gradient accumulation buffer"),
}
REGIMES["16-mixed"] = REGIMES["bf16-mixed"]
REGIMES["16-true"] = REGIMES["bf16-true"]
STATE_WORDS = {"adamw": 2, "sgd": 1, "sgd-nomomentum": 0}  # AdamW's two moments, SGD's momentum buffer
STRATEGIES = ("dp", "zero1", "zero2", "fsdp", "tp", "pp")
VALID_NAMES = {"precision": tuple(REGIMES), "optimizer": tuple(STATE_WORDS), "strategy": STRATEGIES}
# Lightning's names (and the short ones people type) for the planner's.
ALIASES = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed", "playbook": "playbook-mixed",
           "adam": "adamw", "auto": "dp", "ddp": "dp", "ddp_spawn": "dp", "single_device": "dp",
           "zero3": "fsdp", "fsdp2": "fsdp", "model_parallel": "fsdp", "deepspeed_stage_1": "zero1",
           "deepspeed_stage_2": "zero2", "deepspeed_stage_3": "fsdp"}


@dataclass(frozen=True)
class ParamStateBytes:
    """Bytes per parameter as ZeRO shards them: ``weights`` (ZeRO-3), ``gradients`` (an fp32 accumulation
    buffer included; ZeRO-2), ``optimizer`` (fp32 master weights included, ZeRO's k; ZeRO-1); ``grad_comm`` on
    the wire."""

    weights: float
    gradients: float
    optimizer: float
    grad_comm: float
    regime: str

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def normalize(key: str, name: object) -> str:
    """``name`` as one of the planner's ``key``s (precision, optimizer, strategy: aliases, Lightning's names
    and a strategy's ``{"class_path": ...}`` accepted); ConfigError naming ``key`` and the valid names if
    unknown."""
    if isinstance(name, Mapping):
        class_path = str(name.get("class_path", "")).lower()
        name = "fsdp" if "modelparallel" in class_path or "fsdp" in class_path else "dp"
    spelled = str(name).strip().lower()
    normalized = ALIASES.get(spelled, spelled)
    require(normalized in VALID_NAMES[key], f"{key}: unknown {name!r}; valid: {', '.join(VALID_NAMES[key])}")
    return normalized


def param_state_bytes(precision: str, optimizer: str) -> ParamStateBytes:
    regime = REGIMES[normalize("precision", precision)]
    words = STATE_WORDS[normalize("optimizer", optimizer)]
    return ParamStateBytes(regime.weights, regime.gradients, regime.master + regime.word * words, regime.wire,
                           regime.description)


def state_bytes_per_rank(num_params: float, state: ParamStateBytes, strategy: str,
                         devices: int) -> dict[str, float]:
    """Bytes of weights, gradients and optimizer state one rank holds (Rajbhandari et al. 2020, Figure 1): DP
    ``(w+g+k)Ψ`` · ZeRO-1 ``wΨ + gΨ + kΨ/N`` · ZeRO-2 ``wΨ + (g+k)Ψ/N`` · ZeRO-3/FSDP ``(w+g+k)Ψ/N``; TP and
    PP (pure, degree N) divide all three by N, assuming an even split."""
    # What each of weights, gradients and optimizer state is divided by.
    divisors = {"dp": (1, 1, 1), "zero1": (1, 1, devices), "zero2": (1, devices, devices)}
    weights_by, gradients_by, optimizer_by = divisors.get(normalize("strategy", strategy),
                                                          (devices, devices, devices))
    return {"parameters": state.weights * num_params / weights_by,
            "gradients": state.gradients * num_params / gradients_by,
            "optimizer_state": state.optimizer * num_params / optimizer_by}


def config_value(config: Mapping, key: str, default: object = None) -> object:
    """``key`` of a nested or dotted config (a dotted key wins, so overrides can be merged in)."""
    value = config.get(key, get_path(config, key, None))
    return default if value is None else value


@dataclass(frozen=True)
class StepSetup:
    """What the memory model reads from a config, relative to the profiled step."""

    precision: str
    optimizer: str
    state: ParamStateBytes
    accumulate: int
    granularity: str
    strategy: str
    ranks: int
    bucket_view: bool
    batch_ratio: float  # the micro-batch over the profiled batch
    optimizer_impl: str

    @property
    def autocast(self) -> bool:
        return self.precision.endswith("-mixed")

    @property
    def narrow(self) -> int:
        """What an fp32 tensor the step makes is divided by: 2 where it becomes a 16-bit one."""
        return 2 if self.autocast or self.state.weights == 2 else 1

    @property
    def shard(self) -> int:
        return self.ranks if self.strategy == "fsdp" else 1


def step_setup(profile: StepProfile, config: Mapping) -> StepSetup:
    """The config's precision, optimizer, accumulation, checkpointing, strategy and ranks, checked."""
    precision = normalize("precision", config_value(config, "trainer.precision", "32-true"))
    optimizer = normalize("optimizer", config_value(config, "model.optimizer", "adamw"))
    if optimizer == "sgd" and float(config_value(config, "model.momentum", 0.9)) == 0:
        optimizer = "sgd-nomomentum"
    granularity = str(config_value(config, "model.gradient_checkpointing", "off"))
    raw_strategy = config_value(config, "trainer.strategy", "auto")
    strategy = normalize("strategy", raw_strategy)
    devices = str(config_value(config, "trainer.devices", 1))
    ranks = (int(devices) if devices.isdigit() else 1) * int(config_value(config, "trainer.num_nodes", 1))
    init_args = (raw_strategy.get("init_args") or {}) if isinstance(raw_strategy, Mapping) else {}
    require(strategy in ("dp", "fsdp"),
            f"trainer.strategy: {strategy} memory needs a model split, not predicted")
    require(granularity == "off" or granularity in profile.segments,
            f"model.gradient_checkpointing: the profile has no {granularity!r} segments")
    batch = int(config_value(config, "data.batch_size", profile.batch_size))
    return StepSetup(precision=precision, optimizer=optimizer, state=param_state_bytes(precision, optimizer),
                     accumulate=int(config_value(config, "trainer.accumulate_grad_batches", 1)),
                     granularity=granularity, strategy=strategy, ranks=ranks,
                     bucket_view=bool(init_args.get("gradient_as_bucket_view")),
                     batch_ratio=batch / profile.batch_size,
                     optimizer_impl=str(config_value(config, "model.optimizer_impl", "auto")))


class PeakPoint(NamedTuple):
    """The bytes of one moment of the step that change from moment to moment."""

    gradients: float
    parameters: float
    activations: float
    temporaries: float

    @property
    def total(self) -> float:
        return self.gradients + self.parameters + self.activations + self.temporaries


class BackwardReplay:
    """The step's backward, unit by unit, rescaled from the profiled fp32 step for a :class:`StepSetup`."""

    def __init__(self, profile: StepProfile, setup: StepSetup) -> None:
        self.profile = profile
        self.setup = setup
        self.segments = profile.segments_of(setup.granularity)
        self.blocks = profile.segments_of("block")
        units = range(len(profile.units))
        # Each segment's first unit.
        self.first_unit = {self.segment_of(unit): unit for unit in reversed(units)}

    def segment_of(self, unit: int | None) -> int | None:
        """The checkpoint segment ``unit`` is in (None: outside every segment, or no checkpointing)."""
        if not self.segments or unit is None:
            return None
        return self.profile.units[unit].segments.get(self.setup.granularity)

    def saved_bytes(self, size: float, kind: str, dtype: str, owner: int | None) -> float:
        """What a saved storage of the profiled step costs this step."""
        setup = self.setup
        wide = 2 if dtype == "float32" else 1
        if kind == "batch":
            return size * setup.batch_ratio / (wide if setup.narrow == 2 else 1)
        if kind == "fixed":
            return size / (wide if setup.state.weights == 2 else 1)
        if kind == "cast":  # autocast's 16-bit copy of a weight
            return size / 2 if setup.autocast else 0.0
        if kind == "input":
            # The batch itself costs the step nothing; autocast's 16-bit copy of it for the first layer does
            # (owner None: a segment's input, not a module's saved tensor).
            first_layer = setup.autocast and owner is not None and self.profile.units[owner].type
            return size * setup.batch_ratio / 2 if first_layer else 0.0
        return 0.0  # a parameter saved as it is

    def kept_by_module(self, segment: Segment) -> bool:
        """Whether a module outside every segment saves this segment's input anyway."""
        return segment.input_owner is not None and self.segment_of(segment.input_owner) is None

    def saved_alive(self, unit: int) -> float:
        """Saved tensors alive at ``unit`` in backward: everything saved up to it outside checkpointed
        segments, its own segment recomputed, and the inputs of the segments started so far."""
        segment = self.segment_of(unit)
        saved = sum(self.saved_bytes(storage.bytes, storage.kind, storage.dtype, storage.owner)
                    for storage in self.profile.storages
                    if storage.owner <= unit and self.segment_of(storage.owner) in (None, segment))
        saved += sum(self.saved_bytes(entry.input_bytes, entry.input_kind, "float32", None)
                     for index, entry in enumerate(self.segments)
                     if self.first_unit.get(index, math.inf) <= unit and not self.kept_by_module(entry))
        return saved

    def profiled_alive(self, unit: int) -> int:
        """The batch and per-channel storages of the profile alive at ``unit``."""
        return sum(storage.bytes for storage in self.profile.storages
                   if storage.owner <= unit and storage.kind in ("batch", "fixed"))

    def gathered_bytes(self, unit: int) -> float:
        """FSDP2: the block running and the one prefetched (the previous one, in backward), gathered whole."""
        block = self.profile.units[unit].segments.get("block")
        if self.setup.shard == 1 or block is None:
            return 0.0
        gathered = sum(self.blocks[i].param_bytes for i in (block, block - 1) if i >= 0)
        return gathered * self.setup.state.weights / 4

    def point(self, unit: int) -> PeakPoint:
        setup = self.setup
        backward = self.profile.units[unit].backward
        if setup.accumulate > 1:
            gradients = self.profile.parameters * setup.state.gradients
        else:
            gradients = backward.gradients * setup.state.gradients / 4
        # What MemTracker saw beyond the saved tensors the profile charged (views, outputs held by autograd).
        unprofiled = max(0.0, backward.activations - self.profiled_alive(unit))
        return PeakPoint(gradients=gradients / setup.shard, parameters=self.gathered_bytes(unit),
                         activations=self.saved_alive(unit) + unprofiled * setup.batch_ratio / setup.narrow,
                         temporaries=backward.temporaries * setup.batch_ratio / setup.narrow)

    def points(self) -> list[PeakPoint]:
        return [self.point(unit) for unit, entry in enumerate(self.profile.units) if entry.backward]


def update_point(profile: StepProfile, setup: StepSetup) -> PeakPoint:
    """The optimizer update: every gradient, plus foreach's copy of all weights or the for-loop's largest
    one."""
    state = setup.state
    if setup.optimizer_impl == "fused":
        temporaries = 0.0
    elif setup.optimizer_impl == "foreach":
        temporaries = profile.parameters * state.weights / setup.shard
    else:
        temporaries = profile.largest_param_bytes * state.weights / 4
    if setup.optimizer == "sgd-nomomentum":
        temporaries = 0.0
    return PeakPoint(gradients=profile.parameters * state.gradients / setup.shard, parameters=0.0,
                     activations=0.0, temporaries=temporaries)


def resident_bytes(profile: StepProfile, setup: StepSetup) -> dict[str, float]:
    """What the whole step holds: the (sharded) weights and optimizer state, buffers, DDP's gradient
    buckets."""
    state = setup.state
    sharded = state_bytes_per_rank(profile.parameters, state, "fsdp", setup.shard)
    buckets = setup.strategy == "dp" and setup.ranks > 1 and not setup.bucket_view
    return {"parameters": sharded["parameters"], "buffers": profile.peak_bytes["buffers"],
            "optimizer_state": sharded["optimizer_state"],
            "comm_buffers": profile.parameters * state.grad_comm if buckets else 0.0}


CATEGORIES = ("parameters", "buffers", "gradients", "optimizer_state", "activations", "temporaries",
              "comm_buffers")


def predict_peak_mib(profile_record: Mapping, config: Mapping) -> dict[str, float]:
    """One rank's peak tensor memory (MiB by category, and ``total``) under ``config`` (docs/distributed.md),
    from the ``profile`` of one fp32 step (or a record holding it), by replaying backward: at each module's
    peak, parameters + optimizer state + gradients so far + saved tensors not yet released + temporaries
    there, rescaled for ``config``."""
    profile = read_profile(profile_record)
    setup = step_setup(profile, config)
    points = [*BackwardReplay(profile, setup).points(), update_point(profile, setup)]
    peak = max(points, key=lambda point: point.total)._asdict()
    resident = resident_bytes(profile, setup)
    by_category = {key: (resident.get(key, 0.0) + peak.get(key, 0.0)) / MIB for key in CATEGORIES}
    return {**by_category, "total": sum(by_category.values())}


def largest_batch(profile_record: Mapping, config: Mapping, budget_mib: float) -> int:
    """The largest per-rank micro-batch whose predicted peak fits ``budget_mib`` (0 if not even one
    sample)."""

    def over_budget(batch: int) -> bool:
        return predict_peak_mib(profile_record, {**config, "data.batch_size": batch})["total"] > budget_mib

    # The peak grows with the batch, so the batches up to 2^25 that fit come first: count them by bisection.
    best = bisect.bisect_left(range(1, 2**25 + 1), True, key=over_budget)
    require(best < 2**25, "budget_mib: fits more than 16 M samples; is the budget in MiB?")
    return best

