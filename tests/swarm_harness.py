"""In-process swarm for protocol tests: several peers in one event loop on 127.0.0.1:0.

Each peer has a real grpc.aio server with the Averaging service, a Matchmaker and a
ReduceRegistry; the DHT is an in-memory dict shared by all peers (the protocol only needs
``store`` and ``get``). Failures are injected by stopping a peer's server at a chosen moment.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from grpc_health.v1 import health

from lowcomm.protocol import codecs
from lowcomm.protocol.allreduce import AllReduceResult, ReduceRegistry, run_allreduce
from lowcomm.protocol.handshake import Identity
from lowcomm.protocol.matchmaking import Matchmaker
from lowcomm.protocol.outer import NesterovOuter
from lowcomm.protocol.rpc import AveragingServicer, ChannelPool, NodeInfoServicer, create_server
from lowcomm.protocol.state import params_sha256


class MemoryDHT:
    """A dict with expirations, standing in for hivemind's DHT."""

    def __init__(self) -> None:
        self.data: dict[str, dict[str, tuple[dict, float]]] = {}

    async def store(self, key: str, subkey: str, value: dict, ttl: float) -> bool:
        self.data.setdefault(key, {})[subkey] = (value, time.monotonic() + ttl)
        return True

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

    async def start(self, fingerprint: str = "f" * 64, run_config_json: str = "{}") -> None:
        self.identity = Identity(self.peer_id, fingerprint, run_config_json)
        self.executor = ThreadPoolExecutor(2)
        self.channels = ChannelPool()
        self.registry = ReduceRegistry(self.peer_id, lambda r, s, d: self.rejections.append((r, s)), self.executor)
        self.matchmaker = Matchmaker(self.dht, "test", self.identity, "", self.channels, self.group_size,
                                     int(codecs.get_codec(self.codec).id), self.numel, self.reduce_timeout)

        async def no_status():
            raise NotImplementedError

        self.server, port = create_server("127.0.0.1", 0, AveragingServicer(self.matchmaker, self.registry), None,
                                          NodeInfoServicer(no_status), health.aio.HealthServicer())
        await self.server.start()
        if not self.client_mode:
            self.matchmaker.address = f"127.0.0.1:{port}"
        self.residual = torch.zeros(self.numel)
        self.owner_residual = torch.zeros(self.numel)

    async def stop(self) -> None:
        await self.server.stop(grace=None)
        await self.channels.close()
        self.executor.shutdown(wait=False, cancel_futures=True)

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


def apply_outer(params: torch.Tensor, outer: NesterovOuter, result: AllReduceResult) -> torch.Tensor:
    params = params.clone()
    for average, sl in zip(result.averages, result.slices):
        if average is not None:
            outer.step_slice(params, sl.start, average)
    return params


async def start_peers(count: int, numel: int, codec: str = "int8", **kwargs) -> list[Peer]:
    dht = MemoryDHT()
    peers = [Peer(f"peer-{i:02d}", numel, codec, dht, **kwargs) for i in range(count)]
    await asyncio.gather(*(p.start() for p in peers))
    return peers


def digest(t: torch.Tensor) -> str:
    return params_sha256(t)
