"""Faults: exact resume after SIGKILL mid-epoch, SIGTERM, non-finite losses, a failing DDP rank.

Fault injectors are in tests/faults.py. The callbacks list of a run is configs/base.yaml's, patched and
written to a config file (a CLI flag cannot change one entry of a list).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from torch.utils.data import DataLoader, TensorDataset

from conftest import REPO_ROOT, fit_args
from modelwright.measure import LossWatch, NonFiniteLossError
from modelwright.study import DONE_STATUSES
from modelwright.train.cli import cli_main
from modelwright.train.resume import ResumableDataLoader, ResumableRandomSampler

SMALL = ["--model.network", "SmallCNN", "--trainer.max_epochs", "2", "--data.train_size", "64"]  # 8 steps/epoch


def _args(log_dir: Path, *extra: str) -> list[str]:
    """A small fit (batch 8, 8 steps per epoch, 2 epochs) logging under ``log_dir``; ``extra`` wins."""
    return [*fit_args(log_dir), *SMALL, *extra]


def _callbacks_config(path: Path, *, every_n_train_steps: int = 3, on_nonfinite: str = "stop",
                      extra: tuple[dict, ...] = ()) -> Path:
    """configs/base.yaml's callbacks, with checkpoints every ``every_n_train_steps`` and the RunMonitor's
    ``on_nonfinite`` set."""
    base = yaml.safe_load((REPO_ROOT / "configs" / "base.yaml").read_text(encoding="utf-8"))
    callbacks = base["trainer"]["callbacks"]
    found = set()
    for cb in callbacks:
        args = cb.setdefault("init_args", {}) or {}
        cb["init_args"] = args
        if cb["class_path"].endswith("ModelCheckpoint") and "every_n_train_steps" in args:
            args["every_n_train_steps"] = every_n_train_steps
            found.add("steps")
        elif cb["class_path"].endswith("RunMonitor"):
            args["on_nonfinite"] = on_nonfinite
            found.add("monitor")
    assert found == {"steps", "monitor"}, "base.yaml has a step ModelCheckpoint and a RunMonitor"
    path.write_text(yaml.safe_dump({"trainer": {"callbacks": [*callbacks, *extra]}}), encoding="utf-8")
    return path


@pytest.fixture
def threads() -> dict:
    """For a child process, this one's thread count: CPU kernels, and so the last bits of the weights, depend on it.
    (The clock behind the hardware peak is measured once per test session, in conftest's cache folder.)"""
    return {"OMP_NUM_THREADS": str(torch.get_num_threads())}


def _ckpt(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def _last(log_dir: Path, version: int) -> Path:
    """The checkpoint ``--ckpt_path last`` would take from that version: the newest ``last*.ckpt``."""
    return max(log_dir.glob(f"*/version_{version}/checkpoints/last*.ckpt"), key=lambda p: p.stat().st_mtime)


# -- the resumable loader ------------------------------------------------------------------------


def _epochs(loader: DataLoader, n: int = 2) -> list[list[list[int]]]:
    return [[batch[0].tolist() for batch in loader] for _ in range(n)]


def test_resumable_loader_shuffles_as_shuffle_true_and_resumes_mid_pass():
    data = TensorDataset(torch.arange(20))
    torch.manual_seed(0)
    plain = _epochs(DataLoader(data, batch_size=3, shuffle=True, drop_last=True))

    def resumable() -> ResumableDataLoader:
        return ResumableDataLoader(data, batch_size=3, sampler=ResumableRandomSampler(data), drop_last=True)

    torch.manual_seed(0)
    assert _epochs(resumable()) == plain, "an uninterrupted run sees DataLoader(shuffle=True)'s order"

    torch.manual_seed(0)
    first = resumable()
    it = iter(first)
    seen = [next(it)[0].tolist() for _ in range(2)]
    state = first.state_dict()
    draw = torch.rand(3)  # what the training step after the checkpoint would draw (dropout, ...)
    assert state["batches"] == 2 and seen == plain[0][:2]

    torch.manual_seed(123)  # a fresh process: another RNG state
    second = resumable()
    it = iter(second)  # Lightning may iterate before the state arrives (issue #20550): it applies at the first batch
    second.load_state_dict(state)
    rest = [next(it)[0].tolist()]
    assert torch.equal(torch.rand(3), draw), "the global RNG continues where the checkpoint left it"
    rest += [batch[0].tolist() for batch in it]
    assert rest == plain[0][2:], "the rest of the interrupted pass, same permutation, nothing repeated"
    assert _epochs(second, 1)[0] != plain[0], "the next pass shuffles anew"


# -- exact resume after SIGKILL ------------------------------------------------------------------


#: Kill points of the sweep: (name, hook, global_step, batch_idx). 16 steps, 8 an epoch, a validation after every
#: 4th; step checkpoints every 4 steps, written after the validation that follows them (callbacks/checkpoint.py).
KILL_POINTS = [
    ("start", "on_train_batch_start", 0, None),  # before any checkpoint: `last` starts afresh
    ("mid-epoch", "on_train_batch_start", 6, None),
    ("checkpoint write", "fsync", 12, None),  # step 12's checkpoint written to its temp file, not yet in place
    ("epoch's last batch", "on_validation_start", 8, None),  # trained the epoch, not yet validated
    ("validation", "on_validation_batch_end", 12, 1),  # a mid-epoch validation half done
    ("after the last step", "on_validation_start", 16, None),  # the final validation pending
]


@pytest.mark.timeout(600)
def test_sigkill_at_every_kill_point_then_resume_ends_as_the_uninterrupted_run(tmp_path, subprocess_env, threads):
    """Weights, optimizer, schedule and the validations run (their steps and losses) match the uninterrupted run."""
    def config(name: str, *extra: dict) -> list[str]:
        val_log = {"class_path": "faults.ValLog", "init_args": {"path": str(tmp_path / f"{name}.val")}}
        path = _callbacks_config(tmp_path / f"{name}.yaml", every_n_train_steps=4, extra=(val_log, *extra))
        return ["--config", str(path), "--model.scheduler", "onecycle", "--data.val_size", "32",
                "--trainer.limit_val_batches", "3"]

    fits = {}
    for name, hook, step, batch in KILL_POINTS:
        killer = ({"class_path": "faults.FsyncFault", "init_args": {"step": step}} if hook == "fsync" else
                  {"class_path": "faults.KillAt", "init_args": {"hook": hook, "step": step, "batch": batch}})
        fits[str(tmp_path / f"{name}.log")] = _args(tmp_path / name, *config(name, killer))
    (tmp_path / "fits.json").write_text(json.dumps(fits))
    # All at once, forked from one process that imported the training code: most of a fresh child's time is importing.
    fork = subprocess.Popen([sys.executable, "tests/faults.py", str(tmp_path / "fits.json")], cwd=REPO_ROOT,
                            env={**subprocess_env, **threads}, stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert cli_main(_args(tmp_path / "a", *config("a"))) == 0  # uninterrupted, while the children run
        statuses = json.loads(fork.communicate(timeout=300)[0])
    finally:
        if fork.poll() is None:
            os.killpg(fork.pid, signal.SIGKILL)  # the session holds the forked children
            fork.wait()
    assert len(statuses) == len(KILL_POINTS)
    for log, status in statuses.items():
        assert status == -signal.SIGKILL, (log, Path(log).read_text()[-3000:])
    a, a_val = _ckpt(_last(tmp_path / "a", 0)), (tmp_path / "a.val").read_text().splitlines()
    assert a["global_step"] == 16 and [line.split()[0] for line in a_val] == ["4", "8", "12", "16"]
    failures = []
    for name, *_ in KILL_POINTS:
        killed = (tmp_path / f"{name}.val").read_text().splitlines() if (tmp_path / f"{name}.val").exists() else []
        # Another seed: a run that restarted instead of restoring would not match A (but one killed before its
        # first checkpoint has nothing to restore: `last` starts it afresh in its folder, with A's seed).
        seed = "0" if name == "start" else "7"
        (tmp_path / f"{name}.val").unlink(missing_ok=True)
        assert cli_main(_args(tmp_path / name, *config(name), "--ckpt_path", "last", "--seed_everything", seed)) == 0
        resumed = (tmp_path / f"{name}.val").read_text().splitlines() if (tmp_path / f"{name}.val").exists() else []
        failures += [f"{name}: {what}" for what in _differences(a, _ckpt(_last(tmp_path / name, 0)))]
        if not (killed == a_val[: len(killed)] and resumed == a_val[len(a_val) - len(resumed) :]
                and len(killed) + len(resumed) >= len(a_val)):
            failures.append(f"{name}: validations {killed} then {resumed}, uninterrupted {a_val}")
    assert not failures, "\n".join(failures)


def _differences(a: dict, b: dict) -> list[str]:
    """What differs between two end-of-fit checkpoints: step, weights, optimizer, schedule."""
    found = [] if a["global_step"] == b["global_step"] else [f"global_step {b['global_step']}"]
    found += [f"{k} differs" for k, t in a["state_dict"].items() if not torch.equal(t, b["state_dict"][k])]
    for key in ("state", "param_groups"):
        if repr(a["optimizer_states"][0][key]) != repr(b["optimizer_states"][0][key]):
            found.append(f"optimizer {key}")
    if a["lr_schedulers"] != b["lr_schedulers"]:
        found.append("lr schedule")
    return found


def test_validation_does_not_change_training(tmp_path):
    """A validation draws no random numbers from the global generator, so how often one runs (or whether a resumed run
    repeats one) cannot change the next epoch's shuffle, and so the weights."""
    ends = []
    for limit in ("0", "2"):
        assert cli_main(_args(tmp_path / limit, "--trainer.limit_val_batches", limit)) == 0
        ends.append(_ckpt(_last(tmp_path / limit, 0))["state_dict"])
    assert all(torch.equal(t, ends[1][k]) for k, t in ends[0].items())


def test_a_full_disk_keeps_the_previous_checkpoint_and_records_why_the_run_failed(tmp_path, capsys):
    full = {"class_path": "faults.FsyncFault", "init_args": {"step": 4, "fault": "enospc"}}
    config = _callbacks_config(tmp_path / "callbacks.yaml", every_n_train_steps=2, extra=(full,))
    assert cli_main(_args(tmp_path, "--config", str(config))) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: [Errno 28] No space left on device: ") and line.endswith(".ckpt'"), line
    folder = next(tmp_path.glob("*/version_0/checkpoints"))
    assert [p.name for p in folder.iterdir() if p.suffix != ".ckpt"] == [], "no temporary file left"
    assert {_ckpt(p)["global_step"] for p in folder.glob("*.ckpt")} == {2}, "the step-2 checkpoint is whole"
    record = json.loads(next(tmp_path.glob("*/version_0/record.json")).read_text())
    assert record["status"] == "failed" and "No space left on device" in record["error"]


# -- SIGTERM -------------------------------------------------------------------------------------


def test_sigterm_saves_a_checkpoint_exits_143_and_is_recorded_interrupted(tmp_path):
    signaller = {"class_path": "faults.SignalAt", "init_args": {"step": 3}}
    config = _callbacks_config(tmp_path / "callbacks.yaml", every_n_train_steps=500, extra=(signaller,))
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        cli_main(_args(tmp_path, "--config", str(config)))
    handler = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, previous)
    assert handler is not signal.SIG_DFL, "a second SIGTERM while the process ends is still handled"
    assert stopped.value.code == 143, "main.py exits with 128 + SIGTERM"
    ckpt = _ckpt(_last(tmp_path, 0))
    # SIGTERM arrived at the end of step 3 (after the stop check of that step): the run stopped after the next.
    assert ckpt["global_step"] == 4, "the checkpoint holds the step after which the run stopped"
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["batches"] == 4
    (record_path,) = tmp_path.glob("*/version_0/record.json")
    record = json.loads(record_path.read_text())
    assert record["status"] == "interrupted" and record["status"] not in DONE_STATUSES


@pytest.fixture
def signal_handlers():
    """The process's SIGTERM and SIGINT handlers as they were, put back after the test."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    yield saved
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_ctrl_c_stops_after_the_step_with_a_checkpoint_and_the_command_that_resumes_exactly(
        tmp_path, capsys, signal_handlers):
    """Before, Ctrl-C ended the run at once with exit 1 and no checkpoint: `--ckpt_path last` then pointed at an
    older run or started afresh."""
    ctrl_c = {"class_path": "faults.SignalAt", "init_args": {"step": 3, "signum": int(signal.SIGINT)}}
    config = _callbacks_config(tmp_path / "callbacks.yaml", every_n_train_steps=500, extra=(ctrl_c,))
    args = _args(tmp_path / "stopped", "--config", str(config))
    with pytest.raises(SystemExit) as stopped:
        cli_main(args)
    assert stopped.value.code == 130, "128 + SIGINT"
    err = capsys.readouterr().err
    assert "Ctrl-C: stopping after the optimizer step in flight" in err
    assert "to resume: " in err and err.rstrip().endswith("--ckpt_path last")
    ckpt = _ckpt(_last(tmp_path / "stopped", 0))
    assert ckpt["global_step"] == 4, "the signal came at the end of step 3: the run stopped after the next"
    record = json.loads(next((tmp_path / "stopped").glob("*/version_0/record.json")).read_text())
    assert record["status"] == "interrupted" and "Ctrl-C" in record["error"]
    assert cli_main([*args, "--ckpt_path", "last"]) == 0
    assert cli_main(_args(tmp_path / "whole", "--config", str(_callbacks_config(tmp_path / "plain.yaml",
                                                                                  every_n_train_steps=500)))) == 0
    assert _differences(_ckpt(_last(tmp_path / "whole", 0)), _ckpt(_last(tmp_path / "stopped", 0))) == []


def test_a_second_sigterm_as_the_process_exits_keeps_the_exit_status_143(tmp_path, subprocess_env):
    """Before, Lightning's teardown put the default handler back and the second SIGTERM killed the process
    (status -15) before it could exit with 143."""
    signals = ({"class_path": "faults.SignalAt", "init_args": {"step": 2}},
               {"class_path": "faults.SignalAtExit"})
    config = _callbacks_config(tmp_path / "callbacks.yaml", every_n_train_steps=500, extra=signals)
    proc = subprocess.run([sys.executable, "main.py", *_args(tmp_path, "--config", str(config))], cwd=REPO_ROOT,
                          env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert _ckpt(_last(tmp_path, 0))["global_step"] == 3


def test_the_record_exists_while_the_run_runs_and_survives_a_kill_in_its_last_write(tmp_path, subprocess_env):
    """Before, the record was written once, at the end: a kill during that write left a temp file and no
    record, and the run's measurements were lost."""
    spy = {"class_path": "faults.RecordAt", "init_args": {"step": 4, "copy": str(tmp_path / "at-step-4.json")}}
    kill = {"class_path": "faults.KillInFinalRecordWrite"}
    config = _callbacks_config(tmp_path / "callbacks.yaml", every_n_train_steps=4, extra=(spy, kill))
    args = _args(tmp_path, "--config", str(config))
    proc = subprocess.run([sys.executable, "main.py", *args], cwd=REPO_ROOT, env=subprocess_env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert json.loads((tmp_path / "at-step-4.json").read_text())["status"] == "running"
    (folder,) = tmp_path.glob("*/version_0")
    record = json.loads((folder / "record.json").read_text())  # whole: the last running record
    assert record["status"] == "running" and record["timing"]["measured_steps"] >= 10
    assert record["timing"]["epoch_steps"] == 8, "an epoch ended before the kill: its time is kept"
    assert list(folder.glob(".record.json.*.tmp")), "the kill left the last write's temp file"
    plain = _callbacks_config(tmp_path / "plain.yaml", every_n_train_steps=4)
    resume = _args(tmp_path, "--config", str(plain), "--ckpt_path", str(folder / "checkpoints" / "last-step.ckpt"))
    assert cli_main(resume) == 0
    assert not list(folder.glob(".record.json.*.tmp")), "the next run of it removed the stale temp file"


# -- non-finite loss -----------------------------------------------------------------------------


def _nan_at(*steps: int) -> dict:
    return {"class_path": "faults.NanLossAt", "init_args": {"steps": list(steps)}}


def test_nonfinite_loss_stops_the_run_naming_the_step(tmp_path, capsys):
    config = _callbacks_config(tmp_path / "callbacks.yaml", every_n_train_steps=500, extra=(_nan_at(5),))
    try:
        rc = cli_main(_args(tmp_path, "--config", str(config)))
        lines = capsys.readouterr().err.strip().splitlines()
    except NonFiniteLossError as err:  # until cli_main turns it into one line and a status
        rc, lines = 1, [f"error: {err}"]
    assert rc != 0
    assert len([line for line in lines if line.startswith("error: ")]) == 1
    assert "train/loss is nan at step 5 (epoch 0, batch 5)" in lines[-1], lines
    (record_path,) = tmp_path.glob("*/version_0/record.json")
    record = json.loads(record_path.read_text())
    assert record["status"] == "diverged", record["error"]
    assert "step 5" in record["error"]
    assert record["faults"]["diverged"] is True and record["faults"]["diverged_at_step"] == 5


def test_nonfinite_loss_skip_drops_the_steps_and_counts_them(tmp_path):
    """Step 2 gets NaN images (its forward poisons BatchNorm's statistics), step 5 a NaN loss; both are dropped."""
    nan_input = {"class_path": "faults.NanInputAt", "init_args": {"steps": [2]}}
    config = _callbacks_config(
        tmp_path / "callbacks.yaml", every_n_train_steps=500, on_nonfinite="skip", extra=(nan_input, _nan_at(5))
    )
    assert cli_main(_args(tmp_path, "--config", str(config), "--trainer.max_steps", "8")) == 0
    ckpt = _ckpt(_last(tmp_path, 0))
    assert ckpt["global_step"] == 8
    faults = ckpt["callbacks"]["RunMonitor"]["faults"]
    assert faults["skipped_steps"] == 2 and faults["skipped_at"] == [2, 5]
    assert faults["scaler_skipped_steps"] is None, "no GradScaler in fp32"
    adam_steps = {float(s["step"]) for s in ckpt["optimizer_states"][0]["state"].values()}
    assert adam_steps == {6.0}, "AdamW took 6 of the 8 steps: the skipped ones changed no optimizer state"
    for name, tensor in ckpt["state_dict"].items():
        assert torch.isfinite(tensor.float()).all(), f"{name} is not finite"
        if name.endswith("num_batches_tracked"):
            assert int(tensor) == 6, f"{name}: {int(tensor)}; the skipped steps' forwards were not undone"
    (record_path,) = tmp_path.glob("*/version_0/record.json")
    record = json.loads(record_path.read_text())
    assert record["status"] == "ok"
    assert record["faults"]["nonfinite_skipped_steps"] == 2 and record["faults"]["nonfinite_skipped_at"] == [2, 5]
    assert math.isfinite(record["metrics"]["val/loss"]), "validation runs on a model the NaN batch did not poison"


def test_gradscaler_skipped_steps_are_counted_from_the_scale():
    """A real GradScaler (the CPU one; Lightning's 16-mixed uses the CUDA one) halves its scale on a skip."""
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    watch = LossWatch()
    module = torch.nn.Linear(1, 1)
    for factor in (float("inf"), 1.0, float("nan"), 1.0):  # as Lightning's MixedPrecision.optimizer_step does
        optimizer.zero_grad()
        (scaler.scale(param.sum()) * factor).backward()
        scaler.unscale_(optimizer)
        watch.before_update(optimizer, module, reduce=lambda t: t, scale=scaler._scale)
        scaler.step(optimizer)
        scaler.update()
        watch.after_micro_batch(reduce=lambda t: t, scale=scaler._scale)
    assert watch.scaler_skipped_steps == 2
    assert torch.allclose(param, torch.full((3,), 0.8)), "two of the four steps updated the parameter"
    assert watch.section()["scaler_skipped_steps"] == 2 and watch.skipped_steps == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GradScaler runs with 16-mixed on CUDA")
def test_gradscaler_skips_are_counted_in_a_16_mixed_fit(tmp_path):
    config = _callbacks_config(tmp_path / "callbacks.yaml", every_n_train_steps=500, on_nonfinite="skip",
                               extra=(_nan_at(3),))
    args = _args(tmp_path, "--config", str(config), "--trainer.precision", "16-mixed",
                 "--trainer.accelerator", "cuda", "--trainer.max_steps", "8")
    assert cli_main(args) == 0
    (record_path,) = tmp_path.glob("*/version_0/record.json")
    faults = json.loads(record_path.read_text())["faults"]
    assert faults["nonfinite_skipped_steps"] == 1 and faults["nonfinite_skipped_at"] == [3]
    # The NaN step's gradients make the scaler skip too; fp16 overflows at the initial scale may add more.
    assert faults["scaler_skipped_steps"] is not None and 1 <= faults["scaler_skipped_steps"] <= 8


# -- DDP: a failing rank ends the job ------------------------------------------------------------


@pytest.mark.timeout(300)
def test_ddp_rank_failure_ends_the_job_nonzero_in_bounded_time(tmp_path, subprocess_env):
    """Rank 1 raises at step 2 while rank 0 trains on: both processes are gone soon after, with a non-zero status.

    (gloo: rank 0's next collective fails on the closed connection; NCCL: Lightning's launcher SIGKILLs
    rank 0 within ~5 s of a child exiting non-zero. The process-group timeout in ddp.yaml bounds a rank that
    stalls instead of failing.)"""
    failed_at = tmp_path / "failed_at"
    args = fit_args(tmp_path, "--config", "configs/ddp.yaml", "--model.network", "SmallCNN",
                    "--trainer.max_steps", "6", "--trainer.callbacks+=faults.RaiseAt",
                    "--trainer.callbacks.step", "2", "--trainer.callbacks.rank", "1",
                    "--trainer.callbacks.marker", str(failed_at))
    # capture_output waits for every process holding the pipes: a rank left hanging fails this by timeout.
    proc = subprocess.run([sys.executable, "main.py", *args], cwd=REPO_ROOT, env=subprocess_env,
                          capture_output=True, text=True, timeout=240)
    ended_after_s = time.time() - float(failed_at.read_text())
    assert proc.returncode != 0
    assert "injected failure on rank 1 at step 2" in proc.stderr
    assert ended_after_s < 60, f"the job ended {ended_after_s:.0f} s after rank 1 failed"


def test_sigterm_after_several_fits_reaches_the_handler_from_before_them(tmp_path, signal_handlers):
    """Issue 39. Before: each fit chained the stop handler to Lightning's, which held the stop handler: a
    SIGTERM after the fits went round between them until a RecursionError."""
    received = []
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    for run in ("first", "second"):
        assert cli_main(_args(tmp_path / run, "--trainer.max_steps", "1")) == 0
    os.kill(os.getpid(), signal.SIGTERM)
    assert received == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGINT) is signal_handlers[signal.SIGINT], "Ctrl-C's handler put back too"


def test_a_ctrl_c_delivered_twice_at_once_stops_as_one(tmp_path, capsys, signal_handlers):
    """Issue 39. Before: under `uv run` without a terminal, uv forwarded the SIGINT the process group had already
    got; the run saw a second Ctrl-C at once and stopped hard: exit 1, no checkpoint."""
    twice = {"class_path": "faults.SignalAt", "init_args": {"step": 2, "signum": int(signal.SIGINT), "times": 2}}
    config = _callbacks_config(tmp_path / "callbacks.yaml", every_n_train_steps=500, extra=(twice,))
    with pytest.raises(SystemExit) as stopped:
        cli_main(_args(tmp_path, "--config", str(config), "--trainer.max_epochs", "1"))
    assert stopped.value.code == 130, "128 + SIGINT, as for one Ctrl-C"
    assert capsys.readouterr().err.count("Ctrl-C: stopping after the optimizer step in flight") == 1
    assert _ckpt(_last(tmp_path, 0))["global_step"] == 3, "stopped after the step in flight, with a checkpoint"


def test_a_second_ctrl_c_a_moment_later_still_stops_at_once(monkeypatch):
    """The window that merges a doubled delivery leaves the second Ctrl-C a person presses to stop at once."""
    from callbacks import fault_tolerance

    stop = fault_tolerance._StopSignals()
    stop.fitting = True
    clock = iter([100.0, 100.0 + fault_tolerance.SAME_SIGNAL_WINDOW_S + 0.1])
    monkeypatch.setattr(fault_tolerance.time, "monotonic", lambda: next(clock))
    stop.handle(signal.SIGINT, None)
    with pytest.raises(KeyboardInterrupt):
        stop.handle(signal.SIGINT, None)
