#!/usr/bin/env bash
# GPU check (issue 32): tests/test_cuda_path.py and benchmarks.gpu_transfer
# (32 layers, 8 KV heads, head dim 128, block 16, bf16, against the PCIe
# copy floor), on a bare machine with no network.
#
#   scripts/gpu_wheels.sh            # here, with network: fills .gpu-wheels/
#   scripts/gpu_check.sh             # on the GPU machine (carry .gpu-wheels)
#
# GPU_CHECK_PYTHON: the python to use (default /opt/torch/.venv/bin/python3,
# which has torch, pytest, attrs, numpy).  The carried wheels (transitions,
# Mooncake's CUDA build) are installed offline into .gpu-site/ (git-ignored)
# unless GPU_CHECK_INSTALL=0 (a python that already has them, e.g. .venv
# to validate the script on CPU: the tests skip CUDA cleanly and the
# benchmark reports no device).  Masters are loopback children of the tests'
# fixtures and of the benchmark (connector.ops.master.EmbeddedMaster).
# Prints one JSON line last: {"tests": {...}, "benchmark": {...}}.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_CHECK_PYTHON:-/opt/torch/.venv/bin/python3}
SITE=.gpu-site
OUT=${GPU_CHECK_OUT:-${OUT:-$(mktemp -d)}}
mkdir -p "$OUT"
if [ "${GPU_CHECK_INSTALL:-1}" = 1 ]; then
    if ! ls .gpu-wheels/*.whl >/dev/null 2>&1; then
        echo "no .gpu-wheels/*.whl: run scripts/gpu_wheels.sh first" >&2
        exit 2
    fi
    rm -rf "$SITE"
    "$PY" -m pip install --no-index --no-deps --quiet --target "$SITE" \
        .gpu-wheels/*.whl || exit 2
    export PYTHONPATH="$PWD:$PWD/$SITE${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$PWD/$SITE/bin:$PATH"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
# The store's system libraries: the carried copies only where missing here.
store_so=$("$PY" -c 'import importlib.util as u; print(u.find_spec("mooncake").submodule_search_locations[0])')/store.so
missing=$(ldd "$store_so" 2>/dev/null | awk '/not found/ {print $1}' | grep -v '^libcuda\.so' || true)
if [ -n "$missing" ] && [ -d .gpu-wheels/syslibs ]; then
    echo "missing system libraries, using carried copies: $missing" >&2
    export LD_LIBRARY_PATH="$PWD/.gpu-wheels/syslibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' >&2
timeout 300 "$PY" -m pytest tests/test_cuda_path.py -q -rs -p no:cacheprovider \
    --junitxml="$OUT/cuda_path.xml" >"$OUT/cuda_path.log" 2>&1
tests_rc=$?
tail -5 "$OUT/cuda_path.log" >&2
timeout 300 "$PY" -m benchmarks.gpu_transfer --json >"$OUT/gpu_transfer.json" \
    2>"$OUT/gpu_transfer.err"
bench_rc=$?
"$PY" - "$OUT" "$tests_rc" "$bench_rc" <<'PY'
import json, pathlib, sys
import xml.etree.ElementTree as ET

out, tests_rc, bench_rc = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
tests = {"rc": tests_rc}
try:
    suite = ET.parse(out / "cuda_path.xml").getroot().find("testsuite")
    for key in ("tests", "failures", "errors", "skipped"):
        tests[key] = int(suite.get(key, 0))
except (OSError, ET.ParseError, AttributeError) as exc:
    tests["report"] = repr(exc)
lines = (out / "gpu_transfer.json").read_text().strip().splitlines()
bench = json.loads(lines[-1]) if lines else {"rc": bench_rc, "error": (out / "gpu_transfer.err").read_text()[-2000:]}
bench.setdefault("rc", bench_rc)
print(json.dumps({"tests": tests, "benchmark": bench}))
PY
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
