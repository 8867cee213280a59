"""Overlapped outer steps (delayed / eager) and streaming fragments through the real CLI."""

from __future__ import annotations

import signal

import psutil
import pytest

from lowcomm.node.checkpoint import list_checkpoints

from .test_swarm_cli import ROUND_WAIT, hash_at

pytestmark = pytest.mark.multiprocess


TOKENS_PER_STEP = 4 * 128  # FAST: batch_size 4, the default seq_len 128
INNER_STEPS = 20  # FAST


# Two variants run in make test-slow (make test stays under 15 min): tests/test_driver.py covers
# fragments synced in turn and when a result applies, without sockets.
@pytest.mark.parametrize("overlap, fragments, apply", [
    pytest.param("delayed", 2, "arrival", marks=pytest.mark.slow), ("eager", 1, "arrival"),
    pytest.param("delayed", 1, "boundary", marks=pytest.mark.slow)])
def test_overlapped_rounds_stay_bit_identical(swarm, overlap, fragments, apply):
    extra = ["--set", f"sync.overlap={overlap}", "--set", f"sync.fragments={fragments}",
             "--set", f"sync.overlap_apply={apply}"]
    first = swarm.start(0, extra=extra)
    initial_eval = first.ready()["eval_loss"]
    nodes = [first, swarm.start(1, [first.multiaddr], extra=extra), swarm.start(2, [first.multiaddr], extra=extra)]

    def averaged_steps() -> dict[int, list[dict]]:
        """round_done events of rounds with more than one member, by the step they produced."""
        by_step: dict[int, list[dict]] = {}
        for node in nodes:
            for event in node.rounds():
                if event["group_size"] >= 2:
                    by_step.setdefault(event["outer_step"], []).append(event)
        return by_step

    first.wait_for(lambda _e: len(averaged_steps()) >= 4, ROUND_WAIT * 4)
    by_step = averaged_steps()
    for step, events in by_step.items():
        # Every member of a round applied the same average at the boundary: identical θ_global.
        assert len({e["params_sha256"] for e in events}) == 1, f"members disagree at step {step}"
        for event in events:
            start, stop = event["fragment"]
            assert stop - start == pytest.approx(event["numel"] / fragments, abs=1)
    if fragments > 1:  # the fragments take turns
        assert len({tuple(e["fragment"]) for events in by_step.values() for e in events}) == fragments
    # A round every H/K inner steps: a peer that was not cut short sends H/K steps' worth (a
    # peer's phase ends early when the round of its step already started elsewhere).
    averaged = [e["tokens_averaged"] for events in by_step.values() for e in events]
    assert INNER_STEPS // fragments * TOKENS_PER_STEP in averaged, averaged
    # A group that stays together meets on the direct path, where only its leader reads the
    # peers table at the round's start: its followers go to it without a read (and still agree;
    # a member that came through the DHT, outside the last group, reads like the leader).
    def direct_follower_steps() -> list[int]:
        """Steps whose members have all logged their round_done, one of them without a read."""
        return [step for step, events in averaged_steps().items()
                if len(events) == events[0]["group_size"] and any(not e["round_start_read"] for e in events)]

    first.wait_for(lambda _e: direct_follower_steps(), ROUND_WAIT * 4)
    for step in direct_follower_steps():
        events = averaged_steps()[step]
        assert len({e["params_sha256"] for e in events}) == 1, f"members disagree at step {step}"
        assert any(e["round_start_read"] for e in events), f"nobody read the table at step {step} (the leader does)"
    assert first.rounds()[-1]["eval_loss"] < initial_eval


# make test-slow (make test stays under 15 min); the overlapped shift is tested without sockets in
# test_driver.py
@pytest.mark.slow
def test_failed_background_round_costs_only_its_update_and_shutdown_is_clean(swarm):
    extra = ["--set", "sync.overlap=delayed"]
    first = swarm.start(0, extra=extra)
    # The second peer stalls inside its 2nd round: the first one's background round for that
    # step loses the stalled peer's shard and contribution, but the first peer trains on.
    second = swarm.start(1, [first.multiaddr], extra=extra, env={"LOWCOMM_FAULT_HOLD_ROUND": "2"})
    hold = second.wait_event("fault_hold", ROUND_WAIT * 2)
    step = hold["outer_step"]
    done = first.wait_for(lambda e: e.get("event") == "round_done" and e["outer_step"] == step + 1, ROUND_WAIT)
    assert done["skipped_shards"] >= 1 and done["eval_loss"] == done["eval_loss"]
    # The training thread had to wait for that late round, and said so.
    first.wait_event("round_late", ROUND_WAIT)
    # Later rounds fail (the stalled peer is still in the swarm), training goes on regardless.
    steps_before = sum(1 for e in first.events if e.get("event") == "round_late")
    first.wait_for(lambda e: sum(1 for x in first.events if x.get("event") == "round_late") > steps_before
                   or e.get("level") == "warning", ROUND_WAIT)

    # SIGTERM in the middle of a background round: exit 0 within the grace period, checkpoint
    # written, no child left.
    children = swarm.descendants(first)
    first.signal(signal.SIGTERM)
    assert first.wait_exit(timeout=10 + 15) == 0
    first.wait_event("node_stopped", 5)
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert list_checkpoints(swarm.workdir / "peer-0")


# make test-slow (make test stays under 15 min): tests/test_driver.py cuts a slower peer's phase without sockets.
@pytest.mark.slow
def test_overlapped_straggler_ends_its_phase_when_the_round_starts_and_averages(swarm):
    extra = ["--set", "sync.overlap=delayed"]
    first = swarm.start(0, extra=extra)
    fast = [first, swarm.start(1, [first.multiaddr], extra=extra)]
    # ~5x the inner-step time of the others on this machine (one tiny-model step takes ~50 ms).
    slow = swarm.start(2, [first.multiaddr], extra=extra, env={"LOWCOMM_FAULT_SLOW_STEP": "0.2"})
    slow.ready()
    # The straggler does not hold the others' background rounds up by a whole slow phase: it
    # ends its phase as soon as the round of its step started elsewhere and joins it with the
    # steps it did; all three then hold the same state.
    cut = slow.wait_event("inner_phase_cut", ROUND_WAIT * 2)
    assert 0 < cut["steps"] < INNER_STEPS
    joined = slow.wait_for(lambda e: e.get("event") == "round_done" and e["group_size"] == 3
                           and e["outer_step"] > cut["outer_step"], ROUND_WAIT * 2)
    assert joined["tokens_averaged"] > 0
    for node in fast:
        assert hash_at(node, joined["outer_step"]) == joined["params_sha256"]
