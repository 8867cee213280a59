"""The paced heartbeat of node/swarmlink.py in the simulator (issue 15 item 4, the peer table).

``PacedPeer`` is sim/peer.py's ``SimPeer`` with what node/swarmlink.py does since the progress
record (node/swarmpace.py): its record's publication also stores the progress marks that are due
(``MarkWriter``), the heartbeat reads ``<run>/progress`` and the whole peer table only when
``ViewPace`` says so, and the loop's catch-up reuses the last view unless a mark could make it
download (``fresh_needed``), as does the round start of a direct follower and of a member of the
last step's split plan (``recent_view``; such a member reads the table once it leads,
``leader_read``). The other round starts and the matchmaker's looks stay fresh reads, as in
node/averaging.py. The decisions are the real ones, called on whatever view this leaves.

``PacedPeer`` is the simulator's peer (sim/engine.py spawns it, as the node paces its
heartbeat); ``python -m sim --unpaced-heartbeat`` spawns ``SimPeer``, whose heartbeat reads the
whole table at every beat (the node before node/swarmpace.py, and the sweeps before 2026-12-03),
so that both can be measured on the same code. ``python -m sim.heartbeat`` runs ``python -m sim``
(same options) and prints the full reads of the table by reason.
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter

from lowcomm.node import decisions, swarmpace
from lowcomm.node.swarm import SwarmView
from lowcomm.node.swarmpace import Mark, MarkWriter, ViewPace, parse_marks

from .peer import SimPeer


FULL_READS: Counter = Counter()  # full reads of the table by why they were made, over every PacedPeer of the process


class PacedPeer(SimPeer):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        gossip = self.gossip is not None
        cfg = self.world.config
        self.pace = ViewPace(self.peer_id, cfg.quorum, step_window=self.world.gossip_window if gossip else None,
                             group_size=0 if cfg.single_level else cfg.group_size)
        self.mark_writer = MarkWriter(gossip, self.world.config.matchmaking_timeout, self.world.config.heartbeat)
        self.marks: frozenset[Mark] = frozenset()
        self.has_view = False
        self._catching_up = False  # the next refresh_view is the loop catch-up's (node/catchup.py)

    async def publish_record(self, leaving: bool = False) -> None:
        await super().publish_record(leaving)
        if leaving:
            return
        now = asyncio.get_running_loop().time()
        for mark in self.mark_writer.due(self.position(), self.phase, now):
            if await self.dht.store(swarmpace.mark_key(self.world.config.run, mark), mark.subkey, mark.to_value(),
                                    self.mark_writer.ttl(mark)):
                self.mark_writer.stored(mark, now)

    async def read_marks(self) -> frozenset[Mark]:
        keys = swarmpace.mark_keys(self.world.config.run, self.step, self.phase, self.gossip is not None)  # SwarmLink's
        marks = frozenset().union(*(parse_marks(raw) for raw in await asyncio.gather(*(self.dht.get(k) for k in keys))))
        if marks != self.marks:
            self.marks = marks
            self.view_changed.set()  # the inner phase looks again (round_open reads the marks)
        return self.marks

    def want_view(self) -> None:  # RoundPeers.watch: SwarmLink.want_view
        self.pace.want_view()

    def round_open(self, counts: tuple) -> bool:
        return super().round_open(counts) or swarmpace.opened_by_others(self.marks, self.position())

    async def _full_read(self, why: str) -> SwarmView:
        FULL_READS[why] += 1
        marks = self.marks  # known before this read: the view accounts for them
        view = await super().refresh_view()
        self.has_view = True
        self.pace.read_full(marks, self.position())
        return view

    def recent_view(self) -> SwarmView | None:  # SwarmLink.recent_view
        if not self.has_view or swarmpace.fresh_needed(self.marks, self.position(), self.pace.step_window):
            return None
        FULL_READS["round start (direct follower, plan member): last view reused"] += 1
        return self.view

    async def leader_read(self) -> SwarmView:
        return await self._full_read("a plan member leads: its first look")

    async def refresh_view(self) -> SwarmView:
        if self._catching_up:  # SwarmLink.current_view
            self._catching_up = False
            marks = await self.read_marks()
            if self.has_view and not swarmpace.fresh_needed(marks, self.position(), self.pace.step_window):
                FULL_READS["catch-up: last view reused"] += 1
                return self.view
            return await self._full_read("catch-up")
        return await self._full_read("round start, matchmaker, joiner")

    async def catch_up(self) -> None:
        # The node's initial catch-up (a joiner's, here: not caught up yet) reads afresh.
        self._catching_up = self.caught_up
        try:
            await super().catch_up()
        finally:
            self._catching_up = False

    async def heartbeat(self) -> None:
        while True:
            await self.publish_record()
            every = swarmpace.full_read_every(len(self.view.peers))
            marks = await self.read_marks() if every > 1 else self.marks
            me = self.position()
            # The others at our step with our hash, from the view's counts (sim/dht.py) rather than O(N).
            same = sum(n for (step, digest, _), n in self.view_tags.items()
                       if step == me.step and digest == me.params_hash)
            same -= me.peer_id in self.view.peers and self.view.peers[me.peer_id].outer_step == me.step \
                and self.view.peers[me.peer_id].params_sha256 == me.params_hash
            why = self.pace.full_read_due(len(self.view.peers), self.has_view, me, self.phase, marks, same)
            if why is not None:
                await self._full_read(f"heartbeat: {why}")
            else:
                FULL_READS["heartbeat: progress record only"] += 1
            await asyncio.sleep(self.world.config.heartbeat)


def main(argv: list[str] | None = None) -> int:
    from . import __main__ as cli
    from . import heartbeat, peer  # the modules the engine's peers count in (this file may run as __main__)

    code = cli.main(sys.argv[1:] if argv is None else argv)
    print("full reads of the peer table, by reason (and the reads they were spared):", file=sys.stderr)
    for why, count in heartbeat.FULL_READS.most_common():
        print(f"  {count:8d}  {why}", file=sys.stderr)
    print("inner phases, by what ended them:", file=sys.stderr)
    for why, count in peer.CUTS.most_common():
        print(f"  {count:8d}  {why}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
