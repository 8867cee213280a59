"""One member's Reduce stream to one shard owner: its encoded part goes up, the encoded average
comes back on the same stream (the sender side of allreduce.py)."""

from __future__ import annotations

from typing import AsyncIterator, Callable

from ._pb.lowcomm.v1 import averaging_pb2
from .transport import ReduceTransport

CHUNK_BYTES = 2 * 2**20  # DESIGN: stream in 1-4 MiB messages


def chunks(payload: bytes) -> list[bytes]:
    view = memoryview(payload)
    return [bytes(view[i:i + CHUNK_BYTES]) for i in range(0, len(payload), CHUNK_BYTES)] or [b""]


async def reduce_with_owner(transport: ReduceTransport, address: str, header: averaging_pb2.ReduceHeader,
                            payload: bytes, result_bytes: int, timeout: float, on_sent: Callable[[int], None],
                            on_uploaded: Callable[[], None]) -> tuple[averaging_pb2.ReduceResult, bytearray]:
    """Upload ``payload`` after ``header`` to the owner at ``address``, then return the owner's
    result header and payload.

    ``result_bytes`` is the encoded size the average must have; ``on_sent(n)`` counts bytes as
    they go, ``on_uploaded()`` runs once the transport has taken the last chunk. Raises
    transport.CallFailed for a failed call and ValueError for an answer that breaks the protocol.
    """
    async def outgoing() -> AsyncIterator[averaging_pb2.ReduceMessage]:
        yield averaging_pb2.ReduceMessage(header=header)
        for chunk in chunks(payload):
            on_sent(len(chunk))
            yield averaging_pb2.ReduceMessage(chunk=chunk)
        on_uploaded()  # the transport asked for more after the last chunk: it has all of them

    result = None
    received = bytearray()
    answer = transport.reduce(address, outgoing(), timeout)
    try:
        async for message in answer:
            if result is None:
                if not message.HasField("result"):
                    raise ValueError("owner's answer does not start with a result header")
                result = message.result
                if result.numel != header.numel or result.payload_bytes != result_bytes:
                    raise ValueError("owner's result does not match the shard")
                continue
            if len(received) + len(message.chunk) > result.payload_bytes:
                raise ValueError("owner sent more bytes than declared")
            received += message.chunk
    finally:  # a broken answer ends the call at once, not when the stream is collected
        close = getattr(answer, "aclose", None)
        if close is not None:
            await close()
    if result is None or len(received) != result.payload_bytes:
        raise ValueError("owner's answer ended early")
    return result, received
