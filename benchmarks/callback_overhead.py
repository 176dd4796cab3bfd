"""What the measurement callbacks cost: the default config (resnet18) with them on and off, side by side.

To run: ``uv run benchmarks/callback_overhead.py`` (add ``--steps 20 --repeats 5`` for a tighter figure,
``--model smallcnn --batch-size 16 --steps 6 --repeats 1`` for a smoke run).

Each repeat trains the same config from ``configs/base.yaml`` twice in this process, once with the
measurement callback (``RunMonitor``: the step probe and the record) and once
without, alternating which goes first. A step clock of its own, present in both runs, times every
optimizer step as the interval between consecutive ``on_train_batch_start`` calls, so all hooks of a
step, data loading and logging are inside. Left out: the first ``--warmup`` steps and, with the
callbacks on, the step whose memory anatomy the probe captured.
The median over the pairs of the ratio of median step times, callbacks on ÷ off, is the side-by-side figure
(each pair ran back to back, so a shared machine's slow drifts cancel, but not its step-to-step noise).

The direct figure: in the runs with the callbacks on, every hook of the measurement callbacks is timed
(``HookClock``), and the time a step spends inside them is set against the median step. It is immune to the
machine's noise (it does not subtract two noisy step times) and catches everything the callbacks do in their
hooks, their ``self.log`` calls included; what it cannot see is a cost they cause outside their hooks (the
logger writing more scalars at ``log_every_n_steps``). On a GPU a hook that synchronizes the device is charged
for the wait, so there it is an upper bound.

The last line printed gives both; ``results/<hardware>/callback_overhead.json`` keeps them with every pair's
ratio, the per-step hook times, the hardware and the versions.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.callbacks import Callback

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repository root: `callbacks` package

from callbacks.run_monitor import RunMonitor  # noqa: E402
from modelwright.measure import device_sync, hardware_info, percentile, versions  # noqa: E402
from modelwright.study import hardware_slug  # noqa: E402
from modelwright.train.cli import BASE_CONFIG, ModelwrightCLI  # noqa: E402
from modelwright.train.models import SHORT_NAMES  # noqa: E402

MEASUREMENT = (RunMonitor,)


class StepClock(Callback):
    """Durations of optimizer steps: from one ``on_train_batch_start`` to the next (accumulation 1).

    The last step has no next start and is not kept (the end-of-epoch checkpoint would land in it).
    """

    def __init__(self, clock: HookClock | None = None) -> None:
        self.durations: list[tuple[int, float]] = []  # (global_step, seconds)
        self._last: tuple[int, float] | None = None
        self._sync = device_sync(None)
        self.clock = clock  # told each step's global_step as it starts

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sync = device_sync(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._sync()
        now = time.perf_counter()
        if self._last is not None:
            self.durations.append((self._last[0], now - self._last[1]))
        self._last = (trainer.global_step, now)
        if self.clock is not None:
            self.clock.current = trainer.global_step

    def on_validation_start(self, trainer, pl_module) -> None:
        self._last = None  # an interval across validation is not a step


class HookClock:
    """Wall time spent inside the hooks of some callbacks, charged to the step running at the time.

    Each hook a callback overrides is wrapped on the instance. A hook called between one
    ``on_train_batch_start`` of the step clock (which sets :attr:`current`) and the next is charged to that step;
    before the first step, to ``"setup"``; after the last, to ``"teardown"``.
    """

    def __init__(self, callbacks: list[Callback]) -> None:
        self.per_step: dict[int | str, float] = defaultdict(float)
        self.per_hook: dict[str, float] = defaultdict(float)
        self.current: int | str = "setup"
        for cb in callbacks:
            for name in dir(Callback):
                if not (name.startswith("on_") or name in ("setup", "teardown")):
                    continue
                if getattr(type(cb), name, None) is getattr(Callback, name):
                    continue  # not overridden: Lightning's no-op
                setattr(cb, name, self._timed(getattr(cb, name), f"{type(cb).__name__}.{name}"))

    def _timed(self, hook, label: str):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self.per_step[self.current] += dt
                self.per_hook[label] += dt

        return timed


def one_run(
    args: argparse.Namespace, callbacks_on: bool, log_dir: str, hooks: dict[str, Any] | None = None
) -> list[float]:
    """Train ``args.steps`` steps of the base config; the kept step times in seconds.

    With the callbacks on, ``hooks["per_step"]`` gets the seconds the kept steps spent inside their hooks and
    ``hooks["per_hook"]`` each hook's seconds over the whole run, setup and the perturbed steps included.
    """
    overrides = [
        f"--trainer.max_steps={args.steps}",
        "--trainer.max_epochs=1",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--trainer.logger.init_args.save_dir={log_dir}",
        f"--trainer.accelerator={args.accelerator}",
    ]
    if args.model:
        overrides.append(f"--model.network={SHORT_NAMES.get(args.model, args.model)}")
    if args.batch_size:
        overrides.append(f"--data.batch_size={args.batch_size}")
    cli = ModelwrightCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        args=overrides,
        parser_kwargs={"default_config_files": [str(BASE_CONFIG)]},
        save_config_callback=None,
        auto_configure_optimizers=False,
    )
    trainer = cli.trainer
    if not callbacks_on:
        trainer.callbacks[:] = [cb for cb in trainer.callbacks if not isinstance(cb, MEASUREMENT)]
    elif not any(isinstance(cb, RunMonitor) for cb in trainer.callbacks):
        raise SystemExit("configs/base.yaml switches no measurement callbacks on: nothing to compare")
    clock = HookClock([cb for cb in trainer.callbacks if isinstance(cb, MEASUREMENT)]) if callbacks_on else None
    step_clock = StepClock(clock)
    trainer.callbacks.insert(0, step_clock)
    trainer.fit(cli.model, cli.datamodule)
    captured = {cb.probe.captured_step for cb in trainer.callbacks if isinstance(cb, RunMonitor)}
    first = step_clock.durations[0][0] if step_clock.durations else 0
    kept = [(step, dt) for step, dt in step_clock.durations if step - first >= args.warmup and step not in captured]
    if clock is not None and hooks is not None:
        hooks["per_step"].extend(clock.per_step.get(step, 0.0) for step, _ in kept)
        for label, seconds in clock.per_hook.items():
            hooks["per_hook"][label] += seconds
    return [dt for _, dt in kept]


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run (>= 6)")
    parser.add_argument("--warmup", type=int, default=3, help="first steps of each run left out")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs (on, off), interleaved")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--model", default=None,
                        help="resnet18, smallcnn, vit or a class path: model.network (default: the base config's)")
    parser.add_argument("--batch-size", type=int, default=None, help="override data.batch_size")
    parser.add_argument("--out", default=None, help="results file (default: results/<slug>/callback_overhead.json)")
    given = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    sys.argv = sys.argv[:1]  # LightningCLI warns when given args while the command line has its own
    if args.steps < args.warmup + 3:
        parser.error("--steps must leave at least 3 steps after --warmup")

    times: dict[bool, list[float]] = {True: [], False: []}
    hooks: dict[str, Any] = {"per_step": [], "per_hook": defaultdict(float)}  # with the callbacks on
    pair_ratios: list[float] = []  # per repeat: median on / median off, the two runs side by side
    with tempfile.TemporaryDirectory(prefix="modelwright-overhead-") as log_dir:
        for r in range(args.repeats):
            medians: dict[bool, float] = {}
            for on in (True, False) if r % 2 == 0 else (False, True):
                kept = one_run(args, on, log_dir, hooks)
                times[on].extend(kept)
                medians[on] = statistics.median(kept)
                label = "on " if on else "off"
                print(
                    f"repeat {r + 1}/{args.repeats} callbacks {label}: {len(kept)} steps, "
                    f"median {statistics.median(kept) * 1e3:.1f} ms",
                    flush=True,
                )
            pair_ratios.append(medians[True] / medians[False])

    device = "cuda" if torch.cuda.is_available() and args.accelerator in ("auto", "gpu", "cuda") else "cpu"
    print(
        f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
        f"steps/run {args.steps}, warm-up {args.warmup}, repeats {args.repeats}"
    )
    for on in (False, True):
        t = times[on]
        print(
            f"callbacks {'on ' if on else 'off'}: n={len(t)} median {statistics.median(t) * 1e3:.1f} ms, "
            f"p90 {percentile(t, 90) * 1e3:.1f} ms"
        )
    # The median of the per-pair ratios: each pair ran back to back, so slow drifts of a shared machine cancel.
    ratio = statistics.median(pair_ratios)
    median_off = statistics.median(times[False])
    hook_times = hooks["per_step"]
    hooks_median, hooks_max = statistics.median(hook_times), max(hook_times)
    print(f"hooks of the measurement callbacks: median {hooks_median * 1e3:.3f} ms per step, max "
          f"{hooks_max * 1e3:.3f} ms over {len(hook_times)} steps")
    out = Path(args.out) if args.out else REPO / "results" / hardware_slug(args.accelerator) / "callback_overhead.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "callback_overhead",
        "command": shlex.join(["uv", "run", "python", "benchmarks/callback_overhead.py", *given]),
        "settings": {"model": args.model or "base config", "batch_size": args.batch_size or "base config",
                     "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "device": device},
        "median_step_ms": {"on": statistics.median(times[True]) * 1e3, "off": statistics.median(times[False]) * 1e3},
        "ratio_on_off": ratio,
        "pair_ratios": pair_ratios,
        "hooks_ms_per_step": {"median": hooks_median * 1e3, "max": hooks_max * 1e3, "steps": len(hook_times)},
        "hooks_fraction_of_step": hooks_median / median_off,
        # every run with the callbacks on, whole runs: where the time inside the hooks went
        "hooks_total_ms_by_hook": {k: v * 1e3 for k, v in sorted(hooks["per_hook"].items(), key=lambda kv: -kv[1])},
        "hardware": hardware_info(device),
        "versions": versions(),
    }
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(out)
    print(f"overhead: side by side {(ratio - 1) * 100:+.2f}% (median over {len(pair_ratios)} pairs of on/off median "
          f"step time = {ratio:.4f}; pairs: {', '.join(f'{r:.3f}' for r in pair_ratios)}); direct "
          f"{hooks_median / median_off * 100:.3f}% (time inside the callbacks' hooks per step, median, "
          f"÷ median step {median_off * 1e3:.0f} ms)")
    return ratio


if __name__ == "__main__":
    main()
