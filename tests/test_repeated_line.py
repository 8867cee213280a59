"""node/repeated.py and its use for "nobody averaged with us" (node/averaging.py): a line that
repeats every round (every second with a small model) shows once a minute with a count."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from lowcomm.node.averaging import ALONE_LINE_EVERY_SECONDS, Averager
from lowcomm.node.repeated import RepeatedLine


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_said_first_then_once_per_interval_with_the_count_and_at_once_after_a_reset() -> None:
    clock = Clock()
    line = RepeatedLine(60.0, clock)
    assert line.due() == 0
    for _ in range(5):
        clock.now += 1.0
        assert line.due() is None
    clock.now += 55.0
    assert line.due() == 5  # 60 s after it showed: due, with the five left unsaid
    clock.now += 1.0
    assert line.due() is None
    line.reset()  # the condition ended (a group formed): its next occurrence shows at once
    assert line.due() == 0


def test_nobody_averaged_with_us_shows_once_a_minute_with_the_rounds_between(caplog) -> None:
    clock = Clock()
    averager = SimpleNamespace(_alone=RepeatedLine(ALONE_LINE_EVERY_SECONDS, clock))
    with caplog.at_level(logging.DEBUG, logger="lowcomm.node"):
        for step in range(61):  # a round a second for a minute
            Averager._say_alone(averager, step, 2)
            clock.now += 1.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "nobody averaged with us at step 0 although 2 peer(s) are live; training on",
        "nobody averaged with us at step 60 although 2 peer(s) are live; training on "
        "(59 more such round(s) since this line last showed)",
    ]
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 59  # still there for --log-level debug
