#!/usr/bin/env bash
# The device check as one command, for a GPU machine with no package index (docs/device.md): installs the bundle's
# wheels one by one (tests/device/install_bundle.py; .whl/ from tests/device/bundle.sh, carried beside the tree), then
# runs tests/device/cuda_check.py, and leaves everything under $OUT: cuda_check.json (the result, which carries the
# install report), bundle.json, and logs/ (every daemon's log, UCX's protocol tables included).
#
#   OUT=/tmp/out bash tests/device/run.sh [cuda_check.py arguments]      # e.g. --dry-run on a machine without a GPU
# Exit status: cuda_check.py's (0 passed, 1 a part failed, 2 no CUDA device).
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp/kvb-device-out}"
python="${PYTHON:-python3}"
site="${KVB_DEVICE_SITE:-/tmp/kvb-device-site}"
mkdir -p "$out/logs"
"$python" tests/device/install_bundle.py "${KVB_WHEELS:-.whl}" "$site" --report "$out/bundle.json" > /dev/null
PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" "$python" tests/device/cuda_check.py --out "$out/cuda_check.json" \
    --bundle-report "$out/bundle.json" --logs-dir "$out/logs" "$@"
