"""Peers whose clocks are off: they measure their offset from the swarm and run on swarm time.

The unit tests check the decision (node/clock.py) without sockets. The multi-process tests run
the real CLI with libfaketime (Debian package ``faketime``) shifting a peer's wall clock, as a
volunteer's drifting clock would: peers seconds and minutes off join and average bit-identically,
with and without a run secret, and a peer further off than ``max_clock_offset`` stops with one
line naming its offset.
"""

from __future__ import annotations

import base64
import glob
import os
import re
import subprocess
import sys
import time

import pytest

from lowcomm.node.clock import ClockOffsetError, Sample, SwarmClock, decide, describe

ROUND_WAIT = 90  # generous bound for one round on a loaded 2-core machine


# -- the decision ----------------------------------------------------------------------------------


def test_offsets_are_the_median_over_peers_and_small_ones_are_left_alone():
    samples = [Sample("peer-a", -300.2, 0.004), Sample("peer-b", -300.0, 0.002), Sample("peer-c", -299.1, 0.010)]
    offset, uncertainty = decide(samples, max_offset=3600)
    assert offset == -300.0
    assert 0.005 <= uncertainty <= 0.005 + 1.1 / 2  # half the slowest round trip + half the spread
    assert decide([Sample("peer-a", 0.3, 0.001)], max_offset=3600)[0] == 0.0  # synchronised clocks
    assert decide([], max_offset=3600) == (0.0, 0.0)  # nobody answered: hivemind's bootstrap says so


def test_too_large_an_offset_or_disagreeing_peers_stop_the_node_with_the_offset_named():
    with pytest.raises(ClockOffsetError, match=r"5 min 0\.0 s ahead of the swarm's \(300\.0 s.*up to 60 s.*synchronise"):
        decide([Sample("peer-a", -300.0, 0.001)], max_offset=60)
    with pytest.raises(ClockOffsetError, match="corrects up to 0 s"):
        decide([Sample("peer-a", 2.0, 0.001)], max_offset=0)  # 0: never correct
    with pytest.raises(ClockOffsetError, match=r"disagree on the time by 300\.0 s"):
        decide([Sample("peer-a", 0.0, 0.001), Sample("peer-b", 300.0, 0.001)], max_offset=3600)
    assert describe(7300.0) == "2 h 1 min behind" and describe(-4.04) == "4.0 s ahead of"


def test_swarm_time_keeps_running_when_the_wall_clock_is_stepped():
    wall, steady = [1_000_000.0], [50.0]
    clock = SwarmClock(lambda: wall[0], lambda: steady[0])
    assert clock.time() == 1_000_000.0 and clock.offset == 0.0  # no correction: the wall clock
    clock.set(-300.0, 0.002, 2)  # measured: 5 minutes ahead
    assert clock.time() == 999_700.0 and clock.measured_offset == -300.0
    wall[0] += 10.0
    steady[0] += 10.0
    assert clock.time() == 999_710.0
    wall[0] += 1.0 - 300.0  # a second later NTP steps the wall clock to the right time
    steady[0] += 1.0
    assert clock.time() == 999_711.0 and clock.offset == pytest.approx(0.0)


def test_hivemind_refusing_a_bootstrap_peer_becomes_one_line():
    from hivemind.dht.protocol import ValidationError

    from lowcomm.node.cli import _validation_message

    # hivemind's own text, as its bootstrap ping raises it when the offset was not corrected
    clock = ValidationError("local time must be within 3 seconds  of others(local: 1000300.00000, peer: 1000000.00000)")
    line = _validation_message(clock)
    assert "5 min 0.0 s ahead of a bootstrap peer's (300.0 s" in line and "synchronise" in line
    firewall = ValidationError("Peer QmX can't access this node. Probably, libp2p has failed to bypass the firewall")
    assert "--client-mode" in _validation_message(firewall)
    assert "\n" not in line + _validation_message(firewall) + _validation_message(ValidationError("other"))


# -- real nodes on shifted clocks --------------------------------------------------------------------


def _libfaketime() -> str | None:
    for pattern in ("/usr/lib/*/faketime/libfaketime.so.1", "/usr/lib/faketime/libfaketime.so.1",
                    "/usr/local/lib/faketime/libfaketime.so.1"):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def shifted(seconds: int) -> dict[str, str]:
    """Environment of a process whose wall clock is ``seconds`` ahead (negative: behind); skips the
    test when libfaketime is missing or does not move Python's ``time.time()``."""
    library = _libfaketime()
    if library is None:
        pytest.skip("libfaketime is not installed (Debian/Ubuntu: apt-get install faketime)")
    # Monotonic clocks stay true, as on a machine whose wall clock is merely set wrong.
    env = {"LD_PRELOAD": library, "FAKETIME": f"{seconds:+d}", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    started = time.time()
    probe = subprocess.run([sys.executable, "-c", "import time; print(time.time())"], capture_output=True,
                           text=True, env={**os.environ, **env}, timeout=60)
    ended = time.time()
    try:
        shift = float(probe.stdout.strip()) - (started + ended) / 2
    except ValueError:
        shift = None
    if shift is None or abs(shift - seconds) > 1 + (ended - started) / 2:
        pytest.skip(f"libfaketime ({library}) did not shift a child's clock by {seconds} s "
                    f"(measured {shift}; output {probe.stdout!r} {probe.stderr[-200:]!r})")
    return env


def measured_offset(node) -> float:
    return node.wait_event("clock_offset", ROUND_WAIT)["offset_s"]


def assert_average_together(nodes, rounds: int = 2) -> None:
    """``rounds`` steps at which the first node averaged with all others, all on one hash."""
    first, *others = nodes
    steps: list[tuple[int, str]] = []
    index = 0
    while len(steps) < rounds:
        event = first.wait_for(lambda e: e.get("event") == "round_done" and e["group_size"] == len(nodes),
                               ROUND_WAIT * 2, start=index)
        index = first.events.index(event) + 1
        steps.append((event["outer_step"], event["params_sha256"]))
    for step, digest in steps:
        for node in others:
            theirs = node.wait_for(lambda e: e.get("event") == "round_done" and e["outer_step"] == step, ROUND_WAIT)
            assert theirs["params_sha256"] == digest, f"{node.name} disagrees at step {step}"


def error_lines(node) -> list[str]:
    return [line for line in node.raw_lines if line.startswith("lowcomm-node: error:")]


@pytest.mark.multiprocess
@pytest.mark.slow  # make test-slow (make test stays under 15 min); the offset logic is tested above without sockets
def test_peers_minutes_and_seconds_off_join_a_secret_run_and_average(swarm, tmp_path):
    ahead, behind = shifted(300), shifted(-4)  # 5 minutes ahead; a few seconds behind
    secret = tmp_path / "run.secret"
    secret.write_bytes(base64.b64encode(os.urandom(32)) + b"\n")
    auth = ["--run-secret-file", str(secret)]
    first = swarm.start(0, extra=auth)
    fast = swarm.start(1, [first.multiaddr], extra=auth, env=ahead)
    slow = swarm.start(2, [first.multiaddr], extra=auth, env=behind)

    assert measured_offset(fast) == pytest.approx(-300, abs=1.5)
    assert measured_offset(slow) == pytest.approx(4, abs=1.5)
    assert_average_together([first, fast, slow])
    # Tokens and signed records on swarm time: every RPC and record of the run was accepted
    # (uncorrected, the fast peer's tokens would be 5 minutes outside the 60 s window).
    refused = ("rpc_unauthenticated", "dht_unsigned")
    assert not [(n.name, e["msg"]) for n in (first, fast, slow) for e in n.events if e.get("event") in refused]
    assert not any(e.get("event") == "clock_offset" for e in first.events)


@pytest.mark.multiprocess
@pytest.mark.slow  # make test-slow (make test stays under 15 min); the offset logic is tested above without sockets
def test_peers_off_join_an_open_run_and_one_beyond_max_clock_offset_stops_with_one_line(swarm):
    behind, ahead, far = shifted(-420), shifted(5), shifted(300)  # 7 min behind; 5 s ahead; 5 min ahead
    first = swarm.start(0)
    slow = swarm.start(1, [first.multiaddr], env=behind)
    # These two bootstrap through the corrected peer: it passes on swarm time, not its own clock.
    fast = swarm.start(2, [slow.multiaddr], env=ahead)
    refused = swarm.start(3, [slow.multiaddr], env={**far, "LOWCOMM_MAX_CLOCK_OFFSET": "60"})

    assert refused.wait_exit(ROUND_WAIT) != 0
    lines = error_lines(refused)
    assert len(lines) == 1, refused.raw_lines[-5:]
    named = re.search(r"clock is .* ahead of the swarm's \((\d+\.\d) s, measured", lines[0])
    assert named and float(named.group(1)) == pytest.approx(300, abs=1.5), lines[0]
    assert "synchronise this machine's clock" in lines[0] and "max_clock_offset" in lines[0]
    assert not any("Traceback" in line for line in refused.raw_lines)

    assert measured_offset(slow) == pytest.approx(420, abs=1.5)
    assert measured_offset(fast) == pytest.approx(-5, abs=1.5)
    assert_average_together([first, slow, fast])
