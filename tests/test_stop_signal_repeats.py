"""A stop signal sent twice at once is one stop request; a later one still forces the stop.

coreutils `timeout 60 lowcomm-node join ...` sends its SIGTERM to the node and then to the
node's process group, the node included: the node took the copy, microseconds later, for a second
signal, logged "second stop signal: abandoning everything" and skipped the graceful stop (the
grace period, the checkpoint of the round in flight). The same for a program in a
``lowcomm.Swarm`` (lowcomm/api_signals.py).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from lowcomm.node.stopsignals import REPEAT_WINDOW, RepeatFilter, route_stop_signals

from .conftest import FAST, act_at_line, assert_stopped_cleanly_with_its_checkpoint, json_messages
from .test_cli_errors import join_command


class Clock:
    """Monotonic seconds the test sets; counts how often it was read."""

    def __init__(self) -> None:
        self.now = 100.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


def test_a_signal_within_the_window_of_the_first_repeats_it_and_a_later_one_does_not() -> None:
    clock = Clock()
    repeats = RepeatFilter(clock)
    assert not repeats.is_repeat()  # the first: a stop request
    clock.now += 1e-6  # the process group's copy
    assert repeats.is_repeat()
    clock.now += REPEAT_WINDOW / 2
    assert repeats.is_repeat()
    # Measured from the first signal: copies cannot hold off a person's later Ctrl-C.
    clock.now += REPEAT_WINDOW / 2
    assert not repeats.is_repeat()
    assert not repeats.is_repeat()  # and every one after it


def test_the_nodes_loop_takes_two_signals_back_to_back_as_one_stop_request() -> None:
    clock = Clock()
    requests: list[float] = []
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        taken = route_stop_signals(loop, lambda: requests.append(clock.now), clock)
        try:
            assert signal.SIGTERM in taken and signal.SIGINT in taken
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # `timeout`'s copy to the process group
            async with asyncio.timeout(10):
                while clock.reads < 2:  # both reached the handler (none merged by the kernel)
                    await asyncio.sleep(0)
            assert requests == [100.0]
            clock.now += REPEAT_WINDOW + 0.5  # a person's second Ctrl-C, later: forces the stop
            os.kill(os.getpid(), signal.SIGINT)
            async with asyncio.timeout(10):
                while clock.reads < 3:
                    await asyncio.sleep(0)
            assert requests == [100.0, 100.0 + REPEAT_WINDOW + 0.5]
        finally:
            for sig in taken:
                loop.remove_signal_handler(sig)

    try:
        asyncio.run(scenario())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_SWARM_PROGRAM = """
import os, signal
from lowcomm import api_signals
from lowcomm.api_signals import Terminated

clock = [0.0]
replaced = api_signals.take_stop_signals(clock=lambda: clock[0])
assert set(replaced) == {signal.SIGTERM, signal.SIGHUP}, replaced


def settle():
    for _ in range(1000):  # Python runs a handler between two bytecodes of the main thread
        pass


try:
    os.kill(os.getpid(), signal.SIGTERM)
    settle()
    print("not stopped", flush=True)
except Terminated as first:
    # The Swarm stops gracefully here; before, the copy raised Terminated again in the middle
    # of it, as a second stop does.
    os.kill(os.getpid(), signal.SIGTERM)
    settle()
    print("one stop", first.code, flush=True)
clock[0] = 5.0
try:
    os.kill(os.getpid(), signal.SIGHUP)
    settle()
    print("not forced", flush=True)
except Terminated as second:
    print("forced", second.code, flush=True)
api_signals.give_back_stop_signals(replaced)
"""


def test_a_swarm_program_takes_a_sigterm_and_its_copy_as_one_stop_and_a_later_one_as_the_second() -> None:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_SWARM_PROGRAM)], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL, start_new_session=True)
    assert done.returncode == 0 and done.stdout.split("\n") == ["one stop 143", "forced 129", ""], done


def _term_then_hangup(proc: subprocess.Popen) -> None:
    # Two stop signals microseconds apart, as systemd sends (SIGTERM, then SIGHUP with
    # SendSIGHUP=yes); two different ones, so that the kernel cannot merge them into one as it may
    # merge `timeout`'s two SIGTERMs.
    os.kill(proc.pid, signal.SIGTERM)
    os.kill(proc.pid, signal.SIGHUP)


@pytest.mark.multiprocess
@pytest.mark.parametrize("via", ["coreutils-timeout", "term-then-hangup"])
def test_a_node_given_a_stop_twice_at_once_stops_gracefully_with_its_checkpoint(tmp_path, via: str) -> None:
    if via == "coreutils-timeout":
        if shutil.which("timeout") is None:
            pytest.skip("needs coreutils timeout")
        # `timeout` forwards a SIGTERM it gets to the node and to its process group, as when its
        # time runs out: two SIGTERMs microseconds apart (or one, when the kernel merges them).
        command = ["timeout", "600", *join_command(tmp_path, *FAST)]
        act = lambda proc: proc.send_signal(signal.SIGTERM)  # noqa: E731
    else:
        command, act = join_command(tmp_path, *FAST), _term_then_hangup
    _, code, out, err = act_at_line(command, '"event": "round_done"', act)
    assert code == 0, err
    assert_stopped_cleanly_with_its_checkpoint(out, tmp_path / "ckpt")
    messages = json_messages(out)
    assert len([msg for msg in messages if msg.startswith("stop requested")]) == 1, messages
    assert not [msg for msg in messages if msg.startswith("second stop signal")], messages
