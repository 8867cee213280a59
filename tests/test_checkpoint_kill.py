"""A checkpoint write interrupted by SIGKILL leaves the previous checkpoint usable."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import torch

from lowcomm.node import checkpoint

WRITER = r"""
import sys, torch
from pathlib import Path
from lowcomm.node import checkpoint
directory = Path(sys.argv[1])
big = torch.randn(64 * 2**20 // 4)  # 64 MiB: the write takes long enough to be interrupted
print("writing", flush=True)
checkpoint.save(directory, 2, {"step": 2, "params": big})
print("done", flush=True)
"""


def test_sigkill_during_a_checkpoint_write_keeps_the_previous_one(tmp_path):
    checkpoint.save(tmp_path, 1, {"step": 1, "params": torch.arange(10.0)})
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "writing"
        # Kill it while the temporary file is being written (it appears before the rename).
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".step-*.tmp")) and writer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)  # polling a file that appears within milliseconds; bounded by the deadline
        writer.send_signal(signal.SIGKILL)
        interrupted = writer.wait(30) == -signal.SIGKILL
    finally:
        writer.wait(30)
    assert interrupted
    payload, path = checkpoint.load_latest(tmp_path)
    if path.name == "step-000000002.ckpt":  # killed just after the rename: the new file is complete
        assert payload["params"].numel() == 64 * 2**20 // 4
    else:
        assert path.name == "step-000000001.ckpt"
        assert torch.equal(payload["params"], torch.arange(10.0))
        assert list(tmp_path.glob(".step-*.tmp")), "the kill should have landed during the write"
