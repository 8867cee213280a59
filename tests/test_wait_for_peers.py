"""``[node] wait_for_peers``: the driver holds its first inner phase until enough peers are in the
swarm, reading the swarm without sockets here (the demo's swarm runs it through the CLI:
tests/test_swarm_cli.py)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from lowcomm.node import driver
from lowcomm.node.config import load_config
from lowcomm.node.driver import RoundDriver, StopSignals


class GrowingSwarm:
    """A swarm view that gains one peer at each read after the first ``alone`` reads; the
    others are in ``phase`` (waiting to start, as we are, unless told otherwise)."""

    def __init__(self, alone: int, phase: str = "waiting") -> None:
        self.reads = 0
        self.alone = alone
        self.phase = phase
        self.published: list[str] = []
        self.stats = SimpleNamespace(phase="starting")

    async def refresh_view(self):
        self.reads += 1
        count = 1 + max(0, self.reads - self.alone)
        return SimpleNamespace(peers={f"p{i}": SimpleNamespace(peer_id=f"p{i}", phase=self.phase)
                                      for i in range(count)})

    def position(self):
        return SimpleNamespace(peer_id="p0")

    async def publish_record(self):
        self.published.append(self.stats.phase)


def waiting_driver(wanted: int, swarm: GrowingSwarm) -> SimpleNamespace:
    config = load_config(overrides=[f"node.wait_for_peers={wanted}"], environ={})
    return SimpleNamespace(config=config, swarm=swarm, stops=StopSignals(), stats=swarm.stats)


def test_training_starts_once_the_wanted_peers_are_in_the_swarm(monkeypatch, caplog):
    monkeypatch.setattr(driver, "WAIT_FOR_PEERS_POLL", 0.001)
    swarm = GrowingSwarm(alone=3)
    caplog.set_level(logging.INFO, logger="lowcomm.node")
    assert asyncio.run(RoundDriver.wait_for_peers(waiting_driver(3, swarm))) is True
    assert swarm.reads == 5  # three reads alone, then 2 and 3 peers
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["waiting for 3 peers before training (--wait-for-peers): 1 in the swarm",
                     "waiting for 3 peers before training (--wait-for-peers): 2 in the swarm",
                     "3 peers in the swarm: training starts"]  # each count once, not at every read
    assert swarm.published == ["waiting"]  # others see we wait, not train (the driver's phase comes next)


def test_one_peer_wanted_starts_at_once_without_a_read_or_a_line(caplog):
    swarm = GrowingSwarm(alone=10)
    caplog.set_level(logging.INFO, logger="lowcomm.node")
    assert asyncio.run(RoundDriver.wait_for_peers(waiting_driver(1, swarm))) is True
    assert swarm.reads == 0 and caplog.records == []


def test_two_peers_already_there_start_at_once_without_a_line(caplog):
    swarm = GrowingSwarm(alone=0)
    caplog.set_level(logging.INFO, logger="lowcomm.node")
    assert asyncio.run(RoundDriver.wait_for_peers(waiting_driver(2, swarm))) is True
    assert swarm.reads == 1 and caplog.records == []


def test_a_stop_while_waiting_ends_the_wait_at_once():
    swarm = GrowingSwarm(alone=10**9)
    waiting = waiting_driver(2, swarm)

    async def main() -> bool:
        task = asyncio.create_task(RoundDriver.wait_for_peers(waiting))
        while swarm.reads == 0:
            await asyncio.sleep(0)
        waiting.stops.requested.set()
        return await asyncio.wait_for(task, 5)  # the poll is 1 s; the stop ends it before

    assert asyncio.run(main()) is False
    assert swarm.reads == 1


def test_a_node_that_waits_starts_once_another_peer_trains(caplog):
    # A lone peer that trains never steps alone while another is in the swarm: had the newcomer
    # waited on for a third peer, both would have stood still.
    swarm = GrowingSwarm(alone=0, phase="training")
    caplog.set_level(logging.INFO, logger="lowcomm.node")
    assert asyncio.run(asyncio.wait_for(RoundDriver.wait_for_peers(waiting_driver(3, swarm)), 5)) is True
    assert swarm.reads == 1 and swarm.published == []
