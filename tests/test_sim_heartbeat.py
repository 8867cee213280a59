"""The simulated paced heartbeat (sim/heartbeat.py, the simulator's default peer): the same small
swarm with full reads of the peer table at every beat (``unpaced_heartbeat``, sim/peer.py) and
paced as the node paces it (node/swarmpace.py), a full read every 4 beats (VIEW_PEERS lowered so
that 16 peers make a cycle of 4)."""

from __future__ import annotations

import pytest

from lowcomm.node import swarmpace
from sim import dht, heartbeat
from sim.engine import SimConfig, simulate


def config(**unpaced: bool) -> SimConfig:
    return SimConfig(peers=16, rounds=3, seed=3, churn=0.5, numel=1_000_000, inner_steps=20, group_size=8, **unpaced)


def test_a_paced_swarm_reads_fewer_table_records_and_still_averages_in_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    table = [0]  # records returned by reads of the peer table (the progress record is read with get())
    original = dht.DHTClient.get_records

    async def counted(self, key):
        found = await original(self, key)
        table[0] += len(found[0]) + len(found[1])
        return found

    monkeypatch.setattr(dht.DHTClient, "get_records", counted)
    heartbeat.FULL_READS.clear()
    before, _ = simulate(config(unpaced_heartbeat=True))
    assert not heartbeat.FULL_READS  # SimPeer: no pace
    table_before, table[0] = table[0], 0
    monkeypatch.setattr(swarmpace, "VIEW_PEERS", 4)
    after, _ = simulate(config())
    reads = heartbeat.FULL_READS
    # The pace ran: beats that read only the progress record, periodic and near-quorum full reads.
    assert reads["heartbeat: progress record only"] > 0 and reads["heartbeat: periodic"] > 0
    assert reads["heartbeat: near quorum"] > 0
    # Only matchmaking leaders ask for the view while they wait; 16 peers in groups of 8 make
    # steps too small for buckets, whose leaders read the table at each look anyway.
    assert reads["heartbeat: a leader waits on the view"] == 0 and reads["heartbeat: averaging"] == 0
    assert reads["catch-up: last view reused"] > 0
    assert table[0] < 0.7 * table_before, (table[0], table_before)
    for line in after:  # the decisions still work: groups form and commit one hash per group
        assert line["averaged"] >= line["live"] // 2 and line["groups"] >= 1
        assert 1 <= line["hashes"] <= line["groups"] + line["solo"]


def test_in_bucketed_steps_only_the_step_coordinators_read_the_table_while_they_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # 48 peers in groups of 4: steps large enough for buckets (protocol/buckets.py), whose leaders
    # wait on RoundPeers.latest, the heartbeat's view; only the top level's looks ask for a fresh
    # one (RoundPeers.watch); a cycle of 12 beats between periodic reads. Bucketed steps make
    # hardly any near-quorum reads (ViewPace.single_level).
    monkeypatch.setattr(swarmpace, "VIEW_PEERS", 4)
    heartbeat.FULL_READS.clear()
    lines, _ = simulate(SimConfig(peers=48, rounds=3, seed=3, churn=0.5, numel=1_000_000, inner_steps=20,
                                  group_size=4))
    reads = heartbeat.FULL_READS
    assert reads["heartbeat: a leader waits on the view"] > 0 and reads["heartbeat: averaging"] == 0
    # Fewer than one per round and bucket: bucket leaders, the members that wait on their leader
    # and the reducers read none.
    assert reads["heartbeat: a leader waits on the view"] < 3 * 4, reads
    near_quorum = reads["heartbeat: near quorum"]  # a few: joiners whose first views were small
    for line in lines:  # and the leaders still see who is coming: the whole swarm averages, one hash per step
        assert line["averaged"] == line["live"] and line["groups"] >= 8 and line["hashes"] == 1, line
    # The same swarm matchmaking with one leader per step watches the step's quorum.
    heartbeat.FULL_READS.clear()
    simulate(SimConfig(peers=48, rounds=3, seed=3, churn=0.5, numel=1_000_000, inner_steps=20, group_size=4,
                       single_level=True))
    assert near_quorum < heartbeat.FULL_READS["heartbeat: near quorum"] / 10, (near_quorum, heartbeat.FULL_READS)
