"""One JSON record per run: config, techniques as applied, hardware, versions, measurements, metrics.

YAML (``trainer.callbacks``)::

    - class_path: callbacks.run_record.RunRecord
      init_args: {record_path: null, records_jsonl: null}

The record follows :data:`modelwright.record.SCHEMA` (``docs/record-schema.md``). It is assembled at
the end of ``fit`` from the measurement callbacks found in ``trainer.callbacks``
(:class:`StepTimeMonitor`, :class:`MemoryMonitor`, :class:`FlopsMonitor`; sections of absent ones
stay null) and written by global rank 0 only. A fit that raises still leaves a record, with status
``failed``, ``oom`` or ``interrupted`` and the error; a fit whose final loss is not finite ends
``diverged``.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from callbacks._glue import batch_size_of, find_callback, log_every, unwrap_net
from callbacks.flops_monitor import FlopsMonitor
from callbacks.memory_monitor import MemoryMonitor
from callbacks.step_timer import StepTimeMonitor
from modelwright.measure import (
    StepCycle,
    channels_last_applied,
    error_status,
    hardware_info,
    is_compiled,
    one_line_error,
    optimizer_impl,
    versions,
)
from modelwright.record import METRIC_KEYS, append_record, new_record, to_jsonable, write_record

_STRATEGY_NAMES = {
    "SingleDeviceStrategy": "single_device",
    "DDPStrategy": "ddp",
    "FSDPStrategy": "fsdp",
    "ModelParallelStrategy": "model_parallel",
    "DeepSpeedStrategy": "deepspeed",
    "SingleDeviceXLAStrategy": "single_xla",
    "XLAStrategy": "xla",
}


class RunRecord(Callback):
    """Writes the run record at the end of ``fit`` (or when it fails).

    Args:
        record_path: where to write the record; ``{log_dir}`` and ``{run_id}`` are filled in.
            Default ``{log_dir}/record.json`` (the logger's version folder).
        records_jsonl: also append the record as one line to this ``.jsonl`` file (same placeholders).
        run_id: the run's id; default ``$MODELWRIGHT_RUN_ID``, else time + random suffix.
        history: keep ``train/*`` every logging step and ``val/*`` every validation in ``history``.
        log_every_n_steps: how often ``train/*`` enters the history; default the Trainer's.
    """

    def __init__(
        self,
        record_path: str | None = None,
        records_jsonl: str | None = None,
        run_id: str | None = None,
        history: bool = True,
        log_every_n_steps: int | None = None,
    ) -> None:
        super().__init__()
        self.record_path = record_path
        self.records_jsonl = records_jsonl
        self.run_id = run_id
        self.history = history
        self.log_every_n_steps = log_every_n_steps
        self.record: dict[str, Any] | None = None
        self.written_to: Path | None = None
        self._history: dict[str, list[list[float]]] = {}
        self._cycle = StepCycle()
        self._micro_batch_size: int | None = None
        self._t0: float | None = None
        self._every = 1
        self._done = False
        self._run_id: str | None = None

    # -- collecting ------------------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t0 = time.perf_counter()
        self._done = False
        self._run_id = None
        self._history = {}
        self._cycle = StepCycle()
        self._every = log_every(trainer, self.log_every_n_steps)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._cycle.begin(trainer.global_step)
        if self._micro_batch_size is None:
            self._micro_batch_size = batch_size_of(batch)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._cycle.end(trainer.global_step) and self.history and trainer.global_step % self._every == 0:
            self._remember(trainer, "train/")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.history and not trainer.sanity_checking:
            self._remember(trainer, "val/")

    def _remember(self, trainer: pl.Trainer, prefix: str) -> None:
        metrics = trainer.callback_metrics
        for key in METRIC_KEYS:
            if key.startswith(prefix) and key in metrics:
                self._history.setdefault(key, []).append([trainer.global_step, _scalar(metrics[key])])

    # -- writing ---------------------------------------------------------------------------------

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loss = _scalar(trainer.callback_metrics.get("train/loss"))
        if loss is not None and not math.isfinite(loss):
            self._finish(trainer, pl_module, "diverged", f"train/loss is {loss} at step {trainer.global_step}")
        elif _fault_guard(trainer) is not None and _fault_guard(trainer).diverged:
            self._finish(trainer, pl_module, "diverged", "stopped by a non-finite training loss")
        else:
            self._finish(trainer, pl_module, "ok", None)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if trainer.state.fn != "fit":  # a failing validate / test run is not a training run
            return
        guard = _fault_guard(trainer)
        status = "diverged" if guard is not None and guard.diverged else error_status(exception)
        self._finish(trainer, pl_module, status, one_line_error(exception))

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule, status: str, error: str | None) -> None:
        if self._done:
            return
        self._done = True
        try:
            self.record = self.build(trainer, pl_module, status, error)
            if trainer.is_global_zero:
                self._write(trainer, self.record)
        except Exception as err:  # a failing record must not hide the run's own outcome
            if status == "ok":
                raise
            warnings.warn(f"RunRecord: could not write the record of a {status} run: {err}", stacklevel=2)

    def _paths(self, trainer: pl.Trainer, run_id: str) -> tuple[Path, Path | None]:
        log_dir = _log_dir(trainer)
        fill = {"log_dir": log_dir, "run_id": run_id}
        record_path = Path((self.record_path or "{log_dir}/record.json").format(**fill))
        jsonl = Path(self.records_jsonl.format(**fill)) if self.records_jsonl else None
        return record_path, jsonl

    def _write(self, trainer: pl.Trainer, record: dict[str, Any]) -> None:
        record_path, jsonl = self._paths(trainer, record["run_id"])
        self.written_to = write_record(record_path, record)
        if jsonl is not None:
            append_record(jsonl, record)

    # -- assembling ------------------------------------------------------------------------------

    def build(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, status: str = "ok", error: str | None = None
    ) -> dict[str, Any]:
        """The record of this run as it stands (JSON-ready, not yet validated)."""
        self._run_id = self._run_id or self.run_id or os.environ.get("MODELWRIGHT_RUN_ID") or None
        record = new_record(run_id=self._run_id, loop="lightning")
        self._run_id = record["run_id"]
        record["status"], record["error"] = status, error
        config = _resolved_config(trainer, pl_module)
        record["config"] = config
        timer = find_callback(trainer, StepTimeMonitor)
        memory = find_callback(trainer, MemoryMonitor)
        flops = find_callback(trainer, FlopsMonitor)

        micro = (timer.micro_batch_size if timer else None) or self._micro_batch_size
        record["techniques"] = _techniques(trainer, pl_module, config, micro)
        record["hardware"] = hardware_info(pl_module.device, num_devices=trainer.num_devices)
        record["versions"] = versions()

        timing = record["timing"]
        if timer is not None:
            timing.update(timer.summary(trainer))
        if self._t0 is not None:
            timing["wall_time_s"] = time.perf_counter() - self._t0
        median_s = timing["step_time_median_ms"] / 1e3 if timing.get("step_time_median_ms") else None
        if flops is not None:
            record["flops"].update(flops.summary(median_s))
        if memory is not None:
            record["memory"].update(memory.summary())
        net = unwrap_net(pl_module)
        record["memory"]["model_parameters"] = sum(p.numel() for p in net.parameters())

        metrics = {k: _scalar(v) for k, v in trainer.callback_metrics.items() if not k.startswith(("perf/", "mem/"))}
        record["metrics"] = {**dict.fromkeys(METRIC_KEYS), **metrics}
        record["history"] = {k: list(v) for k, v in self._history.items()}
        guard = _fault_guard(trainer)
        if guard is not None:
            record["faults"] = guard.summary()
        return to_jsonable(record)


def _fault_guard(trainer: pl.Trainer) -> Any:
    """The callback that watches for non-finite losses (``callbacks.fault_tolerance.NonFiniteLossGuard``).

    Duck-typed (a ``diverged`` flag and a ``summary()``), so that this file does not depend on that one.
    """
    return next(
        (cb for cb in trainer.callbacks if isinstance(getattr(cb, "diverged", None), bool) and hasattr(cb, "summary")),
        None,
    )


def _log_dir(trainer: pl.Trainer) -> str:
    """``trainer.log_dir`` without its broadcast: this runs on rank 0 alone, where a collective would hang."""
    logger = trainer.logger
    if logger is None:
        return trainer.default_root_dir
    return getattr(logger, "log_dir", None) or logger.save_dir or trainer.default_root_dir


def _scalar(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().item()) if value.numel() == 1 else None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _portable(config: dict[str, Any]) -> dict[str, Any]:
    """The config without jsonargparse's bookkeeping keys, paths inside the working directory made relative.

    Records are committed and compared across machines: they must not name this machine's folders.
    """
    cwd = os.getcwd() + os.sep

    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if not str(k).startswith("__")}
        if isinstance(value, list):
            return [clean(v) for v in value]
        if isinstance(value, str) and value.startswith(cwd):
            return value[len(cwd):]
        return value

    return clean(config)


def _resolved_config(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """LightningCLI's resolved config (from its SaveConfigCallback), else the hyperparameters."""
    try:
        from lightning.pytorch.cli import SaveConfigCallback
    except ImportError:  # jsonargparse missing
        SaveConfigCallback = None  # noqa: N806
    if SaveConfigCallback is not None:
        saver = find_callback(trainer, SaveConfigCallback)
        if saver is not None and getattr(saver, "config", None) is not None:
            config = to_jsonable(saver.config)
            if isinstance(config, dict):
                return _portable(config)
    config: dict[str, Any] = {"model": to_jsonable(dict(pl_module.hparams))}
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is not None and hasattr(datamodule, "hparams"):
        config["data"] = to_jsonable(dict(datamodule.hparams))
    return config


def _techniques(
    trainer: pl.Trainer, pl_module: pl.LightningModule, config: dict[str, Any], micro: int | None
) -> dict[str, Any]:
    hp = dict(pl_module.hparams)
    net = unwrap_net(pl_module)
    trainer_cfg = config.get("trainer") if isinstance(config.get("trainer"), dict) else {}
    requested = trainer_cfg.get("precision")
    accumulate = trainer.accumulate_grad_batches
    strategy = type(trainer.strategy).__name__
    optimizers = trainer.optimizers
    channels_last = channels_last_applied(net)
    compiled = is_compiled(net)
    checkpointed = sum(1 for m in net.modules() if "forward" in m.__dict__)
    return {
        "model_name": hp.get("model_name"),
        "precision": str(trainer.precision),
        "precision_requested": None if requested is None else str(requested),
        "accumulate_grad_batches": accumulate,
        "gradient_checkpointing": hp.get("gradient_checkpointing"),
        "checkpointed_segments": checkpointed,
        "optimizer": hp.get("optimizer"),
        "optimizer_impl": optimizer_impl(optimizers[0]) if optimizers else None,
        "channels_last": channels_last if channels_last is not None else hp.get("channels_last"),
        "compile": compiled,
        "strategy": _STRATEGY_NAMES.get(strategy, strategy.removesuffix("Strategy").lower()),
        "strategy_class": strategy,
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "micro_batch_size": micro,
        "effective_batch_size": micro * accumulate * trainer.world_size if micro else None,
    }
