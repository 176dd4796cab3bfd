"""The efficiency study: a plan of experiment configs, each trained for a short measured window in a fresh process.

To run: ``uv run python -m modelwright study`` (the default plan, ``configs/study/plan_default.yaml``);
``--plan configs/study/plan_vit.yaml`` for another plan, ``--accelerator cuda`` on a GPU, ``--help`` for the rest.

Each run is ``python main.py fit --config <experiment delta> ...`` in its own process (so a run's peak
memory, compiled graphs and allocator state never leak into the next), with overrides that set the
measured window: ``warmup_steps`` unmeasured steps, one step whose tensor-memory anatomy is captured
(the step timer leaves it out, the tracker slows it down), then ``measured_steps`` timed steps, and
``val_batches`` validation batches at the end. The run's record (``record.json``, written by
``callbacks.run_record.RunRecord``) gets a ``study`` section and is appended to
``results/<hardware-slug>/records.jsonl``; then :mod:`modelwright.report` writes the table, the plots
and the README section.

Robustness:

* a run whose resolved config (and hardware slug) already has a record is skipped, so an interrupted
  study resumes where it stopped; ``--retry-failed`` runs the failed ones again, ``--rerun`` everything;
* a run that crashes or runs out of memory is recorded (status ``failed``/``oom``, its error and the
  tail of its output) and the study goes on;
* records are appended with one ``O_APPEND`` write each (:func:`modelwright.record.append_record`).

Largest batch per memory budget: for each run named in the plan's ``budget.runs``, the measured
anatomy gives a per-sample part (activations and backward temporaries, which grow with the batch) and
a fixed part (parameters, gradients, optimizer state, the rest); the largest micro-batch whose
predicted peak fits ``budget.gib`` is then run once to confirm it. A run that accumulates is first
measured at its micro-batch without accumulation (a probe), so that prediction and confirmation share
one setup. If the confirmation lands over the budget, a line through the two measured points gives a
second, final prediction.

On a GPU: ``--accelerator cuda --budget-gib 20`` (more steps give steadier times: ``--steps 20
--warmup-steps 5``); the results go to ``results/cuda-<gpu name>/``, beside the CPU's.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from modelwright import REPO_ROOT
from modelwright.errors import ConfigError, require
from modelwright.record import append_record, get_path, new_record, read_records, to_jsonable, validate_record

BASE_CONFIG = REPO_ROOT / "configs" / "base.yaml"
DEFAULT_PLAN = REPO_ROOT / "configs" / "study" / "plan_default.yaml"
MIB_PER_GIB = 1024

#: Anatomy categories that grow linearly with the micro-batch. Backward temporaries at the peak are
#: mostly gradients of activations, so they scale with the batch as the activations do.
SCALES_WITH_BATCH = ("activations", "temporaries")
#: Statuses that count as "recorded" for resume. A run the user interrupted is not a result; a failed
#: or out-of-memory run is (``--retry-failed`` runs those again).
DONE_STATUSES = ("ok", "oom", "diverged", "failed")
RETRY_STATUSES = ("failed", "oom")
#: Confirmation runs per budget run: the anatomy prediction, then one two-point correction if it lands over.
BUDGET_ATTEMPTS = 2
PLAN_KEYS = {"model", "warmup_steps", "measured_steps", "repeats", "val_batches", "budget", "runs", "description"}
ENTRY_KEYS = {"name", "config", "overrides", "accelerators", "vary_batch", "description"}
_CLASS_SUFFIX = {
    "timer": "StepTimeMonitor",
    "memory": "MemoryMonitor",
    "record": "RunRecord",
    "checkpoint": "ModelCheckpoint",
}


# --------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------


@dataclass
class Entry:
    """One experiment of a plan: a config delta plus overrides, run under a name."""

    name: str
    config: str | None
    overrides: dict[str, Any] = field(default_factory=dict)
    accelerators: list[str] | None = None
    vary_batch: bool = False
    description: str | None = None


@dataclass
class Plan:
    """A study plan file (``configs/study/plan_*.yaml``)."""

    path: str
    entries: list[Entry]
    model: str | None = None
    warmup_steps: int = 1
    measured_steps: int = 3
    repeats: int = 1
    val_batches: int = 2
    budget_gib: float | None = None
    budget_runs: list[str] = field(default_factory=list)
    description: str | None = None


def _rel(path: str | os.PathLike) -> str:
    """``path`` relative to the repository root when it lies inside it (records name no machine paths)."""
    p = Path(path)
    try:
        resolved = p.resolve()
        return Path(os.path.relpath(resolved, REPO_ROOT)).as_posix() if resolved.is_relative_to(REPO_ROOT) else str(p)
    except (OSError, ValueError):
        return str(p)


def _positive_int(value: Any, key: str, minimum: int = 1) -> int:
    require(
        isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
        f"{key}: must be an integer >= {minimum}, got {value!r}",
    )
    return value


def load_plan(path: str | os.PathLike) -> Plan:
    """Read and check a plan file; a problem raises :class:`ConfigError` naming the file and key."""
    path = Path(path)
    where = _rel(path)
    require(path.is_file(), f"--plan: no plan file at {where}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: not valid YAML ({' '.join(str(err).split())})") from None
    require(isinstance(data, dict), f"{where}: a plan is a mapping with a 'runs' list")
    unknown = sorted(set(data) - PLAN_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; valid: {', '.join(sorted(PLAN_KEYS))}")
    runs = data.get("runs")
    require(isinstance(runs, list) and runs, f"{where}: runs: must be a non-empty list of {{name, config}}")
    entries: list[Entry] = []
    for i, item in enumerate(runs):
        key = f"{where}: runs[{i}]"
        require(isinstance(item, dict) and isinstance(item.get("name"), str), f"{key}: needs a 'name'")
        unknown = sorted(set(item) - ENTRY_KEYS)
        if unknown:
            raise ConfigError(f"{key}: unknown key {unknown[0]!r}; valid: {', '.join(sorted(ENTRY_KEYS))}")
        name = item["name"]
        require(
            re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", name) is not None, f"{key}.name: {name!r} is not a plain name"
        )
        require(name not in {e.name for e in entries}, f"{key}.name: {name!r} appears twice")
        config = item.get("config")
        if config is not None:
            require(isinstance(config, str), f"{key}.config: must be a path")
            require((REPO_ROOT / config).is_file(), f"{key}.config: no config file at {config}")
        overrides = item.get("overrides") or {}
        require(isinstance(overrides, dict), f"{key}.overrides: must be a mapping of dotted keys to values")
        accelerators = item.get("accelerators")
        require(
            accelerators is None or (isinstance(accelerators, list) and all(isinstance(a, str) for a in accelerators)),
            f"{key}.accelerators: must be a list such as [cuda]",
        )
        entries.append(
            Entry(
                name,
                config,
                dict(overrides),
                accelerators,
                bool(item.get("vary_batch", False)),
                item.get("description"),
            )
        )
    budget = data.get("budget") or {}
    require(isinstance(budget, dict), f"{where}: budget: must be a mapping {{gib, runs}}")
    budget_gib = budget.get("gib")
    require(
        budget_gib is None or (isinstance(budget_gib, (int, float)) and budget_gib > 0),
        f"{where}: budget.gib: must be a positive number, got {budget_gib!r}",
    )
    budget_runs = budget.get("runs") or []
    names = {e.name for e in entries}
    for name in budget_runs:
        require(name in names, f"{where}: budget.runs: {name!r} is not a run of this plan")
    model = data.get("model")
    require(model is None or isinstance(model, str), f"{where}: model: must be a model name")
    return Plan(
        path=where,
        entries=entries,
        model=model,
        warmup_steps=_positive_int(data.get("warmup_steps", 1), f"{where}: warmup_steps", 0),
        measured_steps=_positive_int(data.get("measured_steps", 3), f"{where}: measured_steps"),
        repeats=_positive_int(data.get("repeats", 1), f"{where}: repeats"),
        val_batches=_positive_int(data.get("val_batches", 2), f"{where}: val_batches", 0),
        budget_gib=float(budget_gib) if budget_gib is not None else None,
        budget_runs=list(budget_runs),
        description=data.get("description"),
    )


# --------------------------------------------------------------------------------------------------
# Resolving a run's config (base.yaml, then the delta, then dotted overrides; lists replace)
# --------------------------------------------------------------------------------------------------


def deep_merge(base: dict, delta: Mapping) -> dict:
    """``delta`` merged into a copy of ``base``: mappings merge key by key, everything else replaces."""
    out = copy.deepcopy(base)
    for key, value in delta.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def set_dotted(config: dict, key: str, value: Any) -> None:
    """Set ``a.b.c`` in a nested dict, creating (or replacing non-dict) levels on the way."""
    parts = key.split(".")
    node = config
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = copy.deepcopy(value)


get_dotted = get_path  # the study reads configs and records alike by dotted key


def _load_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{_rel(path)}: cannot read ({' '.join(str(err).split())})") from None
    require(isinstance(data, dict), f"{_rel(path)}: a config file is a mapping")
    return data


def resolve_config(config_files: Sequence[str | os.PathLike], overrides: Mapping[str, Any]) -> dict:
    """The config a run will see: ``configs/base.yaml``, each file in order, then the dotted overrides.

    This mirrors LightningCLI closely enough to read batch size, accumulation and devices and to hash
    a run's identity; the child process's own parse is the authority on what runs.
    """
    config = _load_yaml(BASE_CONFIG)
    for f in config_files:
        config = deep_merge(config, _load_yaml(REPO_ROOT / f))
    for key, value in overrides.items():
        set_dotted(config, key, value)
    return config


def config_hash(resolved: Mapping, slug: str) -> str:
    """A short stable id of a run's resolved config on one hardware slug (what resume compares)."""
    text = json.dumps({"config": to_jsonable(resolved), "slug": slug}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def _cli_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def _world_size(resolved: Mapping) -> int:
    devices = get_dotted(resolved, "trainer.devices", 1)
    nodes = get_dotted(resolved, "trainer.num_nodes", 1)
    devices = devices if isinstance(devices, int) and devices > 0 else 1
    nodes = nodes if isinstance(nodes, int) and nodes > 0 else 1
    return devices * nodes


def effective_batch(resolved: Mapping) -> int | None:
    """Samples per optimizer step: micro-batch × accumulation × processes (``None`` if not an integer)."""
    micro = get_dotted(resolved, "data.batch_size")
    accumulate = get_dotted(resolved, "trainer.accumulate_grad_batches", 1)
    if not isinstance(micro, int) or not isinstance(accumulate, int):
        return None
    return micro * accumulate * _world_size(resolved)


def _class_name(callback: Any) -> str:
    return str(callback.get("class_path", "")).rsplit(".", 1)[-1] if isinstance(callback, dict) else ""


def patch_callbacks(callbacks: Any, warmup_steps: int, record_path: str | None) -> list[dict]:
    """The callbacks list of a study run: the measurement window set, no checkpoint files, the record path.

    Raises:
        ConfigError: the list has no ``RunRecord`` (the study could not read the run's result).
    """
    require(
        isinstance(callbacks, list) and any(_class_name(cb) == _CLASS_SUFFIX["record"] for cb in callbacks),
        "trainer.callbacks: the study needs callbacks.run_record.RunRecord in the list (configs/base.yaml)",
    )
    out: list[dict] = []
    for cb in callbacks:
        name = _class_name(cb)
        if name == _CLASS_SUFFIX["checkpoint"]:
            continue  # a study run saves no checkpoint
        cb = copy.deepcopy(cb)
        args = cb.setdefault("init_args", {}) or {}
        cb["init_args"] = args
        if name == _CLASS_SUFFIX["timer"]:
            args.update(warmup_steps=warmup_steps, measure_steps=None)
        elif name == _CLASS_SUFFIX["memory"]:
            args.update(warmup_steps=warmup_steps, anatomy=True, anatomy_step=None)
        elif name == _CLASS_SUFFIX["record"]:
            args.update(record_path=record_path, records_jsonl=None)
        out.append(cb)
    return out


# --------------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------------


@dataclass
class RunSpec:
    """One process to run: which entry, which repeat, its overrides, resolved config and identity."""

    name: str
    kind: str  # "run" or "budget"
    index: int  # position of the entry in the plan
    repeat: int
    config: str | None
    overrides: dict[str, Any]
    resolved: dict
    callbacks: list[dict]
    config_hash: str
    total_steps: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.kind, self.config_hash, self.repeat)

    @property
    def folder(self) -> str:
        """The run's folder name under the work directory (logs, output.log, record.json)."""
        return f"{self.name}-{self.config_hash}-{'b' if self.kind == 'budget' else 'r'}{self.repeat}"

    @property
    def label(self) -> str:
        if self.kind == "budget":
            return f"{self.name} @ batch {get_dotted(self.resolved, 'data.batch_size')} (budget)"
        return self.name


@dataclass
class Settings:
    """What the command line adds to a plan."""

    slug: str
    accelerator: str
    warmup_steps: int
    measured_steps: int
    repeats: int
    val_batches: int
    model: str | None
    set_overrides: dict[str, Any]


def build_spec(
    entry: Entry,
    index: int,
    settings: Settings,
    repeat: int = 0,
    kind: str = "run",
    batch_size: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> RunSpec:
    """The run of ``entry`` under ``settings``: overrides in order (model, ``--set``, the entry's own,
    then the study's window), resolved config and its hash."""
    # A window of a few steps is no schedule's intended length (OneCycleLR cannot even be built for
    # under 8 steps): a constant learning rate keeps every run's loss curve comparable. An entry's
    # own overrides may set a schedule again.
    overrides: dict[str, Any] = {"model.scheduler": "none"}
    if settings.model:
        overrides["model.model_name"] = settings.model
    overrides.update(settings.set_overrides)
    overrides.update(entry.overrides)
    if settings.accelerator != "auto":
        overrides["trainer.accelerator"] = settings.accelerator
    measured = settings.measured_steps
    val_batches = settings.val_batches
    if kind == "budget":
        # Only the peak matters: the anatomy step after the warm-up, one micro-batch per step.
        overrides["data.batch_size"] = batch_size
        overrides["trainer.accumulate_grad_batches"] = 1
        measured, val_batches = 0, 0
    files = [entry.config] if entry.config else []
    draft = resolve_config(files, overrides)
    accumulate = get_dotted(draft, "trainer.accumulate_grad_batches", 1)
    micro = get_dotted(draft, "data.batch_size", 1)
    accumulate = accumulate if isinstance(accumulate, int) and accumulate > 0 else 1
    micro = micro if isinstance(micro, int) and micro > 0 else 1
    # warm-up steps, the anatomy step (left out of the timing), the measured steps: one short "epoch"
    # so that validation runs at its end.
    total = settings.warmup_steps + 1 + measured
    train_size = get_dotted(draft, "data.train_size", 0)
    needed = total * accumulate * micro * _world_size(draft)
    window = {
        "trainer.max_epochs": 1,
        "trainer.max_steps": total,
        "trainer.limit_train_batches": total * accumulate,
        "trainer.limit_val_batches": val_batches,
        "trainer.num_sanity_val_steps": 0,
        "trainer.log_every_n_steps": 1,
        "trainer.enable_checkpointing": False,
        "trainer.enable_progress_bar": False,
        "trainer.enable_model_summary": False,
    }
    if not isinstance(train_size, int) or train_size < needed:
        window["data.train_size"] = needed
    overrides.update(window)
    resolved = resolve_config(files, overrides)
    callbacks = patch_callbacks(get_dotted(resolved, "trainer.callbacks"), settings.warmup_steps, None)
    set_dotted(resolved, "trainer.callbacks", callbacks)
    return RunSpec(
        name=entry.name,
        kind=kind,
        index=index,
        repeat=repeat,
        config=entry.config,
        overrides=overrides,
        resolved=resolved,
        callbacks=callbacks,
        config_hash=config_hash(resolved, settings.slug),
        total_steps=total,
        extra=dict(extra or {}),
    )


def command(spec: RunSpec, run_dir: Path) -> list[str]:
    """The child's argument list (after the interpreter), with paths relative to the repository root."""
    rel = _rel(run_dir)
    args = ["main.py", "fit"]
    if spec.config:
        args += ["--config", spec.config]
    args += ["--config", f"{rel}/callbacks.yaml"]
    args += [f"--{k}={_cli_value(v)}" for k, v in spec.overrides.items()]
    logger = get_dotted(spec.resolved, "trainer.logger")
    if isinstance(logger, dict) and "init_args" in logger:
        args.append(f"--trainer.logger.init_args.save_dir={rel}")
    return args


def scrub(text: str) -> str:
    """``text`` without this machine's paths: the repository, the interpreter's prefix, the home folder."""
    for path, name in ((str(REPO_ROOT), "."), (sys.prefix, "<python>"), (str(Path.home()), "~")):
        if path and path not in ("/", "."):
            text = text.replace(path, name)
    return text


def _tail(text: str, lines: int = 20) -> list[str]:
    return [scrub(line.rstrip()) for line in text.strip().splitlines()[-lines:]]


_ERROR_LINE = re.compile(r"^(error:|[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b)")


def error_line(output: str, returncode: int) -> str:
    """One line for a run that left no record: the last error-looking line of its output, with the exit code."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    found = next((line for line in reversed(lines) if _ERROR_LINE.match(line)), lines[-1] if lines else "")
    how = f"killed by signal {-returncode}" if returncode < 0 else f"exit status {returncode}"
    return scrub(f"{how}: {found}")[:500] if found else how


def classify_failure(output: str, returncode: int) -> str:
    """``oom`` for an out-of-memory crash or a process killed by SIGKILL (the kernel's OOM killer), else ``failed``."""
    low = output.lower()
    if "out of memory" in low or "outofmemoryerror" in low or returncode in (-9, 137):
        return "oom"
    return "failed"


def failure_record(spec: RunSpec, status: str, error: str, run_id: str, accelerator: str) -> dict:
    """A schema-valid record for a run that died before its own record was written."""
    from modelwright.measure import hardware_info, versions  # torch: only needed on this path

    record = new_record(run_id=run_id, loop="lightning")
    record["status"], record["error"] = status, error
    record["config"] = to_jsonable(spec.resolved)
    r = spec.resolved
    micro = get_dotted(r, "data.batch_size")
    accumulate = get_dotted(r, "trainer.accumulate_grad_batches", 1)
    strategy = get_dotted(r, "trainer.strategy")
    world = _world_size(r)
    tech = record["techniques"]
    tech.update(
        model_name=get_dotted(r, "model.model_name"),
        precision=None,
        precision_requested=_cli_value(get_dotted(r, "trainer.precision")),
        accumulate_grad_batches=accumulate if isinstance(accumulate, int) else None,
        gradient_checkpointing=get_dotted(r, "model.gradient_checkpointing"),
        optimizer=get_dotted(r, "model.optimizer"),
        optimizer_impl=None,
        channels_last=get_dotted(r, "model.channels_last"),
        compile=get_dotted(r, "model.compile"),
        strategy=strategy if isinstance(strategy, str) else _class_name(strategy) or None,
        world_size=world,
        num_nodes=get_dotted(r, "trainer.num_nodes", 1),
        micro_batch_size=micro if isinstance(micro, int) else None,
        effective_batch_size=effective_batch(r),
    )
    device = "cuda" if accelerator in ("cuda", "gpu") else "cpu"
    try:
        record["hardware"] = hardware_info(device, num_devices=world)
    except Exception:  # no such device in this process: keep the nulls
        pass
    record["versions"] = versions()
    return to_jsonable(record)


def _now_run_id(spec: RunSpec) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    suffix = "b" if spec.kind == "budget" else "r"
    return f"{spec.name}-{spec.config_hash[:8]}-{suffix}{spec.repeat}-{stamp}"


class Progress:
    """One line per run start and end on stderr: position, runs done and left, estimated time left.

    On a terminal, a ticking line shows the current run's elapsed time.
    """

    def __init__(self, total: int, to_run: int, stream=None) -> None:
        self.total = total
        self.to_run = to_run
        self.position = 0
        self.executed = 0
        self.executed_s = 0.0
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def say(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
        self.stream.write(text + "\n")
        self.stream.flush()

    def eta(self) -> str:
        left = self.to_run - self.executed
        if left <= 0:
            return "0s"
        if not self.executed:
            return "unknown"
        return format_duration(left * self.executed_s / self.executed)

    def skipped(self, label: str, why: str, expected: bool = False) -> None:
        """A run not executed; ``expected`` if it was counted among the runs left."""
        self.position += 1
        if expected:
            self.to_run -= 1
        self.say(f"[{self.position}/{self.total}] {label}: skipped ({why})")

    def start(self, label: str) -> None:
        self.position += 1
        done = self.executed
        self.say(
            f"[{self.position}/{self.total}] {label}: running (runs done {done}, left {self.to_run - done}, "
            f"time left ~{self.eta()})"
        )

    def tick(self, label: str, elapsed_s: float) -> None:
        if self.tty:
            self.stream.write(f"\r\033[K    {label}: {format_duration(elapsed_s)}")
            self.stream.flush()

    def finish(self, label: str, seconds: float, summary: str) -> None:
        self.executed += 1
        self.executed_s += seconds
        self.say(f"[{self.position}/{self.total}] {label}: {summary} in {format_duration(seconds)}")

    def add_runs(self, n: int) -> None:
        self.total += n
        self.to_run += n


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    minutes, s = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{s:02d}s"
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m"


def _summary_line(record: Mapping) -> str:
    if record.get("status") != "ok":
        return f"{record.get('status')}: {record.get('error')}"
    mem = get_dotted(record, "memory.peak_allocated_mib")
    step = get_dotted(record, "timing.step_time_median_ms")
    parts = ["ok"]
    if isinstance(mem, (int, float)):
        parts.append(f"peak {mem:.0f} MiB")
    if isinstance(step, (int, float)):
        parts.append(f"step {step:.0f} ms")
    return ", ".join(parts)


class Study:
    """Runs specs in fresh processes, appending each record to ``records.jsonl``; skips recorded ones."""

    def __init__(
        self,
        plan: Plan,
        settings: Settings,
        results_dir: Path,
        workdir: Path,
        rerun: bool = False,
        run_timeout_s: float | None = None,
        retry_failed: bool = False,
    ) -> None:
        self.plan = plan
        self.settings = settings
        self.results_dir = results_dir
        self.records_path = results_dir / "records.jsonl"
        self.workdir = workdir
        self.rerun = rerun
        self.retry_failed = retry_failed
        self.run_timeout_s = run_timeout_s
        self.done: dict[tuple[str, str, int], dict] = {}
        self.executed = 0
        self.skipped = 0
        self.failed = 0
        if self.records_path.is_file():
            for record in read_records(self.records_path):
                study = record.get("study") or {}
                if record.get("status") in DONE_STATUSES and "config_hash" in study:
                    self.done[(study.get("kind", "run"), study["config_hash"], study.get("repeat", 0))] = record

    def recorded(self, spec: RunSpec) -> dict | None:
        """The record that makes running ``spec`` again unnecessary, if any."""
        record = None if self.rerun else self.done.get(spec.key)
        if record is not None and self.retry_failed and record.get("status") in RETRY_STATUSES:
            return None
        return record

    def run(self, spec: RunSpec, progress: Progress) -> dict:
        """The spec's record: the existing one if already recorded, else a fresh run's."""
        existing = self.recorded(spec)
        if existing is not None:
            progress.skipped(
                spec.label, f"recorded: {existing.get('status')}, config {spec.config_hash}", spec.kind == "budget"
            )
            self.skipped += 1
            return existing
        progress.start(spec.label)
        run_dir = self.workdir / spec.folder
        if run_dir.exists():
            shutil.rmtree(run_dir)  # a stale record of an interrupted attempt must not be read back
        run_dir.mkdir(parents=True)
        record_path = run_dir / "record.json"
        callbacks = patch_callbacks(spec.callbacks, self.settings.warmup_steps, _rel(record_path))
        (run_dir / "callbacks.yaml").write_text(
            yaml.safe_dump({"trainer": {"callbacks": callbacks}}, sort_keys=False), encoding="utf-8"
        )
        args = command(spec, run_dir)
        run_id = _now_run_id(spec)
        env = dict(os.environ, MODELWRIGHT_RUN_ID=run_id, PYTHONUNBUFFERED="1")
        log_path = run_dir / "output.log"
        t0 = time.perf_counter()
        timed_out = False
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, *args], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
            try:
                while proc.poll() is None:
                    elapsed = time.perf_counter() - t0
                    if self.run_timeout_s is not None and elapsed > self.run_timeout_s:
                        timed_out = True
                        proc.terminate()  # SIGTERM first: the run may save its state and exit on its own
                        try:
                            proc.wait(timeout=30)
                        except subprocess.TimeoutExpired:
                            proc.kill()
                            proc.wait()
                        break
                    progress.tick(spec.label, elapsed)
                    time.sleep(0.5)
            except BaseException:
                proc.kill()  # Ctrl-C: take the child down too, record nothing for this run
                proc.wait()
                raise
        seconds = time.perf_counter() - t0
        output = log_path.read_text(encoding="utf-8", errors="replace")
        returncode = proc.returncode
        record = None
        if record_path.is_file():
            try:
                record = json.loads(record_path.read_text(encoding="utf-8"))
            except ValueError:
                record = None
        if timed_out:
            record = failure_record(
                spec, "failed", f"timed out after {self.run_timeout_s:g} s", run_id, self.settings.accelerator
            )
        elif record is None or (returncode != 0 and record.get("status") == "ok"):
            status = classify_failure(output, returncode) if returncode != 0 else "failed"
            error = error_line(output, returncode) if returncode != 0 else "the run wrote no record"
            record = failure_record(spec, status, error, run_id, self.settings.accelerator)
        if isinstance(record.get("error"), str):
            record["error"] = scrub(record["error"])
        if validate_record(record):
            # The child's record does not match the schema: keep the run visible as a failure.
            problem = validate_record(record)[0]
            record = failure_record(spec, "failed", f"invalid record: {problem}", run_id, self.settings.accelerator)
        record["study"] = {
            "name": spec.name,
            "kind": spec.kind,
            "plan": self.plan.path,
            "index": spec.index,
            "repeat": spec.repeat,
            "repeats": self.settings.repeats if spec.kind == "run" else 1,
            "config_hash": spec.config_hash,
            "slug": self.settings.slug,
            "config_file": spec.config,
            "overrides": to_jsonable(spec.overrides),
            "warmup_steps": self.settings.warmup_steps,
            "measured_steps": self.settings.measured_steps if spec.kind == "run" else 0,
            "process_wall_s": seconds,
            "returncode": returncode,
            "command": "python " + shlex.join(args),
            **({"output_tail": _tail(output)} if record.get("status") != "ok" else {}),
            **spec.extra,
        }
        append_record(self.records_path, record)
        self.done[spec.key] = record
        self.executed += 1
        if record.get("status") != "ok":
            self.failed += 1
        progress.finish(spec.label, seconds, _summary_line(record))
        return record


# --------------------------------------------------------------------------------------------------
# Largest batch per memory budget
# --------------------------------------------------------------------------------------------------


def record_peak_mib(record: Mapping) -> float | None:
    """The measured peak of a run: the allocator's peak (CUDA), else the anatomy total (tensor memory on CPU)."""
    peak = get_dotted(record, "memory.peak_allocated_mib")
    if isinstance(peak, (int, float)):
        return float(peak)
    total = get_dotted(record, "memory.anatomy_mib.total")
    return float(total) if isinstance(total, (int, float)) else None


def predict_largest_batch(
    anatomy_mib: Mapping[str, float], peak_mib: float, batch: int, budget_mib: float
) -> dict[str, float | int]:
    """The largest micro-batch whose predicted peak fits ``budget_mib``, from one measured anatomy.

    The :data:`SCALES_WITH_BATCH` categories are taken as ``per_sample_mib × batch``; the rest of the
    measured peak (parameters, gradients, optimizer state, ...) as fixed.

    Returns:
        ``per_sample_mib``, ``fixed_mib``, ``batch`` (0 if not even one sample fits) and
        ``predicted_peak_mib`` at that batch.
    """
    require(batch >= 1, f"batch: must be >= 1, got {batch}")
    scaled = sum(float(anatomy_mib.get(k) or 0.0) for k in SCALES_WITH_BATCH)
    per_sample = scaled / batch
    fixed = max(0.0, peak_mib - scaled)
    return _fit_line(per_sample, fixed, budget_mib)


def _fit_line(per_sample: float, fixed: float, budget_mib: float) -> dict[str, float | int]:
    if per_sample <= 0:
        best = 0
    else:
        best = max(0, math.floor((budget_mib - fixed) / per_sample + 1e-9))
    return {
        "per_sample_mib": per_sample,
        "fixed_mib": fixed,
        "batch": best,
        "predicted_peak_mib": fixed + per_sample * best,
    }


def predict_from_two_points(b0: int, m0: float, b1: int, m1: float, budget_mib: float) -> dict[str, float | int]:
    """The same prediction from two measured (batch, peak) points: the line through them."""
    require(b0 != b1, "two budget points need different batches")
    slope = (m1 - m0) / (b1 - b0)
    return _fit_line(slope, m0 - slope * b0, budget_mib)


def _median_record(records: Sequence[dict]) -> dict:
    ranked = sorted(records, key=lambda r: record_peak_mib(r) or 0.0)
    return ranked[(len(ranked) - 1) // 2]


def budget_phase(
    study: Study, specs: list[RunSpec], entries: list[Entry], progress: Progress, budget_mib: float
) -> None:
    """Predict and confirm the largest micro-batch under ``budget_mib`` for each of the plan's budget runs.

    The prediction needs a measurement in the confirmation's own setup (one micro-batch per step): the
    entry's run if it does not accumulate, else a probe run at its micro-batch without accumulation
    (the anatomy of an accumulating step is no per-micro-batch figure).
    """
    by_name = {e.name: (i, e) for i, e in enumerate(entries)}
    names = [n for n in study.plan.budget_runs if n in by_name]
    progress.add_runs(len(names))
    for name in names:
        index, entry = by_name[name]
        measured = [
            study.done[s.key]
            for s in specs
            if s.name == name and s.key in study.done and study.done[s.key].get("status") == "ok"
        ]
        measured = [r for r in measured if get_dotted(r, "memory.anatomy_mib") and record_peak_mib(r)]
        if not measured:
            progress.skipped(f"{name} (budget)", "no measured anatomy to predict from", True)
            continue
        base = _median_record(measured)
        b0 = get_dotted(base, "techniques.micro_batch_size")
        if get_dotted(base, "techniques.accumulate_grad_batches", 1) != 1:
            progress.add_runs(1)
            probe_extra = {
                "budget_mib": budget_mib,
                "attempt": 0,
                "prediction": "probe",
                "from_run_id": base.get("run_id"),
            }
            probe = build_spec(entry, index, study.settings, kind="budget", batch_size=b0, extra=probe_extra)
            base = study.run(probe, progress)
            if base.get("status") != "ok" or not get_dotted(base, "memory.anatomy_mib") or not record_peak_mib(base):
                progress.skipped(f"{name} (budget)", "the probe run measured no anatomy", True)
                continue
        m0 = record_peak_mib(base)
        prediction = predict_largest_batch(base["memory"]["anatomy_mib"], m0, b0, budget_mib)
        if prediction["batch"] < 1:
            progress.skipped(
                f"{name} (budget)", f"the fixed part alone ({prediction['fixed_mib']:.0f} MiB) exceeds it", True
            )
            continue
        for attempt in range(1, BUDGET_ATTEMPTS + 1):
            extra = {
                "budget_mib": budget_mib,
                "attempt": attempt,
                "from_run_id": base.get("run_id"),
                "from_batch": b0,
                "from_peak_mib": m0,
                "per_sample_mib": prediction["per_sample_mib"],
                "fixed_mib": prediction["fixed_mib"],
                "predicted_batch": prediction["batch"],
                "predicted_peak_mib": prediction["predicted_peak_mib"],
                "prediction": "anatomy" if attempt == 1 else "two-point",
            }
            spec = build_spec(entry, index, study.settings, kind="budget", batch_size=prediction["batch"], extra=extra)
            record = study.run(spec, progress)
            peak = record_peak_mib(record)
            fits = record.get("status") == "ok" and peak is not None and peak <= budget_mib
            if fits or attempt == BUDGET_ATTEMPTS or peak is None:
                break
            b1 = prediction["batch"]
            prediction = predict_from_two_points(b0, m0, b1, peak, budget_mib)
            prediction["batch"] = min(prediction["batch"], b1 - 1)
            if prediction["batch"] < 1:
                break
            progress.add_runs(1)


# --------------------------------------------------------------------------------------------------
# Hardware slug
# --------------------------------------------------------------------------------------------------


def slugify(text: str) -> str:
    text = re.sub(r"\((r|tm|c)\)|\b(cpu|processor|with|radeon graphics)\b|@.*$", " ", text, flags=re.I)
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def hardware_slug(accelerator: str = "auto") -> str:
    """``cpu-<cpu model>-<n>cores`` or ``cuda-<gpu name>`` (``-x<n>`` for several GPUs), lowercase with dashes."""
    import torch

    use_cuda = accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available())
    if use_cuda:
        require(torch.cuda.is_available(), f"--accelerator: {accelerator} but no CUDA device is visible")
        n = torch.cuda.device_count()
        name = slugify(torch.cuda.get_device_name(0))
        return f"cuda-{name}" + (f"-x{n}" if n > 1 else "")
    if accelerator not in ("auto", "cpu"):
        return slugify(accelerator)
    from modelwright.measure import cpu_model

    return f"cpu-{slugify(cpu_model()) or 'unknown'}-{os.cpu_count()}cores"


# --------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------


def _parse_set(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        require("=" in item and not item.startswith("="), f"--set: {item!r} is not KEY=VALUE (e.g. data.batch_size=64)")
        key, value = item.split("=", 1)
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            out[key.strip()] = value
    return out


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(
        prog="python -m modelwright study",
        description="Run a plan of experiment configs (each in a fresh process), then write the table, "
        "plots and README section.",
    )
    p.add_argument("--plan", default=_rel(DEFAULT_PLAN), help="plan file (default: %(default)s)")
    p.add_argument("--only", default=None, help="comma-separated run names of the plan to run")
    p.add_argument("--model", default=None, help="model.model_name for every run (overrides the plan's)")
    p.add_argument("--accelerator", default="auto", help="trainer.accelerator for every run: auto, cpu, cuda, ...")
    p.add_argument("--warmup-steps", type=int, default=None, help="unmeasured steps per run (plan default)")
    p.add_argument("--steps", type=int, default=None, help="measured steps per run (plan default)")
    p.add_argument("--repeats", type=int, default=None, help="runs per plan entry; the table shows the median")
    p.add_argument("--val-batches", type=int, default=None, help="validation batches at the end of each run")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every run")
    p.add_argument("--budget-gib", type=float, default=None, help="memory budget for the largest-batch runs")
    p.add_argument("--no-budget", action="store_true", help="skip the largest-batch-per-budget runs")
    p.add_argument("--results", default="results", help="results root; outputs go to <results>/<slug>/")
    p.add_argument("--slug", default=None, help="hardware slug (default: from the device)")
    p.add_argument("--workdir", default="lightning_logs/study", help="run folders (logs, output.log, record.json)")
    p.add_argument("--readme", default="README.md", help="README whose results section is regenerated")
    p.add_argument("--no-readme", action="store_true", help="leave the README alone")
    p.add_argument("--no-report", action="store_true", help="only run; no table, plots or README")
    p.add_argument("--rerun", action="store_true", help="run again even what is already recorded")
    p.add_argument("--retry-failed", action="store_true", help="run again the runs recorded as failed or oom")
    p.add_argument("--run-timeout-s", type=float, default=None, help="kill and record a run after this long")
    p.add_argument("--dry-run", action="store_true", help="list the runs and their commands, run nothing")
    return p


def _settings(args: argparse.Namespace, plan: Plan) -> Settings:
    def pick(cli, plan_value, key, minimum):
        value = plan_value if cli is None else cli
        return _positive_int(value, key, minimum)

    slug = args.slug or hardware_slug(args.accelerator)
    require(re.fullmatch(r"[a-z0-9][a-z0-9._-]*", slug) is not None, f"--slug: {slug!r} is not a plain name")
    return Settings(
        slug=slug,
        accelerator=args.accelerator,
        warmup_steps=pick(args.warmup_steps, plan.warmup_steps, "--warmup-steps", 0),
        measured_steps=pick(args.steps, plan.measured_steps, "--steps", 1),
        repeats=pick(args.repeats, plan.repeats, "--repeats", 1),
        val_batches=pick(args.val_batches, plan.val_batches, "--val-batches", 0),
        model=args.model or plan.model,
        set_overrides=_parse_set(args.set),
    )


def _device_type(accelerator: str, slug: str) -> str:
    if accelerator in ("cuda", "gpu") or slug.startswith("cuda-"):
        return "cuda"
    return "cpu" if accelerator == "auto" else accelerator


def check_effective_batch(specs: Sequence[RunSpec], entries: Sequence[Entry]) -> None:
    """Every run of a plan trains with the same effective batch, unless its entry says ``vary_batch``."""
    varies = {e.name for e in entries if e.vary_batch}
    reference: tuple[str, int | None] | None = None
    for spec in specs:
        if spec.name in varies:
            continue
        eff = effective_batch(spec.resolved)
        if reference is None:
            reference = (spec.name, eff)
        require(
            eff == reference[1],
            f"runs.{spec.name}: effective batch {eff} differs from {reference[0]}'s {reference[1]}; "
            "set vary_batch: true on a run that is about batch size",
        )


def run_study(argv: Sequence[str] | None = None) -> int:
    """The study command; returns the exit status (0; 1 if every run it ran failed; 2 for a usage error)."""
    t0 = time.perf_counter()
    args = build_parser().parse_args(argv)
    plan_path = Path(args.plan)
    plan = load_plan(plan_path if plan_path.exists() or plan_path.is_absolute() else REPO_ROOT / plan_path)
    settings = _settings(args, plan)
    device = _device_type(settings.accelerator, settings.slug)
    entries = plan.entries
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        for n in wanted:
            require(n in {e.name for e in entries}, f"--only: {n!r} is not a run of {plan.path}")
        entries = [e for e in entries if e.name in wanted]
    results_root = Path(args.results)
    results_dir = results_root.resolve() / settings.slug
    workdir = Path(args.workdir).resolve() / settings.slug

    unsupported = [e for e in entries if e.accelerators and device not in e.accelerators]
    runnable = [e for e in entries if e not in unsupported]
    index_of = {e.name: i for i, e in enumerate(plan.entries)}
    specs = [build_spec(e, index_of[e.name], settings, repeat=r) for e in runnable for r in range(settings.repeats)]
    check_effective_batch(specs, runnable)
    budget_gib = args.budget_gib if args.budget_gib is not None else plan.budget_gib
    require(budget_gib is None or budget_gib > 0, f"--budget-gib: must be positive, got {budget_gib}")
    do_budget = bool(budget_gib) and not args.no_budget and bool(plan.budget_runs)

    study = Study(
        plan,
        settings,
        results_dir,
        workdir,
        rerun=args.rerun,
        run_timeout_s=args.run_timeout_s,
        retry_failed=args.retry_failed,
    )
    to_run = sum(1 for s in specs if study.recorded(s) is None)
    say = sys.stderr.write
    say(
        f"study {plan.path} on {settings.slug}: {len(specs)} runs ({to_run} to run), {settings.warmup_steps} warm-up "
        f"+ 1 anatomy + {settings.measured_steps} measured steps each"
        + (f"; budget {budget_gib:g} GiB for {', '.join(plan.budget_runs)}" if do_budget else "")
        + f"\nresults: {_rel(results_dir)}/\n"
    )
    for e in unsupported:
        say(f"  {e.name}: not on {device} (runs on {', '.join(e.accelerators or [])})\n")
    if args.dry_run:
        for spec in specs:
            state = "recorded" if study.recorded(spec) else "to run"
            line = shlex.join(command(spec, workdir / spec.folder))
            say(f"  {spec.name} r{spec.repeat} [{spec.config_hash}] {state}: python {line}\n")
        return 0

    progress = Progress(total=len(specs), to_run=to_run)
    for spec in specs:
        study.run(spec, progress)
    if do_budget:
        budget_phase(study, specs, runnable, progress, budget_gib * MIB_PER_GIB)

    wall_s = time.perf_counter() - t0
    results_dir.mkdir(parents=True, exist_ok=True)
    given = list(argv if argv is not None else sys.argv[1:])
    summary = {
        "plan": plan.path,
        "command": shlex.join(["uv", "run", "python", "-m", "modelwright", "study", *given]),
        "slug": settings.slug,
        "accelerator": settings.accelerator,
        "warmup_steps": settings.warmup_steps,
        "measured_steps": settings.measured_steps,
        "repeats": settings.repeats,
        "val_batches": settings.val_batches,
        "budget_gib": budget_gib if do_budget else None,
        "runs_planned": len(specs),
        "runs_not_on_this_device": [e.name for e in unsupported],
        "runs_executed": study.executed,
        "runs_skipped": study.skipped,
        "runs_failed": study.failed,
        "wall_time_s": wall_s,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (results_dir / "study.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    say(
        f"study done in {format_duration(wall_s)}: {study.executed} run, {study.skipped} skipped, "
        f"{study.failed} not ok; records: {_rel(study.records_path)}\n"
    )
    if not args.no_report:
        from modelwright.report import generate

        readme = None if args.no_readme else Path(args.readme).resolve()
        written = generate(results_dir, readme=readme)
        say("report: " + ", ".join(_rel(p) for p in written) + "\n")
    # Failed runs are results (recorded, shown in the table); only a study that measured nothing is an error.
    return 1 if study.executed and study.failed == study.executed else 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run_study(argv)
    except KeyboardInterrupt:
        print("\ninterrupted: the runs recorded so far are kept; the same command resumes", file=sys.stderr)
        return 130
    except ConfigError as err:
        if os.environ.get("MODELWRIGHT_DEBUG") == "1":
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
