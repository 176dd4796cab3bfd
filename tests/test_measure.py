"""The instrument: timers with a mocked clock, exact byte counts, an anatomy free of data and communication
artifacts, hand-computed FLOPs and the hardware peak (FLOP/cycle × clock, datasheet figures)."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

from modelwright import measure
from modelwright.measure import (
    MIB,
    MemoryAnatomy,
    StepCycle,
    StepTimer,
    Window,
    compute_dtype,
    hardware_peak,
    meta_copy,
    mfu,
    percentile,
    training_flops,
)
from modelwright.measure import flops as flops_mod
from modelwright.measure.memory import COMPILE_NOT_MEASURED
from modelwright.record import DEFINITIONS_VERSION, Hardware, Versions, schema_fields
from modelwright.techniques import apply_checkpointing
from modelwright.train.models import ResNet18, SmallCNN

# -- timing ---------------------------------------------------------------------------------------


class FakeClock:
    """A clock that advances only when told; logs when it is read, to check sync-before-read."""

    def __init__(self) -> None:
        self.now = 100.0
        self.events: list[str] = []

    def __call__(self) -> float:
        self.events.append("clock")
        return self.now

    def sync(self) -> None:
        self.events.append("sync")


def run_steps(timer: StepTimer, clock: FakeClock, durations: list[float], exclude: set[int] = frozenset()) -> None:
    for i, d in enumerate(durations):
        timer.start()
        clock.now += d
        timer.stop(exclude=i in exclude)
        clock.now += 0.5  # time between steps (data loading, validation) is never counted


def test_percentile_matches_linear_interpolation():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 90) == pytest.approx(4.6)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile([7.0], 90) == 7.0
    with pytest.raises(RuntimeError):
        percentile([], 50)


def test_step_timer_excludes_warmup_and_reports_median_p90_and_cpu_time():
    clock = FakeClock()
    timer = StepTimer(warmup_steps=2, clock=clock, sync=clock.sync)
    # Two slow warm-up steps (compile), then ten measured ones: 1.0 .. 1.9 s.
    run_steps(timer, clock, [30.0, 10.0] + [1.0 + 0.1 * i for i in range(10)])
    assert len(timer.durations_s) == 10
    assert timer.durations_s[0] == pytest.approx(1.0)
    assert timer.median_s() == pytest.approx(1.45)
    assert timer.p90_s() == pytest.approx(1.81)
    assert timer.last_s() == pytest.approx(1.9)
    s = timer.summary(samples_per_step=128)
    assert s["warmup_steps"] == 2 and s["measured_steps"] == 10
    assert s["step_time_median_ms"] == pytest.approx(1450.0)
    assert s["step_time_p90_ms"] == pytest.approx(1810.0)
    assert s["step_time_min_ms"] == pytest.approx(1000.0)
    assert s["step_time_max_ms"] == pytest.approx(1900.0)
    assert s["samples_per_s"] == pytest.approx(128 / 1.45)
    # The device is synchronized before every clock reading.
    assert clock.events[:4] == ["sync", "clock", "sync", "clock"]


def test_step_timer_window_and_exclusions():
    clock = FakeClock()
    timer = StepTimer(warmup_steps=1, measure_steps=3, clock=clock, sync=clock.sync)
    # Step 2 is excluded (an anatomy capture); steps past the window (4, 5) are not kept.
    run_steps(timer, clock, [9.0, 1.0, 50.0, 2.0, 3.0, 70.0], exclude={2})
    assert timer.durations_s == [pytest.approx(1.0), pytest.approx(2.0)]
    assert timer.steps_seen == 6
    assert not timer.in_window(0) and timer.in_window(1) and timer.in_window(3) and not timer.in_window(4)


def test_window_is_the_one_warmup_rule():
    w = Window(warmup_steps=2, measure_steps=3)
    assert [w.in_window(i) for i in range(6)] == [False, False, True, True, True, False]
    assert Window(0).in_window(10**6)
    for bad in ((-1, None), (0, 0)):
        with pytest.raises(ValueError):
            Window(*bad)


def test_step_timer_without_measured_steps_reports_none():
    clock = FakeClock()
    timer = StepTimer(warmup_steps=5, clock=clock)
    run_steps(timer, clock, [1.0, 1.0])
    s = timer.summary(samples_per_step=8)
    assert s["measured_steps"] == 0
    assert s["step_time_median_ms"] is None and s["samples_per_s"] is None
    assert timer.cpu_utilization(threads=2) is None
    with pytest.raises(RuntimeError):
        timer.stop()


class FakeEvent:
    """Stands in for torch.cuda.Event: records the fake clock; completes when ``FakeEvent.done`` says so."""

    clock: FakeClock
    done = True

    def __init__(self, enable_timing: bool = False) -> None:
        self.t: float | None = None

    def record(self) -> None:
        self.t = self.clock.now

    def query(self) -> bool:
        return FakeEvent.done

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.t - self.t) * 1e3  # milliseconds, as CUDA reports


def test_cuda_event_timer_reads_events_lazily(monkeypatch):
    clock = FakeClock()
    FakeEvent.clock = clock
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    timer = measure.CudaEventTimer(warmup_steps=1)
    FakeEvent.done = False  # the device is behind: nothing is read inside the loop
    run_steps(timer, clock, [5.0, 1.0, 2.0])
    assert len(timer._pending) == 2 and timer._durations_s == []
    assert timer.durations_s == [pytest.approx(1.0), pytest.approx(2.0)]  # waits here, once
    FakeEvent.done = True  # the device keeps up: finished steps are collected as they go
    run_steps(timer, clock, [3.0])
    assert timer._pending == [] and timer.last_s() == pytest.approx(3.0)
    assert timer.median_s() == pytest.approx(2.0)


def test_step_cycle_groups_micro_batches_by_the_step_counter():
    cycle = StepCycle()
    step, closed = 0, []
    # accumulate 3 over 7 micro-batches: the epoch's last, short cycle still steps.
    for i in range(7):
        cycle.begin(step)
        if (i + 1) % 3 == 0 or i == 6:
            step += 1
        if cycle.end(step):
            closed.append((cycle.step, cycle.micro_batches))
    assert closed == [(0, 3), (1, 3), (2, 1)]


# -- memory anatomy -------------------------------------------------------------------------------


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_anatomy_parameters_gradients_optimizer_state_are_exact_byte_counts():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    step()  # the optimizer state exists from here on
    anatomy = MemoryAnatomy("cpu")
    with anatomy.capture(model, [opt]):
        step()

    params = list(model.parameters())
    param_bytes = _nbytes(params)
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    moments = [t for s in opt.state.values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")]
    end = anatomy.end_bytes
    assert end["parameters"] == param_bytes
    assert end["gradients"] == _nbytes(p.grad for p in params) == param_bytes
    assert end["optimizer_state"] == _nbytes(state)
    # AdamW in fp32: two moments per parameter (plus a 4-byte step counter per tensor).
    assert _nbytes(moments) == 2 * param_bytes
    assert end["optimizer_state"] == 2 * param_bytes + 4 * len(params)
    peak = anatomy.peak_bytes
    assert peak["parameters"] == param_bytes
    assert peak["total"] == sum(v for k, v in peak.items() if k != "total")
    assert peak["total"] > end["total"]  # the step's transient tensors
    assert anatomy.peak_mib()["parameters"] == pytest.approx(param_bytes / MIB)
    assert anatomy.caveat is None and not anatomy.active
    assert torch._C._len_torch_dispatch_stack() == 0  # the tracker left nothing behind


def test_anatomy_keeps_forward_inside_a_closure_out_of_optimizer_state():
    # Lightning runs forward and backward inside optimizer.step(closure).
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(512, 64), torch.randint(0, 10, (512,))
    anatomy = MemoryAnatomy("cpu", explicit_optimizer_update=True)

    def closure():
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        anatomy.optimizer_update()  # where Lightning calls on_before_optimizer_step
        return loss

    opt.step(closure)
    with anatomy.capture(model, [opt]):
        opt.step(closure)
    state_bytes = _nbytes(t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    assert anatomy.end_bytes["optimizer_state"] == state_bytes
    # 512×256 fp32 hidden activations are far larger than the whole optimizer state.
    assert anatomy.peak_bytes["activations"] > 512 * 256 * 4
    assert anatomy.peak_bytes["optimizer_state"] <= 2 * state_bytes


def test_anatomy_accumulation_needs_next_micro_batch():
    model = _mlp()
    anatomy = MemoryAnatomy("cpu")
    with anatomy.capture(model):
        for i in range(3):
            if i:
                anatomy.next_micro_batch()
            model(torch.randn(8, 64)).sum().backward()
    assert anatomy.end_bytes["gradients"] == _nbytes(model.parameters())


# Peak activations of resnet18 (32×32 stem) on CPU at batch 8, forward + backward (bf16 is emulated on many CPUs).
_BATCH = 8
_anatomy_cache: dict[str, float] = {}


def _peak_activations_mib(variant: str) -> float:
    if variant in _anatomy_cache:
        return _anatomy_cache[variant]
    torch.manual_seed(0)
    model = ResNet18()
    if variant in ("stage", "block"):
        apply_checkpointing(model, variant)
    x, y = torch.randn(_BATCH, 3, 32, 32), torch.randint(0, 10, (_BATCH,))
    micro = 4 if variant == "accumulate4" else 1
    anatomy = MemoryAnatomy("cpu")
    with anatomy.capture(model):
        for i in range(micro):
            if i:
                anatomy.next_micro_batch()
            xs, ys = x.chunk(micro)[i], y.chunk(micro)[i]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant == "bf16"):
                loss = nn.functional.cross_entropy(model(xs), ys) / micro
            loss.backward()
    _anatomy_cache[variant] = anatomy.peak_mib()["activations"]
    return _anatomy_cache[variant]


@pytest.mark.parametrize(
    ("variant", "max_ratio"),
    [("stage", 0.70), ("bf16", 0.65), ("accumulate4", 0.40)],
)
def test_resnet18_peak_activations_drop(variant, max_ratio):
    base = _peak_activations_mib("fp32")
    assert base > 20  # batch 8 fp32: about 29 MiB
    ratio = _peak_activations_mib(variant) / base
    assert ratio <= max_ratio, f"{variant}: peak activations {ratio:.0%} of fp32, want <= {max_ratio:.0%}"


def test_resnet18_block_checkpointing_cuts_deeper_than_stage():
    base = _peak_activations_mib("fp32")
    stage, block = _peak_activations_mib("stage"), _peak_activations_mib("block")
    assert stage / base <= 0.70
    assert block < stage


# The dataset of the accumulation test: 2048 images, 24 MiB, fetched through a DataLoader as a run does.
_DATA_MIB = 2048 * 3 * 32 * 32 * 4 / MIB


def _smallcnn_step_anatomy(micro: int, fetch_inside: bool) -> MemoryAnatomy:
    """One optimizer step of ``micro`` micro-batches of 32 under a capture, the batches read from a TensorDataset."""
    torch.manual_seed(0)
    model = SmallCNN()
    opt = torch.optim.AdamW(model.parameters())
    loader = iter(DataLoader(TensorDataset(torch.randn(2048, 3, 32, 32), torch.randint(0, 10, (2048,))), 32))

    def step(anatomy: MemoryAnatomy | None = None, first=None) -> None:
        for i in range(micro):
            x, y = first if i == 0 and first is not None else next(loader)
            if anatomy is not None and i:
                anatomy.next_micro_batch()
            (nn.functional.cross_entropy(model(x), y) / micro).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    anatomy = MemoryAnatomy("cpu")
    first = None if fetch_inside else next(loader)
    with anatomy.capture(model, [opt]):
        step(anatomy, first)
    return anatomy


def test_accumulation_data_fetched_inside_the_capture_is_inputs_not_activations():
    # Issue 12.2: indexing a TensorDataset gives views of its whole storage; fetched inside the capture they
    # were filed as 24 MiB of activations, alive after the step.
    single = _smallcnn_step_anatomy(1, fetch_inside=False)
    accumulated = _smallcnn_step_anatomy(4, fetch_inside=True)
    act = single.peak_mib()["activations"]
    assert act > 20  # smallcnn at batch 32: about 51 MiB, so the comparison below means something
    assert accumulated.peak_mib()["activations"] == pytest.approx(act, abs=1.0)
    assert accumulated.end_mib()["activations"] < 1.0 and accumulated.caveat is None
    peak = accumulated.peak_mib()
    assert peak["inputs"] >= _DATA_MIB  # the data is reported, apart
    assert peak["total"] == pytest.approx(sum(v for k, v in peak.items() if k not in ("total", "inputs")))


def test_activations_left_after_the_step_flag_the_anatomy():
    model = _mlp()
    anatomy = MemoryAnatomy("cpu")
    with anatomy.capture(model):
        model(torch.randn(8, 64)).sum().backward()
        kept = torch.zeros(2 * MIB // 4)  # 2 MiB made inside the step and kept beyond it
    assert kept.numel() and anatomy.end_mib()["activations"] >= 2.0
    assert anatomy.caveat is not None and "MiB of activations alive after the step" in anatomy.caveat


def test_register_moves_a_tensor_out_of_activations_even_at_the_peak():
    model = _mlp()
    anatomy = MemoryAnatomy("cpu")
    with anatomy.capture(model):
        batch = torch.randn(4 * MIB // 4)  # 4 MiB, made inside: an activation until registered
        model(torch.randn(8, 64)).sum().backward()
        anatomy.register({"x": batch}, "inputs")
    assert anatomy.peak_mib()["inputs"] == pytest.approx(4.0)
    assert anatomy.peak_mib()["activations"] < 1.0 and anatomy.end_mib()["activations"] < 1.0
    with pytest.raises(ValueError, match="unknown anatomy category"):
        anatomy.register(batch, "data")


def test_a_compiled_module_is_not_measured():
    # Issue 12.4: under the tracker (a TorchDispatchMode) torch.compile runs eagerly, so its figures would be eager.
    model = _mlp()
    model.compile()
    anatomy = MemoryAnatomy("cpu")
    with anatomy.capture(model):  # running it would only spend seconds compiling
        assert not anatomy.active
    assert anatomy.peak_mib() is None and anatomy.end_mib() is None
    assert anatomy.caveat == COMPILE_NOT_MEASURED and anatomy.caveat.startswith("not measured")


def count_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_count_flops_of_a_linear_layer():
    b, i, o = 16, 32, 8
    layer = nn.Linear(i, o)
    assert count_flops(lambda: layer(torch.randn(b, i))) == 2 * b * i * o
    # Training: forward 2·B·I·O and the weight gradient 2·B·I·O; the input needs no gradient.
    assert training_flops(layer, torch.randn(b, i)) == 4 * b * i * o
    h = 64
    two = nn.Sequential(nn.Linear(i, h), nn.Linear(h, o))
    # The second layer also passes a gradient back to its input: 2·B·H·O more.
    assert training_flops(two, torch.randn(b, i)) == 4 * b * i * h + 6 * b * h * o


def test_training_flops_ignore_checkpoint_recomputation_and_leave_the_model_alone():
    x = torch.randn(4, 3, 32, 32)
    plain = SmallCNN()
    ckpt = SmallCNN()
    apply_checkpointing(ckpt, "block")
    assert training_flops(ckpt, x) == training_flops(plain, x) > 0
    copy = meta_copy(ckpt)
    assert all(p.device.type == "meta" for p in copy.parameters())
    assert all(p.device.type == "cpu" for p in ckpt.parameters())
    assert any("forward" in m.__dict__ for m in ckpt.modules())  # the original keeps its checkpointing
    assert not any("forward" in m.__dict__ for m in copy.modules())


def test_training_flops_look_through_torch_compile():
    x = torch.randn(4, 3, 32, 32)
    plain, compiled = SmallCNN(), SmallCNN()
    compiled.compile()  # never called, so nothing is compiled: the meta copy must run eagerly
    assert measure.is_compiled(compiled) and not measure.is_compiled(plain)
    assert training_flops(compiled, x) == training_flops(plain, x)


def test_compute_dtype_and_mfu():
    assert compute_dtype("bf16-mixed") is torch.bfloat16
    assert compute_dtype("bf16-true") is torch.bfloat16
    assert compute_dtype("16-mixed") is torch.float16
    assert compute_dtype("32-true") is torch.float32
    assert compute_dtype("64-true") is torch.float64
    assert compute_dtype(None) is torch.float32
    # 426 GFLOP in 3 s on a 200 GFLOP/s device: 142 GFLOP/s achieved, 71% of the peak.
    assert mfu(426e9, 3.0, 200e9) == pytest.approx(0.71)
    assert mfu(None, 3.0, 200e9) is None and mfu(426e9, 3.0, None) is None and mfu(426e9, 0.0, 200e9) is None


def test_conv_flops_match_a_hand_count():
    n, cin, cout, h, w, k = 2, 3, 8, 16, 16, 3
    conv = nn.Conv2d(cin, cout, k, padding=1, bias=False)
    forward = 2 * n * h * w * cout * cin * k * k  # a multiply-add per weight per output pixel
    assert count_flops(lambda: conv(torch.randn(n, cin, h, w))) == forward == 221_184
    # Training: forward and the weight gradient (same size); the input needs no gradient.
    assert training_flops(conv, torch.randn(n, cin, h, w)) == 2 * forward


def test_mfu_of_resnet18_step_against_the_zen4_hardware_peak():
    # The study's baseline step: 426,111,664,128 FLOPs in 2.03 s on 2 Zen 4 cores at 3.65 GHz.
    assert mfu(426_111_664_128, 2.03, 2 * 32 * 3.65e9) == pytest.approx(0.8986, abs=1e-4)


def _info(flags: str, vendor: str = "GenuineIntel", family: int = 6) -> dict:
    return {"flags": flags, "vendor_id": vendor, "cpu family": str(family)}


def test_cpu_hardware_peak_is_cores_times_flop_per_cycle_times_clock(monkeypatch, tmp_path):
    info = {**_info("avx2 fma avx512f avx512_bf16", "AuthenticAMD", 25), "siblings": "4", "cpu cores": "2"}
    monkeypatch.setattr(flops_mod, "cpuinfo", lambda: info)
    monkeypatch.setattr(flops_mod, "cpu_clock_hz", lambda: (3.65e9, "test clock"))
    monkeypatch.setattr(flops_mod, "available_cpus", lambda: 4)  # 2 cores with 2 SMT siblings each
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    peak = hardware_peak("cpu", torch.float32)
    assert peak.flops_per_s == pytest.approx(233.6e9) and peak.source == "cpu-isa-clock"
    assert "2 cores x 32 float32 FLOP/cycle" in peak.method and "3.65 GHz (test clock)" in peak.method
    assert hardware_peak("cpu", torch.bfloat16).flops_per_s == pytest.approx(467.2e9)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # SMT siblings share a core's FMA units
    assert hardware_peak("cpu", torch.float32).flops_per_s == pytest.approx(233.6e9)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # a DDP rank on half the cores
    peak = hardware_peak("cpu", torch.float32)
    assert (peak.flops_per_s, peak.source) == (pytest.approx(116.8e9), "cpu-isa-clock")


def test_the_clock_cache_carries_its_method_and_definitions(monkeypatch, tmp_path):
    monkeypatch.setenv("MODELWRIGHT_CACHE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(flops_mod, "_timed_add_loop_hz", lambda: calls.append(1) or 3.0e9)
    assert flops_mod.cpu_clock_hz() == (3.0e9, flops_mod.CLOCK_METHOD)
    assert flops_mod.cpu_clock_hz()[0] == 3.0e9 and len(calls) == 1  # cached under $MODELWRIGHT_CACHE_DIR
    path = tmp_path / "cpu_clock.json"
    cache = json.loads(path.read_text())
    (entry,) = cache.values()
    assert entry == {"clock_hz": 3.0e9, "method": flops_mod.CLOCK_METHOD, "definitions": DEFINITIONS_VERSION}
    entry["definitions"] = DEFINITIONS_VERSION - 1  # an older definition is measured again
    path.write_text(json.dumps(cache))
    flops_mod.cpu_clock_hz()
    assert len(calls) == 2


@pytest.mark.skipif(flops_mod._timed_add_loop_hz() is None, reason="needs x86-64 Linux with executable pages")
def test_measured_clock_agrees_with_the_time_stamp_counter():
    # Independent of the loop: Linux's BogoMIPS on x86 is twice the TSC rate, which runs at the base clock.
    # A running core is between a little under base and about twice base; a wrong adds-per-cycle count is not.
    bogomips = float(measure.facts.cpuinfo().get("bogomips", 0))
    if not bogomips:
        pytest.skip("no bogomips in /proc/cpuinfo")
    assert 0.8 * bogomips / 2 * 1e6 <= flops_mod._timed_add_loop_hz() <= 2.0 * bogomips / 2 * 1e6


@pytest.fixture
def gpu(monkeypatch):
    """Pretend to be a GPU of the given name and compute capability."""

    def pretend(name: str, capability=(9, 0), matmul="highest", cudnn_tf32=False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: matmul)
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", cudnn_tf32)

    return pretend


def test_gpu_peak_is_the_dense_datasheet_figure_with_tf32_stated(gpu):
    gpu("NVIDIA H200")
    peak = hardware_peak("cuda", torch.bfloat16)
    assert (peak.flops_per_s, peak.source) == (989.4e12, "datasheet")  # dense, not the 2-sparsity 1979
    assert hardware_peak("cuda", torch.float32).flops_per_s == 66.9e12
    assert "TF32 allowed for matmul: no, for cuDNN convolutions: no" in hardware_peak("cuda", torch.float32).method
    gpu("NVIDIA H100 80GB HBM3", matmul="high")
    assert hardware_peak("cuda", torch.float32).flops_per_s == 494.7e12
    gpu("NVIDIA A100-SXM4-80GB", capability=(8, 0), cudnn_tf32=True)
    peak = hardware_peak("cuda", torch.float32)
    assert peak.flops_per_s == 156e12 and "cuDNN convolutions: yes" in peak.method
    gpu("Tesla V100-SXM2-16GB", capability=(7, 0), matmul="high")
    assert hardware_peak("cuda", torch.float32).flops_per_s == 15.7e12  # no TF32 before Ampere
    for unknown in ("NVIDIA L40S", "NVIDIA H100 NVL"):
        gpu(unknown)
        peak = hardware_peak("cuda", torch.bfloat16)
        assert (peak.flops_per_s, peak.source) == (None, None) and unknown in peak.method


_H100_SXM = {"float64": 33.5, "float32": 66.9, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4}
_A100 = {"float64": 9.7, "float32": 19.5, "tf32": 156, "bfloat16": 312, "float16": 312}
#: Every GPU of the peak table by the name torch reports, its compute capability, and its dense peaks in
#: TFLOP/s as NVIDIA publishes them (a figure given only with 2:4 sparsity, marked *, halved); {}: a variant
#: the table leaves out rather than guess.
DATASHEETS = {
    # NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022), table 3, H100 SXM5
    "NVIDIA H100 80GB HBM3": ((9, 0), _H100_SXM),
    # NVIDIA H200 and GH200 datasheets: H100 SXM's compute (FP64 34, FP32 67, TF32 989*, BF16/FP16 1979*)
    "NVIDIA H200": ((9, 0), _H100_SXM),
    "NVIDIA GH200 480GB": ((9, 0), _H100_SXM),
    # the same whitepaper, table 3, H100 PCIe
    "NVIDIA H100 PCIe": ((9, 0), {"float64": 25.6, "float32": 51.2, "tf32": 378, "bfloat16": 756,
                                  "float16": 756}),
    # NVL boards: another clock and power; not in the table
    "NVIDIA H100 NVL": ((9, 0), {}),
    "NVIDIA H200 NVL": ((9, 0), {}),
    # NVIDIA A100 datasheet (2021): the same figures for SXM4 and PCIe, 40 and 80 GB
    "NVIDIA A100-SXM4-80GB": ((8, 0), _A100),
    "NVIDIA A100-PCIE-40GB": ((8, 0), _A100),
    # NVIDIA L4 datasheet: FP32 30.3, TF32 120*, BF16 242*, FP16 242*; no FP64 figure
    "NVIDIA L4": ((8, 9), {"float32": 30.3, "tf32": 60, "bfloat16": 121, "float16": 121}),
    # NVIDIA V100 datasheet: V100 for NVLink (SXM2), V100 PCIe, V100S PCIe: FP64, FP32, Tensor (FP16)
    "Tesla V100-SXM2-16GB": ((7, 0), {"float64": 7.8, "float32": 15.7, "float16": 125}),
    "Tesla V100-PCIE-32GB": ((7, 0), {"float64": 7, "float32": 14, "float16": 112}),
    "Tesla V100S-PCIE-32GB": ((7, 0), {"float64": 8.2, "float32": 16.4, "float16": 130}),
    # NVIDIA T4 datasheet: FP32 8.1, mixed precision FP16/FP32 65; no FP64 figure
    "Tesla T4": ((7, 5), {"float32": 8.1, "float16": 65}),
}


def test_every_gpu_of_the_peak_table_has_its_datasheet_peaks(gpu):
    """Each entry of the table, in every dtype (TF32: float32 with TF32 allowed, from Ampere on), against
    NVIDIA's figure; a new entry must bring a device here."""
    patterns = [pattern for pattern, _ in flops_mod._GPU_PEAKS]
    # the entry each device finds (the first whose pattern matches its name, as the lookup does)
    reached = {next((p for p in patterns if re.search(p, name.lower())), None) for name in DATASHEETS}
    assert set(patterns) <= reached, f"no device of DATASHEETS reaches {set(patterns) - reached}"
    wrong = []
    for name, (capability, tflops) in DATASHEETS.items():
        for key in ("float64", "float32", "tf32", "bfloat16", "float16"):
            tf32 = key == "tf32"
            gpu(name, capability=capability, matmul="high" if tf32 else "highest")
            expected = tflops.get(key)
            if tf32 and capability < (8, 0):
                expected = tflops.get("float32")  # no TF32 before Ampere: float32's peak
            dtype = torch.float32 if tf32 else getattr(torch, key)
            peak = hardware_peak("cuda", dtype).flops_per_s
            if peak != (None if expected is None else pytest.approx(expected * 1e12)):
                wrong.append(f"{name} {key}: {peak} != {expected} TFLOP/s")
    assert wrong == []


def test_hardware_and_versions_cover_the_schema():
    hw = measure.hardware_info("cpu", num_devices=1)
    assert {key for key, *_ in schema_fields(Hardware)} <= set(hw)
    assert hw["accelerator"] == "cpu" and hw["cpu_cores"] >= 1 and hw["device_memory_mib"] > 0
    v = measure.versions()
    assert {key for key, *_ in schema_fields(Versions)} <= set(v)
    assert v["torch"] == torch.__version__


def test_cuda_helpers_are_noops_on_cpu():
    assert measure.reset_peak_memory("cpu") is False
    assert measure.peak_memory_mib("cpu") == {"peak_allocated_mib": None, "peak_reserved_mib": None}
    rss = measure.process_rss_peak_mib()
    if sys.platform.startswith("linux"):  # ru_maxrss is in KiB on Linux: this process holds torch, > 100 MiB
        assert rss > 100
    elif rss is not None:
        assert rss > 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_window_and_event_timer():
    dev = torch.device("cuda")
    big = torch.empty(64 * MIB, dtype=torch.uint8, device=dev)
    del big
    assert measure.reset_peak_memory(dev)
    small = torch.empty(MIB, dtype=torch.uint8, device=dev)
    peak = measure.peak_memory_mib(dev)["peak_allocated_mib"]
    assert 1 <= peak < 64
    del small
    timer = measure.CudaEventTimer(warmup_steps=1)
    a = torch.randn(2048, 2048, device=dev)
    for _ in range(3):
        timer.start()
        a @ a
        timer.stop()
    assert len(timer.durations_s) == 2 and timer.median_s() > 0




# -- the step probe -------------------------------------------------------------------------------


def _probe_steps(probe: measure.StepProbe, steps: int, micro_batches: int = 1, in_an_epoch: bool = False) -> None:
    """``steps`` optimizer steps of a tiny network through ``probe``, as a loop calls it (``in_an_epoch``: all
    of them inside one training epoch the probe is told of)."""
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    probe.start(device="cpu", precision="32-true", modules=[net], optimizers=[optimizer],
                micro_batches_per_step=micro_batches)
    if in_an_epoch:
        probe.epoch_begins()
    step = 0
    for micro in range(steps * micro_batches):
        x = torch.randn(8, 4)
        probe.before_micro_batch(step, (x,))
        loss = net(x).square().mean()
        probe.observe_loss(loss, 0, micro)
        loss.backward()
        if (micro + 1) % micro_batches == 0:
            probe.before_update(optimizer)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
        probe.after_micro_batch(step)
    probe.stop()


def test_the_probe_resets_the_allocator_peak_when_the_window_opens(monkeypatch):
    """On CUDA the peak must cover the window only: the reset is a no-op on a CPU, so a spy checks when it runs."""
    from modelwright.measure import probe as probe_module

    resets = []
    monkeypatch.setattr(probe_module, "reset_peak_memory", lambda device: resets.append(device))
    probe = measure.StepProbe(warmup_steps=2, anatomy=False, peak_flops_per_s=1e12)
    calls_at_step = []
    original = probe.before_micro_batch

    def before(step, batch):
        original(step, batch)
        calls_at_step.append((step, len(resets)))

    monkeypatch.setattr(probe, "before_micro_batch", before)
    _probe_steps(probe, steps=5)
    assert [count for _, count in calls_at_step] == [0, 0, 1, 1, 1], "once, as step 2 (the first measured) begins"


def test_skip_stops_the_run_only_past_max_skipped_steps():
    watch = measure.LossWatch(on_nonfinite="skip", max_skipped_steps=2)
    net = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(2):  # two skipped steps are allowed
        watch.step_begins(net)
        watch.observe(torch.tensor(float("nan")), step, 0, step)
        watch.before_update(optimizer, net, reduce=lambda t: t)
    assert watch.skipped_steps == 2 and watch.skipped_at == [0, 1] and not watch.diverged
    watch.step_begins(net)
    watch.observe(torch.tensor(float("inf")), 2, 0, 2)
    with pytest.raises(measure.NonFiniteLossError, match="3 steps skipped, max_skipped_steps=2"):
        watch.before_update(optimizer, net, reduce=lambda t: t)
    assert watch.diverged_at_step == 2


def test_an_epoch_counts_as_whole_only_with_every_step_it_expected():
    """An epoch begun midway by a resume, or ended early by max_steps, is not a time per epoch."""
    for expected, whole in ((3, True), (4, False), (None, False)):
        probe = measure.StepProbe(warmup_steps=1, anatomy=False, peak_flops_per_s=1e12)
        _probe_steps(probe, steps=3, in_an_epoch=True)
        probe.epoch_ends(expected)
        assert (probe.last_epoch is not None) is whole, expected
        if whole:
            assert probe.last_epoch.steps == 3 and probe.last_epoch.seconds > 0


def test_flops_leave_out_the_gradients_of_weights_frozen_after_the_copy_was_made():
    """The probe copies the network to the meta device before the techniques apply; a frozen backbone ran at
    "110% MFU" because its weight gradients were still counted."""
    from modelwright.measure.flops import meta_copy, training_flops
    from modelwright.measure.probe import _mirror_trainable
    from modelwright.techniques import freeze
    from modelwright.train.models import SmallCNN

    live = SmallCNN()
    copied = meta_copy(live)
    example = torch.zeros(4, 3, 32, 32)
    full = training_flops(copied, example)
    freeze(live, ["stages"])
    holder = torch.nn.Module()  # the probe is given the LightningModule, which holds the network as .net
    holder.net = live
    _mirror_trainable(holder, copied)
    frozen = training_flops(copied, example)
    assert frozen < full
    assert [p.requires_grad for p in copied.parameters()] == [p.requires_grad for p in live.parameters()]
