"""DES-LOC and MT-DAO through the real CLI: three peers average parameters every round and the
optimizer state on its own period; every peer commits one params hash per step and loads the
same synced state (its sha256 in the state_synced event), and the eval loss goes down. A peer
that joins later downloads the synced optimizer state with the swarm's snapshot."""

from __future__ import annotations

import pytest

from lowcomm.protocol.state import state_bytes

from .test_swarm_cli import ROUND_WAIT, hash_at

pytestmark = pytest.mark.multiprocess

ROUNDS = 3  # rounds in which all three peers averaged and synced


# make test-slow (make test stays under 15 min): the sync arithmetic is tested without sockets in
# test_state_sync.py, and the joiner's test below runs a state-syncing swarm in make test.
@pytest.mark.slow
@pytest.mark.parametrize("method, first_moment", [("desloc", "exp_avg"), ("mtdao", "exp_avg_slow")])
def test_method_syncs_its_states_and_trains(swarm, method, first_moment):
    # The method's optimizer with short periods (its default periods are unit-tested in
    # test_state_sync.py): the first moment every round, the second every other one.
    extra = ["--set", f"sync.method={method}", "--set", f"sync.state_sync={{{first_moment}=1,exp_avg_sq=2}}",
             "--set", "train.inner_steps=10"]
    first = swarm.start(0, extra=extra)
    initial_eval = first.ready()["eval_loss"]
    nodes = [first, *(swarm.start(i, [first.multiaddr], extra=extra) for i in (1, 2))]

    def by_step(kind: str) -> dict[int, list[dict]]:
        """Events of ``kind`` of rounds all three peers were in, by the step they produced."""
        out: dict[int, list[dict]] = {}
        for node in nodes:
            for event in node.events:
                if event.get("event") == kind and event.get("group_size", 3) == 3:
                    out.setdefault(event["outer_step"], []).append(event)
        return out

    # The first peer trains alone (its own outer steps) until the others are in: count from then.
    first.wait_for(lambda _e: sum(len(v) == 3 for v in by_step("round_done").values()) >= ROUNDS, ROUND_WAIT * 3)
    rounds, synced = by_step("round_done"), by_step("state_synced")
    full = sorted(step for step, events in rounds.items() if len(events) == 3)[:ROUNDS]
    for step in full:
        assert len({e["params_sha256"] for e in rounds[step]}) == 1, f"peers disagree at step {step}"
        events = synced[step]
        assert len(events) == 3, events
        expected = sorted([first_moment, "exp_avg_sq"]) if step % 2 == 0 else [first_moment]
        assert all(e["states"] == expected and e["skipped_shards"] == 0 for e in events), events
        # Every member loaded the same bytes: the synced state is bit-identical.
        assert len({tuple(sorted(e["state_sha256"].items())) for e in events}) == 1, f"states differ at {step}"
    assert any(step % 2 == 0 for step in full)  # the second moment was synced too
    # A state round (bf16, 2 bytes a value) costs more than the int8 Δ round (wire about 1.4× its
    # payload) on top of it: its bytes are in the round's report.
    assert all(e["bytes_sent"] > 2 * e["payload_bytes"] for step in full for e in rounds[step])
    assert rounds[full[-1]][0]["eval_loss"] < initial_eval


# make test-slow as well (make test stays under 15 min): tests/test_state_sync.py and
# tests/test_state_serve.py check the synced states and what a donor serves without sockets.
@pytest.mark.slow
def test_a_joiner_receives_the_synced_optimizer_state_and_averages_the_next_round(swarm):
    """Two DES-LOC peers sync both moments every round; a third joins, downloads the snapshot
    (format 2: θ_global, the outer momentum and its donor's AdamW state) and then holds exactly the
    moments the group averaged at that step; its next round is a bit-identical member's."""
    extra = ["--set", "sync.method=desloc", "--set", "sync.state_sync={exp_avg=1,exp_avg_sq=1}",
             "--set", "train.inner_steps=10"]
    first = swarm.start(0, extra=extra)
    second = swarm.start(1, [first.multiaddr], extra=extra)

    def synced_at(node, step: int) -> dict:
        event = node.wait_for(lambda e: e.get("event") == "state_synced" and e["outer_step"] == step, ROUND_WAIT)
        assert event["skipped_shards"] == 0, f"{node.name}: a shard of the state round of step {step} was skipped"
        return event["state_sha256"]

    paired = second.wait_for(lambda e: e.get("event") == "round_done" and e["group_size"] == 2
                             and sum(r["group_size"] == 2 for r in second.rounds()) >= 2, ROUND_WAIT * 3)
    joiner = swarm.start(2, [first.multiaddr], extra=extra)
    downloaded = joiner.wait_event("state_downloaded", ROUND_WAIT * 2)
    step = downloaded["outer_step"]
    assert step >= paired["outer_step"]
    # The moments the group averaged at that step, bit for bit (and the donors agree on them).
    assert set(downloaded["state_sha256"]) == {"exp_avg", "exp_avg_sq"}
    assert synced_at(first, step) == synced_at(second, step) == downloaded["state_sha256"]
    assert downloaded["optimizer_step"] > 0
    # θ_global, the outer momentum and the two AdamW moments: 4 float32 values per parameter.
    numel = paired["numel"]
    assert downloaded["bytes_downloaded"] == state_bytes(numel, ("exp_avg", "exp_avg_sq")) > 16 * numel

    joined = joiner.wait_for(lambda e: e.get("event") == "round_done" and e["group_size"] == 3, ROUND_WAIT * 2)
    after = joined["outer_step"]
    assert {hash_at(node, after) for node in (first, second)} == {joined["params_sha256"]}
    assert synced_at(joiner, after) == synced_at(first, after) == synced_at(second, after)
