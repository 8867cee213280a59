#!/usr/bin/env python
"""Baseline `hivemind`: hivemind.Optimizer with local updates and 8-bit state averaging.

    python bench/baselines/hivemind_opt.py --index I --host H [--initial-peer MADDR]
                                           --params-dir DIR [--sync-every 50] [workload flags]

The system a user would otherwise pick, on the node's model, data and AdamW: every peer builds
the node's ``Trainer`` (data-shard key ``--peer-key``: the harness passes the peer id of DiLoCo
peer <index>, so both draw the same batches) and wraps its AdamW in
``hivemind.Optimizer(use_local_updates=True)``: each local step updates the local weights, and
every time the swarm has processed ``target_batch_size = peers × batch × sync_every`` samples
(one hivemind epoch) the peers average their parameters in the background with
``Uniform8BitQuantization``, the 8-bit compression hivemind ships without bitsandbytes. This is
DiLoCo with outer learning rate 1 and no outer momentum, run asynchronously.

Protocol with the harness (JSON lines on stdout, lines on stdin):

    {"event": "dht_ready", "maddrs": [...]}      the DHT is up (peer 0's is the others' --initial-peer)
    {"event": "ready"}                           optimizer built; the peer waits for "go" on stdin
    {"event": "params", "step", "epoch", "path", "wall", "compute_seconds", "sync_seconds"}
                                                 every --eval-every steps: flat float32 weights saved to path
    {"event": "done", "steps", "wall", "compute_seconds", "sync_seconds", "epoch"}

"stop" on stdin ends training after the current step; after its last step a peer stays in the
swarm until "exit" (all peers done) and keeps joining averaging rounds with empty steps
(``opt.step(batch_size=0)``: no data, no gradient), so that a peer still training finds partners.

The peers do not evaluate: the harness averages the peers' weights saved at the same step (the
swarm's model) and evaluates that, so no peer spends time on evaluation. Wall-clock starts at
"go".

hivemind 1.1.12's 8-bit codec does not decode under NumPy 2 (see ``patch_8bit_for_numpy2``);
the script patches that one function when it is broken and says so in its "ready" line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import workload_args, workload_from  # noqa: E402


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def patch_8bit_for_numpy2() -> bool:
    """Make hivemind 1.1.12's 8-bit codecs decode under NumPy 2; True if the patch was needed.

    ``Quantization.extract`` reads the codebook size with ``int(np.frombuffer(buf, count=1))``,
    which NumPy 2 refuses (TypeError: only 0-dimensional arrays can be converted to Python
    scalars). Unpatched, every 8-bit part a peer receives fails to decode inside the averager
    ("Reducer: received 25.0% of input tensors"), rounds still log "Averaged parameters with 4
    peers", and each peer silently keeps most of its own weights. The replacement is the same
    function with ``[0]``.
    """
    import numpy as np
    import torch
    from hivemind.compression import quantization
    from hivemind.compression.base import CompressionInfo

    codec = quantization.Uniform8BitQuantization()
    probe = torch.linspace(-1, 1, 64)
    try:
        codec.extract(codec.compress(probe, CompressionInfo.from_tensor(probe)))
        return False
    except TypeError:
        pass

    def extract(self, serialized_tensor):
        codebook_size = int(np.frombuffer(serialized_tensor.buffer, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(serialized_tensor.buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
        quantized = np.frombuffer(serialized_tensor.buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        quantized = torch.as_tensor(quantized, dtype=torch.int64).reshape(tuple(serialized_tensor.size))
        codebook = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized_tensor.dtype))
        return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)

    quantization.Quantization.extract = extract
    codec.extract(codec.compress(probe, CompressionInfo.from_tensor(probe)))  # now it decodes
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--initial-peer", action="append", default=[])
    parser.add_argument("--peer-key", help="data-shard key (default hivemind-<index>)")
    parser.add_argument("--params-dir", type=Path, required=True)
    parser.add_argument("--sync-every", type=int, default=50,
                        help="local steps per peer between two averaging rounds (sets target_batch_size)")
    parser.add_argument("--matchmaking-time", type=float, default=3.0)
    parser.add_argument("--averaging-timeout", type=float, default=60.0)
    parser.add_argument("--exit-wait", type=float, default=300.0,
                        help="seconds to wait for 'exit' on stdin after the last step before leaving")
    parser.add_argument("--compression", choices=["int8", "fp16", "none"], default="int8")
    workload_args(parser)
    args = parser.parse_args(argv)
    work = workload_from(args)

    # The DHT forks a process: create it before torch spins up threads (as the node does).
    import hivemind

    from lowcomm.node.dht import place_p2pd_sockets

    place_p2pd_sockets(tempfile.gettempdir())  # p2pd's sockets in TMPDIR, as a node's (node/dht.py)
    dht = hivemind.DHT(initial_peers=args.initial_peer, host_maddrs=[f"/ip4/{args.host}/tcp/0"], start=True)
    emit(event="dht_ready", maddrs=[str(m) for m in dht.get_visible_maddrs()])

    import torch
    from torch.nn.utils import parameters_to_vector

    from lowcomm.node.trainer import Trainer

    torch.set_num_threads(1)
    patched = patch_8bit_for_numpy2()  # before the averager process forks: it inherits the patch
    config = work.config()
    trainer = Trainer(config, args.peer_key or f"hivemind-{args.index}")
    compression = {"int8": hivemind.compression.Uniform8BitQuantization(),
                   "fp16": hivemind.compression.Float16Compression(),
                   "none": hivemind.compression.NoCompression()}[args.compression]
    opt = hivemind.Optimizer(
        dht=dht, run_id="lowcomm-bench", target_batch_size=work.peers * work.batch_size * args.sync_every,
        batch_size_per_step=work.batch_size,
        optimizer=lambda params: torch.optim.AdamW(params, lr=config.train.lr, betas=(0.9, 0.95),
                                                   weight_decay=config.train.weight_decay),
        params=trainer.model.parameters(), use_local_updates=True, matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout, state_averaging_compression=compression,
        load_state_compression=compression,
        verbose=True,  # status lines ("Averaged parameters with N peers") that the harness counts
    )
    inner = opt.state_averager.optimizer  # the AdamW whose learning rate the warm-up sets
    args.params_dir.mkdir(parents=True, exist_ok=True)
    emit(event="ready", numel=trainer.numel, patched_8bit_for_numpy2=patched)

    go, stop, leave = threading.Event(), threading.Event(), threading.Event()

    def read_stdin() -> None:
        for line in sys.stdin:
            {"go": go, "stop": stop, "exit": leave}.get(line.strip(), threading.Event()).set()
        stop.set()  # the harness went away
        go.set()
        leave.set()

    threading.Thread(target=read_stdin, daemon=True).start()
    go.wait()

    compute = sync = 0.0
    started = time.perf_counter()
    step = 0
    try:
        for step in range(1, work.steps + 1):
            t0 = time.perf_counter()
            inputs, targets = trainer.sampler.next_batch()
            for group in inner.param_groups:
                group["lr"] = trainer._lr()  # the node's warm-up, by local steps
            _, loss = trainer.model(inputs, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainer.params, config.train.grad_clip)
            t1 = time.perf_counter()
            epoch = opt.local_epoch
            opt.step()
            opt.zero_grad(set_to_none=True)
            trainer.inner_steps_done += 1
            t2 = time.perf_counter()
            compute += t1 - t0
            # A step in which the epoch moved (averaging, or loading state) counts as synchronisation.
            if opt.local_epoch == epoch:
                compute += t2 - t1
            else:
                sync += t2 - t1
            if step % work.eval_every == 0 or step == work.steps or stop.is_set():
                path = args.params_dir / f"peer{args.index}-step{step}.pt"
                torch.save(parameters_to_vector(trainer.params).detach().clone(), path)
                emit(event="params", step=step, epoch=opt.local_epoch, path=str(path),
                     wall=time.perf_counter() - started, compute_seconds=compute, sync_seconds=sync,
                     train_loss=loss.item())
            if stop.is_set():
                break
        emit(event="done", steps=step, wall=time.perf_counter() - started, compute_seconds=compute,
             sync_seconds=sync, epoch=opt.local_epoch)
        # Stay in the swarm until every peer is done, and keep taking part in its averaging rounds:
        # steps with batch_size=0 process no data and change nothing locally, but follow the
        # swarm's epochs, as a peer of an open-ended run would. Without them a peer still training
        # waits hivemind's averaging timeout at every epoch for partners that stopped stepping.
        deadline = time.monotonic() + args.exit_wait
        while not leave.wait(0.5) and time.monotonic() < deadline:
            opt.step(batch_size=0)
    finally:
        opt.shutdown()
        dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
