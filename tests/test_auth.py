"""Run secret and TLS (protocol/auth.py) in one process: tokens, replay, signed records, live servers."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress

import grpc
import pytest
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from lowcomm.node import cli
from lowcomm.node.grpc_metrics import HandledCounter
from lowcomm.node.metrics import NodeMetrics
from lowcomm.node.swarm import PeerRecord, SignedDHT, peers_key, read_swarm
from lowcomm.protocol import PROTOCOL_VERSION
from lowcomm.protocol._pb.lowcomm.v1 import averaging_pb2, averaging_pb2_grpc, node_pb2, node_pb2_grpc, state_pb2, \
    state_pb2_grpc
from lowcomm.protocol.auth import (
    TOKEN_KEY,
    AuthError,
    ReplayCache,
    RunAuth,
    ServerAuthInterceptor,
    TLSConfig,
    claimed_sender,
    client_interceptors,
    parse_secret,
)
from lowcomm.protocol.handshake import Identity
from lowcomm.protocol.rpc import (
    AveragingServicer,
    ChannelPool,
    NodeInfoServicer,
    StateServicer,
    check_health,
    create_server,
)
from lowcomm.protocol.state import StateDonor

from .swarm_harness import MemoryDHT, Peer, digest

SECRET = b"correct horse battery staple 42"
OTHER = b"another run's secret, not ours!"
STATE_INFO = "/lowcomm.v1.StateTransfer/GetStateInfo"
FINGERPRINT = "f" * 64


def run(coro, limit: float = 30.0):
    async def bounded():
        async with asyncio.timeout(limit):
            return await coro
    return asyncio.run(bounded())


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- tokens ---------------------------------------------------------------------------------------


def test_token_round_trip_binds_method_peer_step_and_time():
    clock = Clock()
    auth = RunAuth(SECRET, clock=clock)
    token = auth.mint(STATE_INFO, "peer-a", 7)
    claims = auth.verify(token, STATE_INFO)
    assert (claims.peer_id, claims.step, claims.timestamp) == ("peer-a", 7, clock.now)
    # A peer id may contain ':' (the other fields never do).
    assert auth.verify(auth.mint(STATE_INFO, "a:b", 1), STATE_INFO).peer_id == "a:b"


@pytest.mark.parametrize("tamper", ["method", "peer", "step", "time", "nonce", "mac"])
def test_tampered_token_is_refused(tamper):
    auth = RunAuth(SECRET, clock=Clock())
    version, peer, step, millis, nonce, mac = auth.mint(STATE_INFO, "peer-a", 7).split(":")
    method = STATE_INFO
    if tamper == "method":
        method = "/lowcomm.v1.StateTransfer/DownloadState"
    peer = "peer-b" if tamper == "peer" else peer
    step = "8" if tamper == "step" else step
    millis = str(int(millis) + 1) if tamper == "time" else millis
    nonce = ("0" if nonce[0] != "0" else "1") + nonce[1:] if tamper == "nonce" else nonce
    mac = ("0" if mac[0] != "0" else "1") + mac[1:] if tamper == "mac" else mac
    with pytest.raises(AuthError, match="not signed with this run's secret") as err:
        auth.verify(":".join((version, peer, step, millis, nonce, mac)), method)
    assert err.value.sender == peer


def test_missing_malformed_and_wrong_secret_tokens_are_refused():
    clock = Clock()
    auth = RunAuth(SECRET, clock=clock)
    for token in (None, "", b""):
        with pytest.raises(AuthError, match="no run-secret token"):
            auth.verify(token, STATE_INFO)
    for token in ("garbage", "v2:a:1:2:3:4", "v1:a:x:2:" + "0" * 32 + ":" + "0" * 64):
        with pytest.raises(AuthError, match="malformed|not signed"):
            auth.verify(token, STATE_INFO)
    stranger = RunAuth(OTHER, clock=clock)
    with pytest.raises(AuthError, match="not signed with this run's secret") as err:
        auth.verify(stranger.mint(STATE_INFO, "stranger", 0), STATE_INFO)
    assert err.value.sender == "stranger"


def test_expired_and_future_tokens_are_refused_outside_the_skew_window():
    clock = Clock()
    auth = RunAuth(SECRET, clock=clock, skew=60)
    old = auth.mint(STATE_INFO, "peer-a", 1)
    clock.now += 59
    auth.verify(old, STATE_INFO)  # inside the window
    old = auth.mint(STATE_INFO, "peer-a", 1)
    clock.now += 61
    with pytest.raises(AuthError, match="off this node's clock"):
        auth.verify(old, STATE_INFO)
    sender = RunAuth(SECRET, clock=Clock(clock.now + 120))  # a peer whose clock runs 2 minutes ahead
    with pytest.raises(AuthError, match="off this node's clock"):
        auth.verify(sender.mint(STATE_INFO, "peer-a", 1), STATE_INFO)


def test_replayed_token_is_refused_and_nonces_expire():
    clock = Clock()
    auth = RunAuth(SECRET, clock=clock, skew=60)
    token = auth.mint(STATE_INFO, "peer-a", 1)
    auth.verify(token, STATE_INFO)
    with pytest.raises(AuthError, match="replayed"):
        auth.verify(token, STATE_INFO)
    # Remembered nonces are forgotten once their tokens fail the clock check anyway.
    for _ in range(50):
        auth.verify(auth.mint(STATE_INFO, "peer-a", 1), STATE_INFO)
    assert len(auth.replays) == 51
    clock.now += 61
    auth.verify(auth.mint(STATE_INFO, "peer-a", 1), STATE_INFO)
    assert len(auth.replays) == 1


def test_replay_cache_is_bounded():
    cache = ReplayCache(max_entries=10)
    for i in range(25):
        assert cache.add(f"n{i}", expires=100.0 + i, now=0.0)
    assert len(cache) == 10
    assert not cache.add("n24", expires=200.0, now=0.0)


def test_secret_parsing():
    assert parse_secret(b"  " + SECRET + b"\n") == SECRET
    with pytest.raises(ValueError, match="empty"):
        parse_secret(b" \n")
    with pytest.raises(ValueError, match="fewer than 16"):
        parse_secret(b"short\n")


def test_claimed_sender_reads_hello_and_reduce_headers():
    hello = Identity("peer-a", FINGERPRINT, "{}").hello()
    assert claimed_sender(state_pb2.StateInfoRequest(hello=hello)) == "peer-a"
    assert claimed_sender(state_pb2.StateInfoRequest()) is None
    header = averaging_pb2.ReduceHeader(sender_peer_id="peer-b")
    assert claimed_sender(averaging_pb2.ReduceMessage(header=header)) == "peer-b"
    assert claimed_sender(averaging_pb2.ReduceMessage(chunk=b"x")) is None
    assert claimed_sender(b"raw bytes") is None


# -- signed DHT records ---------------------------------------------------------------------------


def test_records_signed_by_the_run_verify_and_others_do_not():
    clock = Clock()
    auth = RunAuth(SECRET, clock=clock)
    value = {"address": "127.0.0.1:1", "weight": 2.0, "nested": {"a": [1, 2]}}
    signed = auth.sign_record("run/round/3", "peer-a", value, ttl=30)
    assert auth.verify_record("run/round/3", "peer-a", signed) == value
    assert auth.verify_record("run/round/3", "peer-a", value) is None  # unsigned
    assert auth.verify_record("run/round/3", "peer-b", signed) is None  # posing as another peer
    assert auth.verify_record("run/round/4", "peer-a", signed) is None  # moved to another round
    assert auth.verify_record("run/round/3", "peer-a", {**signed, "weight": 99.0}) is None  # altered
    assert auth.verify_record("run/round/3", "peer-a", {**signed, "_exp": signed["_exp"] + 10_000}) is None
    assert RunAuth(OTHER, clock=clock).verify_record("run/round/3", "peer-a", signed) is None
    clock.now += 30 + auth.skew + 1  # replayed long after its owner stopped refreshing it
    assert auth.verify_record("run/round/3", "peer-a", signed) is None


def record(peer_id: str, step: int = 3) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, address=f"127.0.0.1:{len(peer_id)}", outer_step=step, params_sha256="h",
                      bandwidth_bps=0.0, tokens_per_second=0.0, protocol_version=PROTOCOL_VERSION,
                      config_fingerprint=FINGERPRINT, phase="training")


def test_signed_dht_hides_unsigned_values_and_read_swarm_marks_them_foreign(caplog):
    async def scenario():
        memory = MemoryDHT()
        ours = SignedDHT(memory, RunAuth(SECRET))
        theirs = SignedDHT(memory, RunAuth(OTHER))
        key = peers_key("run")
        await ours.store(key, "peer-a", record("peer-a").to_value(), ttl=30)
        await theirs.store(key, "peer-x", record("peer-x").to_value(), ttl=30)
        await memory.store(key, "peer-y", record("peer-y").to_value(), ttl=30)  # no secret at all
        assert set(await ours.get(key)) == {"peer-a"}
        assert set(await theirs.get(key)) == {"peer-x"}
        assert "_mac" not in (await ours.get(key))["peer-a"]
        view = await read_swarm(ours, "run", FINGERPRINT, PROTOCOL_VERSION)
        assert set(view.peers) == {"peer-a"}
        assert set(view.foreign) == {"peer-x", "peer-y"}  # never averaged with, contacted once at most
        # Matchmaking registrations go through the same adapter: a stranger cannot register.
        await theirs.store("run/round/3", "peer-x", {"address": "127.0.0.1:9"}, ttl=30)
        assert await ours.get("run/round/3") == {}

    with caplog.at_level("WARNING"):
        run(scenario())
    warned = [r for r in caplog.records if getattr(r, "event", None) == "dht_unsigned"]
    assert warned and "peer-x" in warned[0].getMessage()


def test_a_warning_about_many_unsigned_records_names_a_few_and_counts_the_rest(caplog):
    # An open run's progress key holds thousands of marks: the warning was a 6 kB line.
    async def scenario():
        memory = MemoryDHT()
        for index in range(10):
            await memory.store("run/progress", f"c/{index:02d}", {"step": index}, ttl=30)
        await SignedDHT(memory, RunAuth(SECRET)).get("run/progress")

    with caplog.at_level("WARNING"):
        run(scenario())
    [warned] = [r for r in caplog.records if getattr(r, "event", None) == "dht_unsigned"]
    assert warned.getMessage().startswith("ignoring 10 DHT record(s) under run/progress without a valid run-secret "
                                          "signature (from c/00, c/01, c/02 and 7 more): ")
    assert warned.senders == ["c/00", "c/01", "c/02"] and warned.records == 10


def test_a_node_with_a_secret_pointed_at_an_open_run_is_told_so_not_left_training_alone():
    from lowcomm.node import joincheck

    async def scenario():
        memory = MemoryDHT()
        key = peers_key("run")
        await memory.store(key, "peer-open", record("peer-open").to_value(), ttl=30)  # an open run's peer
        await SignedDHT(memory, RunAuth(OTHER)).store(key, "peer-x", record("peer-x").to_value(), ttl=30)
        await SignedDHT(memory, RunAuth(SECRET)).store(key, "peer-me", record("peer-me").to_value(), ttl=30)
        return await read_swarm(SignedDHT(memory, RunAuth(SECRET)), "run", FINGERPRINT, PROTOCOL_VERSION)

    view = run(scenario())
    assert view.open_run == {"peer-open"}  # peer-x signs, with another secret: the handshake's case
    assert joincheck.open_run_peer(view, "peer-me", FINGERPRINT).peer_id == "peer-open"
    assert joincheck.open_run_peer(view, "peer-me", "another run config") is None  # the handshake names that
    mine = PeerRecord(**{**record("peer-b").__dict__})
    view.peers["peer-b"] = mine  # a peer of our own secret run is in sight: nothing to refuse
    assert joincheck.open_run_peer(view, "peer-me", FINGERPRINT) is None
    assert "start this node without --run-secret-file" in joincheck.open_run_message(record("peer-open"), "run")


# -- live servers ---------------------------------------------------------------------------------


class Server:
    """A node's gRPC surface (state, averaging, status, health) behind the auth interceptor."""

    def __init__(self, tls: TLSConfig | None = None) -> None:
        self.tls = tls
        self.rejected: list[tuple[str, str, str]] = []
        self.metrics = NodeMetrics()

    async def __aenter__(self) -> "Server":
        async def status():
            return node_pb2.NodeStatus(peer_id="server")

        identity = Identity("server", FINGERPRINT, "{}")
        peer = Peer("server", 10, "fp32", MemoryDHT())
        await peer.start()  # for its matchmaker and registry; its own server is replaced below
        await peer.server.stop(grace=None)
        self.peer = peer
        interceptors = [HandledCounter(self.metrics.grpc_handled),
                        ServerAuthInterceptor(RunAuth(SECRET), lambda *r: self.rejected.append(r))]
        self.health = health.aio.HealthServicer()
        self.server, port = create_server(
            "127.0.0.1", 0, AveragingServicer(peer.matchmaker, peer.registry), StateServicer(StateDonor(identity)),
            NodeInfoServicer(status), self.health, interceptors=interceptors, tls=self.tls)
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.target = f"127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.server.stop(grace=None)
        await self.peer.stop()

    def handled(self, code: str) -> float:
        return self.metrics.registry.get_sample_value(
            "grpc_server_handled_total",
            {"grpc_service": "lowcomm.v1.StateTransfer", "grpc_method": "GetStateInfo", "grpc_code": code}) or 0.0


def info_request(peer_id: str) -> state_pb2.StateInfoRequest:
    return state_pb2.StateInfoRequest(hello=Identity(peer_id, FINGERPRINT, "{}").hello())


async def expect_code(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == code, err.value.details()
    return err.value.details() or ""


def test_server_refuses_calls_without_a_valid_token_and_keeps_health_and_status_open():
    async def scenario():
        async with Server() as server:
            plain = ChannelPool()
            ours = ChannelPool(client_interceptors(RunAuth(SECRET), "peer-a", lambda: 3))
            stranger = ChannelPool(client_interceptors(RunAuth(OTHER), "peer-x", lambda: 3))
            try:
                # Without the secret: health and status answer, everything else is UNAUTHENTICATED.
                check = health_pb2_grpc.HealthStub(plain(server.target)).Check(health_pb2.HealthCheckRequest())
                assert (await check).status == health_pb2.HealthCheckResponse.SERVING
                status = await node_pb2_grpc.NodeInfoStub(plain(server.target)).GetStatus(node_pb2.StatusRequest())
                assert status.peer_id == "server"
                assert await check_health(server.target, 5.0) == "SERVING"
                state = state_pb2_grpc.StateTransferStub(plain(server.target))
                assert "no run-secret token" in await expect_code(
                    state.GetStateInfo(info_request("peer-y")), grpc.StatusCode.UNAUTHENTICATED)
                download = state.DownloadState(state_pb2.StateRequest(hello=info_request("peer-y").hello))
                await expect_code(download.read(), grpc.StatusCode.UNAUTHENTICATED)
                averaging = averaging_pb2_grpc.AveragingStub(plain(server.target))
                await expect_code(averaging.JoinGroup(averaging_pb2.JoinRequest()), grpc.StatusCode.UNAUTHENTICATED)

                # A wrong secret: refused the same way, and counted with the claimed sender.
                state = state_pb2_grpc.StateTransferStub(stranger(server.target))
                assert "not signed with this run's secret" in await expect_code(
                    state.GetStateInfo(info_request("peer-x")), grpc.StatusCode.UNAUTHENTICATED)
                averaging = averaging_pb2_grpc.AveragingStub(stranger(server.target))
                reduce = averaging.Reduce(iter([averaging_pb2.ReduceMessage(
                    header=averaging_pb2.ReduceHeader(sender_peer_id="peer-x"))]))
                await expect_code(reduce.read(), grpc.StatusCode.UNAUTHENTICATED)

                # The secret: served.
                state = state_pb2_grpc.StateTransferStub(ours(server.target))
                assert (await state.GetStateInfo(info_request("peer-a"))).step == -1
                # ... but not when the request names another sender than the token.
                assert "names sender 'peer-b'" in await expect_code(
                    state.GetStateInfo(info_request("peer-b")), grpc.StatusCode.UNAUTHENTICATED)
                averaging = averaging_pb2_grpc.AveragingStub(ours(server.target))
                reduce = averaging.Reduce(iter([averaging_pb2.ReduceMessage(
                    header=averaging_pb2.ReduceHeader(sender_peer_id="peer-b"))]))
                await expect_code(reduce.read(), grpc.StatusCode.UNAUTHENTICATED)
            finally:
                for pool in (plain, ours, stranger):
                    await pool.close()
            reasons = {reason for reason, _, _ in server.rejected}
            senders = [sender for _, sender, _ in server.rejected]
            assert reasons == {"unauthenticated"}
            assert len(server.rejected) == 7
            assert senders.count("?") == 3 and senders.count("peer-x") == 2 and senders.count("peer-a") == 2
            assert server.handled("UNAUTHENTICATED") == 3 and server.handled("OK") == 1

    run(scenario())


def test_replayed_token_is_refused_by_a_live_server():
    async def scenario():
        async with Server() as server:
            token = RunAuth(SECRET).mint(STATE_INFO, "peer-a", 0)
            async with grpc.aio.insecure_channel(server.target) as channel:
                stub = state_pb2_grpc.StateTransferStub(channel)
                first = await stub.GetStateInfo(info_request("peer-a"), metadata=((TOKEN_KEY, token),))
                assert first.step == -1
                details = await expect_code(stub.GetStateInfo(info_request("peer-a"), metadata=((TOKEN_KEY, token),)),
                                            grpc.StatusCode.UNAUTHENTICATED)
                assert "replayed" in details
            # A token is good for its method only.
            other = RunAuth(SECRET).mint("/lowcomm.v1.StateTransfer/DownloadState", "peer-a", 0)
            async with grpc.aio.insecure_channel(server.target) as channel:
                stub = state_pb2_grpc.StateTransferStub(channel)
                await expect_code(stub.GetStateInfo(info_request("peer-a"), metadata=((TOKEN_KEY, other),)),
                                  grpc.StatusCode.UNAUTHENTICATED)

    run(scenario())


async def authed_peer(peer_id: str, secret: bytes, dht: MemoryDHT, numel: int) -> Peer:
    """A harness peer whose DHT values, channels and server use ``secret``."""
    auth = RunAuth(secret)
    peer = Peer(peer_id, numel, "fp32", SignedDHT(dht, auth), reduce_timeout=5.0)
    await peer.start()
    await peer.server.stop(grace=None)
    await peer.channels.close()
    peer.channels = ChannelPool(client_interceptors(auth, peer_id, lambda: 0))
    peer.matchmaker.channel_for = peer.channels

    async def no_status():
        raise NotImplementedError

    peer.server, port = create_server(
        "127.0.0.1", 0, AveragingServicer(peer.matchmaker, peer.registry), None, NodeInfoServicer(no_status),
        health.aio.HealthServicer(),
        interceptors=[ServerAuthInterceptor(auth, lambda reason, sender, _: peer.rejections.append((reason, sender)))])
    await peer.server.start()
    peer.matchmaker.address = f"127.0.0.1:{port}"
    return peer


def test_peers_sharing_the_secret_average_and_a_stranger_contributes_nothing():
    numel = 10_001

    async def scenario():
        dht = MemoryDHT()
        a, b = [await authed_peer(f"peer-{i}", SECRET, dht, numel) for i in "ab"]
        stranger = await authed_peer("peer-0", OTHER, dht, numel)  # lowest id: it would lead if it could
        try:
            gen = torch.Generator().manual_seed(0)
            deltas = [torch.randn(numel, generator=gen) for _ in range(3)]
            honest = {"peer-a", "peer-b"}
            results = await asyncio.gather(
                a.average(0, deltas[0], honest), b.average(0, deltas[1], honest),
                stranger.average(0, deltas[2], honest | {"peer-0"}, timeout=3.0))
            (group_a, result_a), (group_b, result_b), (group_s, _) = results
            assert {m.peer_id for m in group_a.members} == honest == {m.peer_id for m in group_b.members}
            assert [m.peer_id for m in group_s.members] == ["peer-0"]
            assert [digest(x) for x in result_a.averages] == [digest(x) for x in result_b.averages]
            mean = torch.cat(result_a.averages)
            assert torch.allclose(mean, (deltas[0] + deltas[1]) / 2, atol=1e-6)
            # Its direct attempts are refused and counted.
            stub = averaging_pb2_grpc.AveragingStub(stranger.channels(a.matchmaker.address))
            request = averaging_pb2.JoinRequest(hello=stranger.identity.hello(), step=0)
            await expect_code(stub.JoinGroup(request), grpc.StatusCode.UNAUTHENTICATED)
            assert ("unauthenticated", "peer-0") in a.rejections
        finally:
            await asyncio.gather(*(p.stop() for p in (a, b, stranger)))

    run(scenario())


def test_rejections_reason_is_precreated_in_metrics():
    metrics = NodeMetrics()
    value = metrics.registry.get_sample_value("lowcomm_rejected_contributions_total", {"reason": "unauthenticated"})
    assert value == 0.0


# -- TLS ------------------------------------------------------------------------------------------


def self_signed(name: str) -> tuple[bytes, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(
            [x509.DNSName(name), x509.IPAddress(ipaddress.ip_address("10.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def test_tls_material_is_validated():
    cert, key = self_signed("lowcomm-run")
    _, other_key = self_signed("other")
    tls = TLSConfig.from_pem(cert, key)
    assert tls.target_name == "lowcomm-run"  # peers dial IP addresses: the certificate's name is checked
    assert TLSConfig.from_pem(cert).private_key is None
    with pytest.raises(ValueError, match="not a PEM X.509 certificate"):
        TLSConfig.from_pem(b"not a cert", key)
    with pytest.raises(ValueError, match="does not belong to the certificate"):
        TLSConfig.from_pem(cert, other_key)
    with pytest.raises(ValueError, match="not an unencrypted PEM private key"):
        TLSConfig.from_pem(cert, b"junk")


def test_tls_server_with_the_secret_serves_peers_that_trust_its_certificate():
    cert, key = self_signed("lowcomm-run")
    wrong_cert, _ = self_signed("lowcomm-run")  # same name, another key: not trusted

    async def scenario():
        async with Server(tls=TLSConfig.from_pem(cert, key)) as server:
            client_tls = TLSConfig.from_pem(cert)
            assert await check_health(server.target, 5.0, client_tls) == "SERVING"
            ours = ChannelPool(client_interceptors(RunAuth(SECRET), "peer-a", lambda: 0), tls=client_tls)
            plaintext = ChannelPool(client_interceptors(RunAuth(SECRET), "peer-a", lambda: 0))
            untrusting = ChannelPool(client_interceptors(RunAuth(SECRET), "peer-a", lambda: 0),
                                     tls=TLSConfig.from_pem(wrong_cert))
            no_secret = ChannelPool(tls=client_tls)
            try:
                info = await state_pb2_grpc.StateTransferStub(ours(server.target)).GetStateInfo(
                    info_request("peer-a"), timeout=5)
                assert info.step == -1
                for pool in (plaintext, untrusting):
                    await expect_code(state_pb2_grpc.StateTransferStub(pool(server.target)).GetStateInfo(
                        info_request("peer-a"), timeout=5), grpc.StatusCode.UNAVAILABLE)
                await expect_code(state_pb2_grpc.StateTransferStub(no_secret(server.target)).GetStateInfo(
                    info_request("peer-a"), timeout=5), grpc.StatusCode.UNAUTHENTICATED)
            finally:
                for pool in (ours, plaintext, untrusting, no_secret):
                    await pool.close()

    run(scenario())


def test_a_tls_joiner_that_trusts_none_of_the_swarms_certificates_is_told_which_flag_to_fix():
    from lowcomm.node import joincheck
    from lowcomm.node.swarm import SwarmView

    cert, key = self_signed("lowcomm-run")
    wrong_cert, _ = self_signed("lowcomm-run")

    async def scenario() -> tuple[str | None, str | None, str | None]:
        async with Server(tls=TLSConfig.from_pem(cert, key)) as server:
            peer = PeerRecord(**{**record("peer-a").__dict__, "address": server.target, "tls": True})
            view = SwarmView({"peer-a": peer, "me": record("me")}, {}, 0.0)
            hello = Identity("me", FINGERPRINT, "{}").hello()
            verdicts = []
            for trusted in (wrong_cert, cert):
                pool = ChannelPool(client_interceptors(RunAuth(SECRET), "me", lambda: 0),
                                   tls=TLSConfig.from_pem(trusted))
                try:
                    verdicts.append(await joincheck.untrusted_certificate(view, "me", pool, hello))
                finally:
                    await pool.close()
            gone = PeerRecord(**{**peer.__dict__, "peer_id": "peer-0", "address": "127.0.0.1:1"})  # nobody there
            plain = PeerRecord(**{**peer.__dict__, "peer_id": "peer-1", "tls": False})  # not a TLS peer
            pool = ChannelPool(tls=TLSConfig.from_pem(wrong_cert))
            try:
                verdicts.append(await joincheck.untrusted_certificate(SwarmView({"peer-0": gone}, {}, 0.0), "me",
                                                                      pool, hello))
                # Probed first, a peer gone or serving plaintext hid the untrusted one (seen in CI).
                crowd = SwarmView({"peer-0": gone, "peer-1": plain, "peer-a": peer}, {}, 0.0)
                verdicts.append(await joincheck.untrusted_certificate(crowd, "me", pool, hello))
            finally:
                await pool.close()
            return tuple(verdicts)

    untrusted, trusted, unreachable, behind_others = run(scenario())
    assert behind_others == untrusted
    assert untrusted.startswith("the TLS certificate of peer peer-a at 127.0.0.1:")
    assert "not trusted (CERTIFICATE_VERIFY_FAILED: self signed certificate), nor any other peer's" in untrusted
    assert untrusted.endswith("in --tls-cert")
    assert trusted is None and unreachable is None


def test_a_joiner_on_the_other_side_of_tls_from_the_swarm_is_told_which_flags_to_change():
    from lowcomm.node import joincheck
    from lowcomm.node.swarm import SwarmView

    tls_peer = PeerRecord(**{**record("peer-a").__dict__, "tls": True})
    plain_peer = record("peer-b")
    client = PeerRecord(**{**record("peer-c").__dict__, "address": ""})  # serves nothing: not counted
    tls_swarm = SwarmView({"peer-a": tls_peer, "peer-c": client}, {}, 0.0)
    assert "serve gRPC over TLS and this node plaintext: start it with the run's certificate and key (--tls-cert, " \
           "--tls-key)" in joincheck.transport_mismatch(tls_swarm, "me", tls=False)
    assert joincheck.transport_mismatch(tls_swarm, "me", tls=True) is None
    plain_swarm = SwarmView({"peer-b": plain_peer}, {}, 0.0)
    assert "serve plaintext gRPC and this node TLS: start it without --tls-cert and --tls-key" in \
           joincheck.transport_mismatch(plain_swarm, "me", tls=True)
    mixed = SwarmView({"peer-a": tls_peer, "peer-b": plain_peer}, {}, 0.0)
    assert joincheck.transport_mismatch(mixed, "me", tls=False) is None  # one it can call
    # A joiner refused a moment ago leaves its record, still "starting": no evidence (seen in CI).
    refused = PeerRecord(**{**plain_peer.__dict__, "phase": "starting"})
    assert joincheck.transport_mismatch(SwarmView({"peer-a": tls_peer, "peer-b": refused}, {}, 0.0), "me",
                                        tls=False) is not None
    alone = SwarmView({"me": PeerRecord(**{**tls_peer.__dict__, "peer_id": "me"})}, {}, 0.0)
    assert joincheck.transport_mismatch(alone, "me", tls=False) is None
    # The flag travels in the record, and records without it (older peers) read as plaintext.
    assert PeerRecord.parse("peer-a", tls_peer.to_value()).tls is True
    assert PeerRecord.parse("peer-b", {k: v for k, v in tls_peer.to_value().items() if k != "tls"}).tls is False


# -- the CLI's reading of the files (in-process: it fails before starting anything) ----------------


@pytest.mark.parametrize("content, needle", [
    (None, "does not exist"), (b"\n", "is empty"), (b"tiny\n", "fewer than 16"), ("dir", "not readable"),
])
def test_join_refuses_unusable_secret_files_in_one_line(tmp_path, capsys, content, needle):
    path = tmp_path / "run.secret"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    code = cli.main(["join", "--run-secret-file", str(path), "--checkpoint-dir", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("lowcomm-node: error: run secret file") and needle in lines[0]
    assert str(path) in lines[0]


def test_join_refuses_half_or_broken_tls_settings_in_one_line(tmp_path, capsys):
    cert, key = self_signed("lowcomm-run")
    (tmp_path / "cert.pem").write_bytes(cert)
    (tmp_path / "bad.pem").write_bytes(b"-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n")
    cases = [(["--tls-cert", str(tmp_path / "cert.pem")], "go together"),
             (["--tls-cert", str(tmp_path / "bad.pem"), "--tls-key", str(tmp_path / "cert.pem")], "not a PEM X.509"),
             (["--tls-cert", str(tmp_path / "cert.pem"), "--tls-key", str(tmp_path / "missing.pem")], "does not exist")]
    for flags, needle in cases:
        code = cli.main(["join", *flags, "--checkpoint-dir", str(tmp_path / "ckpt")])
        err = capsys.readouterr().err.strip()
        assert code == cli.EXIT_USAGE and err.startswith("lowcomm-node: error:") and needle in err, err
        assert "\n" not in err
