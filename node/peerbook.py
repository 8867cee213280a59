"""The peers a node saw last time, kept beside its checkpoints, so that a restart finds the swarm.

Why: a node joins through the multiaddrs of ``--peers``. In a swarm that runs for days those
peers come and go: the first peer has none at all, and a volunteer restarted with the command
it was started with names a bootstrap peer that may have left long ago. Either way the restart
used to find nobody although the swarm was still there: the first peer trained alone until a
peer's DHT happened to call it again (8 steps in one audit), and a volunteer whose bootstrap peer
had gone could not start at all.

So every serving peer publishes the multiaddr of its DHT in its record (``PeerRecord.dht_address``,
the one its join line shows), and a node writes those of the live peers in its view to
``<checkpoint_dir>/known_peers.txt`` (at most once a minute, only when they changed). A node that
starts with no ``--peers`` joins through them when any answers; one whose ``--peers`` do not answer
tries them before it gives up (node/cli.py ``start_dht``). The file is plain text, one multiaddr a
line: an operator may read, edit or delete it.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Iterable

log = logging.getLogger("lowcomm.node")

FILE_NAME = "known_peers.txt"
KEEP = 16  # multiaddrs kept at most: the live ones first, then those seen before
SAVE_EVERY_SECONDS = 60.0
_HEADER = "# peers this node saw in its swarm (lowcomm writes this file; delete it to forget them)\n"


def book_path(checkpoint_dir: Path) -> Path:
    return Path(checkpoint_dir) / FILE_NAME


def peer_id_of(multiaddr: str) -> str:
    """The peer id after ``/p2p/``, or "" when the multiaddr has none."""
    head, sep, tail = multiaddr.rpartition("/p2p/")
    return tail if sep and head and tail and "/" not in tail else ""


def load(path: Path) -> list[str]:
    """The multiaddrs in ``path`` (lines that start with "/" and end in /p2p/<id>); [] when the
    file is missing or unreadable (said once: the node then starts as if it had none)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as err:
        log.warning("cannot read %s (%s); starting without the peers it remembers", path, err)
        return []
    lines = (line.strip() for line in text.splitlines())
    return list(dict.fromkeys(line for line in lines if line.startswith("/") and peer_id_of(line)))


class PeerBook:
    """The file of one node: what it holds, and when to write it again (``remember``)."""

    def __init__(self, path: Path, own_peer_id: str) -> None:
        self.path = path
        self.own_peer_id = own_peer_id
        self.known = [m for m in load(path) if peer_id_of(m) != own_peer_id]
        self._written_at = -float("inf")
        self._failed = False

    def remember(self, live: Iterable[str], left: Iterable[str] = (), now: float | None = None) -> bool:
        """Record the DHT multiaddrs of the live peers of a view (``left``: peer ids that said
        goodbye, forgotten). Writes the file when SAVE_EVERY_SECONDS passed and the list changed;
        whether it wrote. Never raises: a full disk costs the book, not the node."""
        now = time.monotonic() if now is None else now
        if now - self._written_at < SAVE_EVERY_SECONDS:
            return False
        gone = set(left) | {self.own_peer_id}
        fresh = [m for m in dict.fromkeys(live) if peer_id_of(m) and peer_id_of(m) not in gone]
        ids = {peer_id_of(m) for m in fresh}
        merged = (fresh + [m for m in self.known if peer_id_of(m) not in ids | gone])[:KEEP]
        if not fresh or merged == self.known:
            return False
        self._written_at = now
        try:
            self._write(merged)
        except OSError as err:
            if not self._failed:  # said once: it would repeat every minute
                log.warning("cannot write %s (%s); a restart may not find the swarm without --peers", self.path, err)
            self._failed = True
            return False
        self.known = merged
        log.debug("remembered %d peer(s) in %s", len(merged), self.path,
                  extra={"event": "peers_remembered", "peer_ids": [peer_id_of(m) for m in merged]})
        return True

    def _write(self, multiaddrs: list[str]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(_HEADER + "".join(f"{m}\n" for m in multiaddrs), encoding="utf-8")
        os.replace(tmp, self.path)  # atomic: a kill mid-write leaves the old list
