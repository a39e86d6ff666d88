#!/usr/bin/env bash
# Installs the project itself, editable and without dependencies, into VENV,
# so its entry points are live there: the `kv-lifecycle` console script and
# the `vllm.general_plugins` plugin that registers MooncakeLifecycleConnector
# with vLLM by name.
#
# Usage: scripts/install_self.sh VENV
#
# Idempotent: it does nothing when VENV already has this checkout installed
# from the same pyproject.toml (entry points live there).
set -euo pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 VENV" >&2
    exit 2
fi
VENV=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
PY="$VENV/bin/python"
STAMP="$VENV/.kv-lifecycle-editable.sha256"

want=$( (pwd; cat pyproject.toml) | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ] && [ -x "$VENV/bin/kv-lifecycle" ]; then
    exit 0
fi
echo "install_self: pip install --no-deps -e . into $VENV"
"$PY" -m pip install -q --disable-pip-version-check --no-deps -e . \
    --config-settings editable_mode=compat 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
"$PY" - <<'PYEOF'
from importlib.metadata import entry_points

names = {ep.name for ep in entry_points(group="vllm.general_plugins")}
assert "kv_lifecycle" in names, f"plugin entry point missing: {names}"
PYEOF
echo "$want" >"$STAMP"
