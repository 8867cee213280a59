"""The compose cluster for real: deploy/docker-compose.yml run with podman (deploy/podman/).

Builds the images (layer-cached after the first run), starts a bootstrap peer, three peers and
Prometheus in a compose project of its own, and checks what a user of `make cluster` relies on:
the peers agree on one outer step and params hash, Prometheus scrapes every node, a killed peer
does not stop the others and resumes from its volume when restarted, and `down` leaves nothing
behind. Minutes long, so it runs only in `make test-containers` (marker `containers`, which
pyproject's addopts leave out of the default run).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "deploy" / "podman" / "cluster.sh"
CONTAINERS_CONF = REPO / "deploy" / "podman" / "containers.conf"
PEERS = 3
MIN_STEP = 3
# Rounds of the compose run config (deploy/run.toml: 50 inner steps of a tiny model on one
# torch thread) take tens of seconds on a loaded 2-core machine; these bound each wait.
ROUND_WAIT_S = 600.0
POLL_S = 3.0

# Cold image builds take about 6 minutes, the cluster part about 5; this bounds a failing run.
pytestmark = [pytest.mark.containers, pytest.mark.timeout(2400)]

T = TypeVar("T")


def _tool(name: str) -> str | None:
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _skip_reason() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    if shutil.which("podman") is None:
        return "podman is not installed (make test-containers installs it with apt-get)"
    if _tool("podman-compose") is None:
        return "podman-compose is not installed (make test-containers installs it with pip)"
    if os.geteuid() != 0:
        return "the base image is made with debootstrap, which needs root"
    if shutil.which("debootstrap") is None:
        return "debootstrap is not installed (make test-containers installs it with apt-get)"
    info = subprocess.run(["podman", "info", "--format", "{{.Host.OCIRuntime.Name}}"],
                          env={**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)},
                          capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        return f"podman cannot run here: {(info.stderr or info.stdout).strip()[:300]}"
    return None


class Cluster:
    """One compose project of deploy/podman/cluster.sh, named for this test run."""

    def __init__(self, project: str) -> None:
        self.project = project
        self.prometheus_port = _free_port()
        self.env = {
            **os.environ,
            "PROJECT": project,
            "PEERS": str(PEERS),
            "PIP": _tool("pip") or "pip",
            "PODMAN_COMPOSE": _tool("podman-compose") or "podman-compose",
            "PROMETHEUS_PORT": str(self.prometheus_port),
            "CONTAINERS_CONF": str(CONTAINERS_CONF),
        }

    def script(self, command: str, timeout: float) -> str:
        # Output to a file, not a pipe: the containers' monitors (conmon) inherit the script's
        # stdio, and a pipe would only reach end-of-file when the last container exits.
        with tempfile.TemporaryFile(mode="w+") as out:
            proc = subprocess.run([str(SCRIPT), command], cwd=REPO, env=self.env, stdin=subprocess.DEVNULL,
                                  stdout=out, stderr=subprocess.STDOUT, text=True, timeout=timeout)
            out.seek(0)
            text = out.read()
        assert proc.returncode == 0, f"cluster.sh {command} failed:\n{text}"
        return text

    def podman(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(["podman", *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if check:
            assert proc.returncode == 0, f"podman {' '.join(args)}: {proc.stderr.strip()}"
        return proc

    def containers(self, service: str | None = None, all_states: bool = False) -> list[str]:
        args = ["ps", "--format", "{{.Names}}", "--filter", f"label=io.podman.compose.project={self.project}"]
        if service:
            args += ["--filter", f"label=com.docker.compose.service={service}"]
        if all_states:
            args.append("-a")
        return sorted(self.podman(*args).stdout.split())

    def nodes(self) -> list[str]:
        return self.containers("bootstrap") + self.containers("peer")

    def status(self, container: str) -> dict[str, Any] | None:
        """`lowcomm-node status --json` inside the container; None while it does not answer."""
        try:
            # Python's start-up alone can take a minute when the machine is overloaded.
            proc = self.podman("exec", container, "lowcomm-node", "status", "--json", "--timeout", "20",
                               timeout=240, check=False)
        except subprocess.TimeoutExpired:
            return None
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def logs_since(self, container: str, since: str) -> list[dict[str, Any]]:
        """The node's JSON log records written since ``since`` (RFC 3339)."""
        proc = self.podman("logs", "--since", since, container, timeout=60)
        records = []
        for line in (proc.stdout + proc.stderr).splitlines():
            if line.startswith("{"):
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return records

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=io.podman.compose.project={self.project}"
        found = {
            "containers": self.podman("ps", "-a", "-q", "--filter", label).stdout.split(),
            "volumes": self.podman("volume", "ls", "-q", "--filter", label).stdout.split(),
            "networks": [name for name in self.podman("network", "ls", "--format", "{{.Name}}").stdout.split()
                         if name.startswith(self.project)],
        }
        return {kind: names for kind, names in found.items() if names}


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = ROUND_WAIT_S) -> T:
    """Polls an outside system (containers, Prometheus) until ``probe`` returns a value."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(POLL_S)
    pytest.fail(f"timed out waiting for {what}")


class Agreement:
    """What each node said its (outer step, params hash) was, asked in parallel on every poll.

    On a loaded machine one `lowcomm-node status` in a container can take longer than a round,
    so the nodes are never asked at one instant: they agree at step s when every one of them
    reported step s, each with the same hash.
    """

    def __init__(self, cluster: Cluster, nodes: list[str]) -> None:
        self.cluster = cluster
        self.nodes = nodes
        self.seen: dict[str, dict[int, str]] = {node: {} for node in nodes}

    def poll(self) -> None:
        with ThreadPoolExecutor(len(self.nodes)) as pool:
            for node, report in zip(self.nodes, pool.map(self.cluster.status, self.nodes)):
                if report is not None:
                    self.seen[node][report["outer_step"]] = report["params_sha256"]

    def latest(self, node: str) -> int:
        return max(self.seen[node], default=-1)

    def agreed_above(self, above: int) -> tuple[int, str] | None:
        """The newest step > ``above`` every node reported with one hash, after one more poll."""
        self.poll()
        common = set.intersection(*(set(steps) for steps in self.seen.values()))
        for step in sorted((s for s in common if s > above), reverse=True):
            if len({self.seen[node][step] for node in self.nodes}) == 1:
                return step, self.seen[self.nodes[0]][step]
        return None


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    cluster = Cluster(f"lowcomm-test-{os.getpid()}")
    started = time.monotonic()
    out = cluster.script("images", timeout=2400)
    print(f"images built in {time.monotonic() - started:.0f} s:\n{out}")
    try:
        yield cluster
    finally:
        cluster.script("down", timeout=300)


def test_node_image_is_small_unprivileged_cpu_and_has_no_build_tools(cluster: Cluster) -> None:
    image = cluster.env.get("NODE_IMAGE") or "localhost/lowcomm:0.1.0-cpu"
    inspect = json.loads(cluster.podman("image", "inspect", image).stdout)[0]
    assert inspect["Config"]["User"].split(":")[0] == "10001"
    # Podman reports the docker format's HEALTHCHECK next to the OCI config, not inside it.
    assert "lowcomm-node healthcheck" in " ".join(inspect["Healthcheck"]["Test"])
    probe = ("import shutil, torch; "
             "print(torch.__version__); "
             "print(*[t for t in ('gcc', 'cc', 'c++', 'make', 'pip', 'pip3') if shutil.which(t)])")
    proc = cluster.podman("run", "--rm", "--entrypoint", "python3", image, "-c", probe)
    version, tools = (proc.stdout.splitlines() + ["", ""])[:2]
    assert version.endswith("+cpu"), f"torch {version} in the image is not the CPU build"
    assert tools == "", f"build tools in the image: {tools}"


def test_cluster_agrees_is_scraped_survives_a_killed_peer_and_leaves_nothing(cluster: Cluster) -> None:
    out = cluster.script("up", timeout=900)
    assert "Grafana is not started" in out
    nodes = cluster.nodes()
    assert len(nodes) == PEERS + 1, nodes

    # Every node at one outer step >= MIN_STEP with one params hash, as the nodes themselves say.
    everyone = Agreement(cluster, nodes)
    step, digest = wait_for(f"all nodes at one outer step >= {MIN_STEP}", lambda: everyone.agreed_above(MIN_STEP - 1))
    print(f"{len(nodes)} nodes agree at outer step {step}, params {digest[:16]}")

    # Prometheus (its targets API, through the published port) scrapes every node, found by
    # DNS service discovery of the compose services.
    ips = {json.loads(cluster.podman("inspect", node).stdout)[0]["NetworkSettings"]["Networks"]
           [f"{cluster.project}_default"]["IPAddress"] for node in nodes}

    def scraped() -> set[str] | None:
        url = f"http://127.0.0.1:{cluster.prometheus_port}/api/v1/targets?state=active"
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                targets = json.load(reply)["data"]["activeTargets"]
        except OSError:
            return None
        up = {t["labels"]["instance"].rsplit(":", 1)[0] for t in targets if t["health"] == "up"}
        return up if up >= ips else None

    assert wait_for("Prometheus scraping every node", scraped, timeout=300) >= ips

    # Kill one peer outright: the others go on without it, past the step it died at.
    victim = cluster.containers("peer")[-1]
    others = [node for node in nodes if node != victim]
    everyone.poll()
    killed_at = max(everyone.latest(node) for node in nodes)
    kill_time = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    cluster.podman("kill", "--signal", "KILL", victim)
    survivors = Agreement(cluster, others)
    step, _ = wait_for("the other nodes to agree on a later step", lambda: survivors.agreed_above(killed_at))
    print(f"killed {victim} at swarm step {killed_at}; the other {len(others)} agree at step {step}")

    # A killed container stays down (restart: unless-stopped treats it as stopped by hand).
    # Started again, it loads its newest checkpoint from its volume (the directory of its
    # hostname, the same container's), then catches up with the swarm.
    cluster.podman("start", victim)
    resumed = wait_for("the restarted peer to resume from its checkpoint",
                       lambda: [r for r in cluster.logs_since(victim, kill_time) if r.get("event") == "resumed"],
                       timeout=300)
    assert resumed[0]["outer_step"] >= 1, resumed[0]
    print(f"{victim} restarted: resumed from {resumed[0]['checkpoint']} (outer step {resumed[0]['outer_step']})")
    rejoined = Agreement(cluster, nodes)
    rejoined.poll()
    swarm_step = max(rejoined.latest(node) for node in others)
    step, _ = wait_for("the restarted peer to rejoin the swarm's step and hash", lambda: rejoined.agreed_above(swarm_step))
    print(f"all {len(nodes)} nodes agree again at step {step}")

    cluster.script("down", timeout=300)
    assert cluster.leftovers() == {}
