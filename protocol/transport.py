"""What the protocol logic needs from the network, the clock and randomness: the seams (DESIGN §2).

``Matchmaker`` (matchmaking.py, direct.py) and the all-reduce (allreduce.py, sender.py,
agreement.py, accumulator.py) never speak gRPC, read the wall clock or draw random bytes
themselves. They call:

- a **transport**: ``MatchmakingTransport.join`` (the JoinGroup call) and
  ``ReduceTransport.reduce`` / ``ReduceTransport.report_shards`` (the Reduce stream and the
  ReportShards call). A call that does not succeed raises ``CallFailed(code, detail)``: the
  callee refused it (``code`` is the callee's ``Refused`` code), or the callee could not be
  reached (``Code.UNAVAILABLE``) or did not answer in time (``Code.DEADLINE_EXCEEDED``).
- on the serving side, plain methods that take the request message and return (or, for Reduce,
  yield) the response messages: ``Matchmaker.handle_join``, ``ReduceRegistry.handle`` and
  ``ReduceRegistry.handle_report``. They refuse a call by raising ``Refused(code, detail)``.
- a **clock** (``Clock.monotonic()``, seconds) for every deadline, arrival time and grace; the
  default is the running event loop's ``loop.time()``, the same clock ``asyncio.timeout`` and
  ``asyncio.sleep`` use, so the deadlines the logic computes and the timeouts it awaits agree.
- **random bytes** (``RandomBytes``, e.g. ``os.urandom``, the default) for group ids.

The gRPC adapters are in grpc_transport.py (``GrpcMatchmakingTransport``,
``GrpcReduceTransport``; rpc.py's ``AveragingServicer`` maps ``Refused`` to
``context.abort(code, detail)``). Wire formats are the protobuf messages of
``lowcomm.v1.averaging`` in both cases.

Plugging in a fake transport and clock (unit tests, sim/)
-----------------------------------------------------------
1. Clock: pass ``clock=`` to ``Matchmaker(...)`` and ``ReduceRegistry(...)`` (the all-reduce
   of a round uses its registry's clock). Under a virtual-time event loop the default
   ``LoopClock()`` already reads virtual time; a fake needs only ``monotonic()``. Whatever it
   returns must be the time base of the loop's timers, since the logic also awaits
   ``asyncio.timeout``/``asyncio.sleep`` for the same deadlines.
2. Randomness: ``Matchmaker(..., random_bytes=random.Random(seed).randbytes)``.
3. Transport: ``Matchmaker(dht, run, identity, address, None, ..., transport=fake)`` and
   ``run_allreduce(group, peer_id, ..., registry, None, executor, ..., transport=fake)``; the
   serving side of a peer is its ``Matchmaker`` and ``ReduceRegistry``. A fake routes a call to
   the callee's serving method, copies the messages (a real network never shares the caller's
   objects), and turns the callee's ``Refused`` into ``CallFailed``::

       class FakeNet:                                   # one object can serve every peer
           async def join(self, address, request, timeout):
               callee = self.matchmakers.get(address)   # none, or dead: CallFailed(Code.UNAVAILABLE, ...)
               try:
                   async with asyncio.timeout(timeout):  # expiry: CallFailed(Code.DEADLINE_EXCEEDED, ...)
                       return copy(await callee.handle_join(copy(request)))
               except Refused as err:
                   raise CallFailed(err.code, err.detail) from None

           async def report_shards(self, address, report, timeout):
               ...                                      # the same, with registry.handle_report(report)

           async def reduce(self, address, requests, timeout):   # an async generator
               ...                                      # registry.handle(requests) in a task of its own

   ``reduce`` must yield the owner's messages, raise ``CallFailed`` (never ``Refused``) from
   the iteration when the call fails, and end the callee's handler when the caller stops
   reading (the caller closes the stream). Run the owner's ``registry.handle(requests)`` in a
   task of its own, as a server does, and hand its messages over through a queue: timeouts
   and cancellation then stay with the task they belong to. The sender counts its upload as
   done when the handler asks for the message after its last chunk. tests/protocol_fakes.py
   (``FakeNet``, ``VirtualTimeLoop``, ``InlineExecutor``, ``FakeDHT``) is a complete, tested
   set of fakes; tests/test_matchmaking_unit.py and tests/test_allreduce_unit.py use them.
4. Executor: the all-reduce runs codec work in the executor it is given; under virtual time
   an executor that runs inline keeps the clock exact (a thread would let time jump while
   it works).
"""

from __future__ import annotations

import asyncio
import enum
import os
import time
from typing import AsyncIterator, Callable, Protocol

from ._pb.lowcomm.v1 import averaging_pb2

__all__ = ["CallFailed", "Clock", "Code", "LoopClock", "MatchmakingTransport", "RandomBytes", "ReduceTransport",
           "Refused", "default_random_bytes"]


class Code(enum.Enum):
    """Why a call was refused or failed; the names are gRPC's status codes, which the adapter maps by name."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # the caller sent something invalid (its own fault)
    NOT_FOUND = "NOT_FOUND"  # no such group or shard on the callee
    ALREADY_EXISTS = "ALREADY_EXISTS"  # the caller already joined
    FAILED_PRECONDITION = "FAILED_PRECONDITION"  # incompatible peers (handshake): used only for that
    ABORTED = "ABORTED"  # the callee is not in that round (any more), or left it
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"  # an answer did not come in time
    UNAVAILABLE = "UNAVAILABLE"  # the callee cannot be reached
    CANCELLED = "CANCELLED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNKNOWN = "UNKNOWN"  # anything else


class Refused(Exception):
    """Raised by a serving method to refuse the call; the transport delivers ``code`` and
    ``detail`` to the caller (gRPC: ``context.abort(code, detail)``)."""

    def __init__(self, code: Code, detail: str) -> None:
        super().__init__(f"{code.name}: {detail}")
        self.code = code
        self.detail = detail


class CallFailed(Exception):
    """A call made through a transport did not succeed: refused by the callee, or not delivered."""

    def __init__(self, code: Code, detail: str) -> None:
        super().__init__(f"{code.name}: {detail}")
        self.code = code
        self.detail = detail


class Clock(Protocol):
    """Seconds on a monotonic clock: the time base of every deadline the protocol computes."""

    def monotonic(self) -> float: ...


class LoopClock:
    """The running event loop's clock (``loop.time()``): what ``asyncio.timeout`` and
    ``asyncio.sleep`` count in, so a virtual-time loop drives the protocol's deadlines too.

    Under uvloop (the node's loop) it reads ``time.monotonic()`` instead: uvloop's
    ``loop.time()`` is libuv's ``uv_now()``, CLOCK_MONOTONIC in whole milliseconds, so every
    duration the protocol measured came out in whole milliseconds (a stable group's
    matchmaking, a fast all-reduce, an owner's timing of an upload: 150 kB over loopback took
    exactly 1 or 2 ms). ``time.monotonic()`` reads the same clock at full resolution, at most a
    millisecond ahead of the loop's timers."""

    def monotonic(self) -> float:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop running (an object built before the loop): asyncio's own base
            return time.monotonic()
        return time.monotonic() if isinstance(loop, _MillisecondLoops) else loop.time()


try:  # the loops whose time() counts whole milliseconds of CLOCK_MONOTONIC
    from uvloop import Loop as _UvLoop
    _MillisecondLoops: tuple[type, ...] = (_UvLoop,)
except ImportError:  # protocol/ runs on asyncio's own loop as well
    _MillisecondLoops = ()


RandomBytes = Callable[[int], bytes]  # n -> n random bytes
default_random_bytes: RandomBytes = os.urandom


class MatchmakingTransport(Protocol):
    async def join(self, address: str, request: averaging_pb2.JoinRequest,
                   timeout: float) -> averaging_pb2.JoinResponse:
        """JoinGroup on the peer at ``address``; raises CallFailed."""
        ...


class ReduceTransport(Protocol):
    def reduce(self, address: str, requests: AsyncIterator[averaging_pb2.ReduceMessage],
               timeout: float) -> AsyncIterator[averaging_pb2.ReduceMessage]:
        """The Reduce stream with the owner at ``address``: ``requests`` go up, the answer's
        messages come back; the iteration raises CallFailed when the call fails."""
        ...

    async def report_shards(self, address: str, report: averaging_pb2.ShardReport,
                            timeout: float) -> averaging_pb2.ShardReport:
        """ReportShards on the member at ``address``; raises CallFailed."""
        ...
