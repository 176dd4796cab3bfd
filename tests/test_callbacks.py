"""The measurement callbacks in short CPU runs: TensorBoard scalars read back, the record written and valid,
failures recorded, the base config's callbacks through the CLI, and DDP with 2 CPU processes."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from callbacks.flops_monitor import FlopsMonitor
from callbacks.memory_monitor import MemoryMonitor
from callbacks.run_record import RunRecord
from callbacks.step_timer import StepTimeMonitor
from modelwright.train.cli import cli_main
from modelwright.train.data import ImageDataModule
from modelwright.measure import MIB, error_status, training_flops
from modelwright.train.models import build_model
from modelwright.train.module import ImageClassifier
from modelwright.record import read_record, read_records, validate_record

REPO = Path(__file__).resolve().parents[1]
PEAK = 1.0e11  # a configured peak, so that no test measures one


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of a TensorBoard run, read back with tensorboard's own event reader."""
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def measured_trainer(tmp_path: Path, warmup: int = 2, **trainer_kwargs) -> pl.Trainer:
    kwargs = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        log_every_n_steps=1,
        logger=TensorBoardLogger(tmp_path, name="run", default_hp_metric=False),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[
            StepTimeMonitor(warmup_steps=warmup),
            MemoryMonitor(warmup_steps=warmup),
            FlopsMonitor(peak_flops_per_s=PEAK),
            RunRecord(),
        ],
    )
    kwargs.update(trainer_kwargs)
    return pl.Trainer(**kwargs)


def small_data(batch_size: int = 8, train_size: int = 48) -> ImageDataModule:
    return ImageDataModule(batch_size=batch_size, train_size=train_size, val_size=16)


def small_model(**kwargs) -> ImageClassifier:
    torch.manual_seed(0)
    return ImageClassifier(model_name="smallcnn", scheduler="none", **kwargs)


def test_short_run_logs_perf_and_mem_scalars_and_writes_a_valid_record(tmp_path):
    trainer = measured_trainer(tmp_path)
    model = small_model()
    trainer.fit(model, small_data())  # 48 / 8 = 6 optimizer steps, then one validation

    log_dir = Path(trainer.logger.log_dir)
    tb = scalars(log_dir)
    for tag in (
        "perf/step_time_ms",
        "perf/samples_per_s",
        "perf/mfu",
        "perf/step_time_median_ms",
        "mem/peak_allocated_mib",
        "mem/parameters_mib",
        "mem/activations_mib",
        "mem/optimizer_state_mib",
        "mem/process_rss_peak_mib",
    ):
        assert tag in tb, f"{tag} missing from {sorted(tb)}"
    # Steps 0 and 1 are warm-up, step 2 is the anatomy capture: steps 3..5 are timed (logged at 4..6).
    assert [step for step, _ in tb["perf/step_time_ms"]] == [4, 5, 6]

    record = read_record(log_dir / "record.json")  # validates
    assert record["status"] == "ok" and record["loop"] == "lightning"
    timing = record["timing"]
    assert timing["warmup_steps"] == 2 and timing["measured_steps"] == 3
    median_s = timing["step_time_median_ms"] / 1e3
    assert sorted(v for _, v in tb["perf/step_time_ms"])[1] == pytest.approx(timing["step_time_median_ms"], rel=1e-5)
    assert timing["steps_per_epoch"] == 6
    assert timing["epoch_time_s"] == pytest.approx(6 * median_s)
    assert timing["samples_per_s"] == pytest.approx(8 / median_s)
    assert timing["wall_time_s"] >= 6 * timing["step_time_min_ms"] / 1e3

    tech = record["techniques"]
    assert tech["model_name"] == "smallcnn" and tech["precision"] == "32-true"
    assert tech["micro_batch_size"] == 8 and tech["effective_batch_size"] == 8
    assert tech["strategy"] == "single_device" and tech["world_size"] == 1
    assert tech["optimizer"] == "adamw" and tech["optimizer_impl"].startswith("torch.optim.AdamW[")

    flops = record["flops"]
    assert flops["flops_per_step"] == training_flops(build_model("smallcnn"), torch.zeros(8, 3, 32, 32))
    assert flops["peak_flops_source"] == "config" and flops["peak_flops_per_s"] == PEAK
    assert flops["mfu"] == pytest.approx(flops["flops_per_step"] / median_s / PEAK)

    mem = record["memory"]
    param_bytes = sum(p.numel() * p.element_size() for p in model.net.parameters())
    assert mem["anatomy_step"] == 2
    assert mem["model_parameters"] == sum(p.numel() for p in model.net.parameters())
    assert mem["anatomy_mib"]["parameters"] == pytest.approx(param_bytes / MIB)
    n_tensors = len(list(model.net.parameters()))
    assert mem["anatomy_end_mib"]["optimizer_state"] == pytest.approx((2 * param_bytes + 4 * n_tensors) / MIB)
    assert mem["anatomy_mib"]["activations"] > 0
    assert mem["peak_allocated_mib"] == mem["anatomy_mib"]["total"]  # CPU: the tracker's peak
    assert mem["peak_reserved_mib"] is None
    assert mem["rss_peak_mib"] > mem["peak_allocated_mib"]
    assert tb["mem/activations_mib"] == [(3, pytest.approx(mem["anatomy_mib"]["activations"], rel=1e-5))]

    assert record["metrics"]["val/acc"] is not None and record["metrics"]["train/loss"] is not None
    assert [s for s, _ in record["history"]["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert record["history"]["val/acc"][0][0] == 6
    assert torch._C._len_torch_dispatch_stack() == 0


def test_accumulation_cycles_and_flops_per_step(tmp_path):
    trainer = measured_trainer(tmp_path, warmup=1, accumulate_grad_batches=2)
    model = small_model()
    trainer.fit(model, small_data(batch_size=4, train_size=32))  # 8 micro-batches = 4 optimizer steps
    record = next(cb.record for cb in trainer.callbacks if isinstance(cb, RunRecord))
    assert validate_record(record) == []
    # Step 0 warm-up, step 1 captured, steps 2 and 3 timed.
    assert record["memory"]["anatomy_step"] == 1 and record["timing"]["measured_steps"] == 2
    assert record["timing"]["steps_per_epoch"] == 4
    tech = record["techniques"]
    assert tech["accumulate_grad_batches"] == 2 and tech["micro_batch_size"] == 4
    assert tech["effective_batch_size"] == 8
    micro = training_flops(build_model("smallcnn"), torch.zeros(4, 3, 32, 32))
    assert record["flops"]["flops_per_step"] == 2 * micro
    # The capture spans both micro-batches: the gradients of the whole cycle are there at its end.
    param_bytes = sum(p.numel() * p.element_size() for p in model.net.parameters())
    assert record["memory"]["anatomy_end_mib"]["gradients"] == pytest.approx(param_bytes / MIB)


class _Failing(ImageClassifier):
    def __init__(self, fail_at: int, exc: BaseException, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fail_at, self.exc = fail_at, exc

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == self.fail_at:
            raise self.exc
        return super().training_step(batch, batch_idx)


def test_failed_run_writes_a_failed_record_and_leaves_no_tracker(tmp_path):
    trainer = measured_trainer(tmp_path)
    # Fails inside step 2, while the memory anatomy is being captured.
    model = _Failing(2, RuntimeError("boom\nsecond line"), model_name="smallcnn", scheduler="none")
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(model, small_data())
    record = read_record(Path(trainer.logger.log_dir) / "record.json")
    assert record["status"] == "failed" and record["error"] == "RuntimeError: boom"
    assert record["memory"]["anatomy_mib"] is None
    assert torch._C._len_torch_dispatch_stack() == 0


def test_interrupted_run_is_recorded(tmp_path):
    trainer = measured_trainer(tmp_path)
    model = _Failing(3, KeyboardInterrupt(), model_name="smallcnn", scheduler="none")
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):  # Lightning's graceful shutdown exits after the hooks ran
            trainer.fit(model, small_data())
    finally:
        signal.signal(signal.SIGINT, handler)
    record = read_record(Path(trainer.logger.log_dir) / "record.json")
    assert record["status"] == "interrupted" and record["error"].startswith("KeyboardInterrupt")


class _Diverging(ImageClassifier):
    def _shared_step(self, batch):
        loss, logits = super()._shared_step(batch)
        if self.training and self.trainer.global_step >= 2:
            loss = loss * math.nan
        return loss, logits


def test_diverged_run_is_recorded(tmp_path):
    trainer = measured_trainer(tmp_path, max_steps=3)
    trainer.fit(_Diverging(model_name="smallcnn", scheduler="none"), small_data())
    record = read_record(Path(trainer.logger.log_dir) / "record.json")
    assert record["status"] == "diverged" and "nan" in record["error"]
    assert record["metrics"]["train/loss"] is None  # written as null


def test_run_stopped_by_the_nonfinite_guard_is_diverged(tmp_path):
    from callbacks.fault_tolerance import NonFiniteLossGuard

    trainer = measured_trainer(tmp_path, max_steps=4)
    trainer.callbacks.append(NonFiniteLossGuard(on_nonfinite="stop"))
    with pytest.raises(FloatingPointError):
        trainer.fit(_Diverging(model_name="smallcnn", scheduler="none"), small_data())
    record = read_record(Path(trainer.logger.log_dir) / "record.json")
    assert record["status"] == "diverged" and record["error"]
    assert record["faults"]["diverged"] is True and record["faults"]["diverged_at_step"] == 2


def test_status_of_exceptions():
    assert error_status(torch.OutOfMemoryError("CUDA out of memory")) == "oom"
    assert error_status(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB")) == "oom"
    assert error_status(MemoryError()) == "oom"
    assert error_status(ValueError("bad")) == "failed"
    assert error_status(KeyboardInterrupt()) == "interrupted"


def test_base_config_callbacks_through_the_cli(tmp_path, monkeypatch):
    monkeypatch.setenv("MODELWRIGHT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MODELWRIGHT_RUN_ID", "cli-run")
    status = cli_main(
        [
            "fit",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--trainer.max_steps=4",
            "--trainer.max_epochs=1",
            "--trainer.precision=16-mixed",
            "--trainer.log_every_n_steps=1",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            "--trainer.num_sanity_val_steps=0",
            "--model.model_name=smallcnn",
            "--model.scheduler=none",
            "--data.batch_size=4",
            "--data.train_size=32",
            "--data.val_size=8",
        ]
    )
    assert status == 0
    (path,) = tmp_path.glob("base/version_*/record.json")
    record = read_record(path)
    assert record["run_id"] == "cli-run"
    assert record["techniques"]["precision"] == "bf16-mixed"  # what ran on CPU
    assert record["techniques"]["precision_requested"] == "16-mixed"  # what was asked for
    assert record["config"]["trainer"]["precision"] == "16-mixed"
    assert record["config"]["model"]["model_name"] == "smallcnn"
    assert record["flops"]["peak_flops_source"] == "measured-matmul"
    cache = json.loads((tmp_path / "cache" / "peak_flops.json").read_text())
    assert any("|bfloat16|" in key for key in cache)  # the peak of the run's compute dtype
    assert record["timing"]["measured_steps"] == 1  # 4 steps: 2 warm-up, 1 captured, 1 timed
    assert "perf/step_time_ms" in scalars(path.parent) and "mem/activations_mib" in scalars(path.parent)


DDP_CONFIG = """\
trainer:
  accelerator: cpu
  strategy: ddp
  devices: 2
  max_steps: 5
  max_epochs: 1
  log_every_n_steps: 1
  enable_progress_bar: false
  enable_model_summary: false
  num_sanity_val_steps: 0
  logger:
    class_path: lightning.pytorch.loggers.TensorBoardLogger
    init_args: {{save_dir: "{root}", name: ddp, default_hp_metric: false}}
  callbacks:
    - class_path: callbacks.step_timer.StepTimeMonitor
    - class_path: callbacks.memory_monitor.MemoryMonitor
    - class_path: callbacks.flops_monitor.FlopsMonitor
    - class_path: callbacks.run_record.RunRecord
      init_args: {{records_jsonl: "{root}/records.jsonl"}}
model:
  model_name: smallcnn
  scheduler: none
data:
  batch_size: 4
  train_size: 64
  val_size: 8
"""


@pytest.mark.timeout(300)
def test_ddp_two_cpu_processes_rank_zero_alone_writes_the_record(tmp_path):
    config = tmp_path / "ddp.yaml"
    config.write_text(DDP_CONFIG.format(root=tmp_path))
    env = {**os.environ, "MODELWRIGHT_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("MODELWRIGHT_RUN_ID", None)
    proc = subprocess.run(
        [sys.executable, str(REPO / "main.py"), "fit", "--config", str(config)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_records(tmp_path / "records.jsonl", validate=True)
    assert len(records) == 1  # one line: rank 1 wrote nothing
    (path,) = tmp_path.glob("ddp/version_*/record.json")
    record = read_record(path)
    assert record["run_id"] == records[0]["run_id"]
    tech = record["techniques"]
    assert tech["strategy"] == "ddp" and tech["world_size"] == 2
    assert tech["micro_batch_size"] == 4 and tech["effective_batch_size"] == 8
    assert record["timing"]["measured_steps"] == 2  # 5 steps: 2 warm-up, 1 captured
    assert record["memory"]["anatomy_mib"]["activations"] > 0
    # The peak was measured once (by local rank 0), on one process's share of the cores.
    assert record["flops"]["peak_flops_source"] == "measured-matmul"
    assert "perf/step_time_ms" in scalars(path.parent)


def test_progress_bar_redraws_at_most_every_interval_and_at_the_end():
    from callbacks.progress_bar import ThrottledProgressBar

    now = {"t": 0.0}
    bar = ThrottledProgressBar(min_interval_s=0.5, clock=lambda: now["t"])
    decisions = []
    for batch in range(1, 9):  # a batch every 0.2 s, 8 batches in the pass
        now["t"] += 0.2
        decisions.append(bar._should_update(batch, 8))
    # redraw at 0.2 s, then not before 0.7 s (batch 4 at 0.8 s), 1.4 s (batch 7), and always at the last batch
    assert decisions == [True, False, False, True, False, False, True, True]
    unthrottled = ThrottledProgressBar(min_interval_s=0.0, clock=lambda: 0.0)
    assert all(unthrottled._should_update(b, 8) for b in range(1, 9))
    with pytest.raises(ValueError, match="min_interval_s"):
        ThrottledProgressBar(min_interval_s=-1)
