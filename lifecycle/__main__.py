"""Command line: ``python -m lifecycle {render,table,demo,replay}``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lifecycle import render

MAX_DIFF_LINES = 80


def _render(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if not args.check:
        for path in render.write(out):
            print(f"wrote {path}")
        return 0
    diffs, skipped = render.check(out)
    for name in skipped:
        print(
            f"warning: {name} not checked (no `dot` binary)", file=sys.stderr
        )
    if not diffs:
        print(f"diagrams in {out} are up to date")
        return 0
    for diff in diffs:
        lines = diff.splitlines()
        print("\n".join(lines[:MAX_DIFF_LINES]), file=sys.stderr)
        if len(lines) > MAX_DIFF_LINES:
            more = len(lines) - MAX_DIFF_LINES
            print(f"... ({more} more diff lines)", file=sys.stderr)
    print(
        f"{len(diffs)} diagram(s) in {out} are stale: "
        "run `python -m lifecycle render`",
        file=sys.stderr,
    )
    return 1


def _table(_args: argparse.Namespace) -> int:
    print(render.to_markdown(), end="")
    return 0


def _demo(_args: argparse.Namespace) -> int:
    from lifecycle.demo import walk  # noqa: PLC0415 - only for this command

    return walk()


def _replay(args: argparse.Namespace) -> int:
    from lifecycle.trace import TraceError, replay_file  # noqa: PLC0415

    try:
        result = replay_file(args.trace)
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.summary(), indent=2, sort_keys=True))
    else:
        print(result.render(args.request), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = argparse.ArgumentParser(prog="python -m lifecycle")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("render", help="write diagrams/ from the table")
    p.add_argument("--check", action="store_true", help="fail if stale")
    p.add_argument("--out", default=str(render.DIAGRAM_DIR))
    p.set_defaults(func=_render)
    p = sub.add_parser("table", help="print the table as Markdown")
    p.set_defaults(func=_table)
    p = sub.add_parser("demo", help="walk one request through a preemption")
    p.set_defaults(func=_demo)
    p = sub.add_parser(
        "replay",
        help="replay a lifecycle trace: paths, first illegal ordering, counts",
    )
    p.add_argument("trace", help="a JSONL trace (lifecycle_trace)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--request", help="show only this request id's path")
    p.set_defaults(func=_replay)
    args = parser.parse_args(argv)
    status: int = args.func(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
