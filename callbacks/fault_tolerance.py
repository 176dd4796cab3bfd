"""Faults a fit meets, handled so that the run ends the way its record says: non-finite losses, GradScaler
skips, SIGTERM, and ranks that fail under DDP.

YAML (``trainer.callbacks``)::

    - class_path: callbacks.fault_tolerance.NonFiniteLossGuard
      init_args: {on_nonfinite: stop, max_skipped_steps: null}
    - class_path: callbacks.fault_tolerance.GracefulStop

:class:`NonFiniteLossGuard` stops the fit at a non-finite training loss, or skips and counts such steps; under
``16-mixed`` it also counts the steps the GradScaler skipped (loss-scale search, not divergence). Its
:meth:`~NonFiniteLossGuard.summary` is the record's ``faults`` section. Costs, on a GPU: ``stop`` reads one
flag on the host per batch, after its optimizer step is queued; ``skip`` reads it before the optimizer step.
Under DDP a one-element all-reduce at each read makes every rank take the same decision.

:class:`GracefulStop` turns Lightning's SIGTERM handling (a flag, then ``SIGTERMException`` with exit status 0)
into "save ``last.ckpt``, exit 143", and keeps a failure under DDP from hanging or orphaning processes.
"""

from __future__ import annotations

import atexit
import signal
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from callbacks._glue import Measurement


class NonFiniteLossError(FloatingPointError):
    """The training loss was NaN or infinite (raised by :class:`NonFiniteLossGuard` on every rank alike)."""


@dataclass
class _MicroBatch:
    finite: torch.Tensor  # bool, on the loss's device
    loss: torch.Tensor
    step: int  # trainer.global_step while the micro-batch ran: the optimizer step it belongs to
    epoch: int
    batch_idx: int


class NonFiniteLossGuard(Measurement):
    """Stops the fit at the first non-finite training loss, or skips and counts such optimizer steps.

    Args:
        on_nonfinite: ``stop``: raise :class:`NonFiniteLossError` naming the step; ``skip``: drop the optimizer
            step (gradients set to ``None`` before it, so neither parameters nor optimizer state change), put back
            the buffers its forward passes changed (BatchNorm's running statistics, from a copy taken at the
            step's first micro-batch), and count it.
        max_skipped_steps: with ``skip``, stop as ``stop`` would once more than this many steps were skipped;
            ``None``: never.

    A step is named by ``trainer.global_step`` while it ran: the number of optimizer steps before it, so the
    first step is step 0. With gradient accumulation, one non-finite micro-batch loss condemns its step.
    """

    def __init__(self, on_nonfinite: Literal["stop", "skip"] = "stop", max_skipped_steps: int | None = None) -> None:
        super().__init__()
        if on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"NonFiniteLossGuard.on_nonfinite: {on_nonfinite!r}; valid: stop, skip")
        if max_skipped_steps is not None and max_skipped_steps < 0:
            raise ValueError(f"NonFiniteLossGuard.max_skipped_steps: must be >= 0 or null, got {max_skipped_steps}")
        self.on_nonfinite = on_nonfinite
        self.max_skipped_steps = max_skipped_steps
        self.skipped_steps = 0
        self.skipped_at: list[int] = []  # the first 100 skipped steps
        self.diverged = False
        self.diverged_at_step: int | None = None
        self.message: str | None = None
        self._pending: list[_MicroBatch] = []
        self._buffers: list[torch.Tensor] = []  # skip: the module's buffers as the step found them
        self._scale_before: torch.Tensor | None = None
        self._scaler_skipped: torch.Tensor | int = 0

    # -- the loss ----------------------------------------------------------------------------------

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.on_nonfinite == "skip" and not self._pending:  # the first micro-batch of a step
            self._buffers = [b.detach().clone() for b in pl_module.buffers()]

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if not trainer.training:
            return
        loss = loss.detach()
        loop = trainer.fit_loop.epoch_loop
        self._pending.append(
            _MicroBatch(torch.isfinite(loss).all(), loss, trainer.global_step, trainer.current_epoch, loop.batch_idx)
        )

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        scaler = _grad_scaler(trainer)
        if scaler is not None:
            self._scale_before = _scale_of(scaler).clone()
        if self.on_nonfinite != "skip":
            return
        bad = self._first_nonfinite(trainer)
        if bad is None:
            return
        optimizer.zero_grad(set_to_none=True)  # an optimizer step over no gradients changes nothing
        with torch.no_grad():
            for buffer, saved in zip(pl_module.buffers(), self._buffers, strict=True):
                buffer.copy_(saved)
        self.skipped_steps += 1
        if len(self.skipped_at) < 100:
            self.skipped_at.append(bad.step)
        if self.max_skipped_steps is not None and self.skipped_steps > self.max_skipped_steps:
            self._stop(bad, f"; {self.skipped_steps} steps skipped, max_skipped_steps={self.max_skipped_steps}")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._scale_before is not None:
            scaler = _grad_scaler(trainer)
            if scaler is not None:  # the scale only goes down when the scaler skipped the step
                self._scaler_skipped = self._scaler_skipped + (_scale_of(scaler) < self._scale_before).int()
            self._scale_before = None
        if self.on_nonfinite == "stop" and self._pending:
            bad = self._first_nonfinite(trainer)
            if bad is not None:
                self._stop(bad, "")

    def _first_nonfinite(self, trainer: pl.Trainer) -> _MicroBatch | None:
        """The first micro-batch since the last check whose loss was not finite, on any rank (one host read)."""
        pending, self._pending = self._pending, []
        if not pending:
            return None
        all_finite = torch.stack([mb.finite for mb in pending]).all()
        if trainer.world_size > 1:
            bad_ranks = trainer.strategy.reduce((~all_finite).float(), reduce_op="sum")
            if float(bad_ranks) == 0:
                return None
        elif bool(all_finite):
            return None
        return next((mb for mb in pending if not bool(mb.finite)), pending[0])

    def _stop(self, bad: _MicroBatch, why: str) -> None:
        what = "not finite on another rank" if bool(bad.finite) else f"{float(bad.loss.float().mean())}"
        self.diverged = True
        self.diverged_at_step = bad.step
        self.message = (
            f"train/loss is {what} at step {bad.step} (epoch {bad.epoch}, batch {bad.batch_idx}){why}; "
            f"stopped by NonFiniteLossGuard(on_nonfinite={self.on_nonfinite})"
        )
        raise NonFiniteLossError(self.message)

    # -- what the record reads ---------------------------------------------------------------------

    @property
    def scaler_skipped_steps(self) -> int | None:
        """Optimizer steps the GradScaler skipped (inf/NaN gradients); ``None`` when no GradScaler ran."""
        if isinstance(self._scaler_skipped, torch.Tensor):
            return int(self._scaler_skipped.item())
        return None

    def summary(self) -> dict[str, Any]:
        """Counts and verdict for the run record."""
        return {
            "on_nonfinite": self.on_nonfinite,
            "diverged": self.diverged,
            "diverged_at_step": self.diverged_at_step,
            "nonfinite_skipped_steps": self.skipped_steps,
            "nonfinite_skipped_at": list(self.skipped_at),
            "scaler_skipped_steps": self.scaler_skipped_steps,
        }

    def record_sections(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, dict]:
        return {"faults": self.summary()}

    def state_dict(self) -> dict[str, Any]:
        return {
            "skipped_steps": self.skipped_steps,
            "skipped_at": list(self.skipped_at),
            "scaler_skipped_steps": self.scaler_skipped_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.skipped_at = list(state_dict.get("skipped_at", []))
        scaler_skipped = state_dict.get("scaler_skipped_steps")
        self._scaler_skipped = torch.tensor(scaler_skipped) if scaler_skipped is not None else 0


def _grad_scaler(trainer: pl.Trainer) -> Any:
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


def _scale_of(scaler: Any) -> torch.Tensor:
    scale = getattr(scaler, "_scale", None)  # the device tensor: reading get_scale() would stall the host
    return scale if isinstance(scale, torch.Tensor) else torch.tensor(scaler.get_scale())


class GracefulStop(Callback):
    """SIGTERM saves ``last.ckpt`` and exits non-zero; under DDP, a failure ends every process, promptly.

    Args:
        filename: checkpoint written on SIGTERM, in the first ``ModelCheckpoint``'s folder (the CLI's
            ``--ckpt_path last`` picks the newest ``last*.ckpt``); a run without a ``ModelCheckpoint``
            (a study run) keeps no checkpoint and writes none.
        exit_code: exit status of a process stopped by SIGTERM (128 + 15, the shell's convention).

    Under DDP, Lightning starts ranks 1.. as child processes of rank 0, and a thread in rank 0 SIGKILLs every
    process within about 5 s of a child exiting non-zero; so a failing child already ends the job. This adds:

    * a stop every rank takes together (SIGTERM, which Lightning broadcasts; :class:`NonFiniteLossError`)
      ends with a barrier, so rank 0 has written its checkpoint and record before the other ranks exit;
    * after any other exception on rank 0, the child ranks are SIGKILLed when rank 0 exits: they would
      otherwise wait in a collective until the process-group timeout (30 min by default), holding memory.

    List it after ``RunRecord``: Lightning calls ``on_exception`` in list order, and the barrier must come
    after rank 0's record.
    """

    def __init__(self, filename: str = "last", exit_code: int = 128 + signal.SIGTERM) -> None:
        super().__init__()
        self.filename = filename
        self.exit_code = exit_code
        self.saved_to: Path | None = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            exception.code = self.exit_code
            folder = next((cb.dirpath for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)), None)
            if folder is not None:
                path = Path(folder) / f"{self.filename}.ckpt"
                try:
                    trainer.save_checkpoint(path, weights_only=False)  # on every rank: it synchronizes them
                except Exception as err:  # the stop must still happen, and say why it has no checkpoint
                    warnings.warn(f"GracefulStop: no checkpoint on SIGTERM ({type(err).__name__}: {err})", stacklevel=2)
                else:
                    self.saved_to = path
        if trainer.world_size <= 1:
            return
        if isinstance(exception, (SIGTERMException, NonFiniteLossError)):
            trainer.strategy.barrier("GracefulStop")
        elif trainer.global_rank == 0:
            procs = list(getattr(trainer.strategy.launcher, "procs", None) or [])
            if procs:
                atexit.register(_kill_running, procs)


def _kill_running(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
