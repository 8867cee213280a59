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
"""

from __future__ import annotations

import os

_SIZE = os.environ.get("LOWCOMM_FAULT_DIE_SERVING")

if _SIZE:
    import asyncio
    import logging
    import signal

    from lowcomm.protocol import agreement, allreduce

    _log = logging.getLogger("lowcomm.faults")
    _state: dict = {"group": None, "step": None, "holder": None}
    _serve = allreduce.ReduceRegistry._serve
    _handle = agreement.AgreementBook.handle

    async def _faulty_serve(self, acc, header, requests, context):
        if _state["group"] is None and len(acc.group.members) >= int(_SIZE):
            _state["group"], _state["step"] = acc.group.group_id, acc.group.step
        faulty = _state["group"] == acc.group.group_id
        async for message in _serve(self, acc, header, requests, context):
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
