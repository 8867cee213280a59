#!/usr/bin/env python
"""Baselines `single` and `ddp`: the node's model, data and AdamW, synchronised every step.

    python bench/baselines/ddp.py --rank R --world-size W --master-addr A --master-port P
                                  [--ifname lo] [workload flags] [--eval-batch-size B]

One process per rank, one torch thread each. Every rank builds the node's own ``Trainer``
(same preset, seed, initial weights, ShardSampler, AdamW with the node's betas, weight decay,
warm-up and clipping) under ``--peer-key`` (the harness passes the peer id of the node that
plays rank r in the DiLoCo runs, so both draw the same batches). A step: forward
and backward on the rank's batch, one flat ``all_reduce`` of all gradients over gloo (what
DistributedDataParallel does with a single bucket, without overlapping it with the backward
pass), division by W, clipping, AdamW. ``--world-size 1`` is the `single` baseline: no process
group, the global batch in one process (the caller passes ``--batch-size peers×batch``).

Rank 0 evaluates the model on the node's fixed held-out batches (``--eval-batch-size``, the
node's train.batch_size) every ``--eval-every`` steps and at the end; all ranks wait for it at a
barrier and leave that time out of their wall-clock. JSON lines on stdout:

    {"event": "ready"}                                          after the process group formed
    {"event": "eval", "step", "tokens", "eval_loss", "wall", "compute_seconds", "comm_seconds",
     "app_bytes_sent"}                                          rank 0 only
    {"event": "done", "rank", "steps", "wall", "compute_seconds", "comm_seconds", "eval_seconds",
     "app_bytes_sent", "step_seconds"}

``app_bytes_sent`` is what a ring all-reduce sends per rank, 2·(W−1)/W·4·numel per step
(gloo's algorithm for one large CPU tensor); the harness measures the wire separately.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import workload_args, workload_from  # noqa: E402
from lowcomm.node.data import eval_batches, load_corpus  # noqa: E402
from lowcomm.node.trainer import Trainer  # noqa: E402


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--peer-key", help="data-shard key (default: single / ddp-<rank>); the harness passes "
                        "the peer id of bench identity <rank>, so that rank r draws the batches of DiLoCo peer r")
    parser.add_argument("--eval-batch-size", type=int, default=None,
                        help="batch size of the held-out batches (the node's train.batch_size; default --batch-size)")
    workload_args(parser)
    args = parser.parse_args(argv)
    work = workload_from(args)
    rank, world = args.rank, args.world_size
    torch.set_num_threads(1)

    config = work.config(batch_size=args.batch_size)
    corpus = load_corpus(config.data.path, config.data.eval_fraction)
    trainer = Trainer(config, args.peer_key or ("single" if world == 1 else f"ddp-{rank}"), corpus)
    # The node's held-out set: its batch size is the node's, whatever this process trains with.
    trainer.eval_set = eval_batches(corpus.eval, config.data.seq_len, args.eval_batch_size or args.batch_size,
                                    config.data.eval_batches)
    model, params, optimizer = trainer.model, trainer.params, trainer.optimizer
    numel = trainer.numel
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://{args.master_addr}:{args.master_port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=300))
        dist.barrier()
    emit(event="ready", rank=rank, numel=numel)

    tokens_per_step = args.batch_size * world * config.data.seq_len
    ring_bytes = 2 * (world - 1) / world * 4 * numel if world > 1 else 0.0
    compute = comm = eval_seconds = 0.0
    step_times: list[float] = []
    started = time.perf_counter()
    final_loss = None
    for step in range(1, work.steps + 1):
        t0 = time.perf_counter()
        inputs, targets = trainer.sampler.next_batch()
        for group in optimizer.param_groups:
            group["lr"] = trainer._lr()  # the node's warm-up schedule, by inner steps done
        _, loss = model(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        t1 = time.perf_counter()
        if world > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            flat.div_(world)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, config.train.grad_clip)
        optimizer.step()
        trainer.inner_steps_done += 1
        t3 = time.perf_counter()
        compute += (t1 - t0) + (t3 - t2)
        comm += t2 - t1
        step_times.append(t3 - t0)
        if step % work.eval_every == 0 or step == work.steps:
            e0 = time.perf_counter()
            if rank == 0:
                final_loss = trainer.evaluate()
                emit(event="eval", step=step, tokens=step * tokens_per_step, eval_loss=final_loss,
                     wall=e0 - started - eval_seconds, compute_seconds=compute, comm_seconds=comm,
                     app_bytes_sent=ring_bytes * step, train_loss=loss.item())
            if world > 1:
                dist.barrier()
            eval_seconds += time.perf_counter() - e0
    wall = time.perf_counter() - started - eval_seconds
    emit(event="done", rank=rank, steps=work.steps, wall=wall, compute_seconds=compute, comm_seconds=comm,
         eval_seconds=eval_seconds, app_bytes_sent=ring_bytes * work.steps, final_eval_loss=final_loss,
         step_seconds=step_times)
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
