"""Process settings for fast training on a CPU; framework-neutral.

:func:`set_cpu_malloc` chooses how glibc's ``malloc`` treats the large blocks a training step frees. By default
(``system``) every block over the mmap threshold (at most 32 MiB) is mapped fresh from the kernel on each
allocation and unmapped when freed, and the top of the heap is trimmed back: each step then faults in its
activations again, page by page (seen here: about 200,000 minor page faults per resnet18 step at batch 128, some
10% of the step). ``retain`` keeps freed memory in the process for the next step to reuse (no mmap for large
blocks, no trimming): the process's RSS stays at its high-water mark, which is what a training loop reaches every
step anyway. ``benchmarks/cpu_defaults.py`` measures the two side by side.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import sys

CPU_MALLOC_MODES = ("retain", "system")

# mallopt(3) parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def _glibc():
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def set_cpu_malloc(mode: str) -> bool:
    """Apply ``mode`` to this process's glibc malloc; True if the process's malloc was changed.

    ``retain``: no mmap for large blocks and no trimming, from now on (call it before the model's activations are
    first allocated). ``system``: leave malloc as the process found it (glibc's own thresholds, which adapt as the
    program runs; setting them explicitly would switch that adaptation off and make things slower still).
    Where there is no glibc (macOS, Windows, musl), nothing changes and the answer is False.
    """
    if mode not in CPU_MALLOC_MODES:
        raise ValueError(f"cpu_malloc: {mode!r}; valid: {', '.join(CPU_MALLOC_MODES)}")
    libc = _glibc() if mode == "retain" else None
    if libc is None:
        return False
    settings = {_M_MMAP_MAX: 0, _M_TRIM_THRESHOLD: -1}  # -1: never trim (mallopt(3))
    return all(libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1 for param, value in settings.items())
