"""Train a tiny Hugging Face Llama in your own loop, averaged with other peers by lowcomm.

    python examples/train_hf.py                      # the first peer: prints its multiaddr
    python examples/train_hf.py --peers MULTIADDR --checkpoint-dir runs/example/peer-1
    python examples/launch.py --nproc 2              # or: N peers on this machine at once

Offline: the model comes from a config dict (no hub), the data is Python's own source code.
Run it again with the same --checkpoint-dir to resume where it stopped.
"""

import argparse
import json
import zlib

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import lowcomm

parser = argparse.ArgumentParser()
parser.add_argument("--peers", nargs="*", default=[], help="multiaddrs of peers in the swarm")
parser.add_argument("--checkpoint-dir", default="runs/example/peer-0")
parser.add_argument("--min-peers", type=int, default=1, help="wait for this many peers before training")
parser.add_argument("--steps", type=int, default=200, help="train until this many inner steps in all")
args = parser.parse_args()

torch.manual_seed(0)  # the same initial weights on every peer (a joiner downloads the swarm's anyway)
model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=128))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
data = torch.tensor(list(open(argparse.__file__, "rb").read()))  # bytes of a stdlib module as tokens
data, held_out = data[:-65 * 16], data[-65 * 16:].view(16, 65)  # the tail: a fixed held-out set

config = {"train": {"inner_steps": 10}, "sync": {"codec": "int8"},
          "node": {"host": "127.0.0.1", "checkpoint_dir": args.checkpoint_dir}}

def held_out_loss(replica: torch.nn.Module) -> float:  # run on a copy of the model for every new θ_global
    return replica(input_ids=held_out, labels=held_out).loss.item()


with lowcomm.Swarm(model, optimizer, config=config, peers=args.peers, eval_fn=held_out_loss) as swarm:
    print(json.dumps({"event": "example_ready", "multiaddrs": swarm.multiaddrs}), flush=True)
    if swarm.inner_steps < args.steps:  # a run resumed after its last step has nothing to wait for
        swarm.wait_for_peers(args.min_peers)
    # Each peer its own batches; a resumed run goes on with new ones (seeded by where it resumed).
    sampler = torch.Generator().manual_seed(zlib.crc32(f"{swarm.peer_id}:{swarm.inner_steps}".encode()))
    while swarm.inner_steps < args.steps:
        starts = torch.randint(len(data) - 65, (8,), generator=sampler)
        batch = torch.stack([data[s:s + 65] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss  # transformers shifts the labels itself
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        swarm.step(tokens=batch.numel(), loss=loss)  # every 10 steps: a round with the other peers
print(json.dumps({"event": "example_done", "outer_step": swarm.outer_step}), flush=True)
