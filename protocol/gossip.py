"""Gossip mode: pairwise push-pull averaging of encoded global parameters (DESIGN §4).

At its round boundary a peer A calls ``Exchange`` on each of its partners B: A sends its Hello
and a header; B checks them and answers with its own header, the go-ahead (a refusal thus costs A
no upload); A streams its encoded θ_A in 1-4 MiB chunks; B validates and decodes it, keeps it in
its ``Inbox`` and streams its own encoded θ_B back. A mixes the θ_B it received right away; B mixes
the θ_A in its inbox at its own next round boundary, so that B's θ_global never changes while
B's training thread is training from it. Both directions use the run's gossip codec, each
sender with its own error-feedback residual over its parameters (the rounding it could not
send this time goes out with its next payload, to whichever partner that is).

Everything a peer receives is checked before it is kept: the Hello (FAILED_PRECONDITION on
another protocol version or run config), the step window (ABORTED), codec, length and byte
count (INVALID_ARGUMENT, then ``CodecError`` from the decoder) and finiteness
(``check_contribution``). Every await has a deadline; a partner that fails is simply left out.

This module holds no global state and knows nothing of the node: the responder gets this
peer's step, its reply payload and its inbox through its constructor.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Iterator

import grpc
import torch

from . import codecs
from ._pb.lowcomm.v1 import gossip_pb2, gossip_pb2_grpc
from .allreduce import CHUNK_BYTES
from .handshake import Identity, IncompatiblePeer
from .validate import ContributionRejected, check_contribution

log = logging.getLogger(__name__)

HEADER_TIMEOUT = 10.0  # seconds a responder waits for the first message of an Exchange stream

RejectCallback = Callable[[str, str, str], None]  # (reason, sender peer id, detail)


class GossipError(Exception):
    """An exchange that did not deliver a partner's parameters.

    ``reason`` is a rejection label (``codec``, ``length``, ``non_finite``) when the partner
    sent something invalid, None when it was unreachable, too slow or refused the exchange.
    """

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Traffic:
    """Payload bytes moved by exchanges (accumulated, also by exchanges that failed halfway)."""

    sent: int = 0
    received: int = 0


@dataclass
class Exchanged:
    """What one successful exchange brought back."""

    step: int  # the partner's outer step
    theta: torch.Tensor  # the partner's decoded global parameters (validated)


def chunks(payload: bytes) -> Iterator[bytes]:
    view = memoryview(payload)
    if not payload:
        yield b""
    for start in range(0, len(payload), CHUNK_BYTES):
        yield bytes(view[start:start + CHUNK_BYTES])


def header_problem(header: gossip_pb2.GossipHeader, codec: codecs.Codec, numel: int) -> tuple[str, str] | None:
    """(rejection reason, detail) when ``header`` does not describe what we expect, else None."""
    if header.codec != codec.id:
        return "codec", f"codec {header.codec} differs from the run's gossip codec {int(codec.id)}"
    if header.numel != numel:
        return "length", f"numel {header.numel} differs from the model's {numel}"
    if header.payload_bytes != codec.encoded_size(numel):
        return "length", f"payload_bytes {header.payload_bytes} differs from {codec.encoded_size(numel)}"
    return None


async def decode_checked(codec: codecs.Codec, payload: bytes | bytearray, numel: int,
                         executor: Executor) -> torch.Tensor:
    """Decode off the event loop and refuse non-finite values (raises CodecError, ContributionRejected)."""
    loop = asyncio.get_running_loop()
    theta = await loop.run_in_executor(executor, codec.decode, payload, numel)
    check_contribution(theta)
    return theta


class Inbox:
    """Partners' decoded parameters, waiting for this peer's next round boundary.

    At most one entry per sender (a newer one replaces the older) and at most ``capacity``
    senders, counting exchanges in flight: a peer asked by more partners than that refuses the
    extra ones (RESOURCE_EXHAUSTED) instead of buffering unbounded copies of the model.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: dict[str, torch.Tensor] = {}
        self._in_flight: set[str] = set()

    def __len__(self) -> int:
        return len(self._items)

    def reserve(self, sender: str) -> bool:
        """Room for an exchange with ``sender``; False while one is in flight or the inbox is full."""
        if sender in self._in_flight:
            return False
        if sender not in self._items and len(self._items.keys() | self._in_flight) >= self.capacity:
            return False
        self._in_flight.add(sender)
        return True

    def release(self, sender: str) -> None:
        self._in_flight.discard(sender)

    def put(self, sender: str, theta: torch.Tensor) -> None:
        self._items[sender] = theta

    def drain(self) -> dict[str, torch.Tensor]:
        items, self._items = self._items, {}
        return items


class GossipResponder:
    """The callee's side of ``Exchange``."""

    def __init__(self, identity: Identity, codec: codecs.Codec, numel: int, executor: Executor, inbox: Inbox,
                 step: Callable[[], int], reply: Callable[[], Awaitable[bytes]], on_reject: RejectCallback,
                 step_window: int, timeout: float, on_traffic: Callable[[int, int], None] | None = None) -> None:
        self.identity = identity
        self.codec = codec
        self.numel = numel
        self.executor = executor
        self.inbox = inbox
        self.step = step  # this peer's committed outer step
        self.reply = reply  # this peer's θ_global, encoded with its error-feedback residual
        self.on_reject = on_reject
        self.step_window = step_window
        self.timeout = timeout  # seconds to receive the whole payload once the header arrived
        self.on_traffic = on_traffic  # (bytes received, bytes sent) of every served exchange

    async def handle(self, requests: AsyncIterator[gossip_pb2.GossipMessage],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[gossip_pb2.GossipMessage]:
        try:  # not wait_for: on Python 3.11 it can swallow a cancel that comes with the message
            async with asyncio.timeout(HEADER_TIMEOUT):
                first = await anext(requests)
        except (StopAsyncIteration, TimeoutError):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Exchange stream must start with hello and header")
        if not first.HasField("hello") or not first.HasField("header"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Exchange stream must start with hello and header")
        sender = first.hello.peer_id or "?"
        try:
            self.identity.check(first.hello)
        except IncompatiblePeer as err:
            log.warning("refused a gossip exchange from %s: %s", sender, err)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        header = first.header
        problem = header_problem(header, self.codec, self.numel)
        if problem is not None:
            self.on_reject(problem[0], sender, problem[1])
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem[1])
        mine = self.step()
        if abs(header.step - mine) > self.step_window:
            await context.abort(grpc.StatusCode.ABORTED, f"outer steps {header.step} and {mine} are more than "
                                                         f"{self.step_window} apart: no mixing")
        if sender == self.identity.peer_id or not self.inbox.reserve(sender):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy with other partners; ask another peer")
        try:
            # Our header is the go-ahead: the caller sends its payload only now, so a refusal above
            # costs it no upload (and reaches it as a clean status, not as a failed write).
            yield gossip_pb2.GossipMessage(header=gossip_pb2.GossipHeader(
                step=mine, codec=self.codec.id, numel=self.numel, payload_bytes=self.codec.encoded_size(self.numel)))
            try:
                theta, received, reply = await self._receive(sender, header, requests)
            except _Refused as err:
                self.inbox.release(sender)  # before the caller hears of it: it may call again at once
                await context.abort(err.code, err.detail)
            # Kept only now (a caller we cannot answer would not mix with us either); the entry
            # takes the place of the reservation.
            self.inbox.put(sender, theta)
            self.inbox.release(sender)
            sent = 0
            for chunk in chunks(reply):
                sent += len(chunk)
                yield gossip_pb2.GossipMessage(chunk=chunk)
            if self.on_traffic is not None:
                self.on_traffic(received, sent)
        finally:
            self.inbox.release(sender)

    async def _receive(self, sender: str, header: gossip_pb2.GossipHeader,
                       requests: AsyncIterator[gossip_pb2.GossipMessage]) -> tuple[torch.Tensor, int, bytes]:
        """The caller's validated θ, the payload bytes it took, and our encoded reply; raises _Refused."""
        payload = bytearray(header.payload_bytes)  # bounded: equals the codec's size for our numel
        filled = 0
        try:
            async with asyncio.timeout(self.timeout):
                async for message in requests:
                    if not message.HasField("chunk") or filled + len(message.chunk) > len(payload):
                        self.on_reject("length", sender, "unexpected message or more bytes than declared")
                        raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                                       "unexpected message or more bytes than declared")
                    payload[filled:filled + len(message.chunk)] = message.chunk
                    filled += len(message.chunk)
        except TimeoutError:
            raise _Refused(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"payload not received within {self.timeout:.0f}s") from None
        if filled != len(payload):
            self.on_reject("length", sender, f"{filled} of {len(payload)} declared bytes arrived")
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{filled} of {len(payload)} declared bytes arrived")
        try:
            theta = await decode_checked(self.codec, payload, self.numel, self.executor)
        except codecs.CodecError as err:
            self.on_reject("codec", sender, str(err))
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable payload: {err}") from None
        except ContributionRejected as err:
            self.on_reject(err.reason, sender, str(err))
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
        try:
            reply = await self.reply()
        except codecs.CodecError as err:  # our own parameters are not finite: we have nothing to give
            log.error("cannot encode our parameters for %s: %s", sender, err)
            raise _Refused(grpc.StatusCode.UNAVAILABLE, "this peer's parameters cannot be encoded") from None
        return theta, filled, reply


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


class GossipServicer(gossip_pb2_grpc.GossipServicer):
    """Thin grpc.aio adapter over a ``GossipResponder``."""

    def __init__(self, responder: GossipResponder) -> None:
        self.responder = responder

    async def Exchange(self, request_iterator: AsyncIterator[gossip_pb2.GossipMessage],
                       context: grpc.aio.ServicerContext) -> AsyncIterator[gossip_pb2.GossipMessage]:
        async for message in self.responder.handle(request_iterator, context):
            yield message


def service(responder: GossipResponder) -> Callable[[grpc.aio.Server], None]:
    """An ``add(server)`` callable for ``rpc.create_server(extra_services=...)``."""
    return lambda server: gossip_pb2_grpc.add_GossipServicer_to_server(GossipServicer(responder), server)


async def exchange(channel: grpc.aio.Channel, identity: Identity, codec: codecs.Codec, step: int, payload: bytes,
                   numel: int, executor: Executor, timeout: float, step_window: int,
                   traffic: Traffic | None = None) -> Exchanged:
    """Push ``payload`` (our encoded θ at ``step``) to a partner and pull its θ; raises GossipError.

    The partner's header comes first and is the go-ahead for our payload; its payload follows
    ours. The whole call, transfer and decoding included, ends within ``timeout`` seconds.
    """
    traffic = traffic if traffic is not None else Traffic()
    call = gossip_pb2_grpc.GossipStub(channel).Exchange(timeout=timeout)
    try:
        async with asyncio.timeout(timeout):
            await call.write(gossip_pb2.GossipMessage(hello=identity.hello(), header=gossip_pb2.GossipHeader(
                step=step, codec=codec.id, numel=numel, payload_bytes=len(payload))))
            first = await call.read()
            if first is grpc.aio.EOF:
                raise GossipError(f"{(await call.code()).name}: {await call.details()}")
            if not first.HasField("header"):
                raise GossipError("the answer does not start with a header", "length")
            header = first.header
            problem = header_problem(header, codec, numel)
            if problem is not None:
                raise GossipError(problem[1], problem[0])
            if abs(header.step - step) > step_window:
                raise GossipError(f"partner at step {header.step}, out of the window of {step}")
            for chunk in chunks(payload):
                await call.write(gossip_pb2.GossipMessage(chunk=chunk))
                traffic.sent += len(chunk)
            await call.done_writing()
            received = bytearray(header.payload_bytes)
            filled = 0
            while (message := await call.read()) is not grpc.aio.EOF:
                if not message.HasField("chunk") or filled + len(message.chunk) > len(received):
                    raise GossipError("unexpected message or more bytes than declared", "length")
                received[filled:filled + len(message.chunk)] = message.chunk
                filled += len(message.chunk)
                traffic.received += len(message.chunk)
            if filled != len(received):
                code = await call.code()
                raise GossipError(f"the answer ended early ({code.name}: {await call.details()})",
                                  "length" if code == grpc.StatusCode.OK else None)
            theta = await decode_checked(codec, received, numel, executor)
    except grpc.aio.AioRpcError as err:
        raise GossipError(f"{err.code().name}: {err.details()}") from None
    except asyncio.InvalidStateError:  # a write after the partner ended the call
        raise GossipError(f"the partner ended the exchange ({(await call.code()).name})") from None
    except TimeoutError:
        raise GossipError(f"no answer within {timeout:.1f}s") from None
    except codecs.CodecError as err:
        raise GossipError(f"undecodable answer: {err}", "codec") from None
    except ContributionRejected as err:
        raise GossipError(str(err), err.reason) from None
    finally:
        call.cancel()  # no-op once the call finished; ends it on every early exit
    return Exchanged(step=header.step, theta=theta)
