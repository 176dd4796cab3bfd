"""Process settings for fast training on a CPU; framework-neutral.

:func:`set_cpu_malloc` chooses how glibc's ``malloc`` treats the large blocks a training step frees. By
default (``system``) every block over the mmap threshold (at most 32 MiB) is mapped fresh from the kernel and
unmapped when freed, and the heap's top is trimmed: each step faults its activations in again, page by page
(about 200,000 minor page faults per resnet18 step at batch 128 here, some 10% of the step). ``retain`` keeps
freed memory for the next step (no mmap for large blocks, no trimming): RSS stays at the high-water mark that
every step reaches anyway.
``benchmarks/cpu_defaults.py`` measures the two side by side.
"""

import ctypes
import ctypes.util
import platform
import sys

CPU_MALLOC_MODES = ("retain", "system")


def set_cpu_malloc(mode: str) -> bool:
    """Apply ``mode`` to this process's glibc malloc from now on; True if malloc was changed.

    ``system`` leaves malloc as it is: setting glibc's thresholds explicitly would switch off their adaptation
    as the program runs. Without glibc (macOS, Windows, musl) nothing changes and the answer is False.
    """
    if mode not in CPU_MALLOC_MODES:
        raise ValueError(f"cpu_malloc: {mode!r}; valid: {', '.join(CPU_MALLOC_MODES)}")
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    if mode == "system" or not glibc:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    if not hasattr(libc, "mallopt"):
        return False
    # mallopt(3): M_MMAP_MAX (-4) 0 maps no block; M_TRIM_THRESHOLD (-1) -1 never trims
    settings = ((-4, 0), (-1, -1))
    return all(libc.mallopt(param, value) == 1 for param, value in settings)
