"""The run record: one JSON object per run, whatever loop produced it; its schema, validation and files.

The schema is :data:`SCHEMA` (documented key by key in ``docs/record-schema.md``). Every key it names
is present in a valid record; a value may be ``None`` where the field allows it (not measured, not
applicable). Extra keys are allowed, so a writer can add facts without breaking readers; renaming or
removing a key needs a new :data:`SCHEMA_VERSION`.

Files:

* :func:`write_record`: one record, written atomically (temp file + ``os.replace``);
* :func:`append_record`: one line of a ``.jsonl`` file, appended with a single ``O_APPEND`` write;
* :func:`read_records`: the records of a ``.jsonl`` file; damaged lines are skipped with a warning.

Non-finite floats (a diverged loss) are written as ``null``: JSON has no NaN.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import tempfile
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
#: Bumped when what a figure means changes (the MFU peak, the anatomy categories): records of different
#: definitions are not put in one table.
DEFINITIONS_VERSION = 2
STATUSES = ("ok", "failed", "diverged", "interrupted", "oom")
LOOPS = ("lightning", "accelerate", "raw")
PEAK_FLOPS_SOURCES = ("lightning-table", "config", "measured-matmul", None)
#: Where tensor memory goes; ``ANATOMY_KEYS`` adds their sum, ``total``.
ANATOMY_CATEGORIES = (
    "parameters",
    "buffers",
    "gradients",
    "optimizer_state",
    "activations",
    "temporaries",
    "other",
)
ANATOMY_KEYS = (*ANATOMY_CATEGORIES, "total")
METRIC_KEYS = ("train/loss", "train/acc", "val/loss", "val/acc")


class RecordError(ValueError):
    """A record that does not match :data:`SCHEMA`; the message lists every problem, one per line."""


@dataclass(frozen=True)
class Field:
    """One leaf of the schema.

    Args:
        types: the accepted value types; ``None`` in the tuple allows null. ``float`` accepts ints too
            (never bools).
        doc: what the value means, for ``docs/record-schema.md``.
        unit: the unit, where there is one (also in the key's name).
        choices: the allowed values, if the field is an enumeration.
        nonneg: numbers must be >= 0.
    """

    types: tuple
    doc: str
    unit: str | None = None
    choices: tuple | None = None
    nonneg: bool = False


_S = (str,)
_SN = (str, None)
_I = (int,)
_IN = (int, None)
_FN = (float, None)
_BN = (bool, None)


def _num(doc: str, unit: str | None = None, nullable: bool = True) -> Field:
    return Field((float, None) if nullable else (float,), doc, unit, nonneg=True)


#: The record's shape: nested dicts of :class:`Field` leaves. ``config`` holds any JSON object;
#: ``anatomy_mib`` is null or a dict of :data:`ANATOMY_KEYS`; ``history`` maps a metric name to
#: ``[[step, value], ...]``.
SCHEMA: dict[str, Any] = {
    "schema_version": Field(_I, "Version of this schema; readers check it.", choices=(SCHEMA_VERSION,)),
    "run_id": Field(_S, "Unique id of the run (set by the caller, or time + random suffix)."),
    "status": Field(_S, "How the run ended.", choices=STATUSES),
    "error": Field(_SN, "One-line error for status other than ok (type: message); null when ok."),
    "loop": Field(_S, "The training loop that produced the record.", choices=LOOPS),
    "created_at": Field(_S, "When the record was written, ISO 8601 with time zone."),
    "config": Field((dict,), "The resolved configuration of the run (LightningCLI's), or {} if none."),
    "techniques": {
        "model_name": Field(_SN, "Network name (models.build_model)."),
        "precision": Field(_SN, "Precision as actually applied, e.g. bf16-mixed (Lightning may change 16-mixed)."),
        "precision_requested": Field(_SN, "Precision as configured; null if unknown."),
        "accumulate_grad_batches": Field(_IN, "Micro-batches per optimizer step."),
        "gradient_checkpointing": Field(_SN, "Checkpoint granularity: off, stage or block."),
        "optimizer": Field(_SN, "Optimizer name as configured (e.g. adamw)."),
        "optimizer_impl": Field(_SN, "Optimizer class that ran, with [fused]/[foreach] when set."),
        "channels_last": Field(_BN, "Whether conv weights are in channels_last memory format."),
        "compile": Field((bool, str, None), "torch.compile: false, true, or the mode name."),
        "strategy": Field(_SN, "Distribution strategy: single_device, ddp, fsdp, model_parallel, ..."),
        "world_size": Field(_IN, "Processes taking part in training.", nonneg=True),
        "num_nodes": Field(_IN, "Machines taking part.", nonneg=True),
        "micro_batch_size": Field(_IN, "Samples per device per forward pass.", "samples", nonneg=True),
        "effective_batch_size": Field(
            _IN, "Samples per optimizer step: micro × accumulate × world_size.", "samples", nonneg=True
        ),
    },
    "hardware": {
        "accelerator": Field(_SN, "Device type: cpu, cuda, mps, ..."),
        "device_name": Field(_SN, "GPU name, or the CPU model for a CPU run."),
        "device_memory_mib": _num("GPU memory, or host RAM for a CPU run.", "MiB"),
        "cpu_model": Field(_SN, "CPU model name."),
        "cpu_cores": Field(_IN, "Logical CPUs of the machine.", nonneg=True),
        "num_devices": Field(_IN, "Devices this run used per node.", nonneg=True),
    },
    "versions": {
        "python": Field(_SN, "Python version."),
        "torch": Field(_SN, "PyTorch version."),
        "lightning": Field(_SN, "Lightning version (null if not installed)."),
        "torchvision": Field(_SN, "torchvision version."),
        "accelerate": Field(_SN, "Hugging Face Accelerate version."),
        "cuda": Field(_SN, "CUDA version PyTorch was built with (null for a CPU build)."),
    },
    "timing": {
        "warmup_steps": Field(_IN, "Optimizer steps excluded before the window.", "steps", nonneg=True),
        "measured_steps": Field(_IN, "Optimizer steps timed in the window.", "steps", nonneg=True),
        "step_time_median_ms": _num("Median time of one optimizer step (all its micro-batches).", "ms"),
        "step_time_p90_ms": _num("90th percentile of step time.", "ms"),
        "step_time_min_ms": _num("Fastest measured step.", "ms"),
        "step_time_max_ms": _num("Slowest measured step.", "ms"),
        "steps_per_epoch": Field(_IN, "Optimizer steps per training epoch.", "steps", nonneg=True),
        "epoch_time_s": _num("steps_per_epoch × median step time.", "s"),
        "samples_per_s": _num("effective_batch_size ÷ median step time.", "samples/s"),
        "wall_time_s": _num("Wall-clock time of the whole fit, validation included.", "s"),
    },
    "flops": {
        "flops_per_step": _num("Model FLOPs of one optimizer step (forward + backward, no recompute).", "FLOP"),
        "achieved_flops_per_s": _num("flops_per_step ÷ median step time, per device.", "FLOP/s"),
        "peak_flops_per_s": _num("Peak FLOP/s of one device in the run's compute dtype.", "FLOP/s"),
        "peak_flops_source": Field(_SN, "Where the peak came from.", choices=PEAK_FLOPS_SOURCES),
        "mfu": _num("Model FLOPs utilisation: achieved ÷ peak.", "fraction"),
    },
    "memory": {
        "peak_allocated_mib": _num(
            "Peak tensor memory: CUDA max_memory_allocated over the window; else the tracker peak total.",
            "MiB",
        ),
        "peak_reserved_mib": _num("CUDA max_memory_reserved over the window; null on CPU.", "MiB"),
        "anatomy_step": Field(_IN, "Optimizer step (global_step) whose anatomy was captured.", "step", nonneg=True),
        "anatomy_mib": Field((dict, None), "Tensor memory by category at the captured step's peak.", "MiB"),
        "model_parameters": Field(_IN, "Number of model parameters (elements).", "parameters", nonneg=True),
        "rss_peak_mib": _num("Process RSS high-water mark (not a tensor peak: allocators keep freed pages).", "MiB"),
    },
    "metrics": {key: Field(_FN, f"Final {key} (last logged value).") for key in METRIC_KEYS},
    "history": Field((dict,), "Metric name → [[optimizer step, value], ...] in step order."),
}


def _type_ok(value: Any, types: tuple) -> bool:
    if value is None:
        return None in types
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and (int in types or float in types):
        return True
    return any(t is not None and t not in (int, bool) and isinstance(value, t) for t in types)


def _type_names(types: tuple) -> str:
    return " | ".join("null" if t is None else t.__name__ for t in types)


def _check_field(path: str, value: Any, field: Field, errors: list[str]) -> None:
    if not _type_ok(value, field.types):
        errors.append(f"{path}: expected {_type_names(field.types)}, got {type(value).__name__} {value!r:.60}")
        return
    if field.choices is not None and value not in field.choices:
        errors.append(f"{path}: {value!r} is not one of {list(field.choices)}")
    if isinstance(value, float) and not math.isfinite(value):
        errors.append(f"{path}: non-finite number {value!r}")
    elif field.nonneg and isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
        errors.append(f"{path}: negative value {value!r}")


def _check_section(prefix: str, record: Mapping, spec: Mapping, errors: list[str]) -> None:
    for key, sub in spec.items():
        path = f"{prefix}{key}"
        if key not in record:
            errors.append(f"{path}: missing")
            continue
        value = record[key]
        if isinstance(sub, Field):
            _check_field(path, value, sub, errors)
        elif not isinstance(value, Mapping):
            errors.append(f"{path}: expected an object, got {type(value).__name__}")
        else:
            _check_section(path + ".", value, sub, errors)


def get_path(mapping: Any, path: str, default: Any = None) -> Any:
    """``mapping["a"]["b"]`` for ``path`` ``"a.b"``; ``default`` where a part is missing."""
    node: Any = mapping
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def validate_record(record: Any) -> list[str]:
    """Every way ``record`` departs from :data:`SCHEMA`, one message per problem (empty when valid)."""
    if not isinstance(record, Mapping):
        return [f"record: expected an object, got {type(record).__name__}"]
    errors: list[str] = []
    _check_section("", record, SCHEMA, errors)
    if errors and any(e.startswith("schema_version") for e in errors):
        return errors

    memory = record.get("memory")
    anatomy = memory.get("anatomy_mib") if isinstance(memory, Mapping) else None
    if isinstance(anatomy, Mapping):
        for key in ANATOMY_KEYS:
            if key not in anatomy:
                errors.append(f"memory.anatomy_mib.{key}: missing")
            else:
                _check_field(f"memory.anatomy_mib.{key}", anatomy[key], Field(_FN, "", nonneg=True), errors)

    history = record.get("history")
    if isinstance(history, Mapping):
        for name, points in history.items():
            if not isinstance(points, list):
                errors.append(f"history.{name}: expected a list of [step, value]")
                continue
            last = -1
            for i, point in enumerate(points):
                if (
                    not isinstance(point, (list, tuple))
                    or len(point) != 2
                    or not _type_ok(point[0], _I)
                    or not _type_ok(point[1], _FN)
                ):
                    errors.append(f"history.{name}[{i}]: expected [int step, number or null], got {point!r:.60}")
                    break
                if point[0] < last:
                    errors.append(f"history.{name}[{i}]: step {point[0]} after step {last}")
                    break
                last = point[0]

    status = record.get("status")
    if status in STATUSES and status != "ok" and not record.get("error") and status != "diverged":
        errors.append(f"error: status {status!r} needs a one-line error message")

    tech = record.get("techniques")
    if isinstance(tech, Mapping):
        parts = [tech.get(k) for k in ("micro_batch_size", "accumulate_grad_batches", "world_size")]
        eff = tech.get("effective_batch_size")
        if all(isinstance(p, int) for p in parts) and isinstance(eff, int) and eff != math.prod(parts):
            errors.append(
                f"techniques.effective_batch_size: {eff} != micro_batch_size × accumulate_grad_batches × "
                f"world_size = {math.prod(parts)}"
            )
    return errors


def check_record(record: Any) -> None:
    """Raise :class:`RecordError` listing every problem if ``record`` does not match the schema."""
    errors = validate_record(record)
    if errors:
        raise RecordError("invalid run record:\n" + "\n".join(errors))


def new_run_id() -> str:
    """A sortable unique id: UTC time plus a random suffix, e.g. ``20250101T120000Z-1a2b3c4d``."""
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{now}-{uuid.uuid4().hex[:8]}"


def now_iso() -> str:
    """The current time, ISO 8601 with the local UTC offset."""
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def _skeleton(spec: Mapping) -> dict[str, Any]:
    return {k: _skeleton(v) if isinstance(v, Mapping) else None for k, v in spec.items()}


def new_record(run_id: str | None = None, loop: str = "lightning") -> dict[str, Any]:
    """A record with every key of the schema present: nothing measured yet, status ``ok``."""
    record = _skeleton(SCHEMA)
    record.update(
        schema_version=SCHEMA_VERSION,
        run_id=run_id or new_run_id(),
        status="ok",
        error=None,
        loop=loop,
        created_at=now_iso(),
        config={},
        history={},
    )
    return record


def provenance(command: list[str] | None = None) -> dict[str, Any]:
    """Where a record came from: the git commit of the checkout (``dirty`` if it has uncommitted changes to
    tracked files), the command line, and the versions of the definitions its figures follow."""
    import subprocess
    import sys

    from modelwright import REPO_ROOT

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "commit": commit,
        "dirty": None if status is None else bool(status),
        "command": " ".join(command if command is not None else [Path(sys.argv[0]).name, *sys.argv[1:]]),
        "definitions": DEFINITIONS_VERSION,
    }


def build_record(
    *,
    loop: str,
    status: str = "ok",
    error: str | None = None,
    run_id: str | None = None,
    command: list[str] | None = None,
    **sections: Any,
) -> dict[str, Any]:
    """The one way to make a run record, whatever produced it (a callback, the Accelerate loop, the study).

    ``sections`` are the record's top-level keys (``config``, ``techniques``, ``hardware``, ``versions``,
    ``timing``, ``flops``, ``memory``, ``metrics``, ``history``, ``faults``, ``study``, ...); a dict section of
    the schema is merged over its skeleton, so a writer gives only what it measured. The result is JSON-ready and
    carries its :func:`provenance`; it is validated when written.
    """
    record = new_record(run_id=run_id, loop=loop)
    record["status"], record["error"] = status, error
    for key, value in sections.items():
        if value is None:
            continue
        if isinstance(record.get(key), dict) and isinstance(value, Mapping) and key not in ("config", "history"):
            record[key] = {**record[key], **value}
        else:
            record[key] = value
    record["provenance"] = provenance(command)
    return to_jsonable(record)


def to_jsonable(obj: Any) -> Any:
    """``obj`` as plain JSON values: tensors and numpy scalars to numbers, paths and unknowns to str,
    tuples to lists, non-finite floats to ``None``."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 0) == 0:
        try:
            return to_jsonable(obj.item())
        except (TypeError, ValueError, RuntimeError):
            pass
    if hasattr(obj, "as_dict") and callable(obj.as_dict):  # jsonargparse Namespace
        return to_jsonable(obj.as_dict())
    return str(obj)


def dumps_record(record: Mapping, validate: bool = True, indent: int | None = None) -> str:
    """The record as JSON text (sanitised by :func:`to_jsonable`, validated unless told not to)."""
    data = to_jsonable(record)
    if validate:
        check_record(data)
    return json.dumps(data, indent=indent, allow_nan=False, ensure_ascii=False)


def write_record(path: str | os.PathLike, record: Mapping, validate: bool = True) -> Path:
    """Write one record to ``path`` atomically: a temp file in the same folder, fsync, ``os.replace``."""
    path = Path(path)
    text = dumps_record(record, validate=validate, indent=2) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def append_record(jsonl_path: str | os.PathLike, record: Mapping, validate: bool = True) -> Path:
    """Append the record as one line to ``jsonl_path``.

    The line (newline included) goes out in a single ``write`` on an ``O_APPEND`` descriptor, then
    ``fsync``: concurrent writers on one machine do not interleave, and a crash leaves at most one
    damaged last line, which :func:`read_records` skips.
    """
    path = Path(jsonl_path)
    data = (dumps_record(record, validate=validate) + "\n").encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, data)
        while written < len(data):  # only on a full disk or a signal; the line is then no longer atomic
            written += os.write(fd, data[written:])
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def read_record(path: str | os.PathLike, validate: bool = True) -> dict[str, Any]:
    """One record from a ``.json`` file, validated unless told not to."""
    record = json.loads(Path(path).read_text(encoding="utf-8"))
    if validate:
        check_record(record)
    return record


def read_records(jsonl_path: str | os.PathLike, validate: bool = False) -> list[dict[str, Any]]:
    """The records of a ``.jsonl`` file, in order.

    A line that is not a JSON object (a torn write, a hand edit), or with ``validate`` one that does
    not match the schema, is skipped with a warning naming the file and line number.
    """
    path = Path(jsonl_path)
    records: list[dict[str, Any]] = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as err:
                warnings.warn(f"{path}:{lineno}: skipped damaged record line ({err})", stacklevel=2)
                continue
            if not isinstance(record, dict):
                warnings.warn(f"{path}:{lineno}: skipped line that is not a JSON object", stacklevel=2)
                continue
            if validate:
                errors = validate_record(record)
                if errors:
                    warnings.warn(f"{path}:{lineno}: skipped invalid record ({errors[0]})", stacklevel=2)
                    continue
            records.append(record)
    return records
