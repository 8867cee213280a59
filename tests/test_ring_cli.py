"""The ring schedule (``[sync] schedule = "ring"``, protocol/ring.py) through the real CLI: peers
average in a ring to the same bits, a killed member costs the survivors one skipped round and
no more, and a config that a ring cannot honour is a one-line error. ``schedule = "auto"``: a
butterfly until the members have measured their links, then a ring on equal links."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .test_cli_errors import assert_one_line_error, run_join
from .test_swarm_cli import ROUND_WAIT, hash_at

RING = ["--set", "sync.schedule=ring"]
FAULTS = Path(__file__).parent / "faultinject"


def ring_rounds(node, size):
    return [e for e in node.rounds() if e["group_size"] >= size and e.get("schedule") == "ring"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_three_peers_average_in_a_ring_and_a_member_killed_mid_ring_costs_one_skipped_round(swarm):
    first = swarm.start(0, extra=RING)
    first.ready()
    second = swarm.start(1, [first.multiaddr], extra=RING)
    path = os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH", "")) if p)
    # The third member dies (SIGKILL) in its second ring round of three, once the first running
    # sum from the member before it has arrived (tests/faultinject/sitecustomize.py).
    victim = swarm.start(2, [first.multiaddr], extra=RING, env={"LOWCOMM_FAULT_DIE_IN_RING": "2", "PYTHONPATH": path})
    victim.ready()

    event = second.wait_for(lambda e: e.get("event") == "round_done" and len(ring_rounds(second, 3)) >= 1,
                            ROUND_WAIT * 3)
    assert event["skipped_shards"] == 0
    assert hash_at(first, event["outer_step"]) == event["params_sha256"]
    # The victim's own round_done of that step may not be written before it dies (a report
    # thread logs it after the eval); where it is, it has the same hash.
    assert all(e["params_sha256"] == event["params_sha256"] for e in victim.rounds()
               if e["outer_step"] == event["outer_step"])

    died = victim.wait_event("fault_die_in_ring", ROUND_WAIT * 2)
    assert victim.wait_exit(timeout=30) != 0  # it really died, mid-round
    step = died["outer_step"]
    # The survivors' ring broke at once: both skip every shard alike (nothing lost: each keeps
    # its x in its residual), commit the same hash, and then average in a ring of two.
    broken = [n.wait_for(lambda e: e.get("event") == "round_done" and e["outer_step"] == step + 1, ROUND_WAIT)
              for n in (first, second)]
    assert broken[0]["params_sha256"] == broken[1]["params_sha256"]
    assert all(e["group_size"] == 3 and e["skipped_shards"] > 0 for e in broken), broken
    # Bounded by the shard exchange, which waits for the dead member's report until 1.5 reduce timeouts (12 s).
    assert all(e["allreduce_seconds"] < 1.5 * 8 + 3 for e in broken), broken
    pair = second.wait_for(lambda e: e.get("event") == "round_done" and e["group_size"] == 2
                           and e.get("schedule") == "ring" and e["skipped_shards"] == 0, ROUND_WAIT * 3)
    assert hash_at(first, pair["outer_step"]) == pair["params_sha256"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("extra,needle", [
    (["--set", "sync.aggregation=trimmed_mean"], "aggregation = \"mean\""),
    (["--set", "sync.codec=topk"], "sparse codec"),
])
def test_a_ring_config_it_cannot_honour_is_a_one_line_error(tmp_path, extra, needle):
    result = run_join(tmp_path, *RING, *extra)
    assert_one_line_error(result, "schedule = \"ring\"", needle)


@pytest.mark.multiprocess
def test_auto_measures_the_links_in_a_butterfly_then_runs_a_ring_on_equal_links(swarm):
    auto = ["--set", "sync.schedule=auto"]
    first = swarm.start(0, extra=auto)
    first.ready()
    second = swarm.start(1, [first.multiaddr], extra=auto)
    # Loopback links are equal: once both have declared a bandwidth, the leader picks the ring
    # (protocol/layout.py choose_schedule), except at every 10th step.
    ring = second.wait_for(lambda e: e.get("event") == "round_done" and e["group_size"] == 2
                           and e.get("schedule") == "ring", ROUND_WAIT * 3)
    assert hash_at(first, ring["outer_step"]) == ring["params_sha256"]
    pairs = [e for e in second.rounds() if e["group_size"] == 2]
    # The pair's first round: nobody had measured a link yet, so a butterfly, whose owners time
    # the uploads; after it, the bandwidth each declares.
    assert pairs[0]["schedule"] == "butterfly" and pairs[0]["bandwidth_bps"] > 0, pairs[0]
    assert 0 < ring["owned_share"] < 1
