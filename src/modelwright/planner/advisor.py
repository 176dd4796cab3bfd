"""The advisor for a memory budget: every precision × accumulation × checkpointing at one batch, with its
predicted peak and step time, the recommendation, and the sharding that fits where nothing fits one device."""

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from modelwright.fmt import sig, table
from modelwright.planner.memory import MIB, config_value, param_state_bytes, state_bytes_per_rank
from modelwright.planner.peak import predict_peak_mib
from modelwright.planner.step_profile import read_profile
from modelwright.study_rows import build_rows

#: The study run whose step time, over the baseline's, is each technique's slowdown.
TECHNIQUE_RUNS = {"bf16-mixed": "amp", "stage": "checkpointing-stage", "block": "checkpointing-block",
                  "accumulate": "accumulate"}
ACCUMULATIONS = (1, 2, 4, 8, 16, 32)
SHARDED_RANKS = (2, 4, 8, 16, 32, 64, 128, 256, 512)


class Option(NamedTuple):
    precision: str
    accumulate: int
    checkpointing: str
    peak_mib: float
    step_ms: float | None


class Slowdown(NamedTuple):
    """A technique's step time over the baseline's, and the run it was measured in."""

    factor: float
    source: str


class Sharding(NamedTuple):
    strategy: str
    ranks: int
    peak_mib: float


def slowdowns(records: Sequence[Mapping]) -> tuple[dict[str, Slowdown], float | None]:
    """Each technique's measured slowdown over the baseline, as the study's table has it (medians over the
    repeats of each run's latest config), with where it comes from, and the baseline's step ms (or None)."""
    rows = {row.name: row for row in build_rows(records) if row.ok and row.figures.step_ms}
    base_ms = rows["baseline"].figures.step_ms if "baseline" in rows else None
    found = {}
    for technique, run in TECHNIQUE_RUNS.items():
        if base_ms and run in rows:
            figures = rows[run].figures
            found[technique] = Slowdown(figures.step_ms / base_ms, f"{run}, {figures.repeats} repeats")
    return found, base_ms


def techniques_of(precision: str, accumulate: int, checkpointing: str) -> list[str]:
    """The techniques an option uses, by the names of :data:`TECHNIQUE_RUNS`."""
    used = [precision, "accumulate" if accumulate > 1 else None, checkpointing]
    return [name for name in used if name not in (None, "32-true", "off")]


def options(profile_record: Mapping, config: Mapping, batch: int,
            records: Sequence[Mapping] = ()) -> list[Option]:
    """Every precision × accumulation × checkpointing at ``batch`` samples per step, with its predicted peak
    and step time: fastest first, and without times, fewest techniques first (each costs time or
    precision)."""
    profile = read_profile(profile_record)
    slow, base_ms = slowdowns(records)
    found = []
    accumulations = [accumulate for accumulate in ACCUMULATIONS if batch % accumulate == 0]
    granularities = ("off", *profile.segments)
    for precision, accumulate, checkpointing in itertools.product(("32-true", "bf16-mixed"), accumulations,
                                                                  granularities):
        option_config = {**config, "trainer.precision": precision,
                         "trainer.accumulate_grad_batches": accumulate,
                         "data.batch_size": batch // accumulate,
                         "model.gradient_checkpointing": checkpointing}
        used = techniques_of(precision, accumulate, checkpointing)
        step_ms = None
        if base_ms and all(technique in slow for technique in used):
            factors = [slow[technique].factor for technique in used]
            step_ms = math.prod([base_ms * batch / profile.batch_size, *factors])
        peak = predict_peak_mib(profile_record, option_config)["total"]
        found.append(Option(precision, accumulate, checkpointing, peak, step_ms))

    def order(option: Option) -> tuple:
        return (option.step_ms is None, option.step_ms or 0, option.accumulate, option.checkpointing != "off",
                option.checkpointing == "block", option.precision != "32-true")

    return sorted(found, key=order)


def sharded_peak_mib(profile_record: Mapping, config: Mapping, strategy: str, ranks: int) -> float:
    """One rank's predicted peak under ZeRO-1, ZeRO-2 or FSDP over ``ranks`` (``config`` at the per-rank
    batch)."""
    if strategy == "fsdp":
        fsdp = {**config, "trainer.strategy": "fsdp", "trainer.devices": ranks}
        return predict_peak_mib(profile_record, fsdp)["total"]
    # ZeRO-1/2: one device's peak less the state they shard away.
    num_params = read_profile(profile_record).parameters
    precision = config_value(config, "trainer.precision", "32-true")
    state = param_state_bytes(precision, config_value(config, "model.optimizer", "adamw"))
    full = state_bytes_per_rank(num_params, state, "dp", 1)
    sharded = state_bytes_per_rank(num_params, state, strategy, ranks)
    saved = sum(full[key] - sharded[key] for key in full)
    return predict_peak_mib(profile_record, config)["total"] - saved / MIB


def shardings(profile_record: Mapping, config: Mapping, batch: int, budget_mib: float) -> list[Sharding]:
    """The fewest ranks at which ZeRO-1, ZeRO-2 and FSDP2 fit ``budget_mib`` (per-rank batch = batch / N)."""
    found = []
    for strategy in ("zero1", "zero2", "fsdp"):
        for ranks in (ranks for ranks in SHARDED_RANKS if batch % ranks == 0):
            rank_config = {**config, "data.batch_size": batch // ranks}
            peak = sharded_peak_mib(profile_record, rank_config, strategy, ranks)
            if peak <= budget_mib:
                found.append(Sharding(strategy, ranks, peak))
                break
    return found


def recommend(profile_record: Mapping, config: Mapping, batch: int, budget_mib: float,
              records: Sequence[Mapping] = ()) -> Option | None:
    """The advisor's choice: the first option that fits (fastest predicted, else fewest techniques), or
    None."""
    ranked = options(profile_record, config, batch, records)
    return next((option for option in ranked if option.peak_mib <= budget_mib), None)


def step_times_text(slow: Mapping[str, Slowdown]) -> str:
    if not slow:
        return "unknown (no study records)"
    factors = ", ".join(f"{technique} {sig(found.factor, 2)}× ({found.source})"
                        for technique, found in slow.items())
    return "predicted from measured slowdowns: " + factors


def options_table(ranked: Sequence[Option], budget_mib: float) -> str:
    header = ["precision", "accumulation", "checkpointing", "predicted peak (MiB)", "predicted step", "fits"]
    body = [[option.precision, option.accumulate, option.checkpointing, sig(option.peak_mib),
             sig(option.step_ms, 3, " ms") if option.step_ms else "unknown",
             "yes" if option.peak_mib <= budget_mib else "no"] for option in ranked]
    return table(header, body)


def advise(profile_record: Mapping, config: Mapping, batch: int, budget_mib: float,
           records: Sequence[Mapping] = (), budget_label: str = "") -> str:
    """Markdown: every option with its predicted peak and step time, and the recommendation (or the
    sharding)."""
    ranked = options(profile_record, config, batch, records)
    slow, _ = slowdowns(records)
    best = next((option for option in ranked if option.peak_mib <= budget_mib), None)
    run = profile_record.get("run_id", "the profile")
    lines = [f"Budget {sig(budget_mib / 1024)} GiB{budget_label}; batch {batch}; peaks predicted from the "
             f"profile of run {run}; step times {step_times_text(slow)}", "",
             options_table(ranked, budget_mib), ""]
    if best:
        choice = f"{best.precision}, {best.accumulate} × {best.checkpointing}"
        return "\n".join([*lines, f"Recommended: {choice} — predicted peak {sig(best.peak_mib)} MiB."])
    fitting = [f"{found.strategy} over {found.ranks} ranks fits ({sig(found.peak_mib)} MiB per rank)"
               for found in shardings(profile_record, config, batch, budget_mib)]
    return "\n".join([*lines, "Nothing fits one device. " + ("; ".join(fitting) or "No sharding up to 512.")])
