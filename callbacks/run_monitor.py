"""The run's measurements and its record: Lightning's hooks forwarded to one
:class:`~modelwright.measure.StepProbe` (time, memory and its anatomy, FLOPs and MFU, whole epochs, non-finite
losses), ``perf/*`` and ``mem/*`` in TensorBoard, and one JSON record per run (docs/record-schema.md), written
by global rank 0 with status ``running`` when training starts and replaced, atomically, when it ends (``ok``,
``failed``, ``oom``, ``interrupted``, ``diverged``). A ``fast_dev_run`` writes no record. Lightning's
``ThroughputMonitor`` has the same split: a neutral core, hooks that only forward."""

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException

from callbacks import _lightning
from callbacks._glue import log_every, log_scalars, quiet_lightning, unwrap_net
from modelwright import measure, techniques
from modelwright.record import (
    METRIC_KEYS,
    append_record,
    build_record,
    provenance,
    remove_stale_temp_files,
    to_jsonable,
    write_record,
)
from modelwright.report.run_summary import summary_lines, write_tensorboard

# Others: the class name less "Strategy", lower case.
_STRATEGY_NAMES = {"SingleDeviceStrategy": "single_device", "ModelParallelStrategy": "model_parallel",
                   "SingleDeviceXLAStrategy": "single_xla"}
# TensorBoard's custom-scalars tab: {category: {chart: ["Multiline", [tag regex, ...]]}}
_LAYOUT = {
    "perf": {"step time (ms)": ["Multiline", ["perf/step_time_ms"]],
             "throughput (samples/s)": ["Multiline", ["perf/samples_per_s"]],
             "MFU": ["Multiline", ["perf/mfu"]]},
    "mem": {"peak (MiB)": ["Multiline", ["mem/peak_(allocated|reserved)_mib", "mem/process_rss_peak_mib"]]},
    "train / val": {"loss": ["Multiline", ["(train|val)/loss"]],
                    "accuracy": ["Multiline", ["(train|val)/acc"]]},
}


class RunMonitor(Callback):
    """Measures every optimizer step of the fit and writes its record.

    Args:
        warmup_steps: first optimizer steps not measured (allocator, cuDNN and compile warm-up).
        measure_steps: steps measured after the warm-up; ``None`` measures until the end of the fit.
        anatomy: capture where the memory of one step goes (that step is not timed).
        anatomy_step: the optimizer step to capture (0-based); default the first after the warm-up.
        cuda_timing: on CUDA, ``events`` (no host stall per step) or ``synchronize`` (before each clock
            reading).
        peak_flops_per_s: peak FLOP/s of one device in the run's compute dtype, for MFU; ``None``: the
            hardware's.
        on_nonfinite: a non-finite training loss ``stop``s the run (record: ``diverged``) or ``skip``s its
            step (no weight, optimizer state or BatchNorm statistic changes; counted).
        max_skipped_steps: with ``skip``, stop once more than this many steps were skipped; ``None``: never.
        record_path: where to write the record; ``{log_dir}`` and ``{run_id}`` are filled in (default
            ``{log_dir}/record.json``, the logger's version folder).
        records_jsonl: also append the final record as one line to this ``.jsonl`` file (same placeholders).
        run_id: the run's id; default ``$MODELWRIGHT_RUN_ID``, else time + random suffix.
        history: keep ``train/*`` every logging step and ``val/*`` every validation in the record's
            ``history``.
        log_every_n_steps: how often ``perf/*``, ``mem/*`` and the history are logged; default the Trainer's.
        summary: print the summary on rank 0 and put it, with the anatomy figure, into TensorBoard.
    """

    def __init__(self, warmup_steps: int = 2, measure_steps: int | None = None, anatomy: bool = True,
                 anatomy_step: int | None = None, cuda_timing: Literal["events", "synchronize"] = "events",
                 peak_flops_per_s: float | None = None, on_nonfinite: Literal["stop", "skip"] = "stop",
                 max_skipped_steps: int | None = None, record_path: str | None = None,
                 records_jsonl: str | None = None, run_id: str | None = None, history: bool = True,
                 log_every_n_steps: int | None = None, summary: bool = True) -> None:
        super().__init__()
        quiet_lightning()  # before the Trainer exists: its adverts come from its constructor
        if log_every_n_steps is not None and log_every_n_steps < 1:  # 0 once logged every step unsaid
            raise ValueError(f"log_every_n_steps: must be >= 1 or null, got {log_every_n_steps}")
        self.probe = measure.StepProbe(warmup_steps, measure_steps, anatomy, anatomy_step, cuda_timing,
                                       peak_flops_per_s, on_nonfinite, max_skipped_steps)
        self.record_path = record_path
        self.records_jsonl = records_jsonl
        self.run_id = run_id
        self.history = history
        self.log_every_n_steps = log_every_n_steps
        self.summary = summary
        self.record: dict[str, Any] | None = None
        self.written_to: Path | None = None
        self._history: dict[str, list[list[float]]] = {}  # metric: [[step, value], ...]
        self._every = 1
        self._evaluation: contextlib.ExitStack | None = None
        self._done = False
        self._fixed: dict[str, Any] | None = None  # the sections no write changes (_fixed_sections)

    # --- the fit's life -------------------------------------------------------------------------------------

    def setup(self, trainer, pl_module, stage) -> None:
        if stage == "fit":
            self.probe.prepare(unwrap_net(pl_module))  # before a strategy shards the network

    def on_fit_start(self, trainer, pl_module) -> None:
        self._done = False
        self._history = {}
        self.written_to = None
        self._every = log_every(trainer, self.log_every_n_steps)
        self.run_id = self.run_id or os.environ.get("MODELWRIGHT_RUN_ID") or None

    def on_train_start(self, trainer, pl_module) -> None:
        self._fixed = None  # read again now that the network is on its device
        dataset = getattr(getattr(trainer, "train_dataloader", None), "dataset", None)
        self.probe.start(
            device=pl_module.device, precision=trainer.precision, modules=[pl_module],
            optimizers=trainer.optimizers,
            micro_batches_per_step=trainer.accumulate_grad_batches, world_size=trainer.world_size,
            first_step=trainer.global_step, main_process=trainer.is_global_zero,
            reduce=lambda value: trainer.strategy.reduce(value, reduce_op="sum"),
            grad_scale=lambda: _lightning.grad_scale(trainer), data=getattr(dataset, "tensors", ()),
            fallback_peak=get_available_flops)
        if trainer.is_global_zero and not trainer.fast_dev_run:
            for writer in _tensorboards(trainer) if self.summary else ():
                writer.add_custom_scalars(_LAYOUT)
            self._write_running(trainer, pl_module)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.probe.epoch_begins()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.probe.epoch_ends(expected_steps=_steps_per_epoch(trainer))
        self._write_running(trainer, pl_module)

    # --- the step cycle -------------------------------------------------------------------------------------

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.probe.before_micro_batch(trainer.global_step, batch)

    def on_before_backward(self, trainer, pl_module, loss) -> None:  # training only: validation has none
        self.probe.observe_loss(loss, trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.probe.before_update(optimizer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        reading = self.probe.after_micro_batch(trainer.global_step, self._every)
        # Lightning logs a step's train/* at its 0-based index when (index + 1) is a multiple of the interval.
        if reading is None or (reading.step + 1) % self._every:
            return
        log_scalars(trainer, reading.scalars, reading.step)
        if self.history:
            self._remember(trainer, "train/", reading.step)

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._evaluation = contextlib.ExitStack()
            self._evaluation.enter_context(self.probe.evaluating())

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._evaluation is not None:
            self._evaluation.close()
            self._evaluation = None
        if not trainer.sanity_checking:
            if self.history:
                self._remember(trainer, "val/", self.probe.cycle.step or 0)
            self._write_running(trainer, pl_module)

    def _remember(self, trainer: pl.Trainer, prefix: str, step: int) -> None:
        metrics = trainer.callback_metrics
        for key in METRIC_KEYS:
            if key.startswith(prefix) and key in metrics:
                self._history.setdefault(key, []).append([step, _scalar(metrics[key])])

    def on_fit_end(self, trainer, pl_module) -> None:
        self._finish(trainer, pl_module, "ok", None)

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self._evaluation is not None:
            self._evaluation.close()
            self._evaluation = None
        if trainer.state.fn == "fit":  # a failing validate / test run is not a training run
            status = measure.error_status(exception)
            self._finish(trainer, pl_module, status, _error_line(exception))
            # A stop every rank takes (SIGTERM, a non-finite loss): the other ranks wait for rank 0's record.
            every_rank = isinstance(exception, (SIGTERMException, measure.NonFiniteLossError))
            if trainer.world_size > 1 and every_rank:
                trainer.strategy.barrier("RunMonitor")

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule, status: str,
                error: str | None) -> None:
        if self._done:
            return
        self._done = True
        self.probe.stop()
        try:
            self.record = self.build(trainer, pl_module, status, error)
            if trainer.is_global_zero:
                self._write(trainer, self.record, final=True)
        except Exception as err:  # a failing record must not hide the run's own outcome
            if status == "ok":
                raise
            print(f"warning: RunMonitor could not write the record of a {status} run: {err}", file=sys.stderr)

    # --- the record -----------------------------------------------------------------------------------------

    def build(self, trainer: pl.Trainer, pl_module: pl.LightningModule, status: str = "ok",
              error: str | None = None) -> dict[str, Any]:
        """The record of this run as it stands (JSON-ready, validated when written)."""
        sections = self.probe.sections(_steps_per_epoch(trainer))
        if sections["faults"]["diverged"] and status not in ("running", "interrupted"):
            status = "diverged"
        config = _resolved_config(trainer, pl_module)
        requested = (config.get("trainer") or {}).get("precision")
        strategy = type(trainer.strategy).__name__
        loop = techniques.LoopFacts(
            precision=str(trainer.precision),
            precision_requested=None if requested is None else str(requested),
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            strategy=_STRATEGY_NAMES.get(strategy, strategy.removesuffix("Strategy").lower()),
            strategy_class=strategy, world_size=trainer.world_size, num_nodes=trainer.num_nodes)
        section = techniques.record_section(getattr(pl_module, "args", None), unwrap_net(pl_module), loop,
                                            sections.pop("techniques"))
        metrics = {key: _scalar(value) for key, value in trainer.callback_metrics.items()
                   if not key.startswith(("perf/", "mem/"))}
        history = {key: list(points) for key, points in self._history.items()}
        record = build_record(loop="lightning", status=status, error=error, run_id=self.run_id, config=config,
                              techniques=section, history=history, metrics=metrics,
                              **self._fixed_sections(trainer, pl_module), **sections)
        self.run_id = record["run_id"]  # the same id for the record rewritten at the end
        return record

    def _fixed_sections(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """The machine, the versions and the commit, read once a fit has started: the record is rewritten
        after every validation, inside the timed epoch, and the commit costs two git calls."""
        if self._fixed is None:
            hardware = measure.hardware_info(pl_module.device, num_devices=trainer.num_devices)
            self._fixed = {"hardware": hardware, "versions": measure.versions(), "provenance": provenance()}
        return self._fixed

    def _write_running(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The record so far, status ``running``: when training starts, after each validation and epoch. A run
        killed, even during its last write, leaves what it had measured."""
        if trainer.is_global_zero and not trainer.fast_dev_run and not self._done:
            self._write(trainer, self.build(trainer, pl_module, "running"), final=False)

    def _write(self, trainer: pl.Trainer, record: dict[str, Any], final: bool) -> None:
        log_dir = _log_dir(trainer)
        if not trainer.fast_dev_run:
            fill = {"log_dir": log_dir, "run_id": record["run_id"]}
            path = Path((self.record_path or "{log_dir}/record.json").format(**fill))
            if not final and self.written_to is None:  # the first write of this run
                remove_stale_temp_files(path)
                if trainer.ckpt_path:  # a kill during the resumed run's last write left one beside its record
                    remove_stale_temp_files(Path(trainer.ckpt_path).parent.parent / path.name)
            self.written_to = write_record(path, record)
            if final and self.records_jsonl:
                append_record(self.records_jsonl.format(**fill), record)
        if final and self.summary:
            self._report(trainer, record, log_dir)

    def _report(self, trainer: pl.Trainer, record: dict[str, Any], log_dir: str) -> None:
        """The summary on the terminal (after the progress bar closed) and in TensorBoard. A run that trained
        nothing leaves no TensorBoard events: TensorBoard would list it as a run."""
        writers = _tensorboards(trainer)
        lines = summary_lines(record, _portable(self.written_to), _portable(log_dir) if writers else None)
        print("\n" + "\n".join(lines), flush=True)
        if trainer.global_step == 0:
            for writer in writers:
                writer.close()
                for events in Path(writer.log_dir).glob("events.out.tfevents.*"):
                    events.unlink()
            return
        step = self.probe.captured_step if self.probe.captured_step is not None else trainer.global_step
        for writer in writers:
            write_tensorboard(writer, record, lines, step)

    def state_dict(self) -> dict[str, Any]:
        return {"faults": self.probe.watch.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "faults" in state_dict:
            self.probe.watch.load_state_dict(state_dict["faults"])


def _steps_per_epoch(trainer: pl.Trainer) -> int | None:
    batches = trainer.num_training_batches
    if batches is None or batches == float("inf"):
        return None
    return -(-int(batches) // trainer.accumulate_grad_batches)  # ceil: Lightning steps at a short epoch's end


def _resolved_config(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict:
    """LightningCLI's resolved config (from its SaveConfigCallback), else the hyperparameters."""
    saver = next((cb for cb in trainer.callbacks if isinstance(cb, SaveConfigCallback)), None)
    if saver is not None:
        return _portable(to_jsonable(saver.config))
    data = getattr(trainer.datamodule, "hparams", {})
    return _portable(to_jsonable({"model": pl_module.hparams, "data": data}))


def _error_line(exception: BaseException) -> str:
    if isinstance(exception, SIGTERMException):
        return "SIGTERMException: stopped by SIGTERM or Ctrl-C, with a checkpoint to resume from"
    return measure.one_line_error(exception)


def _log_dir(trainer: pl.Trainer) -> str:
    # trainer.log_dir without its broadcast: this runs on rank 0 alone, where a collective would hang.
    logger = trainer.logger
    return getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None) or trainer.default_root_dir


def _portable(value: Any, cwd: str | None = None) -> Any:
    """The config without jsonargparse's ``__`` keys, paths inside the working directory made relative:
    records are committed and compared across machines and must not name this machine's folders."""
    cwd = cwd or os.getcwd() + os.sep
    if isinstance(value, dict):
        return {k: _portable(v, cwd) for k, v in value.items() if not str(k).startswith("__")}
    if isinstance(value, list):
        return [_portable(v, cwd) for v in value]
    if isinstance(value, (str, Path)) and str(value).startswith(cwd):
        return str(value)[len(cwd):]
    return value


def _scalar(value: Any) -> float | None:  # a logged metric: a number or a one-element tensor
    return None if value is None else float(value)


def _tensorboards(trainer: pl.Trainer) -> list:
    return [logger.experiment for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]
