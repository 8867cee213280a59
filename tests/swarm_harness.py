"""In-process swarm for protocol tests: several peers in one event loop on 127.0.0.1:0.

Each peer has a real grpc.aio server with the Averaging service, a Matchmaker and a
ReduceRegistry; the DHT is an in-memory dict shared by all peers (the protocol only needs
``store`` and ``get``). Failures are injected by stopping a peer's server at a chosen moment.
A round's result is applied to θ_global by the node's own code (``lowcomm.node.apply``), so these
tests check the outer step the node runs, not a copy of it.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from grpc_health.v1 import health

from lowcomm.node.apply import apply_averages
from lowcomm.node.globalstate import GlobalState
from lowcomm.protocol import codecs
from lowcomm.protocol._pb.lowcomm.v1 import averaging_pb2
from lowcomm.protocol.aggregation import Aggregation
from lowcomm.protocol.allreduce import AllReduceResult, ReduceRegistry, run_allreduce
from lowcomm.protocol.handshake import Identity
from lowcomm.protocol.matchmaking import Matchmaker
from lowcomm.protocol.rpc import AveragingServicer, ChannelPool, NodeInfoServicer, create_server
from lowcomm.protocol.state import params_sha256


class MemoryDHT:
    """A dict with expirations, standing in for hivemind's DHT."""

    def __init__(self, barrier: int = 0) -> None:
        self.data: dict[str, dict[str, tuple[dict, float]]] = {}
        self._stored: asyncio.Event | None = None
        # With barrier=N, the first N stores wait for each other before anybody reads: N peers
        # that register "at the same moment" all see each other on their first read.
        self._barrier = asyncio.Barrier(barrier) if barrier else None

    async def store(self, key: str, subkey: str, value: dict, ttl: float) -> bool:
        self.data.setdefault(key, {})[subkey] = (value, time.monotonic() + ttl)
        if self._stored is not None:
            self._stored.set()
            self._stored = None
        barrier = self._barrier
        if barrier is not None:
            if barrier.n_waiting + 1 == barrier.parties:
                self._barrier = None  # single use: later stores do not wait
            await barrier.wait()
        return True

    async def wait_stored(self, key: str, subkeys: set[str]) -> None:
        """Return once every subkey in ``subkeys`` has been stored under ``key`` (no polling)."""
        while not subkeys <= set(self.data.get(key, {})):
            if self._stored is None:
                self._stored = asyncio.Event()
            await self._stored.wait()

    async def get(self, key: str) -> dict[str, dict]:
        now = time.monotonic()
        return {k: v for k, (v, exp) in self.data.get(key, {}).items() if exp > now}


@dataclass
class Peer:
    peer_id: str
    numel: int
    codec: str
    dht: MemoryDHT
    group_size: int = 16
    reduce_timeout: float = 5.0
    client_mode: bool = False
    rejections: list[tuple[str, str]] = field(default_factory=list)
    aggregation: Aggregation | None = None  # None: ReduceRegistry's default (plain mean with the norm bound)

    async def start(self, fingerprint: str = "f" * 64, run_config_json: str = "{}") -> None:
        self.identity = Identity(self.peer_id, fingerprint, run_config_json)
        self.executor = ThreadPoolExecutor(2)
        self.channels = ChannelPool()
        self.registry = ReduceRegistry(self.peer_id, lambda r, s, d: self.rejections.append((r, s)), self.executor,
                                       self.aggregation)
        self.joins_seen: list[str] = []  # peer ids whose JoinGroup reached this peer, in order
        self._join_event = asyncio.Event()
        self._stopped = False
        self.matchmaker = Matchmaker(self.dht, "test", self.identity, "", self.channels, self.group_size,
                                     int(codecs.get_codec(self.codec).id), self.numel, self.reduce_timeout)

        async def no_status():
            raise NotImplementedError

        handle_join = self.matchmaker.handle_join

        async def observed_join(request, context):
            # Registration inside handle_join runs before its first await, so a waiter woken here
            # sees the follower registered.
            call = handle_join(request, context)
            self.joins_seen.append(request.hello.peer_id)
            self._join_event.set()
            return await call

        self.matchmaker.handle_join = observed_join
        self.server, port = create_server("127.0.0.1", 0, AveragingServicer(self.matchmaker, self.registry), None,
                                          NodeInfoServicer(no_status), health.aio.HealthServicer())
        await self.server.start()
        self.port = port
        if not self.client_mode:
            self.matchmaker.address = f"127.0.0.1:{port}"
        self.residual = torch.zeros(self.numel)
        self.owner_residual = torch.zeros(self.numel)

    async def wait_joined_by(self, peer_id: str) -> None:
        """Return once ``peer_id`` has called JoinGroup on this peer."""
        while peer_id not in self.joins_seen:
            self._join_event.clear()
            await self._join_event.wait()

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        await self.server.stop(grace=None)
        await self.channels.close()
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def form(self, step: int, expected: set[str], timeout: float = 10.0, weight: float = 1.0,
                   bandwidth_bps: float = 0.0):
        """Only the matchmaking half of ``average``."""
        async def expected_peers() -> set[str]:
            return expected

        return await self.matchmaker.form_group(step, weight, bandwidth_bps, expected_peers, timeout)

    async def reduce(self, group, delta: torch.Tensor, quorum: float = 1.0) -> AllReduceResult:
        """Only the all-reduce half of ``average``."""
        return await run_allreduce(group, self.peer_id, delta, self.residual, self.owner_residual,
                                   self.registry, self.channels, self.executor, quorum=quorum)

    async def average(self, step: int, delta: torch.Tensor, expected: set[str], timeout: float = 10.0,
                      weight: float = 1.0) -> tuple[object, AllReduceResult | None]:
        async def expected_peers() -> set[str]:
            return expected

        group = await self.matchmaker.form_group(step, weight, 0.0, expected_peers, timeout)
        if len(group.members) == 1:
            return group, None
        result = await run_allreduce(group, self.peer_id, delta, self.residual, self.owner_residual,
                                     self.registry, self.channels, self.executor)
        return group, result


# The outer optimizer of the in-process tests (the node's defaults are not needed here).
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def apply_outer(params: torch.Tensor, result: AllReduceResult) -> torch.Tensor:
    """θ_global after a first round from ``params`` with ``result``: the node's outer step
    (node/apply.py) on a fresh GlobalState, zero momentum."""
    state = GlobalState.fresh(params, OUTER_LR, OUTER_MOMENTUM)
    apply_averages(state, slice(0, params.numel()), result)
    return state.params


async def start_peers(count: int, numel: int, codec: str = "int8", dht: MemoryDHT | None = None,
                      **kwargs) -> list[Peer]:
    dht = MemoryDHT() if dht is None else dht
    peers = [Peer(f"peer-{i:02d}", numel, codec, dht, **kwargs) for i in range(count)]
    await asyncio.gather(*(p.start() for p in peers))
    return peers


async def stop_peers(peers: list[Peer]) -> None:
    await asyncio.gather(*(p.stop() for p in peers))


def digest(t: torch.Tensor) -> str:
    return params_sha256(t)


class RewritingChannels:
    """A peer's ``channel_for`` whose outgoing Reduce streams are rewritten, to play a malicious
    sender that runs the honest protocol code (headers, deadlines, owner side) but puts bytes of
    its choice on the wire: ``rewrite(header, payload) -> payload`` sees the whole encoded
    contribution of one shard and returns what is sent instead (the header is sent unchanged).

    Install with ``peer.channels = RewritingChannels(peer.channels, rewrite)`` after ``start``.
    """

    def __init__(self, channels: ChannelPool, rewrite) -> None:
        self._channels = channels
        self._rewrite = rewrite

    def __call__(self, address: str) -> "_RewritingChannel":
        return _RewritingChannel(self._channels(address), self._rewrite)

    async def close(self) -> None:
        await self._channels.close()


class _RewritingChannel:
    def __init__(self, channel, rewrite) -> None:
        self._channel = channel
        self._rewrite = rewrite

    def __getattr__(self, name: str):
        return getattr(self._channel, name)

    def stream_stream(self, method: str, *args, **kwargs):
        real = self._channel.stream_stream(method, *args, **kwargs)
        if not method.endswith("/Reduce"):
            return real
        rewrite = self._rewrite

        def call(requests, **call_kwargs):
            async def rewritten():
                header, payload = None, bytearray()
                async for message in requests:
                    if message.HasField("header"):
                        header = message.header
                    else:
                        payload += message.chunk
                yield averaging_pb2.ReduceMessage(header=header)
                yield averaging_pb2.ReduceMessage(chunk=bytes(rewrite(header, bytes(payload))))

            return real(rewritten(), **call_kwargs)

        return call
