"""One member's Reduce stream to one shard owner: its encoded part goes up, the encoded average
comes back on the same stream (the sender side of allreduce.py)."""

from __future__ import annotations

from typing import AsyncIterator, Callable

import numpy as np
import torch

from . import codecs, wire
from .channels import STREAM_CHUNK_BYTES
from ._pb.lowcomm.v1 import averaging_pb2
from .transport import ReduceTransport
from .validate import check_contribution

CHUNK_BYTES = STREAM_CHUNK_BYTES


def chunks(payload: bytes) -> list[bytes]:
    view = memoryview(payload)
    return [bytes(view[i:i + CHUNK_BYTES]) for i in range(0, len(payload), CHUNK_BYTES)] or [b""]


class Inbox:
    """The bytes of one declared payload, gathered chunk by chunk into one buffer allocated
    without zero-filling (``bytearray(n)`` writes n zeros first, and ``+=`` reallocates as it
    grows); ``decode`` then reads that buffer in place (fp32: no copy at all)."""

    def __init__(self, size: int) -> None:
        # numpy, not torch: numpy's buffers show in tracemalloc (the fuzz tests bound them there).
        self._buffer = np.empty(size, dtype=np.uint8)
        self._view = memoryview(self._buffer)
        self.size = size
        self.filled = 0

    def add(self, chunk: bytes) -> bool:
        """Append ``chunk``; False (nothing appended) if it would exceed the declared size."""
        end = self.filled + len(chunk)
        if end > self.size:
            return False
        self._view[self.filled:end] = chunk
        self.filled = end
        return True

    @property
    def complete(self) -> bool:
        return self.filled == self.size

    def payload(self) -> bytes:
        """A copy of the bytes received (before ``decode``, which may reuse the buffer)."""
        return self._buffer[:self.filled].tobytes()

    def decode(self, codec: codecs.Codec, numel: int) -> torch.Tensor:
        """The payload decoded and checked for finite values (codecs.CodecError or
        validate.ContributionRejected); runs in the executor. The inbox is spent afterwards."""
        decoded = codec.decode_owned(self._view, numel)
        check_contribution(decoded)
        return decoded

    def release(self) -> None:
        self._view.release()
        self._buffer = np.empty(0, dtype=np.uint8)
        self.size = self.filled = 0


async def reduce_with_owner(transport: ReduceTransport, address: str, header: averaging_pb2.ReduceHeader,
                            payload: bytes, result_bytes: int, timeout: float, on_sent: Callable[[int], None],
                            on_uploaded: Callable[[], None]) -> tuple[averaging_pb2.ReduceResult, Inbox]:
    """Upload ``payload`` after ``header`` to the owner at ``address``, then return the owner's
    result header and payload (an Inbox: ``inbox.decode`` in the executor).

    ``result_bytes`` is the encoded size the average must have; ``on_sent(n)`` counts bytes as
    they go, ``on_uploaded()`` runs once the transport has taken the last chunk. Raises
    transport.CallFailed for a failed call and ValueError for an answer that breaks the protocol.
    """
    async def outgoing() -> AsyncIterator[wire.Message]:
        yield averaging_pb2.ReduceMessage(header=header)
        for chunk in wire.chunks(payload, CHUNK_BYTES):  # views of the payload, framed once by the transport
            on_sent(len(chunk.chunk))
            yield chunk
        on_uploaded()  # the transport asked for more after the last chunk: it has all of them

    result = None
    received = Inbox(0)
    answer = transport.reduce(address, outgoing(), timeout)
    try:
        async for message in answer:
            if result is None:
                if not message.HasField("result"):
                    raise ValueError("owner's answer does not start with a result header")
                result = message.result
                if result.numel != header.numel or result.payload_bytes != result_bytes:
                    raise ValueError("owner's result does not match the shard")
                received = Inbox(result.payload_bytes)  # bounded: the codec's size for this shard
                continue
            if not received.add(message.chunk):
                raise ValueError("owner sent more bytes than declared")
    finally:  # a broken answer ends the call at once, not when the stream is collected
        close = getattr(answer, "aclose", None)
        if close is not None:
            await close()
    if result is None or not received.complete:
        raise ValueError("owner's answer ended early")
    return result, received
