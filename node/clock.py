"""Swarm time: this machine's wall clock, corrected by its measured offset from the swarm's.

Volunteers' clocks drift, and some are minutes (or, with a real-time clock kept in local time,
hours) off. Three things in a node compare wall-clock times with other peers: hivemind's DHT
(a bootstrap peer whose ping reply differs by more than 3 s is refused, and record expirations
are absolute times), our RPC tokens (protocol/auth.py: a timestamp more than 60 s off is
refused) and the expiry of signed DHT records. A node that joins through ``--peers`` therefore
measures, before its DHT bootstraps, how far its clock is from its bootstrap peers', and from
then on runs all three on *swarm time* = local clock + offset.

**Measurement.** hivemind's own ping reply carries the answering peer's DHT time (already swarm
time when that peer corrected its own clock, so corrections chain back to the swarm's first
peer). Per peer, a few pings; the sample with the shortest round trip gives
``offset = reply time - midpoint of the round trip`` (NTP's estimate, error at most half that
round trip); over peers, the median. Offsets under ``MIN_CORRECTION`` are noise of synchronised
clocks and are left alone; offsets beyond ``max_clock_offset`` (a wrong date rather than a
drifting clock) stop the node with one line that names the offset and the fix; so do bootstrap
peers that disagree among themselves by more than hivemind tolerates.

The offset is measured once, at start. From then on swarm time runs on the steady (boot-time)
clock, so a wall clock stepped later (NTP starting after the node, the date set by hand) does
not move it; a free-running clock's drift (its rate error, typically under a few seconds a day)
does.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

log = logging.getLogger(__name__)

MIN_CORRECTION = 0.5  # seconds; below this the local clock is used as it is
DEFAULT_MAX_OFFSET = 86_400.0  # seconds the node corrects by default (a day)
HIVEMIND_TOLERANCE = 3.0  # hivemind.utils.timed_storage.MAX_DHT_TIME_DISCREPANCY_SECONDS
SAMPLES_PER_PEER = 3
STRAGGLER_WAIT = 1.0  # seconds the measurement waits for other peers once one has answered
FIX = "synchronise this machine's clock (e.g. `timedatectl set-ntp true`, or chrony/ntpd) and start again"


class ClockOffsetError(RuntimeError):
    """The clock is further off than the node corrects, or the swarm's time cannot be told."""


@dataclass(frozen=True)
class Sample:
    """One peer's clock against ours: ``offset`` = their time - ours, known within ``rtt / 2``."""

    peer: str
    offset: float
    rtt: float


def describe(offset: float) -> str:
    """``offset`` (swarm - local) as words: '5 min 0.2 s ahead of', '3.1 s behind'."""
    ahead = offset < 0  # the swarm is behind us: our clock runs ahead
    seconds = round(abs(offset), 1)
    amount = f"{seconds:.1f} s"
    if seconds >= 3600:
        amount = f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"
    elif seconds >= 60:
        amount = f"{int(seconds // 60)} min {seconds % 60:.1f} s"
    return f"{amount} {'ahead of' if ahead else 'behind'}"


def decide(samples: Sequence[Sample], max_offset: float) -> tuple[float, float]:
    """(offset to run on, its uncertainty) from the bootstrap peers' samples; ClockOffsetError
    when the peers disagree or the offset is beyond ``max_offset``. No samples: (0, 0)."""
    if not samples:
        return 0.0, 0.0  # nobody answered: hivemind's bootstrap reports that itself
    offsets = sorted(s.offset for s in samples)
    spread = offsets[-1] - offsets[0]
    if spread > HIVEMIND_TOLERANCE - MIN_CORRECTION:
        listed = ", ".join(f"{s.peer[-8:]}: {s.offset:+.1f} s" for s in sorted(samples, key=lambda s: s.offset))
        raise ClockOffsetError(
            f"the peers in --peers disagree on the time by {spread:.1f} s (their clock minus this machine's: "
            f"{listed}); name peers of one swarm, or ask their operators to synchronise their clocks")
    offset = statistics.median(offsets)
    uncertainty = max(s.rtt for s in samples) / 2 + spread / 2
    if abs(offset) <= MIN_CORRECTION:
        return 0.0, uncertainty
    if abs(offset) > max_offset:
        raise ClockOffsetError(
            f"this machine's clock is {describe(offset)} the swarm's ({abs(offset):.1f} s, measured against "
            f"{len(samples)} peer(s)); the node corrects up to {max_offset:.0f} s (max_clock_offset): {FIX}")
    return offset, uncertainty


def steady_clock() -> float:
    """Seconds of a clock that setting the date never moves: Linux's boot time (it counts suspend,
    unlike ``time.monotonic``), else the monotonic clock. NTP may slew its rate, never step it."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic()


class SwarmClock:
    """Swarm time, shared between the node and its forked DHT process.

    Once set, swarm time runs on the steady clock: ``time() = steady() + base``, with ``base``
    fixed when the offset is measured. So a wall clock stepped while the node runs (NTP starting
    after the node, the date set by hand) moves neither the DHT's time nor the tokens'. The values
    live in shared memory created before the fork: the DHT process measures and writes them, the
    node reads them on every call.
    """

    def __init__(self, wall: Callable[[], float] = time.time, steady: Callable[[], float] = steady_clock) -> None:
        self._wall, self._steady = wall, steady
        # base (swarm time - steady clock), offset measured, its uncertainty, peers measured
        self._shared = multiprocessing.RawArray("d", 4)
        self.set(0.0, 0.0, 0)

    @property
    def measured_offset(self) -> float:
        """Swarm time minus this machine's wall clock when it was measured (0: no correction)."""
        return self._shared[1]

    @property
    def offset(self) -> float:
        """Swarm time minus this machine's wall clock now."""
        return self.time() - self._wall()

    @property
    def uncertainty(self) -> float:
        return self._shared[2]

    @property
    def peers_measured(self) -> int:
        return int(self._shared[3])

    def set(self, offset: float, uncertainty: float, peers: int) -> None:
        """Swarm time is the wall clock + ``offset`` now, and runs on the steady clock from here."""
        base = self._wall() + offset - self._steady()
        self._shared[0], self._shared[1], self._shared[2], self._shared[3] = base, offset, uncertainty, float(peers)

    def time(self) -> float:
        """Seconds since the epoch on swarm time (what ``time.time`` would say on a synchronised clock)."""
        return self._steady() + self._shared[0]

    def log_offset(self) -> None:
        """One warning when the node runs on a corrected clock (the volunteer should still fix it)."""
        offset = self.measured_offset
        if offset:
            log.warning("this machine's clock is %s the swarm's (%.1f s, ±%.3f s, measured against %d peer(s)); "
                        "running on swarm time. To be safe, %s",
                        describe(offset), abs(offset), self.uncertainty, self.peers_measured,
                        FIX.removesuffix(" and start again"),
                        extra={"event": "clock_offset", "offset_s": offset, "uncertainty_s": self.uncertainty,
                               "peers": self.peers_measured})


def run_hivemind_on(now: Callable[[], float]) -> None:
    """Make every loaded hivemind module read ``now`` as its DHT time (this process only).

    hivemind has no setting for it: ``get_dht_time`` is ``time.time``, imported by name into each
    module that uses it, so each module's binding is replaced (the DHT process has imported them
    all before it forks, and later imports copy the patched one from ``timed_storage``).
    """
    original = time.time
    for name, module in list(sys.modules.items()):
        if (name == "hivemind" or name.startswith("hivemind.")) and getattr(module, "get_dht_time", None) is original:
            module.get_dht_time = now


async def _sample(protocol, peer, count: int) -> Sample | None:
    """The fastest of ``count`` pings to ``peer`` through hivemind's DHT protocol, or None."""
    from hivemind.proto import dht_pb2

    best: Sample | None = None
    stub = protocol.get_stub(peer)
    for _ in range(count):
        # An empty request: the peer answers with its time and does not add us to its routing table
        # before our clock is settled.
        sent = time.time()
        try:
            reply = await stub.rpc_ping(dht_pb2.PingRequest(), timeout=protocol.wait_timeout)
        except Exception:  # unreachable or gone: hivemind's own bootstrap ping reports it
            log.debug("clock sample from %s failed", peer, exc_info=True)
            break
        received = time.time()
        if not reply.dht_time:
            break  # a peer that does not tell its time
        sample = Sample(str(peer), reply.dht_time - (sent + received) / 2, received - sent)
        if best is None or sample.rtt < best.rtt:
            best = sample
    return best


async def measure(protocol, peers: Iterable, count: int = SAMPLES_PER_PEER) -> list[Sample]:
    """Samples from the peers that answer; once one has, the others get ``STRAGGLER_WAIT`` more."""
    tasks = [asyncio.create_task(_sample(protocol, peer, count)) for peer in peers]
    if not tasks:
        return []
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if any(task.result() is not None for task in done):
            break
    if pending:
        _, pending = await asyncio.wait(pending, timeout=STRAGGLER_WAIT)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [task.result() for task in tasks if task.done() and not task.cancelled() and task.result() is not None]
