"""The instrument: framework-neutral timing, memory, FLOPs and facts (nothing here imports Lightning).

:mod:`.timing` the warm-up window and step timers; :mod:`.memory` the allocator peak, process RSS and
:class:`MemoryAnatomy`; :mod:`.flops` FLOPs, the hardware's peak FLOP/s and MFU; :mod:`.facts` hardware,
versions, techniques as applied, how a run ended. Units live in names: ``_mib`` is 2**20 bytes, ``_s``, ``_ms``.
"""

from modelwright.measure.facts import (
    MIB,
    channels_last_applied,
    cpu_model,
    device_name,
    error_status,
    hardware_info,
    one_line_error,
    optimizer_impl,
    versions,
)
from modelwright.measure.flops import compute_dtype, hardware_peak, meta_copy, mfu, resolve_peak_flops, training_flops
from modelwright.measure.memory import (
    AnatomyUnavailable,
    MemoryAnatomy,
    is_compiled,
    peak_memory_mib,
    process_rss_peak_mib,
    reset_peak_memory,
)
from modelwright.measure.timing import CudaEventTimer, StepCycle, StepTimer, Window, device_sync, percentile

__all__ = [
    "MIB", "AnatomyUnavailable", "CudaEventTimer", "MemoryAnatomy", "StepCycle", "StepTimer", "Window",
    "channels_last_applied", "compute_dtype", "cpu_model", "device_name", "device_sync", "error_status",
    "hardware_info", "hardware_peak", "is_compiled", "meta_copy", "mfu", "one_line_error", "optimizer_impl",
    "peak_memory_mib", "percentile", "process_rss_peak_mib", "reset_peak_memory",
    "resolve_peak_flops", "training_flops", "versions",
]
