"""Faults a fit meets, handled so that the run ends the way its record says: non-finite losses, GradScaler
skips, SIGTERM, and ranks that fail under DDP."""

import atexit
import signal
import warnings
from collections import namedtuple
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from callbacks._glue import Measurement


class NonFiniteLossError(FloatingPointError):
    """The training loss was NaN or infinite (raised by :class:`NonFiniteLossGuard` on every rank alike)."""


# A micro-batch's loss (``finite``: a device bool tensor, read only when checked) and its optimizer step, epoch, batch.
_MicroBatch = namedtuple("_MicroBatch", "finite loss step epoch batch_idx")


class NonFiniteLossGuard(Measurement):
    """Stops the fit at the first non-finite training loss, or skips and counts such optimizer steps; under
    ``16-mixed`` it also counts the steps the GradScaler skipped (loss-scale search, not divergence).

    Args:
        on_nonfinite: ``stop``: raise :class:`NonFiniteLossError` naming the step; ``skip``: drop the optimizer step
            (gradients set to ``None``: parameters and optimizer state stay), put back the buffers its forwards
            changed (BatchNorm's statistics), and count it.
        max_skipped_steps: with ``skip``, stop once more than this many steps were skipped; ``None``: never.

    A step is named by ``trainer.global_step`` while it ran; one non-finite micro-batch loss condemns its step.
    One host read per batch, and under DDP a one-element all-reduce so that every rank decides alike.
    """

    def __init__(self, on_nonfinite: Literal["stop", "skip"] = "stop", max_skipped_steps: int | None = None) -> None:
        super().__init__()
        if on_nonfinite not in ("stop", "skip"):  # jsonargparse checks the Literal; a Python caller gets this
            raise ValueError(f"NonFiniteLossGuard.on_nonfinite: {on_nonfinite!r}; valid: stop, skip")
        if max_skipped_steps is not None and max_skipped_steps < 0:
            raise ValueError(f"NonFiniteLossGuard.max_skipped_steps: must be >= 0 or null, got {max_skipped_steps}")
        self.on_nonfinite, self.max_skipped_steps = on_nonfinite, max_skipped_steps
        self.skipped_at: list[int] = []  # the first 100 skipped steps
        self.skipped_steps, self.diverged, self.diverged_at_step = 0, False, None
        self._pending: list[_MicroBatch] = []
        self._buffers: list[torch.Tensor] = []  # skip: the module's buffers as the step found them
        self._scale_before: torch.Tensor | None = None
        self._scaler_skipped: torch.Tensor | int = 0  # a device tensor once a GradScaler ran: no host read per step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.on_nonfinite == "skip" and not self._pending:  # the first micro-batch of a step
            self._buffers = [b.detach().clone() for b in pl_module.buffers()]

    def on_before_backward(self, trainer, pl_module, loss) -> None:  # training only: validation has no backward
        loss, batch_idx = loss.detach(), trainer.fit_loop.epoch_loop.batch_idx
        micro = _MicroBatch(torch.isfinite(loss).all(), loss, trainer.global_step, trainer.current_epoch, batch_idx)
        self._pending.append(micro)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if (scale := _scale(trainer)) is not None:
            self._scale_before = scale.clone()
        if self.on_nonfinite != "skip" or (bad := self._first_nonfinite(trainer)) is None:
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

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._scale_before is not None and (scale := _scale(trainer)) is not None:
            # The scale only goes down when the scaler skipped the step.
            self._scaler_skipped = self._scaler_skipped + (scale < self._scale_before).int()
        self._scale_before = None
        if self.on_nonfinite == "stop" and (bad := self._first_nonfinite(trainer)) is not None:
            self._stop(bad, "")

    def _first_nonfinite(self, trainer) -> _MicroBatch | None:
        """The first micro-batch since the last check whose loss was not finite, on any rank (one host read)."""
        pending, self._pending = self._pending, []
        if not pending:
            return None
        all_finite = torch.stack([mb.finite for mb in pending]).all()
        if trainer.world_size > 1:
            all_finite = trainer.strategy.reduce((~all_finite).float(), reduce_op="sum") == 0
        return None if bool(all_finite) else next((mb for mb in pending if not bool(mb.finite)), pending[0])

    def _stop(self, bad: _MicroBatch, why: str) -> None:
        what = "not finite on another rank" if bool(bad.finite) else f"{float(bad.loss.float().mean())}"
        self.diverged, self.diverged_at_step = True, bad.step
        raise NonFiniteLossError(f"train/loss is {what} at step {bad.step} (epoch {bad.epoch}, batch {bad.batch_idx})"
                                 f"{why}; stopped by NonFiniteLossGuard(on_nonfinite={self.on_nonfinite})")

    @property
    def scaler_skipped_steps(self) -> int | None:
        """Optimizer steps the GradScaler skipped (inf/NaN gradients); ``None`` when no GradScaler ran."""
        return int(self._scaler_skipped.item()) if isinstance(self._scaler_skipped, torch.Tensor) else None

    def record_sections(self, trainer, pl_module) -> dict[str, dict]:
        return {"faults": {
            "on_nonfinite": self.on_nonfinite, "diverged": self.diverged, "diverged_at_step": self.diverged_at_step,
            "nonfinite_skipped_steps": self.skipped_steps, "nonfinite_skipped_at": list(self.skipped_at),
            "scaler_skipped_steps": self.scaler_skipped_steps}}

    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps, "skipped_at": list(self.skipped_at),
                "scaler_skipped_steps": self.scaler_skipped_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps, self.skipped_at = state_dict["skipped_steps"], list(state_dict["skipped_at"])
        scaler_skipped = state_dict["scaler_skipped_steps"]  # None: no GradScaler ran
        self._scaler_skipped = 0 if scaler_skipped is None else torch.tensor(scaler_skipped)


def _scale(trainer) -> torch.Tensor | None:
    """The enabled GradScaler's scale: its device tensor, as ``get_scale()`` would stall the host; else None."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler._scale if scaler is not None and scaler.is_enabled() else None


class GracefulStop(Callback):
    """SIGTERM saves ``last.ckpt`` and exits 143 (Lightning: a flag, then ``SIGTERMException`` with status 0);
    under DDP, a failure ends every process, promptly.

    Args:
        filename: checkpoint written on SIGTERM in the first ``ModelCheckpoint``'s folder (none without one).
        exit_code: exit status of a process stopped by SIGTERM (128 + 15, the shell's convention).

    Under DDP Lightning's launcher SIGKILLs every rank ~5 s after a child rank fails. A stop every rank takes
    (SIGTERM, :class:`NonFiniteLossError`) ends with a barrier after rank 0's checkpoint and record (list this after
    ``RunRecord``: ``on_exception`` runs in list order); any other exception on rank 0 SIGKILLs the child ranks as
    it exits, or they would hold memory till the process-group timeout.
    """

    def __init__(self, filename: str = "last", exit_code: int = 128 + signal.SIGTERM) -> None:
        super().__init__()
        self.filename, self.exit_code = filename, exit_code

    def on_exception(self, trainer, pl_module, exception) -> None:
        if isinstance(exception, SIGTERMException):
            exception.code = self.exit_code
            if (folder := getattr(trainer.checkpoint_callback, "dirpath", None)) is not None:
                try:  # on every rank: it synchronizes them
                    trainer.save_checkpoint(Path(folder) / f"{self.filename}.ckpt", weights_only=False)
                except Exception as err:  # the stop must still happen, and say why it has no checkpoint
                    warnings.warn(f"GracefulStop: no checkpoint on SIGTERM ({type(err).__name__}: {err})", stacklevel=2)
        if trainer.world_size > 1 and isinstance(exception, (SIGTERMException, NonFiniteLossError)):
            trainer.strategy.barrier("GracefulStop")
        elif trainer.global_rank == 0:
            for proc in getattr(trainer.strategy.launcher, "procs", None) or ():
                atexit.register(proc.kill)  # Popen.kill leaves a process that already exited alone
