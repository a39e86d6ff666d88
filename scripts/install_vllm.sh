#!/usr/bin/env bash
# Install vLLM 0.33.0 into VENV for scheduler-level use on a CPU machine.
#
# Usage: scripts/install_vllm.sh VENV
#
# The vllm wheel on PyPI is a CUDA build that pins torch==2.14.0 and ~75
# GPU packages, so it is never resolved with its dependencies: the wheel is
# downloaded to .cache/wheels/ and installed with --no-deps, xgrammar and
# apache-tvm-ffi likewise (they would pull triton), and the dependencies
# vLLM's scheduler path really imports come from requirements/vllm-deps.txt
# (exact pins), resolved with torch==2.13.0 as a constraint.
#
# Idempotent: it does nothing when VENV already imports vllm 0.33 and the
# pins it was installed from are unchanged.
#
# Environment:
#   VLLM_KEEP_BINARIES=1  keep vLLM's compiled CUDA binaries (~690 MB); by
#                         default they are removed, because the scheduler
#                         path loads none of them.
set -euo pipefail

VLLM_VERSION=0.33.0
if [ $# -ne 1 ]; then
    echo "usage: $0 VENV" >&2
    exit 2
fi
VENV=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
PY="$VENV/bin/python"
DEPS=requirements/vllm-deps.txt
CONSTRAINT=requirements/torch-cpu.txt
WHEELS=.cache/wheels
STAMP="$VENV/.vllm-deps.sha256"

say() { echo "install_vllm: $*"; }

# pip's known, expected noise: the machine's file indexes that lack a
# package, and the resolver listing vllm's (deliberately) unmet CUDA pins.
pip_q() {
    "$PY" -m pip -q --disable-pip-version-check "$@" 2>&1 | {
        grep -v -e "is ignored: it is neither a file nor a directory" \
            -e "^vllm ${VLLM_VERSION} requires " \
            -e "^xgrammar 0.2.8 requires triton" \
            -e "^ERROR: pip's dependency resolver does not currently" \
            || true
    }
}

vllm_ok() {
    "$PY" -c "import vllm; assert vllm.__version__.startswith('0.33')" \
        >/dev/null 2>&1
}

want_stamp=$(cat "$DEPS" "$CONSTRAINT" | sha256sum | cut -d' ' -f1)
if vllm_ok && [ "$(cat "$STAMP" 2>/dev/null)" = "$want_stamp" ]; then
    say "vllm ${VLLM_VERSION} already installed in $VENV; nothing to do"
    exit 0
fi

start=$SECONDS
torch_version() {
    "$PY" -c "import torch; print(torch.__version__)" 2>/dev/null || true
}
torch_before=$(torch_version)
if [ -z "$torch_before" ]; then
    say "ERROR: no torch in $VENV; install requirements/base.txt first" >&2
    exit 1
fi

if vllm_ok; then
    say "vllm ${VLLM_VERSION} present; refreshing its dependency pins"
else
    mkdir -p "$WHEELS"
    wheel=$(ls "$WHEELS"/vllm-"$VLLM_VERSION"-*.whl 2>/dev/null | head -n1 || true)
    if [ -z "$wheel" ]; then
        say "downloading vllm==${VLLM_VERSION} (--no-deps, ~336 MB)"
        pip_q download "vllm==${VLLM_VERSION}" --no-deps -d "$WHEELS"
        wheel=$(ls "$WHEELS"/vllm-"$VLLM_VERSION"-*.whl | head -n1)
    fi
    say "installing $(basename "$wheel") (--no-deps)"
    pip_q install --no-deps "$wheel"
fi

say "installing xgrammar==0.2.8 apache-tvm-ffi==0.1.11 (--no-deps)"
pip_q install --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.11

say "installing pinned dependencies from $DEPS"
pip_q install -c "$CONSTRAINT" -r "$DEPS"

site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if [ "${VLLM_KEEP_BINARIES:-0}" != 1 ] && [ -d "$site/vllm" ]; then
    # NOTE(harness): the scheduler path loads no compiled vLLM code, and
    # this CUDA build's binaries cannot run on CPU anyway.
    before=$(du -sm "$site/vllm" | cut -f1)
    find "$site/vllm" -name '*.so' -delete
    rm -f "$site/vllm/vllm-rs"
    after=$(du -sm "$site/vllm" | cut -f1)
    say "removed compiled binaries: vllm/ ${before} MB -> ${after} MB"
fi

torch_after=$(torch_version)
if [ "$torch_before" != "$torch_after" ]; then
    say "ERROR: torch changed from $torch_before to $torch_after" >&2
    exit 1
fi
if ! vllm_ok; then
    say "ERROR: vllm ${VLLM_VERSION} does not import in $VENV" >&2
    "$PY" -c "import vllm" >&2 || true
    exit 1
fi
echo "$want_stamp" >"$STAMP"
say "vllm ${VLLM_VERSION} ready in $VENV" \
    "(torch $torch_after, $((SECONDS - start)) s)"
