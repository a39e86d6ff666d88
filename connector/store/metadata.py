"""Keeps a store client's transfer metadata published after a master restart.

A peer reads this client's segment by its name (``ip:port``): its
transfer engine asks the metadata server for two entries, the segment
descriptor (``mooncake/ram/<name>``) and the RPC location
(``mooncake/rpc_meta/<name>``).  With the master's embedded HTTP metadata
server those entries live in the master's memory, so a master restart
forgets them.  Mooncake's client publishes them again only while it
re-mounts a segment, after its heartbeat thread noticed the restart
(seconds later: that thread stalls about 4.3 s per failed ping), and a
client that owns no segment never does.

`MetadataKeeper` closes that gap from outside Mooncake: it remembers the
entries as the metadata server last answered them for this client and,
when one is missing, writes the remembered value back (a PUT of exactly
what the client itself had published).  It never overwrites an entry
that exists (Mooncake's own re-publication wins), and refreshes its
copy from every entry it finds, so a descriptor updated by a later
``register_buffer`` is what it restores.  `MetadataWatch` runs a keeper
in a daemon thread every ``interval_s``.

A present descriptor can also be stale.  Mooncake's client re-mounts its
segment once right after ``setup()`` (its first heartbeat) and, on that
thread, re-publishes a copy of the descriptor it took before the PUT; a
``register_buffer`` made meanwhile (the connector registers its KV
caches right after set-up) is then missing from the entry for good
(reproduced: 2 of 12 clients that registered at once).  Given the
regions its client registered (``regions``), the keeper also checks that
the descriptor lists each of them and, when one is missing, asks the
client to publish again (``republish``: Mooncake writes its current
descriptor on every registration).

Only ``http://`` metadata servers are watched (etcd, redis and
``P2PHANDSHAKE`` keep no state in the master).  No vLLM import.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import TYPE_CHECKING, Final

import attrs

if TYPE_CHECKING:
    from collections.abc import Callable, Collection

__all__ = [
    "DEFAULT_METADATA_CHECK_S",
    "MetadataCheck",
    "MetadataKeeper",
    "MetadataWatch",
    "Region",
    "metadata_keys",
    "published_regions",
]

log: Final = logging.getLogger(__name__)

DEFAULT_METADATA_CHECK_S: Final = 1.0
"""Seconds between two checks of a client's metadata entries (two GETs
to the metadata server, about a millisecond on loopback)."""

HTTP_TIMEOUT_S: Final = 1.0
"""Bound of one request to the metadata server."""

_NOT_FOUND: Final = 404

Region = tuple[int, int]
"""A registered region: ``(address, length in bytes)``."""


def metadata_keys(name: str) -> tuple[str, str]:
    """The metadata server's keys of segment ``name`` (``ip:port``).

    As Mooncake's transfer engine names them, with the optional cluster
    prefix ``MC_METADATA_CLUSTER_ID``.
    """
    cluster = os.environ.get("MC_METADATA_CLUSTER_ID", "")
    if cluster and not cluster.endswith("/"):
        cluster += "/"
    prefix = f"mooncake/{cluster}"
    return f"{prefix}ram/{name}", f"{prefix}rpc_meta/{name}"


@attrs.frozen
class MetadataCheck:
    """What one check found.

    Attributes:
        missing: entries the metadata server did not hold.
        restored: missing entries written back.
        failed: whether the metadata server could not be asked (down,
            or it answered an error other than 404).
        stale: registered regions the published descriptor did not list.
        republished: whether the client published its descriptor again
            for them.
    """

    missing: int = 0
    restored: int = 0
    failed: bool = False
    stale: int = 0
    republished: bool = False


def published_regions(descriptor: bytes) -> frozenset[Region] | None:
    """The ``(addr, length)`` of each buffer a segment descriptor lists.

    None when ``descriptor`` is not the JSON object Mooncake's transfer
    engine writes (then nothing can be said about it).
    """
    try:
        buffers = json.loads(descriptor)["buffers"]
        return frozenset((int(b["addr"]), int(b["length"])) for b in buffers)
    except (ValueError, KeyError, TypeError):
        return None


class MetadataKeeper:
    """Restores one client's metadata entries when the server lost them.

    Args:
        url: The metadata server (``http://host:port/metadata``).
        name: The client's segment name (``ip:port``).
        timeout_s: Bound of each HTTP request.
        regions: The regions the client registered, now (checked
            against the published descriptor; none by default).
        republish: Makes the client write its current descriptor again;
            returns whether it did.
    """

    def __init__(
        self,
        url: str,
        name: str,
        *,
        timeout_s: float = HTTP_TIMEOUT_S,
        regions: Callable[[], Collection[Region]] = frozenset,
        republish: Callable[[], bool] = lambda: False,
    ) -> None:
        self.url = url
        self.name = name
        self.timeout_s = timeout_s
        self.keys = metadata_keys(name)
        self._known: dict[str, bytes] = {}
        self._regions = regions
        self._republish = republish

    @classmethod
    def for_server(
        cls,
        url: str,
        name: str,
        *,
        regions: Callable[[], Collection[Region]] = frozenset,
        republish: Callable[[], bool] = lambda: False,
    ) -> MetadataKeeper | None:
        """A keeper if ``url`` is an HTTP metadata server, else None."""
        if not url.startswith(("http://", "https://")) or not name:
            return None
        return cls(url, name, regions=regions, republish=republish)

    def follow(
        self,
        regions: Callable[[], Collection[Region]],
        republish: Callable[[], bool],
    ) -> None:
        """Check the descriptor against ``regions`` from now on."""
        self._regions = regions
        self._republish = republish

    @property
    def known(self) -> frozenset[str]:
        """The keys whose value this keeper remembers."""
        return frozenset(self._known)

    def check(
        self, stopped: Callable[[], bool] = lambda: False
    ) -> MetadataCheck:
        """Restore each missing entry; remember each present one.

        Asks for each entry: a missing one gets its remembered value
        written back, a present one's value is remembered.  A present
        segment descriptor that lacks a region registered before it was
        asked for (and still registered after) is stale: ``republish``.

        Never raises for the server's answers: a server that cannot be
        reached gives ``failed`` (the next check asks again).  Nothing is
        written back once ``stopped()`` is true (a closing client's
        Mooncake ``close()`` removes its own entries).
        """
        missing = restored = stale = 0
        failed = republished = False
        for key in self.keys:
            expected = (
                frozenset(self._regions()) if key == self.keys[0] else ()
            )
            try:
                body = self._get(key)
            except OSError:
                failed = True
                continue
            if body is not None:
                self._known[key] = body
                if expected and not stopped():
                    stale = self._stale(body, expected)
                    if stale:
                        republished = self._republish()
                continue
            missing += 1
            value = self._known.get(key)
            if value is None or stopped():
                continue  # never seen (nothing to restore), or closing
            try:
                self._put(key, value)
            except OSError as exc:
                failed = True
                log.debug("could not restore %s: %s", key, exc)
                continue
            restored += 1
        return MetadataCheck(missing, restored, failed, stale, republished)

    def _stale(self, descriptor: bytes, expected: frozenset[Region]) -> int:
        """How many regions of ``expected`` ``descriptor`` does not list.

        Only regions still registered now count (one unregistered while
        the entry was read is no fault); 0 for a descriptor that cannot
        be parsed.
        """
        published = published_regions(descriptor)
        if published is None:
            return 0
        absent = expected - published
        if absent:
            absent &= frozenset(self._regions())
        return len(absent)

    def _address(self, key: str) -> str:
        return f"{self.url}?key={urllib.parse.quote(key, safe='')}"

    def _get(self, key: str) -> bytes | None:
        """The entry's value; None on 404; OSError otherwise."""
        try:
            with urllib.request.urlopen(  # noqa: S310 - configured server
                self._address(key), timeout=self.timeout_s
            ) as resp:
                body: bytes = resp.read()
                return body
        except urllib.error.HTTPError as exc:
            if exc.code == _NOT_FOUND:
                return None
            raise

    def _put(self, key: str, value: bytes) -> None:
        request = urllib.request.Request(  # noqa: S310 - configured server
            self._address(key), data=value, method="PUT"
        )
        with urllib.request.urlopen(  # noqa: S310
            request, timeout=self.timeout_s
        ) as resp:
            resp.read()


class MetadataWatch:
    """Runs `MetadataKeeper.check` every ``interval_s`` in a daemon thread.

    ``on_check`` receives each check's result (counters, logging).  The
    first check runs at once.  ``stop`` is idempotent and bounded.
    """

    def __init__(
        self,
        keeper: MetadataKeeper,
        interval_s: float,
        on_check: Callable[[MetadataCheck], None],
    ) -> None:
        self.keeper = keeper
        self.interval_s = interval_s
        self._on_check = on_check
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            name=f"kv-lifecycle-metadata-{keeper.name}",
            daemon=True,
        )

    def start(self) -> MetadataWatch:
        """Start the thread; returns self."""
        self._thread.start()
        return self

    def stop(self, wait_s: float | None = None) -> None:
        """Stop the thread; wait for it at most ``wait_s``.

        ``wait_s`` defaults to one check's bound.  A check still running
        ends on its own (it only asks the metadata server and reports).
        """
        self._stop.set()
        if wait_s is None:
            wait_s = self.keeper.timeout_s * len(self.keeper.keys) * 2
        if self._thread.is_alive():
            self._thread.join(wait_s)

    def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                self._on_check(self.keeper.check(self._stop.is_set))
            except Exception:  # a watcher must not die silently
                log.exception("metadata check of %s failed", self.keeper.name)
            wait = self.interval_s - (time.monotonic() - started)
            if self._stop.wait(max(wait, 0.0)):
                return
