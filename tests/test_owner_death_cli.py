"""A shard owner killed in the middle of its result stream, through the real CLI (DESIGN §4).

One member holds the owner's average, the other does not; both skip the shard alike (the shard
agreement of protocol/agreement.py), commit the same params hash at that step, and nobody
downloads state. The fault is injected inside the owner's result stream by
tests/faultinject/sitecustomize.py (LOWCOMM_FAULT_DIE_SERVING).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .test_swarm_cli import ROUND_WAIT, hash_at

# make test-slow (make test stays under 15 min): tests/test_allreduce_faults.py kills owners mid-round in
# process, without the CLI.
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

FAULTS = Path(__file__).parent / "faultinject"


def test_owner_killed_during_its_result_stream_costs_its_shard_on_every_member(swarm):
    first = swarm.start(0)
    second = swarm.start(1, [first.multiaddr])
    path = os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH", "")) if p)
    victim = swarm.start(2, [first.multiaddr], env={"LOWCOMM_FAULT_DIE_SERVING": "3", "PYTHONPATH": path})
    survivors = {first.ready()["peer_id"]: first, second.ready()["peer_id"]: second}

    died = victim.wait_event("fault_die_serving", ROUND_WAIT * 3)
    step = died["outer_step"]
    assert victim.wait_exit(timeout=30) != 0  # it really died (SIGKILL), mid-round
    holder = survivors[died["holder"]]  # the member that got the average before the owner died

    done = [n.wait_for(lambda e: e.get("event") == "round_done" and e["outer_step"] == step + 1, ROUND_WAIT)
            for n in survivors.values()]
    assert done[0]["params_sha256"] == done[1]["params_sha256"]
    assert all(e["group_size"] == 3 and e["skipped_shards"] == 1 for e in done), done
    # The holder had the average and skipped it anyway, because the other member lacked it.
    vetoed = holder.wait_event("shards_vetoed", 5)
    assert len(vetoed["shards"]) == 1
    # The swarm goes on from the same state, and nobody downloaded state to get there.
    nxt = first.wait_for(lambda e: e.get("event") == "round_done" and e["outer_step"] == step + 2, ROUND_WAIT)
    assert hash_at(second, step + 2) == nxt["params_sha256"]
    for node in survivors.values():
        assert not [e for e in node.events if e.get("event") == "state_downloaded" and e["outer_step"] > step], \
            node.name
