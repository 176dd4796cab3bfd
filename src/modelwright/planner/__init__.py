"""The planner: per-rank memory, communication, step time and cost at N devices, and the advisor for a memory budget.

To run: ``uv run python -m modelwright plan --record results/<hw>/records.jsonl [--devices [1,8,64]]`` (scaling
tables) or ``... plan --budget_gib 16 --model resnet18 --batch 512`` (the advisor, from a profiled baseline).

* :mod:`.memory`: bytes per parameter, ZeRO/FSDP sharding, :func:`predict_peak_mib` and :func:`largest_batch`
  from a profiled step.
* :mod:`.scale`: communication (NVLink inside a node, InfiniBand across), overlap, TP/PP where the model can be
  split, pipeline bubble, step time and cost.
* :mod:`.advise`: which precision × accumulation × checkpointing fits a budget, and the sharding when none does.

Every figure printed says whether it is measured (with its run id) or assumed (with its source).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from modelwright.errors import ConfigError, require
from modelwright.planner.advise import advise, recommend
from modelwright.planner.memory import (
    GB,
    GIB,
    MIB,
    OPTIMIZERS,
    PARAM_STATE_BYTES,
    PRECISIONS,
    STRATEGIES,
    STRATEGY_LABELS,
    ParamStateBytes,
    largest_batch,
    normalize_optimizer,
    normalize_precision,
    normalize_strategy,
    param_state_bytes,
    predict_peak_mib,
    state_bytes_per_rank,
)
from modelwright.planner.scale import (
    DEFAULT_DEVICE,
    DEFAULT_PRICES,
    FABRICS,
    PRICE_DATE,
    PRICE_SOURCE,
    Assumptions,
    DevicePrice,
    JobSpec,
    StepPrediction,
    cannot_split,
    comm_bytes_per_step,
    cost_usd,
    describe_model,
    max_params_that_fit,
    pipeline_bubble_fraction,
    predict_memory_mib,
    predict_step,
    ring_allreduce_bytes,
    train_time_s,
)
from modelwright.record import get_path
from modelwright.report.fmt import count, duration, sig, table, usd

format_duration = duration  # the name callers used before report.fmt
RESNET18_CIFAR_PARAMS = 11_173_962

__all__ = [
    "GB", "GIB", "MIB", "OPTIMIZERS", "PARAM_STATE_BYTES", "PRECISIONS", "STRATEGIES", "STRATEGY_LABELS",
    "DEFAULT_DEVICE", "DEFAULT_PRICES", "FABRICS", "PRICE_DATE", "PRICE_SOURCE", "Assumptions", "DevicePrice",
    "JobSpec", "ParamStateBytes", "StepPrediction", "advise", "cannot_split", "comm_bytes_per_step", "cost_usd",
    "largest_batch", "load_record", "markdown_tables", "max_params_that_fit", "measured_memory_mib",
    "normalize_optimizer", "normalize_precision", "normalize_strategy", "param_state_bytes",
    "pipeline_bubble_fraction", "plan", "predict_memory_mib", "predict_peak_mib", "predict_step", "recommend",
    "ring_allreduce_bytes", "spec_from_record", "state_bytes_per_rank", "train_time_s",
]


def _need(record: Mapping, path: str):
    value = get_path(record, path)
    if value is None:
        raise KeyError(f"record is missing {path!r}")
    return value


def spec_from_record(record: Mapping) -> JobSpec:
    """A :class:`JobSpec` from a single-device run record: parameters, precision, optimizer, batch, activations
    per sample (``memory.anatomy_mib``), and the optimizer step's time (``timing.step_time_median_ms``).

    Raises:
        KeyError: naming the dotted path of a required key that is missing.
    """
    micro = int(_need(record, "techniques.micro_batch_size"))
    optimizer = str(_need(record, "techniques.optimizer"))
    if optimizer == "sgd" and get_path(record, "config.model.momentum") in (0, 0.0):
        optimizer = "sgd-nomomentum"
    anatomy = _need(record, "memory.anatomy_mib")
    return JobSpec(
        num_params=int(_need(record, "memory.model_parameters")),
        precision=str(_need(record, "techniques.precision")), optimizer=optimizer, micro_batch_size=micro,
        accumulate_grad_batches=int(get_path(record, "techniques.accumulate_grad_batches", 1) or 1),
        activation_bytes_per_sample=float(_need(record, "memory.anatomy_mib.activations")) * MIB / micro,
        temporaries_bytes=float(anatomy.get("temporaries") or 0.0) * MIB,
        step_time_ms=float(_need(record, "timing.step_time_median_ms")),
        step_time_source=f"measured, run {record.get('run_id', '?')} on "
        f"{get_path(record, 'hardware.device_name', '?')}",
        model_name=str(get_path(record, "techniques.model_name", "") or ""), source=str(record.get("run_id") or ""),
        **describe_model(record.get("profile")),
    )


def measured_memory_mib(record: Mapping) -> dict[str, float]:
    """The record's measured anatomy in MiB, with ``total``."""
    anatomy = _need(record, "memory.anatomy_mib")
    out = {k: float(v) for k, v in anatomy.items() if v is not None}
    out.setdefault("total", sum(out.values()))
    return out


def load_record(path: str | Path, run_id: str | None = None, model: str | None = None) -> tuple[dict, list[dict]]:
    """``(record, all records)`` from a JSON-lines file: ``run_id``'s, else the single-device baseline (profiled
    first) of ``model``.

    Raises:
        ConfigError: no such file, or no record matches (the message names the file and the filter).
    """
    from modelwright.record import read_records

    require(Path(path).is_file(), f"--record: no such file {str(path)!r}")
    records = read_records(Path(path))
    ok = [r for r in records if r.get("status") == "ok" and (model is None or
                                                            get_path(r, "techniques.model_name") == model)]
    if run_id is not None:
        matches = [r for r in records if str(r.get("run_id")) == run_id]
    else:
        matches = [r for r in ok if int(get_path(r, "techniques.world_size", 1) or 1) == 1]
        matches.sort(key=lambda r: ("profile" not in r, get_path(r, "study.name") != "baseline"))
    if not matches:
        raise ConfigError(f"--record: no {'record ' + run_id if run_id else 'ok single-device record'}"
                          f"{' of ' + model if model else ''} in {str(path)!r}")
    return matches[0], ok


def markdown_tables(spec: JobSpec, devices: Sequence[int] = (1, 8, 64), assumptions: Assumptions | None = None,
                    epochs: float = 100, dataset_size: int = 50_000, strategies: Sequence[str] = STRATEGIES,
                    priced: bool = True) -> str:
    """The scaling tables: per-rank memory, communication, step time and cost, largest model that fits.

    Cells that are estimates say so; a strategy that cannot split this model says why instead of a number.
    ``priced=False`` leaves cost out (a CPU step time must not be priced at GPU rates).
    """
    a = assumptions or Assumptions()
    preds = [(s, n, predict_step(spec, s, n, a)) for s in strategies for n in devices]
    st = spec.state
    head = [
        f"- model: {spec.model_name or 'unnamed'}, {spec.num_params:,} parameters; {spec.precision} + {spec.optimizer}"
        f": {st.weights:g} + {st.gradients:g} + {st.optimizer:g} = {st.total:g} B/parameter ({st.regime})",
        f"- measured: per-rank batch {spec.micro_batch_size} × {spec.accumulate_grad_batches}; activations "
        f"{sig(spec.activation_bytes_per_sample / MIB)} MiB/sample; step {sig(spec.step_time_ms)} ms "
        f"({spec.step_time_source or 'assumed'})",
        *(f"- assumed: {s}" for s in a.sources),
        "- estimates: every time, throughput and cost below is an estimate from the figures above",
    ]
    est = " (est.)"
    rows_mem = [[STRATEGY_LABELS[s], n, *([p.unsplittable] + ["–"] * 5 if p.unsplittable else
                [sig(p.memory_mib[k]) for k in ("parameters", "gradients", "optimizer_state", "activations", "total")]),
                 "–" if p.unsplittable else ("yes" if p.fits else "no")] for s, n, p in preds]
    rows_time = []
    for s, n, p in preds:
        if p.unsplittable:
            rows_time.append([STRATEGY_LABELS[s], n, p.unsplittable, *["–"] * 6])
            continue
        hours = train_time_s(p.samples_per_s, epochs, dataset_size) / 3600
        rows_time.append([STRATEGY_LABELS[s], n, sig(p.comm_bytes / MIB), duration(p.comm_s) + est,
                          f"{sig(100 * p.bubble_share, 2)}%" if s == "pp" else "–", duration(p.step_s) + est,
                          sig(p.samples_per_s) + est, duration(hours * 3600) + est,
                          usd(cost_usd(n, hours, a.price)) + est if priced else "not priced"])
    return "\n".join([
        *head, "", "### Per-device memory (MiB)", "",
        table(["strategy", "N", "parameters", "gradients", "optimizer", "activations", "total", "fits"], rows_mem),
        "", f"### Communication, time and cost ({epochs:g} epochs of {dataset_size:,} samples)", "",
        table(["strategy", "N", "comm/step (MiB)", "comm time", "bubble (share of step)", "step time", "samples/s",
               "train time", "cost"], rows_time),
        "", f"### Largest parameter count that fits {a.device_memory_gib:g} GiB per device", "",
        table(["strategy", *(f"N = {n}" for n in devices)],
              [[STRATEGY_LABELS[s], *(count(max_params_that_fit(spec, s, n, a)) for n in devices)]
               for s in strategies if s not in ("tp", "pp")]), "",
    ])


def plan(
    record: Path | None = None,
    run_id: str | None = None,
    model: str | None = None,
    batch: int | None = None,
    budget_gib: float | None = None,
    devices: list[int] = [1, 8, 64],  # noqa: B006 (jsonargparse reads the default)
    device: str = DEFAULT_DEVICE,
    overlap: float = 1.0,
    price_per_hour: float | None = None,
    gpu_step_time_ms: float | None = None,
    price_cpu_step_time: bool = False,
    epochs: float = 100,
    dataset_size: int = 50_000,
) -> None:
    """Print the planner's Markdown: the advisor for a memory budget, or the scaling tables.

    Args:
        record: records.jsonl to read (default: the first results/*/records.jsonl).
        run_id: the record to plan from (default: the profiled single-device baseline).
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
        dataset_size: samples per epoch.
    """
    require(0 <= overlap <= 1, f"--overlap: must be in [0, 1], got {overlap}")
    require(device in DEFAULT_PRICES, f"--device: unknown {device!r}; valid: {', '.join(DEFAULT_PRICES)}")
    require(all(n >= 1 for n in devices), f"--devices: must be integers >= 1, got {devices}")
    if record is None:
        found = sorted(Path("results").glob("*/records.jsonl"))
        require(bool(found), "--record: no results/*/records.jsonl to read; run `python -m modelwright study`")
        record = found[0]
    rec, records = load_record(record, run_id, model)
    if budget_gib is not None:
        require("profile" in rec, f"--record: run {rec.get('run_id')} has no profile; profile a baseline step first")
        require(budget_gib > 0, f"--budget_gib: must be > 0, got {budget_gib}")
        cpu = get_path(rec, "hardware.accelerator") == "cpu"
        print(advise(rec, rec.get("config", {}), batch or int(rec["profile"]["batch_size"]), budget_gib * 1024,
                     records, " of tensor memory (CPU: tensor bytes, not process RSS)" if cpu else ""))
        return
    try:
        spec = spec_from_record(rec)
    except KeyError as err:
        raise ConfigError(f"--record: {err.args[0]}") from None
    cpu = get_path(rec, "hardware.accelerator") == "cpu"
    if gpu_step_time_ms is not None:
        from dataclasses import replace

        spec = replace(spec, step_time_ms=gpu_step_time_ms, step_time_source="assumed: --gpu_step_time_ms")
    a = Assumptions(device=device, overlap_fraction=overlap, usd_per_device_hour=price_per_hour)
    priced = not cpu or gpu_step_time_ms is not None or price_cpu_step_time
    print(markdown_tables(spec, devices, a, epochs, dataset_size, priced=priced))
