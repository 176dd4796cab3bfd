"""The planner: per-rank memory (:mod:`.memory`), communication, step time and cost at N devices (:mod:`.scale`), and
the advisor for a memory budget. Every figure printed is labelled measured (with its run id) or assumed (its source)."""

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from typing import NamedTuple

from jsonargparse.typing import ClosedUnitInterval, PositiveFloat, PositiveInt

from modelwright.errors import ConfigError, require
from modelwright.planner import memory
from modelwright.planner.memory import MIB, _cfg, largest_batch, param_state_bytes, predict_peak_mib
from modelwright.planner.scale import (
    DEFAULT_PRICES,
    Assumptions,
    markdown_tables,
    predict_step,
    spec_from_record,
)
from modelwright.record import get_path, read_record, read_records
from modelwright.report.fmt import sig, table

__all__ = ["Assumptions", "advise", "largest_batch", "markdown_tables", "options", "plan", "predict_peak_mib",
           "predict_step", "recommend", "spec_from_record"]
#: The study run whose step time, over the baseline's, is each technique's slowdown.
TECHNIQUE_RUNS = {"bf16-mixed": "amp", "stage": "checkpointing-stage", "block": "checkpointing-block",
                  "accumulate": "accumulate"}


class Option(NamedTuple):
    precision: str
    accumulate: int
    checkpointing: str
    peak_mib: float
    step_ms: float | None


def slowdowns(records: Sequence[Mapping]) -> tuple[dict[str, tuple[float, str]], float | None]:
    """Each technique's measured slowdown over the baseline, as the study's table has it (medians over the repeats
    of each run's latest config), with where it comes from, and the baseline's step ms (or None)."""
    from modelwright.report.tables import build_rows  # here: report.tables imports the planner too

    rows = {r.name: r for r in build_rows(records) if r.ok and r.v["step_ms"]}
    base = rows["baseline"].v["step_ms"] if "baseline" in rows else None
    return {t: (rows[run].v["step_ms"] / base, f"{run}, {rows[run].v['repeats']} repeats")
            for t, run in TECHNIQUE_RUNS.items() if base and run in rows}, base


def options(profile_record: Mapping, config: Mapping, batch: int, records: Sequence[Mapping] = ()) -> list[Option]:
    """Every precision × accumulation × checkpointing at ``batch`` samples per step, with its predicted peak and step
    time: fastest first, and without times, fewest techniques first (each costs time or precision)."""
    prof = profile_record.get("profile", profile_record)
    slow, base_ms = slowdowns(records)
    out = []
    accumulations = [a for a in (1, 2, 4, 8, 16, 32) if batch % a == 0]
    for precision, acc, ckpt in itertools.product(("32-true", "bf16-mixed"), accumulations, ("off", *prof["segments"])):
        cfg = {**config, "trainer.precision": precision, "trainer.accumulate_grad_batches": acc,
               "data.batch_size": batch // acc, "model.gradient_checkpointing": ckpt}
        used = [t for t in (precision, "accumulate" if acc > 1 else None, ckpt) if t not in (None, "32-true", "off")]
        known = base_ms and all(t in slow for t in used)
        step = math.prod([base_ms * batch / prof["batch_size"], *(slow[t][0] for t in used)]) if known else None
        out.append(Option(precision, acc, ckpt, predict_peak_mib(profile_record, cfg)["total"], step))
    return sorted(out, key=lambda o: (o.step_ms is None, o.step_ms or 0, o.accumulate, o.checkpointing != "off",
                                      o.checkpointing == "block", o.precision != "32-true"))


def shardings(profile_record: Mapping, config: Mapping, batch: int, budget_mib: float) -> list[tuple[str, int, float]]:
    """The fewest ranks at which ZeRO-1, ZeRO-2 and FSDP2 fit ``budget_mib`` (per-rank batch = batch / N)."""
    psi = profile_record.get("profile", profile_record)["parameters"]
    state = param_state_bytes(_cfg(config, "trainer.precision", "32-true"), _cfg(config, "model.optimizer", "adamw"))
    full, found = memory.state_bytes_per_rank(psi, state, "dp", 1), []
    for name in ("zero1", "zero2", "fsdp"):
        for n in (n for n in (2, 4, 8, 16, 32, 64, 128, 256, 512) if batch % n == 0):
            cfg = {**config, "data.batch_size": batch // n}
            if name == "fsdp":
                fsdp = {**cfg, "trainer.strategy": "fsdp", "trainer.devices": n}
                peak = predict_peak_mib(profile_record, fsdp)["total"]
            else:  # ZeRO-1/2: one device's peak less the state they shard away
                sharded = memory.state_bytes_per_rank(psi, state, name, n)
                peak = predict_peak_mib(profile_record, cfg)["total"] - sum(full[k] - sharded[k] for k in full) / MIB
            if peak <= budget_mib:
                found.append((name, n, peak))
                break
    return found


def recommend(profile_record: Mapping, config: Mapping, batch: int, budget_mib: float,
              records: Sequence[Mapping] = ()) -> Option | None:
    """The advisor's choice: the first option that fits (fastest predicted, else fewest techniques), or None."""
    return next((o for o in options(profile_record, config, batch, records) if o.peak_mib <= budget_mib), None)


def advise(profile_record: Mapping, config: Mapping, batch: int, budget_mib: float,
           records: Sequence[Mapping] = (), budget_label: str = "") -> str:
    """Markdown: every option with its predicted peak and step time, and the recommendation (or the sharding)."""
    opts, (slow, _) = options(profile_record, config, batch, records), slowdowns(records)
    best = next((o for o in opts if o.peak_mib <= budget_mib), None)
    times = ("predicted from measured slowdowns: " + ", ".join(f"{t} {sig(f, 2)}× ({rid})" for t, (f, rid) in
                                                              slow.items())) if slow else "unknown (no study records)"
    lines = [f"Budget {sig(budget_mib / 1024)} GiB{budget_label}; batch {batch}; peaks predicted from the profile of "
             f"run {profile_record.get('run_id', 'the profile')}; step times {times}", "",
             table(["precision", "accumulation", "checkpointing", "predicted peak (MiB)", "predicted step", "fits"],
                   [[o.precision, o.accumulate, o.checkpointing, sig(o.peak_mib),
                     sig(o.step_ms, 3, " ms") if o.step_ms else "unknown", "yes" if o.peak_mib <= budget_mib else "no"]
                    for o in opts]), ""]
    if best:
        return "\n".join([*lines, f"Recommended: {best.precision}, {best.accumulate} × {best.checkpointing} — "
                                  f"predicted peak {sig(best.peak_mib)} MiB."])
    return "\n".join([*lines, "Nothing fits one device. " + ("; ".join(
        f"{name} over {n} ranks fits ({sig(p)} MiB per rank)" for name, n, p in
        shardings(profile_record, config, batch, budget_mib)) or "No sharding up to 512.")])


def plan(record: Path | None = None, run_id: str | None = None, model: str | None = None,
         batch: PositiveInt | None = None, budget_gib: PositiveFloat | None = None,
         devices: list[PositiveInt] = [1, 8, 64],  # noqa: B006 (jsonargparse reads it)
         device: str = "H100 SXM", overlap: ClosedUnitInterval = 1.0, price_per_hour: float | None = None,
         gpu_step_time_ms: float | None = None, price_cpu_step_time: bool = False, epochs: float = 100,
         dataset_size: int = 50_000) -> None:
    """Print the planner's Markdown: the advisor for a memory budget, or the scaling tables.

    Args:
        record: records.jsonl to read (default: the newest results/*/records.jsonl with a profile.json beside it).
        run_id: the record to plan from (default: the single-device baseline, a profiled one first).
        model: the model whose baseline to use (resnet18, smallcnn, vit).
        batch: samples per optimizer step for the advisor (default: the record's).
        budget_gib: memory per device in GiB; with it the advisor runs (on CPU: tensor bytes, not RSS), from the
            record's profile or the study's profile.json beside the records.
        devices: device counts N for the scaling tables.
        device: the GPU priced and networked (a key of DEFAULT_PRICES).
        overlap: share of the backward pass that communication hides behind, in [0, 1].
        price_per_hour: USD per device-hour (default: the low end of the device's listing).
        gpu_step_time_ms: a GPU step time to plan with instead of the record's.
        price_cpu_step_time: price a CPU record's step time at GPU rates anyway.
        epochs: epochs of the priced job.
        dataset_size: samples per epoch."""
    require(device in DEFAULT_PRICES, f"--device: unknown {device!r}; valid: {', '.join(DEFAULT_PRICES)}")
    # Default: the newest study that profiled its baseline (the advisor needs the profile), else the newest at all.
    record = record or max(Path("results").glob("*/records.jsonl"), default=None,
                           key=lambda f: ((f.parent / "profile.json").is_file(), f.stat().st_mtime))
    require(record is not None, "--record: no results/*/records.jsonl to read; run `python -m modelwright study`")
    require(Path(record).is_file(), f"--record: no such file {str(record)!r}")
    records = read_records(Path(record))
    ok = [r for r in records if r.get("status") == "ok" and model in (None, get_path(r, "techniques.model_name"))]
    if run_id is not None:
        matches = [r for r in records if str(r.get("run_id")) == run_id]
    else:  # the single-device baseline, a profiled one first
        matches = [r for r in ok if int(get_path(r, "techniques.world_size", 1) or 1) == 1]
        matches.sort(key=lambda r: ("profile" not in r, get_path(r, "study.name") != "baseline"))
    require(bool(matches), f"--record: no {'record ' + run_id if run_id else 'ok single-device record'}"
            f"{' of ' + model if model else ''} in {str(record)!r}")
    rec, cpu = matches[0], get_path(matches[0], "hardware.accelerator") == "cpu"
    if budget_gib is not None:
        profile = rec
        if "profile" not in rec:  # the study's profile.json beside the records, if it is of this record's model
            with suppress(OSError, ValueError):
                profile = read_record(Path(record).with_name("profile.json"), validate=False)
        same = get_path(profile, "techniques.model_name") == get_path(rec, "techniques.model_name")
        require("profile" in profile and same, f"--record: run {rec.get('run_id')} has no profile and there is no "
                "profile.json of its model beside the records; run the study (it profiles the baseline) first")
        print(advise(profile, rec.get("config", {}), batch or int(profile["profile"]["batch_size"]),
                     budget_gib * 1024, ok, " of tensor memory (CPU: tensor bytes, not process RSS)" if cpu else ""))
        return
    try:
        spec = spec_from_record(rec)
    except KeyError as err:
        raise ConfigError(f"--record: {err.args[0]}") from None
    if gpu_step_time_ms is not None:
        spec = dataclasses.replace(spec, step_time_ms=gpu_step_time_ms, step_time_source="assumed: --gpu_step_time_ms")
    a = Assumptions(device=device, overlap_fraction=overlap, usd_per_device_hour=price_per_hour)
    priced = not cpu or gpu_step_time_ms is not None or price_cpu_step_time
    print(markdown_tables(spec, devices, a, epochs, dataset_size, priced=priced))

