#!/usr/bin/env bash
# Installs the benchmark's peer transfer engines, each in its own venv under bench/.venvs/ (gitignored):
#   bench/.venvs/nixl      NIXL 1.5.1 (UCX inside the wheel; runs on the CPU over DRAM)
#   bench/.venvs/mooncake  Mooncake Transfer Engine (non-CUDA build; needs Debian's libibverbs1 at load time)
# Usage: bash bench/setup_peers.sh [nixl] [mooncake]      (no argument: both)
# A peer that fails to install is reported and skipped; kvbench.py then skips it with a message.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venvs="$here/.venvs"
python="${PYTHON:-python3}"
want=("$@")
[ ${#want[@]} -eq 0 ] && want=(nixl mooncake)
mkdir -p "$venvs"
status=0

install_nixl() {
    "$python" -m venv "$venvs/nixl" &&
        "$venvs/nixl/bin/pip" install -q numpy &&
        "$venvs/nixl/bin/pip" install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1 &&
        "$venvs/nixl/bin/python" -c "from nixl._api import nixl_agent; print('nixl ok')"
}

install_mooncake() {
    if ! ldconfig -p | grep -q libibverbs.so.1; then
        if [ "$(id -u)" = 0 ]; then
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 || return 1
        else
            echo "mooncake needs libibverbs1: run 'sudo apt-get install -y libibverbs1'" >&2
            return 1
        fi
    fi
    "$python" -m venv "$venvs/mooncake" &&
        "$venvs/mooncake/bin/pip" install -q numpy mooncake-transfer-engine-non-cuda &&
        "$venvs/mooncake/bin/python" -c "from mooncake.engine import TransferEngine; print('mooncake ok')"
}

for peer in "${want[@]}"; do
    case "$peer" in
        nixl) install_nixl || { echo "nixl: install failed" >&2; status=1; } ;;
        mooncake) install_mooncake || { echo "mooncake: install failed" >&2; status=1; } ;;
        *) echo "unknown peer '$peer' (nixl, mooncake)" >&2; status=2 ;;
    esac
done
exit $status
