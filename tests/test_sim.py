"""The simulator (sim/): its virtual-time loop, its DHT and links, and that it drives the real
protocol classes, deterministically."""

from __future__ import annotations

import ast
import asyncio
import json
from pathlib import Path

import pytest

import lowcomm.node.decisions
import lowcomm.node.gossip_mode
import lowcomm.protocol.buckets
import lowcomm.protocol.election
import lowcomm.protocol.gossip
import lowcomm.protocol.layout
import lowcomm.protocol.matchmaking
import lowcomm.protocol.schedule
from lowcomm.protocol._pb.lowcomm.v1 import averaging_pb2
from lowcomm.protocol.transport import CallFailed, Code, LoopClock, Refused
from sim import engine, peer, vloop
from sim.dht import SimDHT
from sim.engine import SimConfig, simulate
from sim.links import Link
from sim.transport import JOIN, Server, SimNet

SIM_DIR = Path(__file__).resolve().parent.parent / "sim"


def test_virtual_loop_jumps_to_the_next_timer_in_exact_order() -> None:
    async def main() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        seen: list[tuple[str, float]] = []

        async def sleeper(name: str, seconds: float) -> None:
            await asyncio.sleep(seconds)
            seen.append((name, loop.time() - t0))

        loop.call_later(1800.0, lambda: seen.append(("timer", loop.time() - t0)))
        await asyncio.gather(sleeper("hour", 3600.0), sleeper("second", 1.0), sleeper("half", 0.5),
                             sleeper("also-second", 1.0))
        try:
            async with asyncio.timeout(10.0):
                await asyncio.Event().wait()
        except TimeoutError:
            seen.append(("timeout", loop.time() - t0))
        # The protocol's default clock (the matchmaker's deadlines) reads the same virtual time.
        seen.append(("protocol-clock", LoopClock().monotonic() - t0))
        return seen

    assert vloop.run(main()) == [("half", 0.5), ("second", 1.0), ("also-second", 1.0), ("timer", 1800.0),
                                 ("hour", 3600.0), ("timeout", 3610.0), ("protocol-clock", 3610.0)]


def test_a_loop_where_everything_waits_forever_is_a_deadlock() -> None:
    async def main() -> None:
        await asyncio.Event().wait()

    with pytest.raises(vloop.SimulationDeadlock):
        vloop.run(main())


def test_dht_values_appear_after_their_propagation_and_expire() -> None:
    async def main() -> list[dict]:
        dht = SimDHT()
        dht.add_peer("a")
        writer = dht.client("a", rtt=0.1, propagation=2.0, step=lambda: 0)
        reader = dht.client("b", rtt=0.1, propagation=2.0, step=lambda: 0)
        await writer.store("k", "a", {"v": 1}, ttl=10.0)  # visible 2 s after it returns
        views = [await reader.get("k")]  # 0.1 s later: still stale
        await asyncio.sleep(2.0)
        views.append(await reader.get("k"))
        await writer.store("k", "a", {"v": 2}, ttl=10.0)
        views.append(await reader.get("k"))  # the old value until the new one arrives
        await asyncio.sleep(20.0)
        views.append(await reader.get("k"))  # expired
        assert dht.steps[0].reads["b"] == 4 and dht.steps[0].writes["a"] == 2
        return views

    assert vloop.run(main()) == [{}, {"a": {"v": 1}}, {"a": {"v": 1}}, {}]


def test_sim_transport_fails_calls_as_the_seam_says() -> None:
    link = Link(up=1e6, down=1e6, latency=0.01, speed=1.0, kind="residential")

    async def main() -> list:
        received = []
        net = SimNet(lambda receiver, method, request: received.append((receiver, request.step)))

        async def refuse(request):
            raise Refused(Code.ABORTED, "group closed")

        async def hang(request):
            await asyncio.Event().wait()

        server = Server("s", link)
        net.serve(server)
        transport = net.transport(link)
        codes = []
        for handler, timeout in ((refuse, 5.0), (hang, 0.5)):
            server.handlers[JOIN] = handler
            try:
                await transport.join(net.address_of("s"), averaging_pb2.JoinRequest(step=3), timeout)
            except CallFailed as err:
                codes.append(err.code)
        crashed = asyncio.ensure_future(transport.join(net.address_of("s"), averaging_pb2.JoinRequest(step=4), 60.0))
        await asyncio.sleep(1.0)
        server.crash()  # the call in flight fails at once, later ones cannot connect
        for call in (crashed, transport.join(net.address_of("s"), averaging_pb2.JoinRequest(step=5), 5.0)):
            try:
                await call
            except CallFailed as err:
                codes.append(err.code)
        return codes + received

    assert vloop.run(main()) == [Code.ABORTED, Code.DEADLINE_EXCEEDED, Code.UNAVAILABLE, Code.UNAVAILABLE,
                                 ("s", 3), ("s", 3), ("s", 4)]


def test_the_simulator_uses_the_real_protocol_objects() -> None:
    assert engine.Matchmaker is lowcomm.protocol.matchmaking.Matchmaker
    assert peer.Matchmaker is lowcomm.protocol.matchmaking.Matchmaker
    assert engine.split_into_groups is lowcomm.protocol.layout.split_into_groups
    assert engine.shard_layout is lowcomm.protocol.layout.shard_layout
    assert lowcomm.protocol.matchmaking.split_into_groups is lowcomm.protocol.layout.split_into_groups
    assert peer.decisions is lowcomm.node.decisions
    assert engine.GossipMode is lowcomm.node.gossip_mode.GossipMode
    assert engine.Inbox is lowcomm.protocol.gossip.Inbox
    import sim.allreduce
    assert sim.allreduce.upload_order is lowcomm.protocol.schedule.upload_order


def test_no_protocol_logic_is_copied_into_sim() -> None:
    """No class or function under sim/ carries the name of the protocol logic it drives."""
    protected = {"Matchmaker", "DirectPath", "split_into_groups", "shard_layout", "majority_elsewhere", "behind",
                 "outpaced", "expected_peers_of", "catch_up_target", "solo_step_allowed", "direct_round_allowed",
                 "SwarmView", "PeerRecord", "Inbox", "GossipMode", "_candidates", "upload_order", "result_order",
                 "stage_budget", "result_budget", "bounded_weights", "ShardAccumulator", "Election", "BucketLevel",
                 "bucket_count", "bucket_label", "groups_of_step", "RoundPeers"}
    defined = {}
    for path in sorted(SIM_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in protected:
                defined[node.name] = path.name
    assert defined == {}


def small(**overrides) -> SimConfig:
    settings = dict(peers=32, rounds=3, seed=7, churn=2.0, numel=1_000_000, inner_steps=20)
    settings.update(overrides)
    return SimConfig(**settings)


def test_a_run_goes_through_the_real_matchmaker_and_decisions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Count calls into the real classes during a run: a copy of their logic would not be counted."""
    counts = {"form_group": 0, "handle_join": 0, "split": 0, "majority": 0, "catch_up": 0}
    matchmaker = lowcomm.protocol.matchmaking.Matchmaker

    def counting(name: str, original):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(matchmaker, "form_group", counting("form_group", matchmaker.form_group))
    monkeypatch.setattr(matchmaker, "handle_join", counting("handle_join", matchmaker.handle_join))
    monkeypatch.setattr(lowcomm.protocol.election, "split_into_groups",
                        counting("split", lowcomm.protocol.election.split_into_groups))
    monkeypatch.setattr(lowcomm.node.decisions, "majority_elsewhere",
                        counting("majority", lowcomm.node.decisions.majority_elsewhere))
    monkeypatch.setattr(lowcomm.node.decisions, "catch_up_target",
                        counting("catch_up", lowcomm.node.decisions.catch_up_target))
    lines, _ = simulate(small(peers=16, rounds=2, group_size=8))
    assert all(count > 0 for count in counts.values()), counts
    # 16 peers, groups of at most 8: the real leader split them, so each round has several groups.
    assert max(line["groups"] for line in lines) >= 2


def test_a_small_run_is_deterministic_and_consistent() -> None:
    first, summary = simulate(small())
    second, _ = simulate(small())
    assert json.dumps(first) == json.dumps(second)
    assert [line["round"] for line in first] == [0, 1, 2]
    assert summary["peers_spawned"] >= 32
    for line in first:
        assert 0 < line["averaged"] <= line["live"] <= summary["peers_spawned"]
        assert 0 < line["share_averaged"] <= 1
        assert line["form_p50_s"] <= line["form_p95_s"]
        assert line["group_size_max"] <= 16 and line["groups"] >= 1
        assert line["bytes_per_peer_mb"] > 0
        assert line["dht_reads_per_peer"] > 0 and line["dht_writes_per_peer"] > 0
        # Every committed peer of a round holds one of that round's group results.
        assert 1 <= line["hashes"] <= line["groups"] + line["solo"]
    # 2.0/hour churn over the run's few minutes: some peers came and went.
    assert summary["virtual_seconds"] > 0


def test_gossip_run_mixes_parameters() -> None:
    lines, summary = simulate(small(mode="gossip", churn=0.0, rounds=4))
    distances = [line["consensus_distance"] for line in lines]
    assert distances[-1] < distances[0] < summary["initial_consensus_distance"]
    assert all(line["share_averaged"] > 0.5 for line in lines)


def test_a_large_simulated_step_matchmakes_in_the_real_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    """64 peers, group size 8: B = 8 in the peers' views, so the run goes through the real
    two-level path (protocol/buckets.py), and each step still commits one average."""
    counts = {"bucketed": 0, "through_top": 0}
    matchmaker = lowcomm.protocol.matchmaking.Matchmaker
    for name, attr in (("bucketed", "_form_bucketed"), ("through_top", "_through_top")):
        original = getattr(matchmaker, attr)

        def wrapper(*args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(matchmaker, attr, wrapper)
    lines, summary = simulate(small(peers=64, rounds=2, group_size=8, churn=0.0))
    assert counts["bucketed"] > 0 and 0 < counts["through_top"] < counts["bucketed"], counts
    assert max(line["groups"] for line in lines) >= 4
    assert peer.RoundPeers is lowcomm.protocol.buckets.RoundPeers
