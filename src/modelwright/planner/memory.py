"""Memory per rank: the peak of a config predicted by rehearsing its step
(:mod:`modelwright.measure.rehearsal`, :mod:`modelwright.train.rehearse`), and bytes per parameter as ZeRO and
FSDP shard them at N ranks (the scale model's), from the techniques' tables."""

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from modelwright.errors import require
from modelwright.record import get_path, with_values
from modelwright.techniques import OPTIMIZERS, PRECISIONS, precision

MIB = 2**20
#: An optimizer's state words per parameter where its state is as wide as the parameters (Adafactor's
#: factored state depends on the shapes: the scale model reads it from a record, as measured).
STATE_WORDS = {"adamw": 2, "sgd": 1, "sgd-nomomentum": 0}
STRATEGIES = ("dp", "zero1", "zero2", "fsdp", "tp", "pp")
# Lightning's names (and the short ones people type) for the planner's.
ALIASES = {"adam": "adamw", "auto": "dp", "ddp": "dp", "ddp_spawn": "dp", "single_device": "dp",
           "zero3": "fsdp", "fsdp2": "fsdp", "model_parallel": "fsdp", "deepspeed_stage_1": "zero1",
           "deepspeed_stage_2": "zero2", "deepspeed_stage_3": "fsdp"}
VALID_NAMES = {"optimizer": tuple(dict.fromkeys((*STATE_WORDS, *OPTIMIZERS))), "strategy": STRATEGIES}


def normalize(key: str, name: object) -> str:
    """``name`` as one of the planner's ``key``s (precision, optimizer, strategy: aliases, Lightning's names
    and a strategy's ``{"class_path": ...}`` accepted); ConfigError naming ``key`` and the valid names if
    unknown."""
    if key == "precision":
        return precision(name, key).name
    if key == "strategy" and isinstance(name, Mapping):
        class_path = str(name.get("class_path", "")).lower()
        name = "fsdp" if "modelparallel" in class_path or "fsdp" in class_path else "dp"
    spelled = str(name).strip().lower()
    normalized = ALIASES.get(spelled, spelled)
    require(normalized in VALID_NAMES[key], f"{key}: unknown {name!r}; valid: {', '.join(VALID_NAMES[key])}")
    return normalized


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


def param_state_bytes(precision_name: str, optimizer: str,
                      optimizer_bytes: float | None = None) -> ParamStateBytes:
    """Bytes per parameter of ``precision_name`` (:data:`~modelwright.techniques.PRECISIONS`) with
    ``optimizer``: its state words at the precision's word size, or ``optimizer_bytes`` per parameter where
    given (a record's measured state: Adafactor's factored moments)."""
    regime = PRECISIONS[normalize("precision", precision_name)]
    name = normalize("optimizer", optimizer)
    if optimizer_bytes is None:
        require(name in STATE_WORDS, f"optimizer: {name}'s state depends on the parameters' shapes; plan "
                "from a record of it (its measured optimizer state)")
        optimizer_bytes = regime.word * STATE_WORDS[name]
    return ParamStateBytes(regime.weights, regime.gradients, regime.master + optimizer_bytes, regime.wire,
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


# --- the peak of a config, by rehearsal ----------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _rehearsal(config_json: str) -> Any:
    from modelwright.train.rehearse import rehearse  # torch and Lightning: only once a step is rehearsed

    return rehearse(json.loads(config_json))


#: The project's data modules' sizes a rehearsal sets: a batch of 4 (the rehearsal cuts its own micro-batches
#: from it) and no more samples than it needs.
REHEARSAL_DATA = {"data.batch_size": 4, "data.train_size": 64, "data.val_size": 4}
#: The most micro-batches a step is rehearsed with. The first micro-batch of a step makes the gradients and
#: the last one updates; those between repeat what the second holds (its activations over the gradients), so a
#: step of two stands for a step of any number, at a fraction of the time
#: (tests/test_predict.py checks 4 and 8).
REHEARSED_ACCUMULATION = 2


def rehearsal(config: Mapping) -> Any:
    """The :class:`~modelwright.measure.rehearsal.Rehearsal` of ``config``'s step (at any batch size: the
    micro-batches are the rehearsal's own), made once per config in this process."""
    known = {key: value for key, value in REHEARSAL_DATA.items() if get_path(config, key) is not None}
    accumulate = int(get_path(config, "trainer.accumulate_grad_batches", 1) or 1)
    known["trainer.accumulate_grad_batches"] = min(accumulate, REHEARSED_ACCUMULATION)
    # Nothing is logged in a rehearsal: jobs that differ in their logger alike.
    known["trainer.logger"] = False
    rehearsed = with_values(config, known)
    rehearsed.pop("config", None)  # the files it was read from
    return _rehearsal(json.dumps(rehearsed, sort_keys=True))


def micro_batch(config: Mapping) -> int:
    return int(get_path(config, "data.batch_size"))


def predict_peak_mib(config: Mapping) -> dict[str, float]:
    """One rank's peak tensor memory under ``config`` (resolved), MiB by category and ``total``, before
    any run of it: its step rehearsed at two small micro-batches, the peak at its own."""
    return rehearsal(config).peak(micro_batch(config))


def largest_batch(config: Mapping, budget_mib: float) -> int:
    """The largest per-rank micro-batch whose predicted peak fits ``budget_mib`` (0 if not even one
    sample)."""
    best = rehearsal(config).largest_batch(budget_mib)
    require(best < 2**25, "budget_mib: fits more than 32 M samples; is the budget in MiB?")
    return best
