"""Typed client of the Mooncake distributed store (the connector's data plane).

One module per concept:

- ``codes``: Mooncake's return codes (``ErrorCode``), the ``Outcome`` each
  maps to, and the operations (``Op``);
- ``mooncake``: the Mooncake surface the client calls (``MooncakeStore``)
  and the TCP probe of a master;
- ``regions``: ``Regions``, the registered-memory pieces of a batch;
- ``batch``: ``BatchResult``, what one batch call did, key by key;
- ``counters``: ``OpCounters`` / ``StoreCounters``, per-operation counters
  read by a metrics layer (``connector.integration.stats`` builds vLLM's
  stats from them);
- ``breaker``: ``CircuitBreaker``, which stops calling a dead master;
- ``client``: ``StoreClient``, which puts them together.

The public names are re-exported here: ``from connector.store import
StoreClient, Regions, Outcome`` is the way to import them.
"""

from connector.store.batch import BatchResult
from connector.store.breaker import BreakerState, CircuitBreaker
from connector.store.client import DEAD_MASTER_STALL_S, StoreClient
from connector.store.codes import ErrorCode, Op, Outcome, outcome_of_error
from connector.store.counters import OpCounters, StoreCounters
from connector.store.mooncake import MooncakeStore
from connector.store.regions import Region, Regions, RegionsLike

__all__ = [
    "DEAD_MASTER_STALL_S",
    "BatchResult",
    "BreakerState",
    "CircuitBreaker",
    "ErrorCode",
    "MooncakeStore",
    "Op",
    "OpCounters",
    "Outcome",
    "Region",
    "Regions",
    "RegionsLike",
    "StoreClient",
    "StoreCounters",
    "outcome_of_error",
]
