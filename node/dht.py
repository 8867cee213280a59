"""The hivemind DHT, started so that it can never outlive the node, on swarm time.

hivemind runs the DHT in a forked process that in turn starts the ``p2pd`` daemon. A node killed
with SIGKILL gets no chance to stop them, so both would be orphaned. On Linux each is asked to
receive SIGKILL when its parent dies (``PR_SET_PDEATHSIG``): node → DHT process → p2pd.

A node that joins through ``--peers`` measures its clock's offset from its bootstrap peers in
the DHT process, between the creation of hivemind's DHT protocol and its bootstrap pings (whose
time check would refuse a clock more than 3 s off). hivemind in that process and the node both
read swarm time from ``clock`` (node/clock.py), which no later step of the wall clock moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Callable, Sequence

import hivemind

from .clock import DEFAULT_MAX_OFFSET, SwarmClock, decide, measure, run_hivemind_on
from .parentdeath import die_with_parent
from .tempdir import node_temp_dir

# The longest path of a unix socket (sun_path holds 108 bytes with its terminating NUL), and
# the longest name hivemind gives p2pd's sockets in a folder ("hivemind-p2pclient-" + 11 + ".sock").
_SUN_PATH_MAX = 107
_SOCKET_NAME_MAX = 40


def place_p2pd_sockets(folder: str) -> bool:
    """Put the two unix sockets of the p2pd daemons this process starts into ``folder``.

    hivemind puts them in /tmp whatever TMPDIR says, and removes them when it stops p2pd; a node
    killed with SIGKILL (or by the OOM killer) leaves them behind. A node puts them in its temp
    folder in TMPDIR, which the next node to start removes once this one is gone
    (node/tempdir.py), and the test suite, which kills nodes by the dozen, points TMPDIR at a
    folder it removes (tests/conftest.py). A folder whose sockets' paths would not fit a unix
    socket address keeps hivemind's /tmp. Returns whether ``folder`` is used.
    """
    from hivemind.p2p import P2P

    if len(folder.rstrip("/")) + 1 + _SOCKET_NAME_MAX > _SUN_PATH_MAX:
        return False
    # hivemind reads this class attribute each time it names a socket; it has no parameter for it.
    P2P._UNIX_SOCKET_PREFIX = f"/unix{folder.rstrip('/')}/hivemind-"
    return True


def p2pd_sockets(args: Sequence[str]) -> list[str]:
    """The unix socket paths of a p2pd command line: its own (``-listen``) and hivemind's client's beside it."""
    paths = []
    for arg in args:
        value = str(arg)
        if value.startswith("-listen=/unix/"):
            daemon = value.removeprefix("-listen=/unix")
            folder, _, name = daemon.rpartition("/")
            paths += [daemon, f"{folder}/{name.replace('-p2pd-', '-p2pclient-', 1)}"]
    return paths


class SupervisedDHT(hivemind.DHT):
    """``hivemind.DHT`` whose process and p2pd daemon die with the node, on swarm time.

    ``max_clock_offset``: the largest offset from the bootstrap peers' clocks that is corrected;
    beyond it the constructor raises ``ClockOffsetError`` (node/clock.py).
    """

    def __init__(self, *args, max_clock_offset: float = DEFAULT_MAX_OFFSET, **kwargs) -> None:
        # All before hivemind's constructor: with start=True it forks inside it.
        self.clock = SwarmClock()
        self.max_clock_offset = max_clock_offset
        self.temp_dir = node_temp_dir()  # p2pd's sockets: where the next node finds them if this one is killed
        super().__init__(*args, **kwargs)

    def swarm_time(self) -> float:
        """Wall-clock seconds on swarm time: for RPC tokens, record signatures and expirations."""
        return self.clock.time()

    def run(self) -> None:  # runs in the forked DHT process
        if die_with_parent():
            # A process group of its own, which p2pd inherits: a terminal's Ctrl-C and hangup go
            # to its whole foreground group, and reached this process and p2pd beside the node.
            # p2pd quit under the node's orderly stop ("error accepting connection: ... use of
            # closed network connection") and the DHT's shutdown waited out its grace. The node
            # stops both itself, and they die with it if it is killed (only where that holds:
            # elsewhere a kill of the node's group is what takes them along).
            with contextlib.suppress(OSError):
                os.setpgid(0, 0)
        place_p2pd_sockets(self.temp_dir)
        spawn = asyncio.subprocess.create_subprocess_exec
        sockets: list[str] = []

        async def spawn_p2pd(*args, **kwargs):
            sockets.extend(p2pd_sockets(args))
            return await spawn(*args, preexec_fn=die_with_parent, **kwargs)

        # Only this (forked) process is patched: p2pd, started from here, dies with it.
        asyncio.subprocess.create_subprocess_exec = spawn_p2pd
        # On every node, even one that needs no correction: swarm time ignores steps of the wall clock.
        run_hivemind_on(self.clock.time)
        if self.initial_peers:
            self._measure_clock_before_bootstrap()
        try:
            super().run()
        finally:
            # hivemind removes the daemon's socket only when it stops a p2pd that is still running:
            # one that exited by itself (its bootstrap peers unreachable, a bad --peers address) left
            # its socket in TMPDIR on every failed start. This process is ending, and p2pd with it.
            for path in sockets:
                with contextlib.suppress(OSError):
                    os.remove(path)

    def _measure_clock_before_bootstrap(self) -> None:
        """Wrap hivemind's ``DHTProtocol.create`` (in this process only) so that, once the
        protocol can talk to the initial peers and before ``DHTNode.create`` pings them with
        its time check, the clock offset is measured and adopted.

        hivemind offers no hook between the two; ``DHT.run`` creates the node itself.
        """
        from hivemind.dht.protocol import DHTProtocol
        from hivemind.p2p import PeerID
        from hivemind.utils.multiaddr import Multiaddr

        peers = []
        for maddr in self.initial_peers:
            try:
                peers.append(PeerID.from_base58(Multiaddr(str(maddr))["p2p"]))
            except Exception:  # hivemind refuses malformed multiaddrs with its own message
                continue
        create = DHTProtocol.create.__func__
        clock, max_offset = self.clock, self.max_clock_offset

        async def create_on_swarm_time(cls, *args, **kwargs):
            protocol = await create(cls, *args, **kwargs)
            samples = await measure(protocol, peers)
            offset, uncertainty = decide(samples, max_offset)  # ClockOffsetError reaches the node
            clock.set(offset, uncertainty, len(samples))
            return protocol

        DHTProtocol.create = classmethod(create_on_swarm_time)


def swarm_clock(dht: hivemind.DHT) -> Callable[[], float]:
    """The wall clock a node shares with other peers: swarm time for SupervisedDHT, else local."""
    return dht.swarm_time if isinstance(dht, SupervisedDHT) else time.time
