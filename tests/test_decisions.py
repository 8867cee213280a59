"""The round driver's decisions (node/decisions.py), without sockets: plain functions of a view."""

from __future__ import annotations

import pytest

from lowcomm.node import decisions
from lowcomm.node.decisions import Position
from lowcomm.node.swarm import PeerRecord, SwarmView

ME = "peer-m"


def record(peer_id: str, step: int, digest: str, phase: str = "training", address: str = "127.0.0.1:1") -> PeerRecord:
    return PeerRecord(peer_id=peer_id, address=address, outer_step=step, params_sha256=digest, bandwidth_bps=0.0,
                      tokens_per_second=0.0, protocol_version=1, config_fingerprint="f", phase=phase)


def view(*records: PeerRecord) -> SwarmView:
    return SwarmView({r.peer_id: r for r in records}, {}, 0.0)


def me(step: int = 5, digest: str = "h") -> Position:
    return Position(ME, step, digest)


def test_our_own_record_never_counts_as_another_peer():
    v = view(record(ME, 5, "h"))
    assert decisions.others(v, me()) == []
    assert decisions.solo_step_allowed(v, me())
    assert decisions.catch_up_target(v, me()) is None
    assert not decisions.behind(v, me())


def test_behind_when_a_peer_is_past_our_step_or_a_majority_holds_other_params():
    assert decisions.behind(view(record("a", 6, "x")), me())
    assert not decisions.behind(view(record("a", 4, "x")), me())
    two_elsewhere = view(record("a", 5, "x"), record("b", 5, "x"))
    assert decisions.behind(two_elsewhere, me())
    assert not decisions.behind(two_elsewhere, me(), gossip=True)  # states differ by design there


@pytest.mark.parametrize("ours, theirs, winner", [
    (1, {"x": 1}, "h"),  # a tie of one against one: the smaller hash wins ("h" < "x")
    (1, {"a": 1}, "a"),  # the same tie, won by the other side
    (1, {"x": 2}, "x"),
    (3, {"x": 2}, "h"),
])
def test_majority_elsewhere_counts_us_and_breaks_ties_by_the_smallest_hash(ours, theirs, winner):
    records = [record(f"same{i}", 5, "h") for i in range(ours - 1)]
    records += [record(f"{digest}{i}", 5, digest) for digest, count in theirs.items() for i in range(count)]
    records.append(record("other-step", 7, "z"))  # another step never votes at ours
    got = decisions.majority_elsewhere(view(*records), me())
    assert got == (None if winner == "h" else winner)


def test_outpaced_needs_a_quorum_of_our_step_and_params_averaging():
    averaging = [record(f"p{i}", 5, "h", phase="averaging") for i in range(2)]
    training = [record(f"t{i}", 5, "h") for i in range(3)]
    strangers = [record("q", 5, "other", phase="averaging"), record("r", 6, "h", phase="averaging")]
    # 5 peers with us at (5, h): quorum 2/3 of 6 is 4, i.e. 3 others; 2 are averaging.
    assert not decisions.outpaced(view(*averaging, *training, *strangers), me(), quorum=2 / 3)
    assert decisions.outpaced(view(*averaging, *training[:1], *strangers), me(), quorum=2 / 3)  # 2 of 3 others
    assert not decisions.outpaced(view(*strangers), me(), quorum=2 / 3)  # nobody at our step and hash
    # Rounded up: quorum 0.5 of 4 (us + 3) is 2, i.e. one other is enough.
    assert decisions.outpaced(view(averaging[0], *training[:2]), me(), quorum=0.5)


def test_a_round_is_open_once_another_peer_averages_at_our_step_with_our_params():
    assert decisions.round_opened(view(record("a", 5, "h", phase="averaging"), record("b", 5, "h")), me())
    strangers = [record("q", 5, "other", phase="averaging"), record("r", 6, "h", phase="averaging"),
                 record("s", 4, "h", phase="averaging"), record("t", 5, "h", phase="catching_up")]
    assert not decisions.round_opened(view(*strangers), me())
    assert not decisions.round_opened(view(record(ME, 5, "h", phase="averaging")), me())  # our own record


def test_join_by_leaves_the_rest_of_the_first_averagers_deadline_for_our_join():
    # Seen open at t=100 with a 30 s matchmaking timeout and 5 s heartbeats: the round may have
    # opened up to a heartbeat earlier, so cut at 100 + 15 - 5, well before 100 - 5 + 30.
    assert decisions.join_by(100.0, 30.0, 5.0) == pytest.approx(110.0)
    assert decisions.join_by(100.0, 30.0, 5.0) < 100.0 - 5.0 + 30.0
    assert decisions.join_by(100.0, 4.0, 5.0) == 100.0  # a heartbeat longer than half the timeout: at once


def test_expected_peers_are_those_at_our_step_with_our_params():
    v = view(record("a", 5, "h"), record("b", 5, "x"), record("c", 4, "h"))
    assert decisions.expected_peers(v, me()) == {"a", ME}


def test_the_plan_of_our_state_is_what_the_peers_at_our_step_and_hash_publish():
    from dataclasses import replace

    planned = [replace(record(p, 5, "h"), plan_peers=28) for p in "abc"]
    v = view(*planned, replace(record("d", 5, "h"), plan_peers=0),  # downloaded its state: says nothing
             replace(record("e", 5, "x"), plan_peers=33), replace(record("f", 4, "h"), plan_peers=40))
    assert decisions.plan_of_state(v, me()) == 28  # other hashes and steps come from other plans
    assert decisions.plan_of_state(view(record("a", 5, "h")), me()) == 0
    # The members of one plan agree; should two numbers ever show, the commoner one wins.
    odd = view(*planned, replace(record("g", 5, "h"), plan_peers=29))
    assert decisions.plan_of_state(odd, me()) == 28
    # Our own record is not a witness: our last plan is passed to the matchmaker directly.
    assert decisions.plan_of_state(view(replace(record(ME, 5, "h"), plan_peers=30)), me()) == 0


def test_a_peer_record_carries_its_plan_size_and_tolerates_its_absence_or_garbage():
    from dataclasses import replace

    rec = replace(record("a", 5, "h"), plan_peers=28)
    assert PeerRecord.parse("a", rec.to_value()) == rec
    old = rec.to_value()
    del old["plan_peers"]
    assert PeerRecord.parse("a", old).plan_peers == 0  # a record without it: no plan known
    assert PeerRecord.parse("a", {**old, "plan_peers": -3}).plan_peers == 0
    assert PeerRecord.parse("a", {**old, "plan_peers": "many"}) is None  # malformed: left out of the view


def test_solo_step_only_when_nobody_else_is_in_the_swarm():
    assert decisions.solo_step_allowed(view(), me())
    assert not decisions.solo_step_allowed(view(record("a", 0, "y")), me())  # even a peer far behind


def test_catch_up_downloads_the_newest_step_with_its_majority_hash_from_serving_peers():
    v = view(record("a", 7, "x"), record("b", 7, "x"), record("c", 7, "y"), record("d", 7, "x", address=""),
             record("e", 6, "x"))
    plan = decisions.catch_up_target(v, me())
    assert plan is not None and not plan.because_minority
    assert (plan.step, plan.params_hash) == (7, "x")
    assert sorted(p.peer_id for p in plan.donors) == ["a", "b"]  # d is a client: it serves nothing


def test_catch_up_at_our_step_only_in_a_minority():
    assert decisions.catch_up_target(view(record("a", 5, "h"), record("b", 5, "x")), me()) is None  # tie: ours wins
    plan = decisions.catch_up_target(view(record("a", 5, "x"), record("b", 5, "x")), me())
    assert plan is not None and plan.because_minority and plan.params_hash == "x"
    assert decisions.catch_up_target(view(record("a", 3, "x")), me()) is None  # nobody ahead


def test_catch_up_in_gossip_mode_only_beyond_the_step_window():
    assert decisions.catch_up_target(view(record("a", 9, "x")), me(), gossip_window=4) is None
    plan = decisions.catch_up_target(view(record("a", 10, "x")), me(), gossip_window=4)
    assert plan is not None and plan.step == 10
    # At our own step in gossip mode, other params are normal: no download.
    assert decisions.catch_up_target(view(record("a", 5, "x"), record("b", 5, "x")), me(), gossip_window=4) is None


def test_direct_round_only_when_every_live_peer_was_in_the_last_group():
    last = {ME, "a", "b"}
    assert decisions.direct_round_allowed(view(record("a", 5, "h"), record("b", 5, "h")), me(), last)
    assert decisions.direct_round_allowed(view(record("a", 5, "h")), me(), last)  # one left: fine
    # A joiner one step behind (still catching up) or at another hash: the DHT round lets it in.
    assert not decisions.direct_round_allowed(view(record("a", 5, "h"), record("c", 4, "x")), me(), last)


def test_no_donor_no_download():
    assert decisions.catch_up_target(view(record("a", 8, "x", address="")), me()) is None


def test_faults_are_parsed_once_and_a_typo_fails_loudly():
    from lowcomm.node.errors import FatalError
    from lowcomm.node.faults import Faults

    assert Faults.from_env({}) == Faults()
    faults = Faults.from_env({"LOWCOMM_FAULT_HOLD_ROUND": "2", "LOWCOMM_FAULT_SLOW_STEP": "0.2", "OTHER": "x"})
    assert (faults.hold_round, faults.slow_step, faults.nan_round) == (2, 0.2, None)
    with pytest.raises(FatalError, match="LOWCOMM_FAULT_HOLD_RUOND"):  # one line from the CLI
        Faults.from_env({"LOWCOMM_FAULT_HOLD_RUOND": "2"})
    with pytest.raises(FatalError, match="not a number"):
        Faults.from_env({"LOWCOMM_FAULT_NAN_ROUND": "two"})


def test_fragments_cover_the_parameters_in_turn_and_phases_shrink_with_them():
    assert decisions.fragment(10, 1, 7) == slice(0, 10)
    slices = [decisions.fragment(10, 3, step) for step in range(4)]
    assert slices == [slice(0, 3), slice(3, 6), slice(6, 10), slice(0, 3)]  # contiguous, all covered, cyclic
    assert (decisions.phase_steps(50, 1), decisions.phase_steps(50, 4), decisions.phase_steps(2, 8)) == (50, 12, 1)


def test_a_direct_follower_starts_from_the_heartbeats_view_only_while_it_shows_nobody_outside_the_group():
    """node/averaging.py: the round start of a follower of a stable group's direct path skips the
    table read only while the heartbeat's view has no peer outside the last group; in a split
    step (other groups' peers live) the step coordinator waits for the expected peers of a fresh
    view, and a view from before the last commit would leave most of them out."""
    from types import SimpleNamespace

    from lowcomm.node.averaging import Averager
    from lowcomm.protocol._pb.lowcomm.v1 import averaging_pb2

    last = averaging_pb2.Group(step=4, members=[averaging_pb2.Member(peer_id=p, address=f"{p}:1") for p in ("a", ME)])
    averager = object.__new__(Averager)  # only the two collaborators this decision reads
    seen: list[SwarmView | None] = []
    averager.swarm = SimpleNamespace(recent_view=lambda: seen[-1], position=me)
    averager.matchmaker = SimpleNamespace(last_group=last, follows_directly=lambda step: step == 5)

    stable = view(record("a", 4, "g"))  # read before "a" committed step 4: still fine for a follower
    seen.append(stable)
    assert averager._direct_follower_view(5) is stable
    assert averager._direct_follower_view(6) is None  # not a follower at that step: read
    seen.append(view(record("a", 5, "h"), record("c", 5, "h")))  # another group's peer is live
    assert averager._direct_follower_view(5) is None
    seen.append(None)  # the last beat's marks say the view may be stale for `behind`
    assert averager._direct_follower_view(5) is None
    averager.matchmaker.last_group = None
    seen.append(stable)
    assert averager._direct_follower_view(5) is None


def test_the_declared_bandwidth_is_the_median_of_the_timed_uplinks_and_a_ring_round_adds_nothing():
    from lowcomm.node.decisions import BANDWIDTH_SAMPLES, bandwidth_sample, declared_bandwidth

    assert bandwidth_sample(12e6, ring=False, bytes_sent=1_000_000, seconds=1.0) == 12e6
    assert bandwidth_sample(0.0, ring=True, bytes_sent=1_000_000, seconds=1.0) is None
    # Owners that time nothing (an older version): bytes over the round.
    assert bandwidth_sample(0.0, ring=False, bytes_sent=3_000_000, seconds=2.0) == 1.5e6
    assert bandwidth_sample(0.0, ring=False, bytes_sent=0, seconds=2.0) is None
    assert declared_bandwidth([]) == 0.0
    # One round timed far too fast does not move what the peer declares.
    assert declared_bandwidth([6e6, 6.2e6, 23e6, 5.9e6]) == pytest.approx(6.1e6)
    assert declared_bandwidth([99e6] * 10 + [1e6] * BANDWIDTH_SAMPLES) == 1e6  # only the last few count
