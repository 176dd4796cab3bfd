"""The Accelerate loop: same config, same losses as the Lightning run, same record; N processes; bad input.

The equivalence tests run ``main.py fit`` (in-process) and the Accelerate loop on the same arguments and
compare the ``history`` of their run records step by step. fp32 on one CPU process runs the same kernels in
the same order from the same seed, so the tolerance is tight (relative 1e-5); bf16 autocast differs only
in where the loss is upcast, so it gets relative 1e-3.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, TINY

from callbacks.fault_tolerance import NonFiniteLossError
from modelwright.loops import accelerate as al
from modelwright.train.cli import cli_main
from modelwright.errors import ConfigError
from modelwright.measure import peak_cache_key
from modelwright.record import read_record

SMALL = [
    *TINY, "--model.model_name", "smallcnn", "--data.batch_size", "4", "--data.val_size", "8",
    "--trainer.log_every_n_steps", "1",
]


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine two threads per process wait on each other (3-10x slower).
    Both loops of a comparison run with the same count, so their kernels stay the same."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def cached_peak(one_thread, tmp_path, monkeypatch):
    """A known matmul peak in a private cache: no run measures one (a measurement draws from the global RNG
    before the first batch, which would make the first run on a machine shuffle differently)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    entries = {peak_cache_key("cpu", dtype): {"flops_per_s": 1e11} for dtype in (torch.float32, torch.bfloat16)}
    (cache / "peak_flops.json").write_text(json.dumps(entries))
    monkeypatch.setenv("MODELWRIGHT_CACHE_DIR", str(cache))


def run_both(tmp_path: Path, *extra: str) -> tuple[dict, dict]:
    """The Lightning and the Accelerate record of the same arguments."""
    args = [*SMALL, *extra, "--trainer.logger.init_args.save_dir", str(tmp_path)]
    assert cli_main(["fit", *args]) == 0
    assert al.main(args) == 0
    (lightning_record,) = tmp_path.glob("base/version_*/record.json")
    # Beside the Lightning runs of the same config: <save_dir>/<name>/accelerate/version_N.
    (version,) = tmp_path.glob("base/accelerate/version_*")
    assert "model_name: smallcnn" in (version / "config.yaml").read_text(), "the resolved config is saved"
    assert list(version.glob("events.out.tfevents.*")), "TensorBoard events beside the record"
    return read_record(lightning_record), read_record(version / "record.json")


def assert_same_history(lightning: dict, accelerate: dict, key: str, rel: float) -> None:
    ours, theirs = accelerate["history"][key], lightning["history"][key]
    assert [s for s, _ in ours] == [s for s, _ in theirs], f"{key}: logged at different steps"
    for (step, a), (_, b) in zip(ours, theirs, strict=True):
        assert math.isclose(a, b, rel_tol=rel), f"{key} at step {step}: accelerate {a} vs lightning {b}"


def test_fp32_losses_match_lightning_step_by_step(tmp_path):
    lightning, accelerate = run_both(tmp_path, "--data.train_size", "12", "--trainer.max_epochs", "2")
    assert accelerate["loop"] == "accelerate" and lightning["loop"] == "lightning"
    assert len(accelerate["history"]["train/loss"]) == 6, "2 epochs of 12 samples in batches of 4"
    assert_same_history(lightning, accelerate, "train/loss", rel=1e-5)
    assert_same_history(lightning, accelerate, "train/acc", rel=1e-5)
    assert_same_history(lightning, accelerate, "val/loss", rel=1e-5)  # after each epoch
    for key in ("precision", "micro_batch_size", "effective_batch_size", "world_size", "optimizer_impl"):
        assert accelerate["techniques"][key] == lightning["techniques"][key], key
    assert accelerate["timing"]["steps_per_epoch"] == lightning["timing"]["steps_per_epoch"] == 3
    assert accelerate["flops"]["flops_per_step"] == lightning["flops"]["flops_per_step"] > 0
    assert accelerate["memory"]["anatomy_mib"]["parameters"] == lightning["memory"]["anatomy_mib"]["parameters"]
    assert accelerate["timing"]["measured_steps"] == 3, "6 steps less 2 warm-up, less the anatomy step"


def test_accumulation_and_checkpointing_match_lightning_including_a_short_last_cycle(tmp_path):
    # 10 samples in batches of 2: 5 micro-batches per epoch, stepped as 2 + 2 + 1; blocks recomputed in backward.
    lightning, accelerate = run_both(
        tmp_path, "--trainer.accumulate_grad_batches", "2", "--data.batch_size", "2", "--data.train_size", "10",
        "--trainer.max_epochs", "2", "--model.gradient_checkpointing", "block",
    )
    assert [s for s, _ in accelerate["history"]["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert_same_history(lightning, accelerate, "train/loss", rel=1e-5)
    segments = accelerate["techniques"]["checkpointed_segments"]
    assert segments == lightning["techniques"]["checkpointed_segments"] > 0
    assert accelerate["techniques"]["effective_batch_size"] == 4
    assert accelerate["flops"]["flops_per_step"] == 2 * accelerate["flops"]["flops_per_micro_batch"]


def test_16_mixed_on_cpu_runs_bf16_like_lightning(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="modelwright"):
        lightning, accelerate = run_both(tmp_path, "--trainer.precision", "16-mixed", "--trainer.max_steps", "3")
    assert "requested 16-mixed, running bf16-mixed on cpu" in caplog.text
    for record in (lightning, accelerate):
        assert (record["techniques"]["precision"], record["techniques"]["precision_requested"]) == (
            "bf16-mixed", "16-mixed")
    assert accelerate["techniques"]["mixed_precision"] == "bf16"
    assert_same_history(lightning, accelerate, "train/loss", rel=1e-3)


@pytest.mark.timeout(300)
def test_two_cpu_processes_with_torchrun_write_one_record(tmp_path, subprocess_env):
    # torchrun, not `accelerate launch --cpu --num_processes 2`, which was seen to start one process only.
    args = [
        "--config", "configs/ddp.yaml", *SMALL, "--data.train_size", "24", "--trainer.max_epochs", "1",
        "--trainer.logger.init_args.save_dir", str(tmp_path),
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "modelwright", "accelerate"]
    proc = subprocess.run(
        [*cmd, *args], cwd=REPO_ROOT, env=subprocess_env, capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("ddp/accelerate/version_*/record.json")  # rank 0 alone writes
    record = read_record(path)
    tech = record["techniques"]
    strategy = record["config"]["trainer"]["strategy"]
    assert record["loop"] == "accelerate" and strategy["class_path"].endswith("DDPStrategy")
    assert (tech["world_size"], tech["strategy"], tech["effective_batch_size"]) == (2, "ddp", 8)
    # 24 samples in batches of 4 over 2 processes: 3 steps each, then one validation.
    assert [s for s, _ in record["history"]["train/loss"]] == [1, 2, 3]
    assert record["history"]["val/loss"][0][0] == 3 and math.isfinite(record["metrics"]["val/loss"])


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--model.no_such_key", "1"], "no_such_key"),
        (["--trainer.precision", "8-mixed"], "trainer.precision"),
        (["--trainer.accumulate_grad_batches", "0"], "trainer.accumulate_grad_batches"),
        (["--config", "configs/fsdp2.yaml"], "trainer.strategy"),
        (["--model.lr", "-1"], "model.lr"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, names, tmp_path, capsys):
    assert al.main([*args, "--trainer.logger.init_args.save_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and names in err, err
    assert not list(tmp_path.rglob("record.json")), "a configuration error is not a run"


def test_unknown_key_in_a_config_file_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  model_nam: smallcnn\n")
    assert al.main(["--config", str(bad)]) == 2
    assert "model_nam" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("requested", "device", "precision", "mixed", "cast"),
    [
        ("32-true", "cpu", "32-true", "no", None),
        (32, "cuda", "32-true", "no", None),
        ("bf16-mixed", "cpu", "bf16-mixed", "bf16", None),
        ("bf16", "cuda", "bf16-mixed", "bf16", None),
        ("16-mixed", "cuda", "16-mixed", "fp16", None),
        ("16-mixed", "cpu", "bf16-mixed", "bf16", None),
        ("bf16-true", "cpu", "bf16-true", "no", torch.bfloat16),
        ("64-true", "cpu", "64-true", "no", torch.float64),
    ],
)
def test_precision_plan(requested, device, precision, mixed, cast):
    plan = al.plan_precision(requested, device)
    assert (plan.precision, plan.mixed_precision, plan.cast_dtype) == (precision, mixed, cast)
    assert (plan.note is not None) == (precision != al._PRECISION_ALIASES.get(str(requested), str(requested)))


def test_unsupported_precision_is_a_config_error():
    with pytest.raises(ConfigError, match="trainer.precision"):
        al.plan_precision("transformer-engine", "cuda")


# Images of magnitude 1e38 overflow float32 in the first convolution: every loss is NaN.
BLOW_UP = ["--data.noise", "1e38", "--model.scheduler", "none", "--trainer.max_steps", "4"]


def test_nonfinite_loss_stops_the_run_as_diverged(tmp_path):
    record_path = tmp_path / "r.json"
    with pytest.raises(NonFiniteLossError, match="at step 0 "):
        al.main([*SMALL, *BLOW_UP, "--trainer.logger.init_args.save_dir", str(tmp_path), "--record", str(record_path)])
    record = read_record(record_path)
    assert record["status"] == "diverged" and "NonFiniteLossGuard(on_nonfinite=stop)" in record["error"]
    assert record["faults"]["diverged_at_step"] == 0
    assert record["history"]["train/loss"] == [[1, None]], "stopped after the first step; NaN is written as null"


def test_nonfinite_steps_are_skipped_up_to_the_limit(tmp_path):
    # Lists replace in a delta file: this run's callbacks are the guard and the record only.
    delta = tmp_path / "skip.yaml"
    delta.write_text(
        "trainer:\n  callbacks:\n"
        "    - class_path: callbacks.fault_tolerance.NonFiniteLossGuard\n"
        "      init_args: {on_nonfinite: skip, max_skipped_steps: 1}\n"
        "    - class_path: callbacks.run_record.RunRecord\n"
        f"      init_args: {{record_path: {tmp_path / 'r.json'}}}\n"
    )
    args = [*SMALL, *BLOW_UP, "--config", str(delta), "--trainer.logger.init_args.save_dir", str(tmp_path)]
    with pytest.raises(NonFiniteLossError, match="2 steps skipped, max_skipped_steps=1"):
        al.main(args)
    record = read_record(tmp_path / "r.json")
    assert record["status"] == "diverged"
    assert record["faults"]["nonfinite_skipped_at"] == [0, 1] and record["faults"]["diverged_at_step"] == 1
    assert record["timing"]["warmup_steps"] is None, "no StepTimeMonitor in this config: no timing"


def test_sigterm_ends_the_step_writes_interrupted_and_exits_143(tmp_path, monkeypatch):
    step_ends = al._Run._step_ends

    def terminated_after_step_1(self, *args):
        step_ends(self, *args)
        if self.global_step == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(al._Run, "_step_ends", terminated_after_step_1)
    record_path = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exit_info:
        al.main([*SMALL, "--trainer.max_steps", "3", "--trainer.logger.init_args.save_dir", str(tmp_path),
                 "--record", str(record_path)])
    assert exit_info.value.code == 143
    record = read_record(record_path)
    assert (record["status"], record["error"]) == ("interrupted", "SIGTERM: stopped at the end of step 1")
    assert signal.getsignal(signal.SIGTERM) is not al._Run._on_sigterm, "the previous handler is back"


def test_step_and_batch_counts_follow_lightning():
    assert al.estimated_stepping_batches(5, 2, max_epochs=2, max_steps=-1) == 6
    assert al.estimated_stepping_batches(5, 2, max_epochs=2, max_steps=4) == 4
    assert al.estimated_stepping_batches(5, 1, max_epochs=-1, max_steps=-1) == float("inf")
    assert al.limit_batches(10, 3, "k") == 3
    assert al.limit_batches(10, 0.25, "k") == 2
    assert al.limit_batches(10, 1.0, "k") == 10
    with pytest.raises(ConfigError, match="trainer.limit_val_batches"):
        al.limit_batches(10, 0.01, "trainer.limit_val_batches")
