"""What a demo session measured: counters, the report, its JSON and text.

`TransferTotals` and `InstanceStats` accumulate during a session;
`SessionReport` is what `demo.session.Session.run` returns.  Its JSON form
(`SessionReport.to_json`) is `attrs.asdict` of `ReportSummary`, whose
fields declare the keys; `format_report` prints it as a console table and
`write_diagram` draws the live lifecycle diagram.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

import attrs

from connector.scheduler.requests import RequestTracker
from demo.spec import WorkloadConfig
from lifecycle import Row, render
from lifecycle.kv import TABLE, Event, KVTracker, State
from lifecycle.trace import pair_key

_ADMITTING: Final = frozenset({State.NEW, State.RESET})
_ADMIT: Final = frozenset({Event.ALLOC_LOCAL, Event.ALLOC_EXTERNAL})


@attrs.define
class TransferTotals:
    """Store calls of one kind, summed over the session."""

    calls: int = 0
    keys: int = 0
    failed_keys: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, figures: Mapping[str, Any]) -> None:
        """Add one interval's figures (the connector's stats payload)."""
        self.calls += figures.get("ops", 0)
        self.keys += figures.get("keys", 0)
        self.failed_keys += sum(figures.get("failures", {}).values())
        self.bytes += figures.get("bytes", 0)
        self.seconds += sum(figures.get("latencies_s", ()))

    @property
    def gb_per_s(self) -> float:
        """Bytes moved per second spent inside the calls (GB = 1e9 B)."""
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


@attrs.define
class InstanceStats:
    """What one instance saw (filled by a lifecycle observer and the loop)."""

    name: str
    role: str
    submitted: int = 0
    finished: int = 0
    outcomes: collections.Counter[str] = attrs.Factory(collections.Counter)
    admissions: int = 0
    admitted_tokens: int = 0
    local_hit_tokens: int = 0
    external_admissions: int = 0
    external_hit_tokens: int = 0
    aborts_sent: int = 0
    replayed_finishes: int = 0
    load_failed_recomputed: list[str] = attrs.Factory(list)
    recovered: dict[str, str] = attrs.Factory(dict)

    def observe(
        self, tracker: KVTracker, source: State, event: Event, dest: State
    ) -> None:
        """Lifecycle observer: count admissions and recomputed loads."""
        del dest
        if source in _ADMITTING and event in _ADMIT:
            self.admissions += 1
            self.admitted_tokens += tracker.num_tokens
            if isinstance(tracker, RequestTracker):
                self.local_hit_tokens += tracker.num_local_tokens
            self.external_admissions += event is Event.ALLOC_EXTERNAL
        elif event is Event.LOAD_FAILED and source is State.LOADING:
            self.load_failed_recomputed.append(tracker.req_id)


@attrs.frozen
class SessionReport:
    """Everything a session measured; `to_json` for machines."""

    config: WorkloadConfig
    wall_s: float
    ticks: int
    instances: tuple[InstanceStats, ...]
    transitions: Mapping[Row[State, Event, Any, Any], int]
    illegal: Mapping[tuple[State | None, Event], int]
    stale: Mapping[tuple[State, Event], int]
    worker_illegal: Mapping[tuple[State | None, Event], int]
    worker_stale: Mapping[tuple[State, Event], int]
    preemptions: int
    resumed: int
    loads: TransferTotals
    saves: TransferTotals
    lookups: TransferTotals
    block_bytes: int
    load_faults_injected: int
    failed_load_jobs: int
    mismatches: int
    failures: tuple[str, ...]
    crashes: tuple[str, ...]
    live_trackers: int
    open_jobs: int
    leaked_blocks: int
    master_restarts: int
    trace_files: tuple[str, ...]

    @property
    def finished(self) -> int:
        """Requests that finished, over both instances."""
        return sum(i.finished for i in self.instances)

    @property
    def outcomes(self) -> collections.Counter[str]:
        """Finished requests by vLLM's final status."""
        total: collections.Counter[str] = collections.Counter()
        for inst in self.instances:
            total.update(inst.outcomes)
        return total

    @property
    def prefix_hit_rate(self) -> float:
        """Share of admitted prompt tokens not recomputed (local + store)."""
        tokens = sum(i.admitted_tokens for i in self.instances)
        hits = sum(
            i.local_hit_tokens + i.external_hit_tokens for i in self.instances
        )
        return hits / tokens if tokens else 0.0

    @property
    def cross_instance(self) -> InstanceStats:
        """Instance B, whose store hits are all prefixes A saved."""
        return self.instances[1]

    @property
    def recovered_loads(self) -> int:
        """Failed loads whose request then finished normally."""
        return sum(
            status == "FINISHED_LENGTH_CAPPED"
            for inst in self.instances
            for status in inst.recovered.values()
        )

    def tokens(self, transfer: TransferTotals) -> int:
        """Tokens moved by whole-block transfers."""
        blocks = transfer.bytes // self.block_bytes if self.block_bytes else 0
        return blocks * self.config.block_size

    @property
    def ok(self) -> bool:
        """No crash, mismatch, failed check, leak or unfinished request."""
        return not (
            self.crashes
            or self.mismatches
            or self.failures
            or self.live_trackers
            or self.open_jobs
            or self.leaked_blocks
            or self.finished != self.config.requests
        )

    def summary(self) -> ReportSummary:
        """The JSON form's fields (rounded as printed)."""
        wall = self.wall_s
        instances = self.instances
        return ReportSummary(
            requests=self.config.requests,
            seed=self.config.seed,
            wall_s=round(wall, 3),
            requests_per_s=round(self.finished / wall, 1) if wall else 0.0,
            finished=self.finished,
            outcomes=dict(sorted(self.outcomes.items())),
            prefix_hit_rate=round(self.prefix_hit_rate, 4),
            cross_instance_hits=CrossInstanceHits(
                self.cross_instance.external_admissions,
                self.cross_instance.external_hit_tokens,
            ),
            tokens_loaded=self.tokens(self.loads),
            tokens_saved=self.tokens(self.saves),
            bytes_loaded=self.loads.bytes,
            bytes_saved=self.saves.bytes,
            load_gb_per_s=round(self.loads.gb_per_s, 4),
            save_gb_per_s=round(self.saves.gb_per_s, 4),
            store_calls=StoreCalls(
                self.lookups.calls, self.loads.calls, self.saves.calls
            ),
            preemptions=self.preemptions,
            resumed=self.resumed,
            aborts_sent=sum(i.aborts_sent for i in instances),
            load_failures=LoadFailures(
                injected=self.load_faults_injected,
                failed_load_jobs=self.failed_load_jobs,
                recomputed=sum(
                    len(i.load_failed_recomputed) for i in instances
                ),
                recovered=self.recovered_loads,
            ),
            replayed_finishes=sum(i.replayed_finishes for i in instances),
            transitions={edge_name(r): n for r, n in self.transitions.items()},
            illegal=_named(self.illegal),
            stale=_named(self.stale),
            worker_illegal=_named(self.worker_illegal),
            worker_stale=_named(self.worker_stale),
            mismatches=self.mismatches,
            failures=list(self.failures),
            crashes=list(self.crashes),
            live_trackers=self.live_trackers,
            open_jobs=self.open_jobs,
            leaked_blocks=self.leaked_blocks,
            master_restarts=self.master_restarts,
            instances={i.name: InstanceSummary.of(i) for i in instances},
            trace_files=list(self.trace_files),
            ok=self.ok,
        )

    def to_json(self) -> dict[str, Any]:
        """The report as plain JSON values (`attrs.asdict` of `summary`)."""
        return attrs.asdict(self.summary())


def edge_name(row: Row[State, Event, Any, Any]) -> str:
    """`SOURCE --event--> DEST`, as `python -m lifecycle replay` keys it."""
    return str(row)


def illegal_name(key: tuple[State | None, Event]) -> str:
    """`STATE/event` (`unknown/event` for an untracked request)."""
    return pair_key(*key)


# -- the JSON form: typed fields, serialized by attrs.asdict ----------------


@attrs.frozen
class CrossInstanceHits:
    """Admissions of instance B that loaded A's KV, and their tokens."""

    requests: int
    tokens: int


@attrs.frozen
class StoreCalls:
    """Store calls by operation."""

    exists: int
    get: int
    put: int


@attrs.frozen
class LoadFailures:
    """Injected load faults and what became of them."""

    injected: int
    failed_load_jobs: int
    recomputed: int
    recovered: int


@attrs.frozen
class InstanceSummary:
    """One instance in the JSON report."""

    role: str
    submitted: int
    finished: int
    outcomes: dict[str, int]
    admissions: int
    local_hit_tokens: int
    store_hit_admissions: int
    store_hit_tokens: int

    @classmethod
    def of(cls, stats: InstanceStats) -> InstanceSummary:
        """The summary of one instance's counters."""
        return cls(
            role=stats.role,
            submitted=stats.submitted,
            finished=stats.finished,
            outcomes=dict(sorted(stats.outcomes.items())),
            admissions=stats.admissions,
            local_hit_tokens=stats.local_hit_tokens,
            store_hit_admissions=stats.external_admissions,
            store_hit_tokens=stats.external_hit_tokens,
        )


@attrs.frozen
class ReportSummary:
    """`SessionReport` as JSON: one field per key, in output order.

    `SessionReport.to_json` is `attrs.asdict` of this, so the JSON's keys
    and types are declared here once and checked by mypy.
    """

    requests: int
    seed: int
    wall_s: float
    requests_per_s: float
    finished: int
    outcomes: dict[str, int]
    prefix_hit_rate: float
    cross_instance_hits: CrossInstanceHits
    tokens_loaded: int
    tokens_saved: int
    bytes_loaded: int
    bytes_saved: int
    load_gb_per_s: float
    save_gb_per_s: float
    store_calls: StoreCalls
    preemptions: int
    resumed: int
    aborts_sent: int
    load_failures: LoadFailures
    replayed_finishes: int
    transitions: dict[str, int]
    illegal: dict[str, int]
    stale: dict[str, int]
    worker_illegal: dict[str, int]
    worker_stale: dict[str, int]
    mismatches: int
    failures: list[str]
    crashes: list[str]
    live_trackers: int
    open_jobs: int
    leaked_blocks: int
    master_restarts: int
    instances: dict[str, InstanceSummary]
    trace_files: list[str]
    ok: bool


_Pair = TypeVar("_Pair", tuple[State, Event], tuple[State | None, Event])


def _named(counts: Mapping[_Pair, int]) -> dict[str, int]:
    return {illegal_name(key): n for key, n in counts.items()}


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
