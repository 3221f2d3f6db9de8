#!/usr/bin/env bash
# Assembles, here, the wheels tests/device/cuda_check.py needs on a GPU host that has no package index: they travel
# beside the source tree (docs/device.md). The device image is expected to have torch with CUDA 13, cuda-bindings,
# grpcio, protobuf, numpy, uvloop and prometheus-client; what it lacks, and the check needs:
#   grpcio-health-checking, grpcio-reflection, grpcio-status   (the daemon, every mode; pure Python, about 60 KB)
#   nixl (pure Python) + nixl-cu13 1.5.1 (one wheel per CPython: cp310..cp314, about 58.7 MB each)
#                                                              (device-direct mode and the raw nixl check)
# Budget: the device machine takes 64 MiB with the source tree (about 2.2 MB), so one nixl-cu13 wheel fits and no
# second: --python names the CPython versions to try, in order of preference (default 3.12, the image's so far);
# each one's nixl-cu13 is kept only while the whole stays under 64 MiB, else it is left out, saying so. No
# grpcio/protobuf of our own fits beside NIXL (grpcio alone is 7.4 MB): the host's must meet pyproject.toml's pins.
# On the GPU host, tests/device/run.sh installs the wheels one by one (tests/device/install_bundle.py): a wheel its
# Python cannot take is skipped, the rest installed, and without NIXL the check runs host-staged only and says why.
#
#   bash tests/device/bundle.sh [--no-nixl] [--python 3.12[,3.11...]] [DIR]   # DIR: .whl (ignored by git)
set -euo pipefail
nixl=1
pythons=3.12
while (($#)); do
    case "$1" in
        --no-nixl) nixl=0; shift ;;
        --python) pythons="$2"; shift 2 ;;
        *) break ;;
    esac
done
dir="${1:-.whl}"
limit=$((64 * 1024 * 1024))
cd "$(dirname "$0")/../.."
mkdir -p "$dir"
python="${PYTHON:-python3}"
download() {  # download PYTHON_VERSION DEST SPEC...
    local version="$1" dest="$2"
    shift 2
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$dest" "$@"
}
bytes_of() { if compgen -G "$1/*.whl" > /dev/null; then du -cb "$1"/*.whl | tail -1 | cut -f1; else echo 0; fi; }
tree_bytes=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
first="${pythons%%,*}"
download "$first" "$dir" grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 grpcio-status==1.85.3
if ((nixl)); then
    download "$first" "$dir" nixl==1.5.1
    staging=$(mktemp -d)
    trap 'rm -rf "$staging"' EXIT
    IFS=, read -ra versions <<< "$pythons"
    for version in "${versions[@]}"; do
        rm -f "$staging"/*.whl
        download "$version" "$staging" nixl-cu13==1.5.1
        total=$(($(bytes_of "$dir") + $(bytes_of "$staging") + tree_bytes))
        if ((total > limit)); then
            echo "bundle: nixl-cu13 for Python $version left out: $(((total - limit) / 1000)) kB over the 64 MiB" \
                 "limit (a device Python of that version runs host-staged only)" >&2
            continue
        fi
        mv "$staging"/*.whl "$dir"/
    done
fi
wheel_bytes=$(bytes_of "$dir")
total=$((wheel_bytes + tree_bytes))
echo "bundle: $(ls "$dir" | wc -l) wheels ($(ls "$dir" | tr '\n' ' ')), $((wheel_bytes / 1000)) kB; source tree" \
     "$((tree_bytes / 1000)) kB; together $((total / 1000)) kB (limit $((limit / 1000)) kB)"
if ((total > limit)); then
    echo "bundle: over the device machine's 64 MiB limit" >&2
    exit 1
fi
