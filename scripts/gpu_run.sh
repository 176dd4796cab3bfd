#!/usr/bin/env bash
# The GPU study in one call (docs/gpu.md): the GPU tests; the default plan's one-GPU rows on CUDA with the GPU
# window, then their largest batch under 40 GiB; the attention benchmark; two rows at batch 2048; the
# remaining repeats. Each part runs under its own cap and all of them under one deadline, so the call ends in
# time with what it measured; results go to results/<gpu slug>/ and, where $OUT is set, are packed into $OUT.
#
# To run: bash scripts/gpu_run.sh [PART...]   on a CUDA machine, from anywhere (parts: tests study attention
#                                             batch2048 repeats; default all of them, in that order)
#         bash scripts/gpu_run.sh --dry-run   prints each part's command; runs nothing
#         bash scripts/gpu_run.sh --rehearse  on any machine: everything but the CUDA calls (scripts/gpu_check.py)
#
# Needs no uv and no network: $PYTHON (default python3) must have torch and lightning; jsonargparse and what it
# needs come from the wheels in $WHEELS (default .whl/; docs/gpu.md), installed into a temporary folder first.
# Settings from the environment: DEADLINE_S (default 480: the whole call, packing included), RESULTS (default
# results), GPU_RUN_COMMIT (the commit the working tree is a copy of: the GPU machine has no git history).
set -euo pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
RESULTS="${RESULTS:-results}"
WHEELS="${WHEELS:-.whl}"
DEADLINE_S="${DEADLINE_S:-480}"
PACK_S=30          # kept back from the deadline for the report and the packing
STEPS=200          # measured steps per row: >= 1 s of timed steps even at ~5 ms a step (docs/gpu.md)
BUDGET_GIB=40
ROWS="[baseline,amp,amp-fp16,accumulate,checkpointing-block,all]"  # ddp needs 2 GPUs
GPU_TESTS=(tests/test_cuda_memory.py tests/test_measure.py::test_cuda_peak_window_and_event_timer
           tests/test_reliability.py::test_gradscaler_skips_are_counted_in_a_16_mixed_fit
           tests/test_distributed.py::test_fsdp_config_trains_on_two_gpus)
export PYTHONUNBUFFERED=1

MODE=run
case "${1:-}" in
    --dry-run) MODE=dry; shift ;;
    --rehearse) MODE=rehearse; shift ;;
esac
PARTS=("$@")
(( ${#PARTS[@]} )) || PARTS=(tests study attention batch2048 repeats)
for part in "${PARTS[@]}"; do
    case "$part" in
        tests|study|attention|batch2048|repeats) ;;
        *) echo "unknown part: $part (parts: tests study attention batch2048 repeats)" >&2; exit 2 ;;
    esac
done

install_wheels() {  # install_wheels FOLDER: the carried wheels, without an index, into FOLDER
    local site="$1"
    compgen -G "$WHEELS/*.whl" > /dev/null || { echo "wheels: none in $WHEELS/"; return 0; }
    if "$PY" -m pip --version > /dev/null 2>&1; then
        "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            "$WHEELS"/*.whl
    else  # a wheel is a zip of what goes into site-packages
        "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
            "$site" "$WHEELS"/*.whl
    fi
    echo "wheels: installed from $WHEELS/:" $(cd "$site" && ls -d -- *.dist-info | sed 's/\.dist-info$//')
}

pack() {  # pack RESULTS_FOLDER LOG: into $OUT, which the device tool brings back (8 files of 16 MiB at most)
    tar czf "$OUT/results.tar.gz" -C "$(dirname "$1")" "$(basename "$1")"
    find lightning_logs/study -name output.log -print0 2> /dev/null \
        | tar czf "$OUT/run-logs.tar.gz" --null -T - 2> /dev/null || true
    [[ -f "$2" ]] && cp "$2" "$OUT/gpu-run.log"
    local file
    for file in "$OUT"/*; do
        (( $(stat -c %s "$file") < 16 * 1024 * 1024 )) || echo "pack: $file is over 16 MiB: it will not come back"
    done
    ls -l "$OUT"
}

# Each part's arguments after `python`. The study parts share the GPU window: 3 warm-up steps (the plan's),
# STEPS measured, batch 128 as on the CPU so that the rows compare with the CPU rows and the predictions.
study_args() {  # study_args PART SLUG
    local common="--accelerator cuda --steps $STEPS --run_timeout_s 150 --readme null --report false"
    case "$1" in
        study) echo "-m modelwright study $common --only=$ROWS --repeats 1 --budget_gib $BUDGET_GIB" \
                    "--results $RESULTS --slug $2" ;;
        repeats) echo "-m modelwright study $common --only=$ROWS --repeats 3 --budget false" \
                      "--results $RESULTS --slug $2" ;;
        batch2048) echo "-m modelwright study --accelerator cuda --steps 30 --run_timeout_s 150 --readme null" \
                        "--report false --only=[baseline,amp] --overrides={\"data.batch_size\":2048} --repeats 1" \
                        "--budget false --results $RESULTS/$2 --slug batch2048" ;;
    esac
}
part_args() {  # part_args PART SLUG
    case "$1" in
        tests) echo "-m pytest -q -p no:cacheprovider -rs ${GPU_TESTS[*]}" ;;
        attention) echo "benchmarks/attention.py --device cuda --dtype bfloat16 --batch 8" \
                        "--seqs 1024 2048 4096 8192 16384 32768 65536" \
                        "--impls naive sdpa sdpa-flash sdpa-efficient sdpa-cudnn sdpa-math" \
                        "--warmup 1 --repeats 5 --max-seconds 2 --out $RESULTS/$2" ;;
        *) study_args "$1" "$2" ;;
    esac
}
part_cap() {  # part_cap PART: seconds (docs/gpu.md sizes them)
    case "$1" in
        tests) echo 50 ;; study) echo 230 ;; attention) echo 70 ;; batch2048) echo 60 ;; repeats) echo 150 ;;
    esac
}

if [[ $MODE == dry ]]; then
    echo "gpu_run.sh: deadline ${DEADLINE_S}s for the whole call, ${PACK_S}s of it kept for the report and packing"
    for part in "${PARTS[@]}"; do
        echo "== $part (at most $(part_cap "$part")s): $PY $(part_args "$part" cuda-nvidia-h200)"
    done
    exit 0
fi

SITE="$(mktemp -d)"
install_wheels "$SITE"
export PYTHONPATH="$SITE:$PWD:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

if [[ $MODE == rehearse ]]; then
    SCRATCH="$(mktemp -d)"
    check=(scripts/gpu_check.py --results "$SCRATCH/results" --workdir "$SCRATCH/runs")
    for part in study batch2048 repeats; do
        check+=(--study-args "$(study_args "$part" cuda-nvidia-h200 | sed "s#--results [^ ]*##")")
    done
    for test in "${GPU_TESTS[@]}"; do check+=(--gpu-test "$test"); done
    "$PY" "${check[@]}" 2> "$SCRATCH/check.log" || { tail -30 "$SCRATCH/check.log"; exit 1; }
    mkdir -p "$SCRATCH/out"
    OUT="$SCRATCH/out" pack "$SCRATCH/results" "$SCRATCH/check.log" > /dev/null
    echo "packing: ok ($(ls "$SCRATCH/out" | tr '\n' ' '))"
    for part in "${PARTS[@]}"; do
        echo "== $part (at most $(part_cap "$part")s): $PY $(part_args "$part" cuda-nvidia-h200)"
    done
    rm -rf "$SCRATCH" "$SITE"
    echo "rehearsal: ok"
    exit 0
fi

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')"
SLUG="$("$PY" -c "from modelwright.study import hardware_slug; print(hardware_slug('cuda'))")"
mkdir -p "$RESULTS/$SLUG"
LOG="$RESULTS/$SLUG/gpu-run.log"
exec > >(tee -a "$LOG") 2>&1
nvidia-smi > "$RESULTS/$SLUG/nvidia-smi.txt" 2>&1 || true
export MODELWRIGHT_COMMIT="${GPU_RUN_COMMIT:-}"  # the records name the commit the copy was made from
echo "gpu_run.sh on $SLUG at $(date -Iseconds), commit ${GPU_RUN_COMMIT:-unknown}, deadline ${DEADLINE_S}s"

summary=()
run_part() {  # run_part PART: under min(its cap, what the deadline leaves)
    local part="$1" cap left start rc=0
    cap="$(part_cap "$part")"
    left=$(( DEADLINE_S - PACK_S - SECONDS ))
    (( left < cap )) && cap=$left
    if (( cap < 20 )); then
        echo "== $part: skipped, ${left}s left before the deadline"
        summary+=("{\"part\": \"$part\", \"rc\": null, \"seconds\": 0}")
        return 0
    fi
    local args
    read -r -a args <<< "$(part_args "$part" "$SLUG")"
    echo "== $part (at most ${cap}s): $PY ${args[*]}"
    start=$SECONDS
    timeout --signal=TERM --kill-after=15 "$cap" "$PY" "${args[@]}" || rc=$?
    echo "== $part: exit $rc after $(( SECONDS - start ))s"
    summary+=("{\"part\": \"$part\", \"rc\": $rc, \"seconds\": $(( SECONDS - start ))}")
}
for part in "${PARTS[@]}"; do
    run_part "$part"
done

# The studies left the report to this point: one table, summary and plots per results folder.
"$PY" - "$RESULTS/$SLUG" <<'PYEOF' || echo "report: failed (the records are kept)"
import sys
from pathlib import Path

from modelwright.report import generate

for folder in [Path(sys.argv[1]), *Path(sys.argv[1]).glob("*/")]:
    if (folder / "records.jsonl").is_file():
        print("report:", ", ".join(str(path) for path in generate(folder, allow_mixed=True)))
PYEOF
parts="$(IFS=,; echo "${summary[*]}")"
printf '{"slug": "%s", "commit": "%s", "finished_at": "%s", "wall_s": %s, "parts": [%s]}\n' "$SLUG" \
    "${GPU_RUN_COMMIT:-unknown}" "$(date -Iseconds)" "$SECONDS" "$parts" > "$RESULTS/$SLUG/gpu-run.json"
[[ -f "$RESULTS/$SLUG/table.md" ]] && cat "$RESULTS/$SLUG/table.md"
[[ -n "${OUT:-}" ]] && pack "$RESULTS/$SLUG" "$LOG"
echo "results: $RESULTS/$SLUG/ in ${SECONDS}s"
