"""The instrument: framework-neutral timing, memory, FLOPs, facts and the one step probe both loops call
(nothing here imports Lightning)."""

from modelwright.measure.divergence import LossWatch, NonFiniteLossError
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
from modelwright.measure.probe import StepProbe, StepReading, first_tensor
from modelwright.measure.timing import CudaEventTimer, StepCycle, StepTimer, Window, device_sync, percentile

__all__ = [
    "MIB", "AnatomyUnavailable", "CudaEventTimer", "LossWatch", "MemoryAnatomy", "NonFiniteLossError",
    "StepCycle", "StepProbe", "StepReading", "StepTimer", "Window", "channels_last_applied", "compute_dtype",
    "device_sync", "error_status", "first_tensor", "hardware_info", "hardware_peak", "is_compiled",
    "meta_copy", "mfu", "one_line_error", "optimizer_impl", "peak_memory_mib", "percentile",
    "process_rss_peak_mib", "reset_peak_memory", "training_flops", "versions",
]
