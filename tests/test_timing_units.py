"""Step timing by hand: every figure of a :class:`StepTimer` on injected clocks (the step clock, the process CPU
clock and the host clock), the warm-up window's edges and errors, the CUDA event timer on fake events, the
device synchronisation chosen per device type, and the grouping of micro-batches into optimizer steps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from modelwright.measure import timing
from modelwright.measure.timing import CudaEventTimer, StepCycle, StepTimer, Window, device_sync


class Clocks:
    """The three clocks a StepTimer reads, each advanced by hand: the step clock, the process's CPU time and the
    host's wall clock (``time.perf_counter`` inside the module)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.step = 1000.0
        self.cpu = 50.0
        self.host = 7.0
        monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: self.host))

    def timer(self, warmup_steps: int, measure_steps: int | None = None) -> StepTimer:
        return StepTimer(warmup_steps, measure_steps, clock=lambda: self.step, cpu_clock=lambda: self.cpu)

    def run(self, timer: StepTimer, step_s: float, cpu_s: float, host_s: float, exclude: bool = False):
        """One step that lasts ``step_s`` on the step clock and ``host_s`` on the host's, using ``cpu_s`` of CPU;
        then a pause between steps that no figure may count."""
        timer.start()
        self.step += step_s
        self.cpu += cpu_s
        self.host += host_s
        stopped = timer.stop(exclude=True) if exclude else timer.stop()  # a plain stop() measures the step
        self.step += 100.0
        self.cpu += 100.0
        self.host += 100.0
        return stopped


def test_stop_returns_each_measured_steps_duration_and_sums_cpu_and_host_time(monkeypatch):
    clocks = Clocks(monkeypatch)
    timer = clocks.timer(warmup_steps=1)
    returned = [clocks.run(timer, 9.0, 9.0, 9.0)]  # the warm-up step
    returned += [clocks.run(timer, step, cpu, host) for step, cpu, host in ((2.0, 3.0, 2.5), (4.0, 1.0, 4.5),
                                                                            (8.0, 6.0, 8.5))]
    assert returned == [None, 2.0, 4.0, 8.0]
    assert timer.durations_s == [2.0, 4.0, 8.0] and timer.last_s() == 8.0 and timer.steps_seen == 4
    assert (timer.cpu_s, timer.host_s) == (10.0, 15.5)  # 3 + 1 + 6 and 2.5 + 4.5 + 8.5: the pauses left out
    assert timer.cpu_utilization(threads=1) == 10.0 / 15.5
    assert timer.cpu_utilization(threads=2) == 10.0 / 31.0
    assert timer.cpu_utilization(threads=0) is None


def test_summary_figures_in_milliseconds(monkeypatch):
    clocks = Clocks(monkeypatch)
    timer = clocks.timer(warmup_steps=1)
    for seconds in (50.0, 0.25, 0.5, 1.0, 0.75):
        clocks.run(timer, seconds, 0.0, seconds)
    # measured: 0.25, 0.5, 1.0, 0.75 s; median 0.625 s, p90 = 0.75 + 0.7 x 0.25 = 0.925 s
    assert timer.summary(samples_per_step=40) == {
        "warmup_steps": 1, "measured_steps": 4, "step_time_median_ms": 625.0,
        "step_time_p90_ms": pytest.approx(925.0), "step_time_min_ms": 250.0, "step_time_max_ms": 1000.0,
        "samples_per_s": 64.0,
    }
    assert timer.summary()["samples_per_s"] is None  # the global batch not known
    assert (timer.median_s(), timer.p90_s()) == (0.625, pytest.approx(0.925))


def test_a_timer_before_any_measured_step_has_no_figures(monkeypatch):
    clocks = Clocks(monkeypatch)
    timer = clocks.timer(warmup_steps=1)
    with pytest.raises(RuntimeError, match=r"^StepTimer\.stop\(\) without start\(\)$"):
        timer.stop()  # not even a warm-up step was started
    assert (timer.steps_seen, timer.cpu_s, timer.host_s, timer.durations_s) == (0, 0.0, 0.0, [])
    assert (timer.last_s(), timer.median_s(), timer.p90_s(), timer.cpu_utilization(1)) == (None, None, None, None)
    assert timer.summary(samples_per_step=8) == {
        "warmup_steps": 1, "measured_steps": 0, "step_time_median_ms": None, "step_time_p90_ms": None,
        "step_time_min_ms": None, "step_time_max_ms": None, "samples_per_s": None,
    }


def test_excluded_and_cancelled_steps_are_not_measured(monkeypatch):
    clocks = Clocks(monkeypatch)
    timer = clocks.timer(warmup_steps=0, measure_steps=3)
    assert clocks.run(timer, 5.0, 5.0, 5.0, exclude=True) is None  # an anatomy capture: seen, not measured
    timer.start()
    timer.cancel()  # a fit stopped mid-step
    with pytest.raises(RuntimeError, match=r"^StepTimer\.stop\(\) without start\(\)$"):
        timer.stop()
    assert clocks.run(timer, 1.0, 1.0, 1.0) == 1.0
    with pytest.raises(RuntimeError, match=r"^StepTimer\.stop\(\) without start\(\)$"):
        timer.stop()  # a step is stopped once
    assert (timer.durations_s, timer.steps_seen, timer.cpu_s, timer.host_s) == ([1.0], 2, 1.0, 1.0)
    assert [timer.in_window(step) for step in range(5)] == [True, True, True, False, False]
    assert timer.in_window()  # the next step, the third seen, is in the window of three
    clocks.run(timer, 2.0, 2.0, 2.0)
    assert not timer.in_window() and clocks.run(timer, 3.0, 3.0, 3.0) is None  # past the window
    assert timer.durations_s == [1.0, 2.0] and timer.steps_seen == 4


def test_percentiles_keep_microseconds_of_second_long_steps():
    """Float64 throughout: in float32 a 1 s step carries only about 0.1 µs, and a median of two such steps
    would come out rounded."""
    assert timing.percentile([1.000001, 1.000002], 50) == pytest.approx(1.0000015, rel=1e-12, abs=0)
    assert timing.percentile([1.000001, 1.000002, 1.000004], 90) == pytest.approx(1.0000036, rel=1e-12, abs=0)


def test_a_timer_warms_up_two_steps_unless_told():
    assert StepTimer().window == Window(2, None) == CudaEventTimer().window
    assert CudaEventTimer(3, 4).window == Window(3, 4)


def test_window_errors_name_both_settings():
    assert Window(0, 1).in_window(0) and not Window(0, 1).in_window(1)
    assert Window(3).in_window(3) and not Window(3).in_window(2)
    message = "warmup_steps must be >= 0 and measure_steps >= 1 or None, got -1 and None"
    with pytest.raises(ValueError, match=f"^{message}$"):
        Window(-1)
    with pytest.raises(ValueError, match="^warmup_steps must be >= 0 and measure_steps >= 1 or None, got 0 and 0$"):
        Window(0, 0)


class Event:
    """Stands in for torch.cuda.Event: stamps the time it was recorded at; like CUDA, it can be timed only if
    created with ``enable_timing=True``; it is complete once ``Event.done`` says so."""

    now = 0.0
    done = True

    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing
        self.stamp: float | None = None

    def record(self) -> None:
        self.stamp = Event.now

    def query(self) -> bool:
        return Event.done

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: Event) -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'")
        return (end.stamp - self.stamp) * 1e3  # milliseconds, as CUDA reports


def test_cuda_event_timer_keeps_its_window_and_reads_events_in_order(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(Event, "done", False)  # the device is behind the host for the whole run
    timer = CudaEventTimer(warmup_steps=1, measure_steps=2)
    for seconds in (9.0, 0.5, 2.0, 30.0):
        timer.start()
        Event.now += seconds
        assert timer.stop() is None  # never known at stop: the host does not wait
        Event.now += 1.0
    assert len(timer._pending) == 2
    assert timer.durations_s == [0.5, 2.0] and timer._pending == []  # read once asked for, in step order
    assert timer.summary()["step_time_max_ms"] == 2000.0


def test_device_sync_waits_for_the_devices_own_queue(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.mps, "synchronize", lambda: calls.append("mps"))
    monkeypatch.setattr(torch.xpu, "synchronize", lambda device: calls.append(device))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: calls.append(device))
    for device in (None, "cpu", "meta"):
        assert device_sync(device)() is None
    assert calls == []
    device_sync("mps")()
    device_sync("xpu:1")()
    device_sync("cuda:1")()  # CUDA is not available here: nothing to wait for
    assert calls == ["mps", torch.device("xpu:1")]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    device_sync("cuda:1")()
    device_sync(torch.device("cuda", 0))()
    assert calls[2:] == [torch.device("cuda:1"), torch.device("cuda:0")]


def test_step_cycle_counts_cycles_and_their_micro_batches():
    cycle = StepCycle()
    assert (cycle.open, cycle.step, cycle.micro_batches, cycle.cycles) == (False, None, 0, 0)
    assert not cycle.end(5)  # nothing open: nothing closes
    opened = [cycle.begin(5), cycle.begin(5)]
    assert opened == [True, False] and (cycle.open, cycle.step, cycle.micro_batches) == (True, 5, 2)
    assert not cycle.end(5)  # the counter did not move: the optimizer has not stepped
    assert cycle.begin(5) is False and cycle.end(6)
    assert (cycle.open, cycle.step, cycle.micro_batches, cycle.cycles) == (False, 5, 3, 1)
    assert cycle.begin(6) and cycle.end(7)
    assert (cycle.step, cycle.micro_batches, cycle.cycles) == (6, 1, 2)
