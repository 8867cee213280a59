"""The simulated paced heartbeat (sim/heartbeat.py): the same small swarm with the node's full
reads of the peer table every beat (sim/peer.py) and paced (node/swarmpace.py), a full read
every 4 beats (VIEW_PEERS lowered so that 16 peers make a cycle of 4)."""

from __future__ import annotations

import pytest

from lowcomm.node import swarmpace
from sim import dht, engine, heartbeat
from sim.engine import SimConfig, simulate


def config() -> SimConfig:
    return SimConfig(peers=16, rounds=3, seed=3, churn=0.5, numel=1_000_000, inner_steps=20, group_size=8)


def test_a_paced_swarm_reads_fewer_table_records_and_still_averages_in_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    table = [0]  # records returned by reads of the peer table (the progress record is read with get())
    original = dht.DHTClient.get_records

    async def counted(self, key):
        found = await original(self, key)
        table[0] += len(found[0]) + len(found[1])
        return found

    monkeypatch.setattr(dht.DHTClient, "get_records", counted)
    before, _ = simulate(config())
    table_before, table[0] = table[0], 0
    monkeypatch.setattr(swarmpace, "VIEW_PEERS", 4)
    monkeypatch.setattr(engine, "SimPeer", heartbeat.PacedPeer)
    heartbeat.FULL_READS.clear()
    after, _ = simulate(config())
    reads = heartbeat.FULL_READS
    # The pace ran: beats that read only the progress record, periodic and near-quorum full reads.
    assert reads["heartbeat: progress record only"] > 0 and reads["heartbeat: periodic"] > 0
    assert reads["heartbeat: near quorum"] + reads["heartbeat: averaging"] > 0
    assert reads["catch-up: last view reused"] > 0
    assert table[0] < 0.7 * table_before, (table[0], table_before)
    for line in after:  # the decisions still work: groups form and commit one hash per group
        assert line["averaged"] >= line["live"] // 2 and line["groups"] >= 1
        assert 1 <= line["hashes"] <= line["groups"] + line["solo"]
