"""Corpora, the fixed held-out split, and per-peer shards of the training split.

The default corpus is the Python standard library's own ``.py`` files, read from the running
interpreter: it exists offline on every machine that can run the node. A user's own text comes
in through ``[data] path`` (a glob). Files go to the eval split by a hash of their relative
path, so the split is the same on every peer and does not depend on file order.
"""

from __future__ import annotations

import glob
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


class DataError(Exception):
    """The configured corpus cannot be used; the message says why and what to change."""


def default_corpus_files() -> tuple[Path, list[Path]]:
    """The standard library's .py files (without tests, which are large and repetitive)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.relative_to(root).parts[0].lower()
                   and "site-packages" not in p.parts)
    return root, files


def resolve_files(pattern: str | None) -> tuple[Path, list[Path]]:
    if pattern is None:
        return default_corpus_files()
    matches = sorted(Path(p) for p in glob.glob(str(Path(pattern).expanduser()), recursive=True))
    files = [p for p in matches if p.is_file()]
    if not files:
        raise DataError(f"[data] path {pattern!r} matches no files; give a glob such as 'corpus/**/*.txt'")
    return Path(pattern).expanduser().parent, files


def _is_eval(relative_name: str, eval_fraction: float) -> bool:
    digest = hashlib.sha256(relative_name.encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < eval_fraction


@dataclass
class Corpus:
    train: np.ndarray
    """uint8 bytes of the training files, concatenated."""
    eval: np.ndarray
    """uint8 bytes of the held-out files, concatenated."""
    files: int


def load_corpus(pattern: str | None, eval_fraction: float, max_bytes: int = 64 * 2**20) -> Corpus:
    root, files = resolve_files(pattern)
    train_parts: list[bytes] = []
    eval_parts: list[bytes] = []
    total = 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue  # an unreadable file in a glob is not worth stopping the node for
        name = str(path.relative_to(root)) if path.is_relative_to(root) else path.name
        (eval_parts if _is_eval(name, eval_fraction) else train_parts).append(data)
        total += len(data)
        if total >= max_bytes:
            break
    train = np.frombuffer(b"\n".join(train_parts), dtype=np.uint8)
    held_out = np.frombuffer(b"\n".join(eval_parts), dtype=np.uint8)
    if len(held_out) == 0 and len(train) > 0:
        # Few files: hold out the tail of the text instead of whole files.
        cut = int(len(train) * (1 - eval_fraction))
        train, held_out = train[:cut], train[cut:]
    return Corpus(train=train, eval=held_out, files=len(files))


class ShardSampler:
    """Random windows from this peer's shard of the training split.

    The training split is cut into blocks of ``BLOCK_TOKENS`` and shard ``k`` of ``shards`` is
    every ``shards``-th block starting at ``k``: each shard is spread over the whole corpus, so
    every peer's data looks like the held-out set (contiguous shards made each peer train on a
    few neighbouring files, and the peers' local models drifted apart between rounds). A peer
    starts on the shard its id hashes to and moves to the next one after drawing about one
    shard's worth of tokens, so peers see different data at the same time while every byte
    stays reachable.
    """

    BLOCK_TOKENS = 4096

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, shards: int, peer_key: str, seed: int):
        if len(tokens) < (seq_len + 1) * 2:
            raise DataError(f"training split has {len(tokens)} bytes, too little for seq_len {seq_len}; add files")
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.seq_len, self.batch_size = seq_len, batch_size
        usable = len(tokens) - seq_len - 1  # window starts lie in [0, usable)
        self.block = max(1, min(self.BLOCK_TOKENS, usable))
        self.blocks = max(1, usable // self.block)
        self.shards = max(1, min(shards, self.blocks))
        digest = hashlib.sha256(f"{seed}/{peer_key}".encode()).digest()
        self.shard = int.from_bytes(digest[:8], "little") % self.shards
        self.generator = torch.Generator().manual_seed(int.from_bytes(digest[8:16], "little") % 2**63)
        self.drawn = 0

    def shard_blocks(self, shard: int) -> torch.Tensor:
        """Indices of the blocks that make up ``shard``."""
        return torch.arange(shard, self.blocks, self.shards)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = self.shard_blocks(self.shard)
        chosen = blocks[torch.randint(len(blocks), (self.batch_size,), generator=self.generator)]
        starts = chosen * self.block + torch.randint(self.block, (self.batch_size,), generator=self.generator)
        offsets = torch.arange(self.seq_len + 1)
        windows = self.tokens[starts[:, None] + offsets]
        self.drawn += self.batch_size * self.seq_len
        if self.drawn >= len(blocks) * self.block:
            self.shard, self.drawn = (self.shard + 1) % self.shards, 0
        return windows[:, :-1], windows[:, 1:]


def eval_batches(tokens: np.ndarray, seq_len: int, batch_size: int, batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed held-out set: evenly spaced windows, the same on every peer and every round."""
    data = torch.from_numpy(tokens.astype(np.int64))
    count = batches * batch_size
    usable = len(data) - seq_len - 1
    if usable <= 0:
        raise DataError(f"held-out split has {len(data)} bytes, too little for seq_len {seq_len}")
    starts = torch.linspace(0, usable, count).long()
    windows = data[starts[:, None] + torch.arange(seq_len + 1)]
    return [(w[:, :-1], w[:, 1:]) for w in windows.split(batch_size)]
