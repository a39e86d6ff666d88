"""Typed client of the Mooncake distributed store (the connector's data plane).

``StoreClient`` wraps ``mooncake.store.MooncakeDistributedStore``:

- zero-copy batch calls only: ``batch_is_exist``, ``batch_put_from`` /
  ``batch_get_into`` (one contiguous region per key) and the
  ``*_multi_buffers`` variants (a list of pieces per key);
- every per-key return code becomes an ``Outcome``; a batch returns a
  ``BatchResult`` (a sequence of outcomes plus raw codes, bytes moved and
  latency), never an exception;
- a circuit breaker on ``health_check()`` (a cached flag, well under 1 us)
  turns a dead or hung master into one bounded stall followed by immediate
  ``MASTER_UNREACHABLE`` results, and lets one call through every
  ``breaker_probe_ms`` to detect recovery;
- per-operation counters (``stats``) for a metrics layer.

Theory of operation, per call: check the client is open, ask the breaker
(``health_check() == 0`` while closed), issue exactly one Mooncake batch
call (a put issues two: ``batch_is_exist`` first, then puts only the
missing keys), map the codes, feed RPC failures back into the breaker,
record stats. The Mooncake calls release the GIL and may run concurrently
from transfer threads; all client state is guarded by locks.

Bounds (measured with Mooncake 0.3.13.post1 on this project's machines):
a hung master costs ``rpc_timeout_ms`` per RPC (``MC_RPC_TIMEOUT_MS``);
a dead master costs a fixed reconnect stall of about 4.3-4.6 s that no
setting shortens.  The breaker makes either happen at most once per outage
per concurrent caller (``DEAD_MASTER_STALL_S`` documents the second bound).
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import os
import threading
import time
from collections.abc import Collection, Sequence
from typing import (
    TYPE_CHECKING,
    Any,
    Final,
    Self,
)

import attrs

from connector.errors import (
    RegionError,
    RegistrationError,
    StoreClosedError,
    StoreUnavailable,
)
from connector.store.batch import BatchResult
from connector.store.breaker import CircuitBreaker
from connector.store.codes import (
    _OUTAGE_CODES,
    ErrorCode,
    Op,
    Outcome,
    _exists_outcomes,
    _has_outage,
    _num_ok,
    _remove_outcomes,
    _sum_ok,
    outcome_of_error,
)
from connector.store.counters import StoreCounters
from connector.store.engine import (
    Replica,
    ReplicaReader,
    memory_replicas,
    other_replica,
    read_from,
    read_here,
)
from connector.store.faults import RateLimitedWarning, transfer_faults
from connector.store.metadata import (
    DEFAULT_METADATA_CHECK_S,
    MetadataCheck,
    MetadataKeeper,
    MetadataWatch,
)
from connector.store.mooncake import (
    MooncakeStore,
    _local_address,
    _mooncake_store,
    _probe_master,
    probe_any,
    probe_tcp,
)
from connector.store.regions import Regions, RegionsLike

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

    import torch

    from connector.config import StoreConfig

log = logging.getLogger(__name__)

DEAD_MASTER_STALL_S: Final = 5.0
"""Upper bound of one call against a freshly killed master (measured 4.6 s).

Mooncake retries the connection internally for about 4.3-4.6 s before it
returns ``RPC_FAIL``; neither ``MC_RPC_TIMEOUT_MS`` nor
``MC_RPC_CONNECT_TIMEOUT_MS`` shortens it.
"""

MASTER_GONE: Final = 0.25
"""Seconds `StoreClient.close` waits for a TCP connect to an unhealthy
master before it leaves the Mooncake client to process exit."""

_SCRATCH_BYTES: Final = 4096
"""Bytes of the page `StoreClient._republish` registers and unregisters."""

_KEPT_OPEN: list[Any] = []
"""Mooncake objects left to process exit (never destroyed)."""
_LEFT_WHY: set[str] = set()


_PEER_DOWN: Final = frozenset(
    {Outcome.TRANSFER_FAILED, Outcome.MASTER_UNREACHABLE, Outcome.TIMEOUT}
)
"""A probe's outcomes that fail every key of its segment (`get_spans`)."""


def _endpoints(
    replicas: Sequence[tuple[Replica, ...]],
) -> list[tuple[str, ...]]:
    """Per key, the segments of its replicas, in order."""
    return [tuple(r.endpoint for r in found) for found in replicas]


def _spans_end(spans: Sequence[tuple[int, int]]) -> int:
    """The last span's end.

    Raises:
        ValueError: a span is empty or out of order.
    """
    end = 0
    for a, b in spans:
        if not end <= a < b:
            msg = f"spans must be non-empty and ascending: {list(spans)}"
            raise ValueError(msg)
        end = b
    return end


def left_open() -> list[str]:
    """Why clients of this process were left to process exit (sorted)."""
    return sorted(_LEFT_WHY)


class StoreClient:
    """A Mooncake store client with typed, bounded, thread-safe calls.

    Create with ``StoreClient.open(config)``; use from any thread; call
    ``close()`` once (or use it as a context manager). Data calls never
    raise for per-key failures: read the ``BatchResult``. They raise
    ``StoreClosedError`` after ``close()`` and ``RegionError`` for
    malformed regions.
    """

    def __init__(
        self,
        store: MooncakeStore,
        config: StoreConfig,
        *,
        replicate_config: Any = None,
        check_regions: bool = False,
        reader: ReplicaReader | None = None,
        probe_on_close: bool = False,
        keeper: MetadataKeeper | None = None,
        metadata_check_s: float = DEFAULT_METADATA_CHECK_S,
    ) -> None:
        """Wrap an already set-up ``store``; prefer ``StoreClient.open``.

        ``reader`` is the transfer engine ``store`` was set up on (None:
        a failed get is not retried on another replica).  ``keeper``
        restores this client's transfer metadata when the metadata
        server lost it (checked every ``metadata_check_s`` in a daemon
        thread until ``close``; None: not watched).  With
        ``probe_on_close`` (the real store), ``close`` first checks that
        the master accepts connections.
        """
        self._probe_on_close = probe_on_close
        self._store = store
        self._reader = reader
        self._warn = RateLimitedWarning(log)
        self.config = config
        self._replicate = replicate_config
        self._check_regions = check_regions
        self.stats = StoreCounters()
        self.breaker = CircuitBreaker(
            store.health_check,
            config.breaker_probe_ms / 1000,
            on_trip=self.stats.trip,
        )
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._inflight = 0
        self._closed = False
        #: Why `close` left the Mooncake client to process exit (None: it
        #: closed it, or was not called).
        self.left_to_exit: str | None = None
        self._registered: dict[int, int] = {}
        self._starts: list[int] = []
        self._scratch: ctypes.Array[ctypes.c_char] | None = None
        if keeper is not None:
            keeper.follow(self._registered_regions, self._republish)
        self._watch = (
            MetadataWatch(keeper, metadata_check_s, self._on_metadata).start()
            if keeper is not None
            else None
        )

    # -- set-up and teardown --------------------------------------------------

    @classmethod
    def open(
        cls,
        config: StoreConfig,
        *,
        store_factory: Callable[[], tuple[MooncakeStore, Any]] | None = None,
        check_regions: bool = False,
    ) -> StoreClient:
        """Set up a client against the master named in ``config``.

        Sets ``MC_RPC_TIMEOUT_MS``, ``MC_STORE_CLIENT_SETUP_RETRIES`` (and
        ``MC_LOG_LEVEL`` if configured) in ``os.environ`` first: Mooncake
        reads them at set-up, process-wide. With the real store, the master
        RPC port is probed with a TCP connect first, so a master that is
        down fails at once instead of after Mooncake's retries.

        With the real store the client first starts a transfer engine of
        its own and sets the store up on it, so that a failed get can be
        read again from another replica (``read_replicas``).  If the
        engine cannot start or ``setup()`` refuses it, one WARNING, and
        the store is set up as before (no second try on a replica).

        Args:
            config: validated configuration.
            store_factory: returns ``(store, replicate_config)``; default
                ``MooncakeDistributedStore()`` (tests pass fakes; no
                probe then).
            check_regions: verify on every call that each region lies in
                registered memory (debugging; costs a bisect per piece).

        Raises:
            StoreUnavailable: the master is unreachable or ``setup()``
                failed; ``code`` is Mooncake's return code.
        """
        os.environ.update(config.client_env())
        if config.real_client_address is not None:
            dummy = config.real_client_address
            return cls._open_dummy(config, dummy, store_factory, check_regions)
        address = config.master_server_address
        real = store_factory is None
        if store_factory is None:
            _probe_master(config)
            store_factory = _mooncake_store
        hostname = config.local_hostname or _local_address(
            config.master_host, config.master_port
        )
        reader = None
        if real:
            reader = _open_reader(config, hostname)
        started = time.monotonic()
        store, replicate, rc = _setup(store_factory, config, hostname, reader)
        if rc != 0 and reader is not None:
            log.warning(
                "Mooncake store setup() on the connector's own transfer "
                "engine returned %s; set up without it: a load that fails "
                "on one replica is not retried on another",
                rc,
            )
            reader.close()
            reader = None
            store, replicate, rc = _setup(
                store_factory, config, hostname, None
            )
        if replicate is not None and hasattr(replicate, "replica_num"):
            replicate.replica_num = config.replica_num
        if rc != 0:
            reason = (
                f"setup() returned {rc} after "
                f"{time.monotonic() - started:.1f} s (metadata server "
                f"{config.metadata_server}, protocol {config.protocol})"
            )
            raise StoreUnavailable(
                address, rc if isinstance(rc, int) else None, reason
            )
        placed = _place(config, store, replicate)
        log.info(
            "Mooncake store client %s connected to %s in %.2f s "
            "(segment %d B, protocol %s, namespace %r, tenant %r, puts %s"
            "%s%s)",
            store.get_hostname(),
            address,
            time.monotonic() - started,
            config.global_segment_size,
            config.protocol,
            config.namespace,
            config.tenant_id,
            placed,
            ", SSD tier on" if config.enable_ssd_offload else "",
            ", replica reads on" if reader is not None else "",
        )
        keeper = (
            MetadataKeeper.for_server(
                config.metadata_server, store.get_hostname()
            )
            if real
            else None
        )
        return cls(
            store,
            config,
            replicate_config=replicate,
            check_regions=check_regions,
            reader=reader,
            probe_on_close=real,
            keeper=keeper,
        )

    @classmethod
    def _open_dummy(
        cls,
        config: StoreConfig,
        address: str,
        store_factory: Callable[[], tuple[MooncakeStore, Any]] | None,
        check_regions: bool,  # noqa: FBT001
    ) -> StoreClient:
        """A dummy client of the pool process at ``address``.

        It moves no byte itself: the pool process copies blocks between
        its memory and this process's shared memory (`staging_memory`),
        so there is no transfer engine here, no replica reader and no
        transfer metadata to keep.

        Raises:
            StoreUnavailable: nothing accepts connections at the address,
                or ``setup_dummy`` failed.
        """
        if store_factory is None:
            what = "node-level pool process (mooncake_client)"
            probe_any(address, [address], what, config)
            store_factory = _mooncake_store
        store, replicate = store_factory()
        started = time.monotonic()
        rc = store.setup_dummy(
            config.shm_pool_size, config.local_buffer_size, address
        )
        if rc != 0:
            reason = (
                f"setup_dummy() returned {rc} after "
                f"{time.monotonic() - started:.1f} s"
            )
            raise StoreUnavailable(address, rc, reason)
        if replicate is not None and hasattr(replicate, "replica_num"):
            replicate.replica_num = config.replica_num
        log.info(
            "Mooncake dummy client connected to the pool process at %s in "
            "%.2f s (shared memory %d B; the pool process moves the bytes)",
            address,
            time.monotonic() - started,
            config.shm_pool_size,
        )
        return cls(
            store,
            config,
            replicate_config=replicate,
            check_regions=check_regions,
        )

    @property
    def dummy(self) -> bool:
        """Whether this is a dummy client (``real_client_address``).

        A dummy moves blocks only to and from `staging_memory`: the
        pool process cannot read or write any other memory of this
        process.
        """
        return self.config.dummy

    def staging_memory(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of host memory a dummy client moves blocks through.

        Shared memory from the dummy's pool (``shm_pool_size``; more is
        mapped when it is used up), as a flat uint8 tensor, not yet
        registered (`register` it: the pool process only touches
        memory registered with it).  Owned by Mooncake, never freed
        before the client: drop users before `close`.

        Raises:
            ValueError: this client is not a dummy (any host memory does).
            MemoryError: the pool gave no memory.
            StoreClosedError: after ``close()``.
        """
        import torch  # noqa: PLC0415 - torch only where blocks move

        if not self.dummy:
            msg = "staging_memory is for a dummy client (real_client_address)"
            raise ValueError(msg)
        if nbytes <= 0:
            msg = f"staging memory must be a positive size, got {nbytes}"
            raise ValueError(msg)
        with self._lock:
            if self._closed:
                operation = "staging_memory"
                raise StoreClosedError(operation)
            ptr = self._store.alloc_from_mem_pool(nbytes)
        if not ptr:
            msg = (
                f"the dummy client's shared memory pool gave no {nbytes} B "
                f"(shm_pool_size {self.config.shm_pool_size} B; is /dev/shm "
                "full?)"
            )
            raise MemoryError(msg)
        array = (ctypes.c_uint8 * nbytes).from_address(ptr)
        return torch.frombuffer(array, dtype=torch.uint8)

    def close(self) -> bool:
        """Close the client; idempotent, bounded by ``close_timeout_ms``.

        Waits for in-flight calls (new calls raise ``StoreClosedError``),
        then closes the Mooncake client.  Mooncake's ``close()`` holds the
        GIL for its whole duration (measured: 1.0 s with the master up,
        16 s with it gone: every Python thread stalls), so it is skipped,
        leaving the client to process exit, when

        * calls are still in flight at the bound (closing under them
          would free what they use),
        * the master does not accept connections (``MASTER_GONE``), or
        * the client follows HA masters through etcd (``etcd://``): its
          ``close()`` held the GIL for 29 s in every run (Mooncake's
          leader watch), far past any bound.  Such a client's segment is
          dropped by the master ``client_ttl`` after the process exits,
          as a crashed instance's is; with a node-level pool the engine
          has no segment to drop.

        Returns:
            Whether the Mooncake client was closed within the bound.
        """
        deadline = time.monotonic() + self.config.close_timeout_ms / 1000
        with self._lock:
            if self._closed:
                return True
            self._closed = True
            while self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning(
                        "Mooncake store not closed: %d call(s) still in "
                        "flight after %d ms; left to process exit",
                        self._inflight,
                        self.config.close_timeout_ms,
                    )
                    break
                self._idle.wait(left)
            busy = self._inflight > 0
        if self._watch is not None:
            self._watch.stop(min(1.0, max(0.0, deadline - time.monotonic())))
        if busy:
            self._leave_to_exit("calls in flight")
            return False
        skip = self._skip_close()
        if skip is not None:
            self._leave_to_exit(skip)
            return False
        result: list[int] = []
        closer = threading.Thread(
            target=lambda: result.append(self._store.close()),
            name="mooncake-store-close",
            daemon=True,
        )
        closer.start()
        closer.join(max(0.0, deadline - time.monotonic()))
        if closer.is_alive():
            log.warning(
                "Mooncake store close() still running after %d ms; "
                "continuing without it",
                self.config.close_timeout_ms,
            )
            return False
        if self._reader is not None:
            self._reader.close()
        if result and result[0] != 0:
            log.warning("Mooncake store close() returned %d", result[0])
        return True

    def _skip_close(self) -> str | None:
        """Why Mooncake's ``close()`` must not run now (logged), if so."""
        if self._probe_on_close and self.config.master_ha:
            log.info(
                "Mooncake store of HA masters (%s) not closed: its close() "
                "would hold the GIL about 30 s; left to process exit",
                self.config.master_server_address,
            )
            return "HA masters"
        if not self._master_answers():
            log.warning(
                "Mooncake store not closed: the master at %s does not "
                "answer (its close() would stall every thread for 10-18 "
                "s); left to process exit",
                self.config.master_server_address,
            )
            return "master gone"
        return None

    def _leave_to_exit(self, why: str) -> None:
        """Keep the Mooncake objects alive until the process exits.

        Their destructors tear down like ``close()`` (GIL held, 5-10 s
        without a master); at exit, `connector.store.clients.close_all`
        ends the process before Mooncake's own exit handler would.
        """
        # Its atexit handler ends the process before Mooncake's teardown
        # (which would take as long as the close() skipped here).
        from connector.store import clients  # noqa: F401, PLC0415

        self.left_to_exit = why
        _LEFT_WHY.add(why)
        _KEPT_OPEN.append(self._store)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._store))
        if self._reader is not None:
            _KEPT_OPEN.append(self._reader)
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._reader))

    def _master_answers(self) -> bool:
        """Whether the master accepts a TCP connection now.

        Not the health flag: Mooncake's ping thread sets it seconds after
        the master died.  True without a probe (a store given by a test).
        """
        if not self._probe_on_close:
            return True
        try:
            probe_tcp(
                self.config.master_host, self.config.master_port, MASTER_GONE
            )
        except OSError:
            return False
        return True

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    @property
    def hostname(self) -> str:
        """This client's ``ip:port`` (its segment name)."""
        return self._store.get_hostname()

    @property
    def raw(self) -> MooncakeStore:
        """The underlying Mooncake client (benchmarks, diagnostics)."""
        return self._store

    @property
    def replica_reads(self) -> bool:
        """Whether a failed get is retried on another replica."""
        return self._reader is not None

    @property
    def replicate_config(self) -> Any:
        """The ``ReplicateConfig`` passed to puts."""
        return self._replicate

    # -- registration ---------------------------------------------------------

    def register(self, ptr: int, nbytes: int) -> bool:
        """Register ``[ptr, ptr + nbytes)`` for zero-copy transfers.

        Idempotent: a region inside an already registered one is a no-op.

        Returns:
            ``True`` if Mooncake was called, ``False`` if already covered.

        Raises:
            RegistrationError: Mooncake refused, or a region starting at
                ``ptr`` is registered with a different size.
            StoreClosedError: after ``close()``.
        """
        if ptr <= 0 or nbytes <= 0:
            reason = "pointer and size must be positive"
            raise RegistrationError(ptr, nbytes, 0, reason)
        with self._lock:
            if self._closed:
                operation = "register"
                raise StoreClosedError(operation)
            if self._covered(ptr, nbytes):
                return False
            if ptr in self._registered:
                reason = (
                    "already registered with size "
                    f"{self._registered[ptr]}; unregister first"
                )
                raise RegistrationError(ptr, nbytes, 0, reason)
            rc = self._store.register_buffer(ptr, nbytes)
            if rc != 0:
                raise RegistrationError(ptr, nbytes, rc, "Mooncake refused")
            self._registered[ptr] = nbytes
            bisect.insort(self._starts, ptr)
            log.debug("registered %d B at %#x", nbytes, ptr)
            return True

    def register_tensor(self, tensor: torch.Tensor) -> bool:
        """Register the whole storage behind ``tensor`` (see ``register``)."""
        storage = tensor.untyped_storage()
        return self.register(storage.data_ptr(), storage.nbytes())

    def unregister(self, ptr: int) -> int:
        """Forget a region registered at exactly ``ptr``.

        Returns:
            Its size in bytes (to register it again).

        Raises:
            RegistrationError: it was not registered, or Mooncake refused
                (as it does while the master's metadata server is down);
                a refused region stays registered here, as it stays in
                Mooncake's transfer engine.
        """
        with self._lock:
            nbytes = self._registered.get(ptr)
            if nbytes is None:
                reason = "not registered"
                raise RegistrationError(ptr, 0, 0, reason)
            rc = self._store.unregister_buffer(ptr)
            if rc != 0:
                reason = "Mooncake refused to unregister"
                raise RegistrationError(ptr, nbytes, rc, reason)
            del self._registered[ptr]
            self._starts.remove(ptr)
            return nbytes

    def is_registered(self, ptr: int, nbytes: int) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` lies inside registered memory."""
        with self._lock:
            return self._covered(ptr, nbytes)

    def _covered(self, ptr: int, nbytes: int) -> bool:
        index = bisect.bisect_right(self._starts, ptr) - 1
        if index < 0:
            return False
        start = self._starts[index]
        return ptr + nbytes <= start + self._registered[start]

    def _validate(self, regions: Regions) -> None:
        with self._lock:
            for index, ptr, size in regions.spans():
                if not self._covered(ptr, size):
                    reason = (
                        f"{size} B at {ptr:#x} is not inside registered "
                        "memory (call register() first)"
                    )
                    raise RegionError(index, reason)

    # -- data calls -----------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> BatchResult:
        """Which keys are stored: HIT / MISS / an error outcome per key.

        A HIT grants the object a read lease (the master's
        ``default_kv_lease_ttl``), so it cannot be evicted right away.
        """
        return self._lookup_call(
            Op.EXISTS, keys, _exists_outcomes, self._store.batch_is_exist
        )

    def replica_endpoints(self, keys: Sequence[str]) -> list[tuple[str, ...]]:
        """Per key, where its complete memory replicas live, in order.

        Segments are ``ip:port``, in the master's order; () when none or
        on any error.  One master call (``batch_get_replica_desc``),
        metadata only.
        """
        return _endpoints(self.replicas(keys))

    def local_reads(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether a get reads it from this client's own segment.

        True when a complete memory replica of the key is in this
        client's segment (and none is on disk): Mooncake's get then reads
        that one, a memcpy inside this process, over when the get
        returns, so no peer's transport can write into its region later
        (`read_here`).  One master
        call (``batch_get_replica_desc``); it grants each stored key a
        read lease, so the replica is still there for the get that
        follows.  False for every key on any error, and without a call
        for a client that owns no segment.
        """
        keys = list(keys)
        if not keys or self.config.global_segment_size <= 0:
            return [False] * len(keys)  # no segment: nothing is local
        self._enter("local_reads")
        try:
            found = self._descriptors(keys)
            if found is None:
                return [False] * len(keys)
            local = self._store.get_hostname()
            return [read_here(found.get(k, ()), local) for k in keys]
        finally:
            self._exit()

    def replicas(self, keys: Sequence[str]) -> list[tuple[Replica, ...]]:
        """Per key, its complete memory replicas, in the master's order.

        () when none or on any error.  One master call
        (``batch_get_replica_desc``), metadata only.
        """
        keys = list(keys)
        if not keys:
            return []
        self._enter("replicas")
        try:
            return self._replicas(keys)
        finally:
            self._exit()

    def put(
        self,
        keys: Sequence[str],
        regions: RegionsLike,
        *,
        dedupe: bool = True,
    ) -> BatchResult:
        """Store each key's region; existing keys keep their first value.

        With ``dedupe`` (the default) one ``batch_is_exist`` runs first and
        only missing keys are written, so a repeated prefix costs no
        transfer and reports ALREADY_PRESENT, and a key repeated within
        the batch is written once. Without it every key is sent and
        reports STORED (Mooncake keeps the old value of an existing key
        either way); use that only when the caller has just looked up.

        Raises:
            RegionError: ``regions`` do not match ``keys``.
            StoreClosedError: after ``close()``.
        """
        started = time.perf_counter()
        keys = keys if isinstance(keys, list) else list(keys)
        regions = self._regions(keys, regions)
        n = len(keys)
        if not n:
            return BatchResult(Op.PUT, [], [], num_failed=0)
        self._enter("put")
        try:
            if not self.breaker.allow():
                return self._short(Op.PUT, n, started)
            if not dedupe:
                codes = self._put(keys, regions)
                return self._finish_put(codes, regions, started)
            return self._put_missing(keys, regions, started)
        finally:
            self._exit()

    def get(
        self,
        keys: Sequence[str],
        regions: RegionsLike,
        *,
        avoid: Collection[str] = (),
    ) -> BatchResult:
        """Read each key into its region: HIT only if all bytes arrived.

        A MISS, or any error outcome, means the region's contents are
        undefined and the block must be recomputed. A stored object whose
        size differs from the region is INVALID (code = its size).

        A key whose transfer failed (``TRANSFER_FAILED``, not a miss) is
        read once more from another complete memory replica, if there is
        one outside the segment the get read and outside ``avoid``
        (segment names): see ``read_replicas``.

        Raises:
            RegionError: ``regions`` do not match ``keys``.
            StoreClosedError: after ``close()``.
        """
        started = time.perf_counter()
        keys = keys if isinstance(keys, list) else list(keys)
        regions = self._regions(keys, regions)
        if not keys:
            return BatchResult(Op.GET, [], [], num_failed=0)
        self._enter("get")
        try:
            if not self.breaker.allow():
                return self._short(Op.GET, len(keys), started)
            if regions.piece_ptrs is None or regions.piece_sizes is None:
                codes = self._call(
                    self._store.batch_get_into,
                    keys,
                    regions.ptrs,
                    regions.sizes,
                )
            else:
                codes = self._call(
                    self._store.batch_get_into_multi_buffers,
                    keys,
                    regions.piece_ptrs,
                    regions.piece_sizes,
                )
            if codes == regions.sizes:  # all hits, compared in C
                return self._finish(
                    Op.GET,
                    [Outcome.HIT] * len(codes),
                    codes,
                    regions.nbytes,
                    started,
                    failed=0,
                )
            hit = Outcome.HIT
            outcomes = [
                hit
                if c == s
                else outcome_of_error(c)
                if c < 0
                else Outcome.INVALID
                for c, s in zip(codes, regions.sizes, strict=True)
            ]
            failed_on = frozenset[str]()
            if self._reader is not None:
                failed_on = self._retry(keys, regions, outcomes, codes, avoid)
            nbytes = _sum_ok(regions.sizes, outcomes, regions.nbytes)
            result = self._finish(Op.GET, outcomes, codes, nbytes, started)
            result.failed_segments = failed_on
            return result
        finally:
            self._exit()

    @property
    def reads_spans(self) -> bool:
        """Whether `get_spans` works here.

        Not on a dummy client: its pool process serves no get sessions.
        """
        return not self.config.dummy

    def get_spans(
        self,
        keys: Sequence[str],
        ptrs: Sequence[int],
        spans: Sequence[tuple[int, int]],
        landed: Callable[[int, list[bool]], bool] | None = None,
    ) -> BatchResult:
        """Read each key's object span by span, in order.

        Bytes ``[a, b)`` of key ``i``'s object land at ``ptrs[i] + a``,
        for each ``(a, b)`` of `spans`; ``ptrs[i]`` has room for the whole
        object (the last span's end).  First one key per segment the keys
        live in is read whole (a probe: a ranged read from a dead peer
        fails only after seconds, a whole get at once): a segment whose
        probe fails fails its keys without a ranged read.  Then one get
        session over the others (the master is asked where they live
        once, ``batch_get_session_start``), each span one ranged read of
        every key still good (no master call).  After each span,
        ``landed(index, ok)`` gets each key's success so far (a probed
        key is in from the first span); False stops the read (the keys
        not read in full then fail).  A key is HIT only if all of its
        object arrived; a failed key is not read again from another
        replica (its blocks are recomputed).

        Raises:
            ValueError: `ptrs` and `keys` differ in length, or a span is
                empty or out of order.
            StoreClosedError: after ``close()``.
        """
        started = time.perf_counter()
        keys = keys if isinstance(keys, list) else list(keys)
        if len(ptrs) != len(keys):
            msg = f"{len(keys)} keys but {len(ptrs)} buffers"
            raise ValueError(msg)
        end = _spans_end(spans)
        n = len(keys)
        if not keys or not spans:
            return BatchResult(Op.GET, [], [], num_failed=0)
        self._enter("get")
        try:
            if not self.breaker.allow():
                return self._short(Op.GET, n, started)
            codes = [end] * n
            probed = self._probe(keys, ptrs, end, codes)
            ok = [state is True for state in probed]
            rest = [i for i, state in enumerate(probed) if state is None]
            if rest:
                self._session(keys, ptrs, spans, codes, ok, rest, landed)
            elif landed is not None:
                for index in range(len(spans)):
                    if not landed(index, list(ok)):
                        break
            outcomes = [
                Outcome.HIT
                if good
                else outcome_of_error(c)
                if c < 0
                else Outcome.INVALID
                for good, c in zip(ok, codes, strict=True)
            ]
            nbytes = end * sum(ok)
            return self._finish(Op.GET, outcomes, codes, nbytes, started)
        finally:
            self._exit()

    def _session(  # noqa: PLR0917 - the read's whole state
        self,
        keys: list[str],
        ptrs: Sequence[int],
        spans: Sequence[tuple[int, int]],
        codes: list[int],
        ok: list[bool],
        rest: list[int],
        landed: Callable[[int, list[bool]], bool] | None,
    ) -> None:
        """One get session over the keys at `rest`, ended whatever happens."""
        opened = self._call(
            self._store.batch_get_session_start, [keys[i] for i in rest]
        )
        for i, c in zip(rest, opened, strict=True):
            ok[i] = c >= 0
            if c < 0:
                codes[i] = c
        try:
            self._read_spans(
                keys,
                ptrs,
                spans,
                codes=codes,
                ok=ok,
                ranged=[i for i in rest if ok[i]],
                landed=landed,
            )
        finally:
            self._end_session([keys[i] for i in rest])

    def _probe(
        self,
        keys: list[str],
        ptrs: Sequence[int],
        size: int,
        codes: list[int],
    ) -> list[bool | None]:
        """Read one key per segment whole.

        Per key: True (read whole), False (failed: its probe or its
        segment's did) or None (to read in spans).  `codes` gets each
        failure's code.
        """
        where = [
            found[0] if found else ""
            for found in _endpoints(self._replicas(keys))
        ]
        picks = sorted(
            {w: i for i, w in reversed(list(enumerate(where)))}.values()
        )
        got = self._call(
            self._store.batch_get_into,
            [keys[i] for i in picks],
            [ptrs[i] for i in picks],
            [size] * len(picks),
        )
        state: list[bool | None] = [None] * len(keys)
        down: dict[str, int] = {}
        for i, c in zip(picks, got, strict=True):
            state[i] = c == size
            if c != size:
                codes[i] = c
                if c < 0 and outcome_of_error(c) in _PEER_DOWN:
                    down[where[i]] = c
        for i, segment in enumerate(where):
            if state[i] is None and segment in down:
                state[i] = False
                codes[i] = down[segment]
        return state

    def _read_spans(
        self,
        keys: list[str],
        ptrs: Sequence[int],
        spans: Sequence[tuple[int, int]],
        *,
        codes: list[int],
        ok: list[bool],
        ranged: list[int],
        landed: Callable[[int, list[bool]], bool] | None,
    ) -> None:
        """The spans of a get session over the keys at `ranged`.

        `ok` and `codes` get each key's failure.
        """
        read = self._store.batch_get_into_multi_buffer_ranges
        for index, (a, b) in enumerate(spans):
            live = [i for i in ranged if ok[i]]
            if live:
                size = b - a
                got = self._call(
                    read,
                    [keys[i] for i in live],
                    [[ptrs[i] + a] for i in live],
                    [[size]] * len(live),
                    [[a]] * len(live),
                )
                for i, c in zip(live, got, strict=True):
                    if c != size:
                        ok[i] = False
                        codes[i] = c
            if landed is not None and not landed(index, list(ok)):
                if index + 1 < len(spans):  # stopped: the rest unread
                    for i in ranged:
                        if ok[i]:
                            ok[i] = False
                            codes[i] = int(ErrorCode.TRANSFER_FAIL)
                break

    def _end_session(self, keys: list[str]) -> None:
        try:
            self._store.batch_get_session_end(keys)
        except RuntimeError:
            log.exception("ending a get session of %d keys raised", len(keys))

    def read_replicas(
        self,
        keys: Sequence[str],
        regions: RegionsLike,
        *,
        avoid: Collection[str] = (),
    ) -> BatchResult:
        """Read each key from a live replica outside ``avoid``.

        Per key: the first complete memory replica (master's order) that
        is neither the one a get reads (this client's own segment if it
        holds one, else the first) nor in ``avoid``; read raw through
        this client's transfer engine straight into the region.  A key
        still failed then, whose get segment is not in ``avoid`` and just
        answered another key's raw read, is read from that segment.  HIT
        only when the replica's size equals the region's and every byte
        arrived; a size mismatch is INVALID (code = the replica's size)
        and nothing is read; a key with no such replica, or without a
        transfer engine of its own, is TRANSFER_FAILED.  Keys actually
        tried count under ``Op.REPLICA_GET``.

        Raises:
            RegionError: ``regions`` do not match ``keys``.
            StoreClosedError: after ``close()``.
        """
        started = time.perf_counter()
        keys = keys if isinstance(keys, list) else list(keys)
        regions = self._regions(keys, regions)
        n = len(keys)
        if not n:
            return BatchResult(Op.REPLICA_GET, [], [], num_failed=0)
        self._enter("read_replicas")
        try:
            failed = int(ErrorCode.TRANSFER_FAIL)
            outcomes = [Outcome.TRANSFER_FAILED] * n
            codes = [failed] * n
            if self._reader is not None and self.breaker.allow():
                self._read_replicas(keys, regions, outcomes, codes, avoid)
            nbytes = _sum_ok(regions.sizes, outcomes, regions.nbytes)
            return BatchResult(
                Op.REPLICA_GET,
                outcomes,
                codes,
                nbytes,
                time.perf_counter() - started,
                num_failed=n - _num_ok(outcomes),
            )
        finally:
            self._exit()

    def remove(
        self, keys: Sequence[str], *, force: bool = False
    ) -> BatchResult:
        """Remove keys: HIT (removed), MISS, or an error outcome.

        Without ``force`` a leased key (read recently) is not removed
        (``OTHER``, code ``-706``).
        """
        return self._lookup_call(
            Op.REMOVE, keys, _remove_outcomes, self._store.batch_remove, force
        )

    def remove_all(self, *, force: bool = True) -> int:
        """Remove every object of the whole store (all namespaces).

        Returns:
            The number removed, or a negative Mooncake code.
        """
        self._enter("remove_all")
        try:
            if not self.breaker.allow():
                return int(ErrorCode.RPC_FAIL)
            rc = self._store.remove_all(force)
            self.breaker.record(outage=rc in _OUTAGE_CODES)
            return rc
        finally:
            self._exit()

    # -- internals ------------------------------------------------------------

    def _replicas(self, keys: list[str]) -> list[tuple[Replica, ...]]:
        """`replicas` inside a call (entered, non-empty keys)."""
        found = self._descriptors(keys)
        if found is None:
            return [()] * len(keys)
        return [memory_replicas(found.get(k, ())) for k in keys]

    def _descriptors(self, keys: list[str]) -> dict[str, Any] | None:
        """The master's replica descriptors of `keys`, by key.

        One ``batch_get_replica_desc`` call, inside a call (entered);
        None when the client has no such call, the breaker is open, or
        the call failed (logged).
        """
        ask = getattr(self._store, "batch_get_replica_desc", None)
        if ask is None or not self.breaker.allow():
            return None
        try:
            found: dict[str, Any] = ask(keys)
        except RuntimeError:
            self.breaker.release()
            log.warning("batch_get_replica_desc failed", exc_info=True)
            return None
        self.breaker.record(outage=False)
        return found

    def _retry(
        self,
        keys: list[str],
        regions: Regions,
        outcomes: list[Outcome],
        codes: list[int],
        avoid: Collection[str],
    ) -> frozenset[str]:
        """Read the keys whose transfer failed from another replica.

        Returns the segments the failed transfers read from.
        """
        failed = [
            i for i, o in enumerate(outcomes) if o is Outcome.TRANSFER_FAILED
        ]
        if not failed:
            return frozenset()
        sub_outcomes = [outcomes[i] for i in failed]
        sub_codes = [codes[i] for i in failed]
        failed_on = self._read_replicas(
            [keys[i] for i in failed],
            regions.select(failed),
            sub_outcomes,
            sub_codes,
            avoid,
        )
        for i, outcome, code in zip(
            failed, sub_outcomes, sub_codes, strict=True
        ):
            outcomes[i] = outcome
            codes[i] = code
        return failed_on

    def _read_replicas(
        self,
        keys: list[str],
        regions: Regions,
        outcomes: list[Outcome],
        codes: list[int],
        avoid: Collection[str],
    ) -> frozenset[str]:
        """Raw reads from another replica; updates the tried keys' entries.

        First from a replica a get would not read (`other_replica`).  A
        key still failed whose own read segment then answered another
        raw read is read from that segment once more: Mooncake fails a
        whole batch when one of its transfers stalls, so a get can fail
        keys of a live segment beside the sick one's.  Counts the tried
        keys (a size mismatch included) as one ``Op.REPLICA_GET`` call.

        Returns the segments a get reads these keys from, less those a
        raw read just succeeded from: the suspects.
        """
        reader = self._reader
        if reader is None:
            return frozenset()
        started = time.perf_counter()
        local = self._store.get_hostname()
        found = self._replicas(keys)
        firsts = [read_from(f, local) for f in found]
        retry = _RawReads(reader, keys, regions, outcomes, codes)
        retry.read([other_replica(f, local, avoid) for f in found])
        again = [
            next(r for r in f if r.endpoint == first)
            if outcomes[i] is Outcome.TRANSFER_FAILED
            and first in retry.alive
            and first not in avoid
            else None
            for i, (f, first) in enumerate(zip(found, firsts, strict=True))
        ]
        if any(again):
            retry.read(again)
        if retry.tried:
            tried = sorted(retry.tried)
            self._finish(
                Op.REPLICA_GET,
                [outcomes[i] for i in tried],
                [codes[i] for i in tried],
                sum(
                    regions.sizes[i]
                    for i in tried
                    if outcomes[i] is Outcome.HIT
                ),
                started,
            )
        alive = retry.alive
        return frozenset(f for f in firsts if f and f not in alive)

    def _regions(self, keys: list[str], regions: RegionsLike) -> Regions:
        if not isinstance(regions, Regions):
            regions = Regions.of(regions)
        if len(regions.sizes) != len(keys):
            reason = f"{len(keys)} keys but {len(regions.sizes)} regions"
            raise RegionError(None, reason)
        if self._check_regions:
            self._validate(regions)
        return regions

    def _put(self, keys: list[str], regions: Regions) -> list[int]:
        if regions.piece_ptrs is None or regions.piece_sizes is None:
            return self._call(
                self._store.batch_put_from,
                keys,
                regions.ptrs,
                regions.sizes,
                self._replicate,
            )
        return self._call(
            self._store.batch_put_from_multi_buffers,
            keys,
            regions.piece_ptrs,
            regions.piece_sizes,
            self._replicate,
        )

    def _put_missing(
        self, keys: list[str], regions: Regions, started: float
    ) -> BatchResult:
        exist = self._call(self._store.batch_is_exist, keys)
        n = len(keys)
        if not any(exist) and len(set(keys)) == n:
            # Hot path: nothing stored yet, no duplicates.
            return self._finish_put(self._put(keys, regions), regions, started)
        outcomes = [Outcome.ALREADY_PRESENT] * n
        codes = [1] * n
        todo: list[int] = []
        seen: set[str] = set()
        for i, (key, code) in enumerate(zip(keys, exist, strict=True)):
            if code == 0 and key not in seen:
                seen.add(key)
                todo.append(i)
            elif code < 0:
                outcomes[i] = outcome_of_error(code)
                codes[i] = code
        if todo and _has_outage(exist):
            # The master failed the lookup: do not add a second stall.
            self.breaker.record(outage=True)
            for i in todo:
                outcomes[i] = Outcome.MASTER_UNREACHABLE
                codes[i] = int(ErrorCode.RPC_FAIL)
            todo = []
        nbytes = 0
        if todo:
            sub = regions.select(todo)
            put_codes = self._put([keys[i] for i in todo], sub)
            for i, code, size in zip(todo, put_codes, sub.sizes, strict=True):
                codes[i] = code
                if code == 0:
                    outcomes[i] = Outcome.STORED
                    nbytes += size
                else:
                    outcomes[i] = outcome_of_error(code)
        return self._finish(Op.PUT, outcomes, codes, nbytes, started)

    def _lookup_call(
        self,
        op: Op,
        keys: Sequence[str],
        outcomes_of: Callable[[list[int]], list[Outcome]],
        fn: Callable[..., list[int]],
        *args: Any,
    ) -> BatchResult:
        """One keys-only batch call (no data moved), guarded and timed."""
        started = time.perf_counter()
        keys = keys if isinstance(keys, list) else list(keys)
        if not keys:
            return BatchResult(op, [], [], num_failed=0)
        self._enter(op.value)
        try:
            if not self.breaker.allow():
                return self._short(op, len(keys), started)
            codes = self._call(fn, keys, *args)
            return self._finish(op, outcomes_of(codes), codes, 0, started)
        finally:
            self._exit()

    def _call(self, fn: Callable[..., list[int]], *args: Any) -> list[int]:
        """One Mooncake batch call; feeds RPC failures to the breaker."""
        try:
            codes = fn(*args)
        except RuntimeError:
            log.exception("Mooncake call %s raised", fn.__name__)
            codes = [int(ErrorCode.INTERNAL_ERROR)] * len(args[0])
        except BaseException:
            self.breaker.release()
            raise
        self.breaker.record(outage=_has_outage(codes))
        return codes

    def _finish_put(
        self, codes: list[int], regions: Regions, started: float
    ) -> BatchResult:
        if not any(codes):  # all stored, checked in C
            n = len(codes)
            return self._finish(
                Op.PUT,
                [Outcome.STORED] * n,
                codes,
                regions.nbytes,
                started,
                failed=0,
            )
        outcomes = [
            Outcome.STORED if c == 0 else outcome_of_error(c) for c in codes
        ]
        nbytes = _sum_ok(regions.sizes, outcomes, regions.nbytes)
        return self._finish(Op.PUT, outcomes, codes, nbytes, started)

    def _finish(
        self,
        op: Op,
        outcomes: list[Outcome],
        codes: list[int],
        nbytes: int,
        started: float,
        *,
        failed: int | None = None,
    ) -> BatchResult:
        if failed is None:
            failed = len(outcomes) - _num_ok(outcomes)
        result = BatchResult(
            op,
            outcomes,
            codes,
            nbytes,
            time.perf_counter() - started,
            False,  # noqa: FBT003 - positional for speed
            failed,
        )
        self.stats.record(result, failed)
        if failed:
            self._note_faults(op, outcomes, codes)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%r", result)
        return result

    def _note_faults(
        self, op: Op, outcomes: list[Outcome], codes: list[int]
    ) -> None:
        """Count and report (rate-limited) keys the store failed to move."""
        faults = transfer_faults(op, outcomes, codes)
        if not faults:
            return
        n = sum(faults.values())
        self.stats.fault("transfer", n)
        self._warn.note(
            f"transfer:{op.value}",
            n,
            "Mooncake store answers but cannot transfer: %d key(s) of a "
            "%s failed with codes %s (a peer's segment or transfer "
            "metadata missing, e.g. after a master restart, or no segment "
            "mounted); loads recompute, saves are dropped",
            n,
            op.value,
            dict(faults.most_common()),
        )

    def _registered_regions(self) -> list[tuple[int, int]]:
        """``(address, bytes)`` of each region registered here."""
        with self._lock:
            return list(self._registered.items())

    def _republish(self) -> bool:
        """Make Mooncake write this client's segment descriptor again.

        Mooncake publishes its current descriptor on every registration,
        so registering and unregistering a scratch page of this client's
        own rewrites the entry without touching a caller's region.
        Returns whether both calls succeeded.
        """
        with self._lock:
            if self._closed:
                return False
            if self._scratch is None:
                self._scratch = ctypes.create_string_buffer(_SCRATCH_BYTES)
            ptr = ctypes.addressof(self._scratch)
            if self._store.register_buffer(ptr, _SCRATCH_BYTES) != 0:
                return False
            return bool(self._store.unregister_buffer(ptr) == 0)

    def _on_metadata(self, check: MetadataCheck) -> None:
        """Count and report (rate-limited) one metadata check."""
        name = self._watch.keeper.name if self._watch is not None else "?"
        if check.stale:
            self.stats.fault("metadata_stale", check.stale)
            self._warn.note(
                "metadata_stale",
                check.stale,
                "the metadata server's segment descriptor of store client "
                "%s lacked %d region(s) it registered (Mooncake's client "
                "re-published an older copy over a registration); %s",
                name,
                check.stale,
                "published again"
                if check.republished
                else "could not publish it again (next check retries)",
            )
        if not check.missing:
            return
        self.stats.fault("metadata_missing", check.missing)
        if check.restored:
            self.stats.fault("metadata_restored", check.restored)
        self._warn.note(
            "metadata",
            check.missing,
            "transfer metadata of store client %s missing from the "
            "metadata server %s (%d of 2 entries; did the master restart?): "
            "peers cannot read its segment until it is published again; "
            "%d restored from the client's last copy",
            name,
            self.config.metadata_server,
            check.missing,
            check.restored,
        )

    def _short(self, op: Op, n: int, started: float) -> BatchResult:
        result = BatchResult(
            op,
            [Outcome.MASTER_UNREACHABLE] * n,
            [int(ErrorCode.RPC_FAIL)] * n,
            0,
            time.perf_counter() - started,
            short_circuited=True,
            num_failed=n,
        )
        self.stats.record(result, n)
        return result

    def _enter(self, operation: str) -> None:
        with self._lock:
            if self._closed:
                raise StoreClosedError(operation)
            self._inflight += 1

    def _exit(self) -> None:
        with self._lock:
            self._inflight -= 1
            if self._closed and not self._inflight:
                self._idle.notify_all()


@attrs.define
class _RawReads:
    """One retry's raw reads: updates the keys' outcomes and codes."""

    reader: ReplicaReader
    keys: list[str]
    regions: Regions
    outcomes: list[Outcome]
    codes: list[int]
    tried: set[int] = attrs.Factory(set)
    alive: set[str] = attrs.Factory(set)
    """Segments a raw read succeeded from."""

    def read(self, picks: list[Replica | None]) -> None:
        """Read each picked replica into its key's region (size-checked)."""
        readable: list[int] = []
        reads: list[tuple[Replica, list[tuple[int, int]]]] = []
        for i, source in enumerate(picks):
            if source is None:
                continue
            self.tried.add(i)
            size = self.regions.sizes[i]
            if source.size != size:
                log.warning(
                    "replica of %r on %s holds %d B, the region %d B: "
                    "not read",
                    self.keys[i],
                    source.endpoint,
                    source.size,
                    size,
                )
                self.outcomes[i] = Outcome.INVALID
                self.codes[i] = source.size
                continue
            readable.append(i)
            reads.append((source, _pieces(self.regions, i)))
        if not reads:
            return
        done = self.reader.read(reads)
        for i, (source, _), ok in zip(readable, reads, done, strict=True):
            if ok:
                self.outcomes[i] = Outcome.HIT
                self.codes[i] = self.regions.sizes[i]
                self.alive.add(source.endpoint)


def _pieces(regions: Regions, index: int) -> list[tuple[int, int]]:
    """Key ``index``'s pieces as ``(ptr, nbytes)``, in order."""
    if regions.piece_ptrs is None or regions.piece_sizes is None:
        return [(regions.ptrs[index], regions.sizes[index])]
    return list(
        zip(regions.piece_ptrs[index], regions.piece_sizes[index], strict=True)
    )


def _open_reader(config: StoreConfig, hostname: str) -> ReplicaReader | None:
    """The client's own transfer engine, or None (one WARNING)."""
    try:
        return ReplicaReader.open(
            hostname,
            config.metadata_server,
            config.protocol,
            config.device_name,
        )
    except (OSError, RuntimeError) as exc:
        log.warning(
            "kv-lifecycle could not start a transfer engine of its own "
            "(%s): a load that fails on one replica is not retried on "
            "another",
            exc,
        )
        return None


def _setup(
    factory: Callable[[], tuple[MooncakeStore, Any]],
    config: StoreConfig,
    hostname: str,
    reader: ReplicaReader | None,
) -> tuple[MooncakeStore, Any, int | str]:
    """A new Mooncake client, set up (on ``reader``'s engine if given).

    Returns the store, its replicate config and ``setup()``'s code (a
    string when Mooncake refused the engine object itself).
    """
    store, replicate = factory()
    if reader is not None:
        reader.attach(store)  # its engine's name outlives neither
    try:
        rc: int | str = store.setup(
            reader.name if reader is not None else hostname,
            config.metadata_server,
            config.global_segment_size,
            config.local_buffer_size,
            config.protocol,
            config.device_name,
            config.master_server_address,
            reader.inner if reader is not None else None,
            config.enable_ssd_offload,
            config.ssd_offload_path,
            config.tenant_id,
            config.enable_client_http_server,
            config.client_http_port,
        )
    except (TypeError, RuntimeError) as exc:
        if reader is None:
            raise
        rc = f"{type(exc).__name__}: {exc}"
    return store, replicate, rc


def _place(config: StoreConfig, store: MooncakeStore, replicate: Any) -> str:
    """Point the replicate config every put passes at ``placement``.

    ``local``: ``preferred_segment`` is this client's own segment
    (Mooncake falls back to the others once it is full).  ``mirror``: at
    least two replicas, ``preferred_segments`` the own segment and then
    ``pool_segment``.  Nothing for ``spread``, a client without a segment,
    or a replicate config without the fields (an older wheel, a fake).

    Returns where puts go, for the start-up log line.
    """
    spread = "spread by Mooncake"
    if config.placement == "spread" or config.global_segment_size <= 0:
        return spread
    own = store.get_hostname()
    if config.placement == "mirror" and config.pool_segment is not None:
        if replicate is None or not hasattr(replicate, "preferred_segments"):
            log.warning(
                "this Mooncake wheel's ReplicateConfig has no "
                "preferred_segments: placement 'mirror' is not applied"
            )
            return spread
        replicate.replica_num = max(int(replicate.replica_num), 2)
        replicate.preferred_segments = [own, config.pool_segment]
        return (
            f"{replicate.replica_num} replicas: own segment and the pool "
            f"{config.pool_segment}"
        )
    if replicate is None or not hasattr(replicate, "preferred_segment"):
        return spread
    replicate.preferred_segment = own
    return "own segment first"
