#!/usr/bin/env bash
# A screenshot of a run in TensorBoard, as a reader sees it: the time-series dashboard at smoothing 0, filtered to
# the train/, val/, perf/ and mem/ groups (the memory anatomy figure among them), rendered by headless Chromium.
#
# To run: bash scripts/tensorboard_screenshot.sh LOG_DIR OUT.png   (needs Debian's chromium: apt install chromium)
set -euo pipefail
cd "$(dirname "$0")/.."
LOG_DIR="$1"
OUT="$2"
PORT="${PORT:-6107}"
CHROMIUM="${CHROMIUM:-chromium}"
command -v "$CHROMIUM" > /dev/null || { echo "no $CHROMIUM: apt install chromium (or set CHROMIUM)" >&2; exit 2; }
[[ -d "$LOG_DIR" ]] || { echo "LOG_DIR: no folder $LOG_DIR" >&2; exit 2; }

uv run tensorboard --logdir "$LOG_DIR" --port "$PORT" > /dev/null 2>&1 &
TENSORBOARD=$!
PROFILE="$(mktemp -d)"
trap 'kill $TENSORBOARD 2> /dev/null; rm -rf "$PROFILE"' EXIT
for _ in $(seq 60); do
    curl -sf "http://localhost:$PORT/" > /dev/null && break
    sleep 1
done
# The URL sets smoothing and the tag filter; forceSVG draws the charts as SVG, which headless Chromium renders.
URL="http://localhost:$PORT/?smoothing=0&tagFilter=%5E(train%7Cval%7Cperf%7Cmem)%2F&forceSVG=true#timeseries"
"$CHROMIUM" --headless --no-sandbox --disable-gpu --disable-background-networking --disable-component-update \
    --disable-sync --no-first-run --user-data-dir="$PROFILE" --window-size=1600,2400 --virtual-time-budget=30000 \
    --screenshot="$OUT" "$URL" 2> /dev/null
echo "$OUT"
