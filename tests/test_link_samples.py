"""bench/link_samples.py's reading of link counters: per time bin, each peer's upload and
download as a fraction of the cap (the samples here are written by hand, no namespace needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_show_prints_each_links_use_of_the_cap_per_bin(tmp_path: Path) -> None:
    cap = 100e6 / 8  # bytes per second at 100 Mbit/s
    # Peer 0 uploads at the full cap, peer 1 at half of it; peer 1 downloads what peer 0 sends.
    samples = [[t, ["lct-h0", int(cap * t), int(cap * t / 2)], ["lct-h1", int(cap * t / 2), int(cap * t)]]
               for t in (0.0, 0.25, 0.5, 0.75)]
    path = tmp_path / "links.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    out = subprocess.run([sys.executable, str(REPO / "bench" / "link_samples.py"), "show", str(path), "--mbit", "100"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    rows = [line.split() for line in out[1:-1]]
    assert len(rows) == 3
    assert all([float(x) for x in row[1:]] == [1.0, 0.5, 0.5, 1.0] for row in rows), out
    assert out[-1].startswith("mean upload 0.75 of the cap, download 0.75, over 3 bins")


def test_show_says_when_there_is_nothing_to_read(tmp_path: Path) -> None:
    path = tmp_path / "links.jsonl"
    path.write_text(json.dumps([0.0, ["lct-h0", 0, 0]]) + "\n")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "link_samples.py"), "show", str(path), "--mbit", "20"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "fewer than two samples" in proc.stderr and "Traceback" not in proc.stderr
