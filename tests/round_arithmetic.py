"""The arithmetic of several all-reduce rounds, in one process, for tests/test_bit_identity.py.

Run as ``python tests/round_arithmetic.py --threads 1 2`` under some ``ATEN_CPU_CAPABILITY``; does
the rounds once per thread count and prints one JSON line per run: the kernel selection torch
actually made, the thread count, and SHA-256 digests of θ_global and the outer momentum after the
rounds. The parent compares the digests of runs on different kernels and thread counts.

Every round does what a real one does to the shared state, with the protocol's own functions:
three members encode their Δ with error feedback, the shard owner decodes the contributions,
averages them by token weight (``aggregate``), encodes the average once with its own residual,
and every member applies the *decoded* average with the outer Nesterov step. The codec changes
from round to round (int8, int4, fp16, bf16, topk, sparseloco 2- and 8-bit) and so does the owner's rule (mean, trimmed
mean), over more than a million values, so that the vectorised kernels and threading engage.

``fused_sha256`` is the same θ_global stepped with the outer step as it was written before it
rounded every operation on its own (``add/sub(..., alpha=)``): it shows that the comparison can
fail on this machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json

import numpy as np
import torch

from lowcomm.protocol import codecs
from lowcomm.protocol.aggregation import Aggregation, aggregate
from lowcomm.protocol.outer import NesterovOuter

NUMEL = (1 << 20) + 4099  # odd: partial codec blocks and a vector tail
ROUNDS = 7  # one per codec
MEMBERS = ("peer-a", "peer-b", "peer-c")
WEIGHTS = (1024.0, 1536.0, 2560.0)  # tokens since the last round
CODECS = (("int8", {}), ("int4", {}), ("fp16", {}), ("bf16", {}), ("topk", {"fraction": 1 / 16}),
          ("sparseloco", {}), ("sparseloco", {"bits": 8}))
RULES = (Aggregation(rule="mean"), Aggregation(rule="trimmed_mean", trim_fraction=0.34))
LR, MOMENTUM = 0.7, 0.9


def fused_step(params: torch.Tensor, buf: torch.Tensor, grad: torch.Tensor) -> None:
    """The former outer step (fused multiply-adds in vectorised kernels only)."""
    buf.mul_(MOMENTUM).add_(grad)
    params.sub_(grad.add(buf, alpha=MOMENTUM), alpha=LR)


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def rounds(threads: int) -> dict:
    torch.set_num_threads(threads)
    # numpy draws the inputs: torch's own randn takes another algorithm in its AVX2 kernel.
    rng = np.random.default_rng(2026)

    def randn() -> torch.Tensor:
        return torch.from_numpy(rng.standard_normal(NUMEL, dtype=np.float32))

    theta = randn()
    outer = NesterovOuter.zeros(LR, MOMENTUM, NUMEL)
    fused_theta, fused_buf = theta.clone(), torch.zeros(NUMEL)
    residuals = {m: torch.zeros(NUMEL) for m in MEMBERS}
    owner_residual = torch.zeros(NUMEL)
    for r in range(ROUNDS):
        name, options = CODECS[r % len(CODECS)]
        codec = codecs.get_codec(name, **options)
        contributions = []
        for i, (member, weight) in enumerate(zip(MEMBERS, WEIGHTS)):
            delta = randn().mul_(0.01 * (i + 1))
            payload, _ = codecs.encode_with_feedback(codec, delta, residuals[member])
            contributions.append((member, weight, codec.decode(payload, NUMEL)))
        average = aggregate(contributions, RULES[r % len(RULES)]).average
        payload, _ = codecs.encode_with_feedback(codec, average, owner_residual)
        decoded = codec.decode(payload, NUMEL)  # what every member applies, the owner too
        outer.step_slice(theta, 0, decoded)
        fused_step(fused_theta, fused_buf, decoded)
    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "sha256": digest(theta, outer.buffer),
        "fused_sha256": digest(fused_theta, fused_buf),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, nargs="+", required=True)
    for threads in parser.parse_args().threads:
        print(json.dumps(rounds(threads)), flush=True)


if __name__ == "__main__":
    main()
