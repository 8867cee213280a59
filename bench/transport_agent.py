#!/usr/bin/env python
"""One peer of the transport benchmark (bench/transport.py starts one per network namespace).

    python bench/transport_agent.py lowcomm --index I --host H [--port 7701]
    python bench/transport_agent.py hivemind --index I --host H [--initial-peer MADDR]

It holds a random float32 vector and averages it with the others when told to; commands are
JSON lines on stdin, answers JSON lines on stdout (the harness reads them in the root
namespace, so no command crosses the capped links):

    lowcomm   {"cmd": "setup", "numel": n}            -> {"event": "setup_done"}
              {"cmd": "round", "group": {...}}        -> {"event": "round_done", "t_start", "t_end",
                                                          "cpu_seconds", "bytes_sent", "bytes_received",
                                                          "skipped", "trace": [[t, stage, shard, peer]]}
    hivemind  {"cmd": "setup", "numel": n, "group_size": N, "prefix": P}  -> {"event": "setup_done"}
              {"cmd": "round", "timeout": s}          -> {"event": "round_done", "t_start", "t_end",
                                                          "group_size"}
    both      {"cmd": "quit"}

`lowcomm` runs the project's butterfly all-reduce (``protocol.allreduce.run_allreduce``) over
its gRPC service exactly as a node does after matchmaking; the group message (members, shard
layout, codec) comes from the harness instead of a leader, so only the transfer is timed.
`hivemind` runs ``hivemind.DecentralizedAverager.step`` with ``require_trigger``: matchmaking
first, then the all-reduce, whose start (the trigger) and end are timed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


class Trace:
    """Timestamps of one round's stages, per peer and shard, relative to the round's start (the
    harness puts them into its records: where the time of a round goes, issue 17)."""

    def __init__(self) -> None:
        self.t0 = time.time()
        self.events: list[tuple[float, str, int, str]] = []  # (seconds, what, shard, other peer)

    def mark(self, what: str, shard: int, peer: str = "") -> None:
        self.events.append((round(time.time() - self.t0, 4), what, shard, peer))


class TracingTransport:
    """A ReduceTransport that marks, for every Reduce stream this peer opens, when it starts, when
    its upload was taken, and when the owner's answer starts and ends."""

    def __init__(self, inner, trace: "Trace | None" = None) -> None:
        self.inner = inner
        self.trace = trace

    def reduce(self, address, requests, timeout):
        trace, shard = self.trace, [-1]

        async def outgoing():
            async for message in requests:
                if message.HasField("header"):
                    shard[0] = message.header.shard_index
                    trace.mark("up_start", shard[0], address)
                yield message
            trace.mark("up_taken", shard[0], address)

        async def answer():
            first = True
            async for message in self.inner.reduce(address, outgoing(), timeout):
                if first:
                    trace.mark("result_start", shard[0], address)
                    first = False
                yield message
            trace.mark("result_end", shard[0], address)
        return answer()

    async def report_shards(self, address, report, timeout):
        self.trace.mark("report_out", -1, address)
        try:
            return await self.inner.report_shards(address, report, timeout)
        finally:
            self.trace.mark("report_back", -1, address)


class TracingRegistry:
    """The owner's side of the trace: when a sender's header, its last chunk and the first and
    last message of the average sent back pass this peer's Reduce handler."""

    def __init__(self, registry, transport: TracingTransport) -> None:
        self.registry = registry
        self.transport = transport

    def __getattr__(self, name):
        return getattr(self.registry, name)

    async def handle(self, requests, context=None):
        trace, who = self.transport.trace, ["", -1]

        async def incoming():
            done = False
            async for message in requests:
                if message.HasField("header"):
                    who[:] = [message.header.sender_peer_id, message.header.shard_index]
                    trace.mark("in_header", who[1], who[0])
                elif message.HasField("chunk") and not message.chunk and not done:  # the payload's end
                    trace.mark("in_done", who[1], who[0])
                    done = True
                yield message
            if not done:
                trace.mark("in_done", who[1], who[0])

        first = True
        async for message in self.registry.handle(incoming(), context):
            if first:
                trace.mark("out_result_start", who[1], who[0])
                first = False
            yield message
        trace.mark("out_result_end", who[1], who[0])


def commands() -> "asyncio.Queue[dict]":
    """stdin lines as an asyncio queue (a thread reads; the loop is never blocked)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict] = asyncio.Queue()

    def read() -> None:
        for line in sys.stdin:
            if line.strip():
                loop.call_soon_threadsafe(queue.put_nowait, json.loads(line))
        loop.call_soon_threadsafe(queue.put_nowait, {"cmd": "quit"})

    threading.Thread(target=read, daemon=True).start()
    return queue


async def run_lowcomm(args: argparse.Namespace) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from grpc_health.v1 import health

    from lowcomm.protocol._pb.lowcomm.v1 import averaging_pb2
    from lowcomm.protocol.allreduce import ReduceRegistry, run_allreduce
    from lowcomm.protocol.grpc_transport import GrpcReduceTransport
    from lowcomm.protocol.rpc import AveragingServicer, ChannelPool, NodeInfoServicer, create_server

    torch.set_num_threads(1)
    peer_id = f"agent-{args.index}"
    executor = ThreadPoolExecutor(2, thread_name_prefix="codec")  # as the node's codec pool
    registry = ReduceRegistry(peer_id, lambda reason, sender, detail: emit(event="rejected", reason=reason,
                                                                            detail=detail), executor)

    async def no_status():
        raise NotImplementedError

    channels = ChannelPool()
    transport = TracingTransport(GrpcReduceTransport(channels))
    servicer = AveragingServicer(None, TracingRegistry(registry, transport))
    server, port = create_server(args.host, args.port, servicer, None, NodeInfoServicer(no_status),
                                 health.aio.HealthServicer())
    await server.start()
    emit(event="ready", address=f"{args.host}:{port}", peer_id=peer_id)
    queue = commands()
    delta = residual = owner_residual = None
    try:
        while True:
            cmd = await queue.get()
            if cmd["cmd"] == "quit":
                break
            if cmd["cmd"] == "setup":
                gen = torch.Generator().manual_seed(args.index)
                delta = torch.randn(cmd["numel"], generator=gen).mul_(0.01)
                residual, owner_residual = torch.zeros_like(delta), torch.zeros_like(delta)
                emit(event="setup_done", numel=cmd["numel"])
            elif cmd["cmd"] == "round":
                spec = cmd["group"]
                group = averaging_pb2.Group(
                    group_id=bytes.fromhex(spec["group_id"]), step=spec["step"],
                    members=[averaging_pb2.Member(**m) for m in spec["members"]],
                    shard_bounds=spec["shard_bounds"], shard_owners=spec["shard_owners"], codec=spec["codec"],
                    reduce_timeout_s=spec["reduce_timeout_s"], schedule=spec.get("schedule", 0))
                transport.trace = Trace()
                t_start, cpu_start = transport.trace.t0, time.process_time()
                result = await run_allreduce(group, peer_id, delta, residual, owner_residual, registry, None,
                                             executor, staggered=cmd.get("staggered", True), transport=transport)
                t_end, cpu = time.time(), time.process_time() - cpu_start
                residual.zero_()
                owner_residual.zero_()
                emit(event="round_done", t_start=t_start, t_end=t_end, cpu_seconds=cpu, bytes_sent=result.bytes_sent,
                     upload_bps=result.upload_bps, upload_rates=result.upload_rates,
                     bytes_received=result.bytes_received, skipped=sum(a is None for a in result.averages),
                     trace=transport.trace.events)
    finally:
        await channels.close()
        await server.stop(grace=None)
        executor.shutdown(wait=False, cancel_futures=True)


def run_hivemind(args: argparse.Namespace) -> None:
    import hivemind  # the DHT forks: before torch threads exist

    from lowcomm.node.dht import place_p2pd_sockets

    place_p2pd_sockets(tempfile.gettempdir())  # p2pd's sockets in TMPDIR, as a node's (node/dht.py)
    dht = hivemind.DHT(initial_peers=args.initial_peer, host_maddrs=[f"/ip4/{args.host}/tcp/0"], start=True)
    import torch
    from hivemind.averaging.control import AveragingStage

    torch.set_num_threads(1)
    emit(event="ready", maddrs=[str(m) for m in dht.get_visible_maddrs()])
    averager = None
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                break
            if cmd["cmd"] == "setup":
                if averager is not None:
                    averager.shutdown()
                gen = torch.Generator().manual_seed(args.index)
                tensor = torch.randn(cmd["numel"], generator=gen).mul_(0.01)
                averager = hivemind.DecentralizedAverager(
                    [tensor], dht, start=True, prefix=cmd["prefix"], target_group_size=cmd["group_size"],
                    min_group_size=cmd["group_size"], min_matchmaking_time=2.0, request_timeout=1.0,
                    compression=hivemind.compression.NoCompression(), allreduce_timeout=cmd.get("timeout", 300))
                emit(event="setup_done", numel=cmd["numel"])
            elif cmd["cmd"] == "round":
                timeout = cmd.get("timeout", 300)
                control = averager.step(wait=False, require_trigger=True, timeout=timeout, allow_retries=True)
                deadline = time.monotonic() + timeout
                while control.stage != AveragingStage.AWAITING_TRIGGER and not control.done():
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.01)  # StepControl offers no event for the stage change
                t_start = time.time()
                control.allow_allreduce()
                try:
                    gathered = control.result(timeout)
                    error = None
                except Exception as err:  # a failed round is a result too
                    gathered, error = None, repr(err)
                emit(event="round_done", t_start=t_start, t_end=time.time(),
                     group_size=len(gathered) if gathered else 0, error=error)
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["lowcomm", "hivemind"])
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="lowcomm: gRPC port (0: any)")
    parser.add_argument("--initial-peer", action="append", default=[], help="hivemind: DHT peer to join")
    args = parser.parse_args(argv)
    if args.mode == "lowcomm":
        import uvloop

        uvloop.run(run_lowcomm(args))
    else:
        run_hivemind(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
