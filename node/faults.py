"""Fault injection for tests, read once at start: which round of this process misbehaves, how.

The multi-process tests turn a real node into a straggler, a peer that stalls inside a round,
or one whose local model diverges, through environment variables of the child process only.
They are parsed here, once, into a typed object the round driver receives through its
constructor, so the loop never reads the environment and a typo in a test fails loudly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from .errors import FatalError

PREFIX = "LOWCOMM_FAULT_"
# Handled outside the node's own code (tests/faultinject/sitecustomize.py patches the process).
EXTERNAL = frozenset({"DIE_SERVING", "DIE_IN_RING"})


@dataclass(frozen=True)
class Faults:
    # n: the n-th round this process attempts starts from a local model with NaN weights.
    nan_round: int | None = None
    # Seconds added to every inner step (a slower peer).
    slow_step: float = 0.0
    # n: stall forever inside the n-th round that has a partner (after the group formed).
    hold_round: int | None = None
    # size: stall inside the first round in which this peer led a group of at least that size.
    hold_as_leader: int | None = None
    # n: in the n-th round with a partner, hand the codec pool a job that writes the residual
    # now and after a stop's grace period, then stall (an encode still running at shutdown).
    busy_codec_round: int | None = None
    # n: the n-th round this process attempts, do not take part: wait until the swarm committed a
    # later step without us (a peer that came after the round's plan closed), then fail the round.
    miss_round: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Faults":
        """The faults ``env`` (default: this process's environment) asks for; a variable with the
        prefix that is not one of them, or a value that is not a number, is a FatalError (one line
        from the CLI, not a traceback)."""
        env = os.environ if env is None else env
        names = {"NAN_ROUND": "nan_round", "SLOW_STEP": "slow_step", "HOLD_ROUND": "hold_round",
                 "HOLD_AS_LEADER": "hold_as_leader", "BUSY_CODEC_ROUND": "busy_codec_round",
                 "MISS_ROUND": "miss_round"}
        unknown = sorted(k for k in env if k.startswith(PREFIX) and k[len(PREFIX):] not in names.keys() | EXTERNAL)
        if unknown:
            raise FatalError(f"unknown fault injection variable(s) {', '.join(unknown)}; known: "
                             f"{', '.join(PREFIX + n for n in names)}")
        values: dict[str, float | int] = {}
        for suffix, field in names.items():
            raw = env.get(PREFIX + suffix, "")
            if raw:
                try:
                    values[field] = float(raw) if field == "slow_step" else int(raw)
                except ValueError:
                    raise FatalError(f"{PREFIX}{suffix}={raw!r} is not a number") from None
        return cls(**values)
