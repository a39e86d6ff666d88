"""The P/D example connector through vLLM 0.33's real Scheduler.

`examples.pd_connector.PDProducerConnector` answers ``request_finished``
with delay-free (True) and reports ``finished_sending`` later, when the
peer confirms, cancels or times out.  vLLM asserts that every id in
``finished_sending`` is a request it still holds, and the harness checks
after every step that no block is freed twice and at the end that none
leaked.  So each test passing means: no assert, no double free, no leak.
"""

from __future__ import annotations

import collections
import random

import pytest

pytest.importorskip("vllm")

from examples.pd_connector import PeerLink
from harness import Harness
from lifecycle.pd import ProducerEvent, ProducerState
from tests.connector_helpers import prompt

pytestmark = pytest.mark.vllm

CONNECTOR = "examples.pd_connector.PDProducerConnector"
TIMEOUT_S = 2.0
STEP_S = 0.1


class Clock:
    """The peer link's clock: advanced by the test, 0.1 s per step."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def link(request):
    name = request.node.nodeid
    link = PeerLink.named(name)
    link.clock = Clock()
    yield name, link
    PeerLink.drop(name)


def make(link_name, **kwargs):
    return Harness(
        CONNECTOR,
        kv_role="kv_producer",
        extra_config={"peer_link": link_name, "send_timeout_s": TIMEOUT_S},
        **kwargs,
    )


def drive(h, link, peer=None, *, more=lambda: False, max_steps=600):
    """Step until idle (and `more()` is false); `peer(step, link)` acts
    between steps.  Returns how often each id was in ``finished_sending``.
    """
    reported = collections.Counter()
    for step in range(max_steps):
        if h.is_idle() and not more():
            break
        report = h.step()
        reported.update(report.finished_sending)
        link.clock.now += STEP_S
        if peer is not None:
            peer(step, link)
    h.check()
    return reported


def halves(h):
    return h.scheduler_connector, h.worker_connector


def test_delay_free_finish_then_confirmation_releases_once(link) -> None:
    name, peer_link = link
    h = make(name)
    for i in range(6):
        h.add_request(f"r{i}", prompt(i, 40), max_tokens=3)
    returned = []
    sched, worker = halves(h)
    original = sched.request_finished

    def spy(request, block_ids):
        result = original(request, block_ids)
        returned.append((request.request_id, result[0], len(block_ids)))
        return result

    sched.request_finished = spy

    def confirm_all(_step, lk):
        for req_id in list(lk.offered):
            del lk.offered[req_id]
            lk.confirm(req_id)

    reported = drive(h, peer_link, confirm_all)

    assert sorted(r for r, delay_free, n in returned if delay_free and n) == [
        f"r{i}" for i in range(6)
    ]
    assert reported == {f"r{i}": 1 for i in range(6)}
    assert h.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 6}
    assert len(sched.registry) == len(worker.registry) == 0
    assert sched.machine.illegal_counts.total() == 0
    assert worker.machine.illegal_counts.total() == 0
    assert sched.machine.transition_counts()  # the scheduler saw the ends
    ends = {
        str(row): n for row, n in sched.machine.transition_counts().items()
    }
    assert ends["SENDING --send_done--> SENT"] == 6


def test_a_send_the_peer_never_confirms_times_out(link) -> None:
    name, peer_link = link
    h = make(name)
    h.add_request("r", prompt(1, 40), max_tokens=2)
    sched, worker = halves(h)

    reported = drive(h, peer_link)  # nobody confirms

    assert reported == {"r": 1}
    ends = {str(r): n for r, n in sched.machine.transition_counts().items()}
    assert ends["SENDING --timeout--> EXPIRED"] == 1
    # The peer confirms after all: a counted no-op, nothing reported.
    peer_link.confirm("r")
    sending, _ = worker.get_finished(set())
    assert sending is None
    assert worker.machine.illegal_counts[(None, ProducerEvent.SEND_DONE)] == 1


def test_a_second_finish_is_refused_and_changes_nothing(link) -> None:
    name, peer_link = link
    h = make(name)
    h.add_request("r", prompt(2, 40), max_tokens=2)
    sched, _ = halves(h)
    while "r" not in peer_link.offered:
        h.step()
    request = h.requests["r"]
    blocks = h.scheduler.kv_cache_manager.get_block_ids("r")[0]

    # vLLM #43281's pattern: request_finished again for the same request.
    delay_free, _ = sched.request_finished(request, blocks)

    assert delay_free  # its blocks are still held for the one send
    key = (ProducerState.SENDING, ProducerEvent.FINISH)
    assert sched.machine.illegal_counts[key] == 1
    peer_link.confirm("r")
    reported = drive(h, peer_link)
    assert reported == {"r": 1}


PLANS = (
    "confirm",
    "confirm-twice",
    "cancel",
    "cancel-then-confirm",
    "silent",
    "confirm-at-deadline",
    "confirm-after-timeout",
    "client-abort-then-confirm",
)


class RacingPeer:
    """Admits requests, aborts some, and plays the decode peer (seeded)."""

    def __init__(self, h, n, seed) -> None:
        self.h = h
        self.rng = random.Random(seed)  # noqa: S311 - a workload, not crypto
        self.pending = {
            f"r{i}": (
                prompt(i, self.rng.randint(8, 60)),
                self.rng.randint(1, 12),
            )
            for i in range(n)
        }
        self.plans = {}
        self.offered_at = {}

    def __call__(self, step, lk) -> None:
        rng = self.rng
        for req_id in list(self.pending)[: rng.randint(0, 3)]:
            tokens, max_tokens = self.pending.pop(req_id)
            self.h.add_request(req_id, tokens, max_tokens=max_tokens)
            self.plans[req_id] = rng.choice(PLANS)
        running = [r.request_id for r in self.h.scheduler.running]
        if running and rng.random() < 0.15:
            self.h.abort(rng.choice(running), in_flight=rng.random() < 0.5)
        if rng.random() < 0.05:
            lk.confirm(f"stray-{step}")
        for req_id in list(lk.offered):
            age = step - self.offered_at.setdefault(req_id, step)
            if self.act(req_id, age, lk):
                del lk.offered[req_id]

    def act(self, req_id, age, lk) -> bool:
        """What the peer does with an offered request; True: done with it."""
        plan = self.plans[req_id]
        if plan == "silent":
            return True
        if plan == "client-abort-then-confirm":
            self.h.abort(req_id)  # finished already: vLLM ignores the abort
            self.plans[req_id] = "confirm"
            return False
        if plan in ("confirm", "confirm-twice"):
            if age >= 2:
                lk.confirm(req_id)
                if plan == "confirm-twice":
                    lk.confirm(req_id)
            return age >= 2
        if plan in ("cancel", "cancel-then-confirm"):
            lk.cancel(req_id)
            if plan == "cancel-then-confirm":
                lk.confirm(req_id)
            return True
        late = TIMEOUT_S if plan == "confirm-at-deadline" else TIMEOUT_S + 1
        if (age + 1) * STEP_S < late:
            return False
        lk.confirm(req_id)
        return True


def test_aborts_and_finishes_racing_the_send(link) -> None:
    """A seeded mix of what can race a send.

    Aborts of running requests (between steps and in flight, so some land
    in the step that finishes the request), client aborts after the finish
    (vLLM ignores them), peer confirmations, duplicate confirmations,
    cancellations followed by a confirmation, confirmations in the step
    the deadline passes and after it, and confirmations of ids never
    offered.
    """
    name, peer_link = link
    h = make(name, num_blocks=40, max_num_seqs=8)
    sched, worker = halves(h)
    peer = RacingPeer(h, n=40, seed=7)

    reported = drive(
        h, peer_link, peer, more=lambda: bool(peer.pending), max_steps=3000
    )

    assert not peer.pending
    assert all(count == 1 for count in reported.values()), reported
    finished = h.finished_by_status()
    assert sum(finished.values()) == 40
    assert finished["FINISHED_ABORTED"] >= 1
    assert len(sched.registry) == len(worker.registry) == 0
    # Exactly the delay-freed requests were reported, each once, and the
    # scheduler half ended each one the way the worker did.
    counts = sched.machine.transition_counts()
    ends = collections.Counter()
    for row, count in counts.items():
        if row.source is ProducerState.SENDING:
            ends[row.dest] += count
    started = sum(
        c for r, c in counts.items() if r.dest is ProducerState.SENDING
    )
    assert sum(reported.values()) == sum(ends.values()) == started
    assert ends[ProducerState.SENT] >= 1
    assert ends[ProducerState.EXPIRED] >= 1
    assert ends[ProducerState.ABORTED] >= 1
    illegal = worker.machine.illegal_counts
    assert illegal[(None, ProducerEvent.SEND_DONE)] >= 1  # late or stray


def test_a_duplicate_report_would_crash_vllm(link) -> None:
    """What the table prevents: vLLM asserts on a second report."""
    name, peer_link = link
    h = make(name)
    h.add_request("r", prompt(3, 40), max_tokens=2)
    while "r" not in peer_link.offered:
        h.step()
    peer_link.confirm("r")
    assert drive(h, peer_link) == {"r": 1}
    from vllm.v1.outputs import KVConnectorOutput  # noqa: PLC0415

    with pytest.raises(AssertionError):
        h.scheduler._update_from_kv_xfer_finished(
            KVConnectorOutput(finished_sending={"r"})
        )
