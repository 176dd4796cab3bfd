"""Memory per rank: bytes per parameter, ZeRO/FSDP sharding, and the peak of a step predicted from one profile.

:func:`predict_peak_mib` replays the backward pass of a profiled fp32 baseline step
(:func:`modelwright.measure.profile.profile_step`) under another configuration, module by module: at each module's
peak in backward the live memory is parameters + optimizer state + the gradients made so far + the saved tensors
not yet released + the temporaries measured there, each rescaled for batch, precision, checkpointing, accumulation,
optimizer and strategy. The peak is the largest of these points and of the optimizer update. Nothing measured in the
configuration being predicted enters the prediction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from modelwright.errors import ConfigError, require
from modelwright.record import get_path

MIB, GIB, GB = 2**20, 2**30, 1e9


@dataclass(frozen=True)
class ParamStateBytes:
    """Bytes per parameter, split the way ZeRO shards them.

    Attributes:
        weights: what the forward reads (what ZeRO-3 all-gathers).
        gradients: gradient storage, an fp32 accumulation buffer included (what ZeRO-2 shards).
        optimizer: optimizer state, fp32 master weights included (ZeRO's k; what ZeRO-1 shards).
        grad_comm: bytes per gradient element on the wire.
        regime: which training regime this is.
    """

    weights: float
    gradients: float
    optimizer: float
    grad_comm: float
    regime: str

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "playbook-mixed",
              "playbook-mixed-fp32-grads")
OPTIMIZERS = ("adamw", "sgd", "sgd-nomomentum")
_ALIASES = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed", "playbook": "playbook-mixed", "adam": "adamw",
            "sgd-momentum": "sgd", "sgd_nomomentum": "sgd-nomomentum"}
#: Optimizer state per parameter in the training dtype's words: AdamW two moments, SGD one momentum buffer.
_STATE_WORDS = {"adamw": 2, "sgd": 1, "sgd-nomomentum": 0}
# (weights, grads, master copy, state word, grads on the wire, regime); torch autocast keeps fp32 weights and fp32
# .grad and casts copies on the fly, so the persistent state of *-mixed runs is that of 32-true.
_REGIMES = {
    "32-true": (4, 4, 0, 4, 4, "fp32 weights, grads and optimizer state"),
    "bf16-mixed": (4, 4, 0, 4, 4, "torch autocast: fp32 weights and grads, 16-bit copies made on the fly"),
    "bf16-true": (2, 2, 0, 2, 2, "weights, grads and optimizer state all in 16 bits"),
    "playbook-mixed": (2, 2, 4, 4, 2, "16-bit weights and grads, fp32 master weights and optimizer state"),
    "playbook-mixed-fp32-grads": (2, 6, 4, 4, 4, "as playbook-mixed plus an fp32 gradient accumulation buffer"),
}
_REGIMES["16-mixed"], _REGIMES["16-true"] = _REGIMES["bf16-mixed"], _REGIMES["bf16-true"]
PARAM_STATE_BYTES: dict[tuple[str, str], ParamStateBytes] = {
    (p, o): ParamStateBytes(w, g, master + word * _STATE_WORDS[o], wire, regime)
    for p, (w, g, master, word, wire, regime) in _REGIMES.items() for o in OPTIMIZERS
}
"""Bytes per parameter by (precision, optimizer): 32-true AdamW 4 + 4 + 8 = 16; the ZeRO paper's mixed-precision
Adam (``playbook-mixed``) 2 + 2 + 12 = 16 (k = 12)."""


def _normalize(name: str, valid: tuple[str, ...], key: str) -> str:
    n = _ALIASES.get(str(name).strip().lower(), str(name).strip().lower())
    require(n in valid, f"{key}: unknown {name!r}; valid: {', '.join(valid)}")
    return n


def normalize_precision(precision: str) -> str:
    return _normalize(precision, PRECISIONS, "precision")


def normalize_optimizer(optimizer: str) -> str:
    return _normalize(optimizer, OPTIMIZERS, "optimizer")


def param_state_bytes(precision: str, optimizer: str) -> ParamStateBytes:
    """The bytes-per-parameter entry for a (precision, optimizer) pair; aliases accepted."""
    return PARAM_STATE_BYTES[(normalize_precision(precision), normalize_optimizer(optimizer))]


STRATEGIES = ("dp", "zero1", "zero2", "fsdp", "tp", "pp")
STRATEGY_LABELS = {"dp": "DP (DDP)", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "fsdp": "ZeRO-3 / FSDP", "tp": "TP",
                   "pp": "PP"}
_STRATEGY_ALIASES = {"auto": "dp", "ddp": "dp", "ddp_spawn": "dp", "single_device": "dp", "zero3": "fsdp",
                     "fsdp2": "fsdp", "model_parallel": "fsdp", "deepspeed_stage_1": "zero1",
                     "deepspeed_stage_2": "zero2", "deepspeed_stage_3": "fsdp"}


def normalize_strategy(strategy: object) -> str:
    """A planner or Lightning strategy (a name, or ``{"class_path": ...}``) to one of :data:`STRATEGIES`."""
    if isinstance(strategy, Mapping):
        path = str(strategy.get("class_path", "")).lower()
        strategy = "fsdp" if "modelparallel" in path or "fsdp" in path else "dp"
    name = str(strategy).strip().lower()
    return _normalize(_STRATEGY_ALIASES.get(name, name), STRATEGIES, "strategy")


def check_devices(devices: int) -> int:
    require(int(devices) == devices and devices >= 1, f"devices: must be an integer >= 1, got {devices!r}")
    return int(devices)


def state_bytes_per_rank(num_params: float, state: ParamStateBytes, strategy: str, devices: int) -> dict[str, float]:
    """Bytes of weights, gradients and optimizer state one rank holds (Rajbhandari et al. 2020, Figure 1).

    DP ``(w+g+k)Ψ`` · ZeRO-1 ``wΨ + gΨ + kΨ/N`` · ZeRO-2 ``wΨ + (g+k)Ψ/N`` · ZeRO-3/FSDP ``(w+g+k)Ψ/N``; TP and PP
    (pure, degree N) divide all three by N, assuming an even split.
    """
    n = check_devices(devices)
    shard = {"dp": (1, 1, 1), "zero1": (1, 1, n), "zero2": (1, n, n)}.get(normalize_strategy(strategy), (n, n, n))
    return {"parameters": state.weights * num_params / shard[0], "gradients": state.gradients * num_params / shard[1],
            "optimizer_state": state.optimizer * num_params / shard[2]}


# --- the peak of a step, from a profile ------------------------------------------------------------------------


def _cfg(config: Mapping, key: str, default: object = None) -> object:
    value = config.get(key, get_path(config, key, None))
    return default if value is None else value


def strategy_of(config: Mapping) -> tuple[str, int, bool]:
    """``(strategy, devices, gradient_as_bucket_view)`` of a resolved run config."""
    raw = _cfg(config, "trainer.strategy", "auto")
    devices = _cfg(config, "trainer.devices", 1)
    devices = int(devices) if str(devices).isdigit() else 1
    nodes = int(_cfg(config, "trainer.num_nodes", 1))
    view = bool(raw.get("init_args", {}).get("gradient_as_bucket_view", False)) if isinstance(raw, Mapping) else False
    return normalize_strategy(raw), devices * nodes, view


def predict_peak_mib(profile_record: Mapping, config: Mapping) -> dict[str, float]:
    """The peak tensor memory of one rank's step under ``config``, predicted from a baseline profile alone.

    Args:
        profile_record: a run record with a ``profile`` (or the profile itself): one fp32 step without
            checkpointing, see :func:`modelwright.measure.profile.profile_step`.
        config: a resolved run config, nested or dotted: ``data.batch_size`` (per rank), ``trainer.precision``,
            ``trainer.accumulate_grad_batches``, ``trainer.strategy``, ``trainer.devices``, ``model.optimizer``,
            ``model.momentum``, ``model.optimizer_impl``, ``model.gradient_checkpointing``.

    Returns:
        MiB by category at the predicted peak, and ``"total"``. DDP's gradient buckets (4 B × parameters, as
        ``gradient_as_bucket_view: false``, Lightning's default) are ``comm_buffers``; under FSDP2 the gathered
        blocks (the one running and the one prefetched) are in ``parameters``.
    """
    prof = profile_record.get("profile", profile_record)
    require(isinstance(prof, Mapping) and "units" in prof, "profile_record: has no 'profile' (profile a baseline step)")
    precision = normalize_precision(str(_cfg(config, "trainer.precision", "32-true")))
    optimizer = normalize_optimizer(str(_cfg(config, "model.optimizer", "adamw")))
    if optimizer == "sgd" and float(_cfg(config, "model.momentum", 0.9)) == 0:
        optimizer = "sgd-nomomentum"
    state = PARAM_STATE_BYTES[(precision, optimizer)]
    batch = int(_cfg(config, "data.batch_size", prof["batch_size"]))
    accumulate = int(_cfg(config, "trainer.accumulate_grad_batches", 1))
    granularity = str(_cfg(config, "model.gradient_checkpointing", "off"))
    strategy, n, bucket_view = strategy_of(config)
    require(strategy in ("dp", "fsdp"), f"trainer.strategy: {strategy} memory needs a model split, not predicted")
    require(granularity == "off" or granularity in prof["segments"],
            f"model.gradient_checkpointing: the profile has no {granularity!r} segments")
    r = batch / prof["batch_size"]
    autocast, half = precision.endswith("-mixed"), state.weights == 2
    psi = prof["parameters"]
    units = prof["units"]
    segs = prof["segments"].get(granularity, []) if granularity != "off" else []

    def act_bytes(size: float, kind: str, dtype: str, owner: int | None, as_profiled: bool = False) -> float:
        if as_profiled:
            return size if kind in ("batch", "fixed") else 0.0
        wide = dtype == "float32" and (autocast or half)
        if kind == "batch":
            return size * r / (2 if wide else 1)
        if kind == "fixed":
            return size / (2 if wide and half else 1)
        if kind == "cast":
            return size / 2 if autocast else 0.0
        if kind == "input" and autocast and owner is not None and units[owner]["type"] != "":
            return size * r / 2  # autocast's 16-bit copy of the batch for the first layer
        return 0.0

    def seg_of(u: int) -> int | None:
        return units[u]["segments"].get(granularity) if segs else None

    first = {}
    for u in range(len(units)):
        first.setdefault(seg_of(u), u)

    def activations(u: int, ckpt: bool, as_profiled: bool = False) -> float:
        k, total = seg_of(u) if ckpt else None, 0.0
        for owner, size, kind, dtype in prof["storages"]:
            s = seg_of(owner) if ckpt else None
            if owner <= u and (s is None or s == k):
                total += act_bytes(size, kind, dtype, owner, as_profiled)
        for j, seg in enumerate(segs if ckpt else []):
            kept_elsewhere = seg["input_owner"] is not None and seg_of(seg["input_owner"]) is None
            if first.get(j, math.inf) <= u and not kept_elsewhere:
                total += act_bytes(seg["input_bytes"], seg["input_kind"], "float32", None)
        return total

    fsdp = strategy == "fsdp" and n > 1
    blocks = prof["segments"].get("block", [])
    points = []
    for u, unit in enumerate(units):
        bw = unit.get("backward")
        if not bw:
            continue
        residual = max(0.0, bw["activations"] - activations(u, False, as_profiled=True))
        grads = psi * state.gradients if accumulate > 1 else bw["gradients"] * state.gradients / 4
        gathered = 0.0
        b = unit["segments"].get("block")
        if fsdp and b is not None:  # the running block and the one prefetched (the previous one in backward)
            gathered = sum(blocks[i]["param_bytes"] for i in (b, b - 1) if i >= 0) * state.weights / 4
        points.append({
            "gradients": grads / n if fsdp else grads,
            "activations": activations(u, bool(segs)) + residual * r / (2 if autocast or half else 1),
            "temporaries": bw["temporaries"] * r / (2 if autocast or half else 1),
            "parameters": gathered,
        })
    largest = prof["largest_param_bytes"] * state.weights / 4
    impl = str(_cfg(config, "model.optimizer_impl", "auto"))
    update_temp = {"fused": 0.0, "foreach": psi * state.weights / (n if fsdp else 1)}.get(impl, largest)
    points.append({"gradients": psi * state.gradients / (n if fsdp else 1), "activations": 0.0,
                   "temporaries": update_temp if optimizer != "sgd-nomomentum" else 0.0, "parameters": 0.0})
    fixed = state_bytes_per_rank(psi, state, "fsdp" if fsdp else "dp", n)
    base = {"parameters": fixed["parameters"], "buffers": prof["peak_bytes"]["buffers"],
            "optimizer_state": fixed["optimizer_state"],
            "comm_buffers": psi * state.grad_comm if strategy == "dp" and n > 1 and not bucket_view else 0.0}
    best = max(points, key=lambda p: sum(p.values()))
    out = {k: base.get(k, 0.0) + best.get(k, 0.0) for k in
           ("parameters", "buffers", "gradients", "optimizer_state", "activations", "temporaries", "comm_buffers")}
    out = {k: v / MIB for k, v in out.items()}
    out["total"] = sum(out.values())
    return out


def largest_batch(profile_record: Mapping, config: Mapping, budget_mib: float) -> int:
    """The largest per-rank micro-batch whose predicted peak fits ``budget_mib`` (0 if not even one sample)."""
    def fits(b: int) -> bool:
        return predict_peak_mib(profile_record, {**_flat(config), "data.batch_size": b})["total"] <= budget_mib

    if not fits(1):
        return 0
    hi = 1
    while fits(hi * 2):
        hi *= 2
        if hi > 2**24:
            raise ConfigError("budget_mib: fits more than 16 M samples; is the budget in MiB?")
    lo, hi = hi, hi * 2  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _flat(config: Mapping, prefix: str = "") -> dict[str, object]:
    """A nested config as dotted keys (``{"data.batch_size": 64}``)."""
    out: dict[str, object] = {}
    for k, v in config.items():
        if isinstance(v, Mapping) and k != "strategy" and not str(k).endswith("strategy"):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
