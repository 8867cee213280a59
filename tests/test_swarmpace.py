"""When a peer reads the whole peer table (node/swarmpace.py, node/swarmlink.py), without sockets:
the progress record's marks, the pacing of full reads, and that a stale view answers the
catch-up as a fresh one would whenever the progress record says nothing moved."""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter
from typing import Any

import torch

from lowcomm.node import decisions, swarmpace
from lowcomm.node.config import Config
from lowcomm.node.globalstate import GlobalState
from lowcomm.node.metrics import NodeMetrics
from lowcomm.node.reconnect import Reconnector
from lowcomm.node.runstats import RunStats
from lowcomm.node.swarm import PeerRecord, SwarmView, peers_key
from lowcomm.node.swarmlink import SwarmLink
from lowcomm.node.swarmpace import COMMITTED, OPEN, OPEN_SLOTS, Mark, ViewPace, open_slot
from lowcomm.protocol import PROTOCOL_VERSION
from lowcomm.protocol.handshake import Identity

from .protocol_fakes import run_virtual

ME = decisions.Position("me", 5, "aa")
MY_OPEN = Mark(OPEN, 5, "aa", open_slot("me"))


def record(peer: str, step: int, digest: str, phase: str = "training", fingerprint: str = "f") -> PeerRecord:
    return PeerRecord(peer, f"10.0.0.1:{len(peer)}", step, digest, 1e6, 1.0, PROTOCOL_VERSION, fingerprint, phase)


def test_marks_round_trip_and_refuse_what_is_not_a_mark():
    mark = Mark(COMMITTED, 3, "ab")
    assert mark.subkey == "c/3/ab" and Mark.parse(mark.subkey, mark.to_value()) == mark
    assert Mark.parse("c/4/ab", mark.to_value()) is None  # filed under another subkey: not idempotent
    assert Mark.parse("x/3/ab", {"kind": "x", "step": 3, "params_sha256": "ab"}) is None
    assert Mark.parse("c/3/ab", {"kind": "c", "step": "three"}) is None
    opened = Mark(OPEN, 3, "ab", 7)
    assert opened.subkey == "o/3/ab/7" and Mark.parse(opened.subkey, opened.to_value()) == opened
    outside = Mark(OPEN, 3, "ab", OPEN_SLOTS)
    assert Mark.parse(outside.subkey, outside.to_value()) is None  # a slot past the count would inflate it
    assert swarmpace.parse_marks({"c/3/ab": mark.to_value(), "junk": {"a": 1}}) == {mark}


def test_a_peer_marks_its_commits_and_its_open_rounds_and_gossip_marks_carry_no_hash():
    assert swarmpace.marks_of(decisions.Position("p", 0, "aa"), "training", False) == []
    assert swarmpace.marks_of(ME, "training", False) == [Mark(COMMITTED, 5, "aa")]
    assert swarmpace.marks_of(ME, "averaging", False) == [Mark(COMMITTED, 5, "aa"), MY_OPEN]
    assert swarmpace.marks_of(ME, "averaging", True) == [Mark(COMMITTED, 5, "")]


def test_only_a_later_step_or_another_committed_hash_at_ours_needs_a_fresh_view():
    assert swarmpace.fresh_needed([Mark(COMMITTED, 6, "bb")], ME)  # somebody is past us: behind
    assert not swarmpace.fresh_needed([Mark(OPEN, 6, "aa", 3)], ME)  # whoever averages there committed it first
    assert swarmpace.fresh_needed([Mark(COMMITTED, 5, "bb")], ME)  # the majority vote at our step
    assert not swarmpace.fresh_needed([Mark(COMMITTED, 5, "aa"), Mark(OPEN, 5, "bb", 1), Mark(COMMITTED, 4, "cc")], ME)
    # Gossip mode mixes with a swarm up to the window ahead: only beyond it is a download possible.
    assert not swarmpace.fresh_needed([Mark(COMMITTED, 9, "")], ME, step_window=4)
    assert swarmpace.fresh_needed([Mark(COMMITTED, 10, "")], ME, step_window=4)


def test_without_a_relevant_mark_the_catch_up_of_a_fresh_view_downloads_nothing():
    """The claim the stale catch-up view rests on: a view whose peers all wrote their marks (a
    commit mark per (step, hash) they hold) gives no catch-up target when ``fresh_needed`` is
    False, in 2,000 random swarms around our step (both modes)."""
    rng = random.Random(0)
    checked = Counter()
    for _ in range(2000):
        gossip = rng.random() < 0.3
        peers = {}
        for i in range(rng.randint(0, 12)):
            step = ME.step + rng.choice([-2, -1, 0, 0, 0, 1, 2, 6])
            digest = rng.choice(["aa", "aa", "bb", "cc"])
            peers[f"p{i}"] = record(f"p{i}", step, digest)
        view = SwarmView(peers, {}, 0.0)
        marks = [Mark(COMMITTED, p.outer_step, "" if gossip else p.params_sha256) for p in peers.values()]
        window = 4 if gossip else None
        fresh = swarmpace.fresh_needed(marks, ME, window)
        target = decisions.catch_up_target(view, ME, gossip_window=window)
        if not fresh:
            assert target is None, (view, marks)
            assert gossip or not decisions.behind(view, ME)
        checked[fresh, target is not None] += 1
    assert checked[True, True] > 100 and checked[False, False] > 100  # both sides were exercised


def test_the_pace_reads_the_table_when_decisions_need_it_and_otherwise_once_a_cycle():
    every = swarmpace.full_read_every(1024)
    assert every == 64 and swarmpace.full_read_every(16) == 1 and swarmpace.full_read_every(0) == 1
    assert swarmpace.full_read_every(17) == 2  # past 16 peers, fewer records per beat than the table
    pace = ViewPace("me", quorum=2 / 3)
    assert pace.full_read_due(1024, False, ME, "training", []) == "no view yet"
    reasons = [pace.full_read_due(1024, True, ME, "training", []) for _ in range(3 * every)]
    assert reasons.count("periodic") == 3 and reasons.count(None) == 3 * every - 3
    # Averaging: only a matchmaking leader's look at the view (RoundPeers.latest) asks for a read,
    # at the next beat, once per look.
    pace.want_view()
    assert pace.full_read_due(1024, True, ME, "averaging", []) == "a leader waits on the view"
    assert pace.full_read_due(1024, True, ME, "averaging", []) in (None, "periodic")
    # 9 others at our step and hash: outpaced needs 6 of them averaging; from 3 on, every beat reads.
    one, four = [Mark(OPEN, 5, "aa", 0)], [Mark(OPEN, 5, "aa", slot) for slot in range(4)]
    assert pace.full_read_due(1024, True, ME, "training", one, same=9) in (None, "periodic")
    assert pace.full_read_due(1024, True, ME, "training", four, same=9) == "near quorum"
    assert pace.full_read_due(1024, True, ME, "training", four, same=9) == "near quorum"  # at every beat
    assert pace.full_read_due(1024, True, ME, "training", [Mark(OPEN, 5, "bb", s) for s in range(9)],
                              same=9) in (None, "periodic")  # a round from other parameters
    ahead = [Mark(COMMITTED, 6, "bb")]
    # While we average, the round's end decides whether we are behind: the mark waits for it.
    assert "progress" not in [pace.full_read_due(1024, True, ME, "averaging", ahead) for _ in range(every)]
    due = [pace.full_read_due(1024, True, ME, "training", ahead) for _ in range(every)]
    assert due[0] == "progress" and "progress" in due  # noticed at the first beat that saw it
    pace.read_full(ahead, ME)  # ... and once a full read accounted for it, only the cycle reads
    assert "progress" not in [pace.full_read_due(1024, True, ME, "training", ahead) for _ in range(every)]


def test_near_a_quorum_only_a_single_level_step_reads_the_table_at_every_beat():
    """A bucketed step's leaders close on their buckets' quorums, and the open marks start the
    join-by cut without a read: no swarm-wide quorum to watch there (ViewPace.single_level)."""
    every = swarmpace.full_read_every(1024)
    full = [Mark(OPEN, 5, "aa", slot) for slot in range(swarmpace.OPEN_SLOTS)]  # linear counting: saturated
    bucketed = ViewPace("me", quorum=2 / 3, group_size=16)
    reasons = [bucketed.full_read_due(1024, True, ME, "training", full, same=1023) for _ in range(every)]
    assert "near quorum" not in reasons and reasons.count("periodic") == 1
    # The same marks in a step too small for buckets (fewer than 4 groups' worth), or without
    # bucketed matchmaking ([sync] matchmaking_buckets = false: group_size 0): every beat reads.
    small = ViewPace("me", quorum=2 / 3, group_size=16)
    assert [small.full_read_due(63, True, ME, "training", full, same=62) for _ in range(3)] == ["near quorum"] * 3
    unbucketed = ViewPace("me", quorum=2 / 3, group_size=0)
    assert unbucketed.full_read_due(1024, True, ME, "training", full, same=1023) == "near quorum"
    assert bucketed.single_level(63) and not bucketed.single_level(64) and unbucketed.single_level(10_000)
    # The swarm's size decides, not the peers at our step in a view a few rounds old.
    assert "near quorum" not in [bucketed.full_read_due(1024, True, ME, "training", full, same=0) for _ in range(3)]


def test_the_open_slots_count_the_averaging_peers_and_never_hide_a_quorum():
    """Linear counting over OPEN_SLOTS slots: close for tens of peers, and never below half of
    the true count (what near_quorum relies on) up to saturation, where it says infinity."""
    for m in (1, 10, 50, 100, 200, 400, 2000):
        marks = {Mark(OPEN, 5, "aa", open_slot(f"peer-{m}-{i}")) for i in range(m)}
        estimate = swarmpace.averaging_estimate(marks, ME)
        assert estimate >= m / 2, (m, estimate)
        if m <= 100:
            assert abs(estimate - m) <= 0.25 * m + 1, (m, estimate)
        for same in range(0, 3 * min(m, 400), 7):  # a real quorum is never hidden
            if m >= max(1, math.ceil(2 / 3 * (same + 1)) - 1):
                assert swarmpace.near_quorum(marks, ME, same, quorum=2 / 3), (m, same)
    assert swarmpace.averaging_estimate([], ME) == 0 and not swarmpace.near_quorum([], ME, same=0, quorum=2 / 3)
    assert swarmpace.near_quorum([MY_OPEN], ME, same=1, quorum=2 / 3)  # one other peer: one averaging is a quorum


def test_the_swarm_spreads_its_periodic_reads_over_the_cycle():
    every = swarmpace.full_read_every(1024)
    per_beat = Counter(swarmpace.beat_offset(f"peer-{i}", every) for i in range(1024))
    assert set(per_beat) == set(range(every)) and max(per_beat.values()) <= 2 * 1024 // every


class CountingDHT:
    """The two DHT calls of node/swarm.py in memory, counting calls and records returned per key."""

    def __init__(self) -> None:
        self.data: dict[str, dict[str, dict]] = {}
        self.stores: Counter = Counter()
        self.gets: Counter = Counter()
        self.records: Counter = Counter()

    async def store(self, key: str, subkey: str, value: dict, ttl: float) -> bool:
        self.stores[key] += 1
        self.data.setdefault(key, {})[subkey] = value
        return True

    async def get(self, key: str) -> dict[str, dict]:
        self.gets[key] += 1
        found = dict(self.data.get(key, {}))
        self.records[key] += len(found)
        return found


def make_link(others: int = 0) -> tuple[SwarmLink, CountingDHT, GlobalState, RunStats]:
    config = Config.model_validate({"node": {"heartbeat_interval": 1.0}})
    state = GlobalState.fresh(torch.zeros(4), 0.7, 0.9)
    stats = RunStats(phase="training")
    dht: Any = CountingDHT()
    fingerprint = config.run_fingerprint()
    for i in range(others):
        dht.data.setdefault(peers_key(config.run.name), {})[f"other-{i}"] = record(
            f"other-{i}", 0, state.params_hash, fingerprint=fingerprint).to_value()
    link = SwarmLink(config, Identity("me", fingerprint, "{}"), state, dht_client=dht,
                     reconnector=Reconnector(dht, "me", [], 10.0), metrics=NodeMetrics(), stats=stats)
    return link, dht, state, stats


def test_the_link_writes_each_mark_once_and_the_catch_up_reuses_its_view_until_one_matters():
    link, dht, state, stats = make_link(others=3)
    run = link.config.run.name
    table, progress = peers_key(run), swarmpace.progress_key(run)

    async def main(loop) -> None:
        await link.refresh_view()
        state.params += 1.0
        state.commit()
        await link.publish_record()
        await link.publish_record()  # the next heartbeat: the record again, not the mark
        assert dht.stores[progress] == 1 and set(dht.data[progress]) == {f"c/1/{state.params_hash}"}
        stats.phase = "averaging"
        await link.publish_record()
        assert set(dht.data[progress]) == {f"c/1/{state.params_hash}"}  # the open mark has its step's key
        assert set(dht.data[swarmpace.opened_key(run, 1)]) == {f"o/1/{state.params_hash}/{open_slot('me')}"}

        reads = dht.gets[table]
        view = await link.current_view()  # our own marks: nothing to catch up with
        assert view is link.view and dht.gets[table] == reads
        other = Mark(COMMITTED, 1, "ff" * 32)  # another hash committed at our step: the vote may go against us
        dht.data[progress][other.subkey] = other.to_value()
        await link.current_view()
        assert dht.gets[table] == reads + 1

    run_virtual(main)


def test_the_round_start_of_a_direct_follower_reuses_the_view_unless_the_last_beats_marks_say_otherwise():
    link, dht, state, stats = make_link(others=3)
    run = link.config.run.name
    table, progress = peers_key(run), swarmpace.progress_key(run)

    async def main(loop) -> None:
        assert link.recent_view() is None  # no view yet
        await link.refresh_view()
        reads, mark_reads = dht.gets[table], dht.gets[progress]
        assert link.recent_view() is link.view  # no DHT call of any kind
        ahead = Mark(COMMITTED, 1, "ee" * 32)  # a peer committed past our step: we may be behind
        dht.data.setdefault(progress, {})[ahead.subkey] = ahead.to_value()
        assert link.recent_view() is link.view  # not read yet: the marks are the last beat's
        await link.read_marks()  # the next beat reads them
        assert link.recent_view() is None
        assert (dht.gets[table], dht.gets[progress]) == (reads, mark_reads + 1)

    run_virtual(main)


def test_a_large_swarm_heartbeat_reads_the_table_once_a_cycle_and_at_every_beat_a_leader_waits_on_it():
    link, dht, state, stats = make_link(others=255)
    every = swarmpace.full_read_every(256)
    table = peers_key(link.config.run.name)
    beats = 10 * every

    async def leader_looks() -> None:  # a bucket leader's polls of RoundPeers.latest (node/averaging.py)
        while True:
            link.want_view()
            await asyncio.sleep(0.25)

    async def main(loop) -> None:
        beat = asyncio.create_task(link.heartbeat())
        await asyncio.sleep(beats - 0.5)  # heartbeats at t = 0, 1, ..., beats - 1
        training = dht.gets[table]
        stats.phase = "averaging"  # a member waiting on its leader, or reducing: no view wanted
        await asyncio.sleep(every)
        member = dht.gets[table] - training
        looks = asyncio.create_task(leader_looks())
        await asyncio.sleep(every)
        leading = dht.gets[table] - training - member
        looks.cancel()
        await asyncio.sleep(every)
        after = dht.gets[table] - training - member - leading
        beat.cancel()
        await asyncio.gather(beat, looks, return_exceptions=True)
        # The first beat (no view yet), then one per cycle, averaging or not; at every beat while
        # a leader looks at the view, and at the one beat after its last look.
        assert training in (beats // every + 1, beats // every + 2), training
        assert member == 1 and leading == every and after in (1, 2), (member, leading, after)

    run_virtual(main)
    assert dht.records[table] <= (beats // every + 5 + every) * 256  # vs (beats + 3 * every) * 256 before


def test_a_small_swarm_heartbeat_reads_the_table_at_every_beat_and_no_progress_record():
    link, dht, _, _ = make_link(others=10)
    run = link.config.run.name

    async def main(loop) -> None:
        beat = asyncio.create_task(link.heartbeat())
        await asyncio.sleep(4.5)
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)

    run_virtual(main)
    assert dht.gets[peers_key(run)] == 5 and dht.gets[swarmpace.progress_key(run)] == 0


def test_a_mark_is_stored_once_then_again_at_half_its_ttl_while_the_peer_stands_for_it():
    writer = swarmpace.MarkWriter(False, matchmaking_timeout=40.0, heartbeat=0.0)
    committed, opened = Mark(COMMITTED, 5, "aa"), MY_OPEN
    assert writer.ttl(committed) == 40.0 and swarmpace.MarkWriter(False, 30.0, 5.0).ttl(committed) == 45.0
    assert swarmpace.MarkWriter(False, 30.0, 5.0).ttl(opened) == 30.0  # a failed round's marks go soon
    assert writer.due(ME, "averaging", 0.0) == [committed, opened]
    writer.stored(committed, 0.0)  # the store of the open mark failed: it is due again at the next beat
    assert writer.due(ME, "averaging", 5.0) == [opened]
    writer.stored(opened, 5.0)
    assert writer.due(ME, "averaging", 19.0) == []
    assert writer.due(ME, "averaging", 20.0) == [committed]  # refreshed before it expires
    writer.stored(committed, 20.0)
    assert writer.due(ME, "training", 21.0) == []  # the round closed: the open mark is let expire
    assert writer.due(ME, "averaging", 22.0) == [opened]  # a retried round at the step opens it anew


def test_an_open_mark_of_another_peer_opens_our_round_and_our_own_slot_does_not():
    other_slot = next(slot for slot in range(OPEN_SLOTS) if slot != open_slot("me"))
    assert swarmpace.opened_by_others({Mark(OPEN, 5, "aa", other_slot)}, ME)
    assert not swarmpace.opened_by_others({MY_OPEN}, ME)  # our own failed round's mark lives on
    assert not swarmpace.opened_by_others({Mark(OPEN, 5, "bb", other_slot), Mark(OPEN, 4, "aa", other_slot),
                                           Mark(COMMITTED, 5, "aa")}, ME)


def test_the_link_sees_a_round_open_in_the_marks_between_two_full_reads_of_a_large_table():
    link, dht, state, stats = make_link(others=255)
    opened_at_0 = swarmpace.opened_key(link.config.run.name, 0)

    async def main(loop) -> None:
        await link.refresh_view()
        await link.read_marks()
        assert not link.round_open()
        slot = next(s for s in range(OPEN_SLOTS) if s != open_slot("me"))
        opened = Mark(OPEN, 0, state.params_hash, slot)  # an averager the last full view did not show
        dht.data.setdefault(opened_at_0, {})[opened.subkey] = opened.to_value()
        await link.read_marks()
        assert link.round_open()

    run_virtual(main)


def test_only_a_training_peer_reads_the_open_marks_and_only_those_of_its_own_step():
    """The open marks of a step have a key of their own: a peer that committed the step no longer
    reads them (they live on for their TTL), nor does a peer that averages; in one record with the
    commit marks every peer read up to 64 of them at every beat."""
    link, dht, state, stats = make_link(others=255)
    run = link.config.run.name
    for step in (0, 1):
        dht.data[swarmpace.opened_key(run, step)] = {
            (m := Mark(OPEN, step, "aa", slot)).subkey: m.to_value() for slot in range(OPEN_SLOTS)}

    async def main(loop) -> None:
        await link.read_marks()  # training at step 0
        assert len(link.marks) == OPEN_SLOTS and dht.gets[swarmpace.opened_key(run, 0)] == 1
        stats.phase = "averaging"
        await link.read_marks()
        assert not link.marks and dht.gets[swarmpace.opened_key(run, 0)] == 1
        state.params += 1.0
        state.commit()  # step 1: step 0's open marks are not read again
        stats.phase = "training"
        await link.read_marks()
        assert {m.step for m in link.marks} == {1} and dht.gets[swarmpace.opened_key(run, 0)] == 1
        assert dht.gets[swarmpace.progress_key(run)] == 3  # the commit marks at every read

    run_virtual(main)


def test_the_record_publishes_the_size_of_the_plan_that_made_the_published_step():
    """``plan_peers`` follows the step the record publishes (Matchmaker.plan_behind): the plan
    of step r - 1 stands behind step r, and a step from elsewhere (a download) says 0."""
    link, dht, state, _ = make_link()
    assert link.record().plan_peers == 0  # no matchmaker wired yet: nothing is claimed
    link.plan_behind = lambda step: 28 if step == 1 else 0
    assert link.record().plan_peers == 0  # step 0: not made by that plan
    state.params += 1.0
    state.commit()
    run_virtual(lambda loop: link.publish_record())
    stored = dht.data[peers_key(link.config.run.name)]["me"]
    assert PeerRecord.parse("me", stored).plan_peers == 28 and link.record().outer_step == 1
