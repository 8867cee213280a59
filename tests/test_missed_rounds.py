"""Catching up by the averages of missed rounds (protocol/missed_rounds.py): the donor's log, the
stream and its checks, the replay's bit-identity with the members' own outer steps, and the
gRPC call with its refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowcomm.protocol import codecs, missed_rounds
from lowcomm.protocol._pb.lowcomm.v1 import state_pb2
from lowcomm.protocol.missed_rounds import (
    KEPT_ROUNDS,
    AppliedAverage,
    MissedRoundsError,
    RoundLog,
    RoundRecord,
    apply_missed_rounds,
    fetch_missed_rounds,
    read_missed_rounds,
)
from lowcomm.protocol.outer import NesterovOuter
from lowcomm.protocol.state import StateDonor, params_sha256

from .test_state_download import Swarm, identity, run

NUMEL = 10_000
INT8 = codecs.get_codec("int8")


def members_rounds(rounds: int, numel: int = NUMEL, bounds: tuple[int, ...] = (0, 3_000, 7_000, NUMEL),
                   skip: dict[int, set[int]] | None = None, seed: int = 0,
                   codec: codecs.Codec = INT8) -> tuple[torch.Tensor, NesterovOuter, list[RoundRecord], torch.Tensor]:
    """θ_0 and the outer optimizer before the rounds, the records of ``rounds`` rounds as a member
    keeps them, and θ after them, computed as a member does: decode each shard's encoded average
    and step its slice (shards in ``skip[round]`` skipped)."""
    gen = torch.Generator().manual_seed(seed)
    params0 = torch.randn(numel, generator=gen)
    outer0 = NesterovOuter(0.7, 0.9, torch.randn(numel, generator=gen) * 0.01)
    params, member = params0.clone(), NesterovOuter(0.7, 0.9, outer0.buffer.clone())
    records = []
    for r in range(rounds):
        base = params_sha256(params)
        shards = []
        for index, (start, end) in enumerate(zip(bounds, bounds[1:])):
            if index in (skip or {}).get(r, set()):
                continue
            payload = codec.encode(torch.randn(end - start, generator=gen) * 0.01)
            member.step_slice(params, start, codec.decode(payload, end - start))
            shards.append(AppliedAverage(start, end - start, payload))
        records.append(RoundRecord(10 + r, base, params_sha256(params), codec, tuple(shards)))
    return params0, outer0, records, params


async def stream(messages):
    for message in messages:
        yield message


def read(messages, records: list[RoundRecord], numel: int = NUMEL, **changes) -> list[RoundRecord]:
    args = dict(from_step=records[0].step, base_sha256=records[0].base_sha256, to_step=records[-1].step + 1,
                target_sha256=records[-1].result_sha256, numel=numel) | changes
    return run(read_missed_rounds(stream(messages), **args))


def test_replayed_rounds_end_bit_identical_with_the_members():
    params0, outer0, records, members_params = members_rounds(2, skip={1: {1}})
    before = params0.clone(), outer0.buffer.clone()
    got = read(list(RoundLog.messages(records)), records)
    params, momentum = apply_missed_rounds(params0, outer0, got)
    assert torch.equal(params, members_params)
    assert params_sha256(params) == records[-1].result_sha256
    # Computed on copies: nothing of the caller's state changes before it adopts the result.
    assert torch.equal(params0, before[0]) and torch.equal(outer0.buffer, before[1])
    assert not torch.equal(momentum, before[1])


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(1, NUMEL - 1), min_size=0, max_size=5, unique=True),
       chunk=st.integers(1, 9_000), rounds=st.integers(1, KEPT_ROUNDS))
def test_any_shard_layout_and_message_size_round_trips(cuts, chunk, rounds):
    bounds = (0, *sorted(cuts), NUMEL)
    params0, outer0, records, members_params = members_rounds(rounds, bounds=bounds)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(missed_rounds, "STREAM_CHUNK_BYTES", chunk)
        messages = list(RoundLog.messages(records))
    got = read(messages, records)
    assert [r.shards for r in got] == [r.shards for r in records]
    assert torch.equal(apply_missed_rounds(params0, outer0, got)[0], members_params)


def test_the_log_keeps_the_last_rounds_and_serves_only_a_linked_chain():
    _, _, records, _ = members_rounds(3)
    log = RoundLog()
    for record in records:
        log.add(record)
    assert log.steps() == [11, 12]  # KEPT_ROUNDS = 2
    assert log.chain(11, records[1].base_sha256, 13) == records[1:]
    assert log.chain(12, records[2].base_sha256, 13) == records[2:]
    with pytest.raises(MissedRoundsError, match="not kept"):
        log.chain(10, records[0].base_sha256, 12)
    with pytest.raises(MissedRoundsError, match="other parameters"):
        log.chain(11, records[0].base_sha256, 12)  # a caller whose state is not the round's start
    with pytest.raises(MissedRoundsError, match="nothing to catch up"):
        log.chain(12, records[2].base_sha256, 12)


def header_with(record: RoundRecord, **fields) -> state_pb2.MissedRoundsMessage:
    header = record.header()
    for name, value in fields.items():
        if name == "payload_bytes":
            header.shards[0].payload_bytes = value
        elif name == "shard_start":
            header.shards[1].start = value
        else:
            setattr(header, name, value)
    return state_pb2.MissedRoundsMessage(round=header)


def test_a_donors_answer_is_checked_before_anything_is_used():
    _, _, records, _ = members_rounds(1)
    record = records[0]
    messages = list(RoundLog.messages(records))
    body = messages[1:]
    cases = {
        "payload bytes for": [header_with(record, payload_bytes=1 << 40), *body],  # sizes no buffer
        "overlaps another": [header_with(record, shard_start=10), *body],
        "expected the round of step": [header_with(record, step=11), *body],
        "codec": [header_with(record, codec=99), *body],
        "more bytes than its shards": [*messages, state_pb2.MissedRoundsMessage(chunk=b"x")],
        "ended before all its payload": messages[:-1],
        "does not start with a round header": body,
        "more rounds than": [*messages, *messages],
    }
    for problem, answer in cases.items():
        with pytest.raises(MissedRoundsError, match=problem):
            read(answer, records)
    with pytest.raises(MissedRoundsError, match="not at the published"):
        read(messages, records, target_sha256="0" * 64)
    with pytest.raises(MissedRoundsError, match="sent 1 of the 2 rounds"):
        read(messages, records, to_step=record.step + 2)


def test_a_tampered_average_never_changes_the_callers_state():
    params0, outer0, records, _ = members_rounds(2)
    shard = records[1].shards[0]
    flipped = bytearray(shard.payload)
    flipped[-1] ^= 0x01
    records[1] = RoundRecord(records[1].step, records[1].base_sha256, records[1].result_sha256, INT8,
                             (AppliedAverage(shard.start, shard.numel, bytes(flipped)), *records[1].shards[1:]))
    before = params0.clone()
    with pytest.raises(MissedRoundsError, match="round of step 11 ends at params"):
        apply_missed_rounds(params0, outer0, records)
    assert torch.equal(params0, before)


def test_get_missed_rounds_over_grpc_serves_the_kept_chain_and_refuses_the_rest():
    params0, outer0, records, members_params = members_rounds(2)

    async def scenario() -> None:
        swarm = Swarm()
        try:
            empty = await swarm.add(StateDonor(identity("empty")))
            holder = StateDonor(identity("holder"))
            for record in records:
                holder.rounds.add(record)
            full = await swarm.add(holder)
            fetched = await fetch_missed_rounds([empty, full], 10, records[0].base_sha256, 12,
                                                records[-1].result_sha256, identity("late"), swarm.channels,
                                                timeout=10.0, numel=NUMEL)
            assert fetched.donor == "holder"
            assert fetched.bytes_downloaded == sum(r.payload_bytes for r in records)
            params, _ = apply_missed_rounds(params0, outer0, fetched.records)
            assert torch.equal(params, members_params)
            # Not from another state, and not from a peer of another run config.
            with pytest.raises(MissedRoundsError, match="FAILED_PRECONDITION.*other parameters"):
                await fetch_missed_rounds([full], 11, records[0].base_sha256, 12, records[-1].result_sha256,
                                          identity("late"), swarm.channels, timeout=10.0, numel=NUMEL)
            from .test_state_download import OTHER_CONFIG
            with pytest.raises(MissedRoundsError, match="FAILED_PRECONDITION"):
                await fetch_missed_rounds([full], 10, records[0].base_sha256, 12, records[-1].result_sha256,
                                          identity("other", OTHER_CONFIG), swarm.channels, timeout=10.0,
                                          numel=NUMEL)
        finally:
            await swarm.close()

    run(scenario())
