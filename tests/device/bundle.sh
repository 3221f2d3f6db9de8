#!/usr/bin/env bash
# Assembles the wheels tests/device/cuda_check.py needs on a GPU host that has no package index, beside the source
# tree: an NVIDIA H200 image with Python 3.12, torch 2.11 (CUDA 13), cuda-bindings, grpcio, protobuf, numpy, uvloop
# and prometheus-client already installed (docs/device.md). What it lacks, and the check needs:
#   grpcio-health-checking, grpcio-reflection, grpcio-status   (the daemon; about 60 KB together)
#   nixl + nixl-cu13 1.5.1                                     (device-direct mode and the raw nixl check; 58.8 MB)
# Budget: about 60 MB together with the source tree (2.1 MB). Measured 2026-12: 58.84 MB of wheels + 2.07 MB of tree
# = 60.9 MB, 0.9 MB over the target but inside the device machine's 64 MiB working-tree limit (the hard limit,
# checked here); nothing more fits: no grpcio/protobuf of our own (grpcio alone is 7.4 MB), so the host's must satisfy
# pyproject.toml's pins (the check reports their versions). --no-nixl leaves NIXL out (host-staged mode only; the device-direct part and
# the raw nixl check then report "skipped").
#
#   bash tests/device/bundle.sh [--no-nixl] [DIR]     # default DIR: .whl (add "/.whl/" to .git/info/exclude)
# On the GPU host:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site python3 tests/device/cuda_check.py --out cuda_check.json
set -euo pipefail
nixl=1
if [[ "${1:-}" == "--no-nixl" ]]; then nixl=0; shift; fi
dir="${1:-.whl}"
target=$((60 * 1000 * 1000))
limit=$((64 * 1024 * 1024))
cd "$(dirname "$0")/../.."
mkdir -p "$dir"
python="${PYTHON:-python3}"
wheels=(grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 grpcio-status==1.85.3)
if ((nixl)); then wheels+=(nixl==1.5.1 nixl-cu13==1.5.1); fi
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dir" "${wheels[@]}"
wheel_bytes=$(du -cb "$dir"/*.whl | tail -1 | cut -f1)
tree_bytes=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
total=$((wheel_bytes + tree_bytes))
echo "bundle: $(ls "$dir" | wc -l) wheels, $((wheel_bytes / 1000)) kB; source tree $((tree_bytes / 1000)) kB;" \
     "together $((total / 1000)) kB (target $((target / 1000)) kB, limit $((limit / 1000)) kB)"
if ((total > limit)); then
    echo "bundle: over the device machine's 64 MiB limit" >&2
    exit 1
fi
if ((total > target)); then echo "bundle: $(((total - target) / 1000)) kB over the 60 MB target" >&2; fi
