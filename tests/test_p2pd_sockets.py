"""Where a node's p2pd keeps its unix sockets (node/dht.py ``place_p2pd_sockets``): in the node's
temp folder in TMPDIR, as other programs keep temporary files, and what happens to that folder
when the node is killed outright: the next node to start removes it (node/tempdir.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import psutil
import pytest

from lowcomm.node import dht, tempdir


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


@pytest.fixture
def node_tmpdir():
    """A TMPDIR of the test's own for its nodes: short, under /tmp (socket paths must fit)."""
    folder = Path(tempfile.mkdtemp(prefix="lct-node-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.multiprocess
def test_a_node_keeps_its_p2pd_sockets_in_its_tmpdir_and_removes_them_when_stopped(swarm, node_tmpdir):
    node = swarm.start(0, env={"TMPDIR": str(node_tmpdir)})
    node.ready()
    # The daemon's socket (the node's DHT process starts one p2pd; hivemind opens its client
    # socket only when it serves a stream, beside it).
    assert [p.name for p in node_tmpdir.glob("pymp-*/hivemind-p2pd-*.sock")], list(node_tmpdir.rglob("*"))
    node.signal(signal.SIGTERM)
    assert node.wait_exit(timeout=30) == 0
    assert not list(node_tmpdir.rglob("hivemind-*.sock")), "a node stopped cleanly leaves no socket behind"
    assert not list(node_tmpdir.glob("pymp-*")), "nor its temp folder"


@pytest.mark.multiprocess
def test_the_temp_folder_of_a_node_killed_outright_is_removed_by_the_next_node_to_start(swarm, node_tmpdir):
    # Each SIGKILL (an OOM kill) left a pymp-* folder and p2pd's socket in TMPDIR for good.
    killed = swarm.start(0, env={"TMPDIR": str(node_tmpdir)})
    killed.ready()
    left = [p.parent for p in node_tmpdir.glob(f"pymp-*/{tempdir.MARKER}")]
    assert len(left) == 1 and list(left[0].glob("hivemind-p2pd-*.sock")), list(node_tmpdir.rglob("*"))
    children = swarm.descendants(killed)
    killed.signal(signal.SIGKILL)
    killed.wait_exit(timeout=30)
    psutil.wait_procs(children, timeout=15)  # its DHT process and p2pd die with it
    assert left[0].exists(), "nothing of the killed node could remove it"

    following = swarm.start(1, env={"TMPDIR": str(node_tmpdir)})
    following.ready()
    assert not left[0].exists()
    assert len(list(node_tmpdir.glob(f"pymp-*/{tempdir.MARKER}"))) == 1  # the running node's own


def _marked(base: Path, name: str, marker: str | None) -> Path:
    folder = base / name
    folder.mkdir()
    if marker is not None:
        (folder / tempdir.MARKER).write_text(marker)
    return folder


def test_only_the_folders_of_this_namespaces_nodes_that_are_gone_are_removed(tmp_path):
    finished = subprocess.Popen(["true"])
    finished.wait()
    gone = _marked(tmp_path, "pymp-gone", f"111 {finished.pid}\n")
    kept = [_marked(tmp_path, "pymp-running", f"111 {os.getpid()}\n"),
            _marked(tmp_path, "pymp-other-container", f"222 {finished.pid}\n"),
            _marked(tmp_path, "pymp-not-a-node", None),
            _marked(tmp_path, "pymp-not-our-marker", "whatever\n"),
            _marked(tmp_path, "other-gone", f"111 {finished.pid}\n")]
    assert tempdir.remove_folders_of_gone_nodes(str(tmp_path), "111") == [gone]
    assert not gone.exists() and all(folder.exists() for folder in kept)
