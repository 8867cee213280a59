"""Client-mode peers (no inbound connections) average through the streams they open."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.multiprocess


def test_client_mode_peers_average_with_one_reachable_peer(swarm):
    reachable = swarm.start(0)
    clients = [swarm.start(i, [reachable.multiaddr], extra=["--client-mode"]) for i in (1, 2)]
    for client in clients:
        ready = client.ready()
        assert ready["grpc_address"] == ""  # publishes no address: owns no shard, serves no state

    # A round of all three: the reachable peer owns the only shard; the clients send and receive.
    done = clients[0].wait_for(lambda e: e.get("event") == "round_done" and e["group_size"] == 3, 300)
    step = done["outer_step"]
    for node in (reachable, clients[1]):
        other = node.wait_for(lambda e: e.get("event") == "round_done" and e["outer_step"] == step, 120)
        assert other["params_sha256"] == done["params_sha256"]
    assert done["bytes_sent"] > 0 and done["bytes_received"] > 0
