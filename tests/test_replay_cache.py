"""protocol/auth.py ReplayCache: bounded, and a nonce forgotten early can still not be replayed."""

from __future__ import annotations

import random

from lowcomm.protocol.auth import RunAuth, ReplayCache


def test_a_full_cache_stays_bounded_and_never_accepts_a_forgotten_nonce() -> None:
    cache = ReplayCache(max_entries=10)
    rng = random.Random(0)
    accepted: list[tuple[str, float]] = []
    for i in range(1000):  # peers' clocks differ a little: expiries slightly out of order
        expires = 100.0 + i * 0.01 + rng.uniform(-0.02, 0.02)
        if cache.add(f"n{i}", expires, now=0.0):
            accepted.append((f"n{i}", expires))
        assert len(cache) <= 10
    assert len(accepted) > 700  # under overload most genuine tokens still get through
    # Every nonce accepted so far, forgotten or not, is refused when it comes back.
    assert not any(cache.add(nonce, expires, now=0.0) for nonce, expires in accepted)
    assert len(cache) <= 10


def test_forgetting_early_raises_the_floor_only_under_overload() -> None:
    cache = ReplayCache(max_entries=3)
    for i in range(3):
        assert cache.add(f"n{i}", 10.0 + i, now=0.0)
    assert cache.floor == -float("inf")  # not full yet: nothing refused beyond real replays
    assert cache.add("n3", 20.0, now=0.0)  # full: n0 (expires 10) is forgotten early
    assert cache.floor == 10.0 and len(cache) == 3
    assert not cache.add("n0", 10.0, now=0.0)  # its replay is refused all the same
    assert cache.add("late", 10.5, now=0.0)  # a token expiring after the floor still passes
    # Once the clock has passed the floor the cache empties by itself and nothing is refused.
    assert cache.add("fresh", 100.0, now=50.0) and len(cache) == 1


def test_run_auth_refuses_the_replay_of_a_token_its_full_cache_forgot() -> None:
    now = [1000.0]
    auth = RunAuth(b"s" * 32, clock=lambda: now[0], replay_cache=ReplayCache(max_entries=2))
    first = auth.mint("/lowcomm.v1.StateTransfer/GetStateInfo", "peer-a", 1)
    auth.verify(first, "/lowcomm.v1.StateTransfer/GetStateInfo")
    for _ in range(3):
        now[0] += 0.001
        auth.verify(auth.mint("/lowcomm.v1.StateTransfer/GetStateInfo", "peer-a", 1),
                    "/lowcomm.v1.StateTransfer/GetStateInfo")
    assert len(auth.replays) == 2
    try:
        auth.verify(first, "/lowcomm.v1.StateTransfer/GetStateInfo")
    except Exception as err:
        assert "replayed" in str(err)
    else:
        raise AssertionError("a token forgotten by the full replay cache was accepted again")
