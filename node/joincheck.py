"""Before its first inner phase, a joiner refuses to train beside a swarm it can never take part in.

Pointed at a swarm whose calls it cannot make, a node used to train on alone, of no use to
anyone, with a warning every few seconds (or none): a node without TLS next to a TLS swarm
("Socket closed" from every donor), a TLS node that does not trust the swarm's certificate, a node
with a run secret next to an open run (whose unsigned records it ignores). Each check here gives
the one line that ends the node and says which flag to change; node/catchup.py calls them once,
when the node joins. The peers' records say what they serve (PeerRecord ``tls``); only the
certificate needs a call to find out.
"""

from __future__ import annotations

import grpc

from ..protocol._pb.lowcomm.v1 import handshake_pb2, state_pb2, state_pb2_grpc
from ..protocol.rpc import ChannelPool
from .swarm import PeerRecord, SwarmView

# Peers whose certificates are tried before a joiner concludes that it trusts none: one peer
# with a certificate of its own must not end the node.
CERTIFICATE_PROBES = 3
UNTRUSTED = "CERTIFICATE_VERIFY_FAILED"  # in the details of a call whose TLS handshake failed so


def _others(view: SwarmView, me: str) -> list[PeerRecord]:
    """The peers this node averages with that serve calls (client-mode peers serve none) and have
    passed their own start: a joiner refused a moment ago leaves its record ("starting") in the
    DHT for a few heartbeats, and is no evidence of what the swarm serves."""
    return [p for p in sorted(view.peers.values(), key=lambda p: p.peer_id)
            if p.peer_id != me and p.address and p.phase != "starting"]


def transport_mismatch(view: SwarmView, me: str, tls: bool) -> str | None:
    """Why this node cannot call the swarm's peers when all of them serve the other kind of
    gRPC (TLS or plaintext); None when one of them serves ours, or nobody is there."""
    others = _others(view, me)
    if not others or any(p.tls == tls for p in others):
        return None
    if tls:
        return (f"the {len(others)} peer(s) of this run in sight serve plaintext gRPC and this node TLS: start it "
                f"without --tls-cert and --tls-key (LOWCOMM_TLS_CERT, LOWCOMM_TLS_KEY), as they run")
    return (f"the {len(others)} peer(s) of this run in sight serve gRPC over TLS and this node plaintext: start it "
            f"with the run's certificate and key (--tls-cert, --tls-key), as they run")


def open_run_peer(view: SwarmView, me: str, fingerprint: str) -> PeerRecord | None:
    """A peer of an open run with our run config, when this node (with a run secret) sees no
    peer of its own run: it would train alone beside the swarm it was pointed at."""
    if view.peers.keys() - {me}:
        return None
    for peer_id in sorted(view.open_run - {me}):
        record = view.foreign[peer_id]
        if record.config_fingerprint == fingerprint:
            return record
    return None


def open_run_message(peer: PeerRecord, run: str) -> str:
    return (f"peer {peer.peer_id} and the other peers of run {run!r} in the DHT run without a run secret (their "
            f"records are unsigned), and no peer of this node's secret run is in sight: to join them, start this "
            f"node without --run-secret-file; to start a swarm of your own with the secret, give it another "
            f"[run] name")


async def untrusted_certificate(view: SwarmView, me: str, channels: ChannelPool,
                                hello: handshake_pb2.Hello) -> str | None:
    """Why this TLS node trusts none of the swarm's certificates: the TLS handshakes with the
    first few TLS peers it could reach all failed to verify. None when one of them is trusted
    (its server answered), or none could be reached."""
    reason = None
    for peer in [p for p in _others(view, me) if p.tls][:CERTIFICATE_PROBES]:
        stub = state_pb2_grpc.StateTransferStub(channels(peer.address))
        try:
            await stub.GetStateInfo(state_pb2.StateInfoRequest(hello=hello), timeout=10)
        except grpc.aio.AioRpcError as err:
            details = err.details() or ""
            if UNTRUSTED in details:
                reason = reason or (f"the TLS certificate of peer {peer.peer_id} at {peer.address} is not trusted "
                                    f"({details.split('SSL routines:OPENSSL_internal:')[-1].removesuffix(': OK')})")
                continue
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                continue  # gone, or not reachable from here: no evidence either way
            return None  # its server answered (a refusal, say): the handshake, and so its certificate, passed
        return None
    if reason is None:
        return None
    return (f"{reason}, nor any other peer's this node tried: give the run's certificate (or the CA that signed "
            f"the peers' certificates, appended to this node's) in --tls-cert")
