#!/usr/bin/env bash
# Build the archive that brings the third-party baselines (FlashAttention-4 / flash_attn.cute,
# QuACK, FlashInfer, xFormers) and their libraries to a GPU machine that has no package
# registry (docs/baselines.md).
# Run it where PyPI is reachable; the GPU machine needs only python3 with torch.
#
#   scripts/stage-baselines.sh [PART_MB]
#
# Output in .baselines/ (gitignored): wheels/, site/ (the unpacked packages),
# baselines-site.tar.xz, and part-00, part-01, ... of at most PART_MB MiB each (default 33:
# what fits beside the ~18 MB working tree and the carried binaries in one 64 MiB
# transfer). Unpack on the GPU machine with `scripts/device-run.sh baselines`; later calls
# of device-run.sh put the unpacked site on PYTHONPATH by themselves.
set -euo pipefail
PART_MB=${1:-33}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR="$ROOT/.baselines"
# The GPU machine: CPython 3.12 on x86-64 Linux, torch 2.11 (CUDA 13) already installed.
PY=${BASELINES_PYTHON_VERSION:-3.12}
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
# Pinned: flash-attn-4 is published as pre-releases only; cutlass-dsl's CUDA-13 libraries
# match the machine's torch (cu130). torch, numpy, typing_extensions, einops, protobuf and
# cuda-bindings are already on the machine and left out. flashinfer-python is pure Python
# (its kernels are JIT-compiled with the machine's nvcc and ninja on first use); its
# cuda-tile, nccl4py, nccl-extensions and cudnn-frontend needs come along. xformers 0.0.35
# is built on torch's stable ABI (>= 2.10).
WHEELS=(
  flashinfer-python==0.7.2.post1
  cuda-tile==1.7.0
  nccl4py==0.6.0
  nccl-extensions==0.1.0
  nvidia-cudnn-frontend==1.32.0
  xformers==0.0.35
  flash-attn-4==4.0.0b36
  quack-kernels==0.6.5
  nvidia-cutlass-dsl==4.8.1
  nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-core==4.8.1
  nvidia-cutlass-dsl-libs-cu13==4.8.1
  apache-tvm-ffi==0.1.15.post2
  torch-c-dlpack-ext==0.1.5
)
mkdir -p "$DIR/wheels"
python3 -m pip download --quiet --no-deps --pre --only-binary=:all: --python-version "$PY" \
  --implementation cp "${PLAT[@]}" -d "$DIR/wheels" "${WHEELS[@]}"

# Install = unzip (pure wheels, no scripts); PYTHONPATH skips .pth files, so the
# dsl_packages folder that nvidia_cutlass_dsl's .pth adds must go on PYTHONPATH too.
rm -rf "$DIR/site" && mkdir -p "$DIR/site"
for w in "$DIR"/wheels/*.whl; do
  case $(basename "$w") in nvidia_cutlass_dsl_libs_cu12*) continue ;; esac
  unzip -q -o "$w" -d "$DIR/site"  # keeps the .so files' modes
done
grep -q dsl_packages "$DIR"/site/nvidia_cutlass_dsl*.pth

rm -f "$DIR"/fa4-site.* "$DIR"/baselines-site.tar.xz "$DIR"/part-*
tar -C "$DIR/site" -cf - . | xz -9e -T"${XZ_THREADS:-1}" >"$DIR/baselines-site.tar.xz"
split -b "${PART_MB}M" -d "$DIR/baselines-site.tar.xz" "$DIR/part-"
ls -l "$DIR"/baselines-site.tar.xz "$DIR"/part-*
sha256sum "$DIR"/baselines-site.tar.xz | tee "$DIR/baselines-site.sha256"
