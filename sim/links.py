"""Simulated peers' links and machines: bandwidth, latency and compute speed, drawn per peer.

Profiles (``--links``):
- ``residential``: up 10–100 Mbit/s, down 4–10× the up rate (capped at 1 Gbit/s), one-way
  access latency 10–60 ms;
- ``datacenter``: up and down 1–10 Gbit/s, latency 1–10 ms;
- ``mixed`` (the default): 80 % residential, 20 % datacenter.
Rates and latencies are log-uniform within their range. Compute speed (inner steps per second
relative to the nominal step time) is log-normal with ``--speed-spread`` as sigma, so a spread
of 0.5 puts the 5 %–95 % range of the swarm at about 0.44×–2.3×.

A transfer from a to b of n bytes takes the two access latencies plus n / min(up_a, down_b):
the staggered butterfly (protocol/schedule.py) gives each uplink one receiver and each
downlink one sender per stage, so one flow per link is the model of a stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MBIT = 1e6 / 8  # bytes per second in one Mbit/s
GBIT = 1e9 / 8


@dataclass(frozen=True)
class Link:
    up: float  # bytes per second
    down: float
    latency: float  # one-way access latency, seconds
    speed: float  # compute speed factor (1.0 = nominal step time)
    kind: str  # "residential" | "datacenter"

    @property
    def rtt(self) -> float:
        """Round trip to a typical peer (two access latencies each way)."""
        return 4 * self.latency


def _loguniform(rng: np.random.Generator, low: float, high: float) -> float:
    return float(math.exp(rng.uniform(math.log(low), math.log(high))))


def draw_link(rng: np.random.Generator, profile: str, speed_spread: float) -> Link:
    if profile == "mixed":
        profile = "datacenter" if rng.random() < 0.2 else "residential"
    if profile == "residential":
        up = _loguniform(rng, 10 * MBIT, 100 * MBIT)
        down = min(1000 * MBIT, up * _loguniform(rng, 4, 10))
        latency = _loguniform(rng, 0.010, 0.060)
    elif profile == "datacenter":
        up = _loguniform(rng, 1 * GBIT, 10 * GBIT)
        down = _loguniform(rng, 1 * GBIT, 10 * GBIT)
        latency = _loguniform(rng, 0.001, 0.010)
    else:
        raise ValueError(f"unknown link profile {profile!r} (residential, datacenter, mixed)")
    speed = float(math.exp(rng.normal(0.0, speed_spread))) if speed_spread > 0 else 1.0
    return Link(up, down, latency, speed, profile)


def transfer_seconds(sender: Link, receiver: Link, nbytes: float) -> float:
    """One flow of ``nbytes`` from ``sender`` to ``receiver`` (latency plus serialisation)."""
    rate = min(sender.up, receiver.down)
    return sender.latency + receiver.latency + nbytes / rate


def one_way(a: Link, b: Link) -> float:
    """A small message from a to b."""
    return a.latency + b.latency
