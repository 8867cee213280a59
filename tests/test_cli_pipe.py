"""A reader that stops early (`lowcomm-node status | head -2`) ends the command quietly."""

from __future__ import annotations

import os
import subprocess
import sys

from lowcomm.node.cli import EXIT_BROKEN_PIPE


def test_output_to_a_closed_pipe_ends_quietly_with_the_shells_sigpipe_code() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written: every write fails
    try:
        result = subprocess.run([sys.executable, "-m", "lowcomm.node.cli", "init-config"], stdout=write_end,
                                stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert result.returncode == EXIT_BROKEN_PIPE, result.stderr
    assert result.stderr == ""  # was a BrokenPipeError traceback
