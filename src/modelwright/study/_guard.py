"""Runs one study child, and kills its process group when the study dies, even by SIGKILL.

``python _guard.py STUDY_PID COMMAND...``, run as a file (it starts in milliseconds) in a group of its own:
the kernel sends SIGUSR1 when the study exits (``PR_SET_PDEATHSIG``, Linux), and SIGKILL to the group ends the
run and whatever it started (another DDP rank). SIGTERM to the group is the study asking the run to stop
cleanly: this waits for it."""

import contextlib
import ctypes
import os
import signal
import subprocess
import sys


def _kill_group(*_):
    os.killpg(0, signal.SIGKILL)


signal.signal(signal.SIGUSR1, _kill_group)
signal.signal(signal.SIGTERM, lambda *_: None)
# not Linux: the study's own cleanup kills the group on exit
with contextlib.suppress(OSError, AttributeError):
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGUSR1))  # 1: PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):  # the study died before the parent-death signal was armed
    _kill_group()
code = subprocess.call(sys.argv[2:])
if code < 0:  # die of the same signal, so the study sees what ended the run (-9: the OOM killer)
    with contextlib.suppress(OSError):  # SIGKILL's action cannot be set: it is always the default
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
