#!/usr/bin/env bash
# The Python matrix: the suite's torch-free, vLLM-free part under each
# extra supported Python (the full suite runs in .venv, Python 3.11).
#
# Usage: scripts/pymatrix.sh VERSION...      e.g. scripts/pymatrix.sh 3.12 3.13
#
# For each VERSION: finds the interpreter (pythonVERSION on PATH, else
# pyenv's newest VERSION.x), creates .venv-pyVERSION with the exact pins
# of requirements/pymatrix.txt (no torch, no vLLM: see that file) unless
# its stamp says nothing changed, and runs pytest there with
# KV_PYMATRIX=torch,vllm, so that tests needing either are skipped by
# name (tests/conftest.py) and every other failure fails.
#
# A run fails when pytest fails, when it collected nothing, when no test
# passed, or (without PYTEST_ARGS) when fewer than PYMATRIX_MIN_PASSED
# passed: a broken venv must not pass as "all skipped".  A VERSION with no interpreter on the machine is
# reported as NOT TESTED and fails the run only with PYMATRIX_REQUIRE=1.
#
# Environment:
#   PYMATRIX_MIN_PASSED  the floor of passed tests per Python (default 700)
#   PYMATRIX_REQUIRE=1   a missing interpreter is an error
#   PYTEST_ARGS          extra pytest arguments (e.g. -x, -k ...)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MIN_PASSED=${PYMATRIX_MIN_PASSED:-700}
REQS=(requirements/pymatrix.txt requirements/docs.txt)
ABSENT=torch,vllm
OUT=build/pymatrix

say() { echo "pymatrix: $*"; }

if [ $# -eq 0 ]; then
    echo "usage: $0 VERSION..." >&2
    exit 2
fi

# The interpreter for VERSION (major.minor), or nothing.
find_python() {
    local want=$1 cand
    local pyenv_root=${PYENV_ROOT:-$HOME/.pyenv}
    local -a cands=()
    cand=$(command -v "python$want" 2>/dev/null || true)
    [ -n "$cand" ] && cands+=("$cand")
    if [ -d "$pyenv_root/versions" ]; then
        while IFS= read -r cand; do
            cands+=("$cand")
        done < <(ls -d "$pyenv_root/versions/$want".*/bin/"python$want" \
            2>/dev/null | sort -rV)
    fi
    cands+=("/usr/bin/python$want" "/usr/local/bin/python$want")
    for cand in "${cands[@]}"; do
        [ -x "$cand" ] || continue
        if [ "$("$cand" -c 'import sys; print("%d.%d" % sys.version_info[:2])' \
            2>/dev/null)" = "$want" ]; then
            echo "$cand"
            return 0
        fi
    done
    return 0
}

# Creates or refreshes VENV for PYTHON; idempotent through its stamp.
make_venv() {
    local python=$1 venv=$2 stamp want
    stamp="$venv/.installed"
    want=$({ "$python" -VV; cat "${REQS[@]}"; } | sha256sum | cut -d' ' -f1)
    if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]
    then
        return 0
    fi
    local start=$SECONDS
    say "creating $venv with $("$python" -V)"
    rm -rf "$venv"
    "$python" -m venv "$venv"
    # The pins are exact: a missing wheel for this Python is an error.
    if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check \
        --only-binary :all: \
        -r requirements/pymatrix.txt >"$venv/pip.log" 2>&1; then
        grep -v "is ignored: it is neither a file nor a directory" \
            "$venv/pip.log" | tail -20 >&2
        say "pip failed for $venv"
        return 1
    fi
    "$venv/bin/python" -c "import attrs, transitions, mooncake.store, pytest" \
        || return 1
    if [ ! -x "$venv/bin/mooncake_master" ]; then
        say "$venv has no mooncake_master: the store tests cannot run"
        return 1
    fi
    echo "$want" >"$stamp"
    say "$venv ready in $((SECONDS - start)) s"
}

# "passed skipped" counted from a JUnit XML report.
count() {
    "$1" - "$2" <<'PY'
import sys
import xml.etree.ElementTree as ET

suites = ET.parse(sys.argv[1]).getroot().iter("testsuite")
tests = failed = skipped = 0
for s in suites:
    tests += int(s.get("tests", 0))
    failed += int(s.get("failures", 0)) + int(s.get("errors", 0))
    skipped += int(s.get("skipped", 0))
print(tests - failed - skipped, skipped)
PY
}

mkdir -p "$OUT"
status=0
summary=()
for version in "$@"; do
    python=$(find_python "$version")
    if [ -z "$python" ]; then
        summary+=("python$version: NOT TESTED (no interpreter on this machine)")
        [ "${PYMATRIX_REQUIRE:-0}" = 1 ] && status=1
        continue
    fi
    venv=".venv-py$version"
    if ! make_venv "$python" "$venv"; then
        summary+=("python$version: FAILED (venv)")
        status=1
        continue
    fi
    report="$OUT/py$version.xml"
    rm -f "$report"
    start=$SECONDS
    say "python$version: pytest (without $ABSENT)"
    rc=0
    # shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
    KV_PYMATRIX=$ABSENT PYTHONPATH=$ROOT "$venv/bin/python" -m pytest \
        -q -ra -p no:cacheprovider --junitxml="$report" \
        ${PYTEST_ARGS:-} || rc=$?
    took=$((SECONDS - start))
    read -r passed skipped < <(count "$venv/bin/python" "$report" \
        2>/dev/null || echo "0 0")
    line="python$version ($("$venv/bin/python" -V 2>&1)): $passed passed, "
    line+="$skipped skipped, pytest exit $rc, $took s"
    if [ "$rc" -eq 5 ]; then
        line+=" - FAILED: pytest collected nothing"
        status=1
    elif [ "$rc" -ne 0 ]; then
        line+=" - FAILED"
        status=1
    elif [ "$passed" -lt 1 ]; then
        line+=" - FAILED: no test passed"
        status=1
    elif [ -z "${PYTEST_ARGS:-}" ] && [ "$passed" -lt "$MIN_PASSED" ]; then
        line+=" - FAILED: fewer than $MIN_PASSED passed"
        status=1
    fi
    summary+=("$line")
done
for line in "${summary[@]}"; do
    say "$line"
done
exit $status
