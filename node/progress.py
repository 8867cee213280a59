"""A progress bar for the inner steps of the current round, shown only on a terminal."""

from __future__ import annotations

import sys

from tqdm import tqdm


class InnerProgress:
    def __init__(self, steps: int, outer_step: int, enabled: bool) -> None:
        self._bar = (
            tqdm(total=steps, desc=f"round {outer_step} inner steps", leave=False, file=sys.stderr,
                 dynamic_ncols=True, unit="step")
            if enabled else None
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
