"""Where a node keeps its temporary files, and how those of a node killed outright get removed.

A node's process has a multiprocessing temp folder (``pymp-*`` in TMPDIR: hivemind's DHT passes
tensors between processes through a listener socket in it), and its p2pd keeps two unix sockets.
A clean stop removes both (multiprocessing removes its folder at exit, hivemind the sockets when it
stops p2pd). A node killed with SIGKILL, or by the OOM killer, cannot: each such kill left a
``pymp-*`` folder and a socket in TMPDIR for good, two entries per restart of a node that a
supervisor restarts after every OOM kill.

So p2pd's sockets go into the process's ``pymp-*`` folder, a marker in that folder names the
node's process, and every node, as it starts, removes the folders whose node is gone: a process
of this PID namespace (a container's node does not judge another container's) that no longer runs,
in a folder of this user.
"""

from __future__ import annotations

import contextlib
import multiprocessing.util
import os
import shutil
import tempfile
from pathlib import Path

MARKER = "lowcomm-node"  # in a pymp-* folder: "<pid namespace> <pid>" of the node that made it


def node_temp_dir() -> str:
    """This process's multiprocessing temp folder, marked as a node's, after removing those of
    nodes that are gone (where PID namespaces can be told apart: Linux)."""
    namespace = pid_namespace()
    if namespace is not None:
        remove_folders_of_gone_nodes(tempfile.gettempdir(), namespace)
    folder = multiprocessing.util.get_temp_dir()
    if namespace is not None:
        with contextlib.suppress(OSError):  # a full TMPDIR: then only a clean stop removes the folder
            Path(folder, MARKER).write_text(f"{namespace} {os.getpid()}\n", encoding="utf-8")
    return folder


def pid_namespace() -> str | None:
    """The inode of this process's PID namespace ('4026531836'), None where /proc does not say."""
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return None
    return link.partition("[")[2].rstrip("]") or None


def remove_folders_of_gone_nodes(base: str, namespace: str) -> list[Path]:
    """Remove the marked ``pymp-*`` folders in ``base`` of this user whose node, a process of
    ``namespace``, no longer runs; returns them."""
    removed = []
    for marker in Path(base).glob(f"pymp-*/{MARKER}"):
        folder = marker.parent
        try:
            owner = folder.lstat().st_uid
            marked_namespace, pid = marker.read_text(encoding="utf-8").split()
            gone = marked_namespace == namespace and owner == os.geteuid() and not _runs(int(pid))
        except (OSError, ValueError):  # being removed by its own node, or not a marker of ours
            continue
        if gone:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process runs under that pid
        return True
    return True
