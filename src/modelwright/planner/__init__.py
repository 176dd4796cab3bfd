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
from modelwright.planner.memory import largest_batch, predict_peak_mib
from modelwright.planner.prices import DEFAULT_PRICES
from modelwright.planner.scale import (
    Assumptions,
    markdown_tables,
    model_shape,
    predict_step,
    spec_from_record,
)
from modelwright.record import get_path, read_record, read_records

__all__ = ["Assumptions", "advise", "largest_batch", "markdown_tables", "options", "plan", "predict_peak_mib",
           "predict_step", "recommend", "shardings", "slowdowns", "spec_from_record"]


def newest_records() -> Path | None:
    """The newest results/*/records.jsonl."""
    return max(Path("results").glob("*/records.jsonl"), default=None, key=lambda path: path.stat().st_mtime)


def is_ok_of_model(record: Mapping, model: str | None) -> bool:
    return record.get("status") == "ok" and model in (None, get_path(record, "techniques.model_name"))


def planned_record(records: Sequence[Mapping], ok: Sequence[Mapping], run_id: str | None, model: str | None,
                   source: Path) -> Mapping:
    """The record to plan from: ``run_id``'s, else the single-device baseline first."""
    if run_id is not None:
        matches = [record for record in records if str(record.get("run_id")) == run_id]
    else:
        matches = [record for record in ok if int(get_path(record, "techniques.world_size", 1) or 1) == 1]
        matches.sort(key=lambda found: get_path(found, "study.name") != "baseline")
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


def shape_for(record: Mapping, source: Path) -> dict | None:
    """What TP and PP could split of the record's network: built from its config (schema 3), else from the
    saved-tensor profile an older study wrote beside its records; None where neither is at hand."""
    config = record.get("config") or {}
    if "network" in (get_path(config, "model.init_args") or {}):
        from modelwright.measure.shape import network_shape
        from modelwright.techniques import shard_units
        from modelwright.train.rehearse import build_from_config

        job = build_from_config(config)
        network = job.model.net
        return network_shape(network, shard_units(network), job.datamodule.input_shape)
    with suppress(OSError, ValueError):
        profile = read_record(source.with_name("profile.json"), validate=False)
        if get_path(profile, "techniques.model_name") == get_path(record, "techniques.model_name"):
            return model_shape(profile.get("profile"))
    return None


def this_machine() -> dict:
    """This machine's ``hardware`` section, as a run here would record it, with its vector instruction set."""
    # Here, not at the top: torch loads only when the advisor compares machines.
    from modelwright.measure.facts import hardware_info

    return hardware_info()


def job_config(config: Sequence[Path]) -> dict:
    """The resolved job of ``--config`` files, as ``main.py fit --config ...`` would run it."""
    from modelwright.train.cli import resolved_config  # torch and Lightning: only where a job is planned

    args = ["fit"]
    for path in config:
        args += ["--config", str(path)]
    return resolved_config(args)


def parameters_of(resolved: Mapping) -> int:
    """The parameters of the job's network, built (as the run would build it) and counted."""
    from modelwright.train.rehearse import build_from_config

    module = build_from_config(resolved).model
    return sum(parameter.numel() for parameter in module.parameters())


def effective_batch(resolved: Mapping) -> int:
    micro = int(get_path(resolved, "data.batch_size", 1) or 1)
    accumulate = int(get_path(resolved, "trainer.accumulate_grad_batches", 1) or 1)
    return micro * accumulate


def job_records(resolved: Mapping) -> Path | None:
    """The records of the job's own study on this machine (``study --config`` writes them to
    ``results/<hardware>/<job name>/``), or None where it has none yet."""
    from modelwright.study import hardware_slug  # torch: only where a job is planned

    name = get_path(resolved, "trainer.logger.init_args.name")
    if not isinstance(name, str) or not name:
        return None
    accelerator = str(get_path(resolved, "trainer.accelerator", "auto") or "auto")
    path = Path("results") / hardware_slug(accelerator) / name / "records.jsonl"
    return path if path.is_file() else None


def _advise(config: Sequence[Path], source: Path | None, model: str | None, batch: int | None,
            budget_gib: float) -> None:
    """The advisor on the job of ``config`` (default: the default job), with the step times of ``source``'s
    records: by default the job's own study here, else the newest study's (the table names its network)."""
    resolved = job_config(config)
    source = source or job_records(resolved) or newest_records()
    records = read_records(source) if source is not None and Path(source).is_file() else []
    ok = [found for found in records if is_ok_of_model(found, model)]
    on_cpu = str(get_path(resolved, "trainer.accelerator")) not in ("cuda", "gpu")
    label = " of tensor memory (CPU: tensor bytes, not process RSS)" if on_cpu else ""
    checks = check_records(Path(source)) if source is not None else []
    print(advise(resolved, batch or effective_batch(resolved), budget_gib * 1024, ok, label, checks,
                 this_machine(), parameters_of(resolved)))


def plan(job: list[Path] = [], record: Path | None = None,  # noqa: B006 (jsonargparse reads it)
         run_id: str | None = None, model: str | None = None,
         batch: PositiveInt | None = None, budget_gib: PositiveFloat | None = None,
         devices: list[PositiveInt] = [1, 8, 64],  # noqa: B006 (jsonargparse reads it)
         device: str = "H100 SXM", overlap: ClosedUnitInterval = 1.0, price_per_hour: float | None = None,
         gpu_step_time_ms: float | None = None, price_cpu_step_time: bool = False, epochs: float = 100,
         dataset_size: int = 50_000) -> None:
    """Print the planner's Markdown: the advisor for a memory budget, or the scaling tables.

    Args:
        job: the job's config files, given as ``--config FILE`` as to ``main.py fit`` (default: the default
            job); with --budget_gib the advisor rehearses its step under every option.
        record: records.jsonl to read (default: the newest results/*/records.jsonl): the step times.
        run_id: the record to plan from (default: the single-device baseline).
        model: the model whose baseline to use (resnet18, smallcnn, vit).
        batch: samples per optimizer step for the advisor (default: the record's).
        budget_gib: memory per device in GiB; with it the advisor runs (on CPU: tensor bytes, not RSS).
        devices: device counts N for the scaling tables.
        device: the GPU priced and networked (a key of DEFAULT_PRICES).
        overlap: share of the backward pass that communication hides behind, in [0, 1].
        price_per_hour: USD per device-hour (default: the low end of the device's listing).
        gpu_step_time_ms: a GPU step time to plan with instead of the record's.
        price_cpu_step_time: price a CPU record's step time at GPU rates anyway.
        epochs: epochs of the priced job.
        dataset_size: samples per epoch."""
    require(device in DEFAULT_PRICES, f"--device: unknown {device!r}; valid: {', '.join(DEFAULT_PRICES)}")
    if budget_gib is not None:
        _advise(job, record, model, batch, budget_gib)
        return
    source = record or newest_records()
    require(source is not None,
            "--record: no results/*/records.jsonl to read; run `python -m modelwright study`")
    source = Path(source)
    require(source.is_file(), f"--record: no such file {str(source)!r}")
    records = read_records(source)
    ok = [found for found in records if is_ok_of_model(found, model)]
    chosen = planned_record(records, ok, run_id, model, source)
    on_cpu = get_path(chosen, "hardware.accelerator") == "cpu"
    try:
        spec = spec_from_record(chosen, shape_for(chosen, source))
    except KeyError as err:
        raise ConfigError(f"--record: {err.args[0]}") from None
    if gpu_step_time_ms is not None:
        spec = dataclasses.replace(spec, step_time_ms=gpu_step_time_ms,
                                   step_time_source="assumed: --gpu_step_time_ms")
    assumptions = Assumptions(device=device, overlap_fraction=overlap, usd_per_device_hour=price_per_hour)
    # A CPU step is not priced at a GPU's listing unless asked: a price of its own, or a GPU step time.
    priced = not on_cpu or price_per_hour is not None or gpu_step_time_ms is not None or price_cpu_step_time
    print(markdown_tables(spec, devices, assumptions, epochs, dataset_size, priced=priced))
