"""Test-only callbacks that inject faults into a fit at a chosen optimizer step (``trainer.global_step``).

Used from the command line with ``tests/`` on ``PYTHONPATH``::

    --trainer.callbacks+=faults.RaiseAt --trainer.callbacks.step 2 --trainer.callbacks.rank 1

``python tests/faults.py FITS.json`` runs several fits at once, each a process of its own (see :func:`fork_fits`).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback


class RaiseAt(Callback):
    """Raise ``RuntimeError`` on one rank at the start of step ``step``; write the time to ``marker`` first."""

    def __init__(self, step: int, rank: int = 0, marker: str | None = None) -> None:
        super().__init__()
        self.step = step
        self.rank = rank
        self.marker = marker

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            if self.marker:
                Path(self.marker).write_text(f"{time.time()}\n", encoding="utf-8")
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")


class NanLossAt(Callback):
    """Make the training loss NaN at the given steps, leaving the forward pass (and BatchNorm statistics) alone."""

    def __init__(self, steps: list[int], rank: int | None = None) -> None:
        super().__init__()
        self.steps = set(steps)
        self.rank = rank

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        original = pl_module.training_step

        def training_step(*args: Any, **kwargs: Any) -> Any:
            loss = original(*args, **kwargs)
            if trainer.global_step in self.steps and self.rank in (None, trainer.global_rank):
                loss = loss * float("nan")
            return loss

        pl_module.training_step = training_step


class NanInputAt(Callback):
    """Make the input images of the given steps NaN: the forward pass, BatchNorm's running statistics included, sees
    them."""

    def __init__(self, steps: list[int]) -> None:
        super().__init__()
        self.steps = set(steps)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step in self.steps:
            batch[0].fill_(float("nan"))  # the collated batch, not the dataset


class SleepAt(Callback):
    """After ``step`` optimizer steps (at ``on_train_batch_end``, before any checkpoint of that step), touch
    ``marker`` and sleep until ``seconds`` pass or SIGTERM arrives, so a signal lands at a known place."""

    def __init__(self, step: int, marker: str, seconds: float = 600.0) -> None:
        super().__init__()
        self.step = step
        self.marker = marker
        self.seconds = seconds

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step:
            Path(self.marker).write_text(f"{trainer.current_epoch} {batch_idx}\n", encoding="utf-8")
            deadline = time.monotonic() + self.seconds
            while time.monotonic() < deadline and not trainer.received_sigterm:
                time.sleep(0.05)


class SignalAt(Callback):
    """After ``step`` optimizer steps (at ``on_train_batch_end``), send ``signum`` (default SIGTERM) to this process,
    ``times`` times back to back (``uv run`` forwards a Ctrl-C that its process group already got)."""

    def __init__(self, step: int, signum: int = int(signal.SIGTERM), times: int = 1) -> None:
        super().__init__()
        self.step = step
        self.signum = signum
        self.times = times

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)


class SignalAtExit(Callback):
    """Send ``signum`` (default SIGTERM) to this process once more as it exits (atexit), then wait a second there:
    a second SIGTERM that arrives after Lightning's teardown, as a scheduler's reminder does."""

    def __init__(self, signum: int = int(signal.SIGTERM)) -> None:
        super().__init__()
        self.signum = signum

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import atexit

        def again() -> None:
            os.kill(os.getpid(), self.signum)
            time.sleep(1.0)

        atexit.register(again)


class KillInFinalRecordWrite(Callback):
    """SIGKILL this process in the fsync of the run record's last write (its temp file is then on disk), once
    training has ended: a kill at the worst moment for the record."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        original = os.fsync

        def fsync(fd: int) -> None:
            if ".record.json." in os.readlink(f"/proc/self/fd/{fd}"):
                os.kill(os.getpid(), signal.SIGKILL)
            original(fd)

        os.fsync = fsync


class RecordAt(Callback):
    """Copy the run record as it is on disk when step ``step`` ends to ``copy``."""

    def __init__(self, step: int, copy: str) -> None:
        super().__init__()
        self.step = step
        self.copy = copy

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step:
            record = Path(trainer.logger.log_dir) / "record.json"
            Path(self.copy).write_bytes(record.read_bytes())


class KillAt(Callback):
    """SIGKILL this process in ``hook`` (a Callback hook name) when ``trainer.global_step == step`` (and, for a
    batch hook, ``batch_idx == batch``), outside the sanity check. Lightning runs checkpoint callbacks last, so a
    kill in ``on_validation_start`` lands after the checkpoints of the batch before it."""

    def __init__(self, hook: str, step: int, batch: int | None = None) -> None:
        super().__init__()
        self.step = step
        self.batch = batch

        def kill(trainer: pl.Trainer, *args: Any) -> None:
            batch_idx = args[-1] if hook.endswith("batch_start") or hook.endswith("batch_end") else None
            if trainer.sanity_checking or trainer.global_step != self.step:
                return
            if self.batch is None or batch_idx == self.batch:
                os.kill(os.getpid(), signal.SIGKILL)

        setattr(self, hook, kill)


class FsyncFault(Callback):
    """Fail the first fsync of step ``step``'s first checkpoint, whose bytes are then in their temporary file:
    ``kill`` SIGKILLs the process (the moment a non-atomic save leaves a torn file), ``enospc`` raises the
    ``OSError`` of a full disk."""

    def __init__(self, step: int, fault: str = "kill") -> None:
        super().__init__()
        self.step = step
        self.fault = fault

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if trainer.global_step != self.step or getattr(os.fsync, "armed", False):
            return
        original = os.fsync

        def fsync(fd: int) -> None:
            os.fsync = original
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        fsync.armed = True
        os.fsync = fsync


class ValLog(Callback):
    """Append ``global_step val/loss`` to ``path`` at the end of each validation (the sanity check left out)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(f"{trainer.global_step} {float(trainer.callback_metrics['val/loss'])!r}\n")


def fork_fits(spec: str) -> None:
    """Run the fits of ``spec`` (a JSON file: log path -> ``fit`` arguments) at once, each in a child forked from
    this process once the training code is imported; print each one's exit status (-N: killed by signal N) as JSON.

    Forking saves each child the seconds of importing torch and Lightning. It is safe only from a process that has
    run no OpenMP region yet (a forked child of one that has hangs in its first parallel kernel): this one has not.
    """
    from modelwright.train.cli import cli_main

    children = {}
    for log, args in json.loads(Path(spec).read_text(encoding="utf-8")).items():
        pid = os.fork()
        if pid == 0:
            out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(out, 1)
            os.dup2(out, 2)
            try:
                code = cli_main(args)
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else 1
            except BaseException:  # a child must never return into this loop
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        children[pid] = log
    print(json.dumps({log: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid, log in children.items()}))


if __name__ == "__main__":
    fork_fits(sys.argv[1])
