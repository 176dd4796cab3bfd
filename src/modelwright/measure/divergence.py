"""The divergence check of a training loop: non-finite losses stop the run or skip their optimizer step, and a
GradScaler's skipped steps are counted. Framework-neutral: the step probe calls it from both loops."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

#: Sums a one-element tensor over the ranks of a distributed run (the identity in one process).
Reduce = Callable[[torch.Tensor], torch.Tensor]
#: At most this many skipped steps are listed in the record (all are counted).
LISTED_SKIPS = 100


class NonFiniteLossError(FloatingPointError):
    """The training loss was NaN or infinite (raised by every rank alike)."""


@dataclass
class MicroBatchLoss:
    """One micro-batch's loss: ``finite`` a device bool tensor (read only when checked), and where it was."""

    finite: torch.Tensor
    loss: torch.Tensor
    step: int
    epoch: int
    batch_idx: int


class LossWatch:
    """Watches every micro-batch's loss for one policy.

    Args:
        on_nonfinite: ``stop``: raise :class:`NonFiniteLossError` naming the step; ``skip``: drop the
            optimizer step (gradients set to ``None``: parameters and optimizer state stay), put back the
            buffers its forwards changed (BatchNorm's statistics), and count it.
        max_skipped_steps: with ``skip``, stop once more than this many steps were skipped; ``None``: never.

    One host read per check, and in a distributed run a one-element all-reduce, so that every rank decides
    alike.
    """

    def __init__(self, on_nonfinite: Literal["stop", "skip"] = "stop",
                 max_skipped_steps: int | None = None) -> None:
        if on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite: {on_nonfinite!r}; valid: stop, skip")
        if max_skipped_steps is not None and max_skipped_steps < 0:
            raise ValueError(f"max_skipped_steps: must be >= 0 or null, got {max_skipped_steps}")
        self.on_nonfinite = on_nonfinite
        self.max_skipped_steps = max_skipped_steps
        self.skipped_steps = 0
        self.skipped_at: list[int] = []
        self.diverged_at_step: int | None = None
        self._pending: list[MicroBatchLoss] = []
        self._buffers: list[torch.Tensor] = []  # skip: the module's buffers as the step found them
        self._scale_before: torch.Tensor | None = None
        # A device tensor once a GradScaler ran: no host read per step.
        self._scaler_skipped: torch.Tensor | int = 0

    @property
    def diverged(self) -> bool:
        return self.diverged_at_step is not None

    def step_begins(self, module: nn.Module) -> None:
        """Before the first micro-batch of an optimizer step."""
        if self.on_nonfinite == "skip":
            self._buffers = [buffer.detach().clone() for buffer in module.buffers()]

    def observe(self, loss: torch.Tensor, step: int, epoch: int, batch_idx: int) -> None:
        """A training micro-batch's loss, before its backward."""
        loss = loss.detach()
        self._pending.append(MicroBatchLoss(torch.isfinite(loss).all(), loss, step, epoch, batch_idx))

    def before_update(self, optimizer: torch.optim.Optimizer, module: nn.Module, reduce: Reduce,
                      scale: torch.Tensor | None = None) -> None:
        """Just before the optimizer's update (``scale``: the GradScaler's, if one runs). With ``skip``, a
        step with a non-finite loss is dropped here."""
        if scale is not None:
            self._scale_before = scale.clone()
        if self.on_nonfinite != "skip":
            return
        bad = self._first_nonfinite(reduce)
        if bad is None:
            return
        optimizer.zero_grad(set_to_none=True)  # an optimizer step over no gradients changes nothing
        with torch.no_grad():
            for buffer, saved in zip(module.buffers(), self._buffers, strict=True):
                buffer.copy_(saved)
        self.skipped_steps += 1
        if len(self.skipped_at) < LISTED_SKIPS:
            self.skipped_at.append(bad.step)
        too_many = self.max_skipped_steps is not None and self.skipped_steps > self.max_skipped_steps
        if too_many:
            limit = self.max_skipped_steps
            self._stop(bad, f"; {self.skipped_steps} steps skipped, max_skipped_steps={limit}")

    def after_micro_batch(self, reduce: Reduce, scale: torch.Tensor | None = None) -> None:
        """After each micro-batch (its optimizer step, if it was the last). With ``stop``, raises here."""
        if self._scale_before is not None and scale is not None:
            # The scale only goes down when the scaler skipped the step.
            self._scaler_skipped = self._scaler_skipped + (scale < self._scale_before).int()
        self._scale_before = None
        if self.on_nonfinite == "stop":
            bad = self._first_nonfinite(reduce)
            if bad is not None:
                self._stop(bad, "")

    def _first_nonfinite(self, reduce: Reduce) -> MicroBatchLoss | None:
        """The first micro-batch since the last check whose loss was not finite, on any rank (one host
        read)."""
        pending = self._pending
        self._pending = []
        if not pending:
            return None
        nonfinite_anywhere = reduce((~torch.stack([mb.finite for mb in pending]).all()).float())
        if not bool(nonfinite_anywhere > 0):
            return None
        return next((mb for mb in pending if not bool(mb.finite)), pending[0])

    def _stop(self, bad: MicroBatchLoss, why: str) -> None:
        what = f"{float(bad.loss.float().mean())}" if not bool(bad.finite) else "not finite on another rank"
        self.diverged_at_step = bad.step
        where = f"at step {bad.step} (epoch {bad.epoch}, batch {bad.batch_idx})"
        policy = f"on_nonfinite={self.on_nonfinite}"
        raise NonFiniteLossError(f"train/loss is {what} {where}{why}; stopped by {policy}")

    @property
    def scaler_skipped_steps(self) -> int | None:
        """Optimizer steps the GradScaler skipped (inf/NaN gradients); ``None`` when no GradScaler ran."""
        if isinstance(self._scaler_skipped, torch.Tensor):
            return int(self._scaler_skipped.item())
        return None

    def section(self) -> dict[str, Any]:
        """The record's ``faults``."""
        return {
            "on_nonfinite": self.on_nonfinite,
            "diverged": self.diverged,
            "diverged_at_step": self.diverged_at_step,
            "nonfinite_skipped_steps": self.skipped_steps,
            "nonfinite_skipped_at": list(self.skipped_at),
            "scaler_skipped_steps": self.scaler_skipped_steps,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps, "skipped_at": list(self.skipped_at),
                "scaler_skipped_steps": self.scaler_skipped_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps = state_dict["skipped_steps"]
        self.skipped_at = list(state_dict["skipped_at"])
        scaler_skipped = state_dict["scaler_skipped_steps"]  # None: no GradScaler ran
        self._scaler_skipped = 0 if scaler_skipped is None else torch.tensor(scaler_skipped)
