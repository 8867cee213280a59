"""Fault injection for multi-process tests, in the protocol's own code paths.

Python imports ``sitecustomize`` at start-up from the first folder on ``sys.path`` that has one,
so a node started with this folder on ``PYTHONPATH`` loads it; nothing happens unless the
variable below is set. (The node's own LOWCOMM_FAULT_* hooks live in node/faults.py; this one
needs to act inside the owner's result stream, which only the protocol sees.)

LOWCOMM_FAULT_DIE_SERVING=<size>: in the first round in which this peer owns a shard of a group
of at least ``size`` members, it streams the shard's average to the first member that asks,
holds the result streams of the others, and kills itself (SIGKILL) as soon as that first member's
shard report arrives, which proves it holds the average: an owner that dies in the middle of its
result stream, with one member holding its average and the others not. Before dying it logs the
event ``fault_die_serving`` with the step and the member that got the average.

LOWCOMM_FAULT_DIE_IN_RING=<n>: in the n-th ring round (protocol/ring.py) of this peer with three
members or more, it kills itself (SIGKILL) as soon as the first running sum from the member
before it has arrived: a member that dies in the middle of the reduce-scatter, with
sums of the others on their way through it. Before dying it logs ``fault_die_in_ring`` with the
step.
"""

from __future__ import annotations

import os

_SIZE = os.environ.get("LOWCOMM_FAULT_DIE_SERVING")
_RING_SIZE = os.environ.get("LOWCOMM_FAULT_DIE_IN_RING")


def _die(event: str, **fields) -> None:
    import logging
    import signal

    logging.getLogger("lowcomm.faults").warning("fault injection: %s", event, extra={"event": event, **fields})
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)


if _RING_SIZE:
    from lowcomm.protocol import ring

    _read = ring.RingInbox.read
    _run = ring.run_ring_allreduce

    _rounds = [0]

    async def _faulty_run(group, *args, **kwargs):
        _rounds[0] += len(group.members) >= 3
        ring._fault_step = group.step if len(group.members) >= 3 and _rounds[0] == int(_RING_SIZE) else None
        return await _run(group, *args, **kwargs)

    async def _faulty_read(self, size):
        box = await _read(self, size)
        if getattr(ring, "_fault_step", None) is not None:
            _die("fault_die_in_ring", outer_step=ring._fault_step)
        return box

    ring.RingInbox.read = _faulty_read
    ring.run_ring_allreduce = _faulty_run

if _SIZE:
    import asyncio
    import logging
    import signal

    from lowcomm.protocol import agreement, allreduce

    _log = logging.getLogger("lowcomm.faults")
    _state: dict = {"group": None, "step": None, "holder": None}
    _serve = allreduce.ReduceRegistry._serve
    _handle = agreement.AgreementBook.handle

    async def _faulty_serve(self, acc, header, requests, header_at):
        if _state["group"] is None and len(acc.group.members) >= int(_SIZE):
            _state["group"], _state["step"] = acc.group.group_id, acc.group.step
        faulty = _state["group"] == acc.group.group_id
        async for message in _serve(self, acc, header, requests, header_at):
            if faulty and message.HasField("result"):
                if _state["holder"] is None:
                    _state["holder"] = header.sender_peer_id
                elif header.sender_peer_id != _state["holder"]:
                    await asyncio.Event().wait()  # held until this process dies
            yield message

    async def _faulty_handle(self, request, context):
        if _state["holder"] is not None and request.group_id == _state["group"] \
                and request.sender_peer_id == _state["holder"]:
            _log.warning("fault injection: dying while streaming the average", extra={
                "event": "fault_die_serving", "outer_step": _state["step"], "holder": _state["holder"]})
            for handler in logging.getLogger().handlers:
                handler.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return await _handle(self, request, context)

    allreduce.ReduceRegistry._serve = _faulty_serve
    agreement.AgreementBook.handle = _faulty_handle
