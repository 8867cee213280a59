"""The node's catch-up without sockets: a stop abandons a state download or a fetch of the
missed rounds in flight; catch-ups follow a download the swarm outpaced; the handshake with a
swarm of another run config."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import grpc
import pytest

from lowcomm.node import catchup, decisions
from lowcomm.node.config import load_config
from lowcomm.node.decisions import Position
from lowcomm.node.errors import FatalError
from lowcomm.node.metrics import NodeMetrics
from lowcomm.node.swarm import PeerRecord, SwarmView

OWN_RECORD = {"address": "127.0.0.1:7701", "outer_step": 0, "params_sha256": "h0"}
A_PEER = "/ip4/127.0.0.1/tcp/7700/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


class EndlessFetch:
    """A download from the swarm that never ends: ``began`` once called, ``ended`` once cancelled."""

    def __init__(self) -> None:
        self.began, self.ended = asyncio.Event(), []

    async def __call__(self, *args, **kwargs):
        self.began.set()
        try:
            await asyncio.Event().wait()
        finally:
            self.ended.append("cancelled")


def catch_up_of(state, stop: asyncio.Event) -> catchup.CatchUp:
    """A CatchUp with nothing behind it but ``state`` and the stop event."""
    return catchup.CatchUp(
        load_config(environ={}), None, SimpleNamespace(numel=10), state, swarm=None, averager=None, channels=None,
        donor=None, train_thread=None, codec_executor=None, metrics=NodeMetrics(), stats=None, gossip=False,
        must_download=False, stop_requested=stop)


def test_a_stop_abandons_a_state_download_in_flight_and_leaves_the_state_alone(monkeypatch, caplog):
    # A first Ctrl-C waited for the whole download (minutes for a large model) before stopping.
    endless_download = EndlessFetch()
    began, ended = endless_download.began, endless_download.ended
    monkeypatch.setattr(catchup, "download_state", endless_download)
    state = SimpleNamespace(step=3)
    stop = asyncio.Event()
    catch_up = catch_up_of(state, stop)

    async def main() -> None:
        download = asyncio.create_task(catch_up._download(5, None, []))
        await began.wait()
        stop.set()
        await asyncio.wait_for(download, 10)  # returns: nothing adopted, nothing raised

    caplog.set_level("INFO", logger="lowcomm.node")
    asyncio.run(main())
    assert ended == ["cancelled"]  # nothing of the download runs on
    assert state.step == 3
    assert "the state download of step 5 is abandoned (staying at step 3)" in caplog.text


def test_a_stop_abandons_a_fetch_of_missed_rounds_and_downloads_nothing_instead(monkeypatch, caplog):
    # The initial catch-up's other network part: a stop waited for the fetch's timeout (60 s or
    # more against a donor that does not answer), then the node went on to download the state.
    endless_fetch = EndlessFetch()
    began, ended = endless_fetch.began, endless_fetch.ended

    async def no_download(*args, **kwargs):
        raise AssertionError("a stopped catch-up downloaded the state")

    monkeypatch.setattr(catchup, "fetch_missed_rounds", endless_fetch)
    monkeypatch.setattr(catchup, "download_state", no_download)
    state = SimpleNamespace(step=3, published=lambda: (3, b"base"))
    stop = asyncio.Event()
    catch_up = catch_up_of(state, stop)

    async def main() -> bool:
        fetch = asyncio.create_task(catch_up._apply_missed_rounds(5, "ab" * 32, []))
        await began.wait()
        stop.set()
        return await asyncio.wait_for(fetch, 10)

    caplog.set_level("INFO", logger="lowcomm.node")
    assert asyncio.run(main()) is True  # handled: the caller downloads nothing instead
    assert ended == ["cancelled"]
    assert state.step == 3
    assert "fetching the missed rounds of steps 3-4 is abandoned (staying at step 3)" in caplog.text


class EmptySwarm:
    """The DHT joined through --peers holds no record of this run (another [run] name) but our
    own (published at our announce, before the catch-up)."""

    def __init__(self) -> None:
        self.reads = 0

    async def refresh_view(self):
        self.reads += 1
        return SwarmView({"me": PeerRecord.parse("me", OWN_RECORD)}, {}, 0.0)

    def position(self):
        return Position("me", 0, "h0")


def test_a_node_that_finds_no_peer_of_its_run_through_its_peers_says_to_check_the_run_name(monkeypatch, caplog):
    # A mistyped [run] name trained alone beside the swarm it was pointed at, without a word.
    real_sleep = asyncio.sleep
    monkeypatch.setattr(catchup.asyncio, "sleep", lambda seconds: real_sleep(0))  # the records' grace
    swarm = EmptySwarm()
    config = load_config(overrides=["run.name=mistyped"], environ={"LOWCOMM_PEERS": A_PEER})
    catch_up = catchup.CatchUp(
        config, SimpleNamespace(peer_id="me"), SimpleNamespace(numel=10), SimpleNamespace(step=0), swarm=swarm,
        averager=None, channels=None, donor=None, train_thread=None, codec_executor=None, metrics=None, stats=None,
        gossip=False, must_download=False, stop_requested=asyncio.Event())
    caplog.set_level("INFO", logger="lowcomm.node")
    asyncio.run(catch_up.run(initial=True))
    assert swarm.reads == 9  # the first read and 8 more over the records' grace
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no peer of run 'mistyped' is in the DHT joined through --peers" in warnings[0]
    assert "[run] name" in warnings[0]


class MovingSwarm:
    """A swarm whose one other peer is at the next of ``steps`` at each read."""

    def __init__(self, state, steps: list[int]) -> None:
        self.state, self.steps = state, list(steps)

    def view_at(self, step: int) -> SwarmView:
        other = PeerRecord("other", "127.0.0.1:1", step, f"h{step}", 1.0, 1.0, 1, "f", "training")
        return SwarmView({"other": other}, {}, 0.0)

    async def refresh_view(self):
        return self.view_at(self.steps.pop(0))

    def position(self):
        return Position("me", self.state.step, f"h{self.state.step}")


def test_a_download_the_swarm_outpaced_is_followed_at_once_by_the_next_catch_up(caplog):
    # A joiner on a slow link trained a whole phase from the state it had just downloaded, found
    # itself behind again at the boundary and downloaded again: it chased the swarm for ever.
    state = SimpleNamespace(step=0)
    swarm = MovingSwarm(state, [15, 16])  # during the download of step 10 the swarm got to 15, then 16
    catch_up = catch_up_of(state, asyncio.Event())
    catch_up.swarm = swarm
    downloads, missed = [], []

    async def download(step, digest, donors):
        downloads.append(step)
        state.step = step
        return True

    async def apply_missed_rounds(step, digest, donors):
        if 0 < step - state.step <= catchup.KEPT_ROUNDS:
            missed.append(step)
            state.step = step
            return True
        return False

    catch_up._download, catch_up._apply_missed_rounds = download, apply_missed_rounds
    plan = decisions.catch_up_target(swarm.view_at(10), swarm.position())
    caplog.set_level("INFO", logger="lowcomm.node")
    asyncio.run(catch_up._catch_up(plan))
    assert downloads == [10, 15] and missed == [16] and state.step == 16
    outpaced = [r for r in caplog.records if getattr(r, "event", "") == "download_outpaced"]
    assert len(outpaced) == 1 and "the swarm made 5 step(s) during this" in outpaced[0].getMessage()


def test_a_node_the_swarm_outpaces_every_time_says_why_and_pauses_before_it_tries_again(caplog, monkeypatch):
    # Downloading on and on kept the donors busy for nothing (26 MB every 45 s at 5 Mbit/s).
    now = [1000.0]
    monkeypatch.setattr(catchup.time, "monotonic", lambda: now[0])
    state = SimpleNamespace(step=0)
    swarm = MovingSwarm(state, [20, 30, 40, 50, 60, 70, 80, 90])
    catch_up = catch_up_of(state, asyncio.Event())
    catch_up.swarm, catch_up.stats = swarm, SimpleNamespace(phase="training")
    swarm.current_view = swarm.refresh_view
    downloads = []

    async def download(step, digest, donors):
        downloads.append(step)
        state.step = step
        now[0] += 45.0
        return True

    async def no_missed_rounds(step, digest, donors):
        return False

    catch_up._download, catch_up._apply_missed_rounds = download, no_missed_rounds
    caplog.set_level("INFO", logger="lowcomm.node")
    asyncio.run(catch_up._catch_up(decisions.catch_up_target(swarm.view_at(10), swarm.position())))
    assert downloads == [10, 20, 30][:1 + catchup.MORE_CATCH_UPS]
    said = [r.getMessage() for r in caplog.records if getattr(r, "event", "") == "download_outpaced"]
    assert len(said) == 1 + catchup.MORE_CATCH_UPS, said  # every download of the chain, the last with the pause
    assert said[-1].startswith("this node cannot keep up with the swarm: a state download takes about 45 s, in "
                               "which the swarm makes 10 steps") and "5x faster" in said[-1]
    assert said[-1].endswith(f"trying again in {catchup.OUTPACED_PAUSE_FIRST:.0f} s")
    # Until then a round boundary tries nothing; after it, the next chain, paused twice as long.
    asyncio.run(catch_up.run())
    assert len(downloads) == 3
    now[0] += catchup.OUTPACED_PAUSE_FIRST
    asyncio.run(catch_up.run())
    assert len(downloads) == 6 and catch_up.retry_at == now[0] + 2 * catchup.OUTPACED_PAUSE_FIRST


def test_a_download_says_when_it_starts_how_far_it_is_and_counts_its_bytes_as_they_come(caplog):
    now = [0.0]
    metrics = NodeMetrics()
    caplog.set_level("INFO", logger="lowcomm.node")
    progress = catchup.DownloadProgress(7, 26_000_000, 2, metrics.state_download_bytes, clock=lambda: now[0])
    now[0] = 5.0
    progress(2_000_000, 26_000_000)  # too soon for a line
    now[0] = catchup.PROGRESS_EVERY_SECONDS + 1.0
    progress(6_500_000, 26_000_000)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["downloading the swarm's state of step 7 (26.0MB) from 2 donor(s)",
                     "downloading step 7: 6.5MB of 26.0MB (25 %), 406.2KB/s, about 48 s left"]
    assert metrics.state_download_bytes._value.get() == 6_500_000
    assert progress.said() == "6.5MB of 26.0MB (25 %)"


def test_a_refused_joiners_leftover_record_does_not_let_the_same_command_skip_the_handshake(monkeypatch):
    # The same command run again after a refusal found the first attempt's record ("starting",
    # same run config as its own) and took it for a peer to average with: no handshake, and it
    # trained alone with exit code 0 while the swarm's peer waited.
    asked = []

    class RefusingStub:
        def __init__(self, channel) -> None:
            pass

        async def GetStateInfo(self, request, timeout):
            asked.append(request)
            raise grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="peer QmThem runs a different run config than peer QmMe: [train] lr")

    monkeypatch.setattr(catchup.state_pb2_grpc, "StateTransferStub", RefusingStub)
    leftover = PeerRecord("QmEarlier", "127.0.0.1:2", 0, "h0", 0.0, 0.0, 1, "f", "starting")
    swarm_peer = PeerRecord("QmThem", "127.0.0.1:3", 0, "h9", 0.0, 0.0, 1, "other", "waiting")
    view = SwarmView({"QmEarlier": leftover}, {"QmThem": swarm_peer}, 0.0)
    catch_up = catch_up_of(SimpleNamespace(step=0), asyncio.Event())
    catch_up.identity = SimpleNamespace(peer_id="QmMe", hello=lambda: None)
    catch_up.channels = lambda address: None
    with pytest.raises(FatalError, match=r"refused by the swarm: .*\[train\] lr"):
        asyncio.run(catch_up._handshake(view))
    assert len(asked) == 1
    # A settled peer of our own run: nothing to check.
    settled = PeerRecord("QmFriend", "127.0.0.1:4", 0, "h0", 0.0, 0.0, 1, "f", "training")
    asyncio.run(catch_up._handshake(SwarmView({"QmFriend": settled}, {"QmThem": swarm_peer}, 0.0)))
    assert len(asked) == 1
