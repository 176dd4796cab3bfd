"""study/runner.py without a fit: the lock, a run's process (a tiny python child), what a run that died says, the
record of a run that wrote none, which runs a study skips or runs again, and the lines it prints."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fcntl
import io
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import yaml

from modelwright.errors import ConfigError
from modelwright.record import build_record, read_records, validate_record
from modelwright.study import plan, runner

#: A run's resolved config, by hand: two processes, 4 micro-batches of 8 per step (effective batch 64).
RESOLVED = {
    "trainer": {
        "devices": 2, "num_nodes": 1, "accumulate_grad_batches": 4, "precision": "bf16-mixed",
        "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                   "init_args": {"save_dir": "lightning_logs", "name": "baseline"}},
        "callbacks": [{"class_path": "callbacks.checkpoint.ModelCheckpoint", "init_args": {"save_last": True}},
                      {"class_path": "callbacks.run_monitor.RunMonitor",
                       "init_args": {"log_every": 5, "warmup_steps": 10}}],
    },
    "model": {"class_path": "modelwright.train.module.Classifier",
              "init_args": {"network": {"class_path": "modelwright.train.models.SmallCNN"}, "optimizer": "adamw",
                            "gradient_checkpointing": "off"}},
    "data": {"class_path": "modelwright.data.CIFAR10", "init_args": {"batch_size": 8}},
}
HASH = "0123456789ab"
SETTINGS = plan.Settings(slug="cpu-test", accelerator="cpu", warmup_steps=2, measured_steps=5, repeats=3,
                         val_batches=1, model=None, overrides={})
CMD = ["python", "-m", "modelwright", "study", "--slug", "cpu-test"]


def _spec(name: str = "baseline", kind: str = "run", repeat: int = 0, **extra) -> plan.RunSpec:
    return plan.RunSpec(name, kind, 3, repeat, "configs/baseline.yaml", {"data.batch_size": 8},
                        copy.deepcopy(RESOLVED), HASH, 5, extra=extra)


def _study(tmp_path: Path, settings: plan.Settings = SETTINGS, **flags) -> runner.Study:
    the_plan = plan.Plan("plans/p.yaml", [plan.Entry("baseline", "configs/baseline.yaml")])
    return runner.Study(the_plan, settings, tmp_path / "results", tmp_path / "work" / "nested", **flags)


def _child_record(status: str = "ok", error: str | None = None, **sections) -> dict:
    """A record as a run writes it, with provenance of its own."""
    sections.setdefault("provenance", {"commit": "abc123", "dirty": False, "command": "python main.py fit",
                                       "definitions": 4})
    return build_record(run_id="child-run", status=status, error=error, **sections)


class _Tty(io.StringIO):
    """A terminal for the progress bar, its width set by the test."""

    width = 60

    def isatty(self) -> bool:
        return True

    def fileno(self) -> int:
        return 2


def _terminal(monkeypatch) -> _Tty:
    """stderr a terminal, in the test's body (pytest sets its own stderr back between a fixture and the test)."""
    screen = _Tty()
    monkeypatch.setattr(sys, "stderr", screen)
    monkeypatch.setattr(os, "get_terminal_size", lambda fd=None: os.terminal_size((screen.width, 20)))
    return screen


def _said(screen: _Tty) -> list[str]:
    """The lines written above the bar (each after the bar's clearing ``\\r``)."""
    return [chunk.rsplit("\r", 1)[-1] for chunk in screen.getvalue().split("\n")[:-1]]


# -- the lock -------------------------------------------------------------------------------------------------


def test_the_lock_holds_the_pid_while_the_study_runs_and_is_gone_after_however_it_ends(tmp_path):
    folder = tmp_path / "results" / "cpu-test"  # not there yet
    with runner.study_lock(folder) as lock:
        assert lock == folder / "study.lock" and lock.read_text() == f"{os.getpid()}\n"
    assert not lock.exists()
    with pytest.raises(RuntimeError, match="the study broke"), runner.study_lock(folder):
        raise RuntimeError("the study broke")
    assert not lock.exists()


def test_a_held_lock_is_refused_naming_its_pid_and_a_stale_one_is_taken_over(tmp_path):
    lock_path = tmp_path / "study.lock"
    lock_path.write_text("4242\n")  # left by a study that died: nobody holds it
    with runner.study_lock(tmp_path) as lock:
        assert lock.read_text() == f"{os.getpid()}\n"
    with lock_path.open("a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another study's, as the kernel sees it
        print(4343, file=held, flush=True)
        with pytest.raises(ConfigError) as refused, runner.study_lock(tmp_path):
            pytest.fail("a second study ran on a locked folder")
        assert str(refused.value) == (f"{tmp_path}: another study (PID 4343) is running on these results; "
                                      "wait for it or stop it")
        assert lock_path.read_text() == "4343\n"  # the holder's lock is left as it was


# -- a run's process --------------------------------------------------------------------------------------------


_real_sleep = time.sleep


class _Clock:
    """The poll loop's clock, advanced 0.25 s a poll by the loop's own sleep once ``ready`` (the child started):
    the ticks and the moment of the timeout are then exact, whatever the machine's load."""

    def __init__(self, ready) -> None:
        self.now = 1000.0
        self.ready = ready

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        _real_sleep(0.05)
        if self.ready():
            self.now += seconds


def test_a_run_exits_with_its_status_in_the_repository_in_a_session_of_its_own_its_output_logged(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = ("import os, sys\nprint('out', os.getcwd(), os.environ['RUNNER_MARK'], os.getsid(0), flush=True)\n"
            "print('err', file=sys.stderr)\nsys.exit(3)")
    ticks = []
    child = runner.run_child(["-c", code], tmp_path / "output.log", {**os.environ, "RUNNER_MARK": "m42"}, None,
                             ticks.append)
    assert (child.returncode, child.timed_out) == (3, False)
    out, err = (tmp_path / "output.log").read_text().splitlines()
    where, mark, session = out.split()[1:]
    assert (where, mark, err) == (str(runner.REPO_ROOT), "m42", "err")
    assert int(session) != os.getsid(0)  # its group can be killed without the study's
    assert ticks and all(isinstance(tick, float) for tick in ticks)
    assert ticks == sorted(ticks) and 0 <= ticks[0] and ticks[-1] <= child.seconds


def test_a_child_killed_by_a_signal_returns_minus_the_signal(tmp_path):
    code = "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"
    child = runner.run_child(["-c", code], tmp_path / "output.log", os.environ, None, lambda seconds: None)
    assert (child.returncode, child.timed_out) == (-signal.SIGKILL, False)


def test_a_run_over_its_time_gets_sigterm_at_the_first_poll_past_it(tmp_path, monkeypatch):
    log_path = tmp_path / "output.log"
    clock = _Clock(ready=lambda: "started" in log_path.read_text())
    monkeypatch.setattr(runner, "time", clock)
    code = "import time\nprint('started', flush=True)\ntime.sleep(30)"
    ticks = []
    child = runner.run_child(["-c", code], log_path, os.environ, 1.0, ticks.append)
    assert child == (-signal.SIGTERM, True, 1.5)  # polled at 1.25 s, then one more sleep
    assert sorted(set(ticks)) == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25] and ticks == sorted(ticks)
    assert log_path.read_text() == "started\n"


def test_a_run_that_ignores_sigterm_is_killed_30_s_later(tmp_path, monkeypatch):
    """Popen.wait with a limit returns at once as if the 30 s had passed, the child still running."""
    waits = []

    class ImpatientPopen(subprocess.Popen):
        def wait(self, timeout=None):
            if timeout is None:
                return super().wait()
            waits.append(timeout)
            raise subprocess.TimeoutExpired(self.args, timeout)

    log_path = tmp_path / "output.log"
    monkeypatch.setattr(runner, "time", _Clock(ready=lambda: "deaf" in log_path.read_text()))
    monkeypatch.setattr(runner, "subprocess", types.SimpleNamespace(
        Popen=ImpatientPopen, STDOUT=subprocess.STDOUT, TimeoutExpired=subprocess.TimeoutExpired))
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('deaf', flush=True)\n" \
           "time.sleep(30)"
    child = runner.run_child(["-c", code], log_path, os.environ, 0.5, lambda seconds: None)
    assert (child.returncode, child.timed_out, waits) == (-signal.SIGKILL, True, [30])


def _dead(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_nothing_the_run_started_outlives_it(tmp_path):
    code = ("import subprocess, sys\n"
            "straggler = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
            "print(straggler.pid, flush=True)")
    runner.run_child(["-c", code], tmp_path / "output.log", os.environ, None, lambda seconds: None)
    straggler = int((tmp_path / "output.log").read_text())
    try:
        for _ in range(200):  # SIGKILL was sent: wait for the kernel to end it
            if _dead(straggler):
                break
            _real_sleep(0.05)
        assert _dead(straggler)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(straggler, signal.SIGKILL)


@pytest.mark.parametrize("refusal", [ProcessLookupError, PermissionError])
def test_a_group_that_is_gone_or_not_ours_is_left_alone(monkeypatch, refusal):
    sent = []

    def killpg(pid, sig):
        sent.append((pid, sig))
        raise refusal

    monkeypatch.setattr(runner.os, "killpg", killpg)
    runner._kill_group(4242, signal.SIGKILL)
    assert sent == [(4242, signal.SIGKILL)]


# -- what a run that died says ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("home", "text", "scrubbed"), [
    ("/home/ann", "File /srv/repo/src/x.py; /opt/py/lib/torch; /home/ann/data",
     "File ./src/x.py; <python>/lib/torch; ~/data"),
    ("/", "/srv/repo/a /b/c", "./a /b/c"),  # a home of / or . names no folder to hide
    (".", "a.b /srv/repo", "a.b ."),
])
def test_scrub_hides_this_machines_folders(monkeypatch, home, text, scrubbed):
    monkeypatch.setattr(runner, "REPO_ROOT", Path("/srv/repo"))
    monkeypatch.setattr(runner.sys, "prefix", "/opt/py")
    monkeypatch.setenv("HOME", home)
    assert runner.scrub(text) == scrubbed


TRACEBACK = """Seed set to 0
Traceback (most recent call last):
  File "main.py", line 9, in <module>
RuntimeError: boom

Saving the record
"""
LONG = "RuntimeError: " + "x" * 600

#: A run's output and exit status: its status and the one line of its error.
DIAGNOSES = [
    (TRACEBACK, 1, "failed", "exit status 1: RuntimeError: boom"),  # the last error-looking line, not the last
    ("usage: main.py\nerror: --trainer.max_steps: expected an int\nsee --help\n", 2, "failed",
     "exit status 2: error: --trainer.max_steps: expected an int"),
    ("epoch 0\nKeyboardInterrupt\nbye\n", 130, "failed", "exit status 130: KeyboardInterrupt"),
    ("step 1\nException: boom\nbye\n", 1, "failed", "exit status 1: Exception: boom"),  # the bare base classes
    ("step 1\nError: boom\nbye\n", 1, "failed", "exit status 1: Error: boom"),
    ("x\nlightning.fabric.utilities.exceptions.MisconfigurationException: no GPU\ny\n", 1, "failed",
     "exit status 1: lightning.fabric.utilities.exceptions.MisconfigurationException: no GPU"),
    ("step 1\nstep 2\nstep 3\n", 1, "failed", "exit status 1: step 3"),  # nothing error-like: the last line
    ("\n  \n", 1, "failed", "exit status 1"),
    ("", 0, "failed", "exit status 0"),  # ended well, wrote no record
    ("", -15, "failed", "killed by signal 15"),
    ("step 3\n", -9, "oom", "killed by signal 9: step 3"),  # SIGKILL: the kernel's OOM killer
    ("", 137, "oom", "exit status 137"),  # SIGKILL, seen through a shell
    ("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB\nbye\n", 1, "oom",
     "exit status 1: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"),
    ("torch.OutOfMemoryError: tried to allocate 2.00 GiB\n", 1, "oom",
     "exit status 1: torch.OutOfMemoryError: tried to allocate 2.00 GiB"),
    (f"ValueError: no file {runner.REPO_ROOT}/data/x.csv\n", 1, "failed",
     "exit status 1: ValueError: no file ./data/x.csv"),
    (LONG, 1, "failed", f"exit status 1: {LONG}"[:500]),
]


@pytest.mark.parametrize(("output", "returncode", "status", "error"), DIAGNOSES)
def test_diagnose_says_oom_or_failed_and_the_error_line(output, returncode, status, error):
    assert runner.diagnose(output, returncode) == (status, error)


@pytest.mark.parametrize(("accelerator", "device"), [("cpu", "cpu"), ("gpu", "cuda"), ("cuda", "cuda")])
def test_the_record_of_a_run_that_wrote_none_is_what_its_config_asked_for(accelerator, device):
    record = runner.failure_record(_spec(), "oom", "killed by signal 9", "baseline-r0", accelerator, CMD)
    assert validate_record(record) == []
    assert [record[key] for key in ("run_id", "status", "error", "loop")] == \
        ["baseline-r0", "oom", "killed by signal 9", "lightning"]
    assert record["config"] == RESOLVED and record["provenance"]["command"] == " ".join(CMD)
    asked = {"network": "modelwright.train.models.SmallCNN", "model_name": "smallcnn", "optimizer": "adamw",
             "gradient_checkpointing": "off", "frozen": [], "precision_requested": "bf16-mixed",
             "accumulate_grad_batches": 4, "micro_batch_size": 8, "world_size": 2, "effective_batch_size": 64}
    assert {key: record["techniques"][key] for key in asked} == asked
    hardware = record["hardware"]
    assert (hardware["accelerator"], hardware["num_devices"], hardware["cpu_cores"]) == (device, 2, os.cpu_count())
    assert record["versions"]["python"] == platform.python_version()


def test_a_device_that_cannot_be_read_leaves_the_hardware_unknown(monkeypatch):
    """A GPU fault that killed the run can break reading the device too: the record is still written."""
    import modelwright.measure

    def unreadable(device, num_devices=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(modelwright.measure, "hardware_info", unreadable)
    record = runner.failure_record(_spec(), "failed", "exit status 1: RuntimeError: CUDA error", "r", "gpu", CMD)
    assert validate_record(record) == [] and record["hardware"] == build_record()["hardware"]
    assert set(record["hardware"].values()) == {None}


# -- which runs a study has done --------------------------------------------------------------------------------


def _with_study(status, **facts) -> dict:
    return {"status": status, "study": facts}


@pytest.mark.parametrize(("record", "key"), [
    (_with_study("ok", name="a", kind="epoch", config_hash="h1", repeat=2), ("a", "epoch", "h1", 2)),
    (_with_study("oom", name="a", config_hash="h1"), ("a", "run", "h1", 0)),  # the first records had no kind
    *[(_with_study(status, name="a", config_hash="h1", repeat=1), ("a", "run", "h1", 1))
      for status in runner.DONE_STATUSES],
    (_with_study("interrupted", name="a", config_hash="h1"), None),  # no result
    (_with_study("running", name="a", config_hash="h1"), None),
    (_with_study("ok", name="a"), None),  # not a study's run
    ({"status": "ok"}, None),
    ({"status": "ok", "study": None}, None),
])
def test_done_key_is_name_kind_hash_repeat_of_a_finished_studys_run(record, key):
    assert runner._done_key(record) == key


#: Whether a study runs a spec again, by its record's status (None: no record): plainly, with --retry_failed,
#: with --rerun; and whether the run ended ok.
AGAIN = {"ok": (False, False, True, True), "diverged": (False, False, True, False),
         "failed": (False, True, True, False), "oom": (False, True, True, False),
         "interrupted": (True, True, True, False), "running": (True, True, True, False),
         None: (True, True, True, False)}


@pytest.mark.parametrize("status", AGAIN)
def test_which_runs_a_study_runs_again(tmp_path, status):
    spec = _spec(repeat=1)
    if status is not None:
        record = _child_record(status, None if status in ("ok", "diverged", "running") else "RuntimeError: x")
        record["study"] = {"name": "baseline", "kind": "run", "config_hash": HASH, "repeat": 1}
        other = {**record, "run_id": "another repeat", "study": {**record["study"], "repeat": 0}}
        results = tmp_path / "results" / "records.jsonl"
        results.parent.mkdir()
        results.write_text(json.dumps(other) + "\n" + json.dumps(record) + "\n")
    plain, retry_failed, rerun = (_study(tmp_path), _study(tmp_path, retry_failed=True), _study(tmp_path, rerun=True))
    again = tuple(study.recorded(spec) is None for study in (plain, retry_failed, rerun))
    assert (*again, plain.ended_ok(spec)) == AGAIN[status]
    if not again[0]:
        assert plain.recorded(spec)["run_id"] == "child-run"


# -- one run ----------------------------------------------------------------------------------------------------


class _Rehearsal:
    def peak(self, batch: int) -> dict:
        return {"total": 20.0 + batch}

    def json(self) -> dict:
        return {"method": "rehearsal", "by": "hand"}


def test_a_prediction_is_written_before_a_timed_or_budget_run_only_when_asked(tmp_path, monkeypatch, capsys):
    rehearsed = []
    monkeypatch.setattr(runner.planner.memory, "rehearsal", lambda config: rehearsed.append(config) or _Rehearsal())
    study = _study(tmp_path, predict=True)
    spec = _spec(kind="budget", repeat=1)
    prediction = study._predict(spec)
    assert prediction == {"run": "baseline", "kind": "budget", "repeat": 1, "config_hash": HASH,
                          "created_at": prediction["created_at"], "from": {"method": "rehearsal", "by": "hand"},
                          "predicted_mib": {"total": 28.0}}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d", prediction["created_at"])
    assert read_records(tmp_path / "results" / "predictions.jsonl") == [prediction]
    assert rehearsed == [RESOLVED]
    assert study._predict(_spec(kind="epoch")) is None  # an epoch run captures no memory
    assert _study(tmp_path)._predict(spec) is None  # not asked
    assert len(rehearsed) == 1 and len(read_records(tmp_path / "results" / "predictions.jsonl")) == 1

    def unrehearsable(config):
        raise ConfigError("model: manual optimization is not rehearsed")

    monkeypatch.setattr(runner.planner.memory, "rehearsal", unrehearsable)
    assert study._predict(_spec()) is None
    assert capsys.readouterr() == ("", "baseline r0: not predicted (model: manual optimization is not rehearsed)\n")


@pytest.mark.parametrize(("kind", "anatomy"), [("run", True), ("budget", True), ("epoch", False)])
def test_a_run_folder_is_made_afresh_with_the_runs_callbacks(tmp_path, kind, anatomy):
    study = _study(tmp_path)  # its working folder is not there yet
    spec = _spec(kind=kind)
    run_dir = study._prepare(spec)
    assert run_dir == tmp_path / "work" / "nested" / f"baseline-{HASH}-{kind[0]}0"
    (run_dir / "record.json").write_text("{}")  # a stale attempt's
    assert study._prepare(spec) == run_dir and [path.name for path in run_dir.iterdir()] == ["callbacks.yaml"]
    [monitor] = yaml.safe_load((run_dir / "callbacks.yaml").read_text())["trainer"]["callbacks"]
    # the config's own arguments first, in its order, then the study's; no checkpoint callback
    assert monitor == {"class_path": "callbacks.run_monitor.RunMonitor", "init_args": {
        "log_every": 5, "warmup_steps": 2, "measure_steps": None, "anatomy": anatomy, "anatomy_step": None,
        "record_path": str(run_dir / "record.json"), "records_jsonl": None}}
    assert list(monitor["init_args"]) == ["log_every", "warmup_steps", "measure_steps", "anatomy", "anatomy_step",
                                          "record_path", "records_jsonl"]


def _write_attempt(run_dir: Path, record: dict | bytes | None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(record, dict):
        (run_dir / "record.json").write_text(json.dumps(record))
    elif record is not None:
        (run_dir / "record.json").write_bytes(record)


BROKE = "RuntimeError: teardown broke"
#: What a child left (its record.json, exit status, timed out) and the record the study keeps: its status and
#: error, and whose it is (the run's own, or the study's of a run that left none it can keep).
ATTEMPTS = [
    (_child_record(), 0, False, "ok", None, "run"),
    (_child_record("diverged"), 0, False, "diverged", None, "run"),
    (_child_record("failed", f"ValueError: no {runner.REPO_ROOT}/data"), 1, False, "failed", "ValueError: no ./data",
     "run"),
    (_child_record(), 1, False, "failed", f"exit status 1: {BROKE}", "study"),  # it died after writing ok
    (None, -9, False, "oom", f"killed by signal 9: {BROKE}", "study"),
    (b'{"status": "ok", "run_id": "tor', 1, False, "failed", f"exit status 1: {BROKE}", "study"),  # torn
    (b"\xff\xfe", 1, False, "failed", f"exit status 1: {BROKE}", "study"),
    (b"[1, 2]", 0, False, "failed", f"exit status 0: {BROKE}", "study"),
    (_child_record("failed"), 1, False, "failed",
     "invalid record: error: status 'failed' needs a one-line error message", "study"),
    (_child_record(), -15, True, "failed", "timed out after 2.5 min", "study"),
]


@pytest.mark.parametrize(("left", "returncode", "timed_out", "status", "error", "whose"), ATTEMPTS)
def test_the_record_a_study_keeps_of_a_run(tmp_path, left, returncode, timed_out, status, error, whose):
    study = _study(tmp_path, dataclasses.replace(SETTINGS, accelerator="cuda"), cmd=CMD, run_timeout_s=150.0)
    run_dir = tmp_path / "run"
    _write_attempt(run_dir, left)
    child = runner.ChildResult(returncode, timed_out, 151.0)
    record = study._child_record(_spec(), run_dir, child, f"step 1\n{BROKE}\nbye\n", "baseline-r0")
    assert validate_record(record) == []
    assert (record["status"], record["error"]) == (status, error)
    if whose == "run":  # as it wrote it, its error scrubbed, the command the study's
        assert record == {**left, "error": error, "provenance": {**left["provenance"], "command": " ".join(CMD)}}
    else:
        assert record["run_id"] == "baseline-r0" and record["techniques"]["world_size"] == 2
        assert (record["hardware"]["accelerator"], record["provenance"]["command"]) == ("cuda", " ".join(CMD))


def test_a_study_run_without_its_command_line_records_the_plain_one(tmp_path):
    study = _study(tmp_path)
    _write_attempt(tmp_path / "run", _child_record())
    record = study._child_record(_spec(), tmp_path / "run", runner.ChildResult(0, False, 1.0), "", "r")
    assert record["provenance"]["command"] == "python -m modelwright study"
    assert (study.results_dir, study.records_path, study.workdir) == \
        (tmp_path / "results", tmp_path / "results" / "records.jsonl", tmp_path / "work" / "nested")


def test_a_runs_facts_in_its_record(tmp_path):
    study = _study(tmp_path)
    args = ["main.py", "fit", "--config", "configs/baseline.yaml"]
    child = runner.ChildResult(1, False, 12.5)
    facts = {"name": "baseline", "kind": "run", "plan": "plans/p.yaml", "index": 3, "repeat": 2, "repeats": 3,
             "config_hash": HASH, "slug": "cpu-test", "config_file": "configs/baseline.yaml",
             "overrides": {"data.batch_size": 8}, "warmup_steps": 2, "measured_steps": 5, "process_wall_s": 12.5,
             "returncode": 1, "command": "python main.py fit --config configs/baseline.yaml"}
    assert study._study_facts(_spec(repeat=2), args, child) == facts
    budget = _spec(kind="budget", repeat=2, role="over", budget_mib=200.0)
    assert study._study_facts(budget, args, child) == {**facts, "kind": "budget", "repeats": 1, "role": "over",
                                                       "budget_mib": 200.0}
    assert study._study_facts(_spec(kind="epoch", repeat=2), args, child)["repeats"] == 1


class _FakeChild:
    """``run_child`` for :meth:`Study.run`: writes what a named run leaves, and keeps what it was given."""

    def __init__(self, attempts: dict[str, tuple]) -> None:
        self.attempts = attempts
        self.calls = []

    def __call__(self, args, log_path, env, timeout_s, tick):
        self.calls.append({"args": args, "log_path": log_path, "env": env, "timeout_s": timeout_s})
        record, output, returncode = self.attempts[log_path.parent.name.split("-")[0]]
        if record is not None:
            record = {**record, "run_id": env["MODELWRIGHT_RUN_ID"]}
        _write_attempt(log_path.parent, record)
        log_path.write_bytes(output)
        tick(65.0)
        return runner.ChildResult(returncode, False, 12.5)


def test_the_run_ids_stamp_is_utc_in_any_time_zone(tmp_path, monkeypatch):
    """The stamp ends in Z: it is UTC, not the machine's local time (here 9 hours ahead)."""
    _terminal(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runner, "run_child", _FakeChild({"baseline": (_child_record(), b"fine\n", 0)}))
    monkeypatch.setenv("TZ", "XST-9")
    time.tzset()
    try:
        before = time.time()
        with runner.Progress(1) as progress:
            record = _study(tmp_path, cmd=CMD).run(_spec(), progress)
        after = time.time()
    finally:
        monkeypatch.undo()
        time.tzset()
    stamps = {time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(moment)) for moment in (before, after)}
    assert record["run_id"].rsplit("-", 1)[1] in stamps


def test_a_study_runs_what_is_not_recorded_and_counts_what_it_did(tmp_path, monkeypatch):
    terminal = _terminal(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere/lib")
    monkeypatch.setenv("RUNNER_MARK", "m42")
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    monkeypatch.setattr(runner.planner.memory, "rehearsal", lambda config: _Rehearsal())
    ok = _child_record(memory={"peak_allocated_mib": 123.4}, timing={"step_time_median_ms": 4.567})
    lines = [b"line %d" % number for number in range(1, 25)]
    lines[9] += b" \xff"  # not UTF-8
    output = b"\n".join([*lines, f"{BROKE} in {runner.REPO_ROOT}/x.py\n".encode()])
    child = _FakeChild({"baseline": (ok, b"fine\n", 0), "broken": (None, output, 1)})
    monkeypatch.setattr(runner, "run_child", child)
    study = _study(tmp_path, cmd=CMD, run_timeout_s=600.0, predict=True)
    with runner.Progress(4) as progress:  # closed, however the test ends: a live bar moves the next one down
        broken = study.run(_spec("broken"), progress)
        baseline = study.run(_spec(), progress)
        again = study.run(_spec(repeat=1), progress)
        assert study.run(_spec(), progress) is baseline  # recorded: not run again
    assert read_records(tmp_path / "results" / "records.jsonl") == [broken, baseline, again]
    assert (study.executed, study.skipped, study.failed, progress.n) == (3, 1, 1, 3)
    assert study.done == {_spec("broken").key: broken, _spec().key: baseline, _spec(repeat=1).key: again}
    predictions = read_records(tmp_path / "results" / "predictions.jsonl")
    assert [broken["prediction"], baseline["prediction"], again["prediction"]] == predictions

    first = child.calls[1]
    run_dir = tmp_path / "work" / "nested" / f"baseline-{HASH}-r0"
    assert first["args"] == ["main.py", "fit", "--config", f"{run_dir}/callbacks.yaml", "--data.batch_size=8",
                             f"--trainer.logger.init_args.save_dir={run_dir}"]
    assert (first["log_path"], first["timeout_s"]) == (run_dir / "output.log", 600.0)
    env = first["env"]
    assert re.fullmatch(rf"baseline-{HASH[:8]}-r0-\d{{8}}T\d{{6}}Z", env["MODELWRIGHT_RUN_ID"])
    assert env["MODELWRIGHT_COMMAND"] == " ".join(CMD) and env["PYTHONUNBUFFERED"] == "1"
    # the study's folder first: a job's classes there stay importable from the repository
    assert env["PYTHONPATH"] == os.pathsep.join([str(tmp_path), "/elsewhere/lib"]) and env["RUNNER_MARK"] == "m42"
    assert (baseline["run_id"], baseline["status"]) == (env["MODELWRIGHT_RUN_ID"], "ok")
    assert baseline["study"] == study._study_facts(_spec(), first["args"], runner.ChildResult(0, False, 12.5))
    assert "output_tail" not in baseline["study"]

    assert broken["status"] == "failed" and broken["error"] == f"exit status 1: {BROKE} in ./x.py"
    assert broken["run_id"] == child.calls[0]["env"]["MODELWRIGHT_RUN_ID"]
    tail = [f"line {number}" for number in range(6, 25)] + [f"{BROKE} in ./x.py"]
    tail[4] = "line 10 \ufffd"
    assert broken["study"]["output_tail"] == tail and broken["study"]["returncode"] == 1
    assert (progress.desc, progress.postfix) == ("baseline r1: ", "65 s")
    assert _said(terminal) == [f"broken r0: failed: exit status 1: {BROKE} in ./x.py in 12.5 s",
                               "baseline r0: ok, peak 123 MiB, step 4.57 ms in 12.5 s",
                               "baseline r1: ok, peak 123 MiB, step 4.57 ms in 12.5 s",
                               f"baseline r0: skipped (recorded: ok, config {HASH})"]


def test_a_recorded_budget_run_leaves_the_count_of_runs_to_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runner, "run_child", lambda *args: pytest.fail("a recorded run ran again"))
    records = tmp_path / "results" / "records.jsonl"
    records.parent.mkdir()
    for kind, status in (("budget", "oom"), ("run", "ok")):
        record = _child_record(status, "killed by signal 9" if status == "oom" else None)
        record["study"] = {"name": "baseline", "kind": kind, "config_hash": HASH, "repeat": 0}
        with records.open("a") as file:
            print(json.dumps(record), file=file)
    study = _study(tmp_path)
    progress = runner.Progress(3)
    assert study.run(_spec(kind="budget", role="over"), progress)["status"] == "oom"
    assert (progress.total, study.skipped) == (2, 1)  # budget runs are counted before they are known
    assert study.run(_spec(), progress)["status"] == "ok"
    assert (progress.total, study.skipped, study.executed) == (2, 2, 0)
    assert capsys.readouterr() == ("", f"baseline @ batch 8 (over): skipped (recorded: oom, config {HASH})\n"
                                       f"baseline r0: skipped (recorded: ok, config {HASH})\n")


def test_a_run_left_out_says_why_and_leaves_the_count(tmp_path, capsys):
    study = _study(tmp_path)
    progress = runner.Progress(3)
    study.leave_out(_spec(), progress, "its baseline failed", counted=True)
    assert progress.total == 2
    study.leave_out(_spec(kind="epoch"), progress, "no time left", counted=False)
    assert progress.total == 2
    assert capsys.readouterr() == ("", "baseline r0: not run: its baseline failed\n"
                                       "baseline (one whole epoch): not run: no time left\n")


def test_the_bar_counts_runs_follows_the_terminals_width_and_goes_when_done(monkeypatch):
    terminal = _terminal(monkeypatch)
    with runner.Progress(3) as progress:
        progress.add_runs(-1)
        terminal.width = 40
        progress.refresh()
    frames = terminal.getvalue().split("\r")
    wide = "  0%|" + " " * 31 + "| {}/{} [00:00<?, ?run/s]"  # 59 wide
    assert frames[1:3] == [wide.format(0, 3), wide.format(0, 2)]
    assert frames[3].rstrip() == "  0%|           | 0/2 [00:00<?, ?run/s]"  # 39 wide, over the 59 before
    assert frames[-2:] == [" " * 39, ""] and "\n" not in terminal.getvalue()  # cleared, not left


#: A finished run's line, by its kind and record (seconds: 150).
SAID = [
    ("run", {"status": "ok", "memory": {"peak_allocated_mib": 1234.5}, "timing": {"step_time_median_ms": 0.04567}},
     "baseline r0: ok, peak 1,230 MiB, step 0.0457 ms in 2.5 min"),
    ("epoch", {"status": "ok", "memory": {"peak_allocated_mib": None},
               "timing": {"epoch_time_s": 65.0, "step_time_median_ms": 12.34}},
     "baseline (one whole epoch): ok, epoch 65 s, median step 12.3 ms in 2.5 min"),
    ("budget", {"status": "ok", "memory": {"peak_allocated_mib": 30.8}, "timing": {"step_time_median_ms": None}},
     "baseline @ batch 8 (over): ok, peak 30.8 MiB in 2.5 min"),
    ("epoch", {"status": "oom", "error": "killed by signal 9", "timing": {"epoch_time_s": 65.0}},
     "baseline (one whole epoch): oom: killed by signal 9 in 2.5 min"),
    ("run", {"status": "failed", "error": "exit status 1: RuntimeError: x", "memory": {"peak_allocated_mib": 9.0}},
     "baseline r0: failed: exit status 1: RuntimeError: x in 2.5 min"),
]


@pytest.mark.parametrize(("kind", "record", "line"), SAID)
def test_the_line_said_of_a_finished_run(capsys, kind, record, line):
    runner._say_result(_spec(kind=kind, role="over"), record, 150.0)
    assert capsys.readouterr() == ("", line + "\n")
