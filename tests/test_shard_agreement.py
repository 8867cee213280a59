"""The shard-agreement rule (protocol/agreement.py) without sockets: members exchange reports
through an in-memory transport that runs the real ReportShards handler, and every test asserts
which shards each member applies."""

from __future__ import annotations

import asyncio
import time

import pytest

from lowcomm.protocol import agreement as agreement_mod
from lowcomm.protocol._pb.lowcomm.v1 import averaging_pb2
from lowcomm.protocol.agreement import AgreementBook, ReportFailed, ShardAgreement, agree
from lowcomm.protocol.transport import Refused

GROUP = b"g" * 16


# The handler refuses a report by raising Refused (protocol/transport.py), not through the context.
Aborted = Refused


class FakeContext:
    async def abort(self, code, detail: str) -> None:
        raise Aborted(code, detail)


class Network:
    """Members by address; ``down`` addresses refuse at once (a dead process), ``silent`` ones
    never answer (a hung one); ``delivered`` records (caller, callee) of reports that arrived."""

    def __init__(self) -> None:
        self.books: dict[str, AgreementBook] = {}
        self.down: set[str] = set()
        self.silent: set[str] = set()
        self.delivered: list[tuple[str, str]] = []
        self.on_deliver = None  # called with (caller, callee) before the callee handles it

    def sender_for(self, caller: str):
        async def send(address: str, report: averaging_pb2.ShardReport, timeout: float) -> averaging_pb2.ShardReport:
            if address in self.down:
                raise ReportFailed("UNAVAILABLE: connection refused")
            if address in self.silent:
                await asyncio.Event().wait()
            self.delivered.append((caller, address))
            if self.on_deliver is not None:
                self.on_deliver(caller, address)
            try:
                return await self.books[address].handle(averaging_pb2.ShardReport.FromString(report.SerializeToString()),
                                                        FakeContext())
            except Aborted as err:
                raise ReportFailed(str(err)) from None
        return send


def members(*names: str) -> list[str]:
    return list(names)


async def run_members(outcomes: dict[str, tuple[list[bool], list[bool]]], reachable: set[str], net: Network,
                      seconds: float = 5.0, quorum: float = 1.0, start_delay: dict[str, asyncio.Event] | None = None,
                      absent: set[str] = frozenset()) -> dict[str, list[bool]]:
    """Every member in ``outcomes`` (peer -> (held, skip)) runs ``agree``; ``absent`` members are
    in the group but never run (dead before the exchange). Returns peer -> shards applied."""
    names = sorted(set(outcomes) | set(absent))
    shards = len(next(iter(outcomes.values()))[0])
    agreements = {}
    for name in outcomes:
        net.books.setdefault(name, AgreementBook())
        agreements[name] = ShardAgreement(GROUP, name, names, shards, time.monotonic() + seconds,
                                          reachable=None if name in reachable else reachable)
        net.books[name].open(agreements[name])

    async def one(name: str) -> list[bool]:
        if start_delay and name in start_delay:
            await start_delay[name].wait()
        held, skip = outcomes[name]
        others = {n: n for n in names if n in reachable and n != name}
        return await agree(agreements[name], held, skip, time.monotonic() + seconds, others, net.sender_for(name),
                           quorum)

    results = await asyncio.gather(*(one(n) for n in outcomes))
    return dict(zip(outcomes, results))


def run(coro, limit: float = 20.0):
    async def bounded():
        async with asyncio.timeout(limit):
            return await coro
    return asyncio.run(bounded())


T, F = True, False
ALL = ([T, T, T], [F, F, F])
LOST_1 = ([T, F, T], [F, T, F])  # lost shard 1 through the owner's fault: asks to skip it
REFUSED_1 = ([T, F, T], [F, F, F])  # lacks shard 1 because its own contribution was refused


def test_everybody_holding_everything_applies_everything():
    net = Network()
    got = run(run_members({"a": ALL, "b": ALL, "c": ALL}, {"a", "b", "c"}, net))
    assert got == {p: [T, T, T] for p in "abc"}


def test_one_member_that_lost_a_shard_makes_everybody_skip_it():
    net = Network()
    got = run(run_members({"a": ALL, "b": LOST_1, "c": ALL}, {"a", "b", "c"}, net))
    assert got == {p: [T, F, T] for p in "abc"}


def test_a_refused_contribution_costs_only_its_sender():
    net = Network()
    got = run(run_members({"a": ALL, "b": REFUSED_1, "c": ALL}, {"a", "b", "c"}, net))
    assert got == {"a": [T, T, T], "b": [T, F, T], "c": [T, T, T]}


def test_client_members_learn_each_others_skips_through_a_reachable_member():
    """Client-mode members cannot call each other: the reachable member's answer relays them,
    and they do not wait for each other (run() gives up long before the 60 s deadline)."""
    net = Network()
    got = run(run_members({"r": ALL, "c1": LOST_1, "c2": ALL}, {"r"}, net, seconds=60.0))
    assert got == {p: [T, F, T] for p in ("r", "c1", "c2")}
    assert ("c1", "c2") not in net.delivered and ("c2", "c1") not in net.delivered


def test_a_dead_member_is_not_waited_for():
    """A member that died before the exchange (its calls refused) holds nobody up: the others
    decide long before the deadline and apply what they all hold."""
    net = Network()
    net.down.add("dead")
    # run() gives up after 20 s: waiting for the 60 s deadline would fail the test.
    got = run(run_members({"a": ALL, "b": ALL}, {"a", "b", "dead"}, net, seconds=60.0, quorum=1.0,
                          absent={"dead"}))
    assert got == {"a": [T, T, T], "b": [T, T, T]}


def test_a_member_that_dies_after_reaching_one_member_is_relayed_to_the_others():
    """b lost shard 1, reached a with its report, then died before reaching c. c still skips
    shard 1: a's report to c (its request and its answer) carries b's skip."""
    net = Network()
    reached = asyncio.Event()

    def on_deliver(caller: str, callee: str) -> None:
        if caller == "b" and callee == "a":
            net.down.add("b")  # b is gone from now on: its call to c fails, and c's call to b too
            reached.set()

    net.on_deliver = on_deliver

    async def scenario():
        names = ["a", "b", "c"]
        books = {n: AgreementBook() for n in names}
        net.books.update(books)
        deadline = time.monotonic() + 5.0
        ags = {n: ShardAgreement(GROUP, n, names, 3, deadline) for n in names}
        for n in names:
            books[n].open(ags[n])

        async def b_reports_to_a_then_dies():
            ags["b"].own(*LOST_1, deadline)
            try:
                await net.sender_for("b")("a", ags["b"].report(), 5.0)
            except ReportFailed:
                pass

        b_task = asyncio.create_task(b_reports_to_a_then_dies())
        await reached.wait()
        # c starts only after b is gone, so it can only learn of b's skip through a.
        got = await asyncio.gather(agree(ags["a"], *ALL, deadline, {"b": "b", "c": "c"}, net.sender_for("a")),
                                   agree(ags["c"], *ALL, deadline, {"a": "a", "b": "b"}, net.sender_for("c")))
        b_task.cancel()
        await asyncio.gather(b_task, return_exceptions=True)
        return got

    a, c = run(scenario())
    assert a == c == [T, F, T]


def test_a_slow_member_aligns_with_the_decision_it_gets_back():
    """The others decide without a slow member (grace after the quorum); when its report comes
    late, their answers carry the decision, and it applies the same shards."""
    net = Network()
    go = asyncio.Event()

    async def scenario():
        task = asyncio.create_task(run_members({"a": LOST_1, "b": ALL, "slow": ALL}, {"a", "b", "slow"}, net,
                                               seconds=30.0, quorum=0.5, start_delay={"slow": go}))
        while any(n not in net.books or net.books[n].get(GROUP) is None for n in "ab"):
            await asyncio.sleep(0)  # run_members opens the rounds before its first await
        # a and b decide after the grace following their quorum of one report each.
        await asyncio.gather(*(net.books[n].get(GROUP).decided.wait() for n in "ab"))
        go.set()
        return await task

    got = run(scenario())
    assert got == {p: [T, F, T] for p in ("a", "b", "slow")}


def test_a_member_that_abandons_the_round_vetoes_nothing():
    net = Network()

    async def scenario():
        names = ["a", "b", "gone"]
        for n in names:
            net.books[n] = AgreementBook()
        deadline = time.monotonic() + 5.0
        ags = {n: ShardAgreement(GROUP, n, names, 3, deadline) for n in names}
        for n in names:
            net.books[n].open(ags[n])
        ags["gone"].abandon()  # e.g. shutting down: its handler answers ABORTED
        return await asyncio.gather(
            agree(ags["a"], *ALL, deadline, {"b": "b", "gone": "gone"}, net.sender_for("a")),
            agree(ags["b"], *ALL, deadline, {"a": "a", "gone": "gone"}, net.sender_for("b")))

    assert run(scenario()) == [[T, T, T], [T, T, T]]


def test_a_hung_member_costs_at_most_the_grace_after_the_quorum():
    """A member that never answers (a hung process) is given up after the grace that follows the
    quorum, not the 60 s deadline (run() gives up after 20 s)."""
    net = Network()
    net.silent.add("hung")
    got = run(run_members({"a": ALL, "b": LOST_1}, {"a", "b", "hung"}, net, seconds=60.0, quorum=0.5,
                          absent={"hung"}))
    assert got == {"a": [T, F, T], "b": [T, F, T]}


def test_reports_are_checked_and_late_ones_get_the_decision():
    async def scenario():
        book = AgreementBook()
        ag = ShardAgreement(GROUP, "a", ["a", "b", "c"], 2, time.monotonic() + 5)
        book.open(ag)
        ctx = FakeContext()
        bad = [
            averaging_pb2.ShardReport(group_id=GROUP, sender_peer_id="x", skip=[F, F]),  # not a member
            averaging_pb2.ShardReport(group_id=GROUP, sender_peer_id="a", skip=[F, F]),  # the callee itself
            averaging_pb2.ShardReport(group_id=GROUP, sender_peer_id="b", skip=[F]),  # wrong length
        ]
        for report in bad:
            with pytest.raises(Aborted) as err:
                await book.handle(report, ctx)
            assert err.value.code.name == "INVALID_ARGUMENT"
        agreement_mod.FIND_TIMEOUT, saved = 0.05, agreement_mod.FIND_TIMEOUT
        try:
            with pytest.raises(Aborted) as err:
                await book.handle(averaging_pb2.ShardReport(group_id=b"other", sender_peer_id="b", skip=[F, F]), ctx)
            assert err.value.code.name == "NOT_FOUND"
        finally:
            agreement_mod.FIND_TIMEOUT = saved
        ag.own([T, T], [F, F], time.monotonic() + 5)
        ag.hear("b", [F, T])
        assert ag.decide() == [T, F]
        # After the decision a late report changes nothing and is answered with the decision.
        late = await book.handle(averaging_pb2.ShardReport(group_id=GROUP, sender_peer_id="c", skip=[T, F]), ctx)
        assert list(late.skip) == [F, T] and late.sender_peer_id == "a"
        assert ag.decide() == [T, F]

    run(scenario())


def test_only_recent_rounds_are_kept():
    book = AgreementBook()
    for i in range(agreement_mod.KEPT_ROUNDS + 2):
        book.open(ShardAgreement(bytes([i]) * 16, "a", ["a"], 1, 0.0))
    assert book.get(bytes([0]) * 16) is None and book.get(bytes([1]) * 16) is None
    assert book.get(bytes([agreement_mod.KEPT_ROUNDS + 1]) * 16) is not None
