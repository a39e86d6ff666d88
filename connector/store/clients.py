"""Process-wide store clients, one per master.

vLLM builds a scheduler-role and a worker-role connector; in one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) both get the same client, in
separate processes each opens its own.  A client lives until the process
exits (or `close_all`): vLLM runs one engine per process, closing a
client blocks for 1-2 s, and its segment holds stored KV that other
instances may still read.  The namespace is not part of the identity:
it only prefixes keys.

Only clients that move KV contribute memory to the pool.  The scheduler
half asks for a lookup client (``contribute=False``): it shares the
process's contributing client when there is one (the in-process
topology), and otherwise opens a pure client with no segment, so that
stored blocks never land in a scheduler process, where every load of
them would cross a socket instead of staying in the worker's memory.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import threading
from typing import Final

import attrs

from connector.config import StoreConfig
from connector.store import StoreClient
from connector.store.client import left_open

log: Final = logging.getLogger(__name__)

_LOCK: Final = threading.Lock()
_CLIENTS: dict[StoreConfig, StoreClient] = {}


def acquire(config: StoreConfig, *, contribute: bool = True) -> StoreClient:
    """The process's client for `config`, opened on first use.

    With ``contribute=False`` the caller only looks keys up: it gets the
    contributing client if this process has one, else a pure client
    (`StoreConfig.without_segment`).

    Raises:
        StoreUnavailable: the master cannot be reached (bounded wait).
    """
    identity = attrs.evolve(config, namespace="")
    choices = [identity]
    if not contribute:
        choices.append(identity.without_segment())
    with _LOCK:
        for choice in choices:
            client = _CLIENTS.get(choice)
            if client is not None and not client.closed:
                return client
        opened = choices[-1]
        client = StoreClient.open(
            attrs.evolve(opened, namespace=config.namespace)
        )
        _CLIENTS[opened] = client
        return client


def release(client: StoreClient) -> None:
    """Say that a holder is done with `client`; it stays open regardless.

    Clients live until the process exits (see the module docstring), so
    nothing is counted: this is the pair of `acquire` that a holder calls
    when it shuts down or fails to start, and the one place a closing
    policy would go.
    """
    del client


@atexit.register
def close_all() -> None:
    """Close every client (at process exit, or when a test is done).

    A client left open, by this or an earlier `close` (its master gone,
    or calls still in flight: see `StoreClient.close`), would be torn
    down by Mooncake's own C exit handler, which then joins its
    reconnecting threads for 5-15 s.  At process exit, such a client
    makes the process end right after Python's own finalization instead
    (`_exit_before_native_teardown`).
    """
    with _LOCK:
        clients = list(_CLIENTS.values())
        _CLIENTS.clear()
    for client in clients:
        client.close()
    why = left_open()
    if why and _exiting():
        _exit_before_native_teardown(", ".join(why))


def _exiting() -> bool:
    """Whether the interpreter is finalizing.

    Python runs atexit handlers after marking the main thread stopped.
    """
    return not threading.main_thread().is_alive()


def _exit_before_native_teardown(why: str) -> None:
    """End the process with its status once Python has finalized.

    glibc's ``on_exit`` runs handlers last-registered first, with the
    exit status as first argument: registering ``_exit`` now (after
    Mooncake registered its teardown) ends the process before that
    teardown, and before C exit handlers registered earlier.  Python's
    own finalization (streams flushed, logging shut down) is complete by
    then.  Without glibc's ``on_exit`` nothing changes.
    """
    try:
        libc = ctypes.CDLL(None)
        on_exit = libc.on_exit
    except (OSError, AttributeError):
        return
    on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    on_exit.restype = ctypes.c_int
    if on_exit(ctypes.cast(libc["_exit"], ctypes.c_void_p), None) == 0:
        log.warning(
            "Mooncake client left open (%s): process exit skips its "
            "native teardown (no master to tell)",
            why,
        )
