"""The efficiency study (``uv run python -m modelwright study --help``): a plan of experiment configs, each trained
for a short measured window in a fresh process; then :mod:`modelwright.report` writes the table, plots and README."""

import dataclasses
import inspect
import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

from jsonargparse.typing import NonNegativeInt, PositiveFloat, PositiveInt

from modelwright import REPO_ROOT
from modelwright.errors import require
from modelwright.report import fmt, generate
from modelwright.study import plan as p
from modelwright.study.budget import budget_phase
from modelwright.study.plan import patch_callbacks, resolve_config
from modelwright.study.runner import DONE_STATUSES, Progress, Study, say, study_lock

__all__ = ["DONE_STATUSES", "hardware_slug", "patch_callbacks", "resolve_config", "study"]


def slugify(text: str) -> str:
    text = re.sub(r"\((r|tm|c)\)|\b(cpu|processor|with|radeon graphics)\b|@.*$", " ", text, flags=re.I)
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def hardware_slug(accelerator: str = "auto") -> str:
    """``cpu-<cpu model>-<vector ISA>-<n>cores`` or ``cuda-<gpu name>`` (``-x<n>`` for several GPUs), lowercase with
    dashes. A CPU's names its vector ISA: one model name ("AMD EPYC") covers machines with and without AVX-512."""
    import torch

    if accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available()):
        require(torch.cuda.is_available(), f"accelerator: {accelerator} but no CUDA device is visible")
        n = torch.cuda.device_count()
        return f"cuda-{slugify(torch.cuda.get_device_name(0))}" + (f"-x{n}" if n > 1 else "")
    if accelerator not in ("auto", "cpu"):
        return slugify(accelerator)
    from modelwright.measure.facts import cpu_model, cpuinfo

    flags = set(cpuinfo().get("flags", "").split())
    isa = next((name for name in ("avx512", "avx2", "neon", "asimd") if name in flags or f"{name}f" in flags), None)
    return "-".join(filter(None, ["cpu", slugify(cpu_model()) or "unknown", isa, f"{os.cpu_count()}cores"]))


def study(plan: Path = Path("configs/study/plan_default.yaml"), only: list[str] | None = None, model: str | None = None,
          accelerator: str = "auto", warmup_steps: NonNegativeInt | None = None, steps: PositiveInt | None = None,
          repeats: PositiveInt | None = None, val_batches: NonNegativeInt | None = None,
          overrides: dict[str, Any] | None = None, budget_gib: PositiveFloat | None = None, budget: bool = True,
          results: Path = Path("results"), slug: str | None = None, workdir: Path = Path("lightning_logs/study"),
          readme: Path | None = Path("README.md"), report: bool = True, allow_mixed: bool = False,
          rerun: bool = False, retry_failed: bool = False, run_timeout_s: PositiveFloat | None = None,
          predict: bool = True, dry_run: bool = False) -> int:
    """Run a plan of experiment configs, each in a fresh process, then write the table, plots and README section.
    Returns 0, or 1 if every run it ran failed (a user error raises ConfigError: one line, exit status 2).

    Args:
        plan: the plan file (configs/study/plan_*.yaml).
        only: run names of the plan to run, e.g. [baseline,amp].
        model: model.model_name for every run (overrides the plan's).
        accelerator: trainer.accelerator for every run: auto, cpu, cuda, ...
        warmup_steps: unmeasured steps per run (default: the plan's, for this device).
        steps: measured steps per run (default: the plan's, for this device).
        repeats: fresh-process repeats of every run, round-robin (default: the plan's).
        val_batches: validation batches at the end of each run (default: the plan's).
        overrides: dotted config keys for every run, e.g. {data.batch_size: 64}.
        budget_gib: memory budget of the largest-batch runs (default: the plan's).
        budget: run the largest-batch-under-budget phase.
        results: results root; the outputs go to <results>/<hardware slug>/.
        slug: hardware slug (default: from the device).
        workdir: run folders (logs, output.log, record.json).
        readme: README whose results section is regenerated; null leaves it alone.
        report: write the table, plots and README section after the runs.
        allow_mixed: let the report table records of different commits or definitions, marked.
        rerun: run again even what is recorded.
        retry_failed: run again the runs recorded as failed or oom.
        run_timeout_s: stop a run (and record it as failed) after this long.
        predict: profile one step of the baseline and write every run's predicted peak before it (the budget needs it).
        dry_run: list the runs and their commands; run nothing.
    """
    given = {k: v for k, v in locals().items() if v != inspect.signature(study).parameters[k].default}
    cmd = ["python", "-m", "modelwright", "study", *(f"--{k}={p.cli_value(v)}" for k, v in given.items())]
    t0 = time.perf_counter()
    the_plan = p.load_plan(plan if plan.exists() or plan.is_absolute() else REPO_ROOT / plan)
    slug = slug or hardware_slug(accelerator)
    require(re.fullmatch(r"[a-z0-9][a-z0-9._-]*", slug) is not None, f"slug: {slug!r} is not a plain name")
    device = "cuda" if accelerator in ("cuda", "gpu") or slug.startswith("cuda-") else "cpu"
    settings = p.Settings(
        slug, accelerator, p.for_device(the_plan.warmup_steps if warmup_steps is None else warmup_steps, device),
        p.for_device(the_plan.measured_steps if steps is None else steps, device), repeats or the_plan.repeats,
        the_plan.val_batches if val_batches is None else val_batches, model or the_plan.model, dict(overrides or {}))
    names = [e.name for e in the_plan.entries]
    for name in only or []:
        require(name in names, f"only: {name!r} is not a run of {the_plan.path}; valid: {', '.join(names)}")
    entries = [e for e in the_plan.entries if not only or e.name in only]
    from modelwright.measure.facts import cpuinfo

    # cpu-bf16: a CPU with bf16 instructions (elsewhere bf16 autocast is emulated: ~15× an fp32 step).
    bf16 = device == "cpu" and {"avx512_bf16", "amx_bf16"} & set(cpuinfo().get("flags", "").split())
    kinds = {device, "cpu-bf16"} if bf16 else {device}
    # A run named in --only runs anyway: the user asked for it (e.g. to check a bf16 prediction on such a CPU).
    runnable = entries if only else [e for e in entries if not e.accelerators or kinds & set(e.accelerators)]
    # Round-robin: every run once, then again, so that a slow spell of the machine spreads over every row.
    specs = [p.build_spec(e, names.index(e.name), settings, r) for r in range(settings.repeats) for e in runnable]
    p.check_effective_batch(specs, runnable)
    budget_gib = budget_gib or the_plan.budget_gib
    budget_runs = [n for n in the_plan.budget_runs if n in {e.name for e in runnable}]
    do_budget = bool(budget and budget_gib and budget_runs)
    results_dir, workdir = results.resolve() / slug, workdir.resolve() / slug
    runner = Study(the_plan, settings, results_dir, workdir, rerun=rerun, retry_failed=retry_failed, profile=predict,
                   run_timeout_s=run_timeout_s, cmd=cmd)
    to_run = sum(runner.recorded(s) is None for s in specs)
    say(f"study {the_plan.path} on {slug}: {len(specs)} runs ({to_run} to run; {settings.repeats} repeats, "
        f"round-robin), {settings.warmup_steps} warm-up + 1 anatomy + {settings.measured_steps} measured steps each"
        + (f"; budget {budget_gib:g} GiB for {', '.join(budget_runs)}" if do_budget else "")
        + f"\nresults: {p.rel(results_dir)}/")
    elsewhere = [e for e in entries if e not in runnable]
    for e in elsewhere:
        emulated = ": bf16 is emulated on this CPU" if device == "cpu" and "cpu-bf16" in e.accelerators else ""
        say(f"  {e.name}: not on {device} (runs on {', '.join(e.accelerators)}{emulated})")
    if dry_run:
        for s in specs:
            state = "recorded" if runner.recorded(s) else "to run"
            say(f"  {s.label} [{s.config_hash}] {state}: python {' '.join(p.command(s, workdir / s.folder))}")
        return 0
    # SIGTERM ends the study as Ctrl-C does: the running child's group is killed and the lock released.
    main_thread = threading.current_thread() is threading.main_thread()  # where Python can set a handler
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if main_thread else None
    try:
        with study_lock(results_dir):
            with Progress(to_run) as progress:
                for spec in specs:
                    runner.run(spec, progress)
                if do_budget:
                    budget_phase(runner, runnable, progress, budget_gib * 1024)
            wall_s = time.perf_counter() - t0
            summary = {"plan": the_plan.path, "command": " ".join(cmd), **dataclasses.asdict(settings),
                       "repeat_order": "round-robin", "budget_gib": budget_gib if do_budget else None,
                       "runs_not_on_this_device": [e.name for e in elsewhere], "runs_executed": runner.executed,
                       "runs_skipped": runner.skipped, "runs_failed": runner.failed, "wall_time_s": wall_s,
                       "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            (results_dir / "study.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
            say(f"study done in {fmt.duration(wall_s)}: {runner.executed} run, {runner.skipped} skipped, "
                f"{runner.failed} not ok; records: {p.rel(runner.records_path)}")
    except KeyboardInterrupt:
        say("interrupted: the runs recorded so far are kept; the same command resumes")
        return 130
    finally:
        if previous is not None:  # None: not set here, or by no Python code
            signal.signal(signal.SIGTERM, previous)
    if report:
        written = generate(results_dir, readme=readme.resolve() if readme else None, allow_mixed=allow_mixed)
        say("report: " + ", ".join(p.rel(w) for w in written))
    # Failed runs are results (recorded, shown in the table); only a study that measured nothing is an error.
    return 1 if runner.executed and runner.failed == runner.executed else 0
