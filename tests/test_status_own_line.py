"""A node's status lists itself as it is now: its own line in the swarm table comes from its
live record, not from the copy its last heartbeat stored in the DHT (one heartbeat behind
after every round, so `lowcomm-node status` showed "step 0 (lag 1)" beside "step 1")."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

from lowcomm.node import cli
from lowcomm.node.config import load_config
from lowcomm.node.daemon import Node
from lowcomm.node.swarm import PeerRecord, SwarmView


def record(peer_id: str, step: int, digest: str) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, address=f"10.0.0.{len(peer_id)}:7701", outer_step=step, params_sha256=digest,
                      bandwidth_bps=1e8, tokens_per_second=100.0, protocol_version=1, config_fingerprint="f",
                      phase="training")


def node_after_its_first_round(link) -> SimpleNamespace:
    # The DHT still holds our record of step 0; the peer we averaged with has published step 1.
    view = SwarmView({"QmMe": record("QmMe", 0, "00" * 32), "QmOther": record("QmOther", 1, "11" * 32)}, {}, 0.0)
    return SimpleNamespace(
        view=view, link=link, peer_id="QmMe", state=SimpleNamespace(published=lambda: (1, "11" * 32)),
        stats=SimpleNamespace(last_loss=math.nan, last_eval=math.nan, tokens_total=10, phase="training",
                              rounds_completed=1, tokens_per_second=100.0, consensus_distance=0.0),
        multiaddrs=[], config=load_config(environ={}), _checkpoint_failure_fields=lambda: {}, unreachable="")


def test_the_nodes_own_line_shows_its_step_now_not_its_last_heartbeats(capsys) -> None:
    link = SimpleNamespace(record=lambda: record("QmMe", 1, "11" * 32))
    info = cli.status_dict(asyncio.run(Node.status(node_after_its_first_round(link))))
    steps = {peer["peer_id"]: (peer["outer_step"], peer["params_sha256"]) for peer in info["swarm"]}
    assert steps == {"QmMe": (1, "11" * 32), "QmOther": (1, "11" * 32)}
    assert info["swarm_peers"] == 2
    cli._print_status(info)
    assert [line for line in capsys.readouterr().out.splitlines() if "(lag" in line] == [
        "  QmMe  step     1 (lag 0)        100 tok/s  10.0.0.4:7701",
        "  QmOther  step     1 (lag 0)        100 tok/s  10.0.0.7:7701"]


def test_before_the_node_has_a_record_the_table_is_the_dhts() -> None:
    # Status is served while the state is being restored, before the node's link exists.
    info = cli.status_dict(asyncio.run(Node.status(node_after_its_first_round(None))))
    assert [(p["peer_id"], p["outer_step"]) for p in info["swarm"]] == [("QmMe", 0), ("QmOther", 1)]
