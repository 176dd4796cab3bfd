"""The hardware peak and FLOP counts by hand: the FLOP/cycle and instruction set named for every CPU case, the
CPU peak's cores, clock and wording, each GPU read by its own index, the clock's measurement on a scripted
thread clock and its cache file, and the meta copy the FLOPs are counted on."""

from __future__ import annotations

import json
import mmap
import platform
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from modelwright.measure import flops as flops_mod
from modelwright.measure.flops import PeakFlops, hardware_peak, meta_copy, training_flops
from modelwright.measure.memory import is_compiled
from modelwright.record import DEFINITIONS_VERSION

NONE_KNOWN = "no FLOP/cycle known for this instruction set"
AVX2 = "AVX2+FMA, 2 FMA units"
ZEN4 = "AVX-512 on 256-bit FMA units"
AVX512 = "AVX-512, 2 FMA units"
NEON = "NEON, 2x128-bit FMA units"


def intel(flags: str) -> dict:
    return {"vendor_id": "GenuineIntel", "cpu family": "6", "flags": flags}


def amd(flags: str, family: str | None) -> dict:
    info = {"vendor_id": "AuthenticAMD", "flags": flags}
    return info if family is None else {**info, "cpu family": family}


#: An arm64 Linux /proc/cpuinfo names its flags "Features".
ARM = {"processor": "0", "BogoMIPS": "50.00", "Features": "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics"}
F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize(
    ("info", "dtype", "per_cycle", "isa"),
    [
        (intel("avx avx2 fma"), F32, 32, AVX2),
        (intel("avx2 fma"), F32, 32, AVX2),  # just the two flags
        (intel("avx avx2 fma"), F64, 16, AVX2),
        (intel("avx avx2 fma"), BF16, 32, AVX2),  # no bf16 instructions: float32's rate
        (intel("avx avx2 fma"), F16, 32, AVX2),
        (intel("avx avx2"), F32, None, NONE_KNOWN),  # AVX2 without FMA
        (amd("avx avx2 fma", "25"), BF16, 32, AVX2),  # Zen 3
        (amd("avx2 fma avx512f avx512_bf16", "25"), F32, 32, ZEN4),  # Zen 4: 512-bit work on 256-bit units
        (amd("avx2 fma avx512f avx512_bf16", "25"), F64, 16, ZEN4),
        (amd("avx2 fma avx512f avx512_bf16", "25"), BF16, 64, f"{ZEN4} + AVX512_BF16"),
        (amd("avx2 fma avx512f", None), F32, 32, ZEN4),  # no family given: taken as before Zen 5
        (amd("avx2 fma avx512f", ""), F32, 32, ZEN4),
        (amd("avx2 fma avx512f", "26"), F32, 64, AVX512),  # Zen 5: full 512-bit units
        (intel("avx2 fma avx512f avx512_bf16"), F32, 64, AVX512),
        (intel("avx2 fma avx512f avx512_bf16"), F64, 32, AVX512),
        (intel("avx2 fma avx512f avx512_bf16"), BF16, 128, f"{AVX512} + AVX512_BF16"),
        (intel("avx2 fma avx512f avx512_bf16"), F16, 64, AVX512),  # bf16 instructions do no float16
        (intel("avx2 fma avx512f avx512_fp16"), F16, 128, f"{AVX512} + AVX512_FP16"),
        (intel("avx2 fma avx512f avx512_fp16"), BF16, 64, AVX512),
        (intel("avx2 fma avx512f avx512_bf16 amx_bf16"), BF16, 1024, "AMX tiles"),
        (intel("avx2 fma avx512f avx512_fp16 amx_fp16"), F16, 1024, "AMX tiles"),
        (intel("avx2 fma avx512f avx512_bf16 amx_bf16"), F16, 64, AVX512),
        (intel("avx2 fma avx512f amx_bf16 amx_fp16"), F64, 32, AVX512),  # AMX does no float64
        pytest.param(ARM, F32, 16, NEON, id="arm64-float32"),
        pytest.param(ARM, F64, 8, NEON, id="arm64-float64"),
        pytest.param(ARM, BF16, 16, NEON, id="arm64-bfloat16"),
        (intel("sse sse2"), F32, None, NONE_KNOWN),
        ({}, F32, None, NONE_KNOWN),  # no /proc/cpuinfo
    ],
)
def test_cpu_flop_per_cycle_and_the_instruction_set_it_names(info, dtype, per_cycle, isa):
    found = flops_mod._cpu_flop_per_cycle(dtype, info)
    assert found == (per_cycle, isa)
    assert type(found[0]) is type(per_cycle)  # a whole number of FLOP, as the peak's method prints it


@pytest.fixture
def cpu(monkeypatch):
    """Pretend to be a CPU: its /proc/cpuinfo, clock, the CPUs this process may use, all the machine's CPUs
    and torch's threads."""

    def pretend(info: dict, clock=(3.0e9, "test clock"), available=None, cpu_count=None, threads=64):
        clock_reads = []
        monkeypatch.setattr(flops_mod, "cpuinfo", lambda: info)
        monkeypatch.setattr(flops_mod, "cpu_clock_hz", lambda: clock_reads.append(1) or clock)
        monkeypatch.setattr(flops_mod, "available_cpus", lambda: available)
        monkeypatch.setattr(flops_mod.os, "cpu_count", lambda: cpu_count)
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        return clock_reads

    return pretend


ZEN4_SMT = {**amd("avx2 fma avx512f avx512_bf16", "25"), "siblings": "4", "cpu cores": "2"}


@pytest.mark.parametrize(
    ("info", "available", "cpu_count", "threads", "cores"),
    [
        (ZEN4_SMT, 4, 16, 8, 2),  # 4 logical CPUs, 2 SMT siblings per core: 2 cores
        (ZEN4_SMT, 4, 16, 1, 1),  # one thread uses one core
        (ZEN4_SMT, None, 8, 16, 4),  # no affinity known: the machine's CPUs
        (amd("avx2 fma avx512f", "25"), None, None, 16, 1),  # nothing known: one core
        (ZEN4_SMT, 1, 16, 16, 1),  # one CPU, half a core: still one
        (amd("avx2 fma avx512f", "25"), 3, 16, 8, 3),  # no SMT figures: every CPU a core
        ({**amd("avx2 fma avx512f", "25"), "siblings": "4"}, 8, 16, 16, 2),
        ({**amd("avx2 fma avx512f", "25"), "siblings": "3", "cpu cores": "2"}, 6, 16, 16, 6),  # 3 // 2: no SMT
    ],
)
def test_cpu_peak_counts_physical_cores_the_process_may_use(cpu, info, available, cpu_count, threads, cores):
    cpu(info, clock=(3.65e9, "test clock"), available=available, cpu_count=cpu_count, threads=threads)
    method = f"{cores} cores x 32 float32 FLOP/cycle ({ZEN4}) x 3.65 GHz (test clock)"
    assert hardware_peak("cpu", torch.float32) == PeakFlops(cores * 32 * 3.65e9, "cpu-isa-clock", method)


def test_cpu_peak_states_dtype_instruction_set_and_clock(cpu):
    cpu(intel("avx2 fma avx512f avx512_bf16"), clock=(3_005_000_001.0, "measured"), available=2, threads=2)
    assert hardware_peak(None, torch.bfloat16) == PeakFlops(
        2 * 128 * 3_005_000_001.0, "cpu-isa-clock",
        f"2 cores x 128 bfloat16 FLOP/cycle ({AVX512} + AVX512_BF16) x 3.01 GHz (measured)")
    assert hardware_peak(torch.device("cpu"), torch.float64).method.startswith("2 cores x 32 float64 FLOP/cycle")
    assert hardware_peak("cpu").method.startswith("2 cores x 64 float32 FLOP/cycle")  # float32 by default


def test_cpu_peak_unknown_says_why(cpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    clock_reads = cpu(intel("sse2"))
    assert hardware_peak("cpu", torch.float32) == PeakFlops(None, None, NONE_KNOWN)
    assert clock_reads == []  # no clock measured for an unknown instruction set
    cpu(intel("avx2 fma"), clock=(None, "clock unknown"))
    assert hardware_peak("cpu", torch.float32) == PeakFlops(None, None, "clock unknown")
    for device in ("mps", "meta", "cuda"):  # CUDA is not available here
        assert hardware_peak(device, torch.float32) == PeakFlops(None, None, f"no peak known for {device}")


def test_arm64_linux_reads_its_features_line(cpu):
    """arm64 Linux names the flags "Features" in /proc/cpuinfo; read as nothing, no NEON rate was ever found."""
    cpu(ARM, clock=(2.0e9, "test clock"), available=4, threads=4)
    assert hardware_peak("cpu", torch.float32) == PeakFlops(
        4 * 16 * 2.0e9, "cpu-isa-clock", f"4 cores x 16 float32 FLOP/cycle ({NEON}) x 2.00 GHz (test clock)")


@pytest.fixture
def gpus(monkeypatch):
    """Pretend to be a machine of several GPUs, each with its own name and capability; device 0 is current."""

    def pretend(*boards, matmul="highest", cudnn_tf32=False):
        def board(device):
            if isinstance(device, int):
                return boards[device]
            return boards[torch.device(device or "cuda").index or 0]

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: board(device)[0])
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: board(device)[1])
        monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: matmul)
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", cudnn_tf32)

    return pretend


A100 = ("NVIDIA A100-SXM4-80GB", (8, 0))
H100 = ("NVIDIA H100 80GB HBM3", (9, 0))
V100 = ("Tesla V100-SXM2-16GB", (7, 0))
L4 = ("NVIDIA L4", (8, 9))


def test_each_gpu_is_read_by_its_own_index(gpus):
    gpus(A100, H100, V100, matmul="high")
    assert hardware_peak("cuda:1", torch.bfloat16) == PeakFlops(
        989.4e12, "datasheet", "NVIDIA H100 80GB HBM3: dense bfloat16 datasheet peak")
    # the current device, an A100, allows TF32; the V100 asked for has no TF32
    assert hardware_peak("cuda:2", torch.float32) == PeakFlops(
        15.7e12, "datasheet", "Tesla V100-SXM2-16GB: dense float32 datasheet peak")
    assert hardware_peak("cuda", torch.float16).flops_per_s == 312e12  # no index: the current device


def test_gpu_peak_method_states_the_tf32_settings(gpus):
    gpus(A100, cudnn_tf32=True)
    assert hardware_peak("cuda:0", torch.float32) == PeakFlops(
        156e12, "datasheet", "NVIDIA A100-SXM4-80GB: dense tf32 datasheet peak; TF32 allowed for matmul: no, "
                             "for cuDNN convolutions: yes")
    gpus(H100, matmul="medium")
    assert hardware_peak("cuda", torch.float32).method == (
        "NVIDIA H100 80GB HBM3: dense tf32 datasheet peak; TF32 allowed for matmul: yes, for cuDNN convolutions: no")
    gpus(L4)
    assert hardware_peak("cuda", torch.float64) == PeakFlops(None, None, "no datasheet peak for NVIDIA L4 in float64")
    assert hardware_peak("cuda", torch.float32) == PeakFlops(
        30.3e12, "datasheet", "NVIDIA L4: dense float32 datasheet peak; TF32 allowed for matmul: no, "
                              "for cuDNN convolutions: no")


# -- the clock ----------------------------------------------------------------------------------------


def _executable_pages() -> bool:
    try:
        mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC).close()
    except (OSError, ValueError, AttributeError):
        return False
    return True


X86_LINUX = platform.machine().lower() in ("x86_64", "amd64") and sys.platform.startswith("linux")
needs_x86_linux = pytest.mark.skipif(not (X86_LINUX and _executable_pages()),
                                     reason="runs the x86-64 add loop: needs x86-64 Linux with executable pages")


def scripted_thread_time(monkeypatch, seconds: list[float]) -> None:
    """The module's thread clock: each run of the loop takes the next of ``seconds``; more runs fail."""
    readings = []
    for run, duration in enumerate(seconds):
        start = 100.0 * (run + 1)
        readings += [start, start + duration]
    script = iter(readings)

    def thread_time() -> float:
        reading = next(script, None)
        assert reading is not None, f"the loop ran more than {len(seconds)} times"
        return reading

    monkeypatch.setattr(flops_mod, "time", SimpleNamespace(thread_time=thread_time))


@needs_x86_linux
@pytest.mark.parametrize("machine", ["x86_64", "AMD64"])
def test_clock_is_adds_per_second_of_the_fastest_of_five_runs_after_ten_warmups(monkeypatch, machine):
    # ten warm-up runs (slow, to show they are left out), then five; the fastest, 1/64 s, comes first
    scripted_thread_time(monkeypatch, [0.001] * 10 + [0.015625, 0.03125, 0.0625, 0.03125, 0.0625])
    monkeypatch.setattr(flops_mod, "platform", SimpleNamespace(machine=lambda: machine))
    # 2,000,000 iterations of 16 adds in 1/64 s
    assert flops_mod._timed_add_loop_hz() == 2_000_000 * 16 * 64


@pytest.mark.parametrize(("machine", "system"), [("aarch64", "linux"), ("x86_64", "darwin"), ("x86_64", "win32")])
def test_clock_is_not_measured_off_x86_64_linux(monkeypatch, machine, system):
    scripted_thread_time(monkeypatch, [])
    monkeypatch.setattr(flops_mod, "platform", SimpleNamespace(machine=lambda: machine))
    monkeypatch.setattr(flops_mod, "sys", SimpleNamespace(platform=system))
    assert flops_mod._timed_add_loop_hz() is None


def test_clock_cache_file_default_folder_and_damage(monkeypatch, tmp_path):
    monkeypatch.delenv("MODELWRIGHT_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    measurements = []
    monkeypatch.setattr(flops_mod, "_timed_add_loop_hz", lambda: measurements.append(1) or 3.0e9)
    monkeypatch.setattr(flops_mod, "cpu_model", lambda: "Test CPU")
    path = tmp_path / ".cache" / "modelwright" / "cpu_clock.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"Other CPU": {"clock_hz": 2.0e9, "method": "old", "definitions": 0}}))
    assert flops_mod.cpu_clock_hz() == (3.0e9, flops_mod.CLOCK_METHOD)
    entry = {"clock_hz": 3.0e9, "definitions": DEFINITIONS_VERSION, "method": flops_mod.CLOCK_METHOD}
    expected = {"Other CPU": {"clock_hz": 2.0e9, "definitions": 0, "method": "old"}, "Test CPU": entry}
    assert path.read_text() == json.dumps(expected, indent=1, sort_keys=True)  # other machines kept, sorted
    assert flops_mod.cpu_clock_hz() == (3.0e9, flops_mod.CLOCK_METHOD) and len(measurements) == 1  # cached
    for damaged in ("{not json", "[1, 2]", "null"):
        path.write_text(damaged)
        assert flops_mod.cpu_clock_hz() == (3.0e9, flops_mod.CLOCK_METHOD)
    assert len(measurements) == 4  # each damaged file measured again
    monkeypatch.setenv("MODELWRIGHT_CACHE_DIR", "")  # empty: the default folder
    assert flops_mod.cpu_clock_hz() == (3.0e9, flops_mod.CLOCK_METHOD) and len(measurements) == 4


@pytest.mark.parametrize("damaged_entry", [{}, {"clock_hz": None}, {"clock_hz": "fast"}, {"clock_hz": -1.0},
                                           {"clock_hz": 0}, "3e9"])
def test_a_damaged_cache_entry_is_measured_again(monkeypatch, tmp_path, damaged_entry):
    monkeypatch.setenv("MODELWRIGHT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flops_mod, "_timed_add_loop_hz", lambda: 3.0e9)
    monkeypatch.setattr(flops_mod, "cpu_model", lambda: "Test CPU")
    current = {"method": flops_mod.CLOCK_METHOD, "definitions": DEFINITIONS_VERSION}
    entry = {**current, **damaged_entry} if isinstance(damaged_entry, dict) else damaged_entry
    (tmp_path / "cpu_clock.json").write_text(json.dumps({"Test CPU": entry}))
    assert flops_mod.cpu_clock_hz() == (3.0e9, flops_mod.CLOCK_METHOD)
    assert json.loads((tmp_path / "cpu_clock.json").read_text())["Test CPU"] == {"clock_hz": 3.0e9, **current}


@pytest.mark.parametrize("clock_hz", [2.5e9, 1, 0.5])
def test_a_cached_positive_clock_is_taken_without_measuring(monkeypatch, tmp_path, clock_hz):
    """Any positive number is a clock: the check is for damage (test above), not for plausibility."""
    monkeypatch.setenv("MODELWRIGHT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flops_mod, "_timed_add_loop_hz", lambda: pytest.fail("measured although cached"))
    monkeypatch.setattr(flops_mod, "cpu_model", lambda: "Test CPU")
    entry = {"method": flops_mod.CLOCK_METHOD, "definitions": DEFINITIONS_VERSION, "clock_hz": clock_hz}
    (tmp_path / "cpu_clock.json").write_text(json.dumps({"Test CPU": entry}))
    assert flops_mod.cpu_clock_hz() == (clock_hz, flops_mod.CLOCK_METHOD)


def test_clock_from_cpuinfo_when_it_cannot_be_measured(monkeypatch, tmp_path):
    monkeypatch.setenv("MODELWRIGHT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flops_mod, "_timed_add_loop_hz", lambda: None)
    monkeypatch.setattr(flops_mod, "cpuinfo", lambda: {"cpu MHz": "2450.5"})
    assert flops_mod.cpu_clock_hz() == (2450.5e6, "/proc/cpuinfo cpu MHz (not measured)")
    monkeypatch.setattr(flops_mod, "cpuinfo", lambda: {})
    assert flops_mod.cpu_clock_hz() == (None, "clock unknown")
    assert list(tmp_path.iterdir()) == []  # what was not measured is not cached


def test_an_unwritable_clock_cache_warns_and_the_clock_is_still_given(monkeypatch, tmp_path):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("MODELWRIGHT_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(flops_mod, "_timed_add_loop_hz", lambda: 3.0e9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert flops_mod.cpu_clock_hz() == (3.0e9, flops_mod.CLOCK_METHOD)
    (warning,) = caught
    assert str(warning.message).startswith(f"could not cache the CPU clock in {blocker / 'cache' / 'cpu_clock.json'}: ")
    assert Path(warning.filename).name != "flops.py"  # it points at the caller


# -- FLOPs on a meta copy -------------------------------------------------------------------------------


def test_meta_copy_keeps_frozen_weights_frozen_and_moves_buffers():
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    net[0].weight.requires_grad_(False)
    copied = meta_copy(net)
    assert [p.requires_grad for p in copied.parameters()] == [False, True, True, True, True, True]
    assert all(isinstance(p, nn.Parameter) for p in copied.parameters())
    assert {t.device.type for t in [*copied.parameters(), *copied.buffers()]} == {"meta"}
    assert [b.shape for b in copied.buffers()] == [b.shape for b in net.buffers()]
    assert {t.device.type for t in [*net.parameters(), *net.buffers()]} == {"cpu"}  # the original untouched


def test_training_flops_of_a_compiled_wrapper_count_the_network_and_print_nothing(capsys):
    b, i, o = 8, 16, 4
    net = nn.Linear(i, o)
    wrapped = torch.compile(net)  # never called: nothing is compiled
    assert type(meta_copy(wrapped)) is nn.Linear
    inner = nn.Sequential(nn.Linear(i, o))
    inner[0].compile()  # a submodule compiled in place: its copy runs eagerly
    assert inner[0].__dict__["_compiled_call_impl"] is not None
    assert not is_compiled(meta_copy(inner))
    assert training_flops(wrapped, torch.randn(b, i)) == 4 * b * i * o
    assert capsys.readouterr().out == ""


def test_training_flops_count_the_loss_given():
    b, i, o = 8, 16, 4
    net = nn.Linear(i, o)
    projection = torch.ones(o, 3, device="meta")  # a loss with a matmul of its own: 2·B·O·3 more, and its backward
    flops = training_flops(net, torch.randn(b, i), loss_fn=lambda out: (out @ projection).sum())
    assert flops == 4 * b * i * o + 2 * b * o * 3 + 2 * b * o * 3


@pytest.mark.parametrize(("entries", "isa"), [
    ({"flags": "fpu sse2 avx2 fma"}, "avx2"),
    ({"flags": "avx2 avx512f avx512_bf16"}, "avx512"),
    ({"Features": "fp asimd evtstrm aes"}, "asimd"),  # arm64 Linux names its flags line "Features"
    ({}, None),
])
def test_the_records_vector_instruction_set_is_read_from_either_flags_line(monkeypatch, entries, isa):
    from modelwright.measure import facts

    monkeypatch.setattr(facts, "cpuinfo", lambda: entries)
    assert facts.vector_isa() == isa
