"""A log line for a condition that repeats: said the first time, then at most once per interval
with how many times it was left unsaid in between (and said at once again after ``reset``,
when the condition ended)."""

from __future__ import annotations

import math
import time
from typing import Callable


class RepeatedLine:
    def __init__(self, every_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_seconds = every_seconds
        self._clock = clock
        self._said_at = -math.inf
        self._unsaid = 0

    def due(self) -> int | None:
        """The times left unsaid since the line last showed, when it is due now (the caller says
        it); None when it is not (counted as unsaid)."""
        now = self._clock()
        if now - self._said_at < self.every_seconds:
            self._unsaid += 1
            return None
        unsaid, self._said_at, self._unsaid = self._unsaid, now, 0
        return unsaid

    def reset(self) -> None:
        """The condition ended: its next occurrence is said at once."""
        self._said_at, self._unsaid = -math.inf, 0
