"""Memory per rank: bytes per parameter, ZeRO/FSDP sharding, and what the predicted peak (:mod:`.peak`) reads
from a config."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from modelwright.errors import require
from modelwright.planner.step_profile import StepProfile
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
    channels_last: bool = False

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

    @property
    def channels_last_copy(self) -> bool:
        """Whether the LightningModule copies each NCHW batch to channels-last (FSDP2 runs NCHW instead: it
        shards contiguous parameters only)."""
        return self.channels_last and self.strategy != "fsdp"


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
    optimizer_impl = str(config_value(config, "model.optimizer_impl", "auto"))
    if optimizer_impl == "auto" and str(config_value(config, "trainer.accelerator", "")) in ("cuda", "gpu"):
        optimizer_impl = "foreach"  # torch.optim's choice for CUDA parameters (_default_to_fused_or_foreach)
    return StepSetup(precision=precision, optimizer=optimizer, state=param_state_bytes(precision, optimizer),
                     accumulate=int(config_value(config, "trainer.accumulate_grad_batches", 1)),
                     granularity=granularity, strategy=strategy, ranks=ranks,
                     bucket_view=bool(init_args.get("gradient_as_bucket_view")),
                     batch_ratio=batch / profile.batch_size,
                     optimizer_impl=optimizer_impl,
                     channels_last=bool(config_value(config, "model.channels_last", False)))
