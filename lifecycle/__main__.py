"""Command line: ``python -m lifecycle {render,table,demo,replay}``.

Every table command takes ``--table MODULE:NAME`` (default: the KV
lifecycle, ``lifecycle.kv:TABLE``).  Exit status: 0 success, 1 a check
failed (stale diagrams, a trace of another table, malformed trace lines),
2 a usage or input error (unknown table, unreadable trace).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

import attrs

from lifecycle import render
from lifecycle.table import Table

MAX_DIFF_LINES = 80
DEFAULT_TABLE = "lifecycle.kv:TABLE"


@attrs.define(auto_exc=True, slots=False)
class TableNotFoundError(Exception):
    """``--table`` does not name a `Table`; `message` says why."""

    message: str

    def __str__(self) -> str:
        return self.message


def load_table(spec: str) -> Table[Any, Any, Any, Any]:
    """The `Table` named by ``MODULE:NAME``.

    Raises:
        TableNotFoundError: the module, the name or the table is missing.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        msg = f"--table must be MODULE:NAME, got {spec!r}"
        raise TableNotFoundError(msg)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        msg = f"cannot import {module_name!r}: {exc}"
        raise TableNotFoundError(msg) from exc
    table = getattr(module, attr, None)
    if not isinstance(table, Table):
        msg = f"{spec} is not a lifecycle.Table (got {type(table).__name__})"
        raise TableNotFoundError(msg)
    return table


def _default_out() -> Path:
    """``./diagrams`` when the working directory has one, else ``.``."""
    diagrams = Path("diagrams")
    return diagrams if diagrams.is_dir() else Path()


def _render(args: argparse.Namespace, table: Table[Any, Any, Any, Any]) -> int:
    out = _default_out() if args.out is None else Path(args.out)
    if not args.check:
        for path in render.write(out, table, args.stem):
            print(f"wrote {path}")
        return 0
    diffs, skipped = render.check(out, table, args.stem)
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
        f"run `python -m lifecycle render --table {args.table} --out {out}`",
        file=sys.stderr,
    )
    return 1


def _table(_args: argparse.Namespace, table: Table[Any, Any, Any, Any]) -> int:
    print(render.to_markdown(table), end="")
    return 0


def _demo(_args: argparse.Namespace, _table: Table[Any, Any, Any, Any]) -> int:
    from lifecycle.demo import walk  # noqa: PLC0415 - only for this command

    return walk()


def _replay(args: argparse.Namespace, table: Table[Any, Any, Any, Any]) -> int:
    from lifecycle.trace import (  # noqa: PLC0415
        TableMismatchError,
        TraceError,
        replay_file,
    )

    try:
        others = [load_table(spec) for spec in args.also]
    except TableNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        result = replay_file(args.trace, table=table, tables=others)
    except TableMismatchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.summary(), indent=2, sort_keys=True))
    else:
        print(result.render(args.request), end="")
    if result.malformed:
        print(
            f"error: {len(result.malformed)} malformed line(s) in "
            f"{args.trace}",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = argparse.ArgumentParser(prog="python -m lifecycle")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_table(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--table",
            default=DEFAULT_TABLE,
            metavar="MODULE:NAME",
            help=f"the table (default: {DEFAULT_TABLE})",
        )

    p = sub.add_parser("render", help="write a table's dot, mmd and svg")
    with_table(p)
    p.add_argument("--check", action="store_true", help="fail if stale")
    p.add_argument(
        "--out",
        default=None,
        help="directory (default: ./diagrams if it exists, else the "
        "current one; never the installed package)",
    )
    p.add_argument(
        "--stem", default=None, help="file name stem (default: table name)"
    )
    p.set_defaults(func=_render)
    p = sub.add_parser("table", help="print a table as Markdown")
    with_table(p)
    p.set_defaults(func=_table)
    p = sub.add_parser("demo", help="walk one request through a preemption")
    p.set_defaults(func=_demo, table=DEFAULT_TABLE)
    p = sub.add_parser(
        "replay",
        help="replay a lifecycle trace: paths, first illegal ordering, counts",
    )
    with_table(p)
    p.add_argument("trace", help="a JSONL trace (lifecycle_trace)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--request", help="show only this request id's path")
    p.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="MODULE:NAME",
        help="another table of a trace shared by several lifecycles "
        "(repeatable)",
    )
    p.set_defaults(func=_replay)
    args = parser.parse_args(argv)
    try:
        table = load_table(args.table)
    except TableNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    status: int = args.func(args, table)
    return status


if __name__ == "__main__":
    sys.exit(main())
