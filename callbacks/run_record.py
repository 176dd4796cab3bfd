"""One JSON record per run from every :class:`~callbacks._glue.Measurement`'s sections (docs/record-schema.md);
global rank 0 writes it, prints a summary and puts it, with the memory anatomy, into TensorBoard. A fit that raises
still leaves a record (``failed``, ``oom``, ``interrupted``, ``diverged``); a ``fast_dev_run`` writes none."""

import math
import os
import time
import warnings
from itertools import accumulate
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import TensorBoardLogger

from callbacks._glue import first_tensor, log_every, measurements, quiet_lightning, unwrap_net
from modelwright import measure
from modelwright.record import (
    ANATOMY_CATEGORIES,
    METRIC_KEYS,
    append_record,
    build_record,
    to_jsonable,
    write_record,
)
from modelwright.train.models import checkpointed_modules

_STRATEGY_NAMES = {"SingleDeviceStrategy": "single_device", "ModelParallelStrategy": "model_parallel",
                   "SingleDeviceXLAStrategy": "single_xla"}  # others: the class name less "Strategy", lower case
_LAYOUT = {  # TensorBoard's custom-scalars tab: {category: {chart: ["Multiline", [tag regex, ...]]}}
    "perf": {"step time (ms)": ["Multiline", ["perf/step_time_ms", "perf/step_time_(median|p90)_ms"]],
             "throughput (samples/s)": ["Multiline", ["perf/samples_per_s"]], "MFU": ["Multiline", ["perf/mfu"]]},
    "mem": {"peak (MiB)": ["Multiline", ["mem/peak_(allocated|reserved)_mib", "mem/process_rss_peak_mib"]]},
    "train / val": {"loss": ["Multiline", ["(train|val)/loss"]], "accuracy": ["Multiline", ["(train|val)/acc"]]},
}


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

    def __init__(self, record_path: str | None = None, records_jsonl: str | None = None, run_id: str | None = None,
                 history: bool = True, log_every_n_steps: int | None = None, summary: bool = True) -> None:
        super().__init__()
        quiet_lightning()  # before the Trainer exists: its adverts come from its constructor
        self.record_path, self.records_jsonl, self.run_id = record_path, records_jsonl, run_id
        self.history, self.log_every_n_steps, self.summary = history, log_every_n_steps, summary
        self.record: dict[str, Any] | None = None
        self.written_to = self._micro_batch_size = self._t0 = None  # the record.json; _t0: when the fit started
        self._history: dict[str, list[list[float]]] = {}  # metric: [[step, value], ...]
        self._cycle, self._every, self._done = measure.StepCycle(), 1, False

    def on_fit_start(self, trainer, pl_module) -> None:
        self._t0, self._done, self._history, self._cycle = time.perf_counter(), False, {}, measure.StepCycle()
        self._every = log_every(trainer, self.log_every_n_steps)
        self.run_id = self.run_id or os.environ.get("MODELWRIGHT_RUN_ID") or None

    def on_train_start(self, trainer, pl_module) -> None:
        for writer in _tensorboards(trainer) if self.summary and trainer.is_global_zero else ():
            writer.add_custom_scalars(_LAYOUT)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._cycle.begin(trainer.global_step)
        if self._micro_batch_size is None and (x := first_tensor(batch)) is not None:
            self._micro_batch_size = len(x)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._cycle.end(trainer.global_step) and self.history and trainer.global_step % self._every == 0:
            self._remember(trainer, "train/")

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.history and not trainer.sanity_checking:
            self._remember(trainer, "val/")

    def _remember(self, trainer: pl.Trainer, prefix: str) -> None:
        metrics = trainer.callback_metrics
        for key in METRIC_KEYS:
            if key.startswith(prefix) and key in metrics:
                self._history.setdefault(key, []).append([trainer.global_step, _scalar(metrics[key])])

    def on_fit_end(self, trainer, pl_module) -> None:
        loss = _scalar(trainer.callback_metrics.get("train/loss"))
        diverged = loss is not None and not math.isfinite(loss)
        error = f"train/loss is {loss} at step {trainer.global_step}" if diverged else None
        self._finish(trainer, pl_module, "diverged" if diverged else "ok", error)

    def on_exception(self, trainer, pl_module, exception) -> None:
        if trainer.state.fn == "fit":  # a failing validate / test run is not a training run
            self._finish(trainer, pl_module, measure.error_status(exception), measure.one_line_error(exception))

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
        # trainer.log_dir without its broadcast: this runs on rank 0 alone, where a collective would hang.
        log_dir = (getattr(trainer.logger, "log_dir", None) or getattr(trainer.logger, "save_dir", None)
                   or trainer.default_root_dir)
        if not trainer.fast_dev_run:
            fill = {"log_dir": log_dir, "run_id": record["run_id"]}
            self.written_to = write_record((self.record_path or "{log_dir}/record.json").format(**fill), record)
            if self.records_jsonl:
                append_record(self.records_jsonl.format(**fill), record)
        if self.summary:
            _report(record, _portable(self.written_to), _portable(log_dir), _tensorboards(trainer), trainer.global_step)

    def build(self, trainer, pl_module, status: str = "ok", error: str | None = None) -> dict[str, Any]:
        """The record of this run as it stands (JSON-ready, validated when written)."""
        hp, net, strategy = dict(pl_module.hparams), unwrap_net(pl_module), type(trainer.strategy).__name__
        sections = {"timing": {"wall_time_s": None if self._t0 is None else time.perf_counter() - self._t0},
                    "memory": {"model_parameters": sum(p.numel() for p in net.parameters())}}
        for m in measurements(trainer):
            for name, values in m.record_sections(trainer, pl_module).items():
                sections[name] = {**sections.get(name, {}), **values}
        if (sections.get("faults") or {}).get("diverged"):
            status = "diverged"
        # LightningCLI's resolved config (from its SaveConfigCallback), else the hyperparameters.
        saver = next((cb for cb in trainer.callbacks if isinstance(cb, SaveConfigCallback)), None)
        data = getattr(trainer.datamodule, "hparams", {})
        config = _portable(to_jsonable(saver.config if saver else {"model": pl_module.hparams, "data": data}))
        requested, channels_last = (config.get("trainer") or {}).get("precision"), measure.channels_last_applied(net)
        micro = self._micro_batch_size
        techniques = {
            "model_name": hp.get("model_name"), "optimizer": hp.get("optimizer"), "compile": measure.is_compiled(net),
            "precision": str(trainer.precision), "precision_requested": None if requested is None else str(requested),
            "gradient_checkpointing": hp.get("gradient_checkpointing"),
            "checkpointed_segments": len(checkpointed_modules(net)),
            "optimizer_impl": measure.optimizer_impl(trainer.optimizers[0]) if trainer.optimizers else None,
            "channels_last": channels_last if channels_last is not None else hp.get("channels_last"),
            "strategy": _STRATEGY_NAMES.get(strategy, strategy.removesuffix("Strategy").lower()),
            "strategy_class": strategy, "world_size": trainer.world_size, "num_nodes": trainer.num_nodes,
            "micro_batch_size": micro, "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "effective_batch_size": micro * trainer.accumulate_grad_batches * trainer.world_size if micro else None,
        }
        record = build_record(
            loop="lightning", status=status, error=error, run_id=self.run_id, config=config, techniques=techniques,
            hardware=measure.hardware_info(pl_module.device, num_devices=trainer.num_devices),
            versions=measure.versions(), history={k: list(v) for k, v in self._history.items()}, **sections,
            metrics={k: _scalar(v) for k, v in trainer.callback_metrics.items() if not k.startswith(("perf/", "mem/"))},
        )
        self.run_id = record["run_id"]  # the same id for a record rebuilt after an error
        return record


def _portable(value: Any, cwd: str | None = None) -> Any:
    """The config without jsonargparse's ``__`` keys, paths inside the working directory made relative:
    records are committed and compared across machines and must not name this machine's folders."""
    cwd = cwd or os.getcwd() + os.sep
    if isinstance(value, dict):
        return {k: _portable(v, cwd) for k, v in value.items() if not str(k).startswith("__")}
    if isinstance(value, list):
        return [_portable(v, cwd) for v in value]
    return str(value)[len(cwd):] if isinstance(value, (str, Path)) and str(value).startswith(cwd) else value


def _scalar(value: Any) -> float | None:  # a logged metric: a number or a one-element tensor
    return None if value is None else float(value)


def _tensorboards(trainer: pl.Trainer) -> list:
    return [lg.experiment for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]


def _report(record: dict[str, Any], record_path: str | None, log_dir: str, writers: list, step: int) -> None:
    """Prints the run's summary (after the progress bar closed, in on_train_end) and puts it into TensorBoard, with
    the memory anatomy as a table and as one stacked bar at the captured step's peak."""
    from modelwright.report.fmt import pct, sig

    tech, timing, flops, memory = (record.get(k) or {} for k in ("techniques", "timing", "flops", "memory"))
    rows = sorted(((k, v) for k, v in (memory.get("anatomy_mib") or {}).items() if k in ANATOMY_CATEGORIES and v),
                  key=lambda kv: -kv[1])
    top = ", ".join(f"{k} {sig(v)}" for k, v in rows[:3])
    peak_source = flops.get("peak_flops_source")
    lines = [
        f"technique   {tech.get('precision')}, micro-batch {tech.get('micro_batch_size')} x accumulate "
        f"{tech.get('accumulate_grad_batches')}, checkpointing {tech.get('gradient_checkpointing')}, "
        f"{tech.get('strategy')} x {tech.get('world_size')}",
        f"step time   median {sig(timing.get('step_time_median_ms'))} ms, p90 {sig(timing.get('step_time_p90_ms'))}, "
        f"min {sig(timing.get('step_time_min_ms'))}, max {sig(timing.get('step_time_max_ms'))} "
        f"({timing.get('measured_steps')} steps after {timing.get('warmup_steps')} warm-up)",
        f"throughput  {sig(timing.get('samples_per_s'))} samples/s",
        f"memory      peak {sig(memory.get('peak_allocated_mib'))} MiB ({memory.get('peak_source')})"
        + (f": {top}" if top else ""),
        f"MFU         {pct(flops.get('mfu'))} of {sig((flops.get('peak_flops_per_s') or 0) / 1e12)} TFLOP/s "
        f"({peak_source}: {flops.get('peak_flops_method')})" if peak_source else "MFU         – (no peak FLOP/s)",
        f"record      {record_path or 'not written (fast_dev_run)'}",
    ] + ([f"tensorboard uv run tensorboard --logdir {log_dir}"] if writers else [])
    error = f" ({record['error']})" if record.get("error") else ""
    lines = [f"Run {record.get('run_id')}: {record.get('status')}{error}", *("  " + line for line in lines)]
    print("\n" + "\n".join(lines), flush=True)
    for writer in writers:
        writer.add_text("run/summary", "\n".join(f"    {line}" for line in lines), step)
        if rows:
            from matplotlib.figure import Figure  # no pyplot: no GUI backend, nothing global changed

            writer.add_text("mem/anatomy", "| category | MiB |\n|:--|--:|\n" + "".join(
                f"| {k} | {v:.1f} |\n" for k, v in rows), step)
            ax = Figure(figsize=(7, 1.8), layout="constrained").add_subplot()
            for (name, mib), left in zip(rows, accumulate((v for _, v in rows), initial=0.0), strict=False):
                ax.barh(0, mib, left=left, label=f"{name} {mib:.1f}")
            ax.set(yticks=[], xlabel="MiB", title=f"memory at the peak of step {memory.get('anatomy_step')}")
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.6), ncol=4, fontsize="small", frameon=False)
            writer.add_figure("mem/anatomy", ax.figure, step)
        writer.flush()
