"""A study plan (``configs/study/plan_*.yaml``) and its runs, each run's config resolved by LightningCLI itself."""

import contextlib
import copy
import functools
import hashlib
import io
import json
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from modelwright import REPO_ROOT
from modelwright.errors import ConfigError, one_line, require
from modelwright.record import get_path, to_jsonable

PLAN_KEYS = {"model", "warmup_steps", "measured_steps", "repeats", "val_batches", "budget", "runs", "description"}
ENTRY_KEYS = {"name", "config", "overrides", "accelerators", "vary_batch", "description"}
#: What ``accelerators`` may name: cpu-bf16 is a CPU with bf16 instructions (elsewhere bf16 autocast is emulated).
DEVICE_KINDS = {"cpu", "cpu-bf16", "cuda"}


@dataclass
class Entry:
    """One experiment of a plan: a config delta plus overrides, run under a name."""

    name: str
    config: str | None
    overrides: dict[str, Any] = field(default_factory=dict)
    accelerators: list[str] | None = None
    vary_batch: bool = False


@dataclass
class Plan:
    """A plan file. Its first run is the baseline; steps may be per device type (``{cpu: 10, cuda: 20}``)."""

    path: str
    entries: list[Entry]
    model: str | None = None
    warmup_steps: int | dict[str, int] = 1
    measured_steps: int | dict[str, int] = 10
    repeats: int = 3
    val_batches: int = 0
    budget_gib: float | None = None
    budget_runs: list[str] = field(default_factory=list)


def rel(path: str | os.PathLike) -> str:
    """``path`` relative to the repository root when it lies inside it (records name no machine paths)."""
    p = Path(path).resolve()
    return p.relative_to(REPO_ROOT).as_posix() if p.is_relative_to(REPO_ROOT) else str(path)


def count(value: Any, key: str, minimum: int = 1, per_device: bool = False) -> Any:
    for v in value.values() if per_device and isinstance(value, dict) else [value]:
        ok = isinstance(v, int) and not isinstance(v, bool) and v >= minimum
        require(ok, f"{key}: must be an integer >= {minimum}, got {v!r}")
    return value


def for_device(value: int | Mapping[str, int], device: str) -> int:
    """A per-device plan value for ``device`` (a mapping without it gives its ``cpu`` value)."""
    return value.get(device, value.get("cpu", 1)) if isinstance(value, Mapping) else value


def _known(mapping: Mapping, keys: set[str], where: str) -> None:
    unknown = min(set(mapping) - keys, default=None)  # the first, in sorted order
    require(unknown is None, f"{where}: unknown key {unknown!r}; valid: {', '.join(sorted(keys))}")


def load_plan(path: str | os.PathLike) -> Plan:
    """Read and check a plan file; a problem raises :class:`ConfigError` naming the file and key."""
    where = rel(path)
    require(Path(path).is_file(), f"plan: no plan file at {where}")
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: not valid YAML ({one_line(err)})") from None
    require(isinstance(data, dict), f"{where}: a plan is a mapping with a 'runs' list")
    _known(data, PLAN_KEYS, where)
    runs = data.get("runs")
    require(isinstance(runs, list) and bool(runs), f"{where}: runs: must be a non-empty list of {{name, config}}")
    entries: list[Entry] = []
    for i, item in enumerate(runs):
        key = f"{where}: runs[{i}]"
        require(isinstance(item, dict) and isinstance(item.get("name"), str), f"{key}: needs a 'name'")
        _known(item, ENTRY_KEYS, key)
        e = Entry(item["name"], item.get("config"), item.get("overrides") or {}, item.get("accelerators"),
                  bool(item.get("vary_batch")))
        require(re.fullmatch(r"[A-Za-z0-9][\w.+-]*", e.name) is not None, f"{key}.name: {e.name!r} is not a plain name")
        require(e.name not in {x.name for x in entries}, f"{key}.name: {e.name!r} appears twice")
        require(not e.config or (REPO_ROOT / e.config).is_file(), f"{key}.config: no config file at {e.config}")
        require(isinstance(e.overrides, dict), f"{key}.overrides: must be a mapping of dotted keys to values")
        ok = e.accelerators is None or isinstance(e.accelerators, list) and set(e.accelerators) <= DEVICE_KINDS
        require(ok, f"{key}.accelerators: a list of {', '.join(sorted(DEVICE_KINDS))}, e.g. [cuda]")
        entries.append(e)
    budget = data.get("budget") or {}
    gib, budget_runs = budget.get("gib"), budget.get("runs") or []
    ok = gib is None or (isinstance(gib, (int, float)) and not isinstance(gib, bool) and gib > 0)
    require(ok, f"{where}: budget.gib: must be a positive number, got {gib!r}")
    for name in budget_runs:
        require(name in {e.name for e in entries}, f"{where}: budget.runs: {name!r} is not a run of this plan")
    return Plan(where, entries, data.get("model"),
                count(data.get("warmup_steps", 1), f"{where}: warmup_steps", 0, per_device=True),
                count(data.get("measured_steps", 10), f"{where}: measured_steps", per_device=True),
                count(data.get("repeats", 3), f"{where}: repeats"),
                count(data.get("val_batches", 0), f"{where}: val_batches", 0),
                float(gib) if gib is not None else None, list(budget_runs))


def cli_value(value: Any) -> str:
    """``value`` as LightningCLI reads it after ``--key=``."""
    return json.dumps(value) if isinstance(value, (bool, dict, list)) or value is None else str(value)


def resolve_config(config_files: Sequence[str | os.PathLike] = (), overrides: Mapping[str, Any] | None = None) -> dict:
    """The config a run sees: what ``main.py fit --config <file>... --<key>=<value>... --print_config`` prints, by
    LightningCLI's own parser in this process, cached per argument list; a refusal is the parser's one-line error."""
    args = ["fit", *(a for f in config_files for a in ("--config", str(REPO_ROOT / f)))]
    args += [f"--{key}={cli_value(value)}" for key, value in (overrides or {}).items()]
    return copy.deepcopy(_print_config(tuple(args)))


@functools.cache
def _print_config(args: tuple[str, ...]) -> dict:
    from modelwright.train.cli import cli_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), contextlib.suppress(SystemExit), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", "LightningCLI's args parameter")  # this process's own argv is not for it
        cli_main([*args, "--print_config"])
    errors = [line[7:] for line in err.getvalue().splitlines() if line.startswith("error: ")]
    require(bool(out.getvalue().strip()), errors[-1] if errors else f"config: cannot resolve {args[1:]}")
    return yaml.safe_load(out.getvalue())


def _positive(value: Any) -> int:
    if isinstance(value, str) and value.isdigit():  # LightningCLI keeps `--trainer.devices=2` a string
        value = int(value)
    value = len(value) if isinstance(value, list) else value
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def world_size(resolved: Mapping) -> int:
    return _positive(get_path(resolved, "trainer.devices")) * _positive(get_path(resolved, "trainer.num_nodes"))


def effective_batch(resolved: Mapping) -> int | None:
    """Samples per optimizer step: micro-batch × accumulation × processes (``None`` if not an integer)."""
    micro, accumulate = get_path(resolved, "data.batch_size"), get_path(resolved, "trainer.accumulate_grad_batches", 1)
    ok = isinstance(micro, int) and isinstance(accumulate, int)
    return micro * accumulate * world_size(resolved) if ok else None


def patch_callbacks(callbacks: Any, warmup_steps: int, record_path: str | None = None) -> list[dict]:
    """The callbacks list of a study run: the measurement window set, no checkpoint files, the record path; a
    ConfigError if it has no ``RunMonitor`` (the study could not read the run's result)."""
    def name(cb: Any) -> str:
        return str(cb.get("class_path", "")).rsplit(".", 1)[-1] if isinstance(cb, dict) else str(cb or "")

    ok = isinstance(callbacks, list) and any(name(cb) == "RunMonitor" for cb in callbacks)
    require(ok, "trainer.callbacks: the study needs callbacks.run_monitor.RunMonitor in the list (configs/base.yaml)")
    window = {"RunMonitor": {"warmup_steps": warmup_steps, "measure_steps": None, "anatomy": True,
                             "anatomy_step": None, "record_path": record_path, "records_jsonl": None}}
    return [{**copy.deepcopy(cb), "init_args": {**(cb.get("init_args") or {}), **window.get(name(cb), {})}}
            for cb in callbacks if name(cb) != "ModelCheckpoint"]  # a study run saves no checkpoint


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


@dataclass
class RunSpec:
    """One process to run (``kind``: ``run`` or ``budget``) of the plan's entry ``index``."""

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

    @property
    def folder(self) -> str:
        return f"{self.name}-{self.config_hash}-{self.kind[0]}{self.repeat}"

    @property
    def label(self) -> str:
        budget = f"@ batch {get_path(self.resolved, 'data.batch_size')} ({self.extra.get('role')})"
        return f"{self.name} {f'r{self.repeat}' if self.kind == 'run' else budget}"


def build_spec(entry: Entry, index: int, settings: Settings, repeat: int = 0, kind: str = "run",
               batch_size: int | None = None, extra: Mapping[str, Any] | None = None) -> RunSpec:
    """The run of ``entry``: overrides in order (model, the command line's, the entry's, the study's window). A budget
    run has a micro-batch of its own, no accumulation and no timed steps: only its peak matters."""
    # A window of a few steps is no schedule's intended length: a constant learning rate keeps runs comparable.
    overrides: dict[str, Any] = {"model.scheduler": "none", "model.model_name": settings.model}
    overrides = {k: v for k, v in overrides.items() if v} | settings.overrides | entry.overrides
    if settings.accelerator != "auto":
        overrides["trainer.accelerator"] = settings.accelerator
    measured, val_batches = settings.measured_steps, settings.val_batches
    if kind == "budget":
        overrides.update({"data.batch_size": batch_size, "trainer.accumulate_grad_batches": 1})
        measured, val_batches = 0, 0
    files = [entry.config] if entry.config else []
    try:
        draft = resolve_config(files, overrides)
    except ConfigError as err:
        raise ConfigError(f"runs.{entry.name}: {err}") from None
    accumulate = _positive(get_path(draft, "trainer.accumulate_grad_batches"))
    # Warm-up steps, the anatomy step (left out of the timing), the measured steps: one short epoch, then validation.
    total = settings.warmup_steps + 1 + measured
    overrides.update({
        "trainer.max_epochs": 1, "trainer.max_steps": total, "trainer.limit_train_batches": total * accumulate,
        "trainer.limit_val_batches": val_batches, "trainer.num_sanity_val_steps": 0, "trainer.log_every_n_steps": 1,
        "trainer.enable_checkpointing": False, "trainer.enable_progress_bar": False,
        "trainer.enable_model_summary": False, "trainer.val_check_interval": 1.0,
    })
    needed = total * accumulate * _positive(get_path(draft, "data.batch_size")) * world_size(draft)
    if not isinstance(get_path(draft, "data.train_size"), int) or get_path(draft, "data.train_size") < needed:
        overrides["data.train_size"] = needed
    resolved = resolve_config(files, overrides)
    resolved["trainer"]["callbacks"] = patch_callbacks(resolved["trainer"].get("callbacks"), settings.warmup_steps)
    # The run's identity (what resume compares): its resolved config on one hardware slug.
    text = json.dumps({"config": to_jsonable(resolved), "slug": settings.slug}, sort_keys=True, separators=(",", ":"))
    return RunSpec(entry.name, kind, index, repeat, entry.config, overrides, resolved,
                   hashlib.sha256(text.encode("utf-8")).hexdigest()[:12], measured, dict(extra or {}))


def command(spec: RunSpec, run_dir: Path) -> list[str]:
    """The child's argument list (after the interpreter), with paths relative to the repository root."""
    where = rel(run_dir)
    args = ["main.py", "fit", *(["--config", spec.config] if spec.config else [])]
    args += ["--config", f"{where}/callbacks.yaml", *(f"--{k}={cli_value(v)}" for k, v in spec.overrides.items())]
    if isinstance(get_path(spec.resolved, "trainer.logger"), dict):
        args.append(f"--trainer.logger.init_args.save_dir={where}")
    return args


def check_effective_batch(specs: Sequence[RunSpec], entries: Sequence[Entry]) -> None:
    """Every run of a plan trains with the same effective batch, unless its entry says ``vary_batch``."""
    varies = {e.name for e in entries if e.vary_batch}
    compared = [(s.name, effective_batch(s.resolved)) for s in specs if s.name not in varies]
    for name, eff in compared:
        require(eff == compared[0][1], f"runs.{name}: effective batch {eff} differs from {compared[0][0]}'s "
                f"{compared[0][1]}; set vary_batch: true on a run that is about batch size")
