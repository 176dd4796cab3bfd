"""measure.py and record.py: timers with a mocked clock, exact byte counts, activation savings, FLOPs,
the peak-FLOPs source and the run record's schema and files."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from modelwright import measure
from modelwright.measure import (
    MIB,
    MemoryAnatomy,
    StepCycle,
    StepTimer,
    compute_dtype,
    count_flops,
    meta_copy,
    mfu,
    percentile,
    resolve_peak_flops,
    training_flops,
)
from modelwright.train.models import apply_gradient_checkpointing, build_model
from modelwright.record import (
    SCHEMA,
    RecordError,
    append_record,
    check_record,
    new_record,
    read_record,
    read_records,
    validate_record,
    write_record,
)

REPO = Path(__file__).resolve().parents[1]


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
    with pytest.raises(ValueError):
        percentile([], 50)


def test_step_timer_excludes_warmup_and_reports_median_p90_epoch_time():
    clock = FakeClock()
    timer = StepTimer(warmup_steps=2, clock=clock, sync=clock.sync)
    # Two slow warm-up steps (compile), then ten measured ones: 1.0 .. 1.9 s.
    run_steps(timer, clock, [30.0, 10.0] + [1.0 + 0.1 * i for i in range(10)])
    assert timer.measured_steps == 10
    assert timer.durations_s[0] == pytest.approx(1.0)
    assert timer.median_s() == pytest.approx(1.45)
    assert timer.p90_s() == pytest.approx(1.81)
    assert timer.epoch_time_s(steps_per_epoch=32) == pytest.approx(32 * 1.45)
    assert timer.samples_per_s(samples_per_step=128) == pytest.approx(128 / 1.45)
    s = timer.summary(steps_per_epoch=32, samples_per_step=128)
    assert s["warmup_steps"] == 2 and s["measured_steps"] == 10
    assert s["step_time_median_ms"] == pytest.approx(1450.0)
    assert s["step_time_p90_ms"] == pytest.approx(1810.0)
    assert s["step_time_min_ms"] == pytest.approx(1000.0)
    assert s["step_time_max_ms"] == pytest.approx(1900.0)
    assert s["epoch_time_s"] == pytest.approx(46.4)
    # The device is synchronized before every clock reading.
    assert clock.events[:4] == ["sync", "clock", "sync", "clock"]


def test_step_timer_window_and_exclusions():
    clock = FakeClock()
    timer = StepTimer(warmup_steps=1, measure_steps=3, clock=clock, sync=clock.sync)
    # Step 2 is excluded (an anatomy capture); steps past the window (4, 5) are not kept.
    run_steps(timer, clock, [9.0, 1.0, 50.0, 2.0, 3.0, 70.0], exclude={2})
    assert timer.durations_s == [pytest.approx(1.0), pytest.approx(2.0)]
    assert timer.excluded_steps == 1
    assert timer.steps_seen == 6
    assert not timer.in_window(0) and timer.in_window(1) and timer.in_window(3) and not timer.in_window(4)


def test_step_timer_without_measured_steps_reports_none():
    clock = FakeClock()
    timer = StepTimer(warmup_steps=5, clock=clock)
    run_steps(timer, clock, [1.0, 1.0])
    s = timer.summary(steps_per_epoch=10, samples_per_step=8)
    assert s["measured_steps"] == 0
    assert s["step_time_median_ms"] is None and s["epoch_time_s"] is None and s["samples_per_s"] is None
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
    assert anatomy.category_max_bytes["activations"] > 0
    assert anatomy.peak_mib()["parameters"] == pytest.approx(param_bytes / MIB)
    assert anatomy.category_max_bytes["total"] == peak["total"]
    assert not anatomy.active
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
    assert anatomy.category_max_bytes["activations"] > 512 * 256 * 4
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


# Peak activations of resnet18 (32×32 stem) on CPU at batch 32, forward + backward.
_BATCH = 32
_anatomy_cache: dict[str, float] = {}


def _peak_activations_mib(variant: str) -> float:
    if variant in _anatomy_cache:
        return _anatomy_cache[variant]
    torch.manual_seed(0)
    model = build_model("resnet18")
    if variant in ("stage", "block"):
        apply_gradient_checkpointing(model, variant)
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
    assert base > 50  # batch 32 fp32: about 134 MiB
    ratio = _peak_activations_mib(variant) / base
    assert ratio <= max_ratio, f"{variant}: peak activations {ratio:.0%} of fp32, want <= {max_ratio:.0%}"


def test_resnet18_block_checkpointing_cuts_deeper_than_stage():
    base = _peak_activations_mib("fp32")
    stage, block = _peak_activations_mib("stage"), _peak_activations_mib("block")
    assert stage / base <= 0.70
    assert block < stage


# -- FLOPs and peak FLOP/s ------------------------------------------------------------------------


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
    plain = build_model("smallcnn")
    ckpt = build_model("smallcnn")
    apply_gradient_checkpointing(ckpt, "block")
    assert training_flops(ckpt, x) == training_flops(plain, x) > 0
    copy = meta_copy(ckpt)
    assert all(p.device.type == "meta" for p in copy.parameters())
    assert all(p.device.type == "cpu" for p in ckpt.parameters())
    assert any("forward" in m.__dict__ for m in ckpt.modules())  # the original keeps its checkpointing
    assert not any("forward" in m.__dict__ for m in copy.modules())


def test_training_flops_look_through_torch_compile():
    x = torch.randn(4, 3, 32, 32)
    plain, compiled = build_model("smallcnn"), build_model("smallcnn")
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
    assert mfu(426e9, 3.0, 238e9) == pytest.approx(426e9 / 3.0 / 238e9)
    assert mfu(None, 3.0, 238e9) is None and mfu(426e9, 3.0, None) is None


def test_peak_flops_sources_in_order_and_the_measured_peak_is_cached(tmp_path, monkeypatch):
    cache = tmp_path / "peak_flops.json"
    calls = []

    def fake_measure(device, dtype, n=None, **_):
        calls.append((str(device), dtype, n))
        return 1.5e11 if dtype is torch.float32 else 0.8e11

    monkeypatch.setattr(measure, "measure_matmul_peak", fake_measure)
    assert resolve_peak_flops("cpu", torch.float32, table_value=9e14, config_value=1e11) == (9e14, "lightning-table")
    assert resolve_peak_flops("cpu", torch.float32, config_value=1e11) == (1e11, "config")
    assert resolve_peak_flops("cpu", torch.float32, measure=False) == (None, None)
    got = resolve_peak_flops("cpu", torch.float32, cache_path=cache)
    assert got == (1.5e11, "measured-matmul")
    assert resolve_peak_flops("cpu", torch.float32, cache_path=cache) == got  # from the cache
    # On a CPU a bf16 run is held to the faster of the bf16 and fp32 matmul peaks.
    assert resolve_peak_flops("cpu", torch.bfloat16, cache_path=cache) == (1.5e11, "measured-matmul")
    assert len(calls) == 2  # once per dtype
    keys = json.loads(cache.read_text())
    assert any("|float32|" in k for k in keys) and any("|bfloat16|" in k for k in keys)


def test_measured_matmul_peak_is_plausible():
    flops = measure.measure_matmul_peak("cpu", torch.float32, n=256, repeats=3)
    assert 1e8 < flops < 1e14


def test_hardware_and_versions_cover_the_schema():
    hw = measure.hardware_info("cpu", num_devices=1)
    assert set(SCHEMA["hardware"]) <= set(hw)
    assert hw["accelerator"] == "cpu" and hw["cpu_cores"] >= 1 and hw["device_memory_mib"] > 0
    v = measure.versions()
    assert set(SCHEMA["versions"]) <= set(v)
    assert v["torch"] == torch.__version__


def test_cuda_helpers_are_noops_on_cpu():
    assert measure.reset_peak_memory("cpu") is False
    assert measure.peak_memory_mib("cpu") == {"peak_allocated_mib": None, "peak_reserved_mib": None}
    rss = measure.process_rss_peak_mib()
    assert rss is None or rss > 1


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
    assert timer.measured_steps == 2 and timer.median_s() > 0


# -- the run record -------------------------------------------------------------------------------


def _full_record() -> dict:
    r = new_record(run_id="r-1")
    r["config"] = {"trainer": {"precision": "16-mixed"}}
    r["techniques"].update(
        model_name="resnet18",
        precision="bf16-mixed",
        precision_requested="16-mixed",
        accumulate_grad_batches=4,
        gradient_checkpointing="block",
        optimizer="adamw",
        optimizer_impl="torch.optim.AdamW[for-loop]",
        channels_last=False,
        compile=False,
        strategy="ddp",
        world_size=2,
        num_nodes=1,
        micro_batch_size=32,
        effective_batch_size=256,
    )
    r["hardware"].update(measure.hardware_info("cpu", num_devices=2))
    r["versions"].update(measure.versions())
    r["timing"].update(
        warmup_steps=2,
        measured_steps=10,
        step_time_median_ms=3000.0,
        step_time_p90_ms=3100.0,
        step_time_min_ms=2900.0,
        step_time_max_ms=3200.0,
        steps_per_epoch=16,
        epoch_time_s=48.0,
        samples_per_s=85.3,
        wall_time_s=60.0,
    )
    r["flops"].update(
        flops_per_step=426e9,
        achieved_flops_per_s=142e9,
        peak_flops_per_s=135e9,
        peak_flops_source="measured-matmul",
        mfu=1.05,
    )
    r["memory"].update(
        peak_allocated_mib=363.0,
        peak_reserved_mib=None,
        anatomy_step=2,
        anatomy_mib={
            "parameters": 42.6,
            "buffers": 0.0,
            "gradients": 42.6,
            "optimizer_state": 85.3,
            "activations": 180.0,
            "temporaries": 12.5,
            "other": 0.0,
            "total": 363.0,
        },
        model_parameters=11_173_962,
        rss_peak_mib=1500.0,
    )
    r["metrics"].update({"train/loss": 1.2, "train/acc": 0.6, "val/loss": 1.3, "val/acc": 0.55})
    r["history"] = {"train/loss": [[4, 2.0], [8, 1.2]], "val/acc": [[8, 0.55]]}
    return r


def test_new_and_full_records_validate():
    assert validate_record(new_record()) == []
    check_record(_full_record())


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.pop("timing"), "timing: missing"),
        (lambda r: r["timing"].pop("step_time_median_ms"), "timing.step_time_median_ms: missing"),
        (lambda r: r.update(status="crashed"), "status:"),
        (lambda r: r.update(schema_version=2), "schema_version:"),
        (lambda r: r["timing"].update(step_time_median_ms="3 s"), "timing.step_time_median_ms: expected"),
        (lambda r: r["memory"].update(peak_allocated_mib=-1.0), "negative"),
        (lambda r: r["memory"]["anatomy_mib"].pop("activations"), "anatomy_mib.activations: missing"),
        (lambda r: r["flops"].update(peak_flops_source="guess"), "peak_flops_source"),
        (lambda r: r["techniques"].update(effective_batch_size=128), "effective_batch_size"),
        (lambda r: r["techniques"].update(world_size=True), "world_size"),
        (lambda r: r.update(status="failed", error=None), "error:"),
        (lambda r: r["history"]["train/loss"].append([3, 1.0]), "history.train/loss[2]"),
        (lambda r: r["metrics"].update({"val/acc": float("nan")}), "non-finite"),
    ],
)
def test_invalid_records_are_reported(mutate, message):
    r = _full_record()
    mutate(r)
    errors = validate_record(r)
    assert any(message in e for e in errors), errors
    with pytest.raises(RecordError):
        check_record(r)


def test_write_record_is_atomic_and_refuses_invalid_records(tmp_path):
    path = tmp_path / "runs" / "record.json"
    record = _full_record()
    record["metrics"]["train/loss"] = float("nan")  # a diverged loss: written as null
    write_record(path, record)
    back = read_record(path)
    assert back["metrics"]["train/loss"] is None and back["run_id"] == "r-1"
    bad = _full_record()
    bad["status"] = "crashed"
    with pytest.raises(RecordError):
        write_record(path, bad)
    assert read_record(path)["status"] == "ok"  # the old file is untouched
    assert sorted(p.name for p in path.parent.iterdir()) == ["record.json"]  # no temp files left


def test_append_and_read_records_skip_damaged_lines(tmp_path):
    path = tmp_path / "records.jsonl"
    for i in range(3):
        r = _full_record()
        r["run_id"] = f"r-{i}"
        append_record(path, r)
    text = path.read_text()
    assert text.count("\n") == 3 and all(json.loads(line) for line in text.splitlines())
    with path.open("a") as f:
        f.write('{"run_id": "torn", "status": "o\n')  # a torn write
        f.write("[1, 2]\n")
    append_record(path, _full_record())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = read_records(path)
    assert [r["run_id"] for r in records] == ["r-0", "r-1", "r-2", "r-1"]
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert "records.jsonl:4: skipped damaged" in messages[0]
    assert "records.jsonl:5: skipped" in messages[1]


def test_schema_document_names_every_key():
    doc = (REPO / "docs" / "record-schema.md").read_text()

    def keys(spec, prefix=""):
        for k, v in spec.items():
            yield prefix + k
            if isinstance(v, dict):
                yield from keys(v, prefix + k + ".")

    missing = [k for k in keys(SCHEMA) if f"`{k.split('.')[-1]}`" not in doc]
    assert not missing, f"docs/record-schema.md lacks {missing}"


def test_cpu_peak_is_the_fastest_of_blas_matmul_and_onednn_convolutions(monkeypatch):
    """On a CPU whose BLAS sgemm is slow a convolution sets the peak (and vice versa): the best FLOP/s wins."""
    gen = torch.Generator().manual_seed(0)
    kernels = measure._gemm_kernels(torch.device("cpu"), torch.float32, 128, gen)
    assert set(kernels) == {"matmul", "conv1x1", "conv3x3"}
    assert kernels["matmul"][0]().shape == (128, 128) and kernels["matmul"][1] == 2 * 128**3
    assert kernels["conv1x1"][0]().shape == (1, 128, 32, 4) and kernels["conv1x1"][1] == 2 * 128**3
    # 3×3 over 128 pixels with 32 channels in and out: 2 · pixels · (32·9) · 32 FLOPs
    assert kernels["conv3x3"][0]().shape == (1, 32, 32, 4) and kernels["conv3x3"][1] == 2 * 128 * 32 * 9 * 32

    for seconds, fastest in (({"matmul": 0.5, "conv1x1": 2.0, "conv3x3": 2.0}, 1.0 / 0.5),
                             ({"matmul": 2.0, "conv1x1": 4.0, "conv3x3": 0.25}, 0.5 / 0.25)):
        flops = {"matmul": 1.0, "conv1x1": 1.0, "conv3x3": 0.5}
        clock = _KernelClock(seconds, flops)
        monkeypatch.setattr(measure, "_gemm_kernels", clock.kernels)
        got = measure.measure_matmul_peak("cpu", torch.float32, n=128, repeats=2, clock=clock)
        assert got == pytest.approx(fastest)


class _KernelClock:
    """A clock whose reading advances by the duration of the kernel last run, at each stop of a start/stop pair."""

    def __init__(self, durations: dict[str, float], flops: dict[str, float]) -> None:
        self.durations, self.flops, self.t, self.running, self.starting = durations, flops, 0.0, None, True

    def kernels(self, device, dtype, n, gen):
        def make(name):
            def run():
                self.running = name
            return run
        return {name: (make(name), self.flops[name]) for name in self.durations}

    def __call__(self) -> float:
        if not self.starting:
            self.t += self.durations[self.running]
        self.starting = not self.starting
        return self.t
