"""The run record: one JSON object per run, whatever loop produced it; its typed schema, validation and files.

To run (regenerates the tables of docs/record-schema.md): ``uv run python -m modelwright.record``"""

import dataclasses
import datetime as _dt
import functools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import typing
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from modelwright import REPO_ROOT

#: 2: the timing of whole epochs and the CPU time, ``hardware.vector_isa``, the ``running`` status. 3: the
#: network by class path, the fine-tune (``init_weights``, ``frozen``, ``trainable_parameters``), the
#: checkpointing policy's name, ``config.model``/``config.data`` as class path and init_args. Records of
#: versions 1 and 2 are still read: every key they have means what it meant.
SCHEMA_VERSION = 3
SCHEMA_VERSIONS = (1, 2, SCHEMA_VERSION)
#: Bumped when what a figure means changes (the MFU peak, the anatomy categories): records of different
#: definitions are not put in one table. 3: MFU against the hardware peak; inputs and comm_buffers categories.
#: 4: ``timing.epoch_time_s`` measured (it was steps × the median step), the history at 0-based step indices.
DEFINITIONS_VERSION = 4


class RecordError(ValueError):
    """A record that does not match the schema; the message lists every problem, one per line."""


def _field(doc: str, unit: str | None = None, *, choices: tuple | None = None, signed: bool = False,
           key: str | None = None, optional: bool = False, default: Any = None) -> Any:
    """A schema field; ``key``: its JSON name if not its own; a class ``default`` is a factory."""
    meta = {"doc": doc, "unit": unit, "choices": choices, "signed": signed, "key": key, "optional": optional}
    if isinstance(default, type):
        return dataclasses.field(default_factory=default, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass
class Techniques:
    """The techniques **as applied** (read from the run, not only the config)."""

    model_name: str | None = _field("Network's short name: resnet18, smallcnn, vit, else its class name.")
    network: str | None = _field("The network's class path.", optional=True)
    precision: str | None = _field(
        "Precision as applied, e.g. bf16-mixed (Lightning turns 16-mixed into bf16 on CPU).")
    precision_requested: str | None = _field("Precision as configured; null if unknown.")
    accumulate_grad_batches: int | None = _field("Micro-batches per optimizer step.")
    gradient_checkpointing: str | None = _field(
        "Checkpointing policy: off, children, a policy the network names (stage, block), or module classes "
        "and names joined by +.")
    checkpointed_segments: int | None = _field("Modules recomputed in backward.", "modules", optional=True)
    init_weights: str | None = _field("The weights file the run started from (its name); null: none.",
                                      optional=True)
    frozen: list | None = _field("Parameter-name prefixes trained no further.", optional=True)
    trainable_parameters: int | None = _field("Parameters (elements) that train.", "parameters",
                                              optional=True)
    optimizer: str | None = _field("Optimizer as configured: adamw, sgd, adafactor; null: the "
                                   "LightningModule's own.")
    optimizer_impl: str | None = _field(
        "Optimizer class that ran and its kernel: [for-loop], [foreach] or [fused].")
    channels_last: bool | None = _field("Whether conv weights are in channels_last memory format.")
    compile: bool | str | None = _field("Whether the network runs through torch.compile (or the mode name).")
    strategy: str | None = _field("single_device, ddp, fsdp, model_parallel, ...")
    world_size: int | None = _field("Processes training together.", "processes")
    num_nodes: int | None = _field("Machines taking part.", "machines")
    micro_batch_size: int | None = _field("Samples per device per forward pass.", "samples")
    effective_batch_size: int | None = _field(
        "Samples per optimizer step: micro × accumulate × world_size.", "samples")


@dataclasses.dataclass
class Hardware:
    """The machine of rank 0."""

    accelerator: str | None = _field("Device type: cpu, cuda, mps, ...")
    device_name: str | None = _field("GPU name, or the CPU model on a CPU run.")
    device_memory_mib: float | None = _field("The GPU's memory, or the machine's RAM on a CPU run.", "MiB")
    cpu_model: str | None = _field("CPU model name (/proc/cpuinfo).")
    cpu_cores: int | None = _field("Logical CPUs of the machine.")
    vector_isa: str | None = _field("The CPU's widest vector instruction set: avx512, avx2, neon, asimd.",
                                    optional=True)
    num_devices: int | None = _field("Devices this run used per node.")


@dataclasses.dataclass
class Versions:
    """Software versions."""

    python: str | None = _field("Python version.")
    torch: str | None = _field("PyTorch version.")
    lightning: str | None = _field("Lightning version (null if not installed).")
    torchvision: str | None = _field("torchvision version.")
    accelerate: str | None = _field("Hugging Face Accelerate version.")
    cuda: str | None = _field(
        "CUDA version PyTorch was built with (set without a GPU too; null for a CPU build).")


@dataclasses.dataclass
class Timing:
    """Optimizer steps timed on a synchronized clock, without the warm-up and the step whose anatomy is
    captured."""

    warmup_steps: int | None = _field("Optimizer steps excluded before the window.", "steps")
    measured_steps: int | None = _field("Optimizer steps timed in the window.", "steps")
    step_time_median_ms: float | None = _field(
        "Median time of one optimizer step (all its micro-batches).", "ms")
    step_time_p90_ms: float | None = _field("90th percentile of step time (linear interpolation).", "ms")
    step_time_min_ms: float | None = _field("Fastest measured step.", "ms")
    step_time_max_ms: float | None = _field("Slowest measured step.", "ms")
    steps_per_epoch: int | None = _field("Optimizer steps per training epoch.", "steps")
    epoch_time_s: float | None = _field(
        "Wall time of the last whole training epoch: its steps, data loading and the validations inside it; "
        "null if no epoch ran to its end.", "s")
    epoch_steps: int | None = _field("Optimizer steps in that epoch.", "steps", optional=True)
    epoch_validation_s: float | None = _field(
        "Time of the validations inside that epoch.", "s", optional=True)
    epoch_validations: int | None = _field("Validations inside that epoch.", optional=True)
    samples_per_s: float | None = _field("effective_batch_size ÷ median step time.", "samples/s")
    wall_time_s: float | None = _field("Wall-clock time of the whole fit, validation included.", "s")
    cpu_time_s: float | None = _field(
        "CPU time (user + system, all threads) of the process over the fit.", "s", optional=True)
    step_cpu_utilization: float | None = _field(
        "CPU time during the measured steps ÷ (their wall time × the threads torch uses): near 1 when the "
        "cores were the run's alone.", "fraction", optional=True)


@dataclasses.dataclass
class Flops:
    """Model FLOPs (no recomputation) counted once on a meta-device copy; MFU divides by the **hardware**
    peak."""

    flops_per_step: float | None = _field(
        "FLOPs of one optimizer step on one device (forward + backward).", "FLOP")
    achieved_flops_per_s: float | None = _field("flops_per_step ÷ median step time, per device.", "FLOP/s")
    peak_flops_per_s: float | None = _field("Hardware peak of one device in the compute dtype.", "FLOP/s")
    peak_flops_source: str | None = _field(
        "A GPU's dense datasheet figure, Lightning's table for a GPU without one, CPU cores × FLOP/cycle × "
        "clock, or config.", choices=("datasheet", "lightning-table", "cpu-isa-clock", "config", None))
    peak_flops_method: str | None = _field(
        "The arithmetic behind the peak (and TF32 use on a GPU).", optional=True)
    mfu: float | None = _field("Model FLOPs utilisation: achieved ÷ peak.", "fraction")


@dataclasses.dataclass
class Anatomy:
    """Where the tensor memory of one captured step went (``MemoryAnatomy``: PyTorch's MemTracker), by
    category."""

    parameters: float | None = _field("Model parameters.", "MiB")
    buffers: float | None = _field("Module buffers (BatchNorm statistics).", "MiB")
    gradients: float | None = _field("Parameter gradients.", "MiB")
    optimizer_state: float | None = _field("Optimizer state (moments, step counters).", "MiB")
    activations: float | None = _field("Made in forward.", "MiB")
    temporaries: float | None = _field("Made in backward.", "MiB")
    comm_buffers: float | None = _field(
        "Handed to an all-reduce: DDP's gradient buckets.", "MiB", optional=True)
    inputs: float | None = _field(
        "The data: dataset storage and batches; not in total.", "MiB", optional=True)
    other: float | None = _field("Anything else the tracker saw.", "MiB")
    total: float | None = _field("The sum of all but inputs.", "MiB")


#: Where tensor memory goes; ``ANATOMY_KEYS`` adds ``total``.
ANATOMY_KEYS = tuple(schema_field.name for schema_field in dataclasses.fields(Anatomy))
ANATOMY_CATEGORIES = ANATOMY_KEYS[:-1]


@dataclasses.dataclass
class Memory:
    """Peak tensor memory, and the anatomy of one captured step."""

    peak_allocated_mib: float | None = _field(
        "CUDA max_memory_allocated in the window, else the anatomy's total.", "MiB")
    peak_reserved_mib: float | None = _field("CUDA max_memory_reserved over the window; null on CPU.", "MiB")
    anatomy_step: int | None = _field("Optimizer step whose anatomy was captured.", "step")
    anatomy_mib: Anatomy | None = _field(
        "Tensor memory by category at the captured step's peak; null if not measured.")
    anatomy_end_mib: Anatomy | None = _field(
        "The same categories when the captured step ended.", optional=True)
    anatomy_caveat: str | None = _field(
        "Why the anatomy is absent (torch.compile) or suspect.", optional=True)
    model_parameters: int | None = _field("Number of model parameters (elements).", "parameters")
    rss_peak_mib: float | None = _field(
        "Process RSS high-water mark: not a tensor peak (freed pages are kept).", "MiB")


@dataclasses.dataclass
class Metrics:
    """Final values; every other scalar Lightning logged (not perf/ or mem/) is added under its own name."""

    train_loss: float | None = _field(
        "Last logged training loss (of a micro-batch).", key="train/loss", signed=True)
    train_acc: float | None = _field("Last logged training accuracy.", key="train/acc", signed=True)
    val_loss: float | None = _field("Loss of the last validation.", key="val/loss", signed=True)
    val_acc: float | None = _field("Accuracy of the last validation.", key="val/acc", signed=True)


@dataclasses.dataclass
class Provenance:
    """Where the record came from: reports refuse to mix commits or definitions in one table."""

    commit: str | None = _field("Git commit of the checkout.")
    dirty: bool | None = _field("Whether tracked files had uncommitted changes.")
    command: str | None = _field("The command line that produced the record.")
    definitions: int | None = _field("DEFINITIONS_VERSION: what MFU and the anatomy categories mean.")


@dataclasses.dataclass
class RunRecord:
    """One run."""

    schema_version: int = _field("Version of this schema (version 1 records are still read).",
                                 choices=SCHEMA_VERSIONS, default=SCHEMA_VERSION)
    run_id: str = _field("Unique id of the run (the caller's, or UTC time + random suffix).", default="")
    status: str = _field("How the run ended; ``running`` while it runs.",
                         choices=("ok", "failed", "diverged", "interrupted", "oom", "running"), default="ok")
    error: str | None = _field("One line, Type: message, for every status but ok (may be set for diverged).")
    loop: str = _field("The training loop that wrote it.", choices=("lightning", "accelerate", "raw"),
                       default="lightning")
    created_at: str = _field("When the record was written, ISO 8601 with UTC offset.", default="")
    config: dict = _field("The resolved configuration (LightningCLI's), or {}.", default=dict)
    techniques: Techniques = _field("", default=Techniques)
    hardware: Hardware = _field("", default=Hardware)
    versions: Versions = _field("", default=Versions)
    timing: Timing = _field("", default=Timing)
    flops: Flops = _field("", default=Flops)
    memory: Memory = _field("", default=Memory)
    metrics: Metrics = _field("", default=Metrics)
    history: dict = _field("Metric name → [[optimizer step, value], ...] in step order.", default=dict)
    provenance: Provenance = _field("", default=Provenance)
    faults: dict | None = _field("The divergence check: its policy, whether and where the run diverged, the "
                                 "steps it skipped.", optional=True)
    profile: dict | None = _field("The planner's measured profile of the run.", optional=True)
    prediction: dict | None = _field("What the planner predicted for the run.", optional=True)
    study: dict | None = _field("The study's facts about the run (name, repeat, command).", optional=True)


METRIC_KEYS = tuple(schema_field.metadata["key"] for schema_field in dataclasses.fields(Metrics))


def _accepted_type(annotation: Any, section: type | None) -> Any:
    """One member of a field's type as :func:`schema_fields` lists it: ``None`` for null, ``dict`` for a
    section."""
    if annotation is type(None):
        return None
    if annotation is section:
        return dict
    return annotation


@functools.cache
def schema_fields(cls: type = RunRecord) -> tuple[tuple[str, dict, type | None, tuple], ...]:
    """``cls``'s fields as ``(JSON key, metadata, section class or None, accepted types)``; ``None`` among the
    types allows null, ``dict`` stands for a section."""
    described = []
    for schema_field in dataclasses.fields(cls):
        members = typing.get_args(schema_field.type) or (schema_field.type,)
        section = next((member for member in members if dataclasses.is_dataclass(member)), None)
        accepted = tuple(_accepted_type(member, section) for member in members)
        key = schema_field.metadata["key"] or schema_field.name
        described.append((key, schema_field.metadata, section, accepted))
    return tuple(described)


def _type_ok(value: Any, accepted: tuple) -> bool:
    """JSON's view of types: an int is also a float, a bool is not an int."""
    if value is None:
        return None in accepted
    if isinstance(value, bool):
        return bool in accepted
    if isinstance(value, int) and float in accepted:
        return True
    return any(kind and isinstance(value, kind) for kind in accepted)


def _type_names(accepted: tuple) -> str:
    return " | ".join("null" if kind is None else kind.__name__ for kind in accepted)


def _check(prefix: str, record: Mapping, cls: type, errors: list[str]) -> None:
    for key, meta, section, accepted in schema_fields(cls):
        path = prefix + key
        value = record.get(key)
        if key not in record:
            if not meta["optional"]:
                errors.append(f"{path}: missing")
        elif section is not None and isinstance(value, Mapping):
            _check(path + ".", value, section, errors)
        elif not _type_ok(value, accepted):
            got = f"{type(value).__name__} {value!r:.60}"
            errors.append(f"{path}: expected {_type_names(accepted)}, got {got}")
        elif meta["choices"] is not None and value not in meta["choices"]:
            errors.append(f"{path}: {value!r} is not one of {list(meta['choices'])}")
        elif isinstance(value, float) and not math.isfinite(value):
            errors.append(f"{path}: non-finite number {value!r}")
        elif not meta["signed"] and type(value) in (int, float) and value < 0:
            errors.append(f"{path}: negative value {value!r}")


def _history_point_ok(points: list, index: int) -> bool:
    """``points[index]`` is ``[int step, number or null]`` and not before the point ahead of it."""
    point = points[index]
    well_formed = (isinstance(point, (list, tuple)) and len(point) == 2 and _type_ok(point[0], (int,))
                   and _type_ok(point[1], (float, None)))
    return well_formed and not (index and point[0] < points[index - 1][0])


def _check_history(history: Any, errors: list[str]) -> None:
    if not isinstance(history, Mapping):
        return
    for name, points in history.items():
        if not isinstance(points, list):
            errors.append(f"history.{name}: expected a list of [int step, number or null], "
                          f"got {points!r:.60}")
            continue
        for index, point in enumerate(points):
            if not _history_point_ok(points, index):
                errors.append(f"history.{name}[{index}]: expected [int step, number or null] in step order, "
                              f"got {point!r:.60}")
                break


def _check_effective_batch(record: Mapping, errors: list[str]) -> None:
    keys = ("micro_batch_size", "accumulate_grad_batches", "world_size")
    parts = [get_path(record, f"techniques.{key}") for key in keys]
    effective = get_path(record, "techniques.effective_batch_size")
    if all(isinstance(part, int) for part in [*parts, effective]) and effective != math.prod(parts):
        errors.append(f"techniques.effective_batch_size: {effective} != micro × accumulate × world_size = "
                      f"{math.prod(parts)}")


def validate_record(record: Any) -> list[str]:
    """Every way ``record`` departs from the schema, one message per problem (empty when valid)."""
    if not isinstance(record, Mapping):
        return [f"record: expected an object, got {type(record).__name__}"]
    errors: list[str] = []
    _check("", record, RunRecord, errors)
    _check_history(record.get("history"), errors)
    if record.get("status") in ("failed", "interrupted", "oom") and not record.get("error"):
        errors.append(f"error: status {record['status']!r} needs a one-line error message")
    _check_effective_batch(record, errors)
    return errors


def check_record(record: Any) -> Any:
    """``record``, or :class:`RecordError` listing every problem if it does not match the schema."""
    if errors := validate_record(record):
        raise RecordError("invalid run record:\n" + "\n".join(errors))
    return record


def get_path(mapping: Any, path: str, default: Any = None) -> Any:
    """``mapping["a"]["b"]`` for ``path`` ``"a.b"``; ``default`` where a part is missing. A section given by
    class path (``{"class_path": ..., "init_args": {...}}``, as LightningCLI resolves ``model`` and
    ``data``) is read through its ``init_args``: ``model.lr`` is ``model.init_args.lr``."""
    for part in path.split("."):
        nested = isinstance(mapping, Mapping) and isinstance(mapping.get("init_args"), Mapping)
        if nested and part not in mapping:
            mapping = mapping["init_args"]
        if not isinstance(mapping, Mapping) or part not in mapping:
            return default
        mapping = mapping[part]
    return mapping


def with_values(config: Mapping, values: Mapping[str, Any]) -> dict:
    """A copy of ``config`` (resolved, nested) with dotted ``values`` set; a section given by class path takes
    them in its ``init_args``."""
    changed = json.loads(json.dumps(to_jsonable(config)))
    for key, value in values.items():
        section, name = key.split(".", 1)
        target = changed.setdefault(section, {})
        if isinstance(target.get("init_args"), dict) and name.split(".")[0] not in target:
            target = target["init_args"]
        *parents, last = name.split(".")
        for parent in parents:
            target = target.setdefault(parent, {})
        target[last] = value
    return changed


def now_iso() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def _as_dict(obj: Any) -> Any:
    if not dataclasses.is_dataclass(obj):
        return obj
    as_dict = {}
    for schema_field in dataclasses.fields(obj):
        value = getattr(obj, schema_field.name)
        if schema_field.metadata["optional"] and value is None:
            continue
        as_dict[schema_field.metadata["key"] or schema_field.name] = _as_dict(value)
    return as_dict


def _git(*args: str) -> str | None:
    """``git ARGS``'s output in the checkout, or None where git fails or is missing."""
    try:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip()


def provenance(command: list[str] | None = None) -> dict[str, Any]:
    """The record's ``provenance``: the checkout's commit (``dirty`` if tracked files changed; in a copy
    without git history, such as the GPU machine's, ``$MODELWRIGHT_COMMIT`` names it, dirty unknown), the
    command line (``$MODELWRIGHT_COMMAND`` when a parent, such as the study, set it), and
    :data:`DEFINITIONS_VERSION`."""
    commit = _git("rev-parse", "HEAD")
    dirty = None
    if commit is None:
        commit = os.environ.get("MODELWRIGHT_COMMIT") or None
    elif commit:
        changes = _git("status", "--porcelain", "--untracked-files=no")
        dirty = None if changes is None else bool(changes)
    line = os.environ.get("MODELWRIGHT_COMMAND")
    if command is not None:
        line = " ".join(command)
    if not line:
        line = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    return {"commit": commit, "dirty": dirty, "command": line, "definitions": DEFINITIONS_VERSION}


def build_record(*, loop: str = "lightning", status: str = "ok", error: str | None = None,
                 run_id: str | None = None, command: list[str] | None = None,
                 **sections: Any) -> dict[str, Any]:
    """The one way to make a run record, whatever produced it: ``sections`` (top-level keys) of the schema are
    merged over their skeleton, so a writer gives only what it measured; with none, every key of the schema
    and nothing measured. The default ``run_id`` sorts by time; ``provenance``, unless given, is read from
    git."""
    run_id = run_id or f"{_dt.datetime.now(_dt.timezone.utc):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:8]}"
    record = _as_dict(RunRecord(run_id=run_id, status=status, error=error, loop=loop, created_at=now_iso()))
    record["provenance"] = sections.pop("provenance", None) or provenance(command)
    for key, value in sections.items():
        merges = isinstance(record.get(key), dict)  # config and history too: over their empty skeleton
        if merges and isinstance(value, Mapping):
            record[key] = {**record[key], **value}
        elif value is not None:
            record[key] = value
    return to_jsonable(record)


def to_jsonable(obj: Any) -> Any:
    """``obj`` as plain JSON values: tensors and numpy scalars to numbers, paths and unknowns to str, tuples
    to lists, non-finite floats to ``None``."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if obj is None or isinstance(obj, (bool, str, int, float)):
        return obj
    if isinstance(obj, Mapping):
        return {str(key): to_jsonable(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(value) for value in obj]
    if callable(getattr(obj, "item", None)) and getattr(obj, "ndim", 0) == 0:  # tensors, numpy scalars
        return to_jsonable(obj.item())
    if callable(getattr(obj, "as_dict", None)):  # jsonargparse Namespace
        return to_jsonable(obj.as_dict())
    return str(obj)


def _dumps(record: Mapping, validate: bool, indent: int | None = None) -> str:
    data = to_jsonable(record)
    if validate:
        check_record(data)
    return json.dumps(data, indent=indent, allow_nan=False, ensure_ascii=False)


def os_error(err: BaseException) -> OSError | None:
    """The ``OSError`` behind ``err``: itself, or one in its chain (``torch.save`` on a full disk raises
    ``RuntimeError: [enforce fail at inline_container.cc] ... unexpected pos``, the file's ENOSPC only its
    context)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError) and err.errno is not None:
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def write_atomic(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """``write(file)`` into a temp file beside ``path``, fsync, ``os.replace`` onto ``path``, mode 0644: a
    kill or a full disk leaves the previous file whole and no temp file; a failed write's ``OSError`` (also
    one a writer such as ``torch.save`` wrapped in its own error) is raised naming ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600: results are for every reader
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        cause = os_error(err)
        if cause is not None and not (cause is err and err.filename):
            raise OSError(cause.errno, cause.strerror, str(path)) from err
        raise
    return path


def remove_stale_temp_files(path: str | os.PathLike) -> list[Path]:
    """Remove the temp files :func:`write_atomic` leaves beside ``path`` when a kill cuts a write short."""
    path = Path(path)
    stale = list(path.parent.glob(f".{path.name}.*.tmp"))  # none in a folder that does not exist
    for temp in stale:
        temp.unlink(missing_ok=True)
    return stale


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    return write_atomic(path, lambda file: file.write(text.encode("utf-8")))


def write_record(path: str | os.PathLike, record: Mapping, validate: bool = True) -> Path:
    return write_text_atomic(path, _dumps(record, validate, indent=2) + "\n")


def append_record(jsonl_path: str | os.PathLike, record: Mapping, validate: bool = True) -> Path:
    """Append the record as one line: a single ``write`` on an ``O_APPEND`` descriptor, so that concurrent
    writers on one machine do not interleave; a torn last line (a crash) is terminated first, for the new
    line's sake."""
    path = Path(jsonl_path)
    data = (_dumps(record, validate) + "\n").encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        written = os.write(fd, data)
        while written < len(data):  # only on a full disk or a signal; the line is then no longer atomic
            written += os.write(fd, data[written:])
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def read_record(path: str | os.PathLike, validate: bool = True) -> dict[str, Any]:
    record = json.loads(Path(path).read_text(encoding="utf-8"))
    if validate:
        check_record(record)
    return record


def read_records(jsonl_path: str | os.PathLike, validate: bool = False) -> list[dict[str, Any]]:
    """The records of a ``.jsonl`` file, in order; a line that is not a JSON object (a torn write, a hand
    edit), or with ``validate`` one that does not match the schema, is skipped with a warning naming file and
    line."""
    records: list[dict[str, Any]] = []
    for lineno, raw in enumerate(Path(jsonl_path).read_bytes().split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError as err:  # UnicodeDecodeError is one too
            warnings.warn(f"{jsonl_path}:{lineno}: skipped damaged record line ({err})", stacklevel=2)
            continue
        problems = []
        if validate or not isinstance(record, dict):
            problems = validate_record(record)
        if problems:
            warnings.warn(f"{jsonl_path}:{lineno}: skipped invalid record ({problems[0]})", stacklevel=2)
        else:
            records.append(record)
    return records


SCHEMA_DOC = REPO_ROOT / "docs" / "record-schema.md"


def _markdown_type(accepted: tuple, section: type | None) -> str:
    names = []
    for kind in accepted:
        if kind is None:
            names.append("null")
        elif section is not None and kind is dict:
            names.append("object")
        else:
            names.append(kind.__name__)
    return " \\| ".join(names)


def _markdown_row(key: str, meta: dict, section: type | None, accepted: tuple) -> str:
    doc = meta["doc"]
    if section is not None:
        name = section.__name__.lower()
        link = f"[`{name}`](#{name})"
        doc = f"{doc} See {link}." if doc else f"Section {link}."
    if meta["choices"]:
        doc += f" One of {', '.join(f'`{choice}`' for choice in meta['choices'] if choice)}."
    if meta["optional"]:
        doc += " *Optional.*"
    return f"| `{key}` | {_markdown_type(accepted, section)} | {meta['unit'] or ''} | {doc} |"


def schema_markdown() -> str:
    """:data:`SCHEMA_DOC`: its prose before the first table as written there, the tables from
    :class:`RunRecord` and its sections."""
    head = SCHEMA_DOC.read_text(encoding="utf-8").split("\n## ")[0].rstrip("\n")
    parts = [re.sub(r"schema version \d+", f"schema version {SCHEMA_VERSION}", head, count=1), ""]
    sections = [RunRecord]
    for cls in sections:  # grows as sections are met: breadth first
        if cls is RunRecord:
            parts.append("## Top level")
        else:
            parts += [f"## `{cls.__name__.lower()}`", "", " ".join(cls.__doc__.split())]
        parts += ["", "| key | type | unit | meaning |", "|---|---|---|---|"]
        for key, meta, section, accepted in schema_fields(cls):
            if section is not None and section not in sections:
                sections.append(section)
            parts.append(_markdown_row(key, meta, section, accepted))
        parts.append("")
    return "\n".join(parts)


if __name__ == "__main__":
    print(write_text_atomic(SCHEMA_DOC, schema_markdown()))
