"""The conditions to state with every number: hardware, versions, techniques as applied, how a run ended."""

import contextlib
import functools
import os
import platform
from importlib import metadata
from typing import Any

import torch
from torch import nn

MIB = 2**20


def cuda_device(device: torch.device | str | None) -> torch.device | None:
    """``device`` (``None``: the CPU) if it is a CUDA device and CUDA is available, else ``None``."""
    device = torch.device(device or "cpu")
    return device if device.type == "cuda" and torch.cuda.is_available() else None


def available_cpus() -> int | None:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


@functools.cache
def cpuinfo() -> dict[str, str]:
    """The first processor's ``/proc/cpuinfo`` entries (``model name``, ``flags``, ``cpu MHz``, ...); {}
    elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, sep, v in (line.partition(":") for line in first.splitlines()) if sep}


#: The vector instruction sets a CPU is told apart by, widest first (``/proc/cpuinfo`` flag names).
VECTOR_ISAS = ("avx512", "avx2", "neon", "asimd")


def vector_isa(flags: str | None = None) -> str | None:
    """The widest vector instruction set of :data:`VECTOR_ISAS` in a ``/proc/cpuinfo`` flags line (default:
    this machine's), or None. One model name ("AMD EPYC") covers machines with and without AVX-512."""
    if flags is None:
        info = cpuinfo()
        flags = info.get("flags", info.get("Features", ""))  # arm64 Linux: "Features"
    found = set(flags.split())
    return next((isa for isa in VECTOR_ISAS if isa in found or f"{isa}f" in found), None)


def cpu_model() -> str:
    return cpuinfo().get("model name") or platform.processor() or platform.machine() or "unknown"


def hardware_info(device: torch.device | str | None = None, num_devices: int | None = None) -> dict[str, Any]:
    """The record's ``hardware`` section for ``device`` (default: CUDA if present, else CPU), with the logical
    CPUs this process may run on (``cpu_cores_available``) and the machine's RAM (``host_memory_mib``)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / MIB
    if cuda_device(device) is not None:
        name = torch.cuda.get_device_name(device)
        memory = torch.cuda.get_device_properties(device).total_memory / MIB
    elif device.type == "cpu":
        name = cpu_model()
        memory = host
    else:
        name = device.type
        memory = None
    return {
        "accelerator": device.type,
        "device_name": name,
        "device_memory_mib": memory,
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_available": available_cpus(),
        "vector_isa": vector_isa(),
        "num_devices": num_devices if num_devices is not None else 1,
        "host_memory_mib": host,
    }


def versions() -> dict[str, str | None]:
    def dist(name: str) -> str | None:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(name)
        return None

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        **{name: dist(name) for name in ("lightning", "torchvision", "accelerate")},
        "cuda": torch.version.cuda,
        "cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None,
    }


def optimizer_impl(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer class that ran and its kernel: ``torch.optim.AdamW[foreach]`` / ``[for-loop]`` /
    ``[fused]``."""
    cls = type(optimizer)
    name = f"torch.optim.{cls.__name__}" if getattr(torch.optim, cls.__name__, None) is cls \
        else f"{cls.__module__}.{cls.__qualname__}"
    if optimizer.defaults.get("fused"):
        return f"{name}[fused]"
    foreach = optimizer.defaults.get("foreach")
    if foreach is None:  # PyTorch's default: foreach when every parameter is on a GPU, else the for-loop
        params = [p for group in optimizer.param_groups for p in group["params"]]
        foreach = bool(params) and all(p.device.type == "cuda" for p in params)
    return f"{name}[{'foreach' if foreach else 'for-loop'}]"


def channels_last_applied(module: nn.Module) -> bool | None:
    """Whether the first spatial conv weight is in channels_last format; None without one, or if it cannot be
    read (sharded)."""
    weight = next((p for p in module.parameters() if p.ndim == 4 and p.shape[2:] != (1, 1)), None)
    if weight is None:
        return None
    try:
        return weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous()
    except Exception:
        return None


def error_status(exception: BaseException) -> str:
    """The record status of a run that raised ``exception``: ``interrupted``, ``oom`` or ``failed``."""
    if isinstance(exception, (KeyboardInterrupt, SystemExit)):  # Ctrl-C; SIGTERM (a SIGTERMException)
        return "interrupted"
    text = str(exception).lower()
    # CUDA's and the CPU allocator's messages
    oom = isinstance(exception, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in text
    return "oom" if oom or "can't allocate memory" in text else "failed"


def one_line_error(exception: BaseException) -> str:
    """``Type: first line of the message``, at most 500 characters, for the record's ``error``."""
    text = str(exception).strip().splitlines()
    return f"{type(exception).__name__}: {text[0] if text else ''}"[:500].rstrip(": ")
