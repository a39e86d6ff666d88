"""Rate-limited structured logging for events that could flood the log."""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable
from typing import Any


class RateLimitedLog:
    """Logs the first record per key, then at most one per `interval` s.

    Records dropped in between are counted and reported on the next record
    for the same key as ``suppressed``.  Structured fields travel in the
    record's ``lifecycle`` attribute (``extra={"lifecycle": {...}}``).

    Not locked: callers serialise calls (the machine holds its lock).
    """

    __slots__ = ("_last", "_suppressed", "interval", "level", "logger")

    def __init__(
        self,
        logger: logging.Logger,
        interval: float = 10.0,
        level: int = logging.WARNING,
    ) -> None:
        self.logger = logger
        self.interval = interval
        self.level = level
        self._last: dict[Hashable, float] = {}
        self._suppressed: dict[Hashable, int] = {}

    def emit(self, key: Hashable, msg: str, fields: dict[str, Any]) -> bool:
        """Log `msg` with `fields` unless rate-limited; True if logged."""
        if not self.logger.isEnabledFor(self.level):
            return False
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        self._last[key] = now
        fields["suppressed"] = self._suppressed.pop(key, 0)
        self.logger.log(
            self.level,
            "%s %s",
            msg,
            " ".join(f"{k}={v}" for k, v in fields.items()),
            extra={"lifecycle": fields},
        )
        return True
