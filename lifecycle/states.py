"""States and events of the KV request lifecycle.

States are a plain `enum.Enum` (transitions handles `StrEnum` states poorly);
events are a `StrEnum` whose values double as `transitions` trigger names.
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    """Where one request's KV lifecycle stands."""

    NEW = "new"
    LOADING = "loading"
    SAVING = "saving"
    PREEMPTED = "preempted"
    RESET = "reset"
    DRAINING = "draining"
    FINISHED = "finished"
    ABORTED = "aborted"

    # Members are singletons compared by identity, so identity hashing is
    # consistent with equality; it makes the dispatch lookup a C call
    # instead of `Enum.__hash__` in Python.
    __hash__ = object.__hash__

    @property
    def terminal(self) -> bool:
        """Whether the lifecycle is over (no event leaves this state)."""
        return self in TERMINAL


TERMINAL: frozenset[State] = frozenset({State.FINISHED, State.ABORTED})


class Event(enum.StrEnum):
    """What a connector hook or a transfer completion reports."""

    LOOKUP = "lookup"
    LOOKUP_DONE = "lookup_done"
    ALLOC_LOCAL = "alloc_local"
    ALLOC_EXTERNAL = "alloc_external"
    LOAD_DONE = "load_done"
    LOAD_FAILED = "load_failed"
    SAVE_ISSUED = "save_issued"
    SAVE_DONE = "save_done"
    SAVE_FAILED = "save_failed"
    PREEMPT = "preempt"
    RESET = "reset"
    RESUME = "resume"
    FINISH = "finish"
    ABORT = "abort"
