"""The efficiency study (``uv run python -m modelwright study --help``): a plan of experiment configs, each
trained for a short measured window in a fresh process; then :mod:`modelwright.report` writes the table, plots
and README."""

import dataclasses
import inspect
import json
import os
import re
import signal
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from jsonargparse.typing import NonNegativeInt, PositiveFloat, PositiveInt

from modelwright import REPO_ROOT, fmt, repo_path
from modelwright.errors import require
from modelwright.fmt import finite
from modelwright.record import get_path, read_records
from modelwright.report import generate
from modelwright.study.budget import budget_phase
from modelwright.study.plan import (
    Entry,
    Plan,
    RunSpec,
    Settings,
    build_spec,
    check_effective_batch,
    cli_value,
    command,
    for_device,
    load_plan,
    patch_callbacks,
    rel,
    resolve_config,
)
from modelwright.study.runner import DONE_STATUSES, Progress, Study, say, study_lock
from modelwright.study_rows import Row, build_rows

__all__ = ["DONE_STATUSES", "hardware_slug", "patch_callbacks", "resolve_config", "study"]


def slugify(text: str) -> str:
    text = re.sub(r"\((r|tm|c)\)|\b(cpu|processor|with|radeon graphics)\b|@.*$", " ", text, flags=re.I)
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def hardware_slug(accelerator: str = "auto") -> str:
    """``cpu-<cpu model>-<vector ISA>-<n>cores`` or ``cuda-<gpu name>`` (``-x<n>`` for several GPUs),
    lowercase with dashes. A CPU's names its vector ISA: one model name ("AMD EPYC") covers machines with and
    without AVX-512."""
    import torch

    if accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available()):
        require(torch.cuda.is_available(), f"accelerator: {accelerator} but no CUDA device is visible")
        slug = f"cuda-{slugify(torch.cuda.get_device_name(0))}"
        gpus = torch.cuda.device_count()
        if gpus > 1:
            slug += f"-x{gpus}"
        return slug
    if accelerator not in ("auto", "cpu"):
        return slugify(accelerator)
    from modelwright.measure.facts import cpu_model, vector_isa

    parts = ["cpu", slugify(cpu_model()) or "unknown", vector_isa(), f"{os.cpu_count()}cores"]
    return "-".join(part for part in parts if part)


def _device_kinds(device: str) -> set[str]:
    """What the plan's ``accelerators`` lists are matched against here. cpu-bf16: a CPU with bf16 instructions
    (elsewhere bf16 autocast is emulated: ~15× an fp32 step)."""
    from modelwright.measure.facts import cpuinfo

    if device == "cpu" and {"avx512_bf16", "amx_bf16"} & set(cpuinfo().get("flags", "").split()):
        return {device, "cpu-bf16"}
    return {device}


def _runnable(plan: Plan, only: list[str] | None, device: str) -> tuple[list[Entry], list[Entry]]:
    """The plan's entries to run here and those that run on other devices. A run named in ``only`` runs
    anyway: the user asked for it (e.g. to check a bf16 prediction on such a CPU)."""
    names = [entry.name for entry in plan.entries]
    for name in only or []:
        require(name in names, f"only: {name!r} is not a run of {plan.path}; valid: {', '.join(names)}")
    entries = [entry for entry in plan.entries if not only or entry.name in only]
    if only:
        return entries, []
    kinds = _device_kinds(device)
    runnable = [entry for entry in entries if not entry.accelerators or kinds & set(entry.accelerators)]
    return runnable, [entry for entry in entries if entry not in runnable]


def _say_elsewhere(elsewhere: list[Entry], device: str) -> None:
    for entry in elsewhere:
        emulated = ""
        if device == "cpu" and "cpu-bf16" in entry.accelerators:
            emulated = ": bf16 is emulated on this CPU"
        say(f"  {entry.name}: not on {device} (runs on {', '.join(entry.accelerators)}{emulated})")


def _say_dry_run(specs: Sequence[RunSpec], runner: Study, workdir: Path) -> None:
    for spec in specs:
        state = "recorded" if runner.recorded(spec) else "to run"
        args = command(spec, workdir / spec.folder)
        say(f"  {spec.label} [{spec.config_hash}] {state}: python {' '.join(args)}")
    settings = runner.settings
    if settings.max_repeats > settings.repeats:
        say(f"  then more repeats may follow: up to {settings.max_repeats} of a row and of its baseline, in "
            f"turn, where the first {settings.repeats} leave the row undecided (not in the estimate)")
    say(_estimate([spec for spec in specs if not runner.recorded(spec)], runner))


def _estimate(to_run: Sequence[RunSpec], runner: Study) -> str:
    """How long the runs still to run take, from this machine's records of the same runs (same name and kind,
    any config), else from the project's committed records of this hardware slug (a new results folder): the
    median of their process times; the budget phase is left out."""
    if not to_run:
        return "estimate: nothing to run"
    committed = REPO_ROOT / "results" / runner.settings.slug / "records.jsonl"
    for source in dict.fromkeys([runner.records_path, committed]):
        known = _known_seconds(to_run, source)
        if known:
            break
    if not known:
        return (f"estimate: none: no record of these runs on {runner.settings.slug} yet (the plan file says "
                "roughly how long its runs take on the project's machines)")
    unknown = len(to_run) - len(known)
    missing = f"; {unknown} of them with no record to go by" if unknown else ""
    origin = "this machine's earlier records of the same runs"
    if source != runner.records_path:
        origin = f"the records of the same runs in {rel(source.parent)}/"
    return (f"estimate: about {fmt.duration(sum(known))} for the {len(to_run)} runs to run, from {origin}"
            f"{missing}; the budget phase comes on top")


def _known_seconds(to_run: Sequence[RunSpec], records_path: Path) -> list[float]:
    """The median process time of each run of ``to_run`` that ``records_path`` has a record of."""
    seconds: dict[tuple[str, str], list[float]] = {}
    records = read_records(records_path) if records_path.is_file() else []
    for record in records:
        facts = record.get("study") or {}
        wall = finite(facts.get("process_wall_s"))
        if wall is not None:
            seconds.setdefault((facts.get("name"), facts.get("kind", "run")), []).append(wall)
    return [statistics.median(seconds[key]) for spec in to_run if (key := (spec.name, spec.kind)) in seconds]


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM ends the study as Ctrl-C does: the running child's group is killed and the lock released."""
    if threading.current_thread() is not threading.main_thread():  # where Python can set a handler
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        if previous is not None:  # None: not set by Python code
            signal.signal(signal.SIGTERM, previous)


@dataclasses.dataclass
class _Sweep:
    """What one study command runs: the plan, its settings, the runs in order and the budget phase."""

    plan: Plan
    settings: Settings
    device: str
    runnable: list[Entry]
    elsewhere: list[Entry]
    specs: list[RunSpec]  # the timed runs, repeats round-robin, then one whole epoch of each entry
    budget_gib: float | None
    budget_runs: list[str]
    job_name: str = ""  # a user's job's (its trainer.logger name): its outputs' folder
    repeats_by_run: dict[str, int] = dataclasses.field(default_factory=dict)  # timed ones, extra ones too

    @property
    def budget(self) -> bool:
        return bool(self.budget_gib and self.budget_runs)


def _settings(plan: Plan, arguments: dict[str, Any], device: str) -> Settings:
    """The command line's values over the plan's (steps may be per device)."""
    def chosen(argument: str, planned: Any) -> Any:
        return planned if arguments[argument] is None else arguments[argument]

    return Settings(arguments["slug"], arguments["accelerator"],
                    warmup_steps=for_device(chosen("warmup_steps", plan.warmup_steps), device),
                    measured_steps=for_device(chosen("steps", plan.measured_steps), device),
                    repeats=arguments["repeats"] or plan.repeats, max_repeats=plan.max_repeats,
                    val_batches=chosen("val_batches", plan.val_batches),
                    model=arguments["model"] or plan.model, overrides=dict(arguments["overrides"] or {}),
                    job=tuple(rel(path) for path in arguments["job"]))


def _job_name(settings: Settings) -> str:
    """The folder of a user's job's outputs: its ``trainer.logger.init_args.name`` (``""``: no job)."""
    if not settings.job:
        return ""
    for path in settings.job:
        require(Path(path).is_file() or (REPO_ROOT / path).is_file(), f"config: no file {path}")
    name = get_path(resolve_config(list(settings.job)), "trainer.logger.init_args.name")
    require(isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9][\w.-]*", name) is not None,
            f"trainer.logger.init_args.name: the job's name names its results folder; got {name!r}")
    return name


def _sweep(plan: Plan, arguments: dict[str, Any]) -> _Sweep:
    """Resolve every run's config before anything runs."""
    slug = arguments["slug"]
    require(re.fullmatch(r"[a-z0-9][a-z0-9._-]*", slug) is not None, f"slug: {slug!r} is not a plain name")
    device = "cpu"
    if arguments["accelerator"] in ("cuda", "gpu") or slug.startswith("cuda-"):
        device = "cuda"
    settings = _settings(plan, arguments, device)
    job_name = _job_name(settings)
    runnable, elsewhere = _runnable(plan, arguments["only"], device)
    # Round-robin: every run once, then again, so that a slow spell of the machine spreads over every row.
    specs = [build_spec(entry, plan.entries.index(entry), settings, repeat)
             for repeat in range(settings.repeats) for entry in runnable]
    check_effective_batch(specs, runnable)
    if arguments["epochs"]:
        specs += [build_spec(entry, plan.entries.index(entry), settings, kind="epoch") for entry in runnable]
    budget_gib = None
    if arguments["budget"]:
        budget_gib = arguments["budget_gib"] or plan.budget_gib
    runnable_names = {entry.name for entry in runnable}
    budget_runs = [name for name in plan.budget_runs if name in runnable_names]
    return _Sweep(plan, settings, device, runnable, elsewhere, specs, budget_gib, budget_runs, job_name)


def _announce(sweep: _Sweep, to_run: int, results_dir: Path) -> None:
    settings = sweep.settings
    budget = ""
    if sweep.budget:
        budget = f"; budget {sweep.budget_gib:g} GiB for {', '.join(sweep.budget_runs)}"
    epochs = sum(spec.kind == "epoch" for spec in sweep.specs)
    timed = len(sweep.specs) - epochs
    whole = f", then {epochs} whole epoch(s), one per run" if epochs else ""
    say(f"study {sweep.plan.path} on {settings.slug}: {len(sweep.specs)} runs ({to_run} to run): {timed} of "
        f"{settings.warmup_steps} warm-up + 1 anatomy + {settings.measured_steps} measured steps "
        f"({settings.repeats} repeats, round-robin){whole}{budget}\nresults: {rel(results_dir)}/")
    if sweep.specs and not to_run:
        say(f"every run is recorded in {rel(results_dir)}/ already: to measure afresh, give another results "
            "folder (--results ../scratch/results) or --rerun true")
    _say_elsewhere(sweep.elsewhere, sweep.device)


#: How far from 1.0 a row's step ratio must be for more repeats to be worth deciding it (:func:`undecided`).
UNDECIDED_CHANGE = 0.02


def undecided(row: Row) -> bool:
    """Whether more repeats could decide ``row``: its paired interval on the step ratio contains 1.0 while
    the ratio of median steps is more than :data:`UNDECIDED_CHANGE` (2%) from 1.0. A ratio within 2% is no
    measurable change as it stands; a row without an interval (under 2 pairs) has no verdict to decide."""
    time_ratio = row.vs("step_ms")
    if row.interval is None or time_ratio is None:
        return False
    return row.interval.low <= 1 <= row.interval.high and abs(time_ratio - 1) > UNDECIDED_CHANGE


def _extra_specs(sweep: _Sweep, runner: Study) -> list[RunSpec]:
    """Repeats ``repeats`` to ``max_repeats - 1`` of each row that the first round's records (of this sweep's
    own runs: a resumed study extends the same rows) leave :func:`undecided`, and of its baseline: each round
    the baseline first, then its rows."""
    first = [runner.done[spec.key] for spec in sweep.specs if spec.kind == "run" and spec.key in runner.done]
    compared = [row for row in build_rows(first) if row.ok and row.reference not in (None, row)]
    rows = [row for row in compared if undecided(row)]
    for row in rows:
        figures = f"{fmt.ratio(row.vs('step_ms'), 3)}, {row.interval.text()}"
        say(f"{row.name}: undecided after {sweep.settings.repeats} repeats ({figures}): up to "
            f"{sweep.settings.max_repeats}, in turn with {row.reference.name}")
    names = dict.fromkeys(name for row in rows for name in (row.reference.name, row.name))
    entries = {entry.name: entry for entry in sweep.runnable}
    return [build_spec(entries[name], sweep.plan.entries.index(entries[name]), sweep.settings, repeat)
            for repeat in range(sweep.settings.repeats, sweep.settings.max_repeats) for name in names]


def _more_repeats(sweep: _Sweep, runner: Study, progress: Progress) -> None:
    """The extra repeats (:func:`_extra_specs`), run; how many timed repeats each run got, said and kept."""
    extra = _extra_specs(sweep, runner)
    progress.add_runs(sum(runner.recorded(spec) is None for spec in extra))
    for spec in extra:
        runner.run(spec, progress)
    timed = [spec for spec in sweep.specs if spec.kind == "run"]
    sweep.repeats_by_run = dict(Counter(spec.name for spec in [*timed, *extra]))
    if extra:
        counts = [f"{name} {count}" for name, count in sweep.repeats_by_run.items()]
        say(f"repeats per run: {', '.join(counts)}")


def _run(sweep: _Sweep, runner: Study, to_run: int) -> None:
    failed_before = {spec.name for spec in sweep.specs if _timed_runs_failed(sweep, runner, spec.name)}
    timed = [spec for spec in sweep.specs if spec.kind == "run"]  # the first round, before any epoch run
    with Progress(to_run) as progress:
        for spec in timed:
            runner.run(spec, progress)
        _more_repeats(sweep, runner, progress)
        for spec in sweep.specs[len(timed):]:
            unrecorded_epoch = spec.kind == "epoch" and runner.recorded(spec) is None
            if unrecorded_epoch and _timed_runs_failed(sweep, runner, spec.name):
                counted = spec.name not in failed_before  # among the runs to run when the study began
                runner.leave_out(spec, progress, "every timed run of it failed", counted)
                continue
            runner.run(spec, progress)
        if sweep.budget:
            budget_phase(runner, sweep.runnable, progress, sweep.budget_gib * 1024)


def _timed_runs_failed(sweep: _Sweep, runner: Study, name: str) -> bool:
    """Whether every timed run of ``name`` has ended, none ok: a whole epoch of it would fail the same way."""
    timed = [spec for spec in sweep.specs if spec.kind == "run" and spec.name == name]
    ended = all(runner.done.get(spec.key) is not None for spec in timed)
    return ended and not any(runner.ended_ok(spec) for spec in timed)


def _will_run(sweep: _Sweep, runner: Study, spec: RunSpec) -> bool:
    """Whether ``spec`` is to run: not recorded, and not an epoch of a run whose timed runs all failed."""
    if runner.recorded(spec) is not None:
        return False
    return spec.kind != "epoch" or not _timed_runs_failed(sweep, runner, spec.name)


def _write_summary(sweep: _Sweep, runner: Study, results_dir: Path, cmd: list[str], wall_s: float) -> None:
    summary = {"plan": sweep.plan.path, "command": " ".join(cmd), **dataclasses.asdict(sweep.settings),
               "repeat_order": "round-robin", "repeats_by_run": sweep.repeats_by_run,
               "budget_gib": sweep.budget_gib if sweep.budget else None,
               "runs_not_on_this_device": [entry.name for entry in sweep.elsewhere],
               "runs_executed": runner.executed, "runs_skipped": runner.skipped, "runs_failed": runner.failed,
               "wall_time_s": wall_s, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (results_dir / "study.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    say(f"study done in {fmt.duration(wall_s)}: {runner.executed} run, {runner.skipped} skipped, "
        f"{runner.failed} not ok; records: {rel(runner.records_path)}")


def _command(arguments: dict[str, Any]) -> list[str]:
    """The study command that reproduces the records: the job's files as ``--config``, then the arguments
    that differ from their defaults."""
    defaults = inspect.signature(study).parameters
    given = {name: value for name, value in arguments.items()
             if name != "job" and value != defaults[name].default}
    job = [part for path in arguments["job"] for part in ("--config", rel(path))]
    return ["python", "-m", "modelwright", "study", *job,
            *(f"--{name}={cli_value(value)}" for name, value in given.items())]


DEFAULT_PLAN = Path("configs/study/plan_default.yaml")
#: The plan of a user's job (``study --config my_job.yaml``): its baseline, each technique alone, combined.
JOB_PLAN = Path("configs/study/plan_job.yaml")


def _for_the_job(job: list[Path], plan: Path) -> Path:
    """A user's job is studied by :data:`JOB_PLAN` unless a plan is named."""
    if job and plan == DEFAULT_PLAN:
        return JOB_PLAN
    return plan


def _readme(readme: Path | None, job: list[Path], results: Path) -> Path | None:
    """The README the report fills: the one named, else the project's own where the study writes into the
    project's own results folder (not a user's job, not a scratch folder, whose few rows would replace it)."""
    if readme is not None:
        return readme
    own_results = results.resolve() == (REPO_ROOT / "results").resolve()
    if own_results and not job:
        return REPO_ROOT / "README.md"
    return None


def study(job: list[Path] = [],  # noqa: B006 (jsonargparse reads it)
          plan: Path = DEFAULT_PLAN, only: list[str] | None = None,
          model: str | None = None, accelerator: str = "auto", warmup_steps: NonNegativeInt | None = None,
          steps: PositiveInt | None = None, repeats: PositiveInt | None = None,
          val_batches: NonNegativeInt | None = None, overrides: dict[str, Any] | None = None,
          budget_gib: PositiveFloat | None = None, budget: bool = True, results: Path = Path("results"),
          slug: str | None = None, workdir: Path = Path("lightning_logs/study"),
          readme: Path | None = None, report: bool = True, allow_mixed: bool = False,
          rerun: bool = False, retry_failed: bool = False, run_timeout_s: PositiveFloat | None = None,
          predict: bool = True, epochs: bool = True, dry_run: bool = False) -> int:
    """Run a plan of experiment configs, each in a fresh process, then write the table, plots and README
    section. Returns 0, or 1 if every run it ran failed (a user error raises ConfigError: one line, exit
    status 2).

    Args:
        job: a training job's config files, given as ``--config FILE`` as to ``main.py fit``: every run is
            that job with the plan's changes, the plan by default configs/study/plan_job.yaml, the outputs
            under <results>/<hardware slug>/<job name>/ (its trainer.logger name), the README left alone.
        plan: the plan file (configs/study/plan_*.yaml).
        only: run names of the plan to run, e.g. [baseline,amp].
        model: the network of every run (overrides the plan's): resnet18, smallcnn, vit, or a class path.
        accelerator: trainer.accelerator for every run: auto, cpu, cuda, ...
        warmup_steps: unmeasured steps per run (default: the plan's, for this device).
        steps: measured steps per run (default: the plan's, for this device).
        repeats: fresh-process repeats of every run, round-robin (default: the plan's); then a row that they
            leave undecided and its baseline get more, in turn, up to the plan's ``max_repeats``.
        val_batches: validation batches at the end of each run (default: the plan's).
        overrides: dotted config keys for every run, e.g. {data.batch_size: 64}.
        budget_gib: memory budget of the largest-batch runs (default: the plan's).
        budget: run the largest-batch-under-budget phase.
        results: results root; the outputs go to <results>/<hardware slug>/.
        slug: hardware slug (default: from the device).
        workdir: run folders (logs, output.log, record.json).
        readme: README whose sections are regenerated (default: README.md for a study into the project's
            own results/ folder; none for a user's job or another results folder).
        report: write the table, plots and README section after the runs.
        allow_mixed: let the report table records of different commits or definitions, marked.
        rerun: run again even what is recorded.
        retry_failed: run again the runs recorded as failed or oom.
        run_timeout_s: stop a run (and record it as failed) after this long.
        predict: predict every run's peak before it, by rehearsing its step (the budget needs it).
        epochs: also time one whole epoch of each run, as its config has it.
        dry_run: list the runs, their commands and an estimate of their time; run nothing.
    """
    arguments = dict(locals())
    cmd = _command(arguments)
    started = time.perf_counter()
    arguments["slug"] = slug or hardware_slug(accelerator)
    plan = _for_the_job(job, plan)
    readme = _readme(readme, job, results)
    sweep = _sweep(load_plan(repo_path(plan)), arguments)
    runner = _study_runner(sweep, arguments, cmd)
    to_run = sum(_will_run(sweep, runner, spec) for spec in sweep.specs)
    _announce(sweep, to_run, runner.results_dir)
    if dry_run:
        _say_dry_run(sweep.specs, runner, runner.workdir)
        return 0
    if not _run_locked(sweep, runner, to_run, runner.results_dir, cmd, started):
        return 130
    return _report_and_status(runner, runner.results_dir, readme if report else False, allow_mixed)


def _study_runner(sweep: _Sweep, arguments: dict[str, Any], cmd: list[str]) -> Study:
    """The runner of ``sweep``: its results and run folders under the hardware slug (and the job's name)."""
    folders = [arguments[key].resolve() / sweep.settings.slug / sweep.job_name
               for key in ("results", "workdir")]
    options = {key: arguments[key] for key in ("rerun", "retry_failed", "predict", "run_timeout_s")}
    return Study(sweep.plan, sweep.settings, *folders, **options, cmd=cmd)


def _run_locked(sweep: _Sweep, runner: Study, to_run: int, results_dir: Path, cmd: list[str],
                started: float) -> bool:
    """The runs, under the results folder's lock, then study.json; False if interrupted (what was recorded
    is kept)."""
    try:
        with _sigterm_as_interrupt(), study_lock(results_dir):
            _run(sweep, runner, to_run)
            _write_summary(sweep, runner, results_dir, cmd, time.perf_counter() - started)
    except KeyboardInterrupt:
        say("interrupted: the runs recorded so far are kept; the same command resumes")
        return False
    return True


def _report_and_status(runner: Study, results_dir: Path, readme: Path | None | bool,
                       allow_mixed: bool) -> int:
    """The report (``readme`` False: none; None: the results folder's files only), then the study's exit
    status. Failed runs are results (recorded, shown in the table); only a study that measured nothing is an
    error."""
    if readme is not False:
        readme_path = repo_path(readme).resolve() if readme else None
        written = generate(results_dir, readme=readme_path, allow_mixed=allow_mixed)
        say("report: " + ", ".join(rel(path) for path in written))
    if runner.executed and runner.failed == runner.executed:
        return 1
    return 0
