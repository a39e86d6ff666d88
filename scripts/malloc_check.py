"""Run pytest under glibc's malloc checks; a crash fails loudly.

A use-after-free of KV memory (Mooncake's copy threads reading or writing
torch storage already freed) shows only as heap corruption, often long
after the bad write.  This runs the given test files ``--runs`` times,
each in a fresh interpreter with:

* ``PYTHONMALLOC=malloc``: Python's small objects come from glibc too, so
  a stray write lands in checked chunks;
* ``MALLOC_PERTURB_=165``: freed (and fresh) memory is filled with a
  pattern, so a read of freed KV is garbage and a write into it corrupts
  the heap's bookkeeping where it is checked;
* ``MALLOC_CHECK_=3`` with glibc's ``libc_malloc_debug.so.0`` preloaded
  (glibc >= 2.34 needs the preload), when the library is found;
* ``LIBC_FATAL_STDERR_=1`` and ``--capture=sys``: glibc's abort message
  and pytest's faulthandler traceback reach the terminal (fd 2 is not
  captured), and a run killed by a signal is named here.

Exit status: 0 when every run passed, else 1 (the first failing run's
signal or status is printed).  Usage::

    python scripts/malloc_check.py --runs 3 tests/test_worker_seams.py
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

_DEBUG_MALLOC = "libc_malloc_debug.so.0"
_LIB_DIRS = (
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/lib64",
    "/usr/lib64",
)


def debug_malloc() -> str | None:
    """The path of glibc's debug malloc, or None (MALLOC_CHECK_ then off)."""
    for folder in _LIB_DIRS:
        path = Path(folder) / _DEBUG_MALLOC
        if path.exists():
            return str(path)
    return None


def checked_env(*, perturb: int = 165) -> dict[str, str]:
    """This process's environment with the malloc checks switched on."""
    env = dict(os.environ)
    env.update(
        PYTHONMALLOC="malloc",
        MALLOC_PERTURB_=str(perturb),
        LIBC_FATAL_STDERR_="1",
        PYTHONFAULTHANDLER="1",
    )
    preload = debug_malloc()
    if preload is not None:
        env["MALLOC_CHECK_"] = "3"
        env["LD_PRELOAD"] = " ".join(
            p for p in (preload, env.get("LD_PRELOAD", "")) if p
        )
    return env


def describe(returncode: int) -> str:
    """A run's exit status in words (a signal by name)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exit status {returncode}"


def main(argv: list[str] | None = None) -> int:
    """Run the tests `--runs` times under the checks; 0 when all passed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="run every time even after a failure (to count failures)",
    )
    parser.add_argument("pytest_args", nargs="+")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    env = checked_env()
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--capture=sys",
        *args.pytest_args,
    ]
    checks = {k: env[k] for k in ("PYTHONMALLOC", "MALLOC_PERTURB_")}
    checks |= {k: env[k] for k in ("MALLOC_CHECK_", "LD_PRELOAD") if k in env}
    print(f"malloc-check: {checks}", flush=True)
    failed: list[str] = []
    for run in range(1, args.runs + 1):
        started = time.monotonic()
        try:
            rc = subprocess.run(  # noqa: S603
                command, env=env, timeout=args.timeout, check=False
            ).returncode
            outcome = describe(rc)
        except subprocess.TimeoutExpired:
            rc, outcome = 1, f"timed out after {args.timeout:.0f} s"
        took = time.monotonic() - started
        print(
            f"malloc-check: run {run}/{args.runs}: {outcome} ({took:.1f} s)",
            flush=True,
        )
        if rc != 0:
            failed.append(f"run {run}: {outcome}")
            if not args.keep_going:
                break
    if failed:
        print(
            f"malloc-check: FAILED {len(failed)} run(s): {'; '.join(failed)}",
            flush=True,
        )
        return 1
    print(f"malloc-check: {args.runs} run(s) passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
