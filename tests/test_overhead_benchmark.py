"""benchmarks/overhead.py: the stamp arithmetic, and a smoke run of the three loops on the small CNN."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "benchmarks" / "overhead.py"


def _load():
    spec = importlib.util.spec_from_file_location("overhead_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_step_times_shift_by_lookahead():
    overhead = _load()
    # Steps take 1, 2, 3, 4 s. Without look-ahead a fetch starts each step; with one, the first two fetches
    # come together and each later fetch starts the step before the batch it fetches.
    plain = [0.0, 1.0, 3.0, 6.0, 10.0]
    ahead = [0.0, 0.0, 1.0, 3.0, 6.0, 10.0]
    assert overhead.step_times(plain, 0, warmup=1, steps=3, steps_per_epoch=100) == [2.0, 3.0, 4.0]
    assert overhead.step_times(ahead, 1, warmup=1, steps=3, steps_per_epoch=100) == [2.0, 3.0, 4.0]


def test_step_and_epoch_times_across_epochs():
    overhead = _load()
    # Two epochs of 3 steps of 1 s, 5 s spent between epochs, then the first step of a third epoch.
    stamps = [0.0, 1.0, 2.0, 8.0, 9.0, 10.0, 16.0]
    # The last step of an epoch (it holds the epoch end) is not a step time.
    assert overhead.step_times(stamps, 0, warmup=0, steps=10, steps_per_epoch=3) == [1.0, 1.0, 1.0, 1.0]
    assert overhead.epoch_times(stamps, 3, warmup_epochs=1) == [8.0]
    assert overhead.epoch_times(stamps, 3, warmup_epochs=0) == [8.0, 8.0]


@pytest.mark.slow
def test_smoke_three_loops(tmp_path, capsys):
    """The benchmark's parent in this process; each loop still runs in a fresh worker process of its own."""
    out = tmp_path / "overhead.json"
    code = _load().main(["--model", "smallcnn", "--batch-size", "8", "--warmup", "1", "--steps", "2", "--repeats", "1",
                         "--train-size", "64", "--accelerator", "cpu", "--out", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0, stdout[-2000:]
    results = json.loads(out.read_text())
    assert set(results["loops"]) == {"raw", "accelerate", "lightning"}
    for name, loop in results["loops"].items():
        assert loop["median_step_ms"] > 0, name
        assert len(loop["runs"]) == 1 and len(loop["runs"][0]["step_times_ms"]) == 2, name
    # Accelerate's loader reads one batch ahead; the raw loop does not.
    assert results["loops"]["accelerate"]["runs"][0]["lookahead"] == 1
    assert results["loops"]["raw"]["runs"][0]["lookahead"] == 0
    assert results["loops"]["raw"]["ratio_to_raw"] == pytest.approx(1.0)
    for name in ("accelerate", "lightning"):
        ratio = results["ratios_to_raw"][name]
        medians = {k: v["median_step_ms"] for k, v in results["loops"].items()}
        assert ratio == pytest.approx(medians[name] / medians["raw"])
        assert ratio > 0
    assert results["hardware"]["accelerator"] == "cpu" and results["versions"]["torch"]
    assert stdout.strip().splitlines()[-1].startswith("lightning / raw")


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", REPO_ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_hook_clock_charges_each_hook_to_the_step_running(monkeypatch):
    """callback_overhead's direct figure: time inside overridden hooks only, per step, setup kept apart."""
    bench = _load_script("callback_overhead")
    from lightning.pytorch.callbacks import Callback

    class Measured(Callback):
        def __init__(self):
            self.calls = []

        def on_train_start(self, trainer, pl_module):
            self.calls.append("start")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.calls.append(batch_idx)

    now = {"t": 0.0}

    def clock():
        now["t"] += 0.5  # each reading is 0.5 s after the last: a timed hook costs 0.5 s
        return now["t"]

    cb = Measured()
    hook_clock = bench.HookClock([cb])
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    cb.on_train_start(None, None)
    for step in (0, 1):
        hook_clock.current = step
        cb.on_train_batch_end(None, None, None, None, step)
    cb.on_validation_start(None, None)  # not overridden: Lightning's no-op, not wrapped, not timed
    assert cb.calls == ["start", 0, 1]  # the hooks still run
    assert dict(hook_clock.per_step) == {"setup": 0.5, 0: 0.5, 1: 0.5}
    assert dict(hook_clock.per_hook) == {"Measured.on_train_start": 0.5, "Measured.on_train_batch_end": 1.0}


@pytest.mark.slow
def test_cpu_defaults_smoke(tmp_path, monkeypatch):
    """In this process: the benchmark runs its options in one process anyway (only cpu_malloc, left out, starts
    children), and puts the thread count back."""
    import torch

    out = tmp_path / "cpu_defaults.json"
    threads = torch.get_num_threads()
    monkeypatch.chdir(REPO_ROOT)
    assert _load_script("cpu_defaults").main(["--model", "smallcnn", "--batch-size", "8", "--rounds", "2", "--warmup",
                                              "1", "--groups", "memory_format,optimizer_impl,threads",
                                              "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads
    result = json.loads(out.read_text())
    assert [g["group"] for g in result["groups"]] == ["memory_format", "optimizer_impl", "threads"]
    for group in result["groups"]:
        reference = group["options"][0]
        assert reference["round_ratios"] == [1.0, 1.0], group["group"]
        assert sum(o["default"] for o in group["options"]) == 1, group["group"]  # base.yaml's choice is marked
        for option in group["options"]:
            assert option["median_step_ms"] > 0 and 0 < option["mfu"], option
            assert len(option["round_ratios"]) == 2
    assert {o["option"] for o in result["groups"][1]["options"]} == {
        "optimizer_impl=for-loop", "optimizer_impl=foreach", "optimizer_impl=fused"}


def test_cpu_defaults_rejects_an_unknown_group_before_any_work(monkeypatch):
    cpu_defaults = _load_script("cpu_defaults")
    monkeypatch.setattr(cpu_defaults, "base_defaults", lambda: pytest.fail("work began before the names were checked"))
    with pytest.raises(SystemExit) as refused:
        cpu_defaults.main(["--groups", "memory_format,turbo"])
    assert str(refused.value) == (
        f"error: --groups: unknown group 'turbo' (choose from {', '.join(cpu_defaults.GROUPS)})"
    )


def test_callback_overhead_smoke(tmp_path, monkeypatch):
    """The benchmark builds the CLI with run=False: the base config's checks and flags must hold there too."""
    out = tmp_path / "callback_overhead.json"
    monkeypatch.setattr(sys, "argv", ["callback_overhead.py"])
    monkeypatch.chdir(REPO_ROOT)
    _load_script("callback_overhead").main(["--model", "smallcnn", "--batch-size", "8", "--steps", "6", "--warmup",
                                            "2", "--repeats", "1", "--accelerator", "cpu", "--out", str(out)])
    result = json.loads(out.read_text())
    assert len(result["pair_ratios"]) == 1 and result["hooks_ms_per_step"]["steps"] >= 1
    assert 0 <= result["hooks_fraction_of_step"] < 1
    assert "RunMonitor.on_train_batch_end" in result["hooks_total_ms_by_hook"]
