"""Process-wide store clients, one per master.

vLLM builds a scheduler-role and a worker-role connector; in one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) both get the same client, in
separate processes each opens its own.  A client lives until the process
exits (or `close_all`): vLLM runs one engine per process, closing a
client blocks for 1-2 s, and its segment holds stored KV that other
instances may still read.  The namespace is not part of the identity:
it only prefixes keys.
"""

from __future__ import annotations

import atexit
import threading
from typing import Final

import attrs

from connector.config import StoreConfig
from connector.store import StoreClient

_LOCK: Final = threading.Lock()
_CLIENTS: dict[StoreConfig, tuple[StoreClient, int]] = {}


def acquire(config: StoreConfig) -> StoreClient:
    """The process's client for `config`, opened on first use.

    Raises:
        StoreUnavailable: the master cannot be reached (bounded wait).
    """
    identity = attrs.evolve(config, namespace="")
    with _LOCK:
        entry = _CLIENTS.get(identity)
        if entry is None or entry[0].closed:
            client = StoreClient.open(config)
            _CLIENTS[identity] = (client, 1)
            return client
        client, refs = entry
        _CLIENTS[identity] = (client, refs + 1)
        return client


def release(client: StoreClient) -> None:
    """Drop one reference (the client stays open for the process)."""
    with _LOCK:
        for config, (held, refs) in list(_CLIENTS.items()):
            if held is client:
                _CLIENTS[config] = (held, max(refs - 1, 0))
                return


@atexit.register
def close_all() -> None:
    """Close every client (at process exit, or when a test is done)."""
    with _LOCK:
        clients = [c for c, _ in _CLIENTS.values()]
        _CLIENTS.clear()
    for client in clients:
        client.close()
