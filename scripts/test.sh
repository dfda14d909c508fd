#!/usr/bin/env bash
# The test command: formatting, lints, every test, and a CPU smoke run of the main job.
# Works on a fresh machine with only the Rust toolchain and python3/pip: it installs the
# NVRTC 13.0 compiler library (a PyPI wheel) that the kernel-compile test needs.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s ==\n' "$*"; }

step "NVRTC for the GPU-less kernel-compile test"
if [ -x scripts/install-nvrtc.sh ]; then
  NVRTC_LIB=$(scripts/install-nvrtc.sh)
  export FLASHMOE_NVRTC_LIB="$NVRTC_LIB"
  export LD_LIBRARY_PATH="$(dirname "$NVRTC_LIB")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "NVRTC: $NVRTC_LIB"
fi

step "numpy for the Python input-generator tests"
python3 -c "import numpy" 2>/dev/null || python3 -m pip install --quiet numpy
python3 -c "import numpy; print('numpy', numpy.__version__)"

step "Work protocol model of the sm_90a attention kernel (dispenser, posted tile, K/V ring)"
python3 tools/models/ring_protocol_model.py --trials 1000

step "Merge protocol of a split work tile (sm_90a): the kernel's passes, each mutation fails"
python3 tools/models/split_merge_model.py
python3 tools/models/split_merge_model.py --mutants

step "Varlen work-tile enumeration (sm_90a): every tile once, longest first"
python3 tools/models/varlen_schedule_model.py 500

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (warnings are errors)"
cargo clippy --workspace --all-targets --release -- -D warnings

step "the product crate alone (default features: no lab module may be needed)"
cargo clippy -p flashmoe --all-targets --release -- -D warnings

step "rustdoc (broken links are errors): the product crate as an engine's developer reads it, then the lab's"
RUSTDOCFLAGS="-D warnings" cargo doc -p flashmoe --no-deps --release --quiet
RUSTDOCFLAGS="-D warnings" cargo doc -p flashmoe --features lab --no-deps --release --quiet
RUSTDOCFLAGS="-D warnings" cargo doc -p flashmoe-bench -p flashmoe-cli --no-deps --release --quiet

step "cargo test"
cargo test --workspace --release

step "flashmoe-candle: candle-core's CUDA backend built with nvcc from PyPI wheels and link stubs (no toolkit)"
(
  eval "$(scripts/install-nvcc.sh)"
  cargo fmt --manifest-path crates/flashmoe-candle/Cargo.toml -- --check
  # One build with warnings as errors: a separate clippy pass would run candle-kernels'
  # nvcc build (minutes on 2 cores) a second time. Clippy it by hand when editing it.
  RUSTFLAGS="-D warnings" cargo test --manifest-path crates/flashmoe-candle/Cargo.toml
)

step "Python package: abi3 wheel (maturin), core binding tests without a GPU or torch (pytest)"
(
  venv=target/py-venv
  [ -x $venv/bin/python ] || python3 -m venv $venv
  $venv/bin/python -m pip install --quiet --upgrade maturin pytest
  cargo fmt --manifest-path crates/flashmoe-py/Cargo.toml -- --check
  rm -rf target/py-wheels
  RUSTFLAGS="-D warnings" $venv/bin/maturin build --release --quiet \
    -m crates/flashmoe-py/Cargo.toml -o target/py-wheels
  $venv/bin/python -m pip install --quiet --force-reinstall --no-deps target/py-wheels/flashmoe-*.whl
  cd crates/flashmoe-py && ../../$venv/bin/python -m pytest -q tests
)

step "CPU smoke run of the main job"
smoke=$(mktemp -d)
trap 'rm -rf "$smoke"' EXIT
cargo run --release -q -- bench attention --preset quick --out "$smoke/a" --max-time 1
for f in results.json results.csv results.md report.html; do
  test -s "$smoke/a/$f" || { echo "missing $smoke/a/$f"; exit 1; }
done
# An A/A comparison of a result file with itself must not report a regression.
cargo run --release -q -- compare "$smoke/a/results.json" "$smoke/a/results.json"
cargo run --release -q -- check --quick --cpu
echo "smoke run OK"
