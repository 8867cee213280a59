#!/usr/bin/env python
"""Where the memory of one node goes: its start-up stages in one process, then a real node's processes.

    nice -n 10 python bench/node_memory.py [--rounds 30] [--inner-steps 5] [--env KEY=VALUE ...]
                                           [--label TEXT] [--json-out bench/out/node_memory.jsonl]

1. **Stages** (a fresh interpreter, ``--stages``): what the node's main process builds, in the
   order the node builds it (imports, corpus, trainer in a thread of its own, replica, first
   eval, θ_global, inner steps, evals on the replica in another thread), with the RSS after each
   (``/proc/self/status``). ``tiny`` preset, the node's default batch (16 × 128), one torch thread.
2. **Node**: one ``lowcomm-node join`` alone (same settings, H = ``--inner-steps``) until it has
   committed ``--rounds`` rounds; then RSS, PSS and USS of each of its processes (main, the DHT
   process, p2pd, torch_shm_manager; bench/soak.py's reader) and the main process's resident
   memory by mapping (/proc/PID/smaps: anonymous, the brk heap, libtorch, other libraries).

One JSON line of both (``bench: node_memory``); bench/analysis.md ("Memory of a node") reads them.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import OUT, PY, Proc, append_jsonl, node_command, record_base, say
from soak import memory


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def stages() -> None:
    """Print one JSON line per stage of a node's main process (run in a fresh interpreter)."""
    import threading

    def mark(stage: str) -> None:
        print(json.dumps({"stage": stage, "rss_mb": round(rss_mb(), 1)}), flush=True)

    def in_thread(fn):
        out: list = []
        thread = threading.Thread(target=lambda: out.append(fn()))
        thread.start()
        thread.join()
        return out[0]

    mark("interpreter")
    import torch
    mark("import torch")
    import hivemind  # noqa: F401
    mark("import hivemind")
    from lowcomm.node import cli, daemon  # noqa: F401
    mark("import lowcomm.node (grpc, uvloop, pydantic, ...)")
    torch.set_num_threads(1)
    from lowcomm.node.config import load_config
    from lowcomm.node.evaluator import Evaluator
    from lowcomm.node.globalstate import GlobalState
    from lowcomm.node.trainer import Trainer

    config = load_config(overrides=["model.preset=tiny"], environ={})
    trainer = in_thread(lambda: Trainer(config, "peer-x"))
    mark("Trainer (corpus, sampler, model, AdamW: torch imports torch._dynamo and sympy here)")
    evaluator = in_thread(lambda: Evaluator(trainer))
    mark("Evaluator replica")
    in_thread(trainer.evaluate)
    mark("first eval")
    state = GlobalState.fresh(trainer.get_params(), 0.7, 0.9)
    mark("GlobalState (θ_global, momentum, residuals)")
    in_thread(lambda: [trainer.train_phase(5, lambda: False) for _ in range(4)])
    mark("20 inner steps")
    in_thread(lambda: [evaluator.evaluate(state.params) for _ in range(3)])
    mark("3 evals on the replica (another thread)")


def by_mapping(pid: int) -> dict[str, float]:
    """Resident MB of ``pid`` by kind of mapping."""
    groups: collections.Counter[str] = collections.Counter()
    current = "?"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            path = parts[5] if len(parts) > 5 else ""
            if not path:
                current = "anonymous"
            elif path == "[heap]":
                current = "heap (brk)"
            elif "/torch/" in path:
                current = "libtorch and torch extensions"
            elif path.startswith("/"):
                current = "other files (libraries, python)"
            else:
                current = path
        elif parts[0] == "Rss:":
            groups[current] += int(parts[1]) / 1024
    return {key: round(value, 1) for key, value in groups.most_common() if value >= 0.1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--inner-steps", type=int, default=5)
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--time-limit", type=float, default=900)
    parser.add_argument("--label", default="", help="what code was measured (e.g. a commit), kept in the record")
    parser.add_argument("--json-out", type=Path, default=OUT / "node_memory.jsonl")
    parser.add_argument("--stages", action="store_true", help=argparse.SUPPRESS)  # the child of part 1
    args = parser.parse_args(argv)
    if args.stages:
        stages()
        return 0
    env = dict(item.split("=", 1) for item in args.env)
    say("node_memory: stages of the main process")
    out = subprocess.run([PY, __file__, "--stages"], capture_output=True, text=True, check=True,
                         env={**os.environ, **env}).stdout
    staged = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    previous = 0.0
    for stage in staged:
        stage["delta_mb"] = round(stage["rss_mb"] - previous, 1)
        previous = stage["rss_mb"]
        say(f"  {stage['stage']}: {stage['rss_mb']:.0f} MB ({stage['delta_mb']:+.0f})")
    workdir = Path(tempfile.mkdtemp(prefix="lowcomm-bench-memory-"))
    try:
        argv_node = [*node_command(), "join", "--host", "127.0.0.1", "--dht-port", "0", "--grpc-port", "0",
                     "--metrics-port", "0", "--checkpoint-dir", str(workdir), "--torch-threads", "1",
                     "--log-format", "json", "--set", "model.preset=tiny",
                     "--set", f"train.inner_steps={args.inner_steps}"]
        node = Proc("node", argv_node, env=env)
        try:
            node.wait_for(lambda e: e.get("event") == "round_done" and e["outer_step"] >= args.rounds, args.time_limit)
            processes, mappings = memory(node.proc.pid), by_mapping(node.proc.pid)
        finally:
            node.stop(30)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for name, m in processes.items():
        say(f"  {name}: RSS {m['rss_mb']:.0f} MB, PSS {m['pss_mb']:.0f}, USS {m['uss_mb']:.0f}, {m['threads']} threads")
    append_jsonl(args.json_out, record_base("node_memory", run_id=time.strftime("%Y%m%dT%H%M%S"), env=env, label=args.label,
                                            rounds=args.rounds, inner_steps=args.inner_steps, stages=staged,
                                            processes=processes, main_by_mapping=mappings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
