"""A study plan (``configs/study/plan_*.yaml``) and its runs, each run's config resolved by LightningCLI's own
parser."""

import copy
import functools
import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelwright import REPO_ROOT
from modelwright.errors import ConfigError, require
from modelwright.inputs import read_yaml
from modelwright.record import get_path, to_jsonable, with_values

PLAN_KEYS = {"model", "warmup_steps", "measured_steps", "repeats", "max_repeats", "val_batches", "budget",
             "runs", "description"}
ENTRY_KEYS = {"name", "config", "overrides", "accelerators", "vary_batch", "description", "accumulate"}
#: What ``accelerators`` may name: cpu-bf16 is a CPU with bf16 instructions (elsewhere bf16 autocast is
#: emulated).
DEVICE_KINDS = {"cpu", "cpu-bf16", "cuda"}


@dataclass
class Entry:
    """One experiment of a plan: a config delta plus overrides, run under a name."""

    name: str
    config: str | None
    overrides: dict[str, Any] = field(default_factory=dict)
    accelerators: list[str] | None = None
    vary_batch: bool = False
    accumulate: int | None = None  # micro-batches per step, each the job's batch divided by it


@dataclass
class Plan:
    """A plan file. Its first run is its baseline (``baseline`` or ``*-baseline``: its rows are compared with
    it, repeat by repeat); steps may be per device type (``{cpu: 10, cuda: 20}``)."""

    path: str
    entries: list[Entry]
    model: str | None = None
    warmup_steps: int | dict[str, int] = 1
    measured_steps: int | dict[str, int] = 10
    repeats: int = 3
    max_repeats: int = 5  # repeats of a row (and its baseline) whose interval the first round left undecided
    val_batches: int = 0
    budget_gib: float | None = None
    budget_runs: list[str] = field(default_factory=list)


def rel(path: str | os.PathLike) -> str:
    """``path`` relative to the repository root when it lies inside it (records name no machine paths)."""
    resolved = Path(path).resolve()
    if resolved.is_relative_to(REPO_ROOT):
        return resolved.relative_to(REPO_ROOT).as_posix()
    return str(path)


def count(value: Any, key: str, minimum: int = 1, per_device: bool = False) -> Any:
    """``value`` if it is an integer >= ``minimum`` (with ``per_device``, also a mapping of such integers)."""
    values = [value]
    if per_device and isinstance(value, dict):
        values = list(value.values())
    for number in values:
        ok = isinstance(number, int) and not isinstance(number, bool) and number >= minimum
        require(ok, f"{key}: must be an integer >= {minimum}, got {number!r}")
    return value


def for_device(value: int | Mapping[str, int], device: str) -> int:
    """A per-device plan value for ``device`` (a mapping without it gives its ``cpu`` value)."""
    if isinstance(value, Mapping):
        return value.get(device, value.get("cpu", 1))
    return value


def _known(mapping: Mapping, keys: set[str], where: str) -> None:
    unknown = min(set(mapping) - keys, default=None)  # the first, in sorted order
    require(unknown is None, f"{where}: unknown key {unknown!r}; valid: {', '.join(sorted(keys))}")


def _read_plan_file(path: Path, where: str) -> dict:
    require(path.is_file(), f"plan: no plan file at {where}")
    data = read_yaml("plan", path)  # a mapping, read strictly: a duplicated key, an empty file are refused
    _known(data, PLAN_KEYS, where)
    return data


def _entry(item: Any, key: str, earlier: list[Entry]) -> Entry:
    """The plan's run ``item`` (``key`` names it in errors), checked against the ``earlier`` ones."""
    require(isinstance(item, dict) and isinstance(item.get("name"), str), f"{key}: needs a 'name'")
    _known(item, ENTRY_KEYS, key)
    entry = Entry(item["name"], item.get("config"), item.get("overrides") or {}, item.get("accelerators"),
                  bool(item.get("vary_batch")), item.get("accumulate"))
    if entry.accumulate is not None:
        count(entry.accumulate, f"{key}.accumulate", 2)
    plain = re.fullmatch(r"[A-Za-z0-9][\w.+-]*", entry.name) is not None
    require(plain, f"{key}.name: {entry.name!r} is not a plain name")
    require(entry.name not in {other.name for other in earlier}, f"{key}.name: {entry.name!r} appears twice")
    exists = not entry.config or (REPO_ROOT / entry.config).is_file()
    require(exists, f"{key}.config: no config file at {entry.config}")
    require(isinstance(entry.overrides, dict), f"{key}.overrides: must be a mapping of dotted keys to values")
    kinds = entry.accelerators
    ok = kinds is None or (isinstance(kinds, list) and set(kinds) <= DEVICE_KINDS)
    require(ok, f"{key}.accelerators: a list of {', '.join(sorted(DEVICE_KINDS))}, e.g. [cuda]")
    return entry


def _budget(data: dict, entries: list[Entry], where: str) -> tuple[float | None, list[str]]:
    budget = data.get("budget") or {}
    require(isinstance(budget, dict), f"{where}: budget: a mapping {{gib, runs}}, got {budget!r}")
    gib = budget.get("gib")
    runs = budget.get("runs") or []
    ok = gib is None or (isinstance(gib, (int, float)) and not isinstance(gib, bool) and gib > 0)
    require(ok, f"{where}: budget.gib: must be a positive number, got {gib!r}")
    require(isinstance(runs, list), f"{where}: budget.runs: a list of run names, got {runs!r}")
    names = {entry.name for entry in entries}
    for name in runs:
        require(name in names, f"{where}: budget.runs: {name!r} is not a run of this plan")
    if gib is None:
        return None, list(runs)
    return float(gib), list(runs)


def load_plan(path: str | os.PathLike) -> Plan:
    """Read and check a plan file; a problem raises :class:`ConfigError` naming the file and key."""
    where = rel(path)
    data = _read_plan_file(Path(path), where)
    runs = data.get("runs")
    runs_ok = isinstance(runs, list) and bool(runs)
    require(runs_ok, f"{where}: runs: must be a non-empty list of {{name, config}}")
    entries: list[Entry] = []
    for index, item in enumerate(runs):
        entries.append(_entry(item, f"{where}: runs[{index}]", entries))
    budget_gib, budget_runs = _budget(data, entries, where)
    warmup = count(data.get("warmup_steps", 1), f"{where}: warmup_steps", 0, per_device=True)
    measured = count(data.get("measured_steps", 10), f"{where}: measured_steps", per_device=True)
    return Plan(where, entries, data.get("model"), warmup_steps=warmup, measured_steps=measured,
                repeats=count(data.get("repeats", 3), f"{where}: repeats"),
                max_repeats=count(data.get("max_repeats", 5), f"{where}: max_repeats"),
                val_batches=count(data.get("val_batches", 0), f"{where}: val_batches", 0),
                budget_gib=budget_gib, budget_runs=budget_runs)


def cli_value(value: Any) -> str:
    """``value`` as LightningCLI reads it after ``--key=``."""
    if isinstance(value, (bool, dict, list)) or value is None:
        return json.dumps(value)
    return str(value)


def resolve_config(config_files: Sequence[str | os.PathLike] = (),
                   overrides: Mapping[str, Any] | None = None) -> dict:
    """The config a run sees: what ``main.py fit --config <file>... --<key>=<value>... --print_config``
    prints, by the project's LightningCLI parser in this process
    (:func:`modelwright.train.cli.resolved_config`), cached per argument list; a refusal is its one-line
    :class:`ConfigError`."""
    args = ["fit"]
    for config_file in config_files:
        args += ["--config", str(REPO_ROOT / config_file)]
    args += [f"--{key}={cli_value(value)}" for key, value in (overrides or {}).items()]
    return copy.deepcopy(_resolved(tuple(args)))


@functools.cache
def _resolved(args: tuple[str, ...]) -> dict:
    from modelwright.train.cli import resolved_config  # torch and Lightning: only once a config is resolved

    return resolved_config(list(args))


def _positive(value: Any) -> int:
    """``value`` as a positive count (a list: its length), or 1 where it is none (``auto``, a typo)."""
    if isinstance(value, str) and value.isdigit():  # LightningCLI keeps `--trainer.devices=2` a string
        value = int(value)
    if isinstance(value, list):
        value = len(value)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return 1


def world_size(resolved: Mapping) -> int:
    devices = _positive(get_path(resolved, "trainer.devices"))
    return devices * _positive(get_path(resolved, "trainer.num_nodes"))


def effective_batch(resolved: Mapping) -> int | None:
    """Samples per optimizer step: micro-batch × accumulation × processes (``None`` if not an integer)."""
    micro = get_path(resolved, "data.batch_size")
    accumulate = get_path(resolved, "trainer.accumulate_grad_batches", 1)
    if not (isinstance(micro, int) and isinstance(accumulate, int)):
        return None
    return micro * accumulate * world_size(resolved)


def _callback_name(callback: Any) -> str:
    if isinstance(callback, dict):
        return str(callback.get("class_path", "")).rsplit(".", 1)[-1]
    return str(callback or "")


def patch_callbacks(callbacks: Any, warmup_steps: int, record_path: str | None = None,
                    anatomy: bool = True) -> list[dict]:
    """The callbacks list of a study run: the measurement window set, no checkpoint files, the record path; a
    ConfigError if it has no ``RunMonitor`` (the study could not read the run's result). ``anatomy``: capture
    one step's memory (an epoch run does not: the capture slows its step)."""
    names = [_callback_name(callback) for callback in callbacks] if isinstance(callbacks, list) else []
    require("RunMonitor" in names, "trainer.callbacks: the study needs callbacks.run_monitor.RunMonitor "
            "in the list (configs/base.yaml)")
    window = {"RunMonitor": {"warmup_steps": warmup_steps, "measure_steps": None, "anatomy": anatomy,
                             "anatomy_step": None, "record_path": record_path, "records_jsonl": None}}
    patched = []
    for callback in callbacks:
        name = _callback_name(callback)
        if name == "ModelCheckpoint":  # a study run saves no checkpoint
            continue
        init_args = {**(callback.get("init_args") or {}), **window.get(name, {})}
        patched.append({**copy.deepcopy(callback), "init_args": init_args})
    return patched


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
    overrides: dict[str, Any]
    job: tuple[str, ...] = ()  # the training job's config files, before each run's own (study --config)
    max_repeats: int = 5  # the plan's: the first round is ``repeats``


@dataclass
class RunSpec:
    """One process to run (``kind``: ``run``, ``epoch`` or ``budget``) of the plan's entry ``index``."""

    name: str
    kind: str
    index: int
    repeat: int
    config: str | None
    overrides: dict[str, Any]
    resolved: dict
    config_hash: str
    measured_steps: int
    extra: dict[str, Any] = field(default_factory=dict)
    files: tuple[str, ...] = ()  # the config files of its command: the job's, then the entry's

    @property
    def key(self) -> tuple[str, str, str, int]:
        """What identifies its record among a study's records: name, kind, config hash, repeat. The name: a
        plan's own baseline runs in turn with its rows, though another plan's has the same config."""
        return (self.name, self.kind, self.config_hash, self.repeat)

    @property
    def folder(self) -> str:
        return f"{self.name}-{self.config_hash}-{self.kind[0]}{self.repeat}"

    @property
    def label(self) -> str:
        if self.kind == "run":
            return f"{self.name} r{self.repeat}"
        if self.kind == "epoch":
            return f"{self.name} (one whole epoch)"
        return f"{self.name} @ batch {get_path(self.resolved, 'data.batch_size')} ({self.extra.get('role')})"


def _window(total_steps: int, accumulate: int, val_batches: int) -> dict[str, Any]:
    """The trainer overrides of a study run: one short epoch of ``total_steps`` optimizer steps, then
    ``val_batches`` of validation; no checkpoint, progress bar or model summary."""
    return {
        "trainer.max_epochs": 1, "trainer.max_steps": total_steps,
        "trainer.limit_train_batches": total_steps * accumulate, "trainer.limit_val_batches": val_batches,
        "trainer.num_sanity_val_steps": 0, "trainer.log_every_n_steps": 1,
        "trainer.enable_checkpointing": False, "trainer.enable_progress_bar": False,
        "trainer.enable_model_summary": False, "trainer.val_check_interval": 1.0,
    }


def _config_hash(resolved: dict, slug: str) -> str:
    """The run's identity (what resume compares): its resolved config on one hardware slug."""
    identity = {"config": to_jsonable(resolved), "slug": slug}
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def network_class_path(name: str) -> str:
    """A plan's or the command line's network: a built-in's short name (``vit``) or a class path."""
    from modelwright.train.models import SHORT_NAMES

    if name in SHORT_NAMES:
        return f"modelwright.train.models.{SHORT_NAMES[name]}"
    return name


def _first_overrides(entry: Entry, settings: Settings) -> dict[str, Any]:
    """In order: model, the command line's, the entry's. A window of a few steps is no schedule's intended
    length: a constant learning rate keeps runs comparable."""
    overrides: dict[str, Any] = {"model.scheduler": "none"}
    if settings.model:
        overrides["model.network"] = network_class_path(settings.model)
    overrides = overrides | settings.overrides | entry.overrides
    if settings.accelerator != "auto":
        overrides["trainer.accelerator"] = settings.accelerator
    if entry.accumulate:
        overrides |= _accumulation(entry, settings, overrides)
    return overrides


def _files(entry: Entry, settings: Settings) -> list[str]:
    """The config files of ``entry``'s runs: the job's, then the entry's own."""
    return [*settings.job, *([entry.config] if entry.config else [])]


def _resolved_row(entry: Entry, settings: Settings, overrides: Mapping[str, Any]) -> dict:
    """``entry``'s files with ``overrides``, resolved; a refusal names the row."""
    try:
        return resolve_config(_files(entry, settings), overrides)
    except ConfigError as err:
        raise ConfigError(f"runs.{entry.name}: {err}") from None


def _accumulation(entry: Entry, settings: Settings, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``accumulate: N``: N micro-batches per optimizer step, each the job's batch divided by N (the same
    effective batch)."""
    job = _resolved_row(entry, settings, overrides)
    batch = get_path(job, "data.batch_size")
    micro, left = divmod(batch, entry.accumulate) if isinstance(batch, int) else (0, 1)
    require(micro > 0 and left == 0, f"runs.{entry.name}.accumulate: {entry.accumulate} does not divide the "
            f"job's data.batch_size {batch!r}")
    return {"trainer.accumulate_grad_batches": entry.accumulate, "data.batch_size": micro}


def build_spec(entry: Entry, index: int, settings: Settings, repeat: int = 0, kind: str = "run",
               batch_size: int | None = None, extra: Mapping[str, Any] | None = None) -> RunSpec:
    """The run of ``entry``: overrides in order (model, the command line's, the entry's, the study's window).
    A budget run has a micro-batch of its own, no accumulation and no timed steps: only its peak matters. An
    epoch run is one whole epoch as the config has it (:func:`build_epoch_spec`)."""
    if kind == "epoch":
        return build_epoch_spec(entry, index, settings)
    overrides = _first_overrides(entry, settings)
    measured = settings.measured_steps
    val_batches = settings.val_batches
    if kind == "budget":
        overrides.update({"data.batch_size": batch_size, "trainer.accumulate_grad_batches": 1})
        measured = 0
        val_batches = 0
    draft = _resolved_row(entry, settings, overrides)
    accumulate = _positive(get_path(draft, "trainer.accumulate_grad_batches"))
    # Warm-up steps, the anatomy step (left out of the timing), the measured steps: one short epoch, then
    # validation.
    total = settings.warmup_steps + 1 + measured
    window = _window(total, accumulate, val_batches)
    needed = total * accumulate * _positive(get_path(draft, "data.batch_size")) * world_size(draft)
    train_size = get_path(draft, "data.train_size")
    # A generated set grows to the window; an image folder is as it is, so a budget run (its batch a large
    # share of the folder, or all of it) takes its steps over as many epochs as it needs.
    sized = get_path(draft, "data.train_size", default=False) is not False
    if sized and (not isinstance(train_size, int) or train_size < needed):
        window["data.train_size"] = needed
    if not sized and kind == "budget":
        window["trainer.max_epochs"] = total
    overrides.update(window)
    # The window's values are the study's own, of the types the parser gives: set in the parsed config rather
    # than parsed again (a parse takes a third of a second)
    resolved = with_values(draft, window)
    resolved["trainer"]["callbacks"] = patch_callbacks(resolved["trainer"].get("callbacks"),
                                                       settings.warmup_steps)
    files = tuple(_files(entry, settings))
    return RunSpec(entry.name, kind, index, repeat, entry.config, overrides, resolved,
                   _config_hash(resolved, settings.slug), measured, dict(extra or {}), files)


def build_epoch_spec(entry: Entry, index: int, settings: Settings) -> RunSpec:
    """One whole training epoch of ``entry`` as its config has it (training set, validations, data loading),
    timed end to end: no sanity check, no checkpoint files, no progress bar, and no memory capture (it would
    slow one step). The epoch's own length and validations are the config's, not the study's window."""
    overrides = _first_overrides(entry, settings)
    epoch = {
        "trainer.max_epochs": 1, "trainer.max_steps": -1, "trainer.num_sanity_val_steps": 0,
        "trainer.enable_checkpointing": False, "trainer.enable_progress_bar": False,
        "trainer.enable_model_summary": False,
    }
    draft = _resolved_row(entry, settings, overrides)  # the timed run's draft: parsed once for both
    overrides.update(epoch)
    resolved = with_values(draft, epoch)
    resolved["trainer"]["callbacks"] = patch_callbacks(resolved["trainer"].get("callbacks"),
                                                       settings.warmup_steps, anatomy=False)
    return RunSpec(entry.name, "epoch", index, 0, entry.config, overrides, resolved,
                   _config_hash(resolved, settings.slug), 0, {}, tuple(_files(entry, settings)))


def command(spec: RunSpec, run_dir: Path) -> list[str]:
    """The child's argument list (after the interpreter), with paths relative to the repository root."""
    where = rel(run_dir)
    args = ["main.py", "fit"]
    for config_file in spec.files:
        args += ["--config", config_file]
    args += ["--config", f"{where}/callbacks.yaml"]
    args += [f"--{key}={cli_value(value)}" for key, value in spec.overrides.items()]
    if isinstance(get_path(spec.resolved, "trainer.logger"), dict):
        args.append(f"--trainer.logger.init_args.save_dir={where}")
    return args


def check_effective_batch(specs: Sequence[RunSpec], entries: Sequence[Entry]) -> None:
    """Every run of a plan trains with the same effective batch, unless its entry says ``vary_batch``."""
    varies = {entry.name for entry in entries if entry.vary_batch}
    compared = [(spec.name, effective_batch(spec.resolved))
                for spec in specs if spec.name not in varies]
    for name, batch in compared:
        first_name, first_batch = compared[0]
        require(batch == first_batch, f"runs.{name}: effective batch {batch} differs from {first_name}'s "
                f"{first_batch}; set vary_batch: true on a run that is about batch size")
