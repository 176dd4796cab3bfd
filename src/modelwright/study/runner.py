"""A study's runs: fresh processes whose group dies with the study, resume, failure records, predictions
written before each run, a lock that keeps two studies off one results folder."""

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

import yaml
from tqdm import tqdm

from modelwright import REPO_ROOT, fmt, planner
from modelwright.errors import ConfigError, one_line
from modelwright.record import (
    append_record,
    build_record,
    get_path,
    now_iso,
    provenance,
    read_records,
    to_jsonable,
    validate_record,
)
from modelwright.study.plan import (
    Plan,
    RunSpec,
    Settings,
    command,
    effective_batch,
    patch_callbacks,
    rel,
    world_size,
)
from modelwright.techniques import configured_section

GUARD = Path(__file__).with_name("_guard.py")
#: Statuses that count as recorded for resume: an interrupted run is not a result, a failed one is
#: (retry_failed).
DONE_STATUSES = ("ok", "oom", "diverged", "failed")


@contextlib.contextmanager
def study_lock(folder: Path) -> Iterator[Path]:
    """``study.lock`` in ``folder``, holding the PID, locked while a study writes there: the kernel releases
    the lock when the study dies, however it dies; a live study's lock is a ConfigError."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "study.lock"
    with path.open("a+") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.seek(0)
            holder = lock_file.read().strip()
            raise ConfigError(f"{rel(folder)}: another study (PID {holder}) is running on these results; "
                              "wait for it or stop it") from None
        lock_file.truncate(0)
        print(os.getpid(), file=lock_file, flush=True)
        try:
            yield path
        finally:
            path.unlink(missing_ok=True)


class ChildResult(NamedTuple):
    returncode: int
    timed_out: bool
    seconds: float


def _kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def run_child(args: list[str], log_path: Path, env: Mapping[str, str], timeout_s: float | None,
              tick: Callable[[float], None]) -> ChildResult:
    """``python ARGS`` under ``_guard.py``, in a group of its own. A timeout sends the group SIGTERM, SIGKILL
    30 s later; nothing of the group outlives this call (nor, by the guard, a killed study)."""
    started = time.perf_counter()
    timed_out = False
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, str(GUARD), str(os.getpid()), sys.executable, *args],
                                cwd=REPO_ROOT, env=dict(env), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        while proc.poll() is None and not timed_out:
            elapsed = time.perf_counter() - started
            tick(elapsed)
            timed_out = timeout_s is not None and elapsed > timeout_s
            if timed_out:
                _kill_group(proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=30)
            time.sleep(0.25)
    finally:
        _kill_group(proc.pid, signal.SIGKILL)  # stragglers (another rank), or the run itself on an exception
        proc.wait()
    return ChildResult(proc.returncode, timed_out, time.perf_counter() - started)


def scrub(text: str) -> str:
    """``text`` without this machine's paths: the repository, the interpreter's prefix, the home folder."""
    for path, name in ((str(REPO_ROOT), "."), (sys.prefix, "<python>"), (str(Path.home()), "~")):
        if path and path not in ("/", "."):
            text = text.replace(path, name)
    return text


def diagnose(output: str, returncode: int) -> tuple[str, str]:
    """A run that left no record: ``oom`` for an out-of-memory crash or a SIGKILL (the kernel's OOM killer),
    else ``failed``; and one line, the last error-looking line of its output with the exit code."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    error = re.compile(r"^(error:|([A-Za-z_][\w.]*)?(Error|Exception|Interrupt)\b)")
    found = next((line for line in reversed(lines) if error.match(line)), lines[-1] if lines else "")
    how = f"exit status {returncode}"
    if returncode < 0:
        how = f"killed by signal {-returncode}"
    lowered = output.lower()
    oom = "out of memory" in lowered or "outofmemoryerror" in lowered or returncode in (-9, 137)
    status = "oom" if oom else "failed"
    if not found:
        return status, how
    return status, scrub(f"{how}: {found}")[:500]


def failure_record(spec: RunSpec, status: str, error: str, run_id: str, accelerator: str,
                   cmd: list[str]) -> dict:
    """The record of a run that died before writing its own: what its config says, through the one record
    builder."""
    from modelwright.measure import hardware_info, versions  # torch: only needed on this path

    resolved = spec.resolved
    device = "cuda" if accelerator in ("cuda", "gpu") else "cpu"
    try:
        hardware = hardware_info(device, num_devices=world_size(resolved))
    except Exception:  # no such device in this process: the schema's nulls stay
        hardware = None
    techniques = configured_section(resolved, world_size(resolved), effective_batch(resolved))
    return build_record(loop="lightning", status=status, error=error, run_id=run_id, command=cmd,
                        config=resolved, techniques=techniques, hardware=hardware, versions=versions())


def say(text: str) -> None:
    """A line on stderr, above the progress bar if there is one."""
    tqdm.write(text, file=sys.stderr)


class Progress(tqdm):
    """A bar over the runs to execute, on a terminal only."""

    def __init__(self, to_run: int) -> None:
        super().__init__(total=to_run, unit="run", file=sys.stderr, disable=None, dynamic_ncols=True,
                         leave=False)

    def add_runs(self, count: int) -> None:
        self.total += count
        self.refresh()


def _read_json(path: Path) -> dict | None:
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict):
            return data
    return None


def _done_key(record: Mapping) -> tuple[str, str, str, int] | None:
    """What makes a committed record count for resume: ``(name, kind, config hash, repeat)``, or None."""
    facts = record.get("study") or {}
    if record.get("status") not in DONE_STATUSES or "config_hash" not in facts:
        return None
    return facts.get("name"), facts.get("kind", "run"), facts["config_hash"], facts.get("repeat", 0)


class Study:
    """Runs specs in fresh processes, appending each record to ``records.jsonl``; skips recorded ones."""

    def __init__(self, plan: Plan, settings: Settings, results_dir: Path, workdir: Path, *,
                 rerun: bool = False, retry_failed: bool = False, run_timeout_s: float | None = None,
                 cmd: list[str] | None = None, predict: bool = False) -> None:
        self.plan = plan
        self.settings = settings
        self.workdir = workdir
        self.results_dir = results_dir
        self.records_path = results_dir / "records.jsonl"
        self.predictions_path = results_dir / "predictions.jsonl"
        self.predict = predict
        self.rerun = rerun
        self.retry_failed = retry_failed
        self.run_timeout_s = run_timeout_s
        self.cmd = cmd or ["python", "-m", "modelwright", "study"]
        self.done: dict[tuple[str, str, str, int], dict] = {}
        self.executed = 0
        self.skipped = 0
        self.failed = 0
        committed = read_records(self.records_path) if self.records_path.is_file() else []
        for record in committed:
            key = _done_key(record)
            if key is not None:
                self.done[key] = record

    def recorded(self, spec: RunSpec) -> dict | None:
        """The record that makes running ``spec`` again unnecessary, if any."""
        if self.rerun:
            return None
        record = self.done.get(spec.key)
        if self.retry_failed and record and record.get("status") in ("failed", "oom"):
            return None
        return record

    def ended_ok(self, spec: RunSpec) -> bool:
        """Whether ``spec`` has a record, of this study or an earlier one, that ended ok."""
        record = self.done.get(spec.key)
        return record is not None and record.get("status") == "ok"

    def leave_out(self, spec: RunSpec, progress: Progress, why: str, counted: bool) -> None:
        """Do not run ``spec``, and say why; ``counted``: it was among the runs to run."""
        if counted:
            progress.add_runs(-1)
        say(f"{spec.label}: not run: {why}")

    def _predict(self, spec: RunSpec) -> dict | None:
        """The run's peak, predicted by rehearsing its step in this process
        (:mod:`modelwright.planner.memory`), in predictions.jsonl before the run starts: no prediction has
        seen its measurement. An epoch run captures no memory: nothing to predict. A step that cannot be
        rehearsed is said and left unpredicted."""
        if spec.kind == "epoch" or not self.predict:
            return None
        try:
            rehearsal = planner.memory.rehearsal(spec.resolved)
        except Exception as err:  # the run itself will fail and say why, or run unpredicted
            say(f"{spec.label}: not predicted ({one_line(err)})")
            return None
        predicted = rehearsal.peak(int(get_path(spec.resolved, "data.batch_size")))
        prediction = {"run": spec.name, "kind": spec.kind, "repeat": spec.repeat,
                      "config_hash": spec.config_hash, "created_at": now_iso(), "from": rehearsal.json(),
                      "predicted_mib": to_jsonable(predicted)}
        append_record(self.predictions_path, prediction, validate=False)
        return prediction

    def _prepare(self, spec: RunSpec) -> Path:
        """A clean run folder with the run's callbacks file."""
        run_dir = self.workdir / spec.folder
        # a stale record of an interrupted attempt must not be read back
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        callbacks = patch_callbacks(spec.resolved["trainer"]["callbacks"], self.settings.warmup_steps,
                                    rel(run_dir / "record.json"), anatomy=spec.kind != "epoch")
        callbacks_yaml = yaml.safe_dump({"trainer": {"callbacks": callbacks}}, sort_keys=False)
        (run_dir / "callbacks.yaml").write_text(callbacks_yaml)
        return run_dir

    def _child_record(self, spec: RunSpec, run_dir: Path, child: ChildResult, output: str,
                      run_id: str) -> dict:
        """The run's own record, or one that says why there is none (timed out, crashed, invalid)."""
        record = _read_json(run_dir / "record.json")
        why = None
        if child.timed_out:
            why = ("failed", f"timed out after {fmt.duration(self.run_timeout_s)}")
        elif record is None or (child.returncode != 0 and record.get("status") == "ok"):
            why = diagnose(output, child.returncode)
        elif validate_record(record):
            why = ("failed", f"invalid record: {validate_record(record)[0]}")
        if why:
            status, error = why
            record = failure_record(spec, status, error, run_id, self.settings.accelerator, self.cmd)
        if isinstance(record.get("error"), str):
            record["error"] = scrub(record["error"])
        base_provenance = record.get("provenance") or provenance()
        record["provenance"] = {**base_provenance, "command": " ".join(self.cmd)}
        return record

    def _study_facts(self, spec: RunSpec, args: list[str], child: ChildResult) -> dict:
        repeats = self.settings.repeats if spec.kind == "run" else 1
        return {"name": spec.name, "kind": spec.kind, "plan": self.plan.path, "index": spec.index,
                "repeat": spec.repeat, "repeats": repeats, "config_hash": spec.config_hash,
                "slug": self.settings.slug, "config_file": spec.config,
                "overrides": to_jsonable(spec.overrides),
                "warmup_steps": self.settings.warmup_steps, "measured_steps": spec.measured_steps,
                "process_wall_s": child.seconds, "returncode": child.returncode,
                "command": "python " + " ".join(args), **spec.extra}

    def _skip(self, spec: RunSpec, existing: dict, progress: Progress) -> dict:
        if spec.kind == "budget":  # budget runs are counted before they are known
            progress.add_runs(-1)
        say(f"{spec.label}: skipped (recorded: {existing.get('status')}, config {spec.config_hash})")
        self.skipped += 1
        return existing

    def run(self, spec: RunSpec, progress: Progress) -> dict:
        """The spec's record: the existing one if already recorded, else a fresh run's."""
        existing = self.recorded(spec)
        if existing is not None:
            return self._skip(spec, existing, progress)
        prediction = self._predict(spec)
        progress.set_description(spec.label)
        run_dir = self._prepare(spec)
        args = command(spec, run_dir)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        run_id = f"{spec.name}-{spec.config_hash[:8]}-{spec.kind[0]}{spec.repeat}-{stamp}"
        # MODELWRIGHT_COMMAND: the command that reproduces the record is the study's, not the child's
        # The run starts in the repository; a job's classes in the study's working folder stay importable.
        importable = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, MODELWRIGHT_RUN_ID=run_id, MODELWRIGHT_COMMAND=" ".join(self.cmd),
                   PYTHONUNBUFFERED="1", PYTHONPATH=importable)
        child = run_child(args, run_dir / "output.log", env, self.run_timeout_s,
                          lambda seconds: progress.set_postfix_str(fmt.duration(seconds)))
        output = (run_dir / "output.log").read_text(encoding="utf-8", errors="replace")
        record = self._child_record(spec, run_dir, child, output, run_id)
        record["study"] = self._study_facts(spec, args, child)
        if record["status"] != "ok":
            tail = output.strip().splitlines()[-20:]
            record["study"]["output_tail"] = [scrub(line) for line in tail]
        if prediction:
            record["prediction"] = prediction
        append_record(self.records_path, record)
        self.done[spec.key] = record
        self.executed += 1
        self.failed += record["status"] != "ok"
        progress.update(1)
        _say_result(spec, record, child.seconds)
        return record


def _say_result(spec: RunSpec, record: dict, seconds: float) -> None:
    """One line per finished run: its peak and median step (an epoch run: its epoch time), or what failed."""
    peak = get_path(record, "memory.peak_allocated_mib")
    step = get_path(record, "timing.step_time_median_ms")
    if record["status"] != "ok":
        how = f"{record['status']}: {record.get('error')}"
    elif spec.kind == "epoch":
        epoch = get_path(record, "timing.epoch_time_s")
        how = f"ok, epoch {fmt.duration(epoch)}, median step {fmt.sig(step)} ms"
    elif step is None:  # a budget run: its memory only
        how = f"ok, peak {fmt.sig(peak)} MiB"
    else:
        how = f"ok, peak {fmt.sig(peak)} MiB, step {fmt.sig(step)} ms"
    say(f"{spec.label}: {how} in {fmt.duration(seconds)}")
