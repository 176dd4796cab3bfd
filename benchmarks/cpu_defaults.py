"""Fast CPU defaults, measured: each setting against its alternatives, step by step in one process.

To run: ``uv run python benchmarks/cpu_defaults.py`` (resnet18, batch 128, fp32, AdamW; about 12 minutes on a
2-core CPU); ``--rounds 10`` for tighter figures; ``--groups memory_format,optimizer_impl`` for a subset;
``--model smallcnn --batch-size 64 --rounds 2`` for a smoke run.

Each group compares the options of one setting (memory format, optimizer implementation, thread count,
dataloader workers, torch.compile, glibc malloc). Every option gets its own model, optimizer and loader, built
from the same seed; the other settings are those of ``configs/base.yaml``. After ``--warmup`` unmeasured steps of each,
the options take turns, one training step each (data fetch, forward, loss, backward, optimizer step), for
``--rounds`` rounds, the order rotating every round. A step's ratio to the group's reference option (the first)
is taken within its round, so a machine that grows busier or cooler over the minutes hits every option alike;
the figure of an option is the median over rounds of that ratio. ``cpu_malloc`` changes the whole process and
cannot be undone, so there each round runs each option in a fresh child process (``--child-steps`` timed steps
after the warm-up, their median the round's figure). Noise on a shared CPU is ±10-20% per step:
read a difference under a few percent as no difference.

MFU is each option's FLOPs per step (PyTorch's flop counter, :func:`modelwright.measure.training_flops`) over its
median step time and the machine's fp32 hardware peak (:func:`modelwright.measure.hardware_peak`).

The results go to ``results/<hardware slug>/cpu_defaults.json`` (``--out`` to change), the option that
``configs/base.yaml`` sets marked ``default``; ``python -m modelwright report`` writes docs/measurement.md's table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO / "src", REPO):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from modelwright.measure import hardware_info, hardware_peak, training_flops, versions  # noqa: E402
from modelwright.study import hardware_slug, resolve_config  # noqa: E402
from modelwright.techniques import TechniqueArgs, build_optimizer  # noqa: E402
from modelwright.train import models  # noqa: E402
from modelwright.train.data import ImageDataModule  # noqa: E402
from modelwright.train.runtime import CPU_MALLOC_MODES, set_cpu_malloc  # noqa: E402

GROUPS = ("memory_format", "optimizer_impl", "threads", "num_workers", "compile", "cpu_malloc")
PROCESS_GROUPS = ("cpu_malloc",)  # a process-wide setting that cannot be undone: one child process per step block


@dataclass
class Option:
    """One setting of a group: a training step with its own model, optimizer, loader and thread count."""

    name: str
    settings: dict[str, Any]
    step: Callable[[], None]
    flops: float
    threads: int
    times: list[float] = field(default_factory=list)


def base_defaults() -> dict[str, Any]:
    """The settings ``configs/base.yaml`` gives the model and data (what a plain ``main.py fit`` runs)."""
    cfg = resolve_config([], {})
    model, data = cfg["model"]["init_args"], cfg["data"]["init_args"]
    return {
        "memory_format": "channels_last" if model.get("channels_last") else "contiguous",
        # "auto" is torch's own choice: foreach on CUDA, the for-loop on a CPU
        "optimizer_impl": {"auto": "for-loop"}.get(model.get("optimizer_impl", "auto"), model.get("optimizer_impl")),
        "threads": int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads()),
        "num_workers": int(data.get("num_workers", 0)),
        "compile": bool(model.get("compile", False)),
        "cpu_malloc": cfg.get("cpu_malloc", "system"),
        "optimizer": model.get("optimizer", "adamw"),
        "lr": float(model.get("lr", 1e-3)),
        "weight_decay": float(model.get("weight_decay", 0.0)),
    }


def group_options(group: str, defaults: dict[str, Any]) -> list[Any]:
    """The values a group compares; the first is the reference (the plain-PyTorch choice)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if group == "memory_format":
        return ["contiguous", "channels_last"]
    if group == "optimizer_impl":
        return ["for-loop", "foreach", "fused"]
    if group == "threads":
        return sorted({cores, max(1, cores // 2), defaults["threads"]}, reverse=True)
    if group == "num_workers":
        return sorted({0, 1, cores, defaults["num_workers"]})
    if group == "compile":
        return [False, True]
    if group == "cpu_malloc":
        return ["system", "retain"]
    raise SystemExit(f"error: --groups: unknown group {group!r} (choose from {', '.join(GROUPS)})")


def build_option(group: str, value: Any, args: argparse.Namespace, defaults: dict[str, Any]) -> Option:
    settings = {k: defaults[k] for k in ("memory_format", "optimizer_impl", "threads", "num_workers", "compile")}
    settings[group] = value
    torch.manual_seed(args.seed)
    net = getattr(models, models.SHORT_NAMES[args.model])(num_classes=10)
    fmt = torch.channels_last if settings["memory_format"] == "channels_last" else torch.contiguous_format
    net = net.to(memory_format=fmt).train()
    chosen = TechniqueArgs(optimizer=defaults["optimizer"], optimizer_impl=settings["optimizer_impl"])
    optimizer = build_optimizer(net.parameters(), chosen, lr=defaults["lr"], momentum=0.9,
                                weight_decay=defaults["weight_decay"])
    workers = settings["num_workers"]
    dm = ImageDataModule(
        batch_size=args.batch_size, train_size=args.batch_size * 16, num_workers=workers,
        persistent_workers=workers > 0,
    )
    dm.setup("fit")
    loader = dm.train_dataloader()
    batches = iter(loader)
    forward = torch.compile(net) if settings["compile"] else net

    def next_batch():
        nonlocal batches
        try:
            return next(batches)
        except StopIteration:
            batches = iter(loader)
            return next(batches)

    def step() -> None:
        x, y = next_batch()
        loss = F.cross_entropy(forward(x.to(memory_format=fmt)), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    x0, y0 = next_batch()
    flops = training_flops(net, x0.to(memory_format=fmt), lambda out: F.cross_entropy(out, y0.to(out.device)))
    label = value if not isinstance(value, bool) else ("on" if value else "off")
    return Option(f"{group}={label}", settings, step, float(flops), int(settings["threads"]))


def _end_round(
    group: str, r: int, rounds: int, names: list[str], this_round: dict[str, float], ratios: dict[str, list[float]]
) -> None:
    """Each option's ratio to the reference (the first name) within round ``r``; one line of progress."""
    for name in names:
        ratios[name].append(this_round[name] / this_round[names[0]])
    print(f"{group} round {r + 1}/{rounds}: " + ", ".join(f"{n} {this_round[n] * 1e3:.0f} ms" for n in names),
          flush=True)


def _row(
    name: str, value: Any, is_default: bool, times: list[float], ratios: list[float], warmup_s: float,
    flops: float, peak: float | None, **extra: Any,
) -> dict[str, Any]:
    """One option's line of the results: median step, median ratio over rounds, MFU against ``peak``."""
    median_s = statistics.median(times)
    return {
        "option": name, "value": value, "default": is_default, "median_step_ms": median_s * 1e3,
        "ratio_to_reference": statistics.median(ratios), "round_ratios": ratios, "warmup_s": warmup_s,
        "flops_per_step": flops, "mfu": flops / median_s / peak if peak else None, **extra,
    }


def child_steps(mode: str, args: argparse.Namespace, defaults: dict[str, Any]) -> dict[str, Any]:
    """In a child process: malloc ``mode`` first, then ``--warmup`` steps and ``--child-steps`` timed steps."""
    set_cpu_malloc(mode)
    option = build_option("cpu_malloc", mode, args, defaults)
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        option.step()
    warmup_s = time.perf_counter() - t0
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(args.child_steps):
        t0 = time.perf_counter()
        option.step()
        option.times.append(time.perf_counter() - t0)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / max(1, args.child_steps)
    return {"times": option.times, "flops": option.flops, "warmup_s": warmup_s, "minor_faults_per_step": faults}


def run_process_group(group: str, args: argparse.Namespace, defaults: dict[str, Any], peak: float) -> dict[str, Any]:
    """A process-wide setting: each round runs each option in a fresh child process, in rotating order."""
    values = group_options(group, defaults)
    names = [f"{group}={v}" for v in values]
    times: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    warm: dict[str, list[float]] = {n: [] for n in names}
    flops: dict[str, float] = {}
    faults: dict[str, list[float]] = {n: [] for n in names}
    t_start = time.perf_counter()
    for r in range(args.rounds):
        k = r % len(values)
        this_round: dict[str, float] = {}
        pairs = list(zip(values, names, strict=True))
        for value, name in pairs[k:] + pairs[:k]:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child-malloc", value, "--model", args.model,
                   "--batch-size", str(args.batch_size), "--warmup", str(args.warmup),
                   "--child-steps", str(args.child_steps), "--seed", str(args.seed)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"error: {group}={value}: the child process failed:\n{proc.stderr[-2000:]}")
            child = json.loads(proc.stdout.strip().splitlines()[-1])
            this_round[name] = statistics.median(child["times"])
            times[name].extend(child["times"])
            warm[name].append(child["warmup_s"])
            flops[name] = child["flops"]
            faults[name].append(child["minor_faults_per_step"])
        _end_round(group, r, args.rounds, names, this_round, ratios)
    rows = [
        _row(name, value, value == defaults[group], times[name], ratios[name], statistics.median(warm[name]),
             flops[name], peak, minor_faults_per_step=statistics.median(faults[name]))
        for value, name in zip(values, names, strict=True)
    ]
    return {"group": group, "reference": names[0], "options": rows, "wall_s": time.perf_counter() - t_start,
            "method": f"a fresh process per option and round: {args.warmup} warm-up + {args.child_steps} timed steps, "
                      "the round's figure their median"}


def run_group(group: str, args: argparse.Namespace, defaults: dict[str, Any], peak: float) -> dict[str, Any]:
    if group in PROCESS_GROUPS:
        return run_process_group(group, args, defaults, peak)
    options = [build_option(group, v, args, defaults) for v in group_options(group, defaults)]
    ratios: dict[str, list[float]] = {o.name: [] for o in options}
    t_start = time.perf_counter()
    warmup_s: dict[str, float] = {}
    for o in options:
        torch.set_num_threads(o.threads)
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            o.step()
        warmup_s[o.name] = time.perf_counter() - t0  # what compile costs once shows here
    for r in range(args.rounds):
        k = r % len(options)
        order = options[k:] + options[:k]
        this_round: dict[str, float] = {}
        for o in order:
            torch.set_num_threads(o.threads)
            t0 = time.perf_counter()
            o.step()
            this_round[o.name] = time.perf_counter() - t0
            o.times.append(this_round[o.name])
        _end_round(group, r, args.rounds, [o.name for o in options], this_round, ratios)
    torch.set_num_threads(defaults["threads"])
    rows = [
        _row(o.name, o.settings[group], o.settings[group] == defaults[group], o.times, ratios[o.name],
             warmup_s[o.name], o.flops, peak)
        for o in options
    ]
    return {"group": group, "reference": options[0].name, "options": rows,
            "wall_s": time.perf_counter() - t_start}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="resnet18", choices=("resnet18", "smallcnn", "vit"))
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--rounds", type=int, default=6, help="measured steps per option, taken in turns")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps per option first")
    p.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated subset of {','.join(GROUPS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results file (default: results/<slug>/cpu_defaults.json)")
    p.add_argument("--child-steps", type=int, default=3, help="timed steps per child process (cpu_malloc)")
    p.add_argument("--child-malloc", choices=CPU_MALLOC_MODES, help=argparse.SUPPRESS)
    given = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or args.batch_size < 1:
        p.error("--rounds and --batch-size must be >= 1, --warmup >= 0")
    if args.child_malloc:
        print(json.dumps(child_steps(args.child_malloc, args, base_defaults())))
        return 0
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    for g in groups:
        group_options(g, {"threads": 1, "num_workers": 0})  # names checked before any work
    defaults = base_defaults()
    set_cpu_malloc(defaults["cpu_malloc"])  # the other groups run as a default run does
    peak, source, _ = hardware_peak("cpu", torch.float32)
    out = Path(args.out) if args.out else REPO / "results" / hardware_slug("cpu") / "cpu_defaults.json"
    print(f"{args.model}, batch {args.batch_size}, fp32, {defaults['optimizer']}; peak {peak / 1e9:.0f} GFLOP/s "
          f"({source}); base.yaml: {', '.join(f'{k}={defaults[k]}' for k in GROUPS)}", flush=True)
    results = [run_group(g, args, defaults, peak) for g in groups]

    print()
    for res in results:
        for row in res["options"]:
            mark = "  (default)" if row["default"] else ""
            print(f"{row['option']:<28} median {row['median_step_ms']:7.0f} ms  "
                  f"{row['ratio_to_reference']:.3f}× {res['reference']}  MFU {row['mfu']:.1%}{mark}")
    result = {
        "benchmark": "cpu_defaults",
        "command": shlex.join(["uv", "run", "python", "benchmarks/cpu_defaults.py", *given]),
        "settings": {"model": args.model, "batch_size": args.batch_size, "precision": "32-true",
                     "optimizer": defaults["optimizer"], "rounds": args.rounds, "warmup": args.warmup},
        "peak_flops_per_s": peak,
        "peak_flops_source": source,
        "base_yaml": {k: defaults[k] for k in GROUPS},
        "groups": results,
        "hardware": hardware_info("cpu"),
        "versions": versions(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(out)
    print(f"written: {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
