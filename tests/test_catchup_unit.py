"""The node's catch-up without sockets: a stop abandons a state download or a fetch of the
missed rounds in flight."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from lowcomm.node import catchup
from lowcomm.node.config import load_config


def test_a_stop_abandons_a_state_download_in_flight_and_leaves_the_state_alone(monkeypatch, caplog):
    # A first Ctrl-C waited for the whole download (minutes for a large model) before stopping.
    began, ended = asyncio.Event(), []

    async def endless_download(*args, **kwargs):
        began.set()
        try:
            await asyncio.Event().wait()
        finally:
            ended.append("cancelled")

    monkeypatch.setattr(catchup, "download_state", endless_download)
    state = SimpleNamespace(step=3)
    stop = asyncio.Event()
    catch_up = catchup.CatchUp(
        load_config(environ={}), None, SimpleNamespace(numel=10), state, swarm=None, averager=None, channels=None,
        donor=None, train_thread=None, codec_executor=None, metrics=None, stats=None, gossip=False,
        must_download=False, stop_requested=stop)

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
    began, ended = asyncio.Event(), []

    async def endless_fetch(*args, **kwargs):
        began.set()
        try:
            await asyncio.Event().wait()
        finally:
            ended.append("cancelled")

    async def no_download(*args, **kwargs):
        raise AssertionError("a stopped catch-up downloaded the state")

    monkeypatch.setattr(catchup, "fetch_missed_rounds", endless_fetch)
    monkeypatch.setattr(catchup, "download_state", no_download)
    state = SimpleNamespace(step=3, published=lambda: (3, b"base"))
    stop = asyncio.Event()
    catch_up = catchup.CatchUp(
        load_config(environ={}), None, SimpleNamespace(numel=10), state, swarm=None, averager=None, channels=None,
        donor=None, train_thread=None, codec_executor=None, metrics=None, stats=None, gossip=False,
        must_download=False, stop_requested=stop)

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
