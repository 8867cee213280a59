"""A network partition between two halves of a netns cluster, then healing.

During the partition each half keeps training with rounds of its own (nothing hangs past its
deadlines); after the partition heals the halves re-converge on one state through the majority
vote and state download. Needs root, `ip netns` and `tc`; skipped with the reason otherwise.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from .test_netns import assert_nothing_left, nc, netns_available, prefix  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.netns, pytest.mark.multiprocess, pytest.mark.slow]  # make test-slow

PEERS = 4
JOIN = ["--torch-threads", "1", "--set", "train.inner_steps=10", "--set", "train.batch_size=8",
        "--set", "sync.matchmaking_timeout=10", "--set", "sync.reduce_timeout=6",
        "--set", "node.heartbeat_interval=1", "--set", "sync.straggler_wait=1"]


def rounds(state, index):
    return [e for e in state.events(index) if e.get("event") == "round_done"]


def held(state, index) -> dict[int, str]:
    """The params hash peer ``index`` finally held for each step (round result or download)."""
    out = {}
    for event in state.events(index):
        if event.get("event") in ("round_done", "state_downloaded"):
            out[event["outer_step"]] = event["params_sha256"]
    return out


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)  # polls the peers' log files; the condition decides


def set_partition(state, halves, on: bool) -> None:
    """Blackhole routes inside every namespace to the other half's addresses (both directions)."""
    for half, other in (halves, halves[::-1]):
        for i in half:
            for j in other:
                action = "add" if on else "del"
                subprocess.run(["ip", "-n", state.peers[i].netns, "route", action, "blackhole",
                                f"{state.peers[j].ip}/32"], check=True, capture_output=True)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("prefix", ["ltpart"], indirect=True)
def test_partitioned_halves_keep_training_and_reconverge_after_healing(prefix, tmp_path):
    halves = ([0, 1], [2, 3])
    with nc.netns_cluster(PEERS, 50, prefix=prefix, state_dir=tmp_path / "state", join_args=JOIN,
                          ready_timeout=180) as state:
        wait_until(lambda: any(e["group_size"] == PEERS for e in rounds(state, 0)), 240, "a round of all four")

        set_partition(state, halves, on=True)
        marks = {i: len(rounds(state, i)) for i in range(PEERS)}
        # Each half goes on averaging within itself once the other half's DHT records expired.
        wait_until(lambda: all(any(e["group_size"] == 2 for e in rounds(state, i)[marks[i]:]) for i in range(PEERS)),
                   180, "rounds inside both halves")
        during = [e for i in range(PEERS) for e in rounds(state, i)[marks[i]:]]
        assert all(e["round_seconds"] < 10 + 6 * 1.5 + 15 for e in during)  # no round hung past its deadlines

        set_partition(state, halves, on=False)
        healed_at = {i: max(held(state, i), default=0) for i in range(PEERS)}

        def reconverged() -> bool:
            finals = [held(state, i) for i in range(PEERS)]
            common = set.intersection(*(set(f) for f in finals))
            return any(step > max(healed_at.values()) and len({f[step] for f in finals}) == 1 for step in common)

        wait_until(reconverged, 240, "one state on all four peers after healing")
        for i in range(PEERS):
            assert all(e["eval_loss"] == e["eval_loss"] for e in rounds(state, i)), "NaN eval loss"
    assert_nothing_left(prefix)
