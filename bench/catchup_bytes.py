"""Bytes of one catch-up (a joiner's state download) per sync method, on loopback.

    python bench/catchup_bytes.py [--methods diloco,desloc,mtdao] [--json-out FILE] [-- extra join flags]

For each method: one real `lowcomm-node join` process trains alone until it committed an outer
step, then a second one joins it and downloads the swarm's state; the joiner's
`state_downloaded` event says how many bytes it fetched. diloco serves θ_global and the outer
momentum (8 bytes per parameter); desloc and mtdao, which sync the inner optimizer's state, also
serve that state (AdamW: 2 moments, MT-DAO: 3, 4 bytes each) and the joiner loads it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from common import Proc, handle_signals, processes, record_base, say, write_result

from lowcomm.node.localswarm import node_command, peer_args

SETTINGS = ["--set", "train.inner_steps=10", "--set", "train.batch_size=8", "--set", "node.heartbeat_interval=1"]


def catch_up(method: str, extra: list[str], workdir: Path) -> dict:
    flags = [*SETTINGS, "--set", f"sync.method={method}", *extra]
    with processes() as procs:
        first = Proc("peer-0", [*node_command(), "join", *peer_args(workdir, 0, extra=flags)])
        procs.append(first)
        committed = first.wait_event("round_done", 180)  # alone: its own outer step
        joiner = Proc("peer-1", [*node_command(), "join", *peer_args(workdir, 1, [first.multiaddr], flags)])
        procs.append(joiner)
        got = joiner.wait_event("state_downloaded", 180)
    return {"method": method, "numel": committed["numel"], "outer_step": got["outer_step"],
            "bytes_downloaded": got["bytes_downloaded"],
            "bytes_per_param": round(got["bytes_downloaded"] / committed["numel"], 3),
            "optimizer_states": sorted(got.get("state_sha256") or {})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="diloco,desloc,mtdao", help="comma-separated [sync] methods")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("extra", nargs="*", help="extra join flags for both peers (after --)")
    args = parser.parse_args(argv)
    handle_signals()
    for method in args.methods.split(","):
        with tempfile.TemporaryDirectory(prefix="catchup-") as tmp:
            say(f"{method}: a peer trains alone, a second one joins it")
            result = catch_up(method, args.extra, Path(tmp))
        write_result(record_base("catchup_bytes", **result), args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
