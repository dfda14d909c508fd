#!/usr/bin/env bash
# Install what `candle-core`'s `cuda` feature needs to BUILD on a machine with no CUDA
# toolkit and no GPU (CI: rustup's Rust, gcc, python3 + pip), into <repo>/.cuda-nvcc, and
# print the environment to use on stdout (messages go to stderr):
#
#   eval "$(scripts/install-nvcc.sh)"
#   cargo test --manifest-path crates/flashmoe-candle/Cargo.toml
#
# Why each piece (candle-core 0.11.1, candle-kernels 0.11.1, cudarc 0.19.10):
# - candle-kernels' build.rs (cudaforge) runs nvcc: PTX for its kernels and a static
#   libmoe.a. nvcc, cicc/ptxas, the CUDA headers and CCCL (cub, thrust) come from the
#   PyPI wheels nvidia-cuda-nvcc, -nvvm, -crt, -runtime and -cccl (CUDA 13.0, the GPU
#   machine's version). With no GPU to query, CUDA_COMPUTE_CAP must be set (default 90).
# - candle-core turns on cudarc's `dynamic-linking`, so every executable (tests too) is
#   LINKED against libcuda, libnvrtc, libcurand, libcublas, libcublasLt and libcudart.
#   libcudart.so.13 is in the runtime wheel (an unversioned symlink is added). For the
#   others no wheel is needed to link: this script builds stub libraries with gcc that
#   export every function cudarc declares, under the real sonames (libcuda.so.1,
#   libnvrtc.so.13, libcurand.so.10, libcublas.so.13, libcublasLt.so.13). Every stub
#   returns an error code (34 = CUDA_ERROR_STUB_LIBRARY for the driver), so a program
#   run against them sees "no GPU" instead of crashing.
# - Running a test binary on the CPU machine: the loader needs those sonames at start-up,
#   so LD_LIBRARY_PATH gets the stubs (.cuda-nvcc/stubs-run) and libcudart's folder.
#   On a GPU machine leave that LD_LIBRARY_PATH out and point it at the real libraries.
#
# Needs python3 with pip, gcc, cargo (to find cudarc's sources for the stub symbol
# lists); no GPU, no CUDA toolkit. About 100 MB download, 280 MB on disk.
set -euo pipefail

cuda_major="13"
wheels=(
    "nvidia-cuda-nvcc==13.0.88"
    "nvidia-nvvm==13.0.88"
    "nvidia-cuda-crt==13.0.88"
    "nvidia-cuda-runtime==13.0.96"
    "nvidia-cuda-cccl==13.0.85"
)
# Bump when the stub generator or the wheel set changes, to force a reinstall.
layout_version="1"

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target="${FLASHMOE_NVCC_TARGET:-$repo/.cuda-nvcc}"
root="$target/nvidia/cu$cuda_major"
stamp="$target/.installed"
want_stamp="$layout_version ${wheels[*]}"
python="${PYTHON:-python3}"
manifest="${FLASHMOE_CANDLE_MANIFEST:-$repo/crates/flashmoe-candle/Cargo.toml}"

print_env() {
    cat <<EOF
export CUDA_HOME="$root"
export NVCC="$root/bin/nvcc"
export PATH="$root/bin:\$PATH"
export CUDA_COMPUTE_CAP="\${CUDA_COMPUTE_CAP:-90}"
# CPU machine only: lets test binaries start (stub libcuda & co. answer "no GPU").
export LD_LIBRARY_PATH="$target/stubs-run:$root/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
EOF
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want_stamp" ] && [ -x "$root/bin/nvcc" ]; then
    print_env
    exit 0
fi

for tool in "$python" gcc cargo; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "install-nvcc: $tool not found" >&2
        exit 1
    fi
done
if ! "$python" -m pip --version >/dev/null 2>&1; then
    echo "install-nvcc: '$python -m pip' does not work; install pip (e.g. apt-get install python3-pip)" >&2
    exit 1
fi

# Offline: wheel files in <repo>/.whl/ are used first (pip --find-links).
find_links=()
[ -d "$repo/.whl" ] && find_links=(--find-links "$repo/.whl")

echo "install-nvcc: installing ${wheels[*]} into $target (about 100 MB)" >&2
rm -rf "$target"
mkdir -p "$target"
# --no-deps: the set above is complete; --target keeps it out of the user's Python.
PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore "$python" -m pip install --quiet \
    --disable-pip-version-check --no-deps --no-compile "${find_links[@]}" \
    --target "$target" "${wheels[@]}" >&2

if ! "$root/bin/nvcc" --version >/dev/null 2>&1; then
    echo "install-nvcc: $root/bin/nvcc does not run; layout:" >&2
    find "$target" -maxdepth 4 -name 'nvcc*' >&2 || true
    exit 1
fi
# Link-time name for -lcudart (candle-kernels links libmoe.a against it).
ln -sf "libcudart.so.$cuda_major" "$root/lib/libcudart.so"

# cudarc's bindings list the functions; its sources come with `cargo fetch`.
cudarc_src=""
if [ -f "$manifest" ]; then
    cargo fetch --quiet --manifest-path "$manifest" >&2 || true
    cudarc_src="$(cargo metadata --quiet --format-version 1 --manifest-path "$manifest" 2>/dev/null |
        "$python" -c 'import json,os,sys
m=json.load(sys.stdin)
print(next((os.path.dirname(p["manifest_path"]) for p in m["packages"] if p["name"]=="cudarc"), ""))' || true)"
fi
if [ -z "$cudarc_src" ]; then
    cudarc_src="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.* 2>/dev/null | sort -V | tail -1 || true)"
fi
if [ ! -f "$cudarc_src/src/driver/sys/mod.rs" ]; then
    echo "install-nvcc: cudarc 0.19 sources not found (run cargo fetch first)" >&2
    exit 1
fi
echo "install-nvcc: building stub libraries from $cudarc_src" >&2

# module dir in cudarc : link name : soname : error code every stub returns
stubs="driver:cuda:libcuda.so.1:34 nvrtc:nvrtc:libnvrtc.so.$cuda_major:1
curand:curand:libcurand.so.10:999 cublas:cublas:libcublas.so.$cuda_major:1
cublaslt:cublasLt:libcublasLt.so.$cuda_major:1"
mkdir -p "$root/lib/stubs" "$target/stubs-run" "$target/stubs-src"
for spec in $stubs; do
    IFS=: read -r module link soname code <<<"$spec"
    c="$target/stubs-src/$link.c"
    "$python" - "$cudarc_src/src/$module/sys/mod.rs" "$code" >"$c" <<'PY'
import re, sys
path, code = sys.argv[1], sys.argv[2]
decl = re.compile(r'^\s*(?:pub\s+)?fn\s+([A-Za-z_][A-Za-z0-9_]*)\s*\((.*)\)\s*(?:->\s*(.*?))?\s*;\s*$')
names = {}
for line in open(path):
    m = decl.match(line)
    if m:
        ret = (m.group(3) or '').strip()
        names[m.group(1)] = ret.startswith('*')
print('/* Generated by scripts/install-nvcc.sh from cudarc bindings: link-time stub. */')
print('static const char stub_msg[] = "CUDA stub library (built for linking only; no GPU)";')
for name in sorted(names):
    if names[name]:
        print(f'const char *{name}(void) {{ return stub_msg; }}')
    else:
        print(f'long {name}(void) {{ return {code}; }}')
PY
    gcc -shared -fPIC -O1 -w -Wl,-soname,"$soname" -o "$root/lib/stubs/lib$link.so" "$c"
    cp "$root/lib/stubs/lib$link.so" "$target/stubs-run/$soname"
done

echo "$want_stamp" >"$stamp"
echo "install-nvcc: $("$root/bin/nvcc" --version | tail -2 | head -1)" >&2
print_env
