"""The planner: per-rank memory (:mod:`.memory`), communication, step time and cost at N devices
(:mod:`.scale`), and the advisor for a memory budget (:mod:`.advisor`). Every figure printed is labelled
measured (with its run id) or assumed (its source).

To run: ``uv run python -m modelwright plan --budget_gib 16``.
"""

import dataclasses
from collections.abc import Mapping, Sequence
from contextlib import suppress
from pathlib import Path

from jsonargparse.typing import ClosedUnitInterval, PositiveFloat, PositiveInt

from modelwright.errors import ConfigError, require
from modelwright.planner.advisor import advise, options, recommend, shardings, slowdowns
from modelwright.planner.peak import largest_batch, predict_peak_mib
from modelwright.planner.prices import DEFAULT_PRICES
from modelwright.planner.scale import Assumptions, markdown_tables, predict_step, spec_from_record
from modelwright.record import get_path, read_record, read_records

__all__ = ["Assumptions", "advise", "largest_batch", "markdown_tables", "options", "plan", "predict_peak_mib",
           "predict_step", "recommend", "shardings", "slowdowns", "spec_from_record"]


def newest_records() -> Path | None:
    """The newest study that profiled its baseline (the advisor needs the profile), else the newest at all."""
    candidates = Path("results").glob("*/records.jsonl")

    def preference(path: Path) -> tuple:
        return (path.parent / "profile.json").is_file(), path.stat().st_mtime

    return max(candidates, default=None, key=preference)


def is_ok_of_model(record: Mapping, model: str | None) -> bool:
    return record.get("status") == "ok" and model in (None, get_path(record, "techniques.model_name"))


def planned_record(records: Sequence[Mapping], ok: Sequence[Mapping], run_id: str | None, model: str | None,
                   source: Path) -> Mapping:
    """The record to plan from: ``run_id``'s, else the single-device baseline, a profiled one first."""
    if run_id is not None:
        matches = [record for record in records if str(record.get("run_id")) == run_id]
    else:
        matches = [record for record in ok if int(get_path(record, "techniques.world_size", 1) or 1) == 1]
        matches.sort(key=lambda found: ("profile" not in found, get_path(found, "study.name") != "baseline"))
    wanted = f"record {run_id}" if run_id else "ok single-device record"
    of_model = f" of {model}" if model else ""
    require(bool(matches), f"--record: no {wanted}{of_model} in {str(source)!r}")
    return median_repeat(matches)


def median_repeat(matches: Sequence[Mapping]) -> Mapping:
    """The repeat of the first match's run and config whose step is the median (the lower of the middle two),
    so the plan's step is the study table's: the first match where it has no repeats."""
    first = matches[0]
    same = [record for record in matches if get_path(record, "study.name") == get_path(first, "study.name")
            and get_path(record, "study.config_hash") == get_path(first, "study.config_hash")
            and get_path(record, "timing.step_time_median_ms") is not None]
    if get_path(first, "study") is None or len(same) < 2:
        return first
    same.sort(key=lambda record: get_path(record, "timing.step_time_median_ms"))
    return same[(len(same) - 1) // 2]


def check_records(source: Path) -> list[dict]:
    """The records of the check folders inside a study's folder (``bf16-check/records.jsonl``: runs the study
    left out, timed there)."""
    return [record for path in sorted(source.parent.glob("*/records.jsonl")) for record in read_records(path)]


def with_profile_shape(record: Mapping, source: Path) -> Mapping:
    """The record with the study's profile beside it where it has none (TP and PP need the model's blocks)."""
    if "profile" in record:
        return record
    with suppress(OSError, ValueError):
        profile = read_record(source.with_name("profile.json"), validate=False)
        if get_path(profile, "techniques.model_name") == get_path(record, "techniques.model_name"):
            return {**record, "profile": profile.get("profile")}
    return record


def this_machine() -> dict:
    """This machine's ``hardware`` section, as a run here would record it, with its vector instruction set."""
    # Here, not at the top: torch loads only when the advisor compares machines.
    from modelwright.measure.facts import hardware_info

    return hardware_info()


def profile_for(record: Mapping, source: Path) -> Mapping:
    """The record itself if it holds a profile, else the study's ``profile.json`` beside the records, if that
    is of the record's model."""
    profile = record
    if "profile" not in record:
        with suppress(OSError, ValueError):
            profile = read_record(source.with_name("profile.json"), validate=False)
    same_model = get_path(profile, "techniques.model_name") == get_path(record, "techniques.model_name")
    require("profile" in profile and same_model, f"--record: run {record.get('run_id')} has no profile and "
            "there is no profile.json of its model beside the records; run the study (it profiles the "
            "baseline) first")
    return profile


def plan(record: Path | None = None, run_id: str | None = None, model: str | None = None,
         batch: PositiveInt | None = None, budget_gib: PositiveFloat | None = None,
         devices: list[PositiveInt] = [1, 8, 64],  # noqa: B006 (jsonargparse reads it)
         device: str = "H100 SXM", overlap: ClosedUnitInterval = 1.0, price_per_hour: float | None = None,
         gpu_step_time_ms: float | None = None, price_cpu_step_time: bool = False, epochs: float = 100,
         dataset_size: int = 50_000) -> None:
    """Print the planner's Markdown: the advisor for a memory budget, or the scaling tables.

    Args:
        record: records.jsonl to read (default: the newest results/*/records.jsonl with a profile.json beside
            it).
        run_id: the record to plan from (default: the single-device baseline, a profiled one first).
        model: the model whose baseline to use (resnet18, smallcnn, vit).
        batch: samples per optimizer step for the advisor (default: the record's).
        budget_gib: memory per device in GiB; with it the advisor runs (on CPU: tensor bytes, not RSS), from
            the record's profile or the study's profile.json beside the records.
        devices: device counts N for the scaling tables.
        device: the GPU priced and networked (a key of DEFAULT_PRICES).
        overlap: share of the backward pass that communication hides behind, in [0, 1].
        price_per_hour: USD per device-hour (default: the low end of the device's listing).
        gpu_step_time_ms: a GPU step time to plan with instead of the record's.
        price_cpu_step_time: price a CPU record's step time at GPU rates anyway.
        epochs: epochs of the priced job.
        dataset_size: samples per epoch."""
    require(device in DEFAULT_PRICES, f"--device: unknown {device!r}; valid: {', '.join(DEFAULT_PRICES)}")
    source = record or newest_records()
    require(source is not None,
            "--record: no results/*/records.jsonl to read; run `python -m modelwright study`")
    source = Path(source)
    require(source.is_file(), f"--record: no such file {str(source)!r}")
    records = read_records(source)
    ok = [found for found in records if is_ok_of_model(found, model)]
    chosen = planned_record(records, ok, run_id, model, source)
    on_cpu = get_path(chosen, "hardware.accelerator") == "cpu"
    if budget_gib is not None:
        profile = profile_for(chosen, source)
        label = " of tensor memory (CPU: tensor bytes, not process RSS)" if on_cpu else ""
        step_batch = batch or int(profile["profile"]["batch_size"])
        print(advise(profile, chosen.get("config", {}), step_batch, budget_gib * 1024, ok, label,
                     check_records(source), this_machine()))
        return
    try:
        spec = spec_from_record(with_profile_shape(chosen, source))
    except KeyError as err:
        raise ConfigError(f"--record: {err.args[0]}") from None
    if gpu_step_time_ms is not None:
        spec = dataclasses.replace(spec, step_time_ms=gpu_step_time_ms,
                                   step_time_source="assumed: --gpu_step_time_ms")
    assumptions = Assumptions(device=device, overlap_fraction=overlap, usd_per_device_hour=price_per_hour)
    # A CPU step is not priced at a GPU's listing unless asked: a price of its own, or a GPU step time.
    priced = not on_cpu or price_per_hour is not None or gpu_step_time_ms is not None or price_cpu_step_time
    print(markdown_tables(spec, devices, assumptions, epochs, dataset_size, priced=priced))
