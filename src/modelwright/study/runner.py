"""A study's runs: fresh processes whose group dies with the study, resume, failure records, predictions written
before each run, a lock that keeps two studies off one results folder."""

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
from typing import Any

import yaml
from tqdm import tqdm

from modelwright import REPO_ROOT, planner
from modelwright import record as rec
from modelwright.errors import ConfigError
from modelwright.report import fmt
from modelwright.study import plan as p

GUARD = Path(__file__).with_name("_guard.py")
#: Statuses that count as recorded for resume: an interrupted run is not a result, a failed one is (retry_failed).
DONE_STATUSES = ("ok", "oom", "diverged", "failed")


@contextlib.contextmanager
def study_lock(folder: Path) -> Iterator[Path]:
    """``study.lock`` in ``folder``, holding the PID, locked while a study writes there: the kernel releases the lock
    when the study dies, however it dies; a live study's lock is a ConfigError."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "study.lock"
    with path.open("a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise ConfigError(f"{p.rel(folder)}: another study (PID {f.read().strip()}) is running on these results; "
                              "wait for it or stop it") from None
        f.truncate(0)
        print(os.getpid(), file=f, flush=True)
        try:
            yield path
        finally:
            path.unlink(missing_ok=True)


def run_child(args: list[str], log_path: Path, env: Mapping[str, str], timeout_s: float | None,
              tick: Callable[[float], None]) -> tuple[int, bool, float]:
    """``python ARGS`` under ``_guard.py``, in a group of its own: ``(status, timed out, seconds)``. A timeout sends the
    group SIGTERM, SIGKILL 30 s later; nothing of the group outlives this call (nor, by the guard, a killed study)."""
    t0, timed_out = time.perf_counter(), False
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, str(GUARD), str(os.getpid()), sys.executable, *args], cwd=REPO_ROOT,
                                env=dict(env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while proc.poll() is None and not timed_out:
            tick(elapsed := time.perf_counter() - t0)
            if timed_out := timeout_s is not None and elapsed > timeout_s:
                with contextlib.suppress(ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=30)
            time.sleep(0.25)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers (another rank), or the run itself on an exception
        proc.wait()
    return proc.returncode, timed_out, time.perf_counter() - t0


def scrub(text: str) -> str:
    """``text`` without this machine's paths: the repository, the interpreter's prefix, the home folder."""
    for path, name in ((str(REPO_ROOT), "."), (sys.prefix, "<python>"), (str(Path.home()), "~")):
        if path and path not in ("/", "."):
            text = text.replace(path, name)
    return text


def diagnose(output: str, returncode: int) -> tuple[str, str]:
    """A run that left no record: ``oom`` for an out-of-memory crash or a SIGKILL (the kernel's OOM killer), else
    ``failed``; and one line, the last error-looking line of its output with the exit code."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    error = re.compile(r"^(error:|[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b)")
    found = next((line for line in reversed(lines) if error.match(line)), lines[-1] if lines else "")
    how = f"killed by signal {-returncode}" if returncode < 0 else f"exit status {returncode}"
    oom = "out of memory" in output.lower() or "outofmemoryerror" in output.lower() or returncode in (-9, 137)
    return ("oom" if oom else "failed"), (scrub(f"{how}: {found}")[:500] if found else how)


def failure_record(spec: p.RunSpec, status: str, error: str, run_id: str, accelerator: str, cmd: list[str]) -> dict:
    """The record of a run that died before writing its own: what its config says, through the one record builder."""
    from modelwright.measure import hardware_info, versions  # torch: only needed on this path

    r = spec.resolved
    techniques = {"model_name": rec.get_path(r, "model.model_name"), "world_size": p.world_size(r),
                  "accumulate_grad_batches": rec.get_path(r, "trainer.accumulate_grad_batches"),
                  "precision_requested": str(rec.get_path(r, "trainer.precision")),
                  "micro_batch_size": rec.get_path(r, "data.batch_size"), "effective_batch_size": p.effective_batch(r)}
    try:
        hardware = hardware_info("cuda" if accelerator in ("cuda", "gpu") else "cpu", num_devices=p.world_size(r))
    except Exception:  # no such device in this process: the schema's nulls stay
        hardware = None
    return rec.build_record(loop="lightning", status=status, error=error, run_id=run_id, command=cmd, config=r,
                            techniques=techniques, hardware=hardware, versions=versions())


def profile_baseline(resolved: Mapping) -> dict:
    """One profiled fp32 step (``measure.profile``) of the baseline's model, batch and optimizer, made in this process
    before any run it predicts: what every prediction of the study starts from."""
    import torch

    from modelwright.measure.profile import profile_step
    from modelwright.train.models import build_model, checkpoint_segments
    from modelwright.train.optim import build_optimizer

    m, batch = resolved["model"], int(rec.get_path(resolved, "data.batch_size"))
    torch.manual_seed(0)
    layout = torch.channels_last if m["channels_last"] else torch.contiguous_format
    net = build_model(m["model_name"], m["num_classes"]).to(memory_format=layout)
    opt = build_optimizer(net.parameters(), **{k: m[k] for k in ("optimizer", "lr", "momentum", "weight_decay",
                                                                 "optimizer_impl")})
    x = torch.randn(batch, 3, 32, 32).contiguous(memory_format=layout)
    y = torch.randint(0, m["num_classes"], (batch,))

    def step() -> None:
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)  # as the Lightning path and the Accelerate loop do

    step()  # the optimizer's state exists from here on
    segments = {}
    for granularity in ("stage", "block"):
        with contextlib.suppress(ConfigError):
            segments[granularity] = checkpoint_segments(net, granularity)
    return {"run_id": f"profile-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}", "created_at": rec.now_iso(),
            "provenance": rec.provenance(), "techniques": {"model_name": m["model_name"], "micro_batch_size": batch},
            "profile": profile_step(net, step, batch, [opt], [x, y], segments)}


def say(text: str) -> None:
    """A line on stderr, above the progress bar if there is one."""
    tqdm.write(text, file=sys.stderr)


class Progress(tqdm):
    """A bar over the runs to execute, on a terminal only."""

    def __init__(self, to_run: int) -> None:
        super().__init__(total=to_run, unit="run", file=sys.stderr, disable=None, dynamic_ncols=True, leave=False)

    def add_runs(self, n: int) -> None:
        self.total += n
        self.refresh()


def _read_json(path: Path) -> dict | None:
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else None
    return None


class Study:
    """Runs specs in fresh processes, appending each record to ``records.jsonl``; skips recorded ones."""

    def __init__(self, plan: p.Plan, settings: p.Settings, results_dir: Path, workdir: Path, *, rerun: bool = False,
                 retry_failed: bool = False, run_timeout_s: float | None = None, cmd: list[str] | None = None,
                 profile: bool = False) -> None:
        self.plan, self.settings, self.workdir = plan, settings, workdir
        self.records_path, self.predictions_path = results_dir / "records.jsonl", results_dir / "predictions.jsonl"
        self.profile_path = results_dir / "profile.json" if profile else None
        self.rerun, self.retry_failed, self.run_timeout_s = rerun, retry_failed, run_timeout_s
        self.cmd = cmd or ["python", "-m", "modelwright", "study"]
        self.done: dict[tuple[str, str, int], dict] = {}
        self.executed = self.skipped = self.failed = 0
        for record in rec.read_records(self.records_path) if self.records_path.is_file() else []:
            s = record.get("study") or {}
            if record.get("status") in DONE_STATUSES and "config_hash" in s:
                self.done[(s.get("kind", "run"), s["config_hash"], s.get("repeat", 0))] = record

    def recorded(self, spec: p.RunSpec) -> dict | None:
        """The record that makes running ``spec`` again unnecessary, if any."""
        record = None if self.rerun else self.done.get((spec.kind, spec.config_hash, spec.repeat))
        return None if self.retry_failed and record and record.get("status") in ("failed", "oom") else record

    def baseline(self, model: Any) -> dict | None:
        """profile.json: the profile of the plan's first run (its baseline) on ``model``, made on first use, or None."""
        if self.profile_path is None:  # predictions off, or profiling failed
            return None
        saved = _read_json(self.profile_path)
        if saved is None or rec.get_path(saved, "techniques.model_name") != model:
            first = p.build_spec(self.plan.entries[0], 0, self.settings)
            if rec.get_path(first.resolved, "model.model_name") != model:
                return None
            say(f"profiling one step of {first.name} ({model}) for the predictions")
            try:
                saved = profile_baseline(first.resolved)
            except Exception as err:  # the run itself will fail and say why; the study goes on unpredicted
                say(f"no predictions: profiling {first.name} failed ({type(err).__name__}: {err})")
                self.profile_path = None
                return None
            rec.write_text_atomic(self.profile_path, json.dumps(rec.to_jsonable(saved)) + "\n")
        return saved

    def run(self, spec: p.RunSpec, progress: Progress) -> dict:
        """The spec's record: the existing one if already recorded, else a fresh run's."""
        existing = self.recorded(spec)
        if existing is not None:
            progress.add_runs(-int(spec.kind == "budget"))  # budget runs are counted before they are known
            say(f"{spec.label}: skipped (recorded: {existing.get('status')}, config {spec.config_hash})")
            self.skipped += 1
            return existing
        # The planner's peak from the baseline's profile, in predictions.jsonl before the run starts: no prediction
        # has seen its measurement.
        base, prediction = self.baseline(rec.get_path(spec.resolved, "model.model_name")), None
        if base is not None:
            prediction = {"run": spec.name, "kind": spec.kind, "repeat": spec.repeat, "config_hash": spec.config_hash,
                          "from_run_id": base.get("run_id"), "created_at": rec.now_iso(),
                          "predicted_mib": rec.to_jsonable(planner.predict_peak_mib(base, spec.resolved))}
            rec.append_record(self.predictions_path, prediction, validate=False)
        progress.set_description(spec.label)
        run_dir = self.workdir / spec.folder
        shutil.rmtree(run_dir, ignore_errors=True)  # a stale record of an interrupted attempt must not be read back
        run_dir.mkdir(parents=True)
        callbacks = p.patch_callbacks(spec.resolved["trainer"]["callbacks"], self.settings.warmup_steps,
                                      p.rel(run_dir / "record.json"))
        (run_dir / "callbacks.yaml").write_text(yaml.safe_dump({"trainer": {"callbacks": callbacks}}, sort_keys=False))
        args = p.command(spec, run_dir)
        run_id = f"{spec.name}-{spec.config_hash[:8]}-{spec.kind[0]}{spec.repeat}-{time.strftime('%Y%m%dT%H%M%SZ')}"
        # MODELWRIGHT_COMMAND: the command that reproduces the record is the study's, not the child's
        env = dict(os.environ, MODELWRIGHT_RUN_ID=run_id, MODELWRIGHT_COMMAND=" ".join(self.cmd), PYTHONUNBUFFERED="1")
        returncode, timed_out, seconds = run_child(args, run_dir / "output.log", env, self.run_timeout_s,
                                                   lambda s: progress.set_postfix_str(fmt.duration(s)))
        output = (run_dir / "output.log").read_text(encoding="utf-8", errors="replace")
        record = _read_json(run_dir / "record.json")
        why = None
        if timed_out:
            why = ("failed", f"timed out after {fmt.duration(self.run_timeout_s)}")
        elif record is None or (returncode != 0 and record.get("status") == "ok"):
            why = diagnose(output, returncode)
        elif rec.validate_record(record):
            why = ("failed", f"invalid record: {rec.validate_record(record)[0]}")
        if why:
            record = failure_record(spec, *why, run_id, self.settings.accelerator, self.cmd)
        record["error"] = scrub(record["error"]) if isinstance(record.get("error"), str) else record.get("error")
        record["provenance"] = {**(record.get("provenance") or rec.provenance()), "command": " ".join(self.cmd)}
        record["study"] = {"name": spec.name, "kind": spec.kind, "plan": self.plan.path, "index": spec.index,
                           "repeat": spec.repeat, "repeats": self.settings.repeats if spec.kind == "run" else 1,
                           "config_hash": spec.config_hash, "slug": self.settings.slug, "config_file": spec.config,
                           "overrides": rec.to_jsonable(spec.overrides), "warmup_steps": self.settings.warmup_steps,
                           "measured_steps": spec.measured_steps, "process_wall_s": seconds,
                           "returncode": returncode, "command": "python " + " ".join(args), **spec.extra}
        if record["status"] != "ok":
            record["study"]["output_tail"] = [scrub(x) for x in output.strip().splitlines()[-20:]]
        if prediction:
            record["prediction"] = prediction
        rec.append_record(self.records_path, record)
        self.done[(spec.kind, spec.config_hash, spec.repeat)] = record
        self.executed += 1
        self.failed += record["status"] != "ok"
        progress.update(1)
        peak, step = (rec.get_path(record, k) for k in ("memory.peak_allocated_mib", "timing.step_time_median_ms"))
        how = f"ok, peak {fmt.sig(peak)} MiB, step {fmt.sig(step)} ms" if record["status"] == "ok" else (
            f"{record['status']}: {record.get('error')}")
        say(f"{spec.label}: {how} in {fmt.duration(seconds)}")
        return record
