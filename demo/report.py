"""The session report as a console table, and the live lifecycle diagram."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from demo.workload import SessionReport, edge_name, illegal_name
from lifecycle import render
from lifecycle.kv import TABLE

_K = TypeVar("_K")


def _rows(
    pairs: Sequence[tuple[str, object]], indent: str = "  "
) -> list[str]:
    width = max((len(k) for k, _ in pairs), default=0)
    return [f"{indent}{k:<{width}}  {v}" for k, v in pairs]


def _outcomes(report: SessionReport) -> list[str]:
    a, b = report.instances
    statuses = sorted(report.outcomes)
    width = max([len(s) for s in statuses] + [len("status")])
    head = f"  {'status':<{width}}  {'A (producer)':>12}  {'B (consumer)':>12}"
    lines = [f"{head}  {'total':>7}"]
    lines.extend(
        f"  {s:<{width}}  {a.outcomes[s]:>12}  {b.outcomes[s]:>12}  "
        f"{report.outcomes[s]:>7}"
        for s in statuses
    )
    return lines


def _sections(report: SessionReport) -> list[tuple[str, list[str]]]:
    j = report.to_json()
    b = report.cross_instance
    loads = j["load_failures"]
    hit_rate = f"{100 * report.prefix_hit_rate:.1f} % of admitted tokens"
    cross = (
        f"{b.external_admissions} admissions, {b.external_hit_tokens} tokens"
    )
    gbps = (
        f"{report.loads.gb_per_s:.4f} / {report.saves.gb_per_s:.4f} "
        f"(blocks of {report.block_bytes} B)"
    )
    evicted = (
        f"{loads['injected']} -> {loads['failed_load_jobs']} failed load(s), "
        f"{loads['recomputed']} recomputed, "
        f"{loads['recovered']} finished correctly"
    )
    leaks = (
        f"{report.live_trackers} / {report.open_jobs} / {report.leaked_blocks}"
    )
    illegal = [
        *((illegal_name(k), n) for k, n in sorted_items(report.illegal)),
        *(
            (f"worker {illegal_name(k)}", n)
            for k, n in sorted_items(report.worker_illegal)
        ),
    ]
    stale = [
        *((illegal_name(k), n) for k, n in sorted_items(report.stale)),
        *(
            (f"worker {illegal_name(k)}", n)
            for k, n in sorted_items(report.worker_stale)
        ),
    ]
    edges = [(edge_name(r), n) for r, n in report.transitions.items() if n]
    return [
        ("Requests by outcome", _outcomes(report)),
        (
            "Prefix caching",
            _rows(
                [
                    ("prefix hit rate (local + store)", hit_rate),
                    ("cross-instance hits (B loads A's KV)", cross),
                    (
                        "tokens loaded / saved",
                        f"{j['tokens_loaded']} / {j['tokens_saved']}",
                    ),
                    ("GB/s inside get / put calls", gbps),
                ]
            ),
        ),
        (
            "Faults",
            _rows(
                [
                    (
                        "preemptions (resumed)",
                        f"{report.preemptions} ({report.resumed})",
                    ),
                    ("aborts sent (some in flight)", j["aborts_sent"]),
                    ("keys evicted between lookup and load", evicted),
                    (
                        "duplicate request_finished (vLLM #43281)",
                        j["replayed_finishes"],
                    ),
                    ("master restarts", report.master_restarts),
                ]
            ),
        ),
        ("Lifecycle transitions per edge", _rows(edges)),
        (
            "Illegal events (logged no-ops; a naive connector asserts)",
            _rows(illegal) or ["  none"],
        ),
        (
            "Stale completions (from before a preemption, fenced by epoch)",
            _rows(stale) or ["  none"],
        ),
        (
            "Checks (block pool and every computed block, every step)",
            _rows(
                [
                    ("data mismatches", report.mismatches),
                    ("other failed checks", len(report.failures)),
                    ("crashes", len(report.crashes)),
                    ("leaked trackers / open jobs / blocks", leaks),
                ]
            ),
        ),
    ]


def format_report(report: SessionReport, *, svg: Path | None = None) -> str:
    """The report as aligned plain text, one section per topic."""
    config = report.config
    rate = report.finished / report.wall_s if report.wall_s else 0.0
    lines = [
        (
            f"kv-lifecycle demo: {config.requests} requests, seed "
            f"{config.seed}, 2 vLLM schedulers over one Mooncake master "
            f"({report.wall_s:.1f} s, {rate:.0f} req/s)"
        ),
    ]
    for title, body in _sections(report):
        lines.extend(["", title, *body])
    lines.extend(f"  ! {f}" for f in [*report.crashes, *report.failures][:10])
    lines.append("")
    if svg is not None:
        lines.append(f"Live diagram: {svg}")
    lines.extend(f"Lifecycle trace: {t}" for t in report.trace_files)
    lines.append(f"RESULT: {'OK' if report.ok else 'FAILED'}")
    return "\n".join(lines) + "\n"


def sorted_items(counts: Mapping[_K, int]) -> list[tuple[_K, int]]:
    """Items by descending count, then name."""
    return sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0])))


def write_diagram(report: SessionReport, out_dir: Path) -> Path:
    """Write the live diagram (`.dot`, and `.svg` with Graphviz).

    Edges are labelled and weighted by how often they fired; illegal
    (state, event) attempts are dashed.  Returns the SVG path, or the DOT
    path when Graphviz's `dot` is missing.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    dot = render.to_dot(
        TABLE,
        counts=report.transitions,
        illegal=report.illegal,
        title=(
            f"KV request lifecycle: demo session, {report.config.requests} "
            f"requests, seed {report.config.seed}"
        ),
    )
    dot_path = out_dir / "demo-lifecycle.dot"
    dot_path.write_text(dot, encoding="utf-8")
    svg = render.to_svg(dot)
    if svg is None:
        return dot_path
    svg_path = out_dir / "demo-lifecycle.svg"
    svg_path.write_text(svg, encoding="utf-8")
    return svg_path
