"""Where a node's p2pd keeps its unix sockets (node/dht.py ``place_p2pd_sockets``): in TMPDIR,
as other programs keep temporary files, so that the sockets a SIGKILLed node leaves behind are
where its user (or the test suite, tests/conftest.py) cleans up, not in /tmp for good."""

from __future__ import annotations

import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from lowcomm.node import dht


@pytest.fixture
def restore_prefix():
    from hivemind.p2p import P2P

    before = P2P._UNIX_SOCKET_PREFIX
    yield P2P
    P2P._UNIX_SOCKET_PREFIX = before


def test_a_folder_whose_socket_paths_fit_is_used_and_a_longer_one_keeps_hiveminds(restore_prefix):
    default = restore_prefix._UNIX_SOCKET_PREFIX
    too_long = "/tmp/" + "x" * 70  # with hivemind's longest socket name, past the 107 bytes of sun_path
    assert not dht.place_p2pd_sockets(too_long)
    assert restore_prefix._UNIX_SOCKET_PREFIX == default
    assert dht.place_p2pd_sockets("/tmp/lct-abc/")
    assert restore_prefix._UNIX_SOCKET_PREFIX == "/unix/tmp/lct-abc/hivemind-"


@pytest.mark.multiprocess
def test_a_node_keeps_its_p2pd_sockets_in_its_tmpdir_and_removes_them_when_stopped(swarm):
    folder = Path(tempfile.mkdtemp(prefix="lct-node-", dir="/tmp"))
    try:
        node = swarm.start(0, env={"TMPDIR": str(folder)})
        node.ready()
        # The daemon's socket (the node's DHT process starts one p2pd; hivemind opens its client
        # socket only when it serves a stream, beside it).
        assert [p.name for p in folder.glob("hivemind-p2pd-*.sock")], list(folder.iterdir())
        node.signal(signal.SIGTERM)
        assert node.wait_exit(timeout=30) == 0
        assert not list(folder.glob("hivemind-*.sock")), "a node stopped cleanly leaves no socket behind"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
