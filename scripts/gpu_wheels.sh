#!/usr/bin/env bash
# Prepare .gpu-wheels/ (git-ignored) for scripts/gpu_check.sh on a bare GPU
# machine with no network: cp312 wheels of transitions and of Mooncake's
# CUDA build (mooncake-transfer-engine, the version pinned for the non-CUDA
# one), slimmed to what the store needs (the full wheel is ~98 MB; the
# process-group, expert-parallel and benchmark binaries are left out), the
# CUDA 12 runtime the store links against, and copies of this machine's
# system libraries the store needs, used only where the GPU machine lacks
# them.  Run here (with network), then carry .gpu-wheels to the device.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=.gpu-wheels
MOONCAKE=mooncake-transfer-engine==0.3.13.post1
rm -rf "$OUT" && mkdir -p "$OUT/full" "$OUT/syslibs"
"$PY" -m pip download --no-deps --python-version 3.12 --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$OUT/full" "transitions>=0.9.3,<0.10" "$MOONCAKE" \
    "nvidia-cuda-runtime-cu12>=12.4,<13"
mv "$OUT"/full/transitions-*.whl "$OUT/"
"$PY" - "$OUT" <<'PY'
"""Slim the Mooncake wheel; move libcudart.so.12 into its libs folder."""
import base64, hashlib, pathlib, sys, zipfile

out = pathlib.Path(sys.argv[1])
full = out / "full"
(src,) = full.glob("mooncake_transfer_engine-*.whl")
(cudart_whl,) = full.glob("nvidia_cuda_runtime_cu12-*.whl")
drop = ("libmooncake_pg", "transfer_engine_bench", "libmooncake_ep",
        "/pg_2_", "/_ep.", "mooncake_client")
with zipfile.ZipFile(cudart_whl) as z:
    (name,) = [n for n in z.namelist() if n.endswith("/libcudart.so.12")]
    cudart = z.read(name)
records = []
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(
    out / src.name, "w", zipfile.ZIP_DEFLATED
) as zout:
    record_name = next(n for n in zin.namelist() if n.endswith("RECORD"))
    extra = {"mooncake_transfer_engine.libs/libcudart.so.12": cudart}
    items = [(i.filename, zin.read(i)) for i in zin.infolist()
             if i.filename != record_name
             and not any(d in i.filename for d in drop)]
    for name, data in [*items, *extra.items()]:
        zout.writestr(name, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest())
        records.append(f"{name},sha256={digest.rstrip(b'=').decode()},{len(data)}")
    records.append(f"{record_name},,")
    zout.writestr(record_name, "\n".join(records) + "\n")
PY
rm -rf "$OUT/full"
# System libraries of store.so (not glibc, not CUDA's driver), as found here.
tmp=$(mktemp -d)
"$PY" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
    "$(ls "$OUT"/mooncake_transfer_engine-*.whl)" "$tmp"
ldd "$tmp/mooncake/store.so" | awk '$3 ~ /^\/(usr\/)?lib/ {print $3}' \
    | grep -v -E '/(libc|libm|libdl|librt|libpthread|libresolv|libgcc_s|libstdc\+\+)\.so' \
    | while read -r lib; do cp -L "$lib" "$OUT/syslibs/"; done
rm -rf "$tmp"
du -sh "$OUT"
