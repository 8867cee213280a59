"""What a running node knows about its own training and rounds, in one place.

The round driver (node/driver.py) writes these numbers as it trains and averages; the node reads
them for its DHT record (phase, throughput, bandwidth), ``status`` and checkpoints (tokens). One
plain object shared by both instead of attributes of one another: everything runs on the event
loop, except ``tokens_total``, which the training thread reads only while the loop waits for it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


@dataclass
class RunStats:
    phase: str = "starting"  # published in the DHT record: waiting, training, averaging, catching_up, stopping
    rounds_completed: int = 0
    rounds_attempted: int = 0  # rounds whose group formed
    group_rounds: int = 0  # rounds whose group had at least one other member
    tokens_since_round: float = 0.0  # the weight of the next round's Δ
    tokens_total: int = 0
    last_loss: float = math.nan
    last_eval: float = math.nan
    tokens_per_second: float = 0.0
    bandwidth_bps: float = 0.0
    train_seconds: float = 0.0  # in inner steps, since training started
    train_clock: float = 0.0  # wall-clock seconds since training started, at the last phase end
    # Compute utilization counts from here: set again when training starts (after start-up, the
    # DHT join and the first catch-up), so that start-up is not counted as idle time.
    training_since: float = field(default_factory=time.monotonic)
    consensus_distance: float = math.nan  # gossip mode: relative L2 distance to the last partners

    @property
    def compute_utilization(self) -> float:
        return self.train_seconds / max(self.train_clock, 1e-9)
