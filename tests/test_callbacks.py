"""The RunMonitor (the step probe under Lightning's hooks) in short CPU runs: TensorBoard scalars read back, the
record written and valid, failures recorded, the base config's callbacks through the CLI."""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from callbacks._glue import quiet_lightning
from callbacks.model_summary import FlopsModelSummary
from callbacks.run_monitor import RunMonitor
from modelwright.fmt import duration, flop_count, pct, sig
from modelwright.measure import MIB, error_status, hardware_peak, training_flops
from modelwright.record import get_path, read_record, validate_record
from modelwright.train.cli import cli_main
from modelwright.train.data import ImageDataModule
from modelwright.train.models import SmallCNN
from modelwright.train.module import ImageClassifier

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
        callbacks=[RunMonitor(warmup_steps=warmup, peak_flops_per_s=PEAK)],
    )
    kwargs.update(trainer_kwargs)
    return pl.Trainer(**kwargs)


def small_data(batch_size: int = 8, train_size: int = 48) -> ImageDataModule:
    return ImageDataModule(batch_size=batch_size, train_size=train_size, val_size=16)


def small_model(**kwargs) -> ImageClassifier:
    torch.manual_seed(0)
    return ImageClassifier(network=SmallCNN(), scheduler="none", **kwargs)


def test_short_run_logs_perf_and_mem_scalars_and_writes_a_valid_record(tmp_path):
    trainer = measured_trainer(tmp_path)
    model = small_model()
    trainer.fit(model, small_data())  # 48 / 8 = 6 optimizer steps, then one validation

    log_dir = Path(trainer.logger.log_dir)
    tb = scalars(log_dir)
    for tag in ("perf/step_time_ms", "perf/samples_per_s", "perf/mfu", "mem/peak_allocated_mib",
                "mem/process_rss_peak_mib"):
        assert tag in tb, f"{tag} missing from {sorted(tb)}"
    # Steps 0 and 1 are warm-up, step 2 is the anatomy capture: steps 3..5 are timed, logged at their own index,
    # as Lightning logs train/*.
    assert [step for step, _ in tb["perf/step_time_ms"]] == [3, 4, 5]
    assert [step for step, _ in tb["train/loss"]] == [0, 1, 2, 3, 4, 5]
    single = {"perf/step_time_median_ms", "perf/flops_per_step", "perf/peak_flops_per_s", "mem/anatomy_total_mib"}
    assert not single & set(tb), "one-value figures go to the text tab, not to one-dot charts"

    record = read_record(log_dir / "record.json")  # validates
    assert record["status"] == "ok" and record["loop"] == "lightning"
    timing = record["timing"]
    assert timing["warmup_steps"] == 2 and timing["measured_steps"] == 3
    median_s = timing["step_time_median_ms"] / 1e3
    assert sorted(v for _, v in tb["perf/step_time_ms"])[1] == pytest.approx(timing["step_time_median_ms"], rel=1e-5)
    assert timing["steps_per_epoch"] == 6
    # The epoch is measured whole: its 6 steps (the warm-up and captured ones too), loading and its validation.
    assert timing["epoch_steps"] == 6 and timing["epoch_validations"] == 1
    assert 0 < timing["epoch_validation_s"] < timing["epoch_time_s"] < timing["wall_time_s"]
    assert timing["epoch_time_s"] > 3 * timing["step_time_min_ms"] / 1e3 + timing["epoch_validation_s"]
    assert timing["samples_per_s"] == pytest.approx(8 / median_s)
    assert timing["cpu_time_s"] > 0 and 0 < timing["step_cpu_utilization"] <= 1.05

    tech = record["techniques"]
    assert tech["model_name"] == "smallcnn" and tech["precision"] == "32-true"
    assert tech["micro_batch_size"] == 8 and tech["effective_batch_size"] == 8
    assert tech["strategy"] == "single_device" and tech["world_size"] == 1
    assert tech["optimizer"] == "adamw" and tech["optimizer_impl"].startswith("torch.optim.AdamW[")

    flops = record["flops"]
    assert flops["flops_per_step"] == training_flops(SmallCNN(), torch.zeros(8, 3, 32, 32))
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
    assert not any(tag.startswith("mem/activations") for tag in tb), "categories go to one figure, not single dots"

    assert 0 <= record["metrics"]["val/acc"] <= 1 and record["metrics"]["train/loss"] > 0
    assert record["metrics"]["val/acc"] == record["history"]["val/acc"][-1][1]
    # One step numbering everywhere: the record's history is TensorBoard's.
    assert record["history"]["train/loss"] == [[step, pytest.approx(value)] for step, value in tb["train/loss"]]
    assert record["history"]["val/acc"][0][0] == 5 == tb["val/acc"][0][0]
    assert torch._C._len_torch_dispatch_stack() == 0


def test_accumulation_cycles_and_flops_per_step(tmp_path):
    trainer = measured_trainer(tmp_path, warmup=1, accumulate_grad_batches=2)
    model = small_model()
    trainer.fit(model, small_data(batch_size=4, train_size=32))  # 8 micro-batches = 4 optimizer steps
    record = next(cb.record for cb in trainer.callbacks if isinstance(cb, RunMonitor))
    assert validate_record(record) == []
    # Step 0 warm-up, step 1 captured, steps 2 and 3 timed.
    assert record["memory"]["anatomy_step"] == 1 and record["timing"]["measured_steps"] == 2
    assert record["timing"]["steps_per_epoch"] == 4
    tech = record["techniques"]
    assert tech["accumulate_grad_batches"] == 2 and tech["micro_batch_size"] == 4
    assert tech["effective_batch_size"] == 8
    micro = training_flops(SmallCNN(), torch.zeros(4, 3, 32, 32))
    assert record["flops"]["flops_per_step"] == 2 * micro
    # The capture spans both micro-batches: the second one's peak, the higher, holds the first one's gradients.
    param_bytes = sum(p.numel() * p.element_size() for p in model.net.parameters())
    assert record["memory"]["anatomy_mib"]["gradients"] == pytest.approx(param_bytes / MIB)


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
    model = _Failing(2, RuntimeError("boom\nsecond line"), network=SmallCNN(), scheduler="none")
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(model, small_data())
    record = read_record(Path(trainer.logger.log_dir) / "record.json")
    assert record["status"] == "failed" and record["error"] == "RuntimeError: boom"
    assert record["memory"]["anatomy_mib"] is None
    assert torch._C._len_torch_dispatch_stack() == 0


def test_interrupted_run_is_recorded(tmp_path):
    trainer = measured_trainer(tmp_path)
    model = _Failing(3, KeyboardInterrupt(), network=SmallCNN(), scheduler="none")
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


def test_a_nonfinite_loss_stops_the_run_and_is_recorded_diverged(tmp_path):
    trainer = measured_trainer(tmp_path, max_steps=4)
    with pytest.raises(FloatingPointError, match="train/loss is nan at step 2"):
        trainer.fit(_Diverging(network=SmallCNN(), scheduler="none"), small_data())
    record = read_record(Path(trainer.logger.log_dir) / "record.json")
    assert record["status"] == "diverged" and "step 2" in record["error"]
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
            "--model.network=SmallCNN",
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
    assert get_path(record["config"], "model.class_path") == "modelwright.train.module.ImageClassifier"
    assert get_path(record["config"], "model.init_args")["network"]["class_path"] == "modelwright.train.models.SmallCNN"
    assert record["techniques"]["model_name"] == "smallcnn"
    assert record["techniques"]["network"] == "modelwright.train.models.SmallCNN"
    peak = hardware_peak("cpu", torch.bfloat16)  # the peak of the run's compute dtype
    assert record["flops"]["peak_flops_dtype"] == "bfloat16"
    assert record["flops"]["peak_flops_per_s"] == peak.flops_per_s
    assert (record["flops"]["peak_flops_source"], record["flops"]["peak_flops_method"]) == (peak.source, peak.method)
    assert record["timing"]["measured_steps"] == 1  # 4 steps: 2 warm-up, 1 captured, 1 timed
    assert "perf/step_time_ms" in scalars(path.parent) and "mem/peak_allocated_mib" in scalars(path.parent)


def test_progress_bar_redraws_at_most_every_interval_and_at_the_end():
    from callbacks.progress_bar import ThrottledProgressBar

    now = {"t": 0.0}
    bar = ThrottledProgressBar(min_interval_s=0.5, clock=lambda: now["t"])
    decisions = []
    for batch in range(1, 9):  # a batch every 0.2 s, 8 batches in the pass
        now["t"] += 0.2
        decisions.append(bar.due(batch, 8))
    # redraw at 0.2 s, then not before 0.7 s (batch 4 at 0.8 s), 1.4 s (batch 7), and always at the last batch
    assert decisions == [True, False, False, True, False, False, True, True]
    unthrottled = ThrottledProgressBar(min_interval_s=0.0, clock=lambda: 0.0)
    assert all(unthrottled.due(b, 8) for b in range(1, 9))
    with pytest.raises(ValueError, match="min_interval_s"):
        ThrottledProgressBar(min_interval_s=-1)


def _tensorboard(log_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0, "images": 0})
    acc.Reload()
    return acc


def test_a_run_reports_itself_on_the_terminal_and_in_tensorboard(tmp_path, capsys, caplog):
    from tensorboard.plugins.custom_scalar import layout_pb2
    from tensorboard.util import tensor_util

    trainer = measured_trainer(tmp_path)
    trainer.callbacks.insert(0, FlopsModelSummary())
    with caplog.at_level("INFO", logger="lightning.pytorch.callbacks.model_summary"):
        trainer.fit(small_model(), small_data())
    log_dir = Path(trainer.logger.log_dir)
    record = read_record(log_dir / "record.json")

    # Lightning's layer table, with the FLOPs the step probe counts (it printed "0 Total Flops"), as FLOP counts
    # (Lightning's "3.7 B" read like bytes).
    flops = flop_count(record["flops"]["flops_per_micro_batch"])
    assert flops.endswith(" GFLOP")
    assert f"{flops} Training FLOPs per micro-batch (forward + backward)" in caplog.text
    assert re.search(r"\| net +\| SmallCNN +\| 576 K +\| train \| \d[.\d]* GFLOP", caplog.text)

    # The end-of-run summary: after the run, with the record's figures and where things went.
    out = capsys.readouterr().out
    summary = out[out.index("Run " + record["run_id"]):]
    timing, mem, fl = record["timing"], record["memory"], record["flops"]
    assert ("technique   32-true, micro-batch 8 × accumulate 1, checkpointing off, single_device ×1, "
            "AdamW for-loop") in summary
    assert f"median {sig(timing['step_time_median_ms'])} ms, p90 {sig(timing['step_time_p90_ms'])}" in summary
    assert f"throughput  {sig(timing['samples_per_s'])} samples/s" in summary
    parts = {k: v for k, v in mem["anatomy_mib"].items() if k not in ("total", "inputs") and v}
    top = sorted(parts, key=parts.get, reverse=True)[:3]
    named = ", ".join(f"{k.replace('_', ' ')} {sig(parts[k])}" for k in top)
    assert f"peak {sig(mem['peak_allocated_mib'])} MiB (mem-tracker): {named}; the data, " in summary
    assert f"epoch       {duration(timing['epoch_time_s'])} (6 steps and 1 validation, " in summary
    assert f"MFU         {pct(fl['mfu'])} of 0.100 TFLOP/s (config: " in summary
    assert f"record      {log_dir / 'record.json'}" in summary
    assert f"tensorboard uv run tensorboard --logdir {log_dir}   then open http://localhost:6006/?smoothing=0" \
        in summary

    # TensorBoard: perf/ and mem/ grouped in a custom-scalars layout, the anatomy as a figure and a table.
    acc = _tensorboard(log_dir)
    (event,) = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(tensor_util.make_ndarray(event.tensor_proto).item())
    charts = {c.title: list(c.multiline.tag) for cat in layout.category for c in cat.chart}
    assert {cat.title for cat in layout.category} >= {"perf", "mem"}
    assert charts["step time (ms)"][0] == "perf/step_time_ms" and charts["MFU"] == ["perf/mfu"]
    assert "mem/process_rss_peak_mib" in charts["peak (MiB)"]
    assert [e.step for e in acc.Images("mem/anatomy")] == [mem["anatomy_step"]] == [2], "at the captured step"
    (table,) = acc.Tensors("mem/anatomy/text_summary")
    text = tensor_util.make_ndarray(table.tensor_proto).item().decode()
    assert f"| activations | {mem['anatomy_mib']['activations']:.1f} |" in text
    assert f"| (the data: inputs, not in the peak) | {mem['anatomy_mib']['inputs']:.1f} |" in text
    (figures,) = acc.Tensors("run/figures/text_summary")
    text = tensor_util.make_ndarray(figures.tensor_proto).item().decode()
    assert f"| step time, median (ms) | {sig(timing['step_time_median_ms'])} |" in text


def test_records_get_normal_permissions(tmp_path):
    trainer = measured_trainer(tmp_path, max_steps=3)
    trainer.fit(small_model(), small_data())
    assert os.stat(Path(trainer.logger.log_dir) / "record.json").st_mode & 0o777 == 0o644  # was 0600


def test_fast_dev_run_writes_nothing_in_the_working_directory(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "cwd"
    run_dir.mkdir()
    monkeypatch.chdir(run_dir)
    monkeypatch.setenv("MODELWRIGHT_CACHE_DIR", str(tmp_path / "cache"))
    args = ["fit", "--trainer.fast_dev_run=1", "--trainer.enable_progress_bar=false", "--model.network=SmallCNN",
            "--model.scheduler=none", "--data.batch_size=4", "--data.train_size=16", "--data.val_size=4"]
    assert cli_main(args) == 0
    assert sorted(p.name for p in run_dir.rglob("*")) == []  # was checkpoints/last.ckpt and record.json
    assert "record      not written (fast_dev_run)" in capsys.readouterr().out


def test_noise_nobody_can_act_on_is_silenced_at_its_source_and_only_there(caplog):
    from lightning.pytorch.utilities._pytree import _tree_flatten

    log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    saved = log.filters[:]
    try:
        log.filters.clear()
        for quiet in (False, True):
            if quiet:
                quiet_lightning()
            caplog.clear()
            with caplog.at_level("INFO", logger="lightning.pytorch.utilities.rank_zero"), warnings.catch_warnings(
                record=True
            ) as caught:
                warnings.simplefilter("always")
                if quiet:
                    quiet_lightning()  # inside catch_warnings, which restores the filters after
                pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
                _tree_flatten(1)  # Lightning's use of torch's deprecated LeafSpec
                warnings.warn("a warning of our own", UserWarning, stacklevel=1)
            assert ("💡 Tip" in caplog.text) is not quiet
            assert "GPU available" in caplog.text  # Lightning's other messages stay
            messages = [str(w.message) for w in caught]
            assert any("LeafSpec" in m for m in messages) is not quiet
            assert "a warning of our own" in messages
    finally:
        log.filters[:] = saved


def _captured_with_validation_every(tmp_path: Path, interval: int | float) -> dict:
    """Accumulation 2, batches of 4: 12 micro-batches, 6 steps; step 1 (micro-batches 2 and 3) is captured."""
    trainer = measured_trainer(tmp_path, warmup=1, accumulate_grad_batches=2, val_check_interval=interval,
                               limit_val_batches=2)
    trainer.fit(small_model(), small_data(batch_size=4, train_size=48))
    return read_record(Path(trainer.logger.log_dir) / "record.json")


def test_a_validation_inside_the_captured_step_stays_out_of_the_capture(tmp_path):
    """A validation after micro-batch 2, the first of the captured step, used to end the fit with MemTracker's
    "multiple iterative calls" error; paused, it leaves the anatomy exactly as without it."""
    inside = _captured_with_validation_every(tmp_path / "inside", 3)  # after micro-batches 2, 5, 8 and 11
    after = _captured_with_validation_every(tmp_path / "after", 1.0)  # at the epoch's end only
    assert inside["status"] == "ok" and inside["memory"]["anatomy_step"] == 1
    step_memory = {k: v for k, v in inside["memory"]["anatomy_mib"].items() if k != "inputs"}  # inputs: not the step's
    assert step_memory == {k: after["memory"]["anatomy_mib"][k] for k in step_memory}, "an evaluation entered it"
    assert inside["memory"]["anatomy_caveat"] is None
    # Step 4 (micro-batches 8 and 9) holds the third validation: it is not timed.
    assert inside["timing"]["measured_steps"] == 3 and after["timing"]["measured_steps"] == 4
    assert inside["timing"]["epoch_validations"] == 4 and after["timing"]["epoch_validations"] == 1
    assert torch._C._len_torch_dispatch_stack() == 0


def test_the_summary_warns_when_the_cores_were_shared():
    """A contended machine once inflated the main job's steps 45× without a word: below 0.8 of their threads'
    CPU time, a CPU run's measured steps are flagged."""
    from modelwright.report.run_summary import contention, summary_lines

    record = {"run_id": "r", "status": "ok", "hardware": {"accelerator": "cpu"},
              "timing": {"step_cpu_utilization": 0.45}}
    assert "got 45% of their threads' CPU time" in contention(record)
    assert any(line.startswith("  warning     the measured steps got 45%") for line in summary_lines(record, "r.json",
                                                                                                 None))
    for quiet in ({**record, "timing": {"step_cpu_utilization": 0.95}}, {**record, "hardware": {"accelerator": "cuda"}},
                  {**record, "timing": {}}):
        assert contention(quiet) is None
