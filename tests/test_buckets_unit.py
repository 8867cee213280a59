"""Two-level matchmaking of a large step (protocol/buckets.py) without sockets: buckets, the step
coordinator and one step plan, over the fakes of tests/protocol_fakes.py on virtual time."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from lowcomm.protocol._pb.lowcomm.v1 import averaging_pb2
from lowcomm.protocol.buckets import BUCKET_SHARE, RoundPeers, bucket_count, bucket_key, bucket_label, bucketed_by_plan
from lowcomm.protocol.layout import close_groups, groups_of_step, split_into_groups
from lowcomm.protocol.matchmaking import Matchmaker, MatchmakingError, PlanClosed, round_key

from .protocol_fakes import FakeDHT, FakeNet, VirtualTimeLoop, run_virtual
from .test_matchmaking_unit import NUMEL, expecting, make_peer

GROUP = 4
TIMEOUT = 20.0


def swarm(net: FakeNet, dht: FakeDHT, loop: VirtualTimeLoop, count: int) -> list[Matchmaker]:
    return [make_peer(net, dht, loop, f"peer-{i:02d}", group_size=GROUP) for i in range(count)]


def knowing(ids: set[str]) -> RoundPeers:
    """The round-start view expects ``ids``, and all of them stay alive."""
    return RoundPeers(frozenset(ids), latest=lambda: ids)


async def form(m: Matchmaker, step: int, view: set[str], timeout: float = TIMEOUT):
    """form_group as the node calls it; the DHT-reading callback is never used on the bucket path."""
    async def must_not_read() -> set[str]:
        raise AssertionError("a bucketed round re-read the swarm view")

    expected = must_not_read if bucket_count(len(view), m.group_size) > 1 else expecting(view)
    try:
        group = await m.form_group(step, 1.0, 1e6, expected, timeout, params_hash="ab" * 32, round_peers=knowing(view))
    except MatchmakingError as err:
        return err, m.clock.monotonic()
    return group, m.clock.monotonic()


def plans(outcomes) -> Counter:
    """How many peers got each step plan (the tuple of its group ids)."""
    return Counter(tuple(sg.group_id for sg in g.step_groups) or (g.group_id,)
                   for g, _ in outcomes if isinstance(g, averaging_pb2.Group))


STRAGGLE_WAIT = 4 * 2.0  # no history yet: min_straggler_wait x 4 (election.straggler_wait)


def arrivals(step: int, view: set[str], delays: dict[str, float], views: dict[str, set[str]] | None = None):
    """Every peer of ``view`` (``peer-00`` ...) forms its group of ``step`` after its delay (0 when
    not in ``delays``) with its own view (``views``, default ``view``): (outcomes by peer, the
    registrants of the step's top key that announced a plan)."""
    async def scenario(loop: VirtualTimeLoop):
        net, dht = FakeNet(), FakeDHT(loop)
        group = {m.peer_id: m for m in swarm(net, dht, loop, len(view))}
        assert set(group) == view

        async def arrive(peer: str):
            await asyncio.sleep(delays.get(peer, 0.0))
            return peer, await form(group[peer], step, (views or {}).get(peer, view))

        outcomes = dict(await asyncio.gather(*(arrive(p) for p in sorted(view))))
        top = dht.data.get(round_key("unit", step, "ab" * 32), {})
        return outcomes, {pid for pid, (info, _) in top.items() if info.get("planned")}

    return run_virtual(scenario)


def members_by_bucket(step: int, view: set[str], buckets: int) -> dict[str, list[str]]:
    """Each bucket label of ``step`` and its members, in id order."""
    by_label: dict[str, list[str]] = {}
    for peer in sorted(view):
        by_label.setdefault(bucket_label(step, peer, buckets), []).append(peer)
    return by_label


def assert_all_grouped(outcomes: dict) -> None:
    assert all(isinstance(g, averaging_pb2.Group) for g, _ in outcomes.values()), \
        {p: g for p, (g, _) in outcomes.items() if not isinstance(g, averaging_pb2.Group)}


def test_the_bucket_count_is_one_below_four_groups_and_a_power_of_two_near_the_root_above():
    assert [bucket_count(n, 16) for n in (1, 31, 32, 63, 64, 100, 255, 256, 1024, 4096)] == \
        [1, 1, 1, 1, 4, 4, 8, 16, 32, 64]
    assert bucket_count(1024, 2) == 32  # near √n, not n / group_size = 512
    assert [bucket_count(n, 64) for n in (256, 1024, 4096)] == [4, 16, 64]  # no bucket smaller than a group
    assert bucket_count(8, 2) == 4  # never fewer than 4
    labels = {bucket_label(3, f"p{i}", 4) for i in range(64)}
    assert labels == {"b4.0", "b4.1", "b4.2", "b4.3"}
    assert [bucket_label(s, "p1", 4) for s in range(8)] != [bucket_label(0, "p1", 4)] * 8  # re-mixed every step


def test_a_bucket_leader_rebuilds_exactly_the_groups_the_coordinator_made():
    members = [averaging_pb2.Member(peer_id=f"p{i}", address=f"a{i}", weight=1.0 + i) for i in range(11)]
    template = averaging_pb2.Group(step=4, codec=1, reduce_timeout_s=5.0)
    made = close_groups(split_into_groups(members, 4, 4), {m.peer_id: 1e6 for m in members}, NUMEL, template,
                        random.Random(0).randbytes)
    for group in made:
        rebuilt = groups_of_step(group)
        for other in made:
            for m in other.members:
                assert rebuilt[m.peer_id].SerializeToString() == other.SerializeToString()


def test_a_large_step_forms_one_step_plan_and_nobody_receives_every_join():
    async def scenario(loop: VirtualTimeLoop):
        net, dht = FakeNet(), FakeDHT(loop)
        group = swarm(net, dht, loop, 32)  # n = 32, group size 4: B = 8 buckets
        view = {m.peer_id for m in group}
        return await asyncio.gather(*(form(m, 7, view) for m in group)), net.joins, dht.keys_read

    outcomes, joins, keys = run_virtual(scenario)
    groups = [g for g, _ in outcomes]
    assert all(isinstance(g, averaging_pb2.Group) for g in groups)
    assert len(plans(outcomes)) == 1 and len(groups[0].step_groups) == 8  # one plan: one θ for the whole step
    placed = Counter(m.peer_id for sg in groups[0].step_groups for m in sg.members)
    assert set(placed) == {f"peer-{i:02d}" for i in range(32)} and set(placed.values()) == {1}
    for peer, g in zip(range(32), groups):  # each got its own group of that plan
        assert f"peer-{peer:02d}" in [m.peer_id for m in g.members]
    per_callee = Counter(address for address, _ in joins)
    bucket_calls = Counter(address for address, request in joins if request.closed_bucket)
    assert max(bucket_calls.values()) <= 8 - 1  # the coordinator: one call per other bucket
    assert max(per_callee.values()) <= GROUP + 8  # nobody receives the swarm's 31 joins
    # Each bucket's peers read their bucket's registrations, the leaders the step's top key: no
    # key holds every registrant, and none of them is read by everybody at every poll.
    assert not any(key.endswith("/peers") for key in keys)
    assert Counter(keys)[round_key("unit", 7, "ab" * 32)] < 32
    assert max(t for _, t in outcomes) < TIMEOUT


def test_a_small_step_with_round_peers_is_the_single_level_path_unchanged():
    async def scenario(loop: VirtualTimeLoop, with_view: bool):
        net, dht = FakeNet(), FakeDHT(loop)
        group = swarm(net, dht, loop, 15)  # 15 < 4 x 4: B = 1
        view = {m.peer_id for m in group}
        made = await asyncio.gather(*(
            m.form_group(2, 1.0, 1e6, expecting(view), TIMEOUT, params_hash="ab" * 32,
                         round_peers=knowing(view) if with_view else None) for m in group))
        planned = {pid for pid, (info, _) in dht.data[round_key("unit", 2, "ab" * 32)].items() if info.get("planned")}
        return [g.SerializeToString() for g in made], net.calls, dht.keys_read, planned

    bucketed, single = run_virtual(lambda loop: scenario(loop, True)), run_virtual(lambda loop: scenario(loop, False))
    # The same groups through the same calls and DHT reads; the leader announces its split plan
    # (for a bucket leader whose view gave B > 1: matchmaking.py), and only it.
    assert bucketed == single and single[3] == {"peer-00"}  # peer-00, the lowest id, led


@pytest.mark.parametrize("fault", ["down", "silent"])
def test_a_dead_bucket_leader_costs_its_bucket_one_round_not_a_hang(fault):
    """A registered bucket leader that refuses connections (down) is skipped by its bucket; one
    that takes calls and never answers (silent) costs its bucket the round, before its deadline,
    while the rest of the step still forms one plan."""
    async def scenario(loop: VirtualTimeLoop):
        net, dht = FakeNet(), FakeDHT(loop)
        group = swarm(net, dht, loop, 32)
        view = {m.peer_id for m in group} | {"peer-!!"}  # "!" sorts first: the lowest of its bucket
        buckets = bucket_count(len(view), GROUP)
        label = bucket_label(7, "peer-!!", buckets)
        await dht.store(bucket_key("unit", 7, "ab" * 32, label), "peer-!!", {"address": "fake://dead"}, ttl=60)
        (net.down if fault == "down" else net.silent).add("fake://dead")
        net.matchmakers["fake://dead"] = group[0]  # reached only when silent, never answered
        its_bucket = {m.peer_id for m in group if bucket_label(7, m.peer_id, buckets) == label}
        return await asyncio.gather(*(form(m, 7, view) for m in group)), its_bucket

    outcomes, its_bucket = run_virtual(scenario)
    assert its_bucket  # the scenario has members in the dead leader's bucket
    assert all(t <= TIMEOUT + 1e-6 for _, t in outcomes)  # nobody waits past its own deadline
    plan, placed = plans(outcomes).most_common(1)[0]
    others = [g for (g, _), i in zip(outcomes, range(32)) if f"peer-{i:02d}" not in its_bucket]
    assert all(isinstance(g, averaging_pb2.Group) and len(g.members) > 1 for g in others)
    assert placed >= 32 - len(its_bucket) and len(plans(outcomes)) == 1 + sum(  # solo groups count as plans
        isinstance(g, averaging_pb2.Group) and len(g.members) == 1 for g, _ in outcomes)
    mine = [g for (g, _), i in zip(outcomes, range(32)) if f"peer-{i:02d}" in its_bucket]
    if fault == "down":  # the next lowest of the bucket leads it: nothing lost
        assert all(isinstance(g, averaging_pb2.Group) and len(g.members) > 1 for g in mine)
    else:  # the bucket's calls hang until their deadline: refused or alone, never later
        assert all(isinstance(g, MatchmakingError) or len(g.members) == 1 for g in mine)


def test_peers_whose_views_give_another_bucket_count_still_meet_the_coordinator():
    """Near a power of two, views differ: a peer that sees too few peers matchmakes on the single
    level (the step's top key directly), one that sees too many lands in a bucket of its own;
    both end up in the one plan of the step."""
    async def scenario(loop: VirtualTimeLoop):
        net, dht = FakeNet(), FakeDHT(loop)
        group = swarm(net, dht, loop, 16)  # B = 4 for most
        few = make_peer(net, dht, loop, "peer-98", group_size=GROUP)  # sees 5 peers: B = 1
        many = make_peer(net, dht, loop, "peer-99", group_size=GROUP)  # sees 16 ghosts too: B = 8
        view = {m.peer_id for m in group} | {"peer-98", "peer-99"}
        ghosts = {f"ghost-{i}" for i in range(16)}
        return await asyncio.gather(*(form(m, 3, view) for m in group),
                                    form(few, 3, {"peer-98", "peer-00", "peer-01", "peer-02", "peer-03"}),
                                    form(many, 3, view | ghosts))

    outcomes = run_virtual(scenario)
    assert bucket_count(5, GROUP) == 1 and bucket_count(34, GROUP) == 8 and bucket_count(18, GROUP) == 4
    assert all(isinstance(g, averaging_pb2.Group) for g, _ in outcomes)
    assert len(plans(outcomes)) == 1  # one plan with everybody, both odd views included
    placed = {m.peer_id for sg in outcomes[0][0].step_groups for m in sg.members}
    assert {"peer-98", "peer-99"} <= placed and len(placed) == 18
    assert max(t for _, t in outcomes) < BUCKET_SHARE * TIMEOUT + TIMEOUT / 2


def test_a_bucket_that_comes_after_the_plan_closed_fails_its_round_and_makes_no_second_plan():
    """Members of one bucket start when the others' plan is already made: they are told so
    (PlanClosed, a MatchmakingError) within their deadline, and no second plan of the step exists."""
    async def scenario(loop: VirtualTimeLoop):
        net, dht = FakeNet(), FakeDHT(loop)
        group = swarm(net, dht, loop, 32)
        view = {m.peer_id for m in group}
        late_label = bucket_label(7, "peer-31", 8)
        late = [m for m in group if bucket_label(7, m.peer_id, 8) == late_label]
        early = [m for m in group if m not in late]
        first = await asyncio.gather(*(form(m, 7, view, timeout=6.0) for m in early))
        # The late bucket still sees everybody at the step (their records lag), so B = 8 for it too.
        second = await asyncio.gather(*(form(m, 7, view, timeout=6.0) for m in late))
        return first, second, len(late)

    first, second, late = run_virtual(scenario)
    assert late >= 2 and len(plans(first)) == 1
    assert all(isinstance(g, PlanClosed) for g, _ in second), [g for g, _ in second]
    assert max(t for _, t in second) <= max(t for _, t in first) + 6.0  # within their own deadline


def test_a_lower_coordinator_that_comes_after_the_plan_was_made_does_not_plan_the_step_again():
    """Two peers (not the lowest ids) reach the step 28.8 s before the other six (timeout 30 s):
    their coordinator makes the step's plan at its deadline, before the others' buckets come
    up. The lowest of the others would lead the top level (it sees no lower registrant) and
    plan the step a second time (two params hashes). The first plan's announcement stops that:
    whoever is not in it gives up (PlanClosed) within its deadline. (With the late peers 26 s
    late, as this test had them before the top level's straggler wait, that wait now brings
    them all into the first plan.)"""
    async def scenario(loop: VirtualTimeLoop):
        net, dht = FakeNet(), FakeDHT(loop)
        group = [make_peer(net, dht, loop, f"peer-{i:02d}", group_size=2) for i in range(8)]
        view = {m.peer_id for m in group}
        early = {"peer-02", "peer-04"}

        async def arrive(m: Matchmaker):
            if m.peer_id not in early:
                await asyncio.sleep(28.8)
            return await form(m, 12, view, timeout=30.0)

        return await asyncio.gather(*(arrive(m) for m in group))

    outcomes = run_virtual(scenario)
    assert bucket_count(8, 2) == 4
    made = plans(outcomes)
    assert len(made) == 1, made
    planned = [g for g, _ in outcomes if isinstance(g, averaging_pb2.Group)]
    assert {"peer-02", "peer-04"} <= {m.peer_id for g in planned for m in g.members}
    left_out = [g for g, _ in outcomes if not isinstance(g, averaging_pb2.Group)]
    assert left_out and all(isinstance(g, PlanClosed) for g in left_out), left_out
    assert all(t <= 28.8 + 30.0 for _, t in outcomes)


def test_an_overlapped_peer_sees_the_next_round_start_in_its_own_bucket():
    """After a bucketed round, ``others_registered`` (an overlapped peer cuts its inner phase on
    it) also reads the peer's bucket of the next step: there its bucket's members register,
    long before a bucket leader reaches the top key."""
    async def scenario(loop: VirtualTimeLoop):
        net, dht = FakeNet(), FakeDHT(loop)
        group = swarm(net, dht, loop, 32)
        view = {m.peer_id for m in group}
        await asyncio.gather(*(form(m, 7, view) for m in group))
        me, buckets = group[0], bucket_count(len(view), GROUP)
        label = bucket_label(8, me.peer_id, buckets)
        mate = next(m for m in group[1:] if bucket_label(8, m.peer_id, buckets) == label)
        stranger = next(m for m in group[1:] if bucket_label(8, m.peer_id, buckets) != label)
        before = await me.others_registered(8, "ab" * 32)
        await dht.store(bucket_key("unit", 8, "ab" * 32, bucket_label(8, stranger.peer_id, buckets)), stranger.peer_id,
                        {"address": stranger.address}, ttl=60)
        elsewhere = await me.others_registered(8, "ab" * 32)
        await dht.store(bucket_key("unit", 8, "ab" * 32, label), mate.peer_id, {"address": mate.address}, ttl=60)
        return me.last_buckets, before, elsewhere, await me.others_registered(8, "ab" * 32)

    assert run_virtual(scenario) == (bucket_count(32, GROUP), 0, 0, 1)


def test_the_members_of_a_plan_agree_on_the_next_steps_buckets_whatever_their_views_say():
    from lowcomm.protocol.buckets import bucket_count, next_bucket_count

    # 512 peers sit where B doubles: a view short of one peer gives 16, not 32.
    assert (bucket_count(512, 16), bucket_count(511, 16)) == (32, 16)
    plan = (4, 512)  # we were in step 4's plan of 512 peers
    assert next_bucket_count(5, 500, 16, plan) == next_bucket_count(5, 520, 16, plan) == 32
    assert next_bucket_count(6, 500, 16, plan) == 16  # that plan is not the last step's: our view decides
    assert next_bucket_count(5, 500, 16, None) == 16  # a joiner, or a peer that missed the step


def test_a_peer_outside_the_last_plan_takes_the_next_steps_buckets_from_the_members_records():
    from lowcomm.protocol.buckets import next_bucket_count

    # A joiner or a peer that missed step 4 counts 512 in its view where the members of step
    # 4's plan (500 peers) count B = 16: their records say 500, and it takes B from that.
    assert next_bucket_count(5, 512, 16, None, plan_of_state=500) == 16
    assert next_bucket_count(5, 512, 16, None) == 32  # no member published a plan: the view decides
    assert next_bucket_count(5, 500, 16, (4, 512), plan_of_state=500) == 32  # our own plan first


def test_a_straggler_whose_bucket_went_up_without_it_still_reaches_the_open_plan():
    """A bucket closes after its quorum and the straggler wait while the step coordinator still
    waits for a later bucket: a member of the closed bucket that comes in between finds its
    leader at the top level and goes up alone at once, into the one plan of the step (before,
    it polled its empty bucket until the coordinator was about to close and got PlanClosed)."""
    step, view = 7, {f"peer-{i:02d}" for i in range(32)}
    buckets = bucket_count(len(view), GROUP)
    by_label = members_by_bucket(step, view, buckets)
    # The bucket with the lowest id (its leader coordinates) is on time; in another one of three
    # or more, one member (not its lowest) is a straggler; a third bucket comes late as a whole.
    on_time = by_label[bucket_label(step, "peer-00", buckets)]
    closing = next(ids for label, ids in sorted(by_label.items()) if len(ids) >= 3 and ids is not on_time)
    straggler = closing[-1]
    late = next(ids for ids in by_label.values() if ids is not on_time and ids is not closing)
    outcomes, _ = arrivals(step, view, {straggler: STRAGGLE_WAIT + 1.5, **{p: STRAGGLE_WAIT + 2.0 for p in late}})
    assert_all_grouped(outcomes)
    assert len(plans(outcomes.values())) == 1
    placed = {m.peer_id for sg in outcomes[straggler][0].step_groups for m in sg.members}
    assert placed == view


def test_a_peer_whose_view_gave_one_bucket_and_leads_the_top_key_waits_for_every_bucket():
    """At the size where B changes, the lowest peer counted one peer fewer than the others: its
    view gives B = 1, theirs B = 4. It leads the step's key, where the buckets' leaders come up.
    It must coordinate their step as a bucketed step's coordinator does: wait for every bucket,
    not close at a quorum before a late bucket comes (which then failed its round), and
    announce its plan. Before, on eight real nodes in groups of two, such a close came before a
    bucket whose leader had a lower id, and that one planned the step again (two hashes)."""
    step, view = 3, {f"peer-{i:02d}" for i in range(16)}  # at step 3, peer-15's bucket holds three
    assert bucket_count(len(view), GROUP) == 4 and bucket_count(len(view) - 1, GROUP) == 1
    short = view - {"peer-15"}  # peer-00's view misses one peer's record
    late_bucket = bucket_label(step, "peer-15", 4)
    late = {p for p in view if bucket_label(step, p, 4) == late_bucket} - {"peer-00"}
    assert late and len(view - late) - 1 >= 2 / 3 * len(short)  # a quorum is in before the late bucket
    outcomes, announced = arrivals(step, view, {p: STRAGGLE_WAIT + 3.0 for p in late}, {"peer-00": short})
    assert_all_grouped(outcomes)
    assert len(plans(outcomes.values())) == 1 and outcomes["peer-00"][0].step_groups
    assert {m.peer_id for sg in outcomes["peer-00"][0].step_groups for m in sg.members} == view
    assert announced == {"peer-00"}


def test_peers_that_come_after_a_small_steps_split_plan_closed_give_up_instead_of_planning_again():
    """A step below the bucket threshold whose leader split it into groups (12 peers in groups of
    4) closes at its quorum and the straggler wait; two peers that come later find its plan
    announced and fail their round (PlanClosed), where before they made a plan of their own and
    the step ended with two params hashes (the simulator at 16 peers in groups of 4, seed 5)."""
    step, view = 4, {f"peer-{i:02d}" for i in range(12)}
    assert bucket_count(len(view), GROUP) == 1
    late = {"peer-10", "peer-11"}
    outcomes, _ = arrivals(step, view, {p: STRAGGLE_WAIT + 3.0 for p in late})
    assert len(plans(outcomes.values())) == 1
    assert {p for p, (g, _) in outcomes.items() if isinstance(g, averaging_pb2.Group)} == view - late
    assert all(isinstance(outcomes[p][0], PlanClosed) for p in late), {p: outcomes[p][0] for p in late}


def test_the_coordinator_gives_the_stragglers_of_a_bucket_that_reported_short_the_straggler_wait():
    """Every bucket reported, the last one after its quorum and the straggler wait, without one
    of its members: the coordinator waits the straggler wait once more before it closes the
    plan, and that member, coming up alone two seconds after its bucket left, is in the plan.
    Before, the plan closed as the last bucket reported, and the straggler failed its round
    (PlanClosed) and downloaded the state a step later (the simulator at 8 peers in groups of
    2: 21 failed rounds and 10 downloads over 12 seeds, 2 and 1 with the wait)."""
    step, view = 7, {f"peer-{i:02d}" for i in range(32)}
    buckets = bucket_count(len(view), GROUP)
    by_label = members_by_bucket(step, view, buckets)
    closing = next(ids for _, ids in sorted(by_label.items()) if len(ids) >= 3 and "peer-00" not in ids)
    straggler = closing[-1]  # not its bucket's lowest: the bucket closes on its quorum without it
    outcomes, _ = arrivals(step, view, {straggler: STRAGGLE_WAIT + 2.0})
    assert_all_grouped(outcomes)
    assert len(plans(outcomes.values())) == 1
    assert {m.peer_id for sg in outcomes[straggler][0].step_groups for m in sg.members} == view


def test_a_member_of_a_split_plan_says_which_step_that_plan_made_and_how_many_it_held():
    async def scenario(loop: VirtualTimeLoop):
        net, dht = FakeNet(), FakeDHT(loop)
        group = swarm(net, dht, loop, 32)
        view = {m.peer_id for m in group}
        await asyncio.gather(*(form(m, 7, view) for m in group))
        return [(m.plan_behind(8), m.plan_behind(7), m.plan_behind(9)) for m in group]

    # The plan of step 7 made step 8 (the commit after it): 32 behind step 8, nothing else claimed.
    assert set(run_virtual(scenario)) == {(32, 0, 0)}


def plan_member_round(fail_reads_of: str = "") -> tuple[dict, Counter, set[str], Counter]:
    """Step 8 after a plan of the whole 32-peer swarm at step 7, every peer starting from a view
    older than the step (it shows nobody at step 8, as the heartbeat's view does right after a
    commit) with ``read_first`` (node/averaging.py for a plan member): (outcomes by peer, fresh
    reads by peer, the peers that led a bucket, fresh views asked for by peer: ``watch``)."""
    async def scenario(loop: VirtualTimeLoop):
        net, dht = FakeNet(), FakeDHT(loop)
        group = swarm(net, dht, loop, 32)
        view = {m.peer_id for m in group}
        await asyncio.gather(*(form(m, 7, view) for m in group))  # the plan of step 7: 32 peers
        assert all(bucketed_by_plan(8, m.last_plan, GROUP) for m in group)
        reads: Counter = Counter()
        watches: Counter = Counter()

        def round_peers(peer: str) -> RoundPeers:
            fresh = {"read": False}

            async def read_first() -> None:
                reads[peer] += 1
                await asyncio.sleep(0.05)  # a DHT read
                if peer == fail_reads_of:
                    raise ConnectionError("DHT unreachable")
                fresh["read"] = True

            # The old view expects nobody at step 8; the fresh one everybody (the heartbeat's).
            return RoundPeers(frozenset({peer}), latest=lambda: view if fresh["read"] else set(),
                              read_first=read_first, watch=lambda: watches.update([peer]))

        async def never_read() -> set[str]:
            raise AssertionError("a bucketed round read the view through expected_peers")

        async def at_step_8(m: Matchmaker):
            try:
                return m.peer_id, await m.form_group(8, 1.0, 1e6, never_read, TIMEOUT, params_hash="ab" * 32,
                                                     round_peers=round_peers(m.peer_id))
            except MatchmakingError as err:
                return m.peer_id, err

        outcomes = dict(await asyncio.gather(*(at_step_8(m) for m in group)))
        leaders = {min(ids) for ids in members_by_bucket(8, view, bucket_count(32, GROUP)).values()}
        return outcomes, reads, leaders, watches

    return run_virtual(scenario)


def test_members_of_the_last_plan_start_without_a_read_and_only_leaders_read_the_table():
    """A member of a split plan knows the next step's B and bucket without a view
    (``bucketed_by_plan``); a leader reads the table at its first look (``RoundPeers.read_first``)
    and waits for the peers the fresh view expects, so the whole swarm is in one plan; the
    others read nothing (the round-start read was N records per peer and round)."""
    outcomes, reads, leaders, _ = plan_member_round()
    assert all(isinstance(g, averaging_pb2.Group) for g in outcomes.values()), outcomes
    assert len({tuple(sg.group_id for sg in g.step_groups) for g in outcomes.values()}) == 1
    assert {m.peer_id for sg in next(iter(outcomes.values())).step_groups for m in sg.members} == set(outcomes)
    assert leaders <= set(reads) and set(reads.values()) == {1}  # each leader once, for all its levels
    assert len(reads) < len(outcomes) / 2, reads  # most members never lead


def test_only_the_top_level_asks_the_heartbeat_for_a_fresh_table():
    """``RoundPeers.watch``: the step coordinator's looks span every bucket and ask for a view at
    most a beat old; a bucket leader's looks use the view it started with (its first read)."""
    outcomes, reads, leaders, watches = plan_member_round()
    assert all(isinstance(g, averaging_pb2.Group) for g in outcomes.values()), outcomes
    coordinator = min(outcomes)
    assert watches[coordinator] > 0 and set(watches) <= leaders, (watches, leaders)
    assert len(watches) < len(leaders), watches  # bucket leaders that found the coordinator at once asked nothing


def test_a_leader_whose_first_read_fails_fails_its_round_and_the_others_still_meet():
    outcomes, reads, leaders, _ = plan_member_round(fail_reads_of="peer-00")
    assert "peer-00" in leaders and isinstance(outcomes["peer-00"], MatchmakingError)
    assert "could not read the peer table" in str(outcomes["peer-00"])
    grouped = {p for p, g in outcomes.items() if isinstance(g, averaging_pb2.Group)}
    assert len(grouped) >= len(outcomes) - 8  # peer-00's bucket may lose its round, nobody else
