#!/usr/bin/env bash
# One call on a CUDA machine: the default study on resnet18, the ViT study, and the loop-overhead benchmark,
# within about 8 minutes on one H200, into results/<gpu slug>/ (docs/gpu.md).
#
# To run: bash scripts/gpu_run.sh            (from the repository root; --dry-run prints the commands only;
#         --check installs the carried wheels and checks that every part imports and parses its config, on any
#         machine, CUDA or not, then stops)
#
# Needs no uv and no network: it uses $PYTHON (default python3), which must have torch and lightning; the
# other runtime dependencies come from wheels in .whl/ when that folder exists (docs/gpu.md lists them).
# Each part has its own time cap; a part that runs out of time keeps what it recorded (the study resumes
# where it stopped when run again) and the next part runs.
set -euo pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
RESULTS="${RESULTS:-results}"
DRY=0
CHECK=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
[[ "${1:-}" == "--check" ]] && CHECK=1

if [[ -d .whl ]] && compgen -G ".whl/*.whl" > /dev/null; then
    SITE="${TMPDIR:-/tmp}/modelwright-site"
    if [[ $DRY == 0 ]]; then
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

if [[ $CHECK == 1 ]]; then
    # What the parts need, without a GPU: the imports, and the CLI parsing the default config.
    "$PY" - <<'PYEOF'
import importlib
for name in ("torch", "lightning", "jsonargparse", "accelerate", "tensorboard", "torchvision", "torchmetrics",
             "matplotlib", "yaml", "modelwright.train.cli", "modelwright.study", "modelwright.report",
             "modelwright.loops.accelerate", "callbacks.run_record"):
    importlib.import_module(name)
print("imports: ok")
PYEOF
    "$PY" main.py fit --print_config > /dev/null
    "$PY" benchmarks/overhead.py --help > /dev/null
    # One optimizer step of the small CNN on whatever device there is, callbacks and record included.
    LOGS="$(mktemp -d)"
    "$PY" main.py fit --model.model_name smallcnn --data.batch_size 8 --data.train_size 16 --data.val_size 8 \
        --trainer.max_steps 1 --trainer.enable_progress_bar false --trainer.logger.init_args.save_dir "$LOGS" \
        > "$LOGS/fit.log" 2>&1 || { tail -20 "$LOGS/fit.log"; exit 1; }
    ls "$LOGS"/base/version_0/record.json > /dev/null
    rm -rf "$LOGS"
    echo "one-step fit: ok"
    echo "check: ok ($("$PY" -c 'import torch, lightning; print("torch", torch.__version__, "lightning", lightning.__version__)'))"
    exit 0
fi

if [[ $DRY == 1 ]]; then
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
    [[ $DRY == 1 ]] && return 0
    local start=$SECONDS rc=0
    timeout --signal=TERM --kill-after=15 "$cap" "$@" || rc=$?
    echo "== $name: exit $rc after $((SECONDS - start))s"
    [[ $rc == 0 ]] || failed+=("$name (exit $rc)")
}

# Effective batch 128 (the CPU study's, so the two compare), more steps for steadier times; the budget
# runs find the largest batch that fits 40 GiB: the realistic GPU batch sizes.
STUDY=(-m modelwright study --accelerator cuda --results "$RESULTS" --warmup-steps 3 --steps 10
       --budget-gib 40 --run-timeout-s 90 --no-readme)
step "study resnet18" 210 "$PY" "${STUDY[@]}"
step "study vit" 120 "$PY" "${STUDY[@]}" --plan configs/study/plan_vit.yaml
step "overhead resnet18" 120 "$PY" benchmarks/overhead.py --accelerator cuda --batch-size 256 \
    --warmup 5 --steps 30 --repeats 3 --run-timeout-s 60 --out "$OUT/overhead-resnet18.json"

echo "results: $OUT/"
if (( ${#failed[@]} )); then
    echo "not finished: ${failed[*]}" >&2
    exit 1
fi
