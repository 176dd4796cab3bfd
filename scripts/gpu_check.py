"""The GPU call rehearsed on any machine, CUDA or not: everything ``scripts/gpu_run.sh`` runs, short of the
CUDA calls, so that a GPU lease is not spent on an import error or a plan that does not resolve.

To run: ``bash scripts/gpu_run.sh --rehearse`` (it installs the carried wheels first and passes the folders);
directly, ``python scripts/gpu_check.py --results DIR --workdir DIR [--study-args ARGS]...``.

In one process (each fresh one spends seconds importing torch and Lightning): the modules every part imports;
each study part's plan resolved by LightningCLI for CUDA, as the study does before its first run, its runs
listed; the committed H200 predictions reproduced by this torch; the attention benchmark end to end on a tiny
CPU case; the GPU tests collected; and one optimizer step of the small CNN on the CPU through ``main.py``'s
CLI, callbacks and record included. Prints one ``ok`` line per check; any failure exits non-zero.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import runpy
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MODULES = ("torch", "lightning", "jsonargparse", "docstring_parser", "typeshed_client", "accelerate",
           "tensorboard", "torchvision", "torchmetrics", "matplotlib", "yaml", "tqdm", "pytest",
           "modelwright.train.cli", "modelwright.study", "modelwright.report", "modelwright.planner.cuda",
           "modelwright.loops.accelerate", "callbacks.run_monitor")


def check_imports() -> str:
    versions = []
    for name in MODULES:
        module = importlib.import_module(name)
        if name in ("torch", "lightning", "jsonargparse"):
            versions.append(f"{name} {module.__version__}")
    return "imports: ok (" + ", ".join(versions) + ")"


def check_study(arguments: str, results: Path, workdir: Path) -> str:
    """A study part's command (``-m modelwright study ...``), run by the package's CLI as ``python -m`` runs
    it, with ``--dry_run``: the study resolves and lists its runs."""
    from modelwright.__main__ import main as modelwright_main

    tokens = arguments.split()  # as gpu_run.sh splits them (`read -a`): quotes stay in the argument
    if tokens[:2] != ["-m", "modelwright"]:
        raise SystemExit(f"not a `-m modelwright` command: {arguments}")
    argv = [*tokens[2:], f"--results={results}", f"--workdir={workdir}", "--dry_run=true"]
    with contextlib.redirect_stdout(sys.stderr):
        code = modelwright_main(argv)
    if code != 0:
        raise SystemExit(f"{arguments}: exit {code}")
    return f"plan resolved: {' '.join(tokens[2:])}"


def check_predictions() -> str:
    """The committed H200 predictions, predicted again by this torch and this checkout."""
    with contextlib.redirect_stdout(sys.stderr):
        code = run_script("scripts/predict_cuda.py", ["--check"])
    if code != 0:
        raise SystemExit("scripts/predict_cuda.py --check: the committed predictions are not reproduced")
    return "predictions reproduced: results/cuda-nvidia-h200/predicted-before-gpu.json"


def run_script(script: str, argv: list[str]) -> int:
    saved = sys.argv
    sys.argv = [script, *argv]
    try:
        runpy.run_path(str(REPO_ROOT / script), run_name="__main__")
    except SystemExit as done:
        return int(done.code or 0)
    finally:
        sys.argv = saved
    return 0


def check_attention(results: Path) -> str:
    """The attention benchmark end to end (timing, peak, checks, JSON, plot) on a tiny CPU case."""
    out = results / "attention-check"
    with contextlib.redirect_stdout(sys.stderr):
        code = run_script("benchmarks/attention.py",
                          ["--device", "cpu", "--seqs", "32", "64", "--warmup", "1", "--repeats", "1",
                           "--impls", "naive", "sdpa", "sdpa-math", "--out", str(out)])
    written = json.loads((out / "attention.json").read_text(encoding="utf-8"))
    if code != 0 or not all(check["allclose"] for check in written["checks"]):
        raise SystemExit(f"benchmarks/attention.py: exit {code} or outputs not close")
    return "attention benchmark: ok (CPU, sequences 32 and 64)"


def check_gpu_tests(node_ids: list[str]) -> str:
    """Every GPU test the call runs exists (a renamed one would be skipped there silently)."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *node_ids]
    proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"pytest --collect-only: exit {proc.returncode}\n{proc.stdout[-2000:]}"
                         f"{proc.stderr[-2000:]}")
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    return f"GPU tests collected: {len(collected)}"


def check_one_step(workdir: Path) -> str:
    """One optimizer step of the small CNN on the CPU, as ``main.py fit`` runs it, and its record."""
    from modelwright.train.cli import cli_main

    with contextlib.redirect_stdout(sys.stderr):
        code = cli_main(["fit", "--model.network", "SmallCNN", "--data.batch_size", "8",
                         "--data.train_size", "16", "--data.val_size", "8", "--trainer.accelerator", "cpu",
                         "--trainer.max_steps", "1", "--trainer.enable_progress_bar", "false",
                         "--trainer.logger.init_args.save_dir", str(workdir / "one-step")])
    records = list((workdir / "one-step").glob("*/version_0/record.json"))
    status = json.loads(records[0].read_text(encoding="utf-8"))["status"] if records else None
    if code != 0 or status != "ok":
        raise SystemExit(f"one-step fit: exit {code}, record status {status}")
    return "one-step fit on the CPU: ok"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, required=True, help="a scratch results folder")
    parser.add_argument("--workdir", type=Path, required=True, help="a scratch folder for run folders")
    parser.add_argument("--study-args", action="append", default=[], help="one study part's arguments")
    parser.add_argument("--gpu-test", action="append", default=[], help="a GPU test's node id")
    args = parser.parse_args(argv)
    print(check_imports(), flush=True)
    for arguments in args.study_args:
        print(check_study(arguments, args.results, args.workdir), flush=True)
    print(check_predictions(), flush=True)
    print(check_attention(args.results), flush=True)
    print(check_gpu_tests(args.gpu_test), flush=True)
    print(check_one_step(args.workdir), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
