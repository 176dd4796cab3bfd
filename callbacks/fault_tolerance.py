"""How a fit stops when asked to, or when one of its processes fails: SIGTERM and Ctrl-C end it at a point a
resume continues from exactly, with a checkpoint and the command that resumes; a failing DDP rank ends every
process."""

import atexit
import os
import shlex
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from callbacks import _lightning

#: A second SIGINT this soon after the first is the same Ctrl-C delivered twice: ``uv run`` (or a launcher)
#: forwards to its child the SIGINT that the whole process group already got.
SAME_SIGNAL_WINDOW_S = 1.0


class _StopSignals:
    """This process's handler of SIGTERM and SIGINT while a fit runs (signals are process-wide): the first one
    asks the fit to stop; outside a fit, the handlers that were there before decide."""

    def __init__(self) -> None:
        self.received: int | None = None  # the first stop signal of the current fit
        self.received_at = 0.0  # when, by time.monotonic()
        self.fitting = False
        self.previous: dict[int, object] = {}

    def install(self) -> None:
        """This handler; the first install of a fit keeps the handlers from before it, for :meth:`restore`
        (never Lightning's, which holds this one: a SIGTERM would go round between them)."""
        if threading.current_thread() is not threading.main_thread():  # where Python can set a handler
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            current = signal.getsignal(signum)
            if signum not in self.previous and current is not self.handle:
                self.previous[signum] = current
            signal.signal(signum, self.handle)

    def restore(self) -> None:
        """The handlers from before the fit, back in place: the next fit installs afresh."""
        self.fitting = False
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self.previous.items():
            if handler is not None:  # None: set outside Python, cannot be put back
                signal.signal(signum, handler)
        self.previous.clear()

    def handle(self, signum: int, frame: object) -> None:
        if not self.fitting and self.received is None:
            return self._previous(signum, frame)
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            if time.monotonic() - self.received_at < SAME_SIGNAL_WINDOW_S:
                return None  # the same Ctrl-C, delivered twice
            raise KeyboardInterrupt  # a second Ctrl-C: stop at once (Lightning's own shutdown)
        if self.received is not None:
            return None  # already stopping: a second SIGTERM (a scheduler's reminder) changes nothing
        self.received = signum
        self.received_at = time.monotonic()
        name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        again = "; press Ctrl-C again to stop at once" if signum == signal.SIGINT else ""
        print(f"\n{name}: stopping after the optimizer step in flight, with a checkpoint{again}",
              file=sys.stderr, flush=True)
        return None

    def _previous(self, signum: int, frame: object) -> None:
        previous = self.previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


_STOP = _StopSignals()


def stop_signal() -> int | None:
    """The signal that asked the current fit to stop (``signal.SIGTERM`` or ``signal.SIGINT``), or None."""
    return _STOP.received


class GracefulStop(Callback):
    """SIGTERM or Ctrl-C stops the fit after the optimizer step in flight (or after a validation that runs
    between steps), saves ``last.ckpt``, prints the command that resumes, and exits 143 (SIGTERM) or 130
    (Ctrl-C): 128 + the signal, the shell's convention. The record says ``interrupted``. A second Ctrl-C stops
    at once, without a checkpoint; a second SIGTERM changes nothing. Under DDP every rank stops after the same
    step (one one-element all-reduce per step); any other exception on rank 0 SIGKILLs the child ranks as it
    exits, or they would hold memory till the process-group timeout (Lightning's launcher kills the others
    about 5 s after a child rank fails).

    Args:
        filename: the checkpoint written on a stop, in the first ``ModelCheckpoint``'s folder (no checkpoint
            without one).
    """

    def __init__(self, filename: str = "last") -> None:
        super().__init__()
        self.filename = filename
        self._in_step = False
        self._steps_at_batch_start = 0

    def setup(self, trainer, pl_module, stage) -> None:
        # Before Lightning registers its handlers: its teardown puts these back, so a signal that arrives
        # while the run ends (a second SIGTERM) is still ours and the exit status stays 143.
        _STOP.received = None
        _STOP.fitting = stage == "fit"
        _STOP.install()

    def on_train_start(self, trainer, pl_module) -> None:
        # After Lightning's handlers: ours alone, so a signal waits for the step in flight instead of
        # Lightning's stop at the next batch end, which may fall inside an accumulation cycle.
        _STOP.install()

    def teardown(self, trainer, pl_module, stage) -> None:
        _STOP.restore()  # after Lightning's teardown put back its own predecessor, ours

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._in_step = True
        self._steps_at_batch_start = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self._steps_at_batch_start:  # the optimizer stepped: a point to stop at
            self._in_step = False
            self._stop_if_asked(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and not self._in_step:
            self._stop_if_asked(trainer)

    def _stop_if_asked(self, trainer) -> None:
        asked = stop_signal() is not None
        if trainer.world_size > 1:  # every rank stops after the same step
            flag = torch.tensor(float(asked), device=trainer.strategy.root_device)
            asked = bool(trainer.strategy.reduce(flag, reduce_op="sum") > 0)
        if asked:
            _lightning.request_stop(trainer)  # Lightning raises SIGTERMException at the end of this batch

    def on_exception(self, trainer, pl_module, exception) -> None:
        if isinstance(exception, SIGTERMException):
            signum = stop_signal() or signal.SIGTERM
            exception.code = 128 + int(signum)
            saved = self._save(trainer)
            if trainer.is_global_zero and saved is not None:
                print(f"checkpoint {saved}\nto resume: {_resume_command()}", file=sys.stderr, flush=True)
            return
        _STOP.fitting = False
        if trainer.global_rank == 0:
            for proc in getattr(trainer.strategy.launcher, "procs", None) or ():
                atexit.register(proc.kill)  # Popen.kill leaves a process that already exited alone

    def _save(self, trainer) -> Path | None:
        folder = getattr(trainer.checkpoint_callback, "dirpath", None)
        if folder is None:
            return None
        path = Path(folder) / f"{self.filename}.ckpt"
        try:  # on every rank: it synchronizes them
            trainer.save_checkpoint(path, weights_only=False)
        except Exception as err:  # the stop must still happen, and say why it has no checkpoint
            why = f"{type(err).__name__}: {err}"
            warnings.warn(f"GracefulStop: no checkpoint on the stop ({why})", stacklevel=2)
            return None
        return path


def _resume_command() -> str:
    """The command line that resumes this run: this one with ``--ckpt_path last``."""
    args = list(sys.argv[1:])
    while "--ckpt_path" in args:
        at = args.index("--ckpt_path")
        del args[at:at + 2]
    args = [a for a in args if not a.startswith("--ckpt_path=")]
    program = Path(sys.argv[0]).name if sys.argv else "main.py"
    if program != "main.py":
        return "the same command with --ckpt_path last"
    return shlex.join(["uv", "run", "main.py", *args, "--ckpt_path", "last"])
