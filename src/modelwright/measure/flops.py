"""FLOPs of a training step, the hardware's peak FLOP/s (never a kernel's), and MFU = achieved ÷ peak."""

import copy
import ctypes
import json
import mmap
import os
import platform
import re
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from modelwright.errors import ConfigError
from modelwright.measure.facts import available_cpus, cpu_model, cpuinfo, cuda_device
from modelwright.record import DEFINITIONS_VERSION, write_text_atomic
from modelwright.techniques import precision


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` on the meta device, without ``torch.compile`` and the forwards replaced on
    instances (gradient checkpointing), so FLOPs counted on it are model FLOPs, without recomputation."""
    module = getattr(module, "_orig_mod", module)
    # nn.Module.compile()'s compiled call is not copied: nn.Module.__getstate__ leaves it out.
    memo: dict[int, Any] = {}
    for t in [*module.parameters(), *module.buffers()]:
        meta = torch.empty_like(t, device="meta")
        if isinstance(t, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=t.requires_grad)
        memo[id(t)] = meta
    copied = copy.deepcopy(module, memo)
    for sub in copied.modules():
        sub.__dict__.pop("forward", None)
    return copied


def training_flops(module: nn.Module, example_input: torch.Tensor,
                   loss_fn: Callable[[Any], torch.Tensor] | None = None) -> int:
    """FLOPs of one forward and backward of ``module`` on a batch shaped like ``example_input``, on a
    :func:`meta_copy`, by PyTorch's ``FlopCounterMode`` (matmuls, convolutions, attention; the rest counts 0);
    the loss (``loss_fn``, default a sum of the output) is negligible."""
    model = meta_copy(module).train()
    loss_fn = loss_fn or (lambda out: out.float().sum())
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(example_input.detach().to("meta"))).backward()
    return int(counter.get_total_flops())


def compute_dtype(precision_name: str | int | None) -> torch.dtype:
    """The dtype a run's matmuls use (:data:`modelwright.techniques.PRECISIONS`): ``"bf16-mixed"`` → bfloat16,
    ``"16-mixed"`` → float16; float32 for ``None`` or a precision the table does not know."""
    try:
        return getattr(torch, precision(precision_name).compute_dtype)
    except ConfigError:
        return torch.float32


def mfu(flops_per_step: float | None, step_time_s: float | None,
        peak_flops_per_s: float | None) -> float | None:
    """Model FLOPs utilisation: FLOPs per step ÷ step time ÷ the hardware's peak FLOP/s (None if one is
    missing)."""
    ok = flops_per_step and step_time_s and peak_flops_per_s
    return flops_per_step / step_time_s / peak_flops_per_s if ok else None


#: A device's peak FLOP/s in one dtype, its source (None: unknown) and method: the arithmetic, or why there is
#: none.
class PeakFlops(NamedTuple):
    flops_per_s: float | None
    source: str | None
    method: str | None


# Dense datasheet peaks, FLOP/s: (name pattern, {dtype: peak}); "tf32" is float32 on tensor cores.
# H200 has H100 SXM's compute. NVL and other variants are absent rather than guessed.
_GPU_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"nvl", {}),
    (r"h100 pcie",
     {"float64": 25.6e12, "float32": 51.2e12, "tf32": 378e12, "bfloat16": 756e12, "float16": 756e12}),
    (r"\bh[12]00\b|gh200",
     {"float64": 33.5e12, "float32": 66.9e12, "tf32": 494.7e12, "bfloat16": 989.4e12, "float16": 989.4e12}),
    (r"a100", {"float64": 9.7e12, "float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12, "float16": 312e12}),
    (r"\bl4\b", {"float32": 30.3e12, "tf32": 60e12, "bfloat16": 121e12, "float16": 121e12}),
    # V100's datasheet: PCIe and V100S PCIe boards run at other clocks than the SXM2 one
    (r"v100s", {"float64": 8.2e12, "float32": 16.4e12, "float16": 130e12}),
    (r"v100-pcie", {"float64": 7e12, "float32": 14e12, "float16": 112e12}),
    (r"v100", {"float64": 7.8e12, "float32": 15.7e12, "float16": 125e12}),
    (r"\bt4\b", {"float32": 8.1e12, "float16": 65e12}),
)


def datasheet_peaks(device_name: str) -> dict[str, float]:
    """A GPU's dense datasheet peaks by dtype (``bfloat16``, ``tf32``, ...), by its name; {} if unknown."""
    return next((peaks for pattern, peaks in _GPU_PEAKS if re.search(pattern, device_name.lower())), {})


def _gpu_peak(device: torch.device, dtype: torch.dtype) -> PeakFlops:
    name = torch.cuda.get_device_name(device)
    table = datasheet_peaks(name)
    key, note = str(dtype).removeprefix("torch."), ""
    if dtype is torch.float32 and torch.cuda.get_device_capability(device) >= (8, 0):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            matmul = torch.get_float32_matmul_precision() != "highest"
            conv = bool(torch.backends.cudnn.allow_tf32)
        key = "tf32" if matmul or conv else key
        answers = {True: "yes", False: "no"}
        note = f"; TF32 allowed for matmul: {answers[matmul]}, for cuDNN convolutions: {answers[conv]}"
    if key not in table:
        return PeakFlops(None, None, f"no datasheet peak for {name} in {key}{note}")
    return PeakFlops(table[key], "datasheet", f"{name}: dense {key} datasheet peak{note}")


def _cpu_flop_per_cycle(dtype: torch.dtype, info: dict[str, str]) -> tuple[int | None, str]:
    """FLOP per cycle per core of the widest instruction set this CPU reports, and its name."""
    flags = set(info.get("flags", info.get("Features", "")).split())  # arm64 Linux: "Features"
    amd_before_zen5 = info.get("vendor_id") == "AuthenticAMD" and int(info.get("cpu family", "0") or 0) < 26
    if "avx512f" in flags:  # Zen 4 executes 512-bit FMAs as two 256-bit halves
        fp32, isa = (32, "AVX-512 on 256-bit FMA units") if amd_before_zen5 else (64, "AVX-512, 2 FMA units")
    elif {"avx2", "fma"} <= flags:
        fp32, isa = 32, "AVX2+FMA, 2 FMA units"
    elif "asimd" in flags:
        fp32, isa = 16, "NEON, 2x128-bit FMA units"
    else:
        return None, "no FLOP/cycle known for this instruction set"
    if dtype is torch.float64:
        return fp32 // 2, isa
    extensions = ((torch.bfloat16, "amx_bf16", "avx512_bf16"), (torch.float16, "amx_fp16", "avx512_fp16"))
    for kind, amx, dot in extensions:
        if dtype is kind and amx in flags:
            return 1024, "AMX tiles"
        if dtype is kind and dot in flags:
            return 2 * fp32, f"{isa} + {dot.upper()}"
    return fp32, isa


_X86_ADDS = 16
# x86-64: ``xor eax,eax; mov edx,1; loop: add rax,rdx (x16); dec rdi; jnz loop; ret``: 16 dependent adds per
# iteration, one cycle each on every x86 core, so the loop runs at 16 iterations per 16 cycles.
_ADD_LOOP = bytes.fromhex("31c0ba01000000" + "4801d0" * _X86_ADDS + "48ffcf75cbc3")
CLOCK_METHOD = "timed dependent-add loop (one core, thread CPU time, best of 5)"


def _timed_add_loop_hz(iterations: int = 2_000_000, repeats: int = 5) -> float | None:
    """The core's clock from a chain of dependent integer adds, timed in thread CPU time (load-proof); x86-64
    only."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not sys.platform.startswith("linux"):
        return None
    try:
        page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    except (OSError, ValueError, AttributeError):  # a system that refuses executable pages
        return None
    page.write(_ADD_LOOP)
    cbuf = ctypes.c_char.from_buffer(page)
    loop = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_uint64)(ctypes.addressof(cbuf))
    seconds = []
    for _ in range(10 + repeats):  # the first 10 let the core reach its running clock
        t0 = time.thread_time()
        loop(iterations)
        seconds.append(time.thread_time() - t0)
    del loop, cbuf
    page.close()
    return iterations * _X86_ADDS / min(seconds[10:])


def _is_positive_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def cpu_clock_hz() -> tuple[float | None, str]:
    """The CPU's clock and how it was found: measured once per machine (:data:`CLOCK_METHOD`), else cpuinfo
    MHz; cached in ``$MODELWRIGHT_CACHE_DIR/cpu_clock.json`` (default ``~/.cache/modelwright``) per method and
    ``DEFINITIONS_VERSION``."""
    folder = os.environ.get("MODELWRIGHT_CACHE_DIR") or Path.home() / ".cache" / "modelwright"
    path = Path(folder) / "cpu_clock.json"
    try:
        cache = dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):  # none yet, or damaged
        cache = {}
    current = {"method": CLOCK_METHOD, "definitions": DEFINITIONS_VERSION}
    entry = cache.get(cpu_model())
    cached = entry.get("clock_hz") if isinstance(entry, dict) and current.items() <= entry.items() else None
    if _is_positive_number(cached):  # else: none for this machine, or a damaged entry
        return float(cached), CLOCK_METHOD
    hz = _timed_add_loop_hz()
    if hz is None:
        mhz = cpuinfo().get("cpu MHz")
        return (float(mhz) * 1e6, "/proc/cpuinfo cpu MHz (not measured)") if mhz else (None, "clock unknown")
    cache[cpu_model()] = {"clock_hz": hz, **current}
    try:
        write_text_atomic(path, json.dumps(cache, indent=1, sort_keys=True))
    except OSError as err:  # a read-only home should not stop a run
        warnings.warn(f"could not cache the CPU clock in {path}: {err}", stacklevel=2)
    return hz, CLOCK_METHOD


def hardware_peak(device: torch.device | str | None, dtype: torch.dtype = torch.float32) -> PeakFlops:
    """The peak FLOP/s of one ``device`` in ``dtype`` (docs/measurement.md); ``flops_per_s=None`` if unknown.
    On a CPU the cores are ``torch.get_num_threads()``, at most the physical cores this process may run on."""
    device = torch.device(device or "cpu")
    if cuda_device(device) is not None:
        return _gpu_peak(device, dtype)
    if device.type != "cpu":
        return PeakFlops(None, None, f"no peak known for {device.type}")
    info = cpuinfo()
    per_cycle, isa = _cpu_flop_per_cycle(dtype, info)
    hz, how = cpu_clock_hz() if per_cycle else (None, isa)
    if hz is None:
        return PeakFlops(None, None, how)
    # SMT siblings share their core's FMA units.
    smt = max(1, int(info.get("siblings", 1)) // int(info.get("cpu cores", 1)))
    cores = min(torch.get_num_threads(), max(1, (available_cpus() or os.cpu_count() or 1) // smt))
    name = str(dtype).removeprefix("torch.")
    return PeakFlops(cores * per_cycle * hz, "cpu-isa-clock",
                     f"{cores} cores x {per_cycle} {name} FLOP/cycle ({isa}) x {hz / 1e9:.2f} GHz ({how})")
