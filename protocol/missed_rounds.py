"""Catching up by the rounds one missed, not by the whole state (issue 15).

A peer that holds the swarm's state at step s but did not take part in the round of step s (it
came to the round after the round's plan had closed, as joiners of a start-up wave do, or its
round failed while the others' succeeded) is one step behind when the swarm commits s + 1.
Instead of downloading θ_global and the outer momentum of s + 1 (8 bytes per parameter), it can
fetch the *averages* that round applied, encoded as the round sent them (1 byte per parameter in
int8), and apply them with its own outer optimizer: every member of the round applied the same
decoded bytes to the same θ_s and momentum, so the peer ends with the same θ_{s+1}, bit for bit,
which it checks against the params hash the swarm published before using it.

**Donor side** (``RoundLog``): every peer keeps the rounds it committed (or applied this way)
for its last KEPT_ROUNDS steps: the step, the params hash before and after, the codec, and per
applied shard its place in the flat parameters and its encoded average. Memory: KEPT_ROUNDS
times the encoded size of the model (int8: 2 × numel bytes), next to the two state snapshots a
donor keeps anyway (2 × 8 × numel bytes). A round that skipped a shard lists only the others:
a skipped shard moved neither parameters nor momentum on any member.

**Caller side** (``fetch_missed_rounds``): asks donors one after the other for the rounds from
its own (step, params hash) to the target step, and checks what comes before it allocates or
decodes anything: consecutive steps, each round starting from the hash the previous one ended
with (the first from the caller's own), the last ending with the target hash, known codecs,
shards inside the model in ascending order, each payload exactly the codec's size for its
shard. ``apply_missed_rounds`` then runs the outer steps on copies of θ and the momentum and
checks every round's result hash; only a chain that reproduces the published hash is used, so a
donor can make the caller fall back to a download, never adopt other parameters.

What this does not cover (the caller downloads instead, as before): a peer whose own state is
not the swarm's at its step (a minority after the majority vote), one further behind than its
donors keep rounds, runs that sync the inner optimizer's state (a round changes that state as
well, through its own state round), gossip mode (no shared state), and donors of an older
version (UNIMPLEMENTED).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable, Iterable, Iterator, Sequence

import grpc
import torch

from . import codecs
from ._pb.lowcomm.v1 import state_pb2, state_pb2_grpc
from .channels import STREAM_CHUNK_BYTES
from .handshake import Identity
from .outer import NesterovOuter
from .snapshot import params_sha256

if TYPE_CHECKING:
    from .state import Donor

log = logging.getLogger(__name__)

KEPT_ROUNDS = 2  # rounds a donor keeps: a peer at most this many steps behind catches up by them


class MissedRoundsError(Exception):
    """The missed rounds cannot be had or do not reproduce the published state (download instead)."""


@dataclass(frozen=True)
class AppliedAverage:
    """One shard's average as the round applied it: its place in the flat parameters and its
    encoded bytes (what every member decoded)."""

    start: int
    numel: int
    payload: bytes


@dataclass(frozen=True)
class RoundRecord:
    """What one round did to θ_global: from ``base_sha256`` at ``step`` to ``result_sha256``."""

    step: int
    base_sha256: str
    result_sha256: str
    codec: codecs.Codec
    shards: tuple[AppliedAverage, ...]

    @property
    def payload_bytes(self) -> int:
        return sum(len(s.payload) for s in self.shards)

    def header(self) -> state_pb2.MissedRound:
        return state_pb2.MissedRound(
            step=self.step, base_sha256=self.base_sha256, result_sha256=self.result_sha256, codec=int(self.codec.id),
            shards=[state_pb2.AppliedShard(start=s.start, numel=s.numel, payload_bytes=len(s.payload))
                    for s in self.shards])


class RoundLog:
    """The rounds of this peer's last ``keep`` steps, served to peers that missed them."""

    def __init__(self, keep: int = KEPT_ROUNDS) -> None:
        self.keep = keep
        self._rounds: dict[int, RoundRecord] = {}

    def add(self, record: RoundRecord) -> None:
        self._rounds[record.step] = record
        while len(self._rounds) > self.keep:
            del self._rounds[min(self._rounds)]

    def steps(self) -> list[int]:
        return sorted(self._rounds)

    def chain(self, from_step: int, base_sha256: str, to_step: int) -> list[RoundRecord]:
        """The rounds of ``from_step`` .. ``to_step`` − 1, each starting where the one before
        ended and the first at ``base_sha256``; MissedRoundsError if this log lacks any."""
        if to_step <= from_step:
            raise MissedRoundsError(f"nothing to catch up from step {from_step} to step {to_step}")
        records, expected = [], base_sha256
        for step in range(from_step, to_step):
            record = self._rounds.get(step)
            if record is None:
                raise MissedRoundsError(f"the round of step {step} is not kept here (kept: {self.steps()})")
            if record.base_sha256 != expected:
                raise MissedRoundsError(f"the round of step {step} kept here started from other parameters")
            records.append(record)
            expected = record.result_sha256
        return records

    @staticmethod
    def messages(records: Iterable[RoundRecord]) -> Iterator[state_pb2.MissedRoundsMessage]:
        """The stream of ``GetMissedRounds``: per round its header, then its payloads in chunks."""
        for record in records:
            yield state_pb2.MissedRoundsMessage(round=record.header())
            for shard in record.shards:
                view = memoryview(shard.payload)
                for start in range(0, len(view), STREAM_CHUNK_BYTES):
                    yield state_pb2.MissedRoundsMessage(chunk=bytes(view[start:start + STREAM_CHUNK_BYTES]))


def _checked_header(header: state_pb2.MissedRound, step: int, base_sha256: str, numel: int) -> RoundRecord:
    """The header's round with empty payloads, or MissedRoundsError naming what is wrong."""
    if header.step != step or header.base_sha256 != base_sha256:
        raise MissedRoundsError(f"expected the round of step {step} from params {base_sha256[:12]}, "
                                f"got step {header.step} from {header.base_sha256[:12]}")
    try:
        codec = codecs.get_codec(header.codec)
    except ValueError as err:
        raise MissedRoundsError(f"round of step {step}: {err}") from None
    end = 0
    for shard in header.shards:
        if shard.start < end or shard.numel <= 0 or shard.start + shard.numel > numel:
            raise MissedRoundsError(f"round of step {step}: shard [{shard.start}, {shard.start + shard.numel}) "
                                    f"overlaps another or lies outside the model's {numel} parameters")
        if shard.payload_bytes != codec.encoded_size(shard.numel):
            raise MissedRoundsError(f"round of step {step}: {shard.payload_bytes} payload bytes for {shard.numel} "
                                    f"values, the {codec.name} codec makes {codec.encoded_size(shard.numel)}")
        end = shard.start + shard.numel
    return RoundRecord(header.step, header.base_sha256, header.result_sha256, codec,
                       tuple(AppliedAverage(s.start, s.numel, b"") for s in header.shards))


async def read_missed_rounds(messages: AsyncIterator[state_pb2.MissedRoundsMessage], from_step: int,
                             base_sha256: str, to_step: int, target_sha256: str, numel: int) -> list[RoundRecord]:
    """The rounds of a ``GetMissedRounds`` answer, checked (module docstring); the payloads are
    gathered only up to the sizes the codec gives for each shard (a donor sizes no buffer)."""
    if to_step <= from_step:
        raise MissedRoundsError(f"nothing to catch up from step {from_step} to step {to_step}")
    records: list[RoundRecord] = []
    current: RoundRecord | None = None
    payloads: list[bytearray] = []
    sizes: list[int] = []  # the current round's payload size per shard (checked in its header)

    def finish() -> None:
        if current is None:
            return
        if [len(p) for p in payloads] != sizes:
            raise MissedRoundsError(f"the round of step {current.step} ended before all its payload bytes came")
        records.append(RoundRecord(current.step, current.base_sha256, current.result_sha256, current.codec,
                                   tuple(AppliedAverage(s.start, s.numel, bytes(p))
                                         for s, p in zip(current.shards, payloads))))

    async for message in messages:
        if message.HasField("round"):
            finish()
            step = from_step + len(records)
            if step >= to_step:
                raise MissedRoundsError(f"the donor sent more rounds than the {to_step - from_step} asked for")
            current = _checked_header(message.round, step, records[-1].result_sha256 if records else base_sha256,
                                      numel)
            payloads = [bytearray() for _ in current.shards]
            sizes = [current.codec.encoded_size(shard.numel) for shard in current.shards]
            continue
        if current is None:
            raise MissedRoundsError("the answer does not start with a round header")
        chunk = memoryview(message.chunk)
        for payload, size in zip(payloads, sizes):  # fill the shards in order
            take = min(size - len(payload), len(chunk))
            payload += chunk[:take]
            chunk = chunk[take:]
        if len(chunk):
            raise MissedRoundsError(f"the round of step {current.step} carries more bytes than its shards")
    finish()
    if len(records) != to_step - from_step:
        raise MissedRoundsError(f"the donor sent {len(records)} of the {to_step - from_step} rounds asked for")
    if records[-1].result_sha256 != target_sha256:
        raise MissedRoundsError(f"the rounds end at params {records[-1].result_sha256[:12]}, "
                                f"not at the published {target_sha256[:12]}")
    return records


def apply_missed_rounds(params: torch.Tensor, outer: NesterovOuter,
                        records: list[RoundRecord]) -> tuple[torch.Tensor, torch.Tensor]:
    """θ and the outer momentum after ``records``, computed on copies of ``params`` and
    ``outer.buffer`` (left unchanged); MissedRoundsError when a round does not end at its hash
    (a payload that does not decode, or another state than the one the round started from)."""
    params = params.clone()
    replay = NesterovOuter(outer.lr, outer.momentum, outer.buffer.clone())
    for record in records:
        for shard in record.shards:
            try:
                average = record.codec.decode(shard.payload, shard.numel)
            except codecs.CodecError as err:
                raise MissedRoundsError(f"round of step {record.step}: {err}") from None
            replay.step_slice(params, shard.start, average)
        digest = params_sha256(params)
        if digest != record.result_sha256:
            raise MissedRoundsError(f"the round of step {record.step} ends at params {digest[:12]} here, "
                                    f"not at {record.result_sha256[:12]} as on the donor")
    return params, replay.buffer


@dataclass
class FetchedRounds:
    records: list[RoundRecord]
    donor: str  # peer id of the donor that served them
    bytes_downloaded: int


async def fetch_missed_rounds(donors: Sequence[Donor], from_step: int, base_sha256: str, to_step: int, target_sha256: str,
                              identity: Identity, channel_for: Callable[[str], grpc.aio.Channel], timeout: float,
                              *, numel: int) -> FetchedRounds:
    """The rounds from our (``from_step``, ``base_sha256``) to (``to_step``, ``target_sha256``)
    from the first of ``donors`` that has them all; MissedRoundsError if none."""
    problems = []
    request = state_pb2.MissedRoundsRequest(hello=identity.hello(), from_step=from_step,
                                            params_sha256=base_sha256, to_step=to_step)
    for donor in donors:
        stub = state_pb2_grpc.StateTransferStub(channel_for(donor.address))
        try:
            records = await read_missed_rounds(stub.GetMissedRounds(request, timeout=timeout), from_step,
                                               base_sha256, to_step, target_sha256, numel)
        except grpc.aio.AioRpcError as err:
            problems.append(f"{donor.peer_id}: {err.code().name} {err.details()}")
            continue
        except MissedRoundsError as err:
            problems.append(f"{donor.peer_id}: {err}")
            continue
        return FetchedRounds(records, donor.peer_id, sum(r.payload_bytes for r in records))
    raise MissedRoundsError("no donor served the missed rounds: " + ("; ".join(problems) or "no donor"))
