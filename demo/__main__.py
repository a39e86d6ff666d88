"""`python -m demo`: a serving session through vLLM's real scheduler.

Starts an embedded Mooncake master, runs the seeded workload of
`demo.spec` through two vLLM 0.33 schedulers with the connector, shows
a progress bar, and prints the report (`--json` for JSON).  Writes the
live lifecycle diagram, the log and, when the connector supports it, a
lifecycle trace per instance under `--out`.  Exits 1 unless every request
finished with no mismatch, failed check, crash or leak.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Final

from demo.report import format_report, write_diagram

if TYPE_CHECKING:
    from demo.report import SessionReport

DEFAULT_OUT: Final = Path("out")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m demo", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--requests", type=int, default=1000, help="requests (default 1000)"
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="folder for the diagram, log and traces (default out/)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the report as JSON"
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar"
    )
    args = parser.parse_args(argv)
    if args.requests < 2:  # noqa: PLR2004 - one per instance
        parser.error("--requests must be at least 2")
    return args


@contextlib.contextmanager
def stderr_to(path: Path) -> Iterator[IO[str]]:
    """Send file descriptor 2 (Mooncake's C++ logs) to `path`.

    Yields a stream on the original stderr, for the progress bar.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    console = os.fdopen(os.dup(saved), "w", buffering=1)
    with path.open("a", encoding="utf-8") as log_file:
        os.dup2(log_file.fileno(), 2)
        try:
            yield console
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            console.close()


@contextlib.contextmanager
def logging_to(log_path: Path) -> Iterator[None]:
    """Send every log record to `log_path` only; restore logging after."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    handler = logging.FileHandler(log_path, mode="w", encoding="utf-8")
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
        handler.close()


def main(argv: list[str] | None = None) -> int:
    """Run the demo; return the exit status."""
    args = parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "demo.log"
    with logging_to(log_path):
        report = _session(args, log_path)
    svg = write_diagram(report, out)
    if args.json:
        payload = report.to_json()
        payload["diagram"] = str(svg)
        payload["log"] = str(log_path)
        print(json.dumps(payload, indent=2))
    else:
        print(format_report(report, svg=svg), end="")
        print(f"Log: {log_path}")
    return 0 if report.ok else 1


def _session(args: argparse.Namespace, log_path: Path) -> SessionReport:
    """Start a master, run the session with a progress bar, stop it all."""
    # Imported here, once logging is set up: these import vLLM.
    from tqdm import tqdm  # noqa: PLC0415

    from connector.ops.master import EmbeddedMaster  # noqa: PLC0415
    from connector.store import clients  # noqa: PLC0415
    from demo.session import (  # noqa: PLC0415
        Session,
        single_threaded_torch,
    )
    from demo.spec import WorkloadConfig  # noqa: PLC0415

    config = WorkloadConfig(requests=args.requests, seed=args.seed)
    with stderr_to(log_path) as console, single_threaded_torch():
        bar = tqdm(
            total=config.requests,
            unit="req",
            file=console,
            disable=args.no_progress,
            desc="demo",
            mininterval=0.5,
            dynamic_ncols=True,
        )
        bar.set_postfix_str("starting the master and two vLLM schedulers")
        with EmbeddedMaster() as master:
            session = Session(config, master, trace_dir=args.out)
            bar.set_postfix_str("")

            def progress(s: Session) -> None:
                bar.update(s.finished - bar.n)
                if s.ticks % 50 == 0:
                    bar.set_postfix(
                        preempted=s.preemptions, trackers=s.live_trackers
                    )

            try:
                report = session.run(progress)
            finally:
                session.close()
                clients.close_all()  # before the master stops
        bar.close()
    return report


def _exit_now(status: int) -> None:
    """Exit with `status` once output is flushed, skipping finalization.

    The demo's master is stopped by now, and the Mooncake clients' native
    teardown at interpreter exit would only fail to unregister from it,
    logging an error line per entry after the report.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    _exit_now(main())
