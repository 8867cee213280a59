"""Dial-back reachability checks (protocol/reachability.py, node/reachability.py), in-process on
loopback: a peer dials only the host a call came from, and a node says what its peers answered."""

from __future__ import annotations

import asyncio
import logging
import math
import socket

import grpc
import pytest
from grpc_health.v1 import health

from lowcomm.node.reachability import ReachabilityCheck
from lowcomm.node.swarm import PeerRecord, SwarmView
from lowcomm.protocol.reachability import DialBackBusy, DialBacker, ask_dial_back, host_of_peer, split_address
from lowcomm.protocol.rpc import NodeInfoServicer, create_server


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def no_status():
    raise AssertionError("not asked")


async def serve(dial_backer: DialBacker | None = None) -> tuple[grpc.aio.Server, str]:
    server, port = create_server("127.0.0.1", 0, None, None, NodeInfoServicer(no_status, dial_backer),
                                 health.aio.HealthServicer())
    await server.start()
    return server, f"127.0.0.1:{port}"


def record(peer_id: str, address: str) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, address=address, outer_step=0, params_sha256="", bandwidth_bps=0.0,
                      tokens_per_second=0.0, protocol_version=0, config_fingerprint="", phase="training")


def view_of(*records: PeerRecord) -> SwarmView:
    return SwarmView(peers={r.peer_id: r for r in records}, foreign={}, taken_at=0.0)


def test_the_callers_host_is_read_from_grpcs_peer_string():
    assert host_of_peer("ipv4:10.0.0.2:5000") == "10.0.0.2"
    assert host_of_peer("ipv6:[::1]:5000") == "::1"
    assert host_of_peer("ipv6:[fe80::1%25eth0]:5000") == "fe80::1%eth0"
    assert host_of_peer("unix:/tmp/sock") == ""
    assert split_address("[::1]:7701") == ("::1", 7701)
    with pytest.raises(ValueError, match="is not host:port"):
        split_address("10.0.0.2")


def test_a_caller_is_dialled_back_at_its_own_host_only():
    async def main():
        server, address = await serve()
        try:
            backer = DialBacker(timeout=5.0)
            reached = await backer.dial_back(address, "ipv4:127.0.0.1:40000")
            assert (reached.checked, reached.reachable, reached.error, reached.observed_host) == (
                True, True, "", "127.0.0.1")
            named = await backer.dial_back(f"localhost:{address.rpartition(':')[2]}", "ipv4:127.0.0.1:40000")
            assert (named.checked, named.reachable) == (True, True)  # a name that resolves to the caller
            closed = await backer.dial_back(f"127.0.0.1:{closed_port()}", "ipv4:127.0.0.1:40000")
            assert (closed.checked, closed.reachable) == (True, False)
            assert closed.error.startswith("UNAVAILABLE")
            # Another host than the call's: no dial at all (no probing of third machines).
            elsewhere = await backer.dial_back("192.0.2.9:7701", "ipv4:127.0.0.1:40000")
            assert (elsewhere.checked, elsewhere.reachable) == (False, False)
            assert elsewhere.error == "the address's host 192.0.2.9 is not 127.0.0.1, the host the call came from"
            garbage = await backer.dial_back("no port", "ipv4:127.0.0.1:40000")
            assert not garbage.checked and "is not host:port" in garbage.error
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_one_dial_back_at_a_time_and_the_rpc_says_busy():
    async def main():
        backer = DialBacker(timeout=5.0)
        server, address = await serve(backer)
        try:
            async with backer._busy:  # as while dialling another caller
                with pytest.raises(DialBackBusy):
                    await backer.dial_back(address, "ipv4:127.0.0.1:40000")
                async with grpc.aio.insecure_channel(address) as channel:
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await ask_dial_back(channel, address, timeout=10)
                    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            async with grpc.aio.insecure_channel(address) as channel:  # over the RPC: the call's own host
                reply = await ask_dial_back(channel, address, timeout=10)
            assert (reply.checked, reply.reachable, reply.observed_host) == (True, True, "127.0.0.1")
        finally:
            await server.stop(None)

    asyncio.run(main())


def run_check(view_calls, our_address: str = "") -> tuple[object, list[float]]:
    """Run a ReachabilityCheck whose swarm view is ``view_calls(peer's address)``; ours is
    ``our_address``, else a server of its own that answers health checks."""
    async def main():
        peer_server, peer_address = await serve()
        own_server, own_address = await serve()
        channels: list[grpc.aio.Channel] = []

        def channel(target: str) -> grpc.aio.Channel:
            channels.append(grpc.aio.insecure_channel(target))
            return channels[-1]

        gauge: list[float] = []
        try:
            check = ReachabilityCheck("me", our_address or own_address, view_calls(peer_address), channel,
                                      gauge.append, retry_seconds=0.01)
            return await asyncio.wait_for(check.run(), timeout=60), gauge
        finally:
            for ch in channels:
                await ch.close()
            await peer_server.stop(None)
            await own_server.stop(None)

    return asyncio.run(main())


def test_a_node_that_peers_reach_says_so_once(caplog):
    caplog.set_level(logging.INFO, logger="lowcomm.node")
    answers, gauge = run_check(lambda peer: lambda: view_of(record("me", "x"), record("peer", peer)))
    assert answers.reached_by == ["peer"] and gauge == [1.0] and answers.why_unreachable("x:1") == ""
    events = [r for r in caplog.records if getattr(r, "event", "") == "reachable"]
    assert len(events) == 1 and "peer dialled it back" in events[0].getMessage()


def test_a_node_that_peers_cannot_reach_is_told_the_address_and_the_fixes(caplog):
    # A two-namespace audit: behind a firewall a joiner trained once a minute with no warning.
    ours = f"127.0.0.1:{closed_port()}"
    answers, gauge = run_check(lambda peer: lambda: view_of(record("peer", peer)), ours)
    assert answers.failed and not answers.reached_by and gauge == [0.0]
    assert answers.why_unreachable(ours).startswith(f"{ours}: peer could not connect (UNAVAILABLE")
    (warning,) = [r for r in caplog.records if getattr(r, "event", "") == "unreachable"]
    message = warning.getMessage()
    assert warning.levelno == logging.WARNING
    assert f"peers cannot reach this node's gRPC server at {ours} (peer could not: UNAVAILABLE" in message
    for fix in (f"accept inbound TCP connections on port {ours.rpartition(':')[2]}", "--announce-host",
                "sees its calls come from 127.0.0.1", "--client-mode"):
        assert fix in message


def test_the_first_peer_asks_once_another_peer_arrives_and_skips_peers_that_do_not_answer():
    views = []

    def growing(peer):
        def view():  # first alone, then a peer that is away, then one that answers
            views.append(len(views))
            if len(views) == 1:
                return view_of(record("me", "x"))
            if len(views) == 2:
                return view_of(record("away", f"127.0.0.1:{closed_port()}"))
            return view_of(record("away", f"127.0.0.1:{closed_port()}"), record("peer", peer))
        return view

    answers, gauge = run_check(growing)
    assert answers.reached_by == ["peer"] and gauge == [1.0] and len(views) == 3


def test_an_announced_host_that_is_not_ours_is_pointed_out_and_asked_again(caplog):
    calls = []

    def view_then_checkable(peer):
        def view():
            calls.append(1)
            return view_of(record("peer", peer))
        return view

    async def main():
        server, address = await serve()
        port = address.rpartition(":")[2]
        opened: list[grpc.aio.Channel] = []

        def channel(target):
            opened.append(grpc.aio.insecure_channel(target))
            return opened[-1]

        check = ReachabilityCheck("me", f"192.0.2.9:{port}", view_then_checkable(address), channel, lambda v: None,
                                  retry_seconds=0.01)
        try:
            first = await check.ask_some()
            assert not first.done and first.unchecked == {
                "peer": "the address's host 192.0.2.9 is not 127.0.0.1, the host the call came from"}
            check._say_unchecked(first)
        finally:
            for ch in opened:
                await ch.close()
            await server.stop(None)

    caplog.set_level(logging.INFO, logger="lowcomm.node")
    asyncio.run(main())
    (warning,) = [r for r in caplog.records if getattr(r, "event", "") == "reachability_unchecked"]
    assert "correct --announce-host" in warning.getMessage() and "192.0.2.9" in warning.getMessage()


def test_the_gauge_is_unknown_until_a_peer_answered():
    from lowcomm.node.metrics import NodeMetrics

    assert math.isnan(NodeMetrics().grpc_reachable._value.get())


@pytest.mark.multiprocess
@pytest.mark.slow  # three CLI nodes, about 30 s: make test-slow
def test_through_the_cli_nodes_check_each_other_and_a_wrong_announce_host_is_pointed_out(swarm):
    first = swarm.start(0)
    second = swarm.start(1, [first.multiaddr])
    ids = {node.ready()["peer_id"]: node for node in (first, second)}
    for node in (first, second):  # each asks the other, who dials it back
        reached = node.wait_for(lambda e: e.get("event") == "reachable", 120)
        assert reached["address"] == node.ready()["grpc_address"]
        assert [ids[peer] for peer in reached["reached_by"]] == [second if node is first else first]
    # 127.0.0.2 is on loopback too, but the node listens on 127.0.0.1 and calls from there: as a
    # node that announces an address of another machine. (The others cannot ask it anything.)
    stray = swarm.start(2, [first.multiaddr], extra=["--announce-host", "127.0.0.2"])
    unchecked = stray.wait_for(lambda e: e.get("event") == "reachability_unchecked", 120)
    assert unchecked["address"].startswith("127.0.0.2:") and set(unchecked["observed"].values()) == {"127.0.0.1"}
    assert set(unchecked["observed"]) <= set(ids) and "correct --announce-host" in unchecked["msg"]
