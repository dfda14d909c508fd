#!/usr/bin/env bash
# Install NVRTC 13.0 (the run-time CUDA compiler, from the PyPI wheel nvidia-cuda-nvrtc,
# matching the GPU machine's CUDA 13.0) into <repo>/.nvrtc if it is not there yet, and
# print the directory holding libnvrtc.so.13 on stdout (messages go to stderr), so that
#
#   export FLASHMOE_NVRTC_LIB="$(scripts/install-nvrtc.sh)"
#
# points flashmoe at it. Needs python3 with pip; no GPU, no CUDA toolkit. Offline: put
# the wheel file in <repo>/.whl/ (or set FLASHMOE_NVRTC_WHEEL to its path) first.
set -euo pipefail

version="13.0.88"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target="${FLASHMOE_NVRTC_TARGET:-$repo/.nvrtc}"
libdir="$target/nvidia/cu13/lib"
python="${PYTHON:-python3}"

installed_version() {
    local meta
    for meta in "$target"/nvidia_cuda_nvrtc-*.dist-info/METADATA; do
        [ -f "$meta" ] && sed -n 's/^Version: //p' "$meta" && return 0
    done
    return 0
}

if [ -f "$libdir/libnvrtc.so.13" ] && [ "$(installed_version)" = "$version" ]; then
    echo "$libdir"
    exit 0
fi

if ! command -v "$python" >/dev/null 2>&1; then
    echo "install-nvrtc: $python not found; install Python 3 with pip, or set PYTHON" >&2
    exit 1
fi
if ! "$python" -m pip --version >/dev/null 2>&1; then
    echo "install-nvrtc: '$python -m pip' does not work; install pip (e.g. apt-get install python3-pip)" >&2
    exit 1
fi

spec="nvidia-cuda-nvrtc==$version"
wheel="${FLASHMOE_NVRTC_WHEEL:-}"
if [ -z "$wheel" ]; then
    for w in "$repo"/.whl/nvidia_cuda_nvrtc-"$version"-*.whl; do
        [ -f "$w" ] && wheel="$w" && break
    done
fi
if [ -n "$wheel" ]; then
    echo "install-nvrtc: installing $wheel into $target" >&2
    spec="$wheel"
else
    echo "install-nvrtc: installing $spec into $target (about 100 MB)" >&2
fi

rm -rf "$target"
mkdir -p "$target"
# --no-deps: the wheel is self-contained; --target keeps it out of the user's Python.
# PIP_BREAK_SYSTEM_PACKAGES: allowed because --target never touches the system site.
PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore "$python" -m pip install --quiet --disable-pip-version-check \
    --no-deps --no-compile --target "$target" "$spec" >&2

if [ ! -f "$libdir/libnvrtc.so.13" ]; then
    echo "install-nvrtc: $spec installed but $libdir/libnvrtc.so.13 is missing; wheel layout:" >&2
    find "$target" -name 'libnvrtc*' >&2 || true
    exit 1
fi
echo "$libdir"
