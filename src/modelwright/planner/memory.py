"""Memory per rank: bytes per parameter, ZeRO/FSDP sharding, and the peak of a step predicted from one profile."""

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass

from modelwright.errors import require
from modelwright.record import get_path

MIB = 2**20
# (weights, grads, master copy, bytes per optimizer-state word, grads on the wire, regime). Torch autocast keeps fp32
# weights and .grad and casts copies on the fly, so the persistent state of *-mixed runs is that of 32-true.
_REGIMES = {
    "32-true": (4, 4, 0, 4, 4, "fp32 weights, grads and optimizer state"),
    "bf16-mixed": (4, 4, 0, 4, 4, "torch autocast: fp32 weights and grads, 16-bit copies made on the fly"),
    "bf16-true": (2, 2, 0, 2, 2, "weights, grads and optimizer state all in 16 bits"),
    "playbook-mixed": (2, 2, 4, 4, 2, "16-bit weights and grads, fp32 master weights and optimizer state"),
    "playbook-mixed-fp32-grads": (2, 6, 4, 4, 4, "as playbook-mixed plus an fp32 gradient accumulation buffer"),
}
_REGIMES["16-mixed"], _REGIMES["16-true"] = _REGIMES["bf16-mixed"], _REGIMES["bf16-true"]
_STATE_WORDS = {"adamw": 2, "sgd": 1, "sgd-nomomentum": 0}  # AdamW's two moments, SGD's momentum buffer
STRATEGIES = ("dp", "zero1", "zero2", "fsdp", "tp", "pp")
_VALID = {"precision": tuple(_REGIMES), "optimizer": tuple(_STATE_WORDS), "strategy": STRATEGIES}
# Lightning's names (and the short ones people type) for the planner's.
_ALIASES = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed", "playbook": "playbook-mixed", "adam": "adamw",
            "auto": "dp", "ddp": "dp", "ddp_spawn": "dp", "single_device": "dp", "zero3": "fsdp", "fsdp2": "fsdp",
            "model_parallel": "fsdp", "deepspeed_stage_1": "zero1", "deepspeed_stage_2": "zero2",
            "deepspeed_stage_3": "fsdp"}


@dataclass(frozen=True)
class ParamStateBytes:
    """Bytes per parameter as ZeRO shards them: ``weights`` (ZeRO-3), ``gradients`` (an fp32 accumulation buffer
    included; ZeRO-2), ``optimizer`` (fp32 master weights included, ZeRO's k; ZeRO-1); ``grad_comm`` on the wire."""

    weights: float
    gradients: float
    optimizer: float
    grad_comm: float
    regime: str

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def normalize(key: str, name: object) -> str:
    """``name`` as one of the planner's ``key``s (precision, optimizer, strategy: aliases, Lightning's names and a
    strategy's ``{"class_path": ...}`` accepted); ConfigError naming ``key`` and the valid names if unknown."""
    if isinstance(name, Mapping):
        path = str(name.get("class_path", "")).lower()
        name = "fsdp" if "modelparallel" in path or "fsdp" in path else "dp"
    n = _ALIASES.get(str(name).strip().lower(), str(name).strip().lower())
    require(n in _VALID[key], f"{key}: unknown {name!r}; valid: {', '.join(_VALID[key])}")
    return n


def param_state_bytes(precision: str, optimizer: str) -> ParamStateBytes:
    weights, grads, master, word, wire, regime = _REGIMES[normalize("precision", precision)]
    words = _STATE_WORDS[normalize("optimizer", optimizer)]
    return ParamStateBytes(weights, grads, master + word * words, wire, regime)


def state_bytes_per_rank(num_params: float, state: ParamStateBytes, strategy: str, devices: int) -> dict[str, float]:
    """Bytes of weights, gradients and optimizer state one rank holds (Rajbhandari et al. 2020, Figure 1): DP
    ``(w+g+k)Ψ`` · ZeRO-1 ``wΨ + gΨ + kΨ/N`` · ZeRO-2 ``wΨ + (g+k)Ψ/N`` · ZeRO-3/FSDP ``(w+g+k)Ψ/N``; TP and PP
    (pure, degree N) divide all three by N, assuming an even split."""
    n = devices
    shard = {"dp": (1, 1, 1), "zero1": (1, 1, n), "zero2": (1, n, n)}.get(normalize("strategy", strategy), (n, n, n))
    return {"parameters": state.weights * num_params / shard[0], "gradients": state.gradients * num_params / shard[1],
            "optimizer_state": state.optimizer * num_params / shard[2]}


def _cfg(config: Mapping, key: str, default: object = None) -> object:
    """``key`` of a nested or dotted config (a dotted key wins, so overrides can be merged in)."""
    value = config.get(key, get_path(config, key, None))
    return default if value is None else value


def predict_peak_mib(profile_record: Mapping, config: Mapping) -> dict[str, float]:
    """One rank's peak tensor memory (MiB by category, and ``total``) under ``config`` (docs/distributed.md), from the
    ``profile`` of one fp32 step (or a record holding it), by replaying backward: at each module's peak, parameters +
    optimizer state + gradients so far + saved tensors not yet released + temporaries there, rescaled for ``config``."""
    prof = profile_record.get("profile", profile_record)
    require(isinstance(prof, Mapping) and "units" in prof, "profile_record: has no 'profile' (profile a baseline step)")
    precision = normalize("precision", _cfg(config, "trainer.precision", "32-true"))
    optimizer = normalize("optimizer", _cfg(config, "model.optimizer", "adamw"))
    if optimizer == "sgd" and float(_cfg(config, "model.momentum", 0.9)) == 0:
        optimizer = "sgd-nomomentum"
    state = param_state_bytes(precision, optimizer)
    accumulate = int(_cfg(config, "trainer.accumulate_grad_batches", 1))
    granularity = str(_cfg(config, "model.gradient_checkpointing", "off"))
    raw = _cfg(config, "trainer.strategy", "auto")
    strategy, devices = normalize("strategy", raw), str(_cfg(config, "trainer.devices", 1))
    n = (int(devices) if devices.isdigit() else 1) * int(_cfg(config, "trainer.num_nodes", 1))
    bucket_view = isinstance(raw, Mapping) and bool((raw.get("init_args") or {}).get("gradient_as_bucket_view"))
    require(strategy in ("dp", "fsdp"), f"trainer.strategy: {strategy} memory needs a model split, not predicted")
    require(granularity == "off" or granularity in prof["segments"],
            f"model.gradient_checkpointing: the profile has no {granularity!r} segments")
    r = int(_cfg(config, "data.batch_size", prof["batch_size"])) / prof["batch_size"]
    autocast, half = precision.endswith("-mixed"), state.weights == 2
    narrow = 2 if autocast or half else 1  # fp32 tensors a step makes become 16-bit ones
    psi, units, storages = prof["parameters"], prof["units"], prof["storages"]
    segs, blocks = prof["segments"].get(granularity, []), prof["segments"].get("block", [])
    shard = n if strategy == "fsdp" else 1

    def seg_of(u: int | None) -> int | None:
        return units[u]["segments"].get(granularity) if segs and u is not None else None

    def act_bytes(size: float, kind: str, dtype: str, owner: int | None) -> float:
        wide = 2 if dtype == "float32" else 1
        # Parameters saved as they are and the batch itself cost the step nothing; autocast's 16-bit copy of the
        # batch for the first layer does (owner None: a segment's input, not a module's saved tensor).
        first_layer = autocast and owner is not None and units[owner]["type"]
        return {"batch": size * r / (wide if narrow == 2 else 1), "fixed": size / (wide if half else 1),
                "cast": size / 2 if autocast else 0.0, "input": size * r / 2 if first_layer else 0.0}.get(kind, 0.0)

    first = {seg_of(u): u for u in reversed(range(len(units)))}  # each segment's first unit
    points = []
    for u, unit in enumerate(units):
        if not (bw := unit.get("backward")):
            continue
        # Saved tensors alive at unit u in backward: everything saved up to u outside checkpointed segments, u's own
        # segment recomputed, and the inputs of the segments started so far (unless a module keeps them anyway).
        saved = sum(act_bytes(size, kind, dtype, owner) for owner, size, kind, dtype in storages
                    if owner <= u and seg_of(owner) in (None, seg_of(u)))
        saved += sum(act_bytes(seg["input_bytes"], seg["input_kind"], "float32", None) for j, seg in enumerate(segs)
                     if first.get(j, math.inf) <= u
                     and not (seg["input_owner"] is not None and seg_of(seg["input_owner"]) is None))
        # What MemTracker saw beyond the saved tensors the profile charged (views, outputs held by autograd).
        profiled = sum(size for owner, size, kind, _ in storages if owner <= u and kind in ("batch", "fixed"))
        grads = psi * state.gradients if accumulate > 1 else bw["gradients"] * state.gradients / 4
        b = unit["segments"].get("block")
        gathered = 0.0  # FSDP2: the block running and the one prefetched (the previous one, in backward)
        if shard > 1 and b is not None:
            gathered = sum(blocks[i]["param_bytes"] for i in (b, b - 1) if i >= 0) * state.weights / 4
        points.append({"gradients": grads / shard, "parameters": gathered,
                       "activations": saved + max(0.0, bw["activations"] - profiled) * r / narrow,
                       "temporaries": bw["temporaries"] * r / narrow})
    # The optimizer update: every gradient, plus foreach's copy of all weights or the for-loop's largest one.
    update_temp = {"fused": 0.0, "foreach": psi * state.weights / shard}.get(
        str(_cfg(config, "model.optimizer_impl", "auto")), prof["largest_param_bytes"] * state.weights / 4)
    points.append({"gradients": psi * state.gradients / shard, "activations": 0.0, "parameters": 0.0,
                   "temporaries": update_temp if optimizer != "sgd-nomomentum" else 0.0})
    fixed = state_bytes_per_rank(psi, state, "fsdp", shard)
    base = {"parameters": fixed["parameters"], "buffers": prof["peak_bytes"]["buffers"],
            "optimizer_state": fixed["optimizer_state"],
            "comm_buffers": psi * state.grad_comm if strategy == "dp" and n > 1 and not bucket_view else 0.0}
    best = max(points, key=lambda p: sum(p.values()))
    out = {k: (base.get(k, 0.0) + best.get(k, 0.0)) / MIB for k in
           ("parameters", "buffers", "gradients", "optimizer_state", "activations", "temporaries", "comm_buffers")}
    return {**out, "total": sum(out.values())}


def largest_batch(profile_record: Mapping, config: Mapping, budget_mib: float) -> int:
    """The largest per-rank micro-batch whose predicted peak fits ``budget_mib`` (0 if not even one sample)."""
    # The peak grows with the batch, so the batches up to 2^25 that fit come first: count them by bisection.
    best = bisect.bisect_left(range(1, 2**25 + 1), True, key=lambda b: predict_peak_mib(
        profile_record, {**config, "data.batch_size": b})["total"] > budget_mib)
    require(best < 2**25, "budget_mib: fits more than 16 M samples; is the budget in MiB?")
    return best
