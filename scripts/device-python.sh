#!/usr/bin/env bash
# The Python package on the GPU machine, which has torch but no Rust and no network:
# install the wheel built here, run the GPU pytest and the per-op overhead measurement.
#   here:   scripts/device-python.sh --pack     fills target/py-device: the wheel (maturin),
#                                               crates/flashmoe-py/{tests,tools}, and pytest's
#                                               wheels in whl/ for a python3 without pytest
#   device: carry target/py-device, then
#           scripts/device-python.sh [FOLDER]   writes $OUT/pytest.log, $OUT/python-overhead.json
# (scripts/device-run.sh's `python` stage runs the second form.)
set -uo pipefail
if [ "${1:-}" = "--pack" ]; then
  set -e
  cd "$(dirname "$0")/.."
  D=target/py-device
  rm -rf "$D" && mkdir -p "$D/whl"
  venv=target/py-venv
  [ -x $venv/bin/python ] || python3 -m venv $venv
  $venv/bin/python -m pip install --quiet --upgrade maturin
  $venv/bin/maturin build --release --quiet -m crates/flashmoe-py/Cargo.toml -o "$D"
  cp -r crates/flashmoe-py/tests crates/flashmoe-py/tools "$D"/
  find "$D" -name __pycache__ -prune -exec rm -rf {} +
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 -d "$D/whl" \
    pytest pluggy iniconfig packaging pygments
  du -sh "$D"
  exit 0
fi
D=$(cd "${1:-target/py-device}" && pwd)
OUT=${OUT:-/tmp/flashmoe-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLASHMOE_CACHE_DIR=${FLASHMOE_CACHE_DIR:-/tmp/fmc}
python3 -V; ldd --version | head -1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
SITE=/tmp/flashmoe-site
python3 -m pip install -q --no-deps --no-index --target "$SITE" "$D"/flashmoe-*.whl || exit 1
python3 -c "import pytest" 2>/dev/null ||
  python3 -m pip install -q --no-deps --no-index --target "$SITE" "$D"/whl/*.whl || exit 1
export PYTHONPATH=$SITE
cd "$D" || exit 1
# PYTEST_FILES: the test files (default: every test); PYTEST_K: a -k expression.
timeout "${PYTEST_LIMIT:-330}" python3 -m pytest -v -rs ${PYTEST_FILES:-tests} ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 |
  tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
timeout "${OVERHEAD_LIMIT:-90}" python3 tools/overhead.py "$OUT/python-overhead.json" || rc=1
exit "$rc"
