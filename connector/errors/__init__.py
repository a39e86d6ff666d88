"""Every exception ``connector`` raises, one module per concept.

- ``base``: ``ConnectorError``, the base class of them all;
- ``config``: ``ConfigError``, a bad configuration value;
- ``store``: the store client's errors (``StoreError`` and its
  subclasses) and ``KeySchemeError``;
- ``master``: the embedded ``mooncake_master``'s errors (``MasterError``
  and its subclasses);
- ``groups``: ``UnsupportedKVGroups``, a model the connector cannot
  serve;
- ``parallel``: ``UnsupportedParallelism`` and ``ParallelRankError``,
  a parallel layout the connector cannot key.

Every name is re-exported here: ``from connector.errors import
ConfigError`` is the way to import them.

Every exception is an attrs class: the data that explain it are its
fields and its message names them, so a log line alone says what went
wrong and where. They pickle by their fields, for free (exceptions cross
``spawn`` process boundaries and vLLM's engine-core boundary).

``attrs.define(auto_exc=True, slots=False)`` declares each: fields, an
``__init__`` taking them in order, ``args`` holding them (so pickling
rebuilds the exception), identity equality and hashing like any
exception; ``__str__`` writes the message.
"""

from __future__ import annotations

from connector.errors.base import ConnectorError
from connector.errors.config import ConfigError
from connector.errors.groups import UnsupportedKVGroups
from connector.errors.master import (
    MasterBinaryNotFoundError,
    MasterError,
    MasterNotRunningError,
    MasterStartError,
    ServiceStartError,
)
from connector.errors.parallel import (
    ParallelRankError,
    UnsupportedParallelism,
)
from connector.errors.store import (
    KeySchemeError,
    RegionError,
    RegistrationError,
    StoreClosedError,
    StoreError,
    StoreUnavailable,
)

__all__ = [
    "ConfigError",
    "ConnectorError",
    "KeySchemeError",
    "MasterBinaryNotFoundError",
    "MasterError",
    "MasterNotRunningError",
    "MasterStartError",
    "ParallelRankError",
    "RegionError",
    "RegistrationError",
    "ServiceStartError",
    "StoreClosedError",
    "StoreError",
    "StoreUnavailable",
    "UnsupportedKVGroups",
    "UnsupportedParallelism",
]
