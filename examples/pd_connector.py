"""An example P/D producer connector for vLLM 0.33, on `lifecycle.pd`.

The prefill side of a peer-to-peer prefill/decode deployment, in the style
of vLLM's NIXL connector: when a request finishes, ``request_finished``
returns delay-free (True) and vLLM keeps its blocks until the connector
reports the request in ``finished_sending``; the decode peer pulls the
blocks and confirms, or a timeout gives up on it.

Every hook only looks the request up, fires a `lifecycle.pd.PRODUCER`
event and returns; the table decides.  So the connector never asserts,
reports ``finished_sending`` exactly once per delay-freed request (a
confirmation after an abort or a timeout, a second confirmation or a
second finish is a counted no-op), and never for a request it did not
delay-free (vLLM would assert that the id is still held).

It uses only the public API of `lifecycle`.  The data path is left out:
the "peer" is `PeerLink`, an in-process stand-in for the notification
channel a real connector has (NIXL notifications, a ZMQ socket), which
also carries the clock, so tests can drive time.

Halves (as in vLLM, they share state only through the step's metadata and
the worker's report):

- Scheduler: tracks each request from ``on_new_request``; on a normal
  finish fires ``finish`` (RUNNING -> SENDING) and ships the id to the
  worker; on an aborted one fires ``abort`` (nothing to send); applies the
  worker's release outcomes so its trackers end where the worker's did.
- Worker: starts a send (``finish``, with a deadline) for each shipped id;
  each step fires ``send_done``, ``abort`` (peer cancelled) and
  ``timeout`` (deadline passed) and reports in ``finished_sending`` every
  request whose tracker left SENDING in that step.

``kv_connector_extra_config`` keys: ``peer_link`` (the `PeerLink` name,
default ``"default"``), ``send_timeout_s`` (default 30), ``strict``
(raise on an illegal ordering, for tests; default False).

Load it with ``kv_connector_module_path="examples.pd_connector"`` and
``kv_connector="PDProducerConnector"``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Final

import attrs
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from lifecycle import LifecycleMachine, Registry
from lifecycle.pd import (
    PRODUCER,
    ProducerEvent,
    ProducerState,
    ProducerTracker,
)

__all__ = [
    "PDProducerConnector",
    "PDSendMetadata",
    "PDWorkerReport",
    "PeerLink",
]

DEFAULT_TIMEOUT_S: Final = 30.0

ProducerMachine = LifecycleMachine[
    ProducerState, ProducerEvent, ProducerTracker
]
ProducerRegistry = Registry[ProducerState, ProducerEvent, ProducerTracker]


class PeerLink:
    """An in-process stand-in for the decode peer's notification channel.

    The peer (a test, or a fake decode instance) calls `confirm` once it
    has pulled a request's blocks and `cancel` when it will not pull them;
    the producer's worker half drains both each step.  Links are named so
    that both connector halves, built by vLLM from the same config, find
    the same one.  Thread safe.

    Args:
        clock: Monotonic seconds; tests pass a clock they advance.
    """

    _links: ClassVar[dict[str, PeerLink]] = {}
    _links_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._confirmed: list[str] = []
        self._cancelled: list[str] = []
        self.offered: dict[str, list[int]] = {}

    @classmethod
    def named(cls, name: str) -> PeerLink:
        """The link called `name`, created on first use."""
        with cls._links_lock:
            link = cls._links.get(name)
            if link is None:
                link = cls._links[name] = cls()
            return link

    @classmethod
    def drop(cls, name: str) -> None:
        """Forget the link called `name` (tests)."""
        with cls._links_lock:
            cls._links.pop(name, None)

    def offer(self, req_id: str, block_ids: Iterable[int]) -> None:
        """The producer offers a finished request's blocks to the peer."""
        with self._lock:
            self.offered[req_id] = list(block_ids)

    def confirm(self, req_id: str) -> None:
        """The peer has pulled `req_id`'s blocks."""
        with self._lock:
            self._confirmed.append(req_id)

    def cancel(self, req_id: str) -> None:
        """The peer will not pull `req_id` (its request was aborted)."""
        with self._lock:
            self._cancelled.append(req_id)

    def take(self) -> tuple[list[str], list[str]]:
        """Drain (confirmed, cancelled) ids, in arrival order."""
        with self._lock:
            confirmed, self._confirmed = self._confirmed, []
            cancelled, self._cancelled = self._cancelled, []
            return confirmed, cancelled


class PDSendMetadata(KVConnectorMetadata):
    """Scheduler -> worker: the ids whose sends start this step."""

    def __init__(self, sends: tuple[str, ...]) -> None:
        self.sends = sends


class PDWorkerReport(KVConnectorWorkerMetadata):
    """Worker -> scheduler: why each released request left SENDING."""

    def __init__(self, released: dict[str, ProducerEvent]) -> None:
        self.released = released

    def aggregate(self, other: KVConnectorWorkerMetadata) -> PDWorkerReport:
        """Fold another rank's report into this one."""
        if isinstance(other, PDWorkerReport):
            return PDWorkerReport({**self.released, **other.released})
        return self


@attrs.frozen
class _Counts:
    """What the connector saw, for tests and logs."""

    illegal: dict[tuple[str, str], int]
    stale: int
    live: int


class PDProducerConnector(KVConnectorBase_V1):
    """The prefill side of a P/D pair: delay-free finish, send, release."""

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config)
        self.link = PeerLink.named(str(extra.get("peer_link", "default")))
        self.timeout_s = float(extra.get("send_timeout_s", DEFAULT_TIMEOUT_S))
        self.machine: ProducerMachine = LifecycleMachine(
            PRODUCER, strict=bool(extra.get("strict", False))
        )
        self.registry: ProducerRegistry = Registry(
            self.machine, ProducerTracker
        )
        self._starting: list[str] = []  # scheduler: sends to ship
        self._to_report: set[str] = set()  # worker: finished_sending
        self._reasons: dict[str, ProducerEvent] = {}  # worker: to the report

    # ------------------------------------------------------- scheduler side

    def on_new_request(self, request: Any) -> None:
        """Track the request from the start: an abort may come first."""
        self.registry.get_or_create(request.request_id)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """A producer never loads: no external tokens."""
        del request, num_computed_tokens
        return 0, False

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        """Nothing to do: the request stays RUNNING."""
        del request, blocks, num_external_tokens

    def build_connector_meta(self, scheduler_output: Any) -> PDSendMetadata:
        """Ship the sends that started since the last step."""
        del scheduler_output
        sends, self._starting = tuple(self._starting), []
        return PDSendMetadata(sends)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Fire ``finish`` (or ``abort``); delay-free while SENDING."""
        req_id: str = request.request_id
        aborted = request.status.name == "FINISHED_ABORTED"
        event = ProducerEvent.ABORT if aborted else ProducerEvent.FINISH
        started = self.registry.fire(req_id, event)
        tracker = self.registry.get(req_id)
        if tracker is None or tracker.state is not ProducerState.SENDING:
            return False, None
        if started and event is ProducerEvent.FINISH:
            self._starting.append(req_id)
            self.link.offer(req_id, block_ids)
        # A second finish is refused by the table, and the blocks are still
        # held for the one send: keep answering delay-free.
        return True, {"remote_request_id": req_id, "remote_blocks": block_ids}

    def update_connector_output(self, connector_output: Any) -> None:
        """End the trackers of the requests vLLM frees now.

        ``finished_sending`` decides which (vLLM frees exactly those); the
        worker's report only says why (confirmed, cancelled or expired).
        """
        report = connector_output.kv_connector_worker_meta
        reasons = report.released if isinstance(report, PDWorkerReport) else {}
        for req_id in connector_output.finished_sending or ():
            self.registry.fire(
                req_id, reasons.get(req_id, ProducerEvent.SEND_DONE)
            )

    # ---------------------------------------------------------- worker side

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start this step's sends: SENDING until confirmed or expired."""
        del forward_context, kwargs
        meta = self._get_connector_metadata()
        if not isinstance(meta, PDSendMetadata):
            return
        deadline = self.link.clock() + self.timeout_s
        for req_id in meta.sends:
            tracker = self.registry.get_or_create(req_id)
            if self.registry.fire(req_id, ProducerEvent.FINISH):
                tracker.deadline = deadline

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing is loaded."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: Any,
        attn_metadata: Any,
        **kwargs: Any,
    ) -> None:
        """Nothing is saved: the peer pulls the blocks."""

    def wait_for_save(self) -> None:
        """Nothing is saved."""

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        """(Requests released this step, None): each reported once."""
        del finished_req_ids
        confirmed, cancelled = self.link.take()
        for req_id in confirmed:
            self._end(req_id, ProducerEvent.SEND_DONE)
        for req_id in cancelled:
            self._end(req_id, ProducerEvent.ABORT)
        now = self.link.clock()
        expired = [
            t.req_id
            for t in self.registry
            if t.state is ProducerState.SENDING and t.deadline <= now
        ]
        for req_id in expired:
            self._end(req_id, ProducerEvent.TIMEOUT)
        sending, self._to_report = self._to_report, set()
        return sending or None, None

    def _end(self, req_id: str, event: ProducerEvent) -> None:
        """Fire a completion; queue one report if it released the blocks."""
        tracker = self.registry.get(req_id)
        applied = self.registry.fire(req_id, event)
        if applied and tracker is not None and tracker.release:
            self._to_report.add(req_id)
            self._reasons[req_id] = event

    def build_connector_worker_meta(self) -> PDWorkerReport | None:
        """Tell the scheduler half why each request was released."""
        reasons, self._reasons = self._reasons, {}
        return PDWorkerReport(reasons) if reasons else None

    # ---------------------------------------------------------------- state

    def counts(self) -> _Counts:
        """Illegal orderings by (state, event), stale events, live ids."""
        illegal = {
            (s.name if s is not None else "unknown", e.value): n
            for (s, e), n in self.machine.illegal_counts.items()
            if n
        }
        stale = sum(self.machine.stale_counts.values())
        return _Counts(illegal, stale, len(self.registry))
