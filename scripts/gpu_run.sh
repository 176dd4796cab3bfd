#!/usr/bin/env bash
# One call on a CUDA machine: the studies (default plan, the extra settings, the ViT), the attention benchmark and
# the loop-overhead benchmark, each part under its own time cap, into results/<gpu slug>/ (docs/gpu.md).
#
# To run: bash scripts/gpu_run.sh [PART...]   (from the repository root; parts: study extra vit attention overhead,
#         default all of them; --dry-run prints the commands only; --check installs the carried wheels, checks that
#         every part imports and that the plans resolve, and trains one step, on any machine, CUDA or not)
#
# Needs no uv and no network: it uses $PYTHON (default python3), which must have torch and lightning; the other
# runtime dependencies come from wheels in .whl/ when that folder exists (docs/gpu.md). A part that runs out of time
# keeps what it recorded (a study resumes where it stopped when run again) and the next part runs.
set -euo pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
RESULTS="${RESULTS:-results}"
MODE=run
case "${1:-}" in
    --dry-run) MODE=dry; shift ;;
    --check) MODE=check; shift ;;
esac
PARTS=("$@")
(( ${#PARTS[@]} )) || PARTS=(study extra vit attention overhead)

if [[ -d .whl ]] && compgen -G ".whl/*.whl" > /dev/null; then
    SITE="${TMPDIR:-/tmp}/modelwright-site"
    if [[ $MODE != dry ]]; then
        if "$PY" -m pip --version > /dev/null 2>&1; then
            "$PY" -m pip install --quiet --no-index --no-deps --target "$SITE" .whl/*.whl
        else  # no pip in that Python: a wheel is a zip of what goes into site-packages
            "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
                "$SITE" .whl/*.whl
        fi
    fi
    export PYTHONPATH="$SITE:$PWD:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi

if [[ $MODE == check ]]; then
    TMP="$(mktemp -d)"
    # One process (each fresh one spends seconds importing torch and Lightning): what the parts import, the plans
    # resolved through LightningCLI as a study does before its first run, the benchmarks' command lines, and one
    # optimizer step of the small CNN on whatever device there is, callbacks and record included, as main.py runs it.
    "$PY" - "$TMP" 2> "$TMP/check.log" <<'PYEOF' || { tail -20 "$TMP/check.log"; exit 1; }
import contextlib
import importlib
import runpy
import sys
from pathlib import Path

tmp = Path(sys.argv[1])
sys.argv = sys.argv[:1]
for name in ("torch", "lightning", "jsonargparse", "accelerate", "tensorboard", "torchvision", "torchmetrics", "tqdm",
             "matplotlib", "yaml", "modelwright.train.cli", "modelwright.study", "modelwright.report",
             "modelwright.loops.accelerate", "callbacks.run_monitor"):
    module = importlib.import_module(name)
    if name in ("torch", "lightning"):
        print(f"{name} {module.__version__}", end="; ")
print("imports: ok")
from modelwright.study import study
from modelwright.study.plan import load_plan

for plan in sorted(Path("configs/study").glob("plan_*.yaml")):
    load_plan(plan)
assert study(dry_run=True, slug="check", results=tmp) == 0
print("plans: ok")
for script in ("benchmarks/overhead.py", "benchmarks/attention.py"):
    if Path(script).is_file():
        sys.argv = [script, "--help"]
        try:
            with contextlib.redirect_stdout(sys.stderr):
                runpy.run_path(script, run_name="__main__")
        except SystemExit as done:
            assert done.code in (0, None), f"{script} --help: exit {done.code}"
sys.argv = sys.argv[:1]
from modelwright.train.cli import cli_main

with contextlib.redirect_stdout(sys.stderr):
    code = cli_main(["fit", "--model.model_name", "smallcnn", "--data.batch_size", "8", "--data.train_size", "16",
                     "--data.val_size", "8", "--trainer.max_steps", "1", "--trainer.enable_progress_bar", "false",
                     "--trainer.logger.init_args.save_dir", str(tmp)])
assert code == 0, f"one-step fit: exit {code}"
PYEOF
    ls "$TMP"/base/version_0/record.json > /dev/null
    rm -rf "$TMP"
    echo "one-step fit: ok"
    echo "check: ok"
    exit 0
fi

if [[ $MODE == dry ]]; then
    SLUG="cuda-<gpu>"
else
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')"
    SLUG="$("$PY" -c "from modelwright.study import hardware_slug; print(hardware_slug('cuda'))")"
fi
OUT="$RESULTS/$SLUG"

failed=()
step() {  # step NAME SECONDS COMMAND...
    local name="$1" cap="$2"
    shift 2
    echo "== $name (at most ${cap}s): $*"
    [[ $MODE == dry ]] && return 0
    local start=$SECONDS rc=0
    timeout --signal=TERM --kill-after=15 "$cap" "$@" || rc=$?
    echo "== $name: exit $rc after $((SECONDS - start))s"
    [[ $rc == 0 ]] || failed+=("$name (exit $rc)")
}

# The plans' GPU window: 3 warm-up and 20 measured steps, 3 fresh-process repeats, round-robin. Effective batch 128
# (the CPU study's, so the two compare); the budget runs find the largest batch that fits 40 GiB, confirmed by a
# run at it and one a few percent over: the realistic GPU batch sizes. The studies leave the README alone.
STUDY=(-m modelwright study --accelerator cuda --results "$RESULTS" --budget_gib 40 --run_timeout_s 120
       --readme null)
for part in "${PARTS[@]}"; do
    case "$part" in
        study) step "study resnet18" 540 "$PY" "${STUDY[@]}" ;;
        extra) step "study extra" 150 "$PY" "${STUDY[@]}" --plan configs/study/plan_extra.yaml ;;
        vit) step "study vit" 150 "$PY" "${STUDY[@]}" --plan configs/study/plan_vit.yaml ;;
        attention)
            if [[ -f benchmarks/attention.py ]]; then
                step "attention" 90 "$PY" benchmarks/attention.py --device cuda --dtype bfloat16 --batch 8 \
                    --seqs 1024 2048 4096 8192 16384 --impls naive sdpa sdpa-flash sdpa-efficient sdpa-math --out "$OUT"
            else
                echo "== attention: benchmarks/attention.py not in this checkout; skipped"
            fi ;;
        overhead) step "overhead resnet18" 120 "$PY" benchmarks/overhead.py --accelerator cuda --batch-size 256 \
                      --warmup 5 --steps 30 --repeats 3 --run-timeout-s 60 --out "$OUT/overhead-resnet18.json" ;;
        *) echo "unknown part: $part (parts: study extra vit attention overhead)" >&2; exit 2 ;;
    esac
done

echo "results: $OUT/"
if (( ${#failed[@]} )); then
    echo "not finished: ${failed[*]}" >&2
    exit 1
fi
