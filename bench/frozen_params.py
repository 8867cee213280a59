"""What a frozen base costs a lowcomm.Swarm run: bytes per round, and the fingerprint's hash.

    python bench/frozen_params.py [--steps 40] [--hash-gb 1] [--json-out FILE]

*rounds*: examples/finetune_lora.py as two peers on loopback (a tiny Llama, frozen, with rank-4
LoRA adapters; a round every 10 inner steps, int8), twice:

* ``frozen``: the example as it is: the Swarm averages the adapters alone
  (node/averaged_params.py);
* ``averaged``: the same script with the base left trainable by requires_grad (the optimizer
  still steps the adapters only), so the Swarm averages every parameter, the base's zero Δ
  included: what every frozen model cost before the split, byte for byte.

Each record gives the averaged parameter count and the median bytes a peer sent and received per
round of both peers (``round_done``), and whether the two peers' params hashes agreed at every
step.

*hash*: seconds of ``frozen_definition`` (the SHA-256 of the frozen parameters a Swarm makes
once, as it is made) over a base of ``--hash-gb`` GB, in float32 and in bf16, on one core.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import Proc, handle_signals, processes, record_base, say, write_result

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "finetune_lora.py"
WAIT = 180  # seconds: start-up and 4 rounds of two peers on a loaded 2-core machine
# The ``averaged`` variant's one change to the example: the base trains by requires_grad again
# after the optimizer was built over the adapters.
OPTIMIZER_LINE = "optimizer = torch.optim.AdamW(adapters, lr=3e-3)\n"
UNFREEZE = "model.requires_grad_(True)  # bench/frozen_params.py: the Swarm averages the base too\n"


def script_for(variant: str, workdir: Path) -> Path:
    if variant == "frozen":
        return EXAMPLE
    source = EXAMPLE.read_text()
    if source.count(OPTIMIZER_LINE) != 1:
        raise SystemExit(f"{EXAMPLE} no longer has the line {OPTIMIZER_LINE.strip()!r}: update bench/frozen_params.py")
    script = workdir / "finetune_lora_averaged.py"
    script.write_text(source.replace(OPTIMIZER_LINE, OPTIMIZER_LINE + UNFREEZE))
    return script


def rounds(variant: str, steps: int, workdir: Path) -> dict:
    script = script_for(variant, workdir)

    def peer(index: int, *args: str) -> Proc:
        argv = [sys.executable, str(script), "--checkpoint-dir", str(workdir / f"peer-{index}"),
                "--min-peers", "2", "--steps", str(steps), *args]
        # PYTHONPATH: the copy of the ``averaged`` variant imports examples/lora.py as the example does.
        return Proc(f"peer-{index}", argv, env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(EXAMPLE.parent)})

    with processes() as procs:
        first = peer(0)
        procs.append(first)
        ready = first.wait_event("example_ready", WAIT)
        second = peer(1, "--peers", ready["multiaddrs"][0])
        procs.append(second)
        if first.wait_exit(WAIT) != 0 or second.wait_exit(WAIT) != 0:
            raise SystemExit(f"{variant}: a peer failed; its output: {first.raw_lines[-5:]} {second.raw_lines[-5:]}")
    paired = [(a, b) for a in first.rounds() for b in second.rounds()
              if a["outer_step"] == b["outer_step"] and a["group_size"] == b["group_size"] == 2]
    if not paired:
        raise SystemExit(f"{variant}: the two peers never averaged together")
    both = [e for pair in paired for e in pair]
    return {"variant": variant, "trainable": ready["trainable"], "frozen": ready["frozen"],
            "averaged_numel": both[0]["numel"], "rounds": len(paired), "codec": both[0]["codec"],
            "payload_bytes": both[0]["payload_bytes"],
            "bytes_sent_median": statistics.median(e["bytes_sent"] for e in both),
            "bytes_received_median": statistics.median(e["bytes_received"] for e in both),
            "hashes_agree": all(a["params_sha256"] == b["params_sha256"] for a, b in paired)}


def hash_seconds(gigabytes: float, dtype: torch.dtype) -> dict:
    from lowcomm.node.averaged_params import frozen_definition

    torch.set_num_threads(1)
    element = torch.empty((), dtype=dtype).element_size()
    count = int(gigabytes * 1e9) // element
    tensors = [(f"base.{i}", torch.ones(count // 8, dtype=dtype)) for i in range(8)]
    started = time.perf_counter()
    frozen_definition(tensors)
    seconds = time.perf_counter() - started
    return {"variant": "hash", "dtype": str(dtype).removeprefix("torch."), "gigabytes": gigabytes,
            "seconds": round(seconds, 3), "seconds_per_gb": round(seconds / gigabytes, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="inner steps per peer (a round every 10)")
    parser.add_argument("--hash-gb", type=float, default=1.0, help="size of the base whose hash is timed")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    handle_signals()
    for variant in ("frozen", "averaged"):
        with tempfile.TemporaryDirectory(prefix="frozen-params-") as tmp:
            say(f"{variant}: examples/finetune_lora.py as two peers")
            write_result(record_base("frozen_params", **rounds(variant, args.steps, Path(tmp))), args.json_out)
    for dtype in (torch.float32, torch.bfloat16):
        say(f"hash of a {args.hash_gb:g} GB {dtype} base")
        write_result(record_base("frozen_params", **hash_seconds(args.hash_gb, dtype)), args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
