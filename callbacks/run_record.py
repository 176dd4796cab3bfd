"""One JSON record per run (:func:`modelwright.record.build_record`), and what the run tells its user.

YAML (``trainer.callbacks``)::

    - class_path: callbacks.run_record.RunRecord
      init_args: {record_path: null, records_jsonl: null}

At the end of ``fit`` the record is assembled from the sections every :class:`~callbacks._glue.Measurement`
callback contributes (``docs/record-schema.md``) and written by global rank 0 only; rank 0 then prints a
short summary and puts it, with the memory anatomy as a figure, into the TensorBoard run. A fit that raises
still leaves a record, with status ``failed``, ``oom``, ``interrupted`` or ``diverged`` and the error.
A ``fast_dev_run`` writes nothing: its logger is a dummy and its figures are not results.
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

from callbacks import _summary
from callbacks._glue import batch_size_of, log_every, measurements, quiet_lightning, unwrap_net
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
from modelwright.record import METRIC_KEYS, append_record, build_record, to_jsonable, write_record

try:
    from modelwright.train.models import checkpointed_modules
except ImportError:  # an older package: count the modules whose forward was replaced on the instance
    def checkpointed_modules(net: torch.nn.Module) -> list[torch.nn.Module]:
        return [m for m in net.modules() if "forward" in m.__dict__]

_STRATEGY_NAMES = {"SingleDeviceStrategy": "single_device", "DDPStrategy": "ddp", "FSDPStrategy": "fsdp",
                   "ModelParallelStrategy": "model_parallel", "DeepSpeedStrategy": "deepspeed",
                   "SingleDeviceXLAStrategy": "single_xla", "XLAStrategy": "xla"}


class RunRecord(Callback):
    """Writes the run record at the end of ``fit`` (or when it fails), then reports the run.

    Args:
        record_path: where to write the record; ``{log_dir}`` and ``{run_id}`` are filled in.
            Default ``{log_dir}/record.json`` (the logger's version folder).
        records_jsonl: also append the record as one line to this ``.jsonl`` file (same placeholders).
        run_id: the run's id; default ``$MODELWRIGHT_RUN_ID``, else time + random suffix.
        history: keep ``train/*`` every logging step and ``val/*`` every validation in ``history``.
        log_every_n_steps: how often ``train/*`` enters the history; default the Trainer's.
        summary: print the summary on rank 0 and write it, with the anatomy figure, to TensorBoard.
    """

    def __init__(
        self,
        record_path: str | None = None,
        records_jsonl: str | None = None,
        run_id: str | None = None,
        history: bool = True,
        log_every_n_steps: int | None = None,
        summary: bool = True,
    ) -> None:
        super().__init__()
        quiet_lightning()  # before the Trainer exists: its adverts come from its constructor
        self.record_path, self.records_jsonl, self.run_id = record_path, records_jsonl, run_id
        self.history, self.log_every_n_steps, self.summary = history, log_every_n_steps, summary
        self.record: dict[str, Any] | None = None
        self.written_to: Path | None = None
        self.summary_lines: list[str] = []
        self._history: dict[str, list[list[float]]] = {}
        self._cycle = StepCycle()
        self._micro_batch_size: int | None = None
        self._t0: float | None = None
        self._every = 1
        self._done = False

    # -- collecting ------------------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t0, self._done, self._history, self._cycle = time.perf_counter(), False, {}, StepCycle()
        self._every = log_every(trainer, self.log_every_n_steps)
        self.run_id = self.run_id or os.environ.get("MODELWRIGHT_RUN_ID") or None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.summary and trainer.is_global_zero:
            for writer in _summary.tensorboards(trainer.loggers):
                writer.add_custom_scalars(_summary.LAYOUT)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._cycle.begin(trainer.global_step)
        self._micro_batch_size = self._micro_batch_size or batch_size_of(batch)

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

    # -- finishing -------------------------------------------------------------------------------

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loss = _scalar(trainer.callback_metrics.get("train/loss"))
        if loss is not None and not math.isfinite(loss):
            self._finish(trainer, pl_module, "diverged", f"train/loss is {loss} at step {trainer.global_step}")
        else:
            self._finish(trainer, pl_module, "ok", None)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if trainer.state.fn == "fit":  # a failing validate / test run is not a training run
            self._finish(trainer, pl_module, error_status(exception), one_line_error(exception))

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

    def _write(self, trainer: pl.Trainer, record: dict[str, Any]) -> None:
        log_dir = None if trainer.fast_dev_run else _log_dir(trainer)
        if log_dir is not None:
            fill = {"log_dir": log_dir, "run_id": record["run_id"]}
            self.written_to = write_record(Path((self.record_path or "{log_dir}/record.json").format(**fill)), record)
            if self.records_jsonl:
                append_record(Path(self.records_jsonl.format(**fill)), record)
        if not self.summary:
            return
        tensorboards = _summary.tensorboards(trainer.loggers)
        tb_dir = _summary.relative(_log_dir(trainer)) if tensorboards else None
        self.summary_lines = _summary.summary_lines(record, _summary.relative(self.written_to), tb_dir)
        _summary.write_tensorboard(tensorboards, record, self.summary_lines, trainer.global_step)
        print("\n" + "\n".join(self.summary_lines), flush=True)  # after the progress bar closed (on_train_end)

    # -- assembling ------------------------------------------------------------------------------

    def build(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, status: str = "ok", error: str | None = None
    ) -> dict[str, Any]:
        """The record of this run as it stands (JSON-ready, validated when written)."""
        sections: dict[str, dict] = {}
        for m in measurements(trainer):
            for name, values in m.record_sections(trainer, pl_module).items():
                sections[name] = {**sections.get(name, {}), **values}
        if (sections.get("faults") or {}).get("diverged"):
            status = "diverged"
        config = _resolved_config(trainer, pl_module)
        timing = sections.pop("timing", {})
        if self._t0 is not None:
            timing["wall_time_s"] = time.perf_counter() - self._t0
        net = unwrap_net(pl_module)
        memory = {**sections.pop("memory", {}), "model_parameters": sum(p.numel() for p in net.parameters())}
        metrics = {k: _scalar(v) for k, v in trainer.callback_metrics.items() if not k.startswith(("perf/", "mem/"))}
        record = build_record(
            loop="lightning", status=status, error=error, run_id=self.run_id, config=config,
            techniques=_techniques(trainer, pl_module, config, self._micro_batch_size),
            hardware=hardware_info(pl_module.device, num_devices=trainer.num_devices), versions=versions(),
            timing=timing, memory=memory, metrics={**dict.fromkeys(METRIC_KEYS), **metrics},
            history={k: list(v) for k, v in self._history.items()}, **sections,
        )
        self.run_id = record["run_id"]  # the same id for a record rebuilt after an error
        return record


def _log_dir(trainer: pl.Trainer) -> str:
    """``trainer.log_dir`` without its broadcast: this runs on rank 0 alone, where a collective would hang."""
    logger = trainer.logger
    if logger is None:
        return trainer.default_root_dir
    return getattr(logger, "log_dir", None) or logger.save_dir or trainer.default_root_dir


def _scalar(value: Any) -> float | None:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().item()) if value.numel() == 1 else None
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def _portable(value: Any, cwd: str) -> Any:
    """The config without jsonargparse's ``__`` keys, paths inside the working directory made relative:
    records are committed and compared across machines and must not name this machine's folders."""
    if isinstance(value, dict):
        return {k: _portable(v, cwd) for k, v in value.items() if not str(k).startswith("__")}
    if isinstance(value, list):
        return [_portable(v, cwd) for v in value]
    return value[len(cwd):] if isinstance(value, str) and value.startswith(cwd) else value


def _resolved_config(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """LightningCLI's resolved config (from its SaveConfigCallback), else the hyperparameters."""
    from lightning.pytorch.cli import SaveConfigCallback

    saver = next((cb for cb in trainer.callbacks if isinstance(cb, SaveConfigCallback)), None)
    config = to_jsonable(saver.config) if saver is not None and getattr(saver, "config", None) is not None else None
    if isinstance(config, dict):
        return _portable(config, os.getcwd() + os.sep)
    config = {"model": to_jsonable(dict(pl_module.hparams))}
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is not None and hasattr(datamodule, "hparams"):
        config["data"] = to_jsonable(dict(datamodule.hparams))
    return config


def _techniques(
    trainer: pl.Trainer, pl_module: pl.LightningModule, config: dict[str, Any], micro: int | None
) -> dict[str, Any]:
    hp = dict(pl_module.hparams)
    net = unwrap_net(pl_module)
    trainer_cfg = config.get("trainer")
    requested = trainer_cfg.get("precision") if isinstance(trainer_cfg, dict) else None
    accumulate = trainer.accumulate_grad_batches
    strategy = type(trainer.strategy).__name__
    channels_last = channels_last_applied(net)
    return {
        "model_name": hp.get("model_name"),
        "precision": str(trainer.precision),
        "precision_requested": None if requested is None else str(requested),
        "accumulate_grad_batches": accumulate,
        "gradient_checkpointing": hp.get("gradient_checkpointing"),
        "checkpointed_segments": len(checkpointed_modules(net)),
        "optimizer": hp.get("optimizer"),
        "optimizer_impl": optimizer_impl(trainer.optimizers[0]) if trainer.optimizers else None,
        "channels_last": channels_last if channels_last is not None else hp.get("channels_last"),
        "compile": is_compiled(net),
        "strategy": _STRATEGY_NAMES.get(strategy, strategy.removesuffix("Strategy").lower()),
        "strategy_class": strategy,
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "micro_batch_size": micro,
        "effective_batch_size": micro * accumulate * trainer.world_size if micro else None,
    }
