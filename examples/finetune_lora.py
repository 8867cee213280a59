"""Fine-tune LoRA adapters on a frozen base model in your own loop; peers average the adapters only.

    python examples/finetune_lora.py                      # the first peer: prints its multiaddr
    python examples/finetune_lora.py --peers MULTIADDR --checkpoint-dir runs/lora/peer-1

Parameters with requires_grad=False (the base) are neither sent nor held as θ_global: a round
carries the adapters' Δ alone. Every peer must hold the same base weights, since no state
download carries them; the run fingerprint covers a digest of them, so a peer with another base
is refused (its log names `[model] frozen_sha256`). Here the "pretrained" base is a tiny Llama
made from a fixed seed (offline: no hub); load your own checkpoint in its place. The data is
Python's own source code. Freeze before making the Swarm: the split is taken there.
examples/lora.py holds the adapters, and a factory that runs the same fine-tune through
`lowcomm-node join` on a model folder of your own.
"""

import argparse
import json
import zlib

import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM

import lowcomm
from lora import add_lora  # examples/lora.py, next to this script

parser = argparse.ArgumentParser()
parser.add_argument("--peers", nargs="*", default=[], help="multiaddrs of peers in the swarm")
parser.add_argument("--checkpoint-dir", default="runs/lora/peer-0")
parser.add_argument("--min-peers", type=int, default=1, help="wait for this many peers before training")
parser.add_argument("--steps", type=int, default=200, help="train until this many inner steps in all")
parser.add_argument("--rank", type=int, default=4, help="rank of the LoRA adapters")
args = parser.parse_args()

torch.manual_seed(0)  # stands in for loading pretrained weights: the same base on every peer
model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=128))
# The base is frozen and the attention's query and value projections get adapters (examples/lora.py).
adapters = add_lora(model, args.rank, targets=("q_proj", "v_proj"), alpha=8.0)
optimizer = torch.optim.AdamW(adapters, lr=3e-3)
data = torch.tensor(list(open(argparse.__file__, "rb").read()))  # bytes of a stdlib module as tokens
data, held_out = data[:-65 * 16], data[-65 * 16:].view(16, 65)  # the tail: a fixed held-out set

config = {"train": {"inner_steps": 10}, "sync": {"codec": "int8"},
          "node": {"host": "127.0.0.1", "checkpoint_dir": args.checkpoint_dir}}


def held_out_loss(replica: nn.Module) -> float:  # run on a copy of the model for every new θ_global
    return replica(input_ids=held_out, labels=held_out).loss.item()


with lowcomm.Swarm(model, optimizer, config=config, peers=args.peers, eval_fn=held_out_loss) as swarm:
    print(json.dumps({"event": "example_ready", "multiaddrs": swarm.multiaddrs,
                      "trainable": sum(p.numel() for p in adapters),
                      "frozen": sum(p.numel() for p in model.parameters() if not p.requires_grad)}), flush=True)
    if swarm.inner_steps < args.steps:  # a run resumed after its last step has nothing to wait for
        swarm.wait_for_peers(args.min_peers)
    # Each peer its own batches; a resumed run goes on with new ones (seeded by where it resumed).
    sampler = torch.Generator().manual_seed(zlib.crc32(f"{swarm.peer_id}:{swarm.inner_steps}".encode()))
    while swarm.inner_steps < args.steps:
        starts = torch.randint(len(data) - 65, (8,), generator=sampler)
        batch = torch.stack([data[s:s + 65] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        swarm.step(tokens=batch.numel(), loss=loss)  # every 10 steps: a round of the adapters' Δ
print(json.dumps({"event": "example_done", "outer_step": swarm.outer_step}), flush=True)
