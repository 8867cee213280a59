"""The node's catch-up without sockets: a stop abandons a state download in flight."""

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
