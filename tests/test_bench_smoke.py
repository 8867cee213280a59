"""Every benchmark of bench/ at its smallest size, so that the harness cannot rot.

Each benchmark runs as the documented command (a subprocess) with tiny arguments and writes its
JSON lines into a temporary directory; the assertions are about the records' shape and
consistency, never about speed (DESIGN §7). The benchmarks that need network namespaces (slow
links, overlap) are skipped with the reason where they are unavailable; transport then runs on
loopback. results.py regenerates RESULTS.md into a temporary directory, never bench/RESULTS.md.

Every benchmark process (and everything it starts: nodes, p2pd, baselines, agents) carries a
marker in its environment; the last test checks that none of them outlived its benchmark and
that no namespace of these tests is left.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import psutil
import pytest

from .netns_module import load_netns_cluster

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # make test-slow

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
# Two peers, ten steps of four sequences: seconds of compute, every code path of the harness.
TINY = ["--peers", "2", "--steps", "10", "--batch-size", "4", "--eval-every", "5"]
HIVEMIND_FAST = ["--hivemind-matchmaking-time", "1", "--hivemind-averaging-timeout", "10"]
PREFIXES = ("lcsmk", "lctsmk", "lcosmk")  # netns prefixes of these tests
MARKER = "LOWCOMM_BENCH_SMOKE"
RUN_MARK = uuid.uuid4().hex


@pytest.fixture(scope="module")
def netns_reason() -> str | None:
    """Why network namespaces cannot be used here, or None (deploy/netns_cluster.py's probe)."""
    return load_netns_cluster().unavailable_reason()


def bench(script: str, *args: str, timeout: float = 270) -> subprocess.CompletedProcess:
    """Run one benchmark in a TMPDIR of its own, which it must leave as it found it: p2pd's and
    hivemind's sockets and multiprocessing folders of its processes (nodes, baselines, agents, the
    bootstrap DHT) go with them, also when the harness ends them with a signal."""
    tmpdir = Path(tempfile.mkdtemp(prefix="b-"))  # short: p2pd's socket paths below it must fit in 107 bytes
    env = {**os.environ, MARKER: RUN_MARK, "TMPDIR": str(tmpdir)}
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    # torch's compile cache (torchinductor_<user>) is a cache that torch keeps there by design.
    left = sorted(p.name for p in tmpdir.iterdir() if not p.name.startswith("torchinductor_"))
    assert not left, f"{script} left in TMPDIR: {left}"
    shutil.rmtree(tmpdir)
    return proc


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bench-out")


def test_codecs(out):
    bench("codecs.py", "--numel", "4096", "--repeat", "1", "--json-out", str(out / "codecs.jsonl"))
    got = records(out / "codecs.jsonl")
    assert {r["codec"] for r in got} >= {"fp32", "int8", "int4", "topk"}
    assert all(r["ratio"] >= 1 and r["encode_MBps"] > 0 for r in got)


def test_frozen_params(out):
    bench("frozen_params.py", "--steps", "20", "--hash-gb", "0.01", "--json-out", str(out / "frozen_params.jsonl"))
    got = {r["variant"] + r.get("dtype", ""): r for r in records(out / "frozen_params.jsonl")}
    assert set(got) == {"frozen", "averaged", "hashfloat32", "hashbfloat16"}
    frozen, averaged = got["frozen"], got["averaged"]
    # The adapters alone against the whole model: what each round's bytes are made of.
    assert frozen["averaged_numel"] == frozen["trainable"] < averaged["averaged_numel"] == 117056
    assert frozen["hashes_agree"] and averaged["hashes_agree"] and frozen["rounds"] == averaged["rounds"] == 2
    assert frozen["bytes_sent_median"] < averaged["bytes_sent_median"]
    assert got["hashfloat32"]["seconds"] > 0



def test_dead_member(out):
    bench("dead_member.py", "--peers", "3", "--rounds", "1", "--reduce-timeout", "20",
          "--json-out", str(out / "dead_member.jsonl"))
    got = {r["schedule"]: r for r in records(out / "dead_member.jsonl")}
    assert set(got) == {"staggered", "ring"}
    for record in got.values():
        assert record["peers"] == 3 and record["rounds"] == 1 and record["deadline_seconds"] == 25.0
        assert record["seconds_min"] <= record["seconds"] <= record["seconds_max"]
    # The butterfly skips the dead owner's shards only; a ring with a hole skips every shard.
    assert 1 <= got["staggered"]["skipped_shards_per_survivor"] < got["ring"]["skipped_shards_per_survivor"]

def test_convergence(out):
    # Loopback: the namespaced variant of the same runners is covered by the slow-link test.
    bench("convergence.py", "--methods", "single,ddp,diloco-int8-H5,hivemind-H5", "--network", "loopback", *TINY,
          *HIVEMIND_FAST, "--time-limit", "120", "--json-out", str(out / "convergence.jsonl"))
    got = {r["method"]: r for r in records(out / "convergence.jsonl")}
    assert set(got) == {"single", "ddp", "diloco-int8-H5", "hivemind"}
    assert len({r["run_id"] for r in got.values()}) == 1
    for method, record in got.items():
        assert record["ok"], (method, record.get("error"), record.get("notes"))
        assert record["final_eval_loss"] < 6, method  # ln(256) = 5.55: the model learned something
        if not any(record.get("inner_phase_cuts") or []):  # a slower blocking node may cut a phase short
            assert record["tokens"] == 10 * 2 * 4 * 128, method  # equal tokens for every method
        assert 0 < record["tokens"] <= 10 * 2 * 4 * 128, method
        assert [p["step"] for p in record["curve"]] == [5, 10], method
        assert record["peers"] == (1 if method == "single" else 2), method
        assert record["machine"]["cores"] and record["command"].startswith("python bench/convergence.py")
    diloco = got["diloco-int8-H5"]
    assert [n for n in diloco["notes"] if not n.startswith("inner phases cut short")] == []
    assert diloco["app_bytes_sent_per_peer"] > 0 and len(diloco["inner_phase_cuts"]) == 2
    assert [len(p) for p in diloco["peer_rounds"]] == [2, 2] and diloco["round_late"] == [0, 0]
    # int8 sends about 4x fewer payload bytes per round than fp32 gradients, and DiLoCo rounds are H apart.
    assert diloco["app_bytes_sent_per_peer"] < got["ddp"]["app_bytes_sent_per_peer"] / 5


def test_slow_links(out, netns_reason):
    if netns_reason is not None:
        pytest.skip(f"slow links need network namespaces: {netns_reason}")
    # Without hivemind: its runner is the convergence test's, and the namespace wrapping is ddp's.
    bench("slow_links.py", "--caps", "50", "--methods", "ddp,diloco", "--diloco", "int8-H5", "--ddp-steps", "4",
          "--max-factor", "1", "--time-limit", "120", *TINY, "--convergence", str(out / "convergence.jsonl"),
          "--json-out", str(out / "slow_links.jsonl"), "--prefix", "lcsmk")
    got = [r for r in records(out / "slow_links.jsonl") if r.get("role") != "reference"]
    assert {r["method"] for r in got} == {"ddp", "diloco-int8-H5"}
    for record in got:
        assert record["mbit"] == 50 and record["target_loss"] > 0, record["method"]
        assert record.get("error") is None, record.get("error")
    ddp = next(r for r in got if r["method"] == "ddp")
    assert ddp["time_to_target"]["estimated"] and ddp["step_seconds_median"] > 0
    diloco = next(r for r in got if r["method"] == "diloco-int8-H5")
    assert diloco["wire_bytes_sent_per_peer"] >= diloco["app_bytes_sent_per_peer"] > 0


def test_transport(out, netns_reason):
    network = ["--network", "loopback"] if netns_reason is not None else ["--caps", "100", "--prefix", "lctsmk"]
    bench("transport.py", "--peers", "2,3", "--sizes-mb", "0.5", "--rounds", "1", "--hivemind",
          "2x0.5@100", *network, "--json-out", str(out / "transport.jsonl"))
    got = records(out / "transport.jsonl")
    # Both of lowcomm's schedules by default: the node's butterfly and the ring (sync.schedule).
    assert {(r["impl"], r.get("schedule"), r["peers"]) for r in got} == {
        ("lowcomm", "staggered", 2), ("lowcomm", "staggered", 3), ("lowcomm", "ring", 2), ("lowcomm", "ring", 3),
        ("hivemind", None, 2)}
    for record in got:
        assert record["ok"] and record["seconds"] > 0, record
    for record in (r for r in got if r["impl"] == "lowcomm"):
        # What the all-reduce counted equals the volume 2(N-1)/N*S (fp32 shards, exact split), ring or not.
        assert record["bytes_sent_per_peer"] == pytest.approx(record["bytes_bound_per_peer"], rel=1e-3)
        if netns_reason is None:
            assert record["efficiency"] > 0 and 0 <= record["rounds"][0]["tcp_retrans_fraction"] <= 1
    if netns_reason is None:  # the namespaces ran the benchmarks' congestion control, not the host's
        assert {r["tcp_congestion"] for r in got} == {"reno"}


def test_overlap(out, netns_reason):
    if netns_reason is not None:
        pytest.skip(f"the overlap benchmark needs network namespaces: {netns_reason}")
    # Blocking and one overlapped mode: the harness does the same for every mode (only
    # sync.overlap differs); the modes themselves are tested in test_overlap_cli.py.
    # Four rounds, not three: an overlapped round may commit after the next inner phase ended
    # (training waits for it at the boundary after), so rounds 2 and 3 can carry the same
    # phase-end clock and leave no utilization window; round 4's comes after phase 4, strictly
    # later than any clock round 2 can carry.
    bench("overlap.py", "--modes", "none,eager", "--peers", "2", "--rounds", "4", "--inner-steps", "5",
          "--batch-size", "4", "--seeds", "7",
          "--time-limit", "90", "--prefix", "lcosmk", "--json-out", str(out / "overlap.jsonl"))
    got = {r["mode"]: r for r in records(out / "overlap.jsonl")}
    assert set(got) == {"none", "eager"}
    for mode, record in got.items():
        assert record["ok"] and record.get("error") is None, (mode, record.get("error"), record.get("notes"))
        assert record["rounds_done_per_peer"] == [4, 4] and record["group_sizes"] == [2], mode
        assert record["eval_outer_step"] == 4 and 0 < record["eval_loss"] < 6, mode
        assert [p["outer_step"] for p in record["eval_curve"]] == [1, 2, 3, 4], mode
        tokens = [p["tokens_in_model"] for p in record["eval_curve"]]
        assert 0 < tokens[0] < tokens[1] < tokens[2] < tokens[3] == record["tokens_in_model"], (mode, tokens)
        assert len(record["rounds_without_result"]) == 2, mode
        assert 0 < record["utilization_window_median"] <= 1, mode
        assert 0 < record["utilization_since_start_median"] <= 1, mode
        assert len(record["round_late"]) == 2 and record["mbit"] == 20 and record["seed"] == 7, mode
    assert got["none"]["round_late"] == [0, 0]  # blocking rounds never wait for a background round


def test_results(out, tmp_path):
    """RESULTS.md and the plots from whatever the tests above left (all of it when run in order),
    plus one failed run, which must be listed as failed without hiding the others."""
    conv = out / "convergence.jsonl"
    if conv.exists():
        run_id = records(conv)[0]["run_id"]
        with conv.open("a") as fh:
            fh.write(json.dumps({"bench": "convergence", "run_id": run_id, "method": "diloco-topk-H5", "ok": False,
                                 "curve": [], "error": "peer-1: expected event did not come\nboom: it broke",
                                 "logs": "bench/out/logs/x", "date": "2000-01-01T00:00:00+00:00"}) + "\n")
    bench("results.py", "--in-dir", str(out), "--out", str(tmp_path / "RESULTS.md"))
    text = (tmp_path / "RESULTS.md").read_text()
    for heading in ("## Goals", "## 1. Convergence", "## 2. Slow links", "## 3. Transport", "## 4. Codecs",
                    "## 5. Overlap"):
        assert heading in text
    assert not (tmp_path / "plots").exists() or (tmp_path / "plots").is_dir()
    if conv.exists():
        assert "| diloco-int8-H5 |" in text and ", 2 peers with one torch thread each" in text
        assert "**FAILED: diloco-topk-H5** — peer-1: expected event did not come / boom: it broke" in text
        assert all((tmp_path / "plots" / name).stat().st_size > 0
                   for name in ("convergence_tokens.png", "convergence_bytes.png", "convergence_wall.png"))
    if (out / "transport.jsonl").exists():  # which TCP the namespaces ran is said (loopback: the host's)
        congestion = {r["tcp_congestion"] for r in records(out / "transport.jsonl") if r.get("impl") and not r.get("error")}
        assert f"TCP congestion control in the namespaces: {', '.join(sorted(congestion))}" in text
    if (out / "overlap.jsonl").exists():
        assert "| eager |" in text and (tmp_path / "plots" / "overlap.png").stat().st_size > 0
        assert "Overlap `eager` at 20 Mbit/s, H=5, compute utilization ≥0.95" in text


def test_nothing_left_behind(netns_reason):
    """No process started by a benchmark above is still running, no namespace of theirs is left."""
    left = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.environ().get(MARKER) == RUN_MARK:
                left.append((proc.pid, " ".join(proc.info["cmdline"] or [])[:200]))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    assert not left, f"benchmark processes still running: {left}"
    if netns_reason is None:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        assert not [n for n in names if n.split("-")[0] in PREFIXES], names
