"""Fails any store call made from inside a scheduler-side hook.

vLLM runs the connector's scheduler half on the thread that schedules
every request, so no scheduler-side hook may wait on the Mooncake master
or the transfer engine.  `SchedulerThreadGuard` wraps every public hook
of `connector.scheduler.side.SchedulerSide` (the facade delegates each
scheduler-role hook to it) so that the calling thread is marked while the
hook runs, and wraps every `StoreClient` method that reaches the master
or the transfer engine so that a call from a marked thread is recorded
and raises `StoreCallInSchedulerHook`.  The record survives a hook that
swallows the exception.

`tests/conftest.py` turns it on for every test, so the real-scheduler
scenarios, the demo workload and the fault tests all run under it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

#: `SchedulerSide` methods vLLM's scheduler thread calls (via the facade).
SCHEDULER_HOOKS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
    "update_connector_output",
    "has_pending_push_work",
)
#: `StoreClient` methods that talk to the master or the transfer engine.
STORE_CALLS = (
    "exists",
    "put",
    "get",
    "remove",
    "remove_all",
    "register",
    "unregister",
    "close",
)


class StoreCallInSchedulerHook(AssertionError):  # noqa: N818 - a failure
    """A scheduler-side hook called the store."""

    def __init__(self, hook: str, call: str) -> None:
        super().__init__(f"{hook} called StoreClient.{call}")
        self.hook = hook
        self.call = call


class SchedulerThreadGuard:
    """Records (and fails) store calls made inside scheduler hooks."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.violations: list[str] = []
        self.hook_calls = 0
        self.store_calls = 0

    def _hook(self, name: str, method: Callable[..., Any]) -> Any:
        guard = self

        @functools.wraps(method)
        def hooked(*args: Any, **kwargs: Any) -> Any:
            local = guard._local
            outer = getattr(local, "hook", None)
            local.hook = outer or name
            guard.hook_calls += 1
            try:
                return method(*args, **kwargs)
            finally:
                local.hook = outer

        return hooked

    def _store(self, name: str, method: Callable[..., Any]) -> Any:
        guard = self

        @functools.wraps(method)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            hook = getattr(guard._local, "hook", None)
            if hook is not None:
                error = StoreCallInSchedulerHook(hook, name)
                guard.violations.append(str(error))
                raise error
            guard.store_calls += 1
            return method(*args, **kwargs)

        return guarded

    @contextmanager
    def installed(self) -> Iterator[SchedulerThreadGuard]:
        """Patch the classes for the duration of the block."""
        from connector.scheduler.side import SchedulerSide  # noqa: PLC0415
        from connector.store import StoreClient  # noqa: PLC0415

        saved: list[tuple[type, str, Any]] = []
        for cls, names, wrap in (
            (SchedulerSide, SCHEDULER_HOOKS, self._hook),
            (StoreClient, STORE_CALLS, self._store),
        ):
            for name in names:
                original = cls.__dict__[name]
                saved.append((cls, name, original))
                setattr(cls, name, wrap(name, original))
        try:
            yield self
        finally:
            for cls, name, original in reversed(saved):
                setattr(cls, name, original)
