"""What a volunteer sees on a terminal: `lowcomm-node join` under a real pseudo-terminal.

The node's output (stdout and stderr, as in a shell) goes to a pty; every byte read from it is
fed to a terminal emulator (pyte), and the screen is checked after every read, not only at the
end: lines the cursor has left are log lines starting at column 0 with no piece of the inner-phase
progress bar in them, and a bar is only ever on the cursor's line (so at most one is visible).
At the end every round's summary line is on the screen, whole. A fast test checks the log
handler and the bar in-process (no CLI) the same way.
"""

from __future__ import annotations

import fcntl
import io
import logging
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from lowcomm.node.localswarm import node_command, peer_args
from lowcomm.node.logs import HumanFormatter, TerminalHandler
from lowcomm.node.progress import InnerProgress

from .conftest import FAST

pyte = pytest.importorskip("pyte", reason="pyte (terminal emulator, dev extra) is not installed: pip install -e '.[dev]'")

# Wide enough that no line of the node wraps (the ready line with its join command is ~220).
COLUMNS, ROWS = 300, 60
ROUNDS = 3
STEPS = 30
STAMP = re.compile(r"^\d\d:\d\d:\d\d ")
BAR = re.compile(r"round \d+ inner steps")
BAR_PIECES = re.compile(r"inner steps|step/s|\b\d+/%d\b" % STEPS)
# A round's summary, whole: from its time at column 0 to the hash prefix that ends it.
ROUND_LINE = re.compile(r"^\d\d:\d\d:\d\d step (\d+) \| loss \d+\.\d{3} \| eval .* \| [0-9a-f]{12}$")


def test_log_lines_go_above_the_live_bar(monkeypatch):
    """The handler of human logs and the bar on one terminal, in one process: every line lands
    whole above the bar, which stays on the last line."""
    terminal = io.StringIO()
    monkeypatch.setattr(terminal, "isatty", lambda: True)  # it stands in for one
    monkeypatch.setattr(sys, "stderr", terminal)  # where InnerProgress draws
    handler = TerminalHandler(terminal)
    handler.setFormatter(HumanFormatter())
    logger = logging.getLogger("lowcomm.test_terminal")
    logger.addHandler(handler)
    monkeypatch.setattr(logger, "propagate", False)
    bar = InnerProgress(STEPS, 7, enabled=True)
    try:
        for done in range(1, 11):
            bar.update(done, 2.5)
            logger.warning("line %d", done)
    finally:
        logger.removeHandler(handler)
    screen = pyte.Screen(COLUMNS, ROWS)
    screen.set_mode(pyte.modes.LNM)  # a newline returns the carriage, as a tty's onlcr does
    pyte.Stream(screen).feed(terminal.getvalue())
    rows = [row.rstrip() for row in screen.display]
    assert [STAMP.sub("", row) for row in rows[:10]] == [f"warning: line {n}" for n in range(1, 11)], rows[:11]
    assert all(STAMP.match(row) for row in rows[:10]), rows[:11]
    assert re.match(r"round 7 inner steps: +33%.*10/30", rows[10]), rows[10]
    assert not any(rows[11:])
    bar.close()


def run_in_terminal(args: list[str], timeout_s: float) -> tuple[int, list[list[str]], list[str]]:
    """Run ``lowcomm-node join args`` with a pty as its terminal until it exits.

    Returns the exit code, the screen (rows, right-stripped) after every read, and the final one.
    """
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
    # A volunteer's shell: no LOWCOMM_* from the test environment (they would choose JSON logs).
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWCOMM_")}
    env.update(TERM="xterm", COLUMNS=str(COLUMNS), LINES=str(ROWS))
    proc = subprocess.Popen([*node_command(), "join", *args], stdin=slave, stdout=slave, stderr=slave, env=env,
                            start_new_session=True, close_fds=True)
    os.close(slave)
    screen = pyte.Screen(COLUMNS, ROWS)
    stream = pyte.ByteStream(screen)
    screens: list[tuple[list[str], int]] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer of the terminal has closed it
                break
            if not chunk:
                break
            stream.feed(chunk)
            screens.append(([row.rstrip() for row in screen.display], screen.cursor.y))
        else:
            pytest.fail(f"the node did not exit within {timeout_s:.0f} s; screen:\n" + "\n".join(screen.display))
        code = proc.wait(30)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its DHT process and p2pd die with it (node/dht.py)
        except ProcessLookupError:
            pass
        proc.wait(30)
        os.close(master)
    return code, screens, [row.rstrip() for row in screen.display]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_join_on_a_terminal_shows_one_live_bar_and_clean_round_lines(tmp_path: Path):
    args = peer_args(tmp_path, 0, [], [*FAST, "--set", f"train.inner_steps={STEPS}", "--max-rounds", str(ROUNDS)])
    code, screens, final = run_in_terminal(args, timeout_s=180)
    text = "\n".join(row for row in final if row)
    assert code == 0, text
    # The bar was drawn at all (a check that cannot pass by the bar being switched off).
    assert any(BAR.search(row) for rows, _ in screens for row in rows), "no progress bar was ever drawn"

    for rows, cursor in screens:
        shown = "\n".join(row for row in rows if row)
        for number, row in enumerate(rows):
            if number == cursor or not row:
                continue  # the cursor's line: the live bar, or a line being written
            assert STAMP.match(row), f"row {number} does not start with a log line's time:\n{shown}"
            assert not BAR_PIECES.search(row), f"row {number} holds part of a progress bar:\n{shown}"
        assert sum(bool(BAR.search(row)) for row in rows) <= 1, f"more than one progress bar:\n{shown}"

    round_steps = [int(m.group(1)) for row in final if (m := ROUND_LINE.match(row))]
    assert round_steps == list(range(1, ROUNDS + 1)), f"round lines of steps {round_steps}:\n{text}"
    assert not any(BAR.search(row) for row in final), f"a bar is left on the screen:\n{text}"
