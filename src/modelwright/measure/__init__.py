"""The instrument: framework-neutral timing, memory, FLOPs and facts (nothing here imports Lightning).

* :mod:`.timing`: the warm-up/window rule, step timers (host clock or CUDA events), micro-batch grouping.
* :mod:`.memory`: the CUDA allocator's peak, process RSS, and :class:`MemoryAnatomy` (where one step's
  tensor memory went, on any device).
* :mod:`.flops`: FLOPs per step, the hardware's peak FLOP/s (:func:`hardware_peak`) and MFU.
* :mod:`.facts`: hardware, versions, techniques as applied, how a run ended.

Units live in names: ``_mib`` is 2**20 bytes, ``_s`` seconds, ``_ms`` milliseconds.
"""

from modelwright.measure.facts import (
    channels_last_applied,
    cpu_model,
    device_name,
    error_status,
    hardware_info,
    one_line_error,
    optimizer_impl,
    versions,
)
from modelwright.measure.flops import (
    PeakFlops,
    compute_dtype,
    count_flops,
    default_cache_dir,
    hardware_peak,
    meta_copy,
    mfu,
    resolve_peak_flops,
    training_flops,
)
from modelwright.measure.memory import (
    MIB,
    AnatomyUnavailable,
    MemoryAnatomy,
    is_compiled,
    peak_memory_mib,
    process_rss_peak_mib,
    reset_peak_memory,
)
from modelwright.measure.timing import CudaEventTimer, StepCycle, StepTimer, Window, device_sync, percentile


def peak_cache_key(device, dtype, n=None) -> str:  # noqa: ANN001
    """Kept for old callers that pre-filled a peak cache; the hardware peak needs none (see :func:`hardware_peak`)."""
    return f"{device_name(device)}|{str(dtype).removeprefix('torch.')}"


__all__ = [
    "MIB", "AnatomyUnavailable", "CudaEventTimer", "MemoryAnatomy", "PeakFlops", "StepCycle", "StepTimer", "Window",
    "channels_last_applied", "compute_dtype", "count_flops", "cpu_model", "default_cache_dir", "device_name",
    "device_sync", "error_status", "hardware_info", "hardware_peak", "is_compiled", "mfu", "meta_copy",
    "one_line_error", "optimizer_impl", "peak_cache_key", "peak_memory_mib", "percentile", "process_rss_peak_mib",
    "reset_peak_memory", "resolve_peak_flops", "training_flops", "versions",
]
