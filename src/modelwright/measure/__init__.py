"""The instrument: framework-neutral timing, memory, FLOPs and facts (nothing here imports Lightning)."""

from modelwright.measure.facts import (
    MIB,
    channels_last_applied,
    error_status,
    hardware_info,
    one_line_error,
    optimizer_impl,
    versions,
)
from modelwright.measure.flops import compute_dtype, hardware_peak, meta_copy, mfu, training_flops
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
    "channels_last_applied", "compute_dtype", "device_sync", "error_status", "hardware_info", "hardware_peak",
    "is_compiled", "meta_copy", "mfu", "one_line_error", "optimizer_impl", "peak_memory_mib", "percentile",
    "process_rss_peak_mib", "reset_peak_memory", "training_flops", "versions",
]
