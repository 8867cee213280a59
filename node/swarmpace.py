"""The swarm's progress record, and when a peer must read the whole peer table (issue 15 item 4).

Every decision of node/decisions.py runs on a ``SwarmView``: the records of all N peers under
``<run>/peers``. Reading that table at every heartbeat costs N records per peer per heartbeat
(~200 kB at N=1024) and puts N requests per heartbeat on the few DHT peers that hold the key.
Most heartbeats learn nothing a decision would act on, so this module decides when a view
older than one heartbeat still answers every decision as a fresh one would, from a small record:

``<run>/progress``, subkey ``c/<step>/<hash>`` = "some peer committed ``step`` with ``hash``";
``<run>/opened/<step>``, subkey ``o/<step>/<hash>/<slot>`` = "a peer of that slot is averaging
at ``step`` from ``hash``", slot = sha256(peer id) mod OPEN_SLOTS. Every peer that commits a
step, or opens a round, writes the same subkey with the same value as the others (idempotent:
the records hold at most one commit mark and OPEN_SLOTS open marks per (step, hash), whatever N
is). How many slots are filled estimates how many peers are averaging (linear counting). In
gossip mode hashes differ by design, so the marks carry no hash and no round opens (one subkey
per step). The open marks have a key per step because only a peer still training at that step
reads them (``reads_open_marks``): in one record with the commit marks, every peer read up to 64
open marks of the step it had just committed at each beat for their whole TTL, and the peers
that were averaging read them too, a quarter of the records a peer read at N=1,024.

What a stale view may miss, and the mark that says it changed:
- ``behind`` / the catch-up target: a peer past our step (any mark at a later step), another
  hash committed at our step (``c/<our step>/<other>``, the majority vote). Without such a mark a
  fresh view would show no peer past our step and no other hash at it either, so the catch-up
  takes no download: the stale view is enough (``fresh_needed``). While we average, a new mark
  waits for the round's end (the groups of a step commit seconds apart: most peers in a large
  swarm see the step committed by another group before their own group commits it).
- ``outpaced`` (the slow peer's cut of its inner phase): true only once a quorum of the peers at
  our step with our hash (as many as in the last full view) are averaging. In a swarm whose
  steps matchmake with one leader (fewer than 4 groups' worth of peers, ``ViewPace.single_level``)
  that leader closes on this quorum: while the open marks at our step and hash say that at
  least half of that many may be averaging (``near_quorum``, which over-counts rather than
  under-counts), the heartbeat reads the table at every beat and ``outpaced`` decides on the
  fresh view. In a bucketed step each bucket leader closes on its own bucket's quorum, a late
  member still reaches the plan through the top level, and the cut comes from
  ``decisions.join_by`` once the open marks show the round open: no read for it.
- the matchmaking's liveness (``RoundPeers.latest``): a bucket leader or a step coordinator
  waits for the peers expected in the heartbeat's view. The coordinator's looks (the top level)
  ask for a full read at the next beat (``RoundPeers.watch``, ``ViewPace.want_view``); a bucket
  leader waits on the view it started from, fresh from its round start or its first look. A
  member that waits on its leader's answer, or reduces, looks at no view: it reads only the
  progress record, as while training. (Every averaging peer read the table at every beat until
  2026-12-03: two thirds of the full reads at N=1024, `python -m sim.heartbeat`.) The solo-step
  check after a group of one reads the last view: in a swarm whose table is read every beat it
  is fresh; in a larger one it may show a peer that left (no solo step: the round fails, as it
  does with a fresh view) and it cannot miss a swarm grown from one (a swarm of one reads at
  every beat).
- liveness for the DHT re-bootstrap (node/reconnect.py), the swarm-size metrics and ``status``:
  only from full reads, which come at least every ``ceil(n / VIEW_PEERS)`` heartbeats, each peer
  at its own offset in that cycle, so the swarm as a whole reads about VIEW_PEERS records per
  peer per heartbeat between rounds, whatever N is.
The round start (node/averaging.py), the first catch-up and every read the matchmaker asks for
stay fresh reads, but for two round starts that read nothing: a direct follower of a stable
group, and a member of the last step's split plan (protocol/buckets.py ``bucketed_by_plan``: it
knows the next step's B and its bucket from the plan, and reads the table only once it finds
itself leading, ``RoundPeers.read_first``).

What this does not bound (measured with ``python -m sim.heartbeat``, which prints the full reads
by reason): a round start outside a plan, a plan member's first look as a leader and the step
coordinator's looks are still N records each (at N=1,024 in groups of 16, 4 rounds, seed 0:
about 105 such reads per round in the whole swarm, next to 232 periodic ones: about 390
records per peer and round in all), and every peer reads ``<run>/progress``
(and, while training, its step's open marks) at each beat, so the busiest holder still serves
O(N) requests per beat. Measured in sim/README.md ("The heartbeat's reads").
The next stage, designed here and not built (it changes protocol/buckets.py's ``RoundPeers``):
- **Records per bucket of the next step.** A peer that committed step r as a member of a step
  plan of n_r members knows B_{r+1} = bucket_count(n_r, group_size) and its bucket label at
  r+1, and publishes its record (with its phase) under ``<run>/peers/<r+1>/<label>`` besides the
  table (which it then refreshes at the slow cycle only). The commit mark carries n_r. The round
  start of a bucketed step reads its bucket key (~group_size records) and the progress record:
  B from n_r, ``RoundPeers`` gets the bucket's expected peers and B instead of the whole
  expected set, and the heartbeat's reads while averaging or while the round is open (the
  bucket leader's liveness, ``outpaced`` over the bucket, whose leader closes on the bucket's
  quorum anyway) read the bucket key. Each bucket key has its own holders: ~group_size readers.
- **Progress shards.** ``<run>/progress/<k>``, k = hash(peer id) mod ceil(N/64): a peer writes
  and reads its own shard. A step committed by one plan reaches every shard (n_r writers spread
  over N/64 shards); a hash held by a few peers may miss some, and that is no loss: only steps
  ahead of ours and hashes held by a majority change a decision.
- Joiners, peers that missed a step's plan and peers whose bucket key is empty read the whole
  table (rare): the decisions then run on the full view, as now.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Iterable

from lowcomm.protocol.buckets import bucket_count

from .decisions import Position

# Records a peer reads per heartbeat on average between rounds: the full table every ceil(n/16)
# beats. 16 is what every peer of a swarm of 16 reads at each beat (it reads the table every
# beat), so a larger swarm reads no more per peer for its liveness. The cost: the swarm-size
# metrics, ``status`` and the re-bootstrap's list of live peers are up to n/16 beats old (5 min
# at N=1,024 with 5 s beats); every decision that needs a fresh view reads one (module docstring).
# It was 64 until 2026-12-03: then these reads were 40 % of the records a peer read at N=1,024.
# Bounding them with the two changes of ViewPace.single_level and RoundPeers.watch cost +1 s of
# formation p50 and +2 % of round time at N=1,024 in the simulator (3 seeds; sim/README.md,
# "Fewer table reads between rounds", which also says what is known of why).
VIEW_PEERS = 16
OPEN_SLOTS = 64  # open-mark slots per (step, hash): linear counting of averaging peers, ~±15 % up to ~150
COMMITTED, OPEN = "c", "o"


def progress_key(run: str) -> str:
    """The commit marks of every step."""
    return f"{run}/progress"


def opened_key(run: str, step: int) -> str:
    """The open marks of ``step``: read only by the peers training at it."""
    return f"{run}/opened/{step}"


def mark_key(run: str, mark: "Mark") -> str:
    return opened_key(run, mark.step) if mark.kind == OPEN else progress_key(run)


def reads_open_marks(phase: str, gossip: bool) -> bool:
    """Whether a peer in ``phase`` reads the open marks of its step: while it trains, when
    ``near_quorum`` and ``opened_by_others`` decide on them (not while it averages itself, nor in
    gossip mode, which writes none)."""
    return phase != "averaging" and not gossip


def mark_keys(run: str, step: int, phase: str, gossip: bool) -> list[str]:
    """The keys a peer at ``step`` in ``phase`` reads its marks from (one ``get`` each, together)."""
    return [progress_key(run), *([opened_key(run, step)] if reads_open_marks(phase, gossip) else [])]


@dataclass(frozen=True)
class Mark:
    """A step committed (``c``, a subkey of ``<run>/progress``) or a round opened (``o``, a subkey
    of ``<run>/opened/<step>``)."""

    kind: str  # COMMITTED or OPEN
    step: int
    params_sha256: str  # "" in gossip mode
    slot: int = 0  # OPEN marks: the writer's slot (open_slot); 0 for COMMITTED ones

    @property
    def subkey(self) -> str:
        tail = f"/{self.slot}" if self.kind == OPEN else ""
        return f"{self.kind}/{self.step}/{self.params_sha256}{tail}"

    def to_value(self) -> dict:
        return {"kind": self.kind, "step": self.step, "params_sha256": self.params_sha256, "slot": self.slot}

    @classmethod
    def parse(cls, subkey: str, value: dict) -> "Mark | None":
        try:
            mark = cls(str(value["kind"]), int(value["step"]), str(value.get("params_sha256", "")),
                       int(value.get("slot", 0)))
        except (KeyError, TypeError, ValueError):
            return None  # a stranger's malformed value must not break the heartbeat
        # The subkey is what makes a mark idempotent: a value filed under another one is not ours.
        valid = mark.kind == COMMITTED and mark.slot == 0 or mark.kind == OPEN and 0 <= mark.slot < OPEN_SLOTS
        return mark if valid and mark.subkey == subkey else None


def parse_marks(raw: dict[str, dict]) -> frozenset[Mark]:
    return frozenset(m for subkey, value in raw.items() if (m := Mark.parse(subkey, value)) is not None)


def marks_of(me: Position, phase: str, gossip: bool) -> list[Mark]:
    """The marks a peer at ``me`` in ``phase`` stands for (the heartbeat writes each once)."""
    digest = "" if gossip else me.params_hash
    marks = [Mark(COMMITTED, me.step, digest)] if me.step > 0 else []  # step 0: nobody committed anything
    if phase == "averaging" and not gossip:  # gossip never waits for a quorum: nothing to cut for
        marks.append(Mark(OPEN, me.step, digest, open_slot(me.peer_id)))
    return marks


def open_slot(peer_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"open/{peer_id}".encode()).digest()[:4], "big") % OPEN_SLOTS


def relevant(marks: Iterable[Mark], me: Position, step_window: int | None = None) -> frozenset[Mark]:
    """The marks that could change a catch-up or ``behind`` decision for a peer at ``me``: a
    later step committed (in gossip mode, ``step_window`` steps later), or another hash committed
    at ours. Open marks add nothing here: a peer averaging at a later step committed it first."""
    committed = [m for m in marks if m.kind == COMMITTED]
    if step_window is not None:
        return frozenset(m for m in committed if m.step > me.step + step_window)
    return frozenset(m for m in committed
                     if m.step > me.step or (m.step == me.step and m.params_sha256 != me.params_hash))


def fresh_needed(marks: Iterable[Mark], me: Position, step_window: int | None = None) -> bool:
    """Whether a catch-up must read the table: only when some mark could make it download."""
    return bool(relevant(marks, me, step_window))


def open_slots(marks: Iterable[Mark], me: Position) -> set[int]:
    """The filled open slots at our step and hash: peers averaging there, by slot."""
    return {m.slot for m in marks if m.kind == OPEN and m.step == me.step and m.params_sha256 == me.params_hash}


def averaging_estimate(marks: Iterable[Mark], me: Position) -> float:
    """About how many peers are averaging at our step from our hash (linear counting over the
    filled open slots; infinite once every slot is filled)."""
    filled = len(open_slots(marks, me))
    return math.inf if filled >= OPEN_SLOTS else -OPEN_SLOTS * math.log1p(-filled / OPEN_SLOTS)


def opened_by_others(marks: Iterable[Mark], me: Position) -> bool:
    """Whether an open mark says that another peer is averaging at our step from our hash. Our
    own slot is left out: the mark of our own failed round at this step lives on for a
    matchmaking timeout, and a peer sharing our slot is seen in the next full read anyway."""
    return bool(open_slots(marks, me) - {open_slot(me.peer_id)})


def near_quorum(marks: Iterable[Mark], me: Position, same: int, quorum: float) -> bool:
    """Whether ``decisions.outpaced`` may be true: the peers averaging at our step and hash may
    number half of those it needs, ``same`` being the other peers at our step with our hash in the
    last full view. Half, so that the estimate's error and the view's age never hide a quorum."""
    estimate = averaging_estimate(marks, me)
    needed = max(1, math.ceil(quorum * (same + 1)) - 1)
    return estimate > 0 and estimate >= needed / 2


def full_read_every(peers: int) -> int:
    """Heartbeats between two periodic full reads, for a swarm of ``peers`` peers."""
    return max(1, math.ceil(peers / VIEW_PEERS))


def beat_offset(peer_id: str, every: int) -> int:
    """This peer's beat in the cycle of ``every``: spread evenly over the swarm by peer id, so the
    table's holders serve about N / every reads per beat rather than N at once."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big") % every


class MarkWriter:
    """Which marks a peer must store now: each mark it stands for once when it starts to, and
    again at half its TTL while it still does (a few stores per round, never one per beat)."""

    def __init__(self, gossip: bool, matchmaking_timeout: float, heartbeat: float) -> None:
        self.gossip = gossip
        self.matchmaking_timeout = matchmaking_timeout
        self.heartbeat = heartbeat
        self.written: dict[Mark, float] = {}  # marks we stand for -> when we stored them

    def ttl(self, mark: Mark) -> float:
        """A commit mark: long enough for every peer to read it at a heartbeat while a round of
        its step lasts. An open mark: the matchmaking timeout, so a failed round's marks do not
        keep the slower peers reading the table long after it."""
        return self.matchmaking_timeout + (3 * self.heartbeat if mark.kind == COMMITTED else 0.0)

    def due(self, me: Position, phase: str, now: float) -> list[Mark]:
        wanted = marks_of(me, phase, self.gossip)
        self.written = {m: t for m, t in self.written.items() if m in wanted}  # a mark stood for again is new
        return [m for m in wanted if now - self.written.get(m, -math.inf) >= self.ttl(m) / 2]

    def stored(self, mark: Mark, now: float) -> None:
        self.written[mark] = now


class ViewPace:
    """Per heartbeat: read the whole table, or only the progress record (module docstring)."""

    def __init__(self, peer_id: str, quorum: float, step_window: int | None = None, group_size: int = 0) -> None:
        self.peer_id = peer_id
        self.quorum = quorum  # [sync] quorum, as outpaced() reads it
        self.step_window = step_window  # gossip mode: the steps it catches up with by mixing
        self.group_size = group_size  # [sync] group_size with bucketed matchmaking, else 0 (every step single-level)
        self.beat = 0
        self.seen: frozenset[Mark] = frozenset()  # relevant marks known when the last full read was made
        self.full_reads = 0
        self.view_wanted = False  # a leader looked at the view since the last beat (want_view)

    def want_view(self) -> None:
        """A bucket leader or step coordinator looked at the heartbeat's view (``RoundPeers.latest``)
        and will look again: the next beat reads the table. Called at every look, so a leader
        gets a view at most a beat old for as long as it leads, and nobody else pays for it."""
        self.view_wanted = True

    def full_read_due(self, peers: int, has_view: bool, me: Position, phase: str, marks: Iterable[Mark],
                      same: int = 0) -> str | None:
        """Why this beat must read the table, or None. Call once per beat, with the marks read
        at this beat; ``peers``: in the last full view, ``same``: those of them (but us) at our
        step with our hash."""
        beat, self.beat = self.beat, self.beat + 1
        wanted, self.view_wanted = self.view_wanted, False
        marks = frozenset(marks)
        every = full_read_every(peers)
        if not has_view:
            return "no view yet"
        if wanted:
            return "a leader waits on the view"  # RoundPeers.latest: who is still coming
        if phase == "training" and self.step_window is None and self.single_level(peers) \
                and near_quorum(marks, me, same, self.quorum):
            return "near quorum"  # outpaced() can turn true at any beat now
        if phase != "averaging" and relevant(marks, me, self.step_window) - self.seen:
            # behind / a catch-up target changed since the last full read. Not while we average:
            # the round's end decides then (a commit makes a later step's mark our own; a failed
            # round's catch-up reads afresh when a mark says so, fresh_needed), and a mark still
            # relevant after the round is read at the first beat of the next phase.
            return "progress"
        if beat % every == beat_offset(self.peer_id, every):
            return "periodic"  # liveness for reconnects and metrics, and any mark we could not see
        return None

    def single_level(self, peers: int) -> bool:
        """Whether the steps of a swarm of ``peers`` matchmake with one leader, whose quorum is
        the step's: only then does ``outpaced`` need a fresh view near that quorum. (The swarm's
        size, not the peers at our step in the last view: between periodic reads that view is
        rounds old and shows few peers at our step.)

        In a bucketed step (protocol/buckets.py) each bucket leader closes on its own bucket's
        quorum, and a member that comes after its bucket closed still reaches the step's plan
        through the top level until the plan closes; the cut that gets a slow peer there is
        ``decisions.join_by``, which the open marks start without a table read. Reading the
        whole table at every beat to judge a swarm-wide quorum bought nothing there: in the
        simulator at N=1,024 in groups of 16 (4 rounds, seed 0) those reads were a third of the
        records a peer read and ``outpaced`` cut 24 of about 4,000 inner phases; without them it
        cut 1, with the same share averaged (0.999-1.00). (What the three bounds on the table
        reads cost together in formation time is measured in sim/README.md.)"""
        return bucket_count(peers, self.group_size) == 1

    def read_full(self, marks: Iterable[Mark], me: Position) -> None:
        """A full read was made, knowing ``marks``: they are accounted for by that view."""
        self.seen = relevant(marks, me, self.step_window)
        self.full_reads += 1
