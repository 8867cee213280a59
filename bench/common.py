"""Shared pieces of the benchmarks: the workload, processes with JSON-line events, networks.

Every benchmark runs real processes (the node's CLI, the baseline scripts, the transport agent)
and reads what they print as JSON lines. A ``Network`` says where those processes run: on
loopback (anyone, no byte counters on the wire) or one network namespace per peer made with
``deploy/netns_cluster.py`` (root; optional ``tc tbf`` caps; the bytes each peer put on the wire
are read from the root-side end of its veth).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import importlib.util
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from lowcomm.node.localswarm import Event, NodeProcess, node_command

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
OUT = BENCH / "out"  # JSON lines and raw logs (gitignored)
PLOTS = BENCH / "plots"  # PNGs committed next to RESULTS.md
PY = sys.executable


# -- the workload every convergence method shares -----------------------------------------------


@dataclass
class Workload:
    """Same model, data, tokens per peer and global batch for every method."""

    peers: int = 4
    """Data-parallel peers (processes) of the multi-peer methods."""
    steps: int = 400
    """Optimizer steps per peer (inner steps for DiLoCo, local steps for hivemind)."""
    batch_size: int = 8
    """Sequences per peer per step; the global batch is peers × batch_size (single uses it whole).
    8, not the node's 16: half the compute, so that the standard set fits in 30 minutes on 2 cores."""
    seq_len: int = 128
    """Tokens (bytes) per sequence."""
    preset: str = "tiny"
    """Model preset of node/model.py."""
    seed: int = 0
    """Initial weights and data order (the node's train.seed)."""
    eval_every: int = 25
    """Steps between two evaluations of ddp, single and hivemind (DiLoCo evaluates every round)."""

    @property
    def global_batch(self) -> int:
        return self.peers * self.batch_size

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one global step: all peers together."""
        return self.global_batch * self.seq_len

    def settings(self, batch_size: int | None = None) -> list[str]:
        """The run-config part of the workload as ``SECTION.KEY=VALUE`` (the node's ``--set``)."""
        return [f"model.preset={self.preset}", f"data.seq_len={self.seq_len}",
                f"train.batch_size={batch_size or self.batch_size}", f"train.seed={self.seed}"]

    def node_sets(self, extra: list[str] = ()) -> list[str]:
        """``--set`` flags of ``lowcomm-node join``."""
        return [arg for item in [*self.settings(), *extra] for arg in ("--set", item)]

    def config(self, batch_size: int | None = None, extra: list[str] = ()):
        """The node's own Config for this workload (the baselines build their Trainer from it)."""
        from lowcomm.node.config import load_config

        return load_config(overrides=[*self.settings(batch_size), *extra], environ={})

    def cli(self) -> list[str]:
        """The workload as flags of the baseline scripts (``workload_args``)."""
        return ["--peers", str(self.peers), "--steps", str(self.steps), "--batch-size", str(self.batch_size),
                "--seq-len", str(self.seq_len), "--preset", self.preset, "--seed", str(self.seed),
                "--eval-every", str(self.eval_every)]


def workload_args(parser) -> None:
    """The Workload fields as flags of a benchmark script."""
    defaults = Workload()
    parser.add_argument("--peers", type=int, default=defaults.peers)
    parser.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps per peer")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences per peer per step")
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
    parser.add_argument("--preset", default=defaults.preset)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--eval-every", type=int, default=defaults.eval_every)


def workload_from(args) -> Workload:
    return Workload(peers=args.peers, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                    preset=args.preset, seed=args.seed, eval_every=args.eval_every)


# -- where results go ----------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """What RESULTS.md prints about the machine a record was measured on."""
    import torch

    model = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cores": os.cpu_count(), "cpu_model": model, "torch": torch.__version__, "gpu": gpu,
            "python": platform.python_version(), "kernel": platform.release(),
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}


def command_line() -> str:
    """The command that produced a record, relative to the repository root."""
    argv = [str(Path(sys.argv[0]).resolve().relative_to(REPO)) if Path(sys.argv[0]).resolve().is_relative_to(REPO)
            else sys.argv[0], *sys.argv[1:]]
    return "python " + " ".join(argv)


def nearest_rank(ordered: list[float], q: float) -> float | None:
    """The q-quantile of sorted values by nearest rank, or None for none."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(record, sort_keys=True) + "\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            obj = json.loads(line)
            if isinstance(obj, dict):
                records.append(obj)
    return records


def handle_signals() -> None:
    """SIGTERM and SIGINT end a benchmark through its ``finally`` blocks, so that its processes and
    network namespaces are removed (SIGINT too when started in the background, where the shell
    ignores it)."""
    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- processes -------------------------------------------------------------------------------------


class Proc(NodeProcess):
    """A subprocess whose JSON output lines become events (NodeProcess's reader, any command).

    ``argv`` is the whole command (already wrapped for a namespace where needed); ``stdin=True``
    keeps a pipe for commands such as the baselines' start signal. ``on_event`` runs in the
    reader thread for every event, the moment it is read.
    """

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None, stdin: bool = False,
                 on_event: Callable[[str, Event], None] | None = None, log_path: Path | None = None) -> None:
        super().__init__(name, argv, env, on_event, command=argv, stdin=stdin, log_path=log_path)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def find(self, name: str) -> list[Event]:
        with self._cond:
            return [e for e in self.events if e.get("event") == name]

    def pause(self) -> None:
        """SIGSTOP (this process only, not its children)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL of the whole session if it does not exit in time."""
        self.resume()
        self.signal(signal.SIGTERM)
        try:
            return self.wait_exit(timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            return None


@contextlib.contextmanager
def processes() -> Iterator[list[Proc]]:
    """A list to put started processes in; every one still running is killed on exit."""
    procs: list[Proc] = []
    try:
        yield procs
    finally:
        for proc in procs:
            proc.resume()
            if proc.proc.poll() is None:
                proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in procs:
            try:
                proc.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            proc.kill_all()  # the session: p2pd and DHT children too
            proc._reader.join(timeout=5)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- networks ------------------------------------------------------------------------------------


def netns_module():
    """deploy/netns_cluster.py (not a package: loaded from its path, as the tests do)."""
    if "netns_cluster" in sys.modules:
        return sys.modules["netns_cluster"]
    spec = importlib.util.spec_from_file_location("netns_cluster", REPO / "deploy" / "netns_cluster.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["netns_cluster"] = module
    spec.loader.exec_module(module)
    return module


_NETNS_REASON: list[str | None] = []


def netns_unavailable() -> str | None:
    """Why namespaces cannot be used here (None when they can); probed once per process."""
    if not _NETNS_REASON:
        _NETNS_REASON.append(netns_module().unavailable_reason())
    return _NETNS_REASON[0]


class Network:
    """Loopback: every peer on 127.0.0.1, nothing measured on the wire."""

    kind = "loopback"
    mbit: float | None = None

    @property
    def tcp_congestion(self) -> str | None:
        """The congestion control new TCP sockets get (loopback: the host's)."""
        with contextlib.suppress(OSError):
            return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
        return None

    def host(self, index: int) -> str:
        return "127.0.0.1"

    @property
    def bootstrap_host(self) -> str:
        """Where a harness-side process listens for the peers (root namespace)."""
        return "127.0.0.1"

    def wrap(self, index: int, argv: list[str]) -> list[str]:
        return argv

    @property
    def ifname(self) -> str:
        return "lo"

    def wire_sent(self, index: int) -> int | None:
        """Bytes peer ``index`` has put on its link so far (None: not measurable here)."""
        return None

    def describe(self) -> str:
        return "loopback (127.0.0.1), no cap"


class NetnsNetwork(Network):
    """One namespace per peer from ``netns_cluster.cluster_up(start_nodes=False)``."""

    kind = "netns"

    def __init__(self, state, mbit: float | None) -> None:
        self.state = state
        self.mbit: float | None = None
        self.slow: tuple[int, float] | None = None
        self.set_cap(mbit)

    @property
    def tcp_congestion(self) -> str | None:
        return self.state.tcp_congestion

    def host(self, index: int) -> str:
        return self.state.peers[index].ip

    @property
    def bootstrap_host(self) -> str:
        return self.state.bridge_ip

    def wrap(self, index: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.state.peers[index].netns, *argv]

    @property
    def ifname(self) -> str:
        return "eth0"

    def wire_sent(self, index: int) -> int | None:
        # What peer i transmits on its eth0 arrives on the root-side end of its veth: read there,
        # without entering the namespace (a sysfs read, cheap enough for every event).
        path = Path(f"/sys/class/net/{self.state.peers[index].host_veth}/statistics/rx_bytes")
        try:
            return int(path.read_text())
        except (OSError, ValueError):
            return None

    def link_counters(self, index: int) -> dict[str, int]:
        """TCP segments sent and retransmitted in peer ``index``'s namespace, and the packets its
        two tbf qdiscs (upload: its eth0, download: the root-side veth) dropped."""
        peer = self.state.peers[index]
        snmp = subprocess.run(["ip", "netns", "exec", peer.netns, "cat", "/proc/net/snmp"], capture_output=True,
                              text=True).stdout.splitlines()
        tcp = [line.split()[1:] for line in snmp if line.startswith("Tcp:")]
        values = dict(zip(tcp[0], map(int, tcp[1]))) if len(tcp) == 2 else {}
        drops = 0
        for dev in (["tc", "-n", peer.netns, "-s", "-j", "qdisc", "show", "dev", "eth0"],
                    ["tc", "-s", "-j", "qdisc", "show", "dev", peer.host_veth]):
            with contextlib.suppress(ValueError):
                drops += sum(q.get("drops", 0) for q in json.loads(subprocess.run(dev, capture_output=True,
                                                                                  text=True).stdout or "[]"))
        return {"out_segs": values.get("OutSegs", 0), "retrans_segs": values.get("RetransSegs", 0), "tbf_drops": drops}

    def set_cap(self, mbit: float | None, slow: tuple[int, float] | None = None) -> None:
        """Cap every peer at ``mbit`` both ways (tbf as netns_cluster sets it), or remove the caps;
        ``slow`` = (index, Mbit/s): that peer gets its own, lower cap (a slow volunteer)."""
        for index, peer in enumerate(self.state.peers):
            cap = slow[1] if slow is not None and index == slow[0] else mbit
            for dev in (["tc", "-n", peer.netns], ["tc"]):
                name = "eth0" if len(dev) == 3 else peer.host_veth
                if cap is None:
                    subprocess.run([*dev, "qdisc", "del", "dev", name, "root"], capture_output=True)
                else:
                    rate = cap * 1e6 / 8
                    burst = max(64 * 1024, int(rate * 0.01))
                    subprocess.run([*dev, "qdisc", "replace", "dev", name, "root", "tbf", "rate", f"{cap}mbit",
                                    "burst", str(burst), "latency", "50ms"], check=True, capture_output=True)
        self.mbit, self.slow = mbit, slow

    def describe(self) -> str:
        cap = f"tc tbf {self.mbit:g} Mbit/s per peer, both directions" if self.mbit else "no cap"
        if self.mbit and self.slow is not None:
            cap += f" (peer {self.slow[0]}: {self.slow[1]:g} Mbit/s)"
        return f"{len(self.state.peers)} network namespaces on a bridge (veth), {cap}, TCP {self.tcp_congestion}"


# The TCP congestion control in the benchmarks' namespaces. A volunteer's machine runs its OS's
# default, which is loss-based (cubic on Linux, Windows and macOS); this host runs bbr, which a new
# namespace inherits. bbr overfills the caps' short queues (8-20 % of the segments retransmitted
# at 20 Mbit/s) and every 4 MB all-reduce of the transport grid was 0.03-0.12 less efficient with
# it (bench/analysis.md, section 3). cubic cannot be set in a namespace here (the host allows reno
# and bbr there); reno is the loss-based one it allows. At these links' bandwidth-delay products
# cubic grows its window about as reno does (its TCP-friendly region), but backs off to 0.7 of it
# on a loss instead of 0.5. "host" keeps the host's.
BENCH_TCP_CONGESTION = "reno"


def tcp_congestion_arg(parser) -> None:
    parser.add_argument("--tcp-congestion", default=BENCH_TCP_CONGESTION, metavar="NAME",
                        help=f"TCP congestion control in the peers' namespaces (default {BENCH_TCP_CONGESTION}; "
                             "'host': the host's own)")


@contextlib.contextmanager
def network(kind: str, peers: int, mbit: float | None = None, prefix: str = "lcb",
            tcp_congestion: str = BENCH_TCP_CONGESTION) -> Iterator[Network]:
    """``kind`` "loopback", "netns", or "auto" (netns when available and asked for a cap or root).
    ``tcp_congestion``: the namespaces' TCP congestion control ("host": the host's)."""
    if kind == "auto":
        kind = "netns" if netns_unavailable() is None else "loopback"
    if kind == "loopback":
        if mbit is not None:
            raise RuntimeError("bandwidth caps need network namespaces (root)")
        yield Network()
        return
    reason = netns_unavailable()
    if reason is not None:
        raise RuntimeError(f"network namespaces unavailable: {reason}")
    nc = netns_module()
    state_dir = Path(f"/tmp/lowcomm-bench-{prefix}")
    nc.cluster_down(prefix, state_dir=state_dir)  # leftovers of an interrupted benchmark
    try:
        state = nc.cluster_up(peers, mbit or 10_000, prefix=prefix, state_dir=state_dir, start_nodes=False,
                              tcp_congestion=None if tcp_congestion == "host" else tcp_congestion)
    except nc.ClusterError as err:  # a user's mistake (e.g. --tcp-congestion), said without a traceback
        raise SystemExit(f"bench: {err}") from None
    try:
        for peer in state.peers:
            # A closed connection's window is remembered per destination and starts the next one
            # (tcp_metrics): a configuration's agents would start from the previous one's link.
            subprocess.run(["ip", "netns", "exec", peer.netns, "sysctl", "-qw", "net.ipv4.tcp_no_metrics_save=1"],
                           check=True, capture_output=True)
        yield NetnsNetwork(state, mbit)
    finally:
        nc.cluster_down(prefix, state_dir=state_dir)
        with contextlib.suppress(OSError):  # empty once the cluster is down; kept if anything is left in it
            state_dir.rmdir()


_BOOTSTRAP_DHT = r"""
import json, sys, tempfile, hivemind
from lowcomm.node.dht import place_p2pd_sockets
place_p2pd_sockets(tempfile.gettempdir())  # p2pd's sockets in TMPDIR, as a node's (node/dht.py)
dht = hivemind.DHT(host_maddrs=[f"/ip4/{sys.argv[1]}/tcp/0"], start=True)
print(json.dumps({"event": "bootstrap_ready", "maddrs": [str(m) for m in dht.get_visible_maddrs()]}), flush=True)
sys.stdin.read()  # until the harness closes our stdin (or dies)
dht.shutdown()
"""


@contextlib.contextmanager
def bootstrap_dht(net: "Network") -> Iterator[str]:
    """A plain hivemind DHT peer run by the harness (never paused) for the nodes to join; its multiaddr.

    In namespaces it listens on the bridge's address in the root namespace, which every peer
    reaches directly.
    """
    host = net.bootstrap_host
    with processes() as procs:
        proc = Proc("bootstrap-dht", [PY, "-c", _BOOTSTRAP_DHT, host], stdin=True)
        procs.append(proc)
        maddrs = proc.wait_event("bootstrap_ready", 120)["maddrs"]
        yield next((m for m in maddrs if f"/{host}/" in m), maddrs[0])
        proc.proc.stdin.close()
        # Its own dht.shutdown() removes p2pd's socket and multiprocessing's folder from TMPDIR;
        # the SIGTERM of processes() would leave both behind (one pair per benchmark run).
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait_exit(30)


IDENTITIES = BENCH / "identities"  # fixed libp2p keys: fixed peer ids, hence fixed data shards


def identity(index: int) -> Path:
    path = IDENTITIES / f"peer-{index}.key"
    if not path.exists():
        count = len(list(IDENTITIES.glob("*.key")))
        raise RuntimeError(f"{path} missing: bench/identities holds keys for {count} peers")
    return path


def peer_key(index: int) -> str:
    """The peer id of bench identity ``index``: the node's data-shard key, reused by the baselines
    so that rank/peer i of every method draws the same batches."""
    from hivemind.p2p import PeerID

    return str(PeerID.from_identity(identity(index).read_bytes()))


def wait_port(host: str, port: int, timeout: float, alive: Callable[[], bool] = lambda: True) -> None:
    """Until something accepts TCP connections on host:port (polling: there is no event to wait on)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return
        if not alive():
            raise RuntimeError(f"the process that should listen on {host}:{port} exited")
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:.0f} s")


def node_argv(net: Network, index: int, workdir: Path, peers: list[str], extra: list[str],
              dht_port: int | None = None) -> list[str]:
    """``lowcomm-node join`` for peer ``index`` of ``net`` (netns_cluster's ports, or free ones)."""
    host = net.host(index)
    ports = ["7700", "7701", "7702"] if net.kind == "netns" else ["0", "0", "0"]
    if dht_port is not None:
        ports[0] = str(dht_port)
    argv = [*node_command(), "join", "--host", host, "--announce-host", host, "--dht-port", ports[0],
            "--grpc-port", ports[1], "--metrics-port", ports[2], "--checkpoint-dir", str(workdir / f"peer-{index}"),
            "--identity", str(identity(index)), "--torch-threads", "1", "--log-format", "json"]
    if peers:
        argv += ["--peers", *peers]
    return net.wrap(index, argv + list(extra))


def code_version() -> dict[str, Any] | None:
    """The commit a record was measured on, and whether the code differed from it (``dirty``;
    the benchmarks' own outputs, which change during every run, do not count), or None outside
    a git checkout. Comparing two versions of the code is then a matter of reading records."""
    version = _code_version(REPO)
    return None if version is None else dict(version)  # a copy: records are edited after they are made


@functools.cache
def _code_version(repo: Path) -> dict[str, Any] | None:
    """Asked once per process: a benchmark runs the code it imported at its start."""
    outputs = [":(exclude)bench/out", ":(exclude)bench/RESULTS.md", ":(exclude)bench/plots"]
    try:
        top, commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--show-toplevel", "--short", "HEAD"],
                                     capture_output=True, text=True, timeout=10, check=True).stdout.splitlines()
        if Path(top).resolve() != repo.resolve():  # bench/ copied into some other repository
            return None
        changed = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no", "--",
                                  ".", *outputs], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError, ValueError):  # no git, no checkout, or output we cannot read
        return None
    return {"commit": commit, "dirty": bool(changed.strip())}


def record_base(bench: str, **fields: Any) -> dict[str, Any]:
    return {"bench": bench, "date": now_iso(), "command": command_line(), "machine": machine(),
            "code": code_version(), **fields}




# -- a loopback swarm of real nodes --------------------------------------------------------------


def full_group_rounds(peers: int, rounds: int, extra: list[str], skip: int = 0,
                      seconds_per_round: float = 60.0) -> list[dict[str, Any]]:
    """``round_done`` events of the rounds in which all ``peers`` loopback nodes averaged together.

    Starts ``peers`` real ``lowcomm-node join`` processes on 127.0.0.1 (the first one is the
    bootstrap), waits until every node has ``skip + rounds`` such rounds, stops them all and
    returns each node's rounds ``skip .. skip + rounds`` (``skip`` leaves out warm-up rounds).
    """
    import tempfile

    from lowcomm.node.localswarm import NodeProcess, peer_args

    workdir = Path(tempfile.mkdtemp(prefix="lowcomm-bench-"))
    nodes: list[NodeProcess] = []
    wanted = skip + rounds

    def full_rounds(node: NodeProcess) -> list[dict[str, Any]]:
        return [e for e in node.rounds() if e["group_size"] == peers]

    try:
        nodes.append(NodeProcess("peer-0", peer_args(workdir, 0, extra=extra)))
        maddr = nodes[0].multiaddr
        for i in range(1, peers):
            nodes.append(NodeProcess(f"peer-{i}", peer_args(workdir, i, [maddr], extra)))
        for node in nodes:
            node.wait_for(lambda e, node=node: len(full_rounds(node)) >= wanted,
                          timeout=120 + seconds_per_round * wanted)
        return [e for node in nodes for e in full_rounds(node)[skip:wanted]]
    finally:
        stop_nodes(nodes, workdir)


def stop_nodes(nodes: list, workdir: Path) -> None:
    """SIGTERM every node (a graceful leave), kill what did not exit within 60 s, remove workdir."""
    import shutil

    for node in nodes:
        node.signal(signal.SIGTERM)
    for node in nodes:
        try:
            node.wait_exit(60)
        except Exception:
            node.kill_all()
    shutil.rmtree(workdir, ignore_errors=True)


def write_result(result: dict[str, Any], json_out: Path | None) -> None:
    """Print one benchmark record as a JSON line and append it to ``json_out`` if given."""
    print(json.dumps(result, sort_keys=True))
    if json_out:
        append_jsonl(json_out, result)
