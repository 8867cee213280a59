"""A multi-host lowcomm cluster on one machine: one network namespace per peer, real per-peer
bandwidth caps, no Docker.

Layout of a cluster with prefix ``lc`` (every name starts with the prefix, so ``down`` finds
what a crashed ``up`` left behind even without its state file)::

    root namespace: bridge lc-br (10.77.X.254/24) -- veth lc-h0 ... lc-h<N-1>
    namespace lc-i: eth0 10.77.X.(i+1)/24 (the other end of lc-hi), lo

X is derived from the prefix, so two clusters get two subnets; a subnet that overlaps a route
the host already has is refused. The namespaces have no default route and the host does not
forward, so no packet leaves the bridge. Every peer is capped by ``tc tbf`` on both directions:
egress of its eth0 (upload) and egress of the bridge-side lc-hi (download). A new namespace
inherits the host's TCP congestion control; ``tcp_congestion`` (``up --tcp-congestion``) sets
another one in every peer's namespace, e.g. a loss-based one like the Linux default (cubic)
on a host that runs bbr: the two treat the caps' queues very differently (bench/analysis.md).

Root only. Standard library only, so any python3 runs it; importable as a library::

    with netns_cluster(peers=3, mbit=50, prefix="lct") as state:
        mbit = measure_bulk_mbit(state.peers[0].netns, state.peers[1].ip, seconds=3)

CLI: ``deploy/netns-cluster up|down|status|measure`` (``--help`` on each).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Iterator, Sequence

DHT_PORT, GRPC_PORT, METRICS_PORT = 7700, 7701, 7702
PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")  # keeps "<prefix>-h<i>" within 15 characters
MAX_PEERS = 200
STOP_TIMEOUT = 40.0  # SIGTERM -> exit: the node's 20 s grace period plus its checkpoint
# A multiaddr a node prints in its ready line (`lowcomm-node join --peers <multiaddr>`).
MADDR_RE = re.compile(r"/(?:ip4|ip6|dns|dns4|dns6)/[^/\s\"',]+/tcp/\d+/p2p/[1-9A-HJ-NP-Za-km-z]+")
# Processes this interpreter started, polled (hence reaped) by pid; nobody else's children are.
_CHILDREN: dict[int, subprocess.Popen] = {}


class ClusterError(RuntimeError):
    """A cluster could not be made or used; the message says what to do."""


@dataclasses.dataclass
class PeerState:
    index: int
    netns: str
    ip: str
    host_veth: str
    mbit: float
    pid: int | None = None
    pid_start: int | None = None  # start time of pid (/proc/<pid>/stat), guards against reuse
    log: str | None = None
    checkpoint_dir: str | None = None
    multiaddr: str | None = None

    @property
    def metrics_target(self) -> str:
        return f"{self.ip}:{METRICS_PORT}"


@dataclasses.dataclass
class ClusterState:
    prefix: str
    subnet: str
    bridge: str
    bridge_ip: str
    state_dir: str
    peers: list[PeerState] = dataclasses.field(default_factory=list)
    up_pid: int = 0
    up_pid_start: int | None = None
    prometheus_pid: int | None = None
    prometheus_pid_start: int | None = None
    prometheus_url: str | None = None
    tcp_congestion: str | None = None  # what the namespaces use (None: a state file from before it was kept)

    @property
    def state_file(self) -> Path:
        return Path(self.state_dir) / "state.json"

    def save(self) -> None:
        # Written after every resource it makes: a crashed `up` leaves an accurate record.
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=2))
        tmp.replace(self.state_file)

    @classmethod
    def load(cls, path: Path) -> ClusterState:
        data = json.loads(Path(path).read_text())
        data["peers"] = [PeerState(**peer) for peer in data.get("peers", [])]
        return cls(**data)

    def events(self, index: int) -> list[dict]:
        """The JSON log lines (objects) peer ``index`` printed so far."""
        return read_json_lines(self.peers[index].log)


# --------------------------------------------------------------------------- small helpers
def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(args)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _say(message: str, quiet: bool) -> None:
    if not quiet:
        print(message, flush=True)


def default_state_dir(prefix: str) -> Path:
    return Path(f"/tmp/lowcomm-netns-{prefix}")


def subnet_octet(prefix: str) -> int:
    """X of 10.77.X.0/24, a stable function of the prefix (1..250)."""
    return zlib.crc32(prefix.encode()) % 250 + 1


def check_prefix(prefix: str) -> None:
    if not PREFIX_RE.match(prefix):
        raise ClusterError(f"prefix {prefix!r}: use 1-8 lower-case letters or digits, starting with a letter")


def unavailable_reason() -> str | None:
    """Why this machine cannot run clusters (None when it can): root, ip netns, veth, tc tbf."""
    if os.geteuid() != 0:
        return "needs root (ip netns, veth and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2)"
    probe = f"lcprobe{os.getpid() % 10**6}"
    try:
        _run("ip", "netns", "add", probe)
        _run("ip", "-n", probe, "link", "add", "pv0", "type", "veth", "peer", "name", "pv1")
        _run("tc", "-n", probe, "qdisc", "add", "dev", "pv0", "root", "tbf",
             "rate", "10mbit", "burst", "32kb", "latency", "50ms")
    except (ClusterError, OSError, subprocess.TimeoutExpired) as err:
        return f"network namespaces, veth or tc tbf unavailable: {err}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def _proc_start(pid: int) -> int | None:
    """Start time of a live, non-zombie process, or None."""
    if pid in _CHILDREN and _CHILDREN[pid].poll() is not None:
        del _CHILDREN[pid]  # our own child, now reaped
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _alive(pid: int | None, start: int | None) -> bool:
    if not pid:
        return False
    now = _proc_start(pid)
    return now is not None and (start is None or now == start)


def _wait_gone(pids: Sequence[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    left = [pid for pid in pids if _proc_start(pid) is not None]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [pid for pid in left if _proc_start(pid) is not None]
    return left


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def read_json_lines(path: str | Path | None) -> list[dict]:
    events = []
    if path is None or not Path(path).exists():
        return events
    for line in Path(path).read_text(errors="replace").splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                obj = json.loads(line)
                if isinstance(obj, dict):
                    events.append(obj)
    return events


# --------------------------------------------------------------------------- what exists
def list_namespaces(prefix: str) -> list[str]:
    pattern = re.compile(rf"^{re.escape(prefix)}-\d+$")
    names = [line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines() if line.strip()]
    return sorted((n for n in names if pattern.match(n)), key=lambda n: int(n.rsplit("-", 1)[1]))


def list_links(prefix: str) -> list[str]:
    pattern = re.compile(rf"^{re.escape(prefix)}-(?:br|h\d+)$")
    links = json.loads(_run("ip", "-j", "link", "show").stdout or "[]")
    return [link["ifname"] for link in links if pattern.match(link.get("ifname", ""))]


def namespace_pids(netns: str) -> list[int]:
    out = _run("ip", "netns", "pids", netns, check=False).stdout
    return [int(tok) for tok in out.split() if tok.isdigit()]


def leftovers(prefix: str) -> dict[str, list]:
    """Every namespace, link and process with this prefix that exists now."""
    namespaces = list_namespaces(prefix)
    pids = sorted({pid for ns in namespaces for pid in namespace_pids(ns)})
    return {"namespaces": namespaces, "links": list_links(prefix), "pids": pids}


# --------------------------------------------------------------------------- up
def _tbf(mbit: float, *dev: str) -> None:
    rate_bytes = mbit * 1e6 / 8
    burst = max(64 * 1024, int(rate_bytes * 0.01))  # >= 10 ms of traffic, and a GSO segment
    _run(*dev[:-1], "qdisc", "replace", "dev", dev[-1], "root", "tbf",
         "rate", f"{mbit}mbit", "burst", str(burst), "latency", "50ms")


def tcp_congestion_of(netns: str) -> str:
    """The TCP congestion control new sockets in ``netns`` get."""
    return _run("ip", "netns", "exec", netns, "sysctl", "-n", "net.ipv4.tcp_congestion_control").stdout.strip()


def set_tcp_congestion(netns: str, name: str) -> None:
    """Make ``name`` the congestion control of new TCP sockets in ``netns``. Only those the host
    allows outside its own namespace can be set (net.ipv4.tcp_allowed_congestion_control)."""
    proc = _run("ip", "netns", "exec", netns, "sysctl", "-qw", f"net.ipv4.tcp_congestion_control={name}", check=False)
    if proc.returncode != 0:
        allowed = _run("sysctl", "-n", "net.ipv4.tcp_allowed_congestion_control", check=False).stdout.split()
        raise ClusterError(f"TCP congestion control {name!r} cannot be used in the namespaces "
                           f"({proc.stderr.strip() or 'refused'}); this host allows {' '.join(allowed) or 'none'} "
                           "there (net.ipv4.tcp_allowed_congestion_control); pick one of those")


def _check_subnet(octet: int) -> None:
    routes = json.loads(_run("ip", "-j", "route", "show", "match", f"10.77.{octet}.1").stdout or "[]")
    for route in routes:
        if route.get("dst") != "default":
            raise ClusterError(
                f"10.77.{octet}.0/24 overlaps the host route {route.get('dst')} on {route.get('dev')}; "
                "pick another --prefix (the subnet is derived from it)"
            )


def _node_command(node_command: Sequence[str] | None) -> list[str]:
    if node_command:
        return list(node_command)
    beside = Path(sys.executable).parent / "lowcomm-node"
    found = str(beside) if beside.exists() else shutil.which("lowcomm-node")
    if found is None:
        raise ClusterError("lowcomm-node not found: install the project (pip install .) or pass --node-command")
    return [found]


def _start_node(state: ClusterState, peer: PeerState, command: list[str], bootstrap: str | None,
                join_args: Sequence[str]) -> None:
    peer_dir = Path(state.state_dir) / f"peer-{peer.index}"
    peer_dir.mkdir(parents=True, exist_ok=True)
    peer.checkpoint_dir = str(peer_dir / "checkpoints")
    peer.log = str(peer_dir / "node.log")
    argv = ["ip", "netns", "exec", peer.netns, *command, "join",
            "--host", peer.ip, "--announce-host", peer.ip, "--dht-port", str(DHT_PORT),
            "--grpc-port", str(GRPC_PORT), "--metrics-port", str(METRICS_PORT),
            "--checkpoint-dir", peer.checkpoint_dir, "--log-format", "json"]
    if bootstrap:
        argv += ["--peers", bootstrap]
    argv += list(join_args)
    (peer_dir / "command.json").write_text(json.dumps(argv))
    with open(peer.log, "ab") as log:
        # `ip netns exec` execs the command: the pid is the node's. Its own session, so it
        # outlives `up` and its group (node, DHT, p2pd) can be signalled as one.
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                cwd=peer_dir, start_new_session=True)
    _CHILDREN[proc.pid] = proc
    peer.pid, peer.pid_start = proc.pid, _proc_start(proc.pid)
    state.save()


def _wait_ready(state: ClusterState, peers: Sequence[PeerState], timeout: float) -> None:
    """Until every peer printed its ready line; fills ``peer.multiaddr``."""
    deadline = time.monotonic() + timeout
    waiting = list(peers)
    while waiting:
        for peer in list(waiting):
            text = Path(peer.log).read_text(errors="replace") if Path(peer.log).exists() else ""
            for line in text.splitlines():
                if "--peers" not in line:
                    continue
                found = MADDR_RE.findall(line)
                ours = [m for m in found if f"/{peer.ip}/" in m]
                if ours or found:
                    peer_id = (ours or found)[0].rsplit("/p2p/", 1)[1]
                    peer.multiaddr = ours[0] if ours else f"/ip4/{peer.ip}/tcp/{DHT_PORT}/p2p/{peer_id}"
                    waiting.remove(peer)
                    break
            else:
                if not _alive(peer.pid, peer.pid_start):
                    tail = "\n".join(text.splitlines()[-20:])
                    raise ClusterError(
                        f"peer {peer.index} ({peer.netns}) exited before it was ready; log {peer.log}:\n{tail}")
        if waiting and time.monotonic() > deadline:
            raise ClusterError(
                f"peers {[p.index for p in waiting]} not ready after {timeout:.0f} s; logs in {state.state_dir}")
        if waiting:
            time.sleep(0.2)
    state.save()


def prometheus_config(state: ClusterState) -> dict:
    """The scrape config of the cluster's Prometheus, with deploy/prometheus's alert rules. Peer 0
    is the bootstrap every other peer joins through: the targets carry the `service` label that
    the compose file's DNS discovery gives (bootstrap / peer), which the node-down alerts read."""
    rules = Path(__file__).resolve().parent / "prometheus" / "rules" / "lowcomm-alerts.yml"
    groups = [("bootstrap", state.peers[:1]), ("peer", state.peers[1:])]
    return {"global": {"scrape_interval": "5s", "scrape_timeout": "4s", "evaluation_interval": "5s"},
            "rule_files": [str(rules)] if rules.exists() else [],
            "scrape_configs": [{"job_name": "lowcomm", "static_configs": [
                {"targets": [p.metrics_target for p in peers], "labels": {"cluster": state.prefix, "service": service}}
                for service, peers in groups if peers]}]}


def _start_prometheus(state: ClusterState, port: int) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        print("prometheus is not installed: skipped", file=sys.stderr)
        return
    prom_dir = Path(state.state_dir) / "prometheus"
    prom_dir.mkdir(parents=True, exist_ok=True)
    (prom_dir / "prometheus.yml").write_text(json.dumps(prometheus_config(state), indent=2))  # JSON is YAML
    with open(prom_dir / "prometheus.log", "ab") as log:
        proc = subprocess.Popen([binary, f"--config.file={prom_dir / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={prom_dir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    _CHILDREN[proc.pid] = proc
    state.prometheus_pid, state.prometheus_pid_start = proc.pid, _proc_start(proc.pid)
    state.prometheus_url = f"http://127.0.0.1:{port}"
    state.save()


def cluster_up(peers: int, mbit: float, *, slow_mbit: float | None = None, prefix: str = "lc",
               state_dir: str | Path | None = None, start_nodes: bool = True, join_args: Sequence[str] = (),
               peer_args: dict[int, Sequence[str]] | None = None, prometheus: bool = False,
               prometheus_port: int = 9090, node_command: Sequence[str] | None = None,
               ready_timeout: float = 180.0, quiet: bool = True, tcp_congestion: str | None = None) -> ClusterState:
    """Make the bridge, one capped namespace per peer and (``start_nodes``) start the nodes.

    ``tcp_congestion``: the TCP congestion control of every namespace (None: the host's).

    ``join_args`` go to every node's ``join``, ``peer_args[i]`` after them to node i only.
    Returns once every node printed its ready line. On any error everything made so far is
    removed again before the error propagates.
    """
    if os.geteuid() != 0:
        raise ClusterError("netns-cluster needs root (ip netns, veth, tc)")
    check_prefix(prefix)
    if not 1 <= peers <= MAX_PEERS:
        raise ClusterError(f"--peers must be within 1..{MAX_PEERS}")
    if mbit <= 0 or (slow_mbit is not None and slow_mbit <= 0):
        raise ClusterError("bandwidth caps must be positive")
    existing = leftovers(prefix)
    if existing["namespaces"] or existing["links"]:
        raise ClusterError(f"a cluster with prefix {prefix!r} exists ({existing}); run `down --prefix {prefix}` first")
    octet = subnet_octet(prefix)
    _check_subnet(octet)
    command = _node_command(node_command) if start_nodes else []

    state_path = Path(state_dir) if state_dir else default_state_dir(prefix)
    state_path.mkdir(parents=True, exist_ok=True)
    state = ClusterState(prefix=prefix, subnet=f"10.77.{octet}.0/24", bridge=f"{prefix}-br",
                         bridge_ip=f"10.77.{octet}.254", state_dir=str(state_path),
                         up_pid=os.getpid(), up_pid_start=_proc_start(os.getpid()))
    state.save()
    try:
        _run("ip", "link", "add", state.bridge, "type", "bridge")
        _say(f"created bridge {state.bridge}", quiet)
        _run("ip", "addr", "add", f"{state.bridge_ip}/24", "dev", state.bridge)
        _run("ip", "link", "set", state.bridge, "up")
        for i in range(peers):
            cap = slow_mbit if (slow_mbit is not None and i == peers - 1) else mbit
            peer = PeerState(index=i, netns=f"{prefix}-{i}", ip=f"10.77.{octet}.{i + 1}",
                             host_veth=f"{prefix}-h{i}", mbit=cap)
            state.peers.append(peer)
            state.save()
            _run("ip", "netns", "add", peer.netns)
            _say(f"created netns {peer.netns}", quiet)
            _run("ip", "link", "add", peer.host_veth, "type", "veth", "peer", "name", "eth0", "netns", peer.netns)
            _run("ip", "link", "set", peer.host_veth, "master", state.bridge, "up")
            _run("ip", "-n", peer.netns, "addr", "add", f"{peer.ip}/24", "dev", "eth0")
            _run("ip", "-n", peer.netns, "link", "set", "eth0", "up")
            _run("ip", "-n", peer.netns, "link", "set", "lo", "up")
            if tcp_congestion is not None:
                set_tcp_congestion(peer.netns, tcp_congestion)
            if i == 0:  # every namespace gets the same: read it back once
                state.tcp_congestion = tcp_congestion_of(peer.netns)
                state.save()
            _tbf(cap, "tc", "-n", peer.netns, "eth0")  # the peer's upload
            _tbf(cap, "tc", peer.host_veth)  # the peer's download
            _say(f"peer {i}: {peer.netns} {peer.ip} capped at {cap} Mbit/s both ways, TCP {state.tcp_congestion}", quiet)
        if start_nodes:
            first = state.peers[0]
            peer_args = peer_args or {}
            _start_node(state, first, command, None, [*join_args, *peer_args.get(0, ())])
            _wait_ready(state, [first], ready_timeout)
            _say(f"peer 0 ready: {first.multiaddr}", quiet)
            for peer in state.peers[1:]:
                _start_node(state, peer, command, first.multiaddr, [*join_args, *peer_args.get(peer.index, ())])
            _wait_ready(state, state.peers[1:], ready_timeout)
            _say(f"{peers} nodes ready; logs in {state.state_dir}", quiet)
        if prometheus:
            _start_prometheus(state, prometheus_port)
            if state.prometheus_url:
                _say(f"prometheus: {state.prometheus_url}", quiet)
    except BaseException:
        cluster_down(prefix, state_dir=state_path, quiet=True)
        raise
    return state


# --------------------------------------------------------------------------- down
def cluster_down(prefix: str = "lc", *, state_dir: str | Path | None = None, timeout: float = STOP_TIMEOUT,
                 quiet: bool = True) -> dict[str, list]:
    """Stop every process and remove every namespace and link of cluster ``prefix``.

    Works from the state file and, independently, from what exists with the prefix now, so it
    also cleans up after a crashed ``up``. Logs and checkpoints in the state directory stay.
    Returns what it removed.
    """
    check_prefix(prefix)
    state_path = Path(state_dir) if state_dir else default_state_dir(prefix)
    state = None
    if (state_path / "state.json").exists():
        with contextlib.suppress(ValueError, TypeError, KeyError):
            state = ClusterState.load(state_path / "state.json")
    removed: dict[str, list] = {"pids": [], "namespaces": [], "links": []}

    # 1. An `up` still running (hung, or interrupted mid-way) would keep making things.
    if state and state.up_pid != os.getpid() and _alive(state.up_pid, state.up_pid_start):
        _signal(state.up_pid, signal.SIGKILL)
        _wait_gone([state.up_pid], 5)
        removed["pids"].append(state.up_pid)

    # 2. Nodes: SIGTERM first, so that they checkpoint and leave the DHT within their grace period.
    recorded = []
    if state:
        recorded = [(p.pid, p.pid_start) for p in state.peers] + [(state.prometheus_pid, state.prometheus_pid_start)]
    main_pids = [pid for pid, start in recorded if _alive(pid, start)]
    for pid in main_pids:
        _signal(pid, signal.SIGTERM)
    _wait_gone(main_pids, timeout)

    # 3. Whatever still runs in our namespaces (children, leftovers of a crash) and recorded
    # processes that ignored SIGTERM: SIGTERM, a short wait, then SIGKILL to them and their groups.
    namespaces = list_namespaces(prefix)
    stragglers = {pid for ns in namespaces for pid in namespace_pids(ns)}
    stragglers |= {pid for pid, start in recorded if _alive(pid, start)}
    removed["pids"] = sorted(set(removed["pids"]) | set(main_pids) | stragglers)
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
        for pid in stragglers:
            _signal(pid, sig)
        if sig == signal.SIGKILL:
            for pid, start in recorded:
                if _alive(pid, start):
                    with contextlib.suppress(OSError):
                        os.killpg(pid, signal.SIGKILL)  # only when it leads its own group
        stragglers = set(_wait_gone(sorted(stragglers), wait))
    if stragglers:
        raise ClusterError(f"processes {sorted(stragglers)} in the cluster's namespaces survived SIGKILL")

    # 4. Namespaces (their veth ends go with them), then links left in the root namespace.
    for ns in namespaces:
        _run("ip", "netns", "del", ns, check=False)
        removed["namespaces"].append(ns)
    for link in list_links(prefix):
        _run("ip", "link", "del", link, check=False)
        removed["links"].append(link)
    # The kernel removes a deleted namespace's devices asynchronously: allow it a moment.
    deadline = time.monotonic() + 5.0
    while any((left := leftovers(prefix)).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    if any(left.values()):
        raise ClusterError(f"could not remove {left}")
    with contextlib.suppress(FileNotFoundError):
        (state_path / "state.json").unlink()
    _say(f"removed {removed}", quiet)
    return removed


@contextlib.contextmanager
def netns_cluster(peers: int, mbit: float, **kwargs) -> Iterator[ClusterState]:
    """``cluster_up`` on enter, ``cluster_down`` on exit, whatever happened in between."""
    prefix = kwargs.get("prefix", "lc")
    state = cluster_up(peers, mbit, **kwargs)
    try:
        yield state
    finally:
        cluster_down(prefix, state_dir=state.state_dir)


# --------------------------------------------------------------------------- bandwidth
_RECEIVER = r"""
import json, socket, sys, time
sock = socket.create_server((sys.argv[1], 0)); sock.settimeout(float(sys.argv[2]))
print(sock.getsockname()[1], flush=True)
conn, _ = sock.accept(); conn.settimeout(float(sys.argv[2]))
total, first, buf = 0, None, bytearray(1 << 20)
while True:
    n = conn.recv_into(buf)
    if not n:
        break
    first = first or time.monotonic()
    total += n
print(json.dumps({"bytes": total, "seconds": time.monotonic() - (first or time.monotonic())}), flush=True)
"""
_SENDER = r"""
import socket, sys, time
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
chunk, end = bytes(1 << 16), time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    conn.sendall(chunk)
conn.close()
"""


def _namespace_of(ip: str) -> str:
    for line in _run("ip", "netns", "list").stdout.splitlines():
        ns = line.split()[0] if line.strip() else ""
        if ns and f"inet {ip}/" in _run("ip", "-n", ns, "addr", "show", check=False).stdout:
            return ns
    raise ClusterError(f"no network namespace has the address {ip}")


def measure_bulk_mbit(src_ns: str, dst_ip: str, seconds: float = 3.0, *, dst_ns: str | None = None) -> float:
    """TCP goodput (payload Mbit/s) of one bulk stream from ``src_ns`` to ``dst_ip``.

    The receiver runs in the namespace holding ``dst_ip`` and times from the first byte to the
    end of the stream; everything is bounded by ``seconds`` plus a fixed margin.
    """
    dst_ns = dst_ns or _namespace_of(dst_ip)
    limit = seconds + 20.0
    receiver = subprocess.Popen(["ip", "netns", "exec", dst_ns, sys.executable, "-c", _RECEIVER, dst_ip, str(limit)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = receiver.stdout.readline().strip()
        if not port.isdigit():
            raise ClusterError(f"bandwidth receiver in {dst_ns} failed: {receiver.stderr.read()}")
        sender = subprocess.run(
            ["ip", "netns", "exec", src_ns, sys.executable, "-c", _SENDER, dst_ip, port, str(seconds)],
            capture_output=True, text=True, timeout=limit)
        if sender.returncode != 0:
            raise ClusterError(f"bandwidth sender in {src_ns} failed: {sender.stderr.strip()}")
        out, err = receiver.communicate(timeout=limit)
        result = json.loads(out.strip().splitlines()[-1])
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    if result["seconds"] <= 0:
        raise ClusterError("no data arrived")
    return result["bytes"] * 8 / result["seconds"] / 1e6


# --------------------------------------------------------------------------- CLI
def _status(prefix: str, state_dir: str | None) -> dict:
    path = (Path(state_dir) if state_dir else default_state_dir(prefix)) / "state.json"
    report: dict = {"prefix": prefix, "state_file": str(path) if path.exists() else None, "exists": leftovers(prefix)}
    if path.exists():
        state = ClusterState.load(path)
        report.update(subnet=state.subnet, prometheus=state.prometheus_url, tcp_congestion=state.tcp_congestion, peers=[
            {"netns": p.netns, "ip": p.ip, "mbit": p.mbit, "pid": p.pid, "running": _alive(p.pid, p.pid_start),
             "multiaddr": p.multiaddr, "log": p.log,
             "rounds_done": sum(1 for e in read_json_lines(p.log) if e.get("event") == "round_done")}
            for p in state.peers])
    return report


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    join_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="netns-cluster", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="make the namespaces and start the nodes; arguments after -- go to every `join`")
    up.add_argument("--peers", type=int, required=True)
    up.add_argument("--mbit", type=float, required=True, help="cap of every peer, both directions")
    up.add_argument("--slow-mbit", type=float, help="cap of the last peer (a slow volunteer)")
    up.add_argument("--no-nodes", action="store_true", help="only the network, no lowcomm-node")
    up.add_argument("--prometheus", action="store_true", help="also run prometheus (when installed) on 127.0.0.1")
    up.add_argument("--prometheus-port", type=int, default=9090)
    up.add_argument("--node-command", help="command that runs the node (default: lowcomm-node)")
    up.add_argument("--ready-timeout", type=float, default=180.0)
    up.add_argument("--tcp-congestion", metavar="NAME",
                    help="TCP congestion control in every namespace, e.g. reno (default: the host's)")
    down = sub.add_parser("down", help="stop and remove everything of a cluster, also after a crash")
    down.add_argument("--timeout", type=float, default=STOP_TIMEOUT, help="seconds nodes get to exit after SIGTERM")
    status = sub.add_parser("status", help="what exists and what the nodes do")
    measure = sub.add_parser("measure", help="TCP bulk throughput from one peer to another")
    measure.add_argument("--src", type=int, default=0)
    measure.add_argument("--dst", type=int, default=1)
    measure.add_argument("--seconds", type=float, default=3.0)
    for p in (up, down, status, measure):
        p.add_argument("--prefix", default="lc")
        p.add_argument("--state-dir", help="default /tmp/lowcomm-netns-<prefix>")
    args = parser.parse_args(argv)
    if args.cmd != "status" and os.geteuid() != 0:
        print("netns-cluster: needs root (ip netns, veth, tc); run it with sudo", file=sys.stderr)
        return 1
    try:
        if args.cmd == "up":
            cluster_up(args.peers, args.mbit, slow_mbit=args.slow_mbit, prefix=args.prefix, state_dir=args.state_dir,
                       start_nodes=not args.no_nodes, join_args=join_args, prometheus=args.prometheus,
                       prometheus_port=args.prometheus_port,
                       node_command=args.node_command.split() if args.node_command else None,
                       ready_timeout=args.ready_timeout, quiet=False, tcp_congestion=args.tcp_congestion)
            print(f"up; stop it with: deploy/netns-cluster down --prefix {args.prefix}")
        elif args.cmd == "down":
            cluster_down(args.prefix, state_dir=args.state_dir, timeout=args.timeout, quiet=False)
        elif args.cmd == "status":
            print(json.dumps(_status(args.prefix, args.state_dir), indent=2))
        else:
            path = (Path(args.state_dir) if args.state_dir else default_state_dir(args.prefix)) / "state.json"
            state = ClusterState.load(path)
            mbit = measure_bulk_mbit(state.peers[args.src].netns, state.peers[args.dst].ip, args.seconds)
            print(f"{state.peers[args.src].netns} -> {state.peers[args.dst].netns}: {mbit:.1f} Mbit/s")
    except ClusterError as err:
        print(f"netns-cluster: {err}", file=sys.stderr)
        return 1
    except FileNotFoundError as err:
        print(f"netns-cluster: {err.filename} not found (is the cluster up?)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
