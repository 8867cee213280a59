"""Tell the volunteer when peers cannot reach this node (protocol/reachability.py asks them).

A node whose gRPC port other peers cannot reach still dials them, joins groups and trains; its
rounds then stall for their deadline and its shards are left out, and every connection error
lands in the other peers' logs, not in its own. So once the node serves, it asks a few peers of
the swarm to dial it back, until one check is done (the first peer of a swarm asks when the next
one arrives), and says the answer once: an info line when a peer reached it, a warning that names
the address and the fixes when the peers that tried could not. ``lowcomm_grpc_reachable`` keeps it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field
from typing import Callable

import grpc

from lowcomm.protocol.reachability import DIAL_TIMEOUT_SECONDS, ask_dial_back, split_address

from .swarm import SwarmView

log = logging.getLogger("lowcomm.node")

RETRY_SECONDS = 5.0  # no peer to ask yet (no call: a look at the view), or none answered: ask again after this
PEERS_PER_TRY = 3
ASK_TIMEOUT_SECONDS = DIAL_TIMEOUT_SECONDS + 5.0


@dataclass
class Answers:
    """What the peers asked in one try said."""

    reached_by: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # peer -> why it could not reach us
    unchecked: dict[str, str] = field(default_factory=dict)  # peer -> why it did not dial
    observed: dict[str, str] = field(default_factory=dict)  # peer -> our host as it sees us

    @property
    def done(self) -> bool:
        return bool(self.reached_by or self.failed)

    def why_unreachable(self, address: str) -> str:
        """For ``status``: our address and the first failure, when no peer reached us; else ""."""
        if self.reached_by or not self.failed:
            return ""
        peer, why = next(iter(self.failed.items()))
        return f"{address}: {peer} could not connect ({why})"


class ReachabilityCheck:
    def __init__(self, peer_id: str, address: str, view: Callable[[], SwarmView],
                 channel: Callable[[str], grpc.aio.Channel], set_reachable: Callable[[float], None],
                 retry_seconds: float = RETRY_SECONDS) -> None:
        """``address``: our gRPC address as peers are told it; ``view``: the latest swarm view;
        ``channel``: a channel to a peer's address (with the run's tokens and TLS)."""
        self.peer_id = peer_id
        self.address = address
        self.view = view
        self.channel = channel
        self.set_reachable = set_reachable
        self.retry_seconds = retry_seconds
        self._said_unchecked = False

    async def run(self) -> Answers:
        """Ask until a peer has dialled (or failed to dial) us; say the answer; return it."""
        while True:
            answers = await self.ask_some()
            if answers.done:
                self.report(answers)
                return answers
            if answers.unchecked and not self._said_unchecked:
                self._say_unchecked(answers)
            await asyncio.sleep(self.retry_seconds)

    async def ask_some(self) -> Answers:
        candidates = [p for p in self.view().peers.values()
                      if p.peer_id != self.peer_id and p.address and p.address != self.address and not p.leaving]
        answers = Answers()
        for peer in random.sample(candidates, min(PEERS_PER_TRY, len(candidates))):
            try:
                reply = await ask_dial_back(self.channel(peer.address), self.address, ASK_TIMEOUT_SECONDS)
            except grpc.aio.AioRpcError as err:  # that peer is away, or older (UNIMPLEMENTED): ask another
                log.debug("could not ask %s to dial us back: %s", peer.peer_id, err.code().name)
                continue
            answers.observed[peer.peer_id] = reply.observed_host
            if not reply.checked:
                answers.unchecked[peer.peer_id] = reply.error
            elif reply.reachable:
                answers.reached_by.append(peer.peer_id)
            else:
                answers.failed[peer.peer_id] = reply.error
        return answers

    def report(self, answers: Answers) -> None:
        if answers.reached_by:
            self.set_reachable(1.0)
            log.info("peers reach this node's gRPC server at %s (%s dialled it back)", self.address,
                     answers.reached_by[0], extra={"event": "reachable", "address": self.address,
                                                   "reached_by": answers.reached_by})
            return
        self.set_reachable(0.0)
        peer, why = next(iter(answers.failed.items()))
        _, port = split_address(self.address)
        log.warning(
            "peers cannot reach this node's gRPC server at %s (%s could not: %s), so rounds will wait for it until "
            "their deadline and leave its part out: accept inbound TCP connections on port %s (firewall; behind "
            "NAT forward the port), or set --announce-host to an address of this machine that peers reach (%s "
            "sees its calls come from %s), or join with --client-mode, which trains without serving",
            self.address, peer, why, port, peer, answers.observed.get(peer) or "?",
            extra={"event": "unreachable", "address": self.address, "failed": answers.failed,
                   "observed": answers.observed})

    def _say_unchecked(self, answers: Answers) -> None:
        """No peer dialled: each saw our calls come from another host than the one we announce.
        Behind one NAT with our public address announced that is expected; otherwise the
        announced host is not this machine's."""
        self._said_unchecked = True
        peer, why = next(iter(answers.unchecked.items()))
        log.warning("could not check that peers reach this node's gRPC server at %s: %s said %s; if that host is "
                    "not this machine's address, correct --announce-host", self.address, peer, why,
                    extra={"event": "reachability_unchecked", "address": self.address,
                           "unchecked": answers.unchecked, "observed": answers.observed})
