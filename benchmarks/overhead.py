"""What a training loop costs: the same training in a raw PyTorch loop, the Accelerate loop and the Lightning Trainer.

To run: ``uv run python benchmarks/overhead.py`` (resnet18, batch 128, fp32, AdamW; about 6 minutes on a
laptop CPU); ``--model smallcnn --epoch`` times whole epochs of the small CNN, where a fixed per-step or
per-epoch cost shows most; ``--accelerator cuda --batch-size 256 --steps 30`` on a GPU.

The three loops train the same network (one of :mod:`modelwright.train.models`), on the same data
(:class:`modelwright.train.data.ImageDataModule`'s training loader, synthetic), with the same batch, precision,
optimizer and schedule (:func:`modelwright.techniques.build_optimizer` / ``train.optim.build_scheduler``,
hyperparameters from ``configs/base.yaml``), for the same number of steps:

* ``raw``: a plain loop (autocast for mixed precision, ``GradScaler`` for fp16; the base config's ``channels_last``,
  ``compile`` and ``cpu_malloc``, process settings the other two loops get from the config too); no metric, no
  logging;
* ``accelerate``: ``modelwright.loops.accelerate.main`` with ``configs/base.yaml``'s callbacks (step timer,
  memory monitor, FLOP counter, run record, loss guard, LR logging, TensorBoard);
* ``lightning``: ``modelwright.train.cli.cli_main(["fit", ...])``, the project's Trainer as configured (progress bar,
  logger, every callback of ``configs/base.yaml``) except the two ``ModelCheckpoint`` callbacks, removed as
  the study removes them (:func:`modelwright.study.patch_callbacks`): the raw loop writes no checkpoint either.
  Validation is off in every loop (``limit_val_batches 0``).

Fairness: one clock for all three. Each loop runs in a fresh process; the worker wraps the ``collate_fn`` of the
training loader the datamodule builds, and stamps ``perf_counter`` (after synchronizing the device) each time a
batch is assembled. ``collate_fn`` survives ``Accelerator.prepare`` (which rebuilds the loader) and Lightning
(which uses the loader as it is), and a batch is fetched once per step in every loop, so the interval between two
fetches is one whole iteration: data loading, host-to-device copy, forward, backward, optimizer, and whatever
the loop does between steps (logging, callbacks, progress bar). A loop that reads ahead (Accelerate's loader
fetches one batch early to know which is last) is recognised by counting the fetches made before the network's
first forward call, and its stamps are shifted by that many. The first ``--warmup`` steps are left out; the
per-run figure is the median step, the loop's figure the median over ``--repeats`` runs, which run
interleaved (raw, accelerate, lightning, raw, ...) so that a machine growing busier or cooler hits all three;
a loop's ratio to raw is taken within each repeat and the median over repeats is its figure.

``--epoch`` times epochs instead: from the first batch of one epoch to the first batch of the next (so epoch-end
hooks and the new loader pass are inside), after one warm-up epoch. Lightning's own parity test tolerates
0.3 s per epoch over a raw loop on MNIST.

The device is synchronized at every stamp, so a loop's host-side work between steps is not hidden behind
queued GPU work: the figure is an upper bound on its overhead. The last lines printed are the ratios to raw;
the results go to ``results/<hardware slug>/overhead-<model>[-epoch].json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
for _p in (REPO_ROOT / "src", REPO_ROOT):  # `modelwright` without an install, `callbacks` (a top-level package)
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

LOOPS = ("raw", "accelerate", "lightning")
GOAL_RATIO = 1.02
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")


# --------------------------------------------------------------------------------------------------
# Worker: one loop, one run, in its own process
# --------------------------------------------------------------------------------------------------


class Stamps:
    """Batch-fetch timestamps and the number of fetches made before the first forward call."""

    def __init__(self, sync) -> None:
        self.times: list[float] = []
        self.fetches_before_forward: int | None = None
        self.sync = sync

    def collate(self, inner):
        def timed(batch):
            self.sync()
            self.times.append(time.perf_counter())
            return inner(batch)

        return timed

    def forward_pre_hook(self, module, args) -> None:
        if self.fetches_before_forward is None:
            self.fetches_before_forward = len(self.times)


def _install_probes(stamps: Stamps) -> None:
    """Wrap the training loader's ``collate_fn`` and the network's first forward, in every loop alike (both
    loops take their loaders from the data module and prepare the network with ``prepare_network``)."""
    from modelwright import techniques
    from modelwright.train.data import ImageDataModule

    original_loader = ImageDataModule.train_dataloader
    original_prepare = techniques.prepare_network

    def train_dataloader(self):
        loader = original_loader(self)
        loader.collate_fn = stamps.collate(loader.collate_fn)
        return loader

    def prepare_network(network, *args, **kwargs):
        network.register_forward_pre_hook(stamps.forward_pre_hook)
        return original_prepare(network, *args, **kwargs)

    ImageDataModule.train_dataloader = train_dataloader
    techniques.prepare_network = prepare_network


def _common_overrides(spec: dict[str, Any], log_dir: str) -> list[str]:
    """The command-line overrides the Lightning and Accelerate loops share (what the raw loop hard-codes)."""
    from modelwright.train.models import SHORT_NAMES

    return [
        "--config", spec["callbacks_yaml"],
        f"--trainer.accelerator={spec['accelerator']}",
        f"--trainer.precision={spec['precision']}",
        f"--trainer.max_steps={spec['max_steps']}",
        f"--trainer.max_epochs={spec['max_epochs']}",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_checkpointing=false",
        f"--trainer.logger.init_args.save_dir={log_dir}",
        f"--model.network={SHORT_NAMES[spec['model']]}",
        f"--model.optimizer={spec['optimizer']}",
        f"--data.batch_size={spec['batch_size']}",
        f"--data.train_size={spec['train_size']}",
        "--data.num_workers=0",  # collate_fn must run in this process to be stamped
        *spec.get("extra", []),
    ]


def _raw_loop(spec: dict[str, Any], device) -> None:
    import torch
    import torch.nn.functional as F
    from lightning.fabric.utilities.seed import seed_everything

    from modelwright import techniques
    from modelwright.train import models
    from modelwright.train.data import ImageDataModule
    from modelwright.train.optim import build_scheduler
    from modelwright.train.runtime import set_cpu_malloc

    hp = spec["model_hparams"]
    # The process settings of the base config, as the CLI and the Accelerate loop apply them.
    set_cpu_malloc(spec.get("cpu_malloc", "system"))
    seed_everything(spec["seed"])
    net = getattr(models, models.SHORT_NAMES[spec["model"]])(num_classes=10).to(device)
    # The memory format and compile of the base config, as ImageClassifier applies them.
    fmt = torch.channels_last if hp.get("channels_last") else torch.contiguous_format
    net = net.to(memory_format=fmt)
    forward = torch.compile(net) if hp.get("compile") else net
    dm = ImageDataModule(batch_size=spec["batch_size"], train_size=spec["train_size"], num_workers=0)
    dm.setup("fit")
    loader = dm.train_dataloader()
    chosen = techniques.TechniqueArgs(optimizer=spec["optimizer"], optimizer_impl=hp.get("optimizer_impl", "auto"))
    optimizer = techniques.build_optimizer(net.parameters(), chosen, lr=hp["lr"], momentum=hp.get("momentum", 0.9),
                                           weight_decay=hp["weight_decay"])
    total = min(spec["max_steps"], len(loader) * spec["max_epochs"])
    scheduler = build_scheduler(optimizer, hp.get("scheduler", "none"), lr=hp["lr"], total_steps=total)
    precision = spec["precision"]
    if precision == "16-mixed" and device.type == "cpu":
        precision = "bf16-mixed"  # as Lightning does: no float16 autocast on CPU
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None
    net.train()
    step = 0
    for _ in range(spec["max_epochs"]):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True).contiguous(memory_format=fmt), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(forward(x), y, label_smoothing=hp.get("label_smoothing", 0.0))
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step >= spec["max_steps"]:
                return


def worker(loop: str, spec_path: Path) -> int:
    """Run ``loop`` as ``spec_path`` says; write the stamps to ``spec["result"]``."""
    import logging

    import torch

    from modelwright.measure import device_sync

    spec = json.loads(spec_path.read_text())
    accelerator = spec["accelerator"]
    device = torch.device("cuda" if accelerator in ("cuda", "gpu") else "cpu")
    stamps = Stamps(device_sync(device))
    _install_probes(stamps)
    sys.argv = sys.argv[:1]  # LightningCLI warns when given args while the command line has its own
    logging.basicConfig(format="%(message)s")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"overhead-{loop}-") as log_dir:
        if loop == "raw":
            _raw_loop(spec, device)
            status = 0
        elif loop == "accelerate":
            from modelwright.loops.accelerate import main as accelerate_main

            status = accelerate_main([*_common_overrides(spec, log_dir), "--out", log_dir])
        else:
            from modelwright.train.cli import cli_main

            status = cli_main(["fit", *_common_overrides(spec, log_dir)])
    if status != 0:
        return status
    result = {
        "loop": loop,
        "stamps_s": stamps.times,
        "fetches_before_forward": stamps.fetches_before_forward,
        "wall_time_s": time.perf_counter() - t0,
        "threads": torch.get_num_threads(),
    }
    Path(spec["result"]).write_text(json.dumps(result))
    return 0


# --------------------------------------------------------------------------------------------------
# From stamps to step and epoch times
# --------------------------------------------------------------------------------------------------


def step_times(stamps: list[float], lookahead: int, warmup: int, steps: int, steps_per_epoch: int) -> list[float]:
    """Durations (s) of steps ``warmup .. warmup + steps - 1``, within epochs (an epoch boundary is not a step).

    ``lookahead``: batches the loop's loader fetches before the first step starts, beyond the first one
    (Accelerate: 1). Step ``i`` of an epoch runs from fetch ``i + lookahead`` to fetch ``i + lookahead + 1``
    of that epoch; the last ``lookahead + 1`` steps of an epoch have no such pair and are left out.
    """
    out: list[float] = []
    step = 0
    for start in range(0, len(stamps), steps_per_epoch):
        epoch = stamps[start : start + steps_per_epoch]
        for i in range(len(epoch) - lookahead - 1):
            if step >= warmup + steps:
                return out
            if step >= warmup:
                out.append(epoch[i + lookahead + 1] - epoch[i + lookahead])
            step += 1
        step += lookahead + 1  # steps of this epoch that had no pair
    return out


def epoch_times(stamps: list[float], steps_per_epoch: int, warmup_epochs: int) -> list[float]:
    """Durations (s) from the first fetch of one epoch to the first fetch of the next, after ``warmup_epochs``."""
    starts = stamps[::steps_per_epoch]
    return [b - a for a, b in zip(starts[warmup_epochs:-1], starts[warmup_epochs + 1 :], strict=True)]


# --------------------------------------------------------------------------------------------------
# Orchestrator
# --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="resnet18", choices=("resnet18", "smallcnn", "vit"))
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--precision", default="32-true", choices=PRECISIONS)
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd", "adafactor"))
    p.add_argument("--accelerator", default="auto", help="auto, cpu or cuda")
    p.add_argument("--warmup", type=int, default=2, help="steps left out at the start of each run")
    p.add_argument("--steps", type=int, default=6, help="timed steps per run")
    p.add_argument("--repeats", type=int, default=5, help="runs per loop, interleaved")
    p.add_argument("--epoch", action="store_true", help="time whole epochs (one warm-up epoch, then --epochs)")
    p.add_argument("--epochs", type=int, default=1, help="timed epochs per run with --epoch")
    p.add_argument("--train-size", type=int, default=None,
                   help="training samples (default: 4096, more if the steps need it)")
    p.add_argument("--loops", default=",".join(LOOPS), help="comma-separated subset of raw,accelerate,lightning")
    p.add_argument("--extra", action="append", default=[], metavar="--KEY=VALUE",
                   help="an override for the Lightning and Accelerate loops only (e.g. --extra=--trainer."
                   "enable_progress_bar=false), to find where an overhead comes from")
    p.add_argument("--out", default=None, help="results file (default: results/<slug>/overhead-<model>[-epoch].json)")
    p.add_argument("--run-timeout-s", type=float, default=900, help="kill a run after this long")
    p.add_argument("--worker", choices=LOOPS, help=argparse.SUPPRESS)
    p.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    return p


def _summary(values: list[float]) -> dict[str, float]:
    from modelwright.measure import percentile

    return {
        "median": statistics.median(values),
        "p10": percentile(values, 10),
        "p90": percentile(values, 90),
        "min": min(values),
        "max": max(values),
    }


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    import torch

    from modelwright.measure import hardware_info, versions
    from modelwright.study import hardware_slug, patch_callbacks, resolve_config

    loops = [name.strip() for name in args.loops.split(",") if name.strip()]
    if not loops or any(name not in LOOPS for name in loops):
        return _fail(f"--loops: {args.loops!r}; valid: a comma-separated subset of {','.join(LOOPS)}")
    for key, value, minimum in (("--batch-size", args.batch_size, 1), ("--steps", args.steps, 1),
                                ("--warmup", args.warmup, 0), ("--repeats", args.repeats, 1),
                                ("--epochs", args.epochs, 1)):
        if value < minimum:
            return _fail(f"{key}: must be >= {minimum}, got {value}")
    if args.accelerator in ("cuda", "gpu") and not torch.cuda.is_available():
        return _fail(f"--accelerator: {args.accelerator} but no CUDA device is visible")
    accelerator = "cuda" if args.accelerator == "gpu" else args.accelerator
    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator not in ("cpu", "cuda"):
        return _fail(f"--accelerator: {args.accelerator!r}; valid: auto, cpu, cuda")

    # Step mode: one epoch holding every step (and the look-ahead); epoch mode: warm-up epoch, timed epochs,
    # then the first step of one more epoch, whose first fetch ends the last timed epoch.
    if args.epoch:
        train_size = args.train_size or 4096
        steps_per_epoch = train_size // args.batch_size
        max_epochs = 1 + args.epochs + 1
        max_steps = (1 + args.epochs) * steps_per_epoch + 1
        if steps_per_epoch < 3:
            return _fail(f"--train-size: {train_size} gives {steps_per_epoch} batches of {args.batch_size}; need >= 3")
    else:
        needed = (args.warmup + args.steps + 2) * args.batch_size
        train_size = args.train_size or max(4096, needed)
        if train_size < needed:
            return _fail(f"--train-size: {train_size} samples; the steps need {needed} (one epoch)")
        steps_per_epoch = train_size // args.batch_size
        max_epochs, max_steps = 1, args.warmup + args.steps + 1

    base = resolve_config([], {})
    slug = hardware_slug(accelerator)
    default_name = f"overhead-{args.model}" + ("-epoch" if args.epoch else "") + ".json"
    out = Path(args.out) if args.out else REPO_ROOT / "results" / slug / default_name
    device = torch.device(accelerator)

    times: dict[str, list[dict[str, Any]]] = {name: [] for name in loops}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="modelwright-overhead-") as tmp_name:
        tmp = Path(tmp_name)
        callbacks = patch_callbacks(base["trainer"]["callbacks"], args.warmup, None)
        for cb in callbacks:  # the memory-anatomy step (a tracker slows it down) inside the warm-up, not timed
            if cb.get("class_path", "").endswith(".RunMonitor") and args.warmup > 0:
                cb["init_args"]["anatomy_step"] = args.warmup - 1
        callbacks_yaml = tmp / "callbacks.yaml"
        callbacks_yaml.write_text(json.dumps({"trainer": {"callbacks": callbacks}}))  # JSON is YAML
        for r in range(args.repeats):
            for name in loops:
                result = tmp / f"{name}-{r}.json"
                spec = {
                    "accelerator": accelerator, "precision": args.precision, "model": args.model,
                    "optimizer": args.optimizer, "batch_size": args.batch_size, "train_size": train_size,
                    "max_steps": max_steps, "max_epochs": max_epochs, "seed": base.get("seed_everything", 0),
                    "model_hparams": base["model"]["init_args"], "cpu_malloc": base.get("cpu_malloc", "system"),
                    "callbacks_yaml": str(callbacks_yaml),
                    "extra": args.extra, "result": str(result),
                }
                spec_path = tmp / f"{name}-{r}.spec.json"
                spec_path.write_text(json.dumps(spec))
                cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--spec", str(spec_path)]
                log_path = tmp / f"{name}-{r}.log"
                with log_path.open("w") as log:
                    try:
                        proc = subprocess.run(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                              timeout=args.run_timeout_s)
                        code = proc.returncode
                    except subprocess.TimeoutExpired:
                        code = "timeout"
                if code != 0 or not result.is_file():
                    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
                    print(f"{name} run {r + 1} failed ({code}); its output ends:\n{tail}", file=sys.stderr)
                    return 1
                data = json.loads(result.read_text())
                stamps = data["stamps_s"]
                lookahead = max(0, (data["fetches_before_forward"] or 1) - 1)
                warmup_steps = args.warmup if not args.epoch else steps_per_epoch
                n_steps = args.steps if not args.epoch else args.epochs * steps_per_epoch
                run_steps = step_times(stamps, lookahead, warmup_steps, n_steps, steps_per_epoch)
                run_epochs = epoch_times(stamps, steps_per_epoch, 1) if args.epoch else []
                if not run_steps or (args.epoch and len(run_epochs) < args.epochs):
                    print(f"{name} run {r + 1}: too few batches fetched ({len(stamps)})", file=sys.stderr)
                    return 1
                entry = {
                    "repeat": r, "lookahead": lookahead, "step_times_ms": [t * 1e3 for t in run_steps],
                    "median_step_ms": statistics.median(run_steps) * 1e3,
                    "epoch_times_s": run_epochs[: args.epochs], "process_wall_time_s": data["wall_time_s"],
                    "threads": data["threads"],
                }
                times[name].append(entry)
                line = f"repeat {r + 1}/{args.repeats} {name:<10}: median step {entry['median_step_ms']:.1f} ms"
                if args.epoch:
                    line += f", epoch {statistics.median(entry['epoch_times_s']):.3f} s"
                print(line, flush=True)

    loops_out: dict[str, Any] = {}
    for name in loops:
        runs = times[name]
        pooled = [t for e in runs for t in e["step_times_ms"]]
        s = _summary(pooled)
        summary = {
            "median_step_ms": statistics.median(e["median_step_ms"] for e in runs),
            "pooled_median_step_ms": s["median"], "p10_step_ms": s["p10"], "p90_step_ms": s["p90"],
            "min_step_ms": s["min"], "max_step_ms": s["max"], "runs": runs,
        }
        if args.epoch:
            summary["epoch_time_s"] = statistics.median(statistics.median(e["epoch_times_s"]) for e in runs)
        loops_out[name] = summary
    ratios: dict[str, float] = {}
    if "raw" in loops_out:
        # Within each repeat the three loops ran back to back: the ratio to raw is taken inside a repeat, and the
        # loop's figure is the median over repeats, so a machine that grows busier between repeats hits all alike.
        raw_runs = loops_out["raw"]["runs"]
        for name, summary in loops_out.items():
            runs = summary["runs"]
            summary["repeat_ratios_to_raw"] = [
                e["median_step_ms"] / r["median_step_ms"] for e, r in zip(runs, raw_runs, strict=True)
            ]
            summary["ratio_to_raw"] = statistics.median(summary["repeat_ratios_to_raw"])
            if args.epoch:
                per_repeat = [
                    statistics.median(e["epoch_times_s"]) / statistics.median(r["epoch_times_s"])
                    for e, r in zip(runs, raw_runs, strict=True)
                ]
                summary["repeat_epoch_ratios_to_raw"] = per_repeat
                summary["epoch_ratio_to_raw"] = statistics.median(per_repeat)
                summary["epoch_overhead_s"] = statistics.median(
                    statistics.median(e["epoch_times_s"]) - statistics.median(r["epoch_times_s"])
                    for e, r in zip(runs, raw_runs, strict=True)
                )
            if name != "raw":
                ratios[name] = summary["epoch_ratio_to_raw" if args.epoch else "ratio_to_raw"]

    results = {
        "benchmark": "overhead",
        "mode": "epoch" if args.epoch else "step",
        "command": shlex.join(["uv", "run", "python", "benchmarks/overhead.py", *sys.argv[1:]]),
        "slug": slug,
        "settings": {
            "model": args.model, "batch_size": args.batch_size, "precision": args.precision,
            "optimizer": args.optimizer, "accelerator": accelerator, "warmup_steps": args.warmup,
            "measured_steps": args.steps if not args.epoch else None, "repeats": args.repeats,
            "measured_epochs": args.epochs if args.epoch else None, "train_size": train_size,
            "steps_per_epoch": steps_per_epoch, "max_steps": max_steps, "loops": loops, "extra": args.extra,
            "timing": "interval between batch fetches, device synchronized at each",
        },
        "goal_ratio": GOAL_RATIO,
        "hardware": hardware_info(device),
        "versions": versions(),
        "loops": loops_out,
        "ratios_to_raw": ratios,
        "wall_time_s": time.perf_counter() - t0,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")

    hw = results["hardware"]
    print(
        f"\n{args.model}, batch {args.batch_size}, {args.precision}, {args.optimizer}, {accelerator} "
        f"({hw.get('device_name')}), torch {results['versions'].get('torch')}, "
        f"lightning {results['versions'].get('lightning')}, accelerate {results['versions'].get('accelerate')}; "
        + (f"{args.epochs} timed epoch(s) of {steps_per_epoch} steps" if args.epoch
           else f"{args.warmup} warm-up + {args.steps} timed steps")
        + f", {args.repeats} repeat(s), interleaved"
    )
    header = f"{'loop':<11}{'median ms':>11}{'p10-p90 ms':>19}{'vs raw':>9}"
    if args.epoch:
        header += f"{'epoch s':>10}{'vs raw':>9}{'+s/epoch':>10}"
    print(header)
    for name, s in loops_out.items():
        row = f"{name:<11}{s['median_step_ms']:>11.1f}{s['p10_step_ms']:>9.1f}-{s['p90_step_ms']:<9.1f}"
        row += f"{s['ratio_to_raw']:>9.3f}" if "ratio_to_raw" in s else f"{'':>9}"
        if args.epoch:
            row += f"{s['epoch_time_s']:>10.3f}"
            if "epoch_ratio_to_raw" in s:
                row += f"{s['epoch_ratio_to_raw']:>9.3f}{s['epoch_overhead_s']:>+10.3f}"
        print(row)
    print(f"results: {os.path.relpath(out)}")
    what = "epoch time" if args.epoch else "median step time"
    for name, ratio in ratios.items():
        verdict = "within" if ratio <= GOAL_RATIO else "OVER"
        print(f"{name} / raw ({what}): {ratio:.3f}x ({verdict} the {GOAL_RATIO}x goal)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker(args.worker, args.spec)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
