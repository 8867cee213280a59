"""A progress bar for the inner steps of the current round, shown only on a terminal.

The bar is drawn by the training thread while the event loop logs round lines to the same
terminal; node/logs.py writes those lines through ``write_above``, which clears the bar, writes
the line and draws the bar again below it, all under the lock the bar draws with. Without that a
line starts wherever the bar left the cursor and the bar's clearing then erases the wrong line,
leaving a stale bar behind every round.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Iterator, TextIO

from tqdm import tqdm

# The bars of one node are drawn by its threads only (the DHT's forked process draws none), so a
# thread lock is enough; tqdm's default lock also creates a multiprocessing semaphore, shared
# with every process forked after it.
tqdm.set_lock(threading.RLock())


class InnerProgress:
    def __init__(self, steps: int, outer_step: int, enabled: bool) -> None:
        # On a terminal only: human lines (log_format "text", as the systemd unit sets) may go to
        # a journal or a file, where the bar's \r-redrawn frames would pile up into one line.
        self._bar = (
            tqdm(total=steps, desc=f"round {outer_step} inner steps", leave=False, file=sys.stderr,
                 dynamic_ncols=True, unit="step")
            if enabled and sys.stderr.isatty() else None
        )

    def update(self, done: int, loss: float) -> None:
        """Called from the training thread after every inner step."""
        if self._bar is not None:
            self._bar.update(1)
            if done % 5 == 0:
                self._bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


@contextmanager
def write_above(stream: TextIO) -> Iterator[None]:
    """Write to ``stream`` (a terminal that may show a bar) with no bar on the line being written.

    Every bar on the terminal is cleared first and drawn again afterwards, so a live bar stays on
    the last line. tqdm ends a clear with a bare ``\\r`` that a buffered stream may keep: it is
    flushed before anything goes to the other stream of the same terminal.
    """
    with tqdm.external_write_mode(file=stream):
        sys.stderr.flush()
        yield
        stream.flush()
