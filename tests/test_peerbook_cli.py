"""Through the real CLI: a first peer restarted without --peers finds its swarm through the
peers it remembered (node/peerbook.py), instead of training alone until a peer's DHT calls it."""

from __future__ import annotations

import signal

import pytest

from lowcomm.node.peerbook import book_path, load, peer_id_of

pytestmark = pytest.mark.multiprocess

ROUND_WAIT = 90  # one round on a loaded 2-core machine (deadlines 15 s + 8 s)


@pytest.mark.slow  # two CLI nodes, a stop and a restart, about a minute: make test-slow
def test_a_first_peer_restarted_without_peers_rejoins_through_the_peers_it_saw(swarm, tmp_path):
    debug = ["--log-level", "debug"]  # the peers_remembered event
    first = swarm.start(0, extra=debug)
    second = swarm.start(1, [first.multiaddr])
    second_id = second.ready()["peer_id"]
    first.wait_for(lambda e: e.get("event") == "round_done" and e["group_size"] == 2, ROUND_WAIT)
    first.wait_for(lambda e: e.get("event") == "peers_remembered" and second_id in e["peer_ids"], ROUND_WAIT)
    assert [peer_id_of(m) for m in load(book_path(tmp_path / "peer-0"))] == [second_id]

    first.signal(signal.SIGTERM)
    assert first.wait_exit(60) == 0

    # The same command again: no --peers, as the first peer of a swarm is started.
    again = swarm.start(0, extra=debug)
    joined = again.wait_event("joined_through_remembered_peers", 60)
    assert joined["peers"] == 1
    together = again.wait_for(lambda e: e.get("event") == "round_done" and e["group_size"] == 2, ROUND_WAIT * 2)
    other = second.wait_for(lambda e: e.get("event") in ("round_done", "state_downloaded")
                            and e.get("outer_step") == together["outer_step"], ROUND_WAIT)
    assert other["params_sha256"] == together["params_sha256"]
    # It never took a step alone: with the second peer in its DHT from the start it caught up.
    assert not [e for e in again.rounds() if e["group_size"] == 1]
