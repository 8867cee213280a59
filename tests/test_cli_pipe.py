"""A reader that stops early (`lowcomm-node status | head -2`) ends the command quietly."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_output_to_a_full_disk_is_one_error_line_saying_the_file_is_incomplete() -> None:
    # `lowcomm-node init-config > run.toml` on a full disk: an OSError traceback (ENOSPC).
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "lowcomm.node.cli", "init-config"], stdout=full,
                                stderr=subprocess.PIPE, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert result.stderr == ("lowcomm-node: error: could not write the config to standard output: No space left on "
                             "device; the file it went to is incomplete: free space there, or write it elsewhere\n")


_INTERRUPTED_IMPORT = """
import sys

class CtrlCDuringTheImport:  # SIGINT while Python imports the CLI (torch, hivemind)
    def find_spec(self, name, path=None, target=None):
        if name == "lowcomm.node.cli":
            raise KeyboardInterrupt

sys.meta_path.insert(0, CtrlCDuringTheImport())
from lowcomm.node.entry import main
sys.exit(main(["status"]))
"""


def test_a_ctrl_c_while_the_cli_imports_ends_quietly_with_130() -> None:
    # The console script pointed at lowcomm.node.cli:main, so the interrupt came out of the
    # script's own import of it: a KeyboardInterrupt traceback.
    result = subprocess.run([sys.executable, "-c", _INTERRUPTED_IMPORT], capture_output=True, text=True, timeout=60,
                            stdin=subprocess.DEVNULL)
    assert (result.returncode, result.stderr) == (130, "")
