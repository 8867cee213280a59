"""Tests of lowcomm.node.data: per-peer shards of the training split and the held-out set."""

from __future__ import annotations

import numpy as np
import pytest

from lowcomm.node.data import DataError, ShardSampler, eval_batches

SEQ = 16


def corpus(blocks: int) -> np.ndarray:
    """A training split whose every token says which block it lies in (block index mod 256)."""
    block = ShardSampler.BLOCK_TOKENS
    return (np.arange(blocks * block + SEQ + 1) // block % 256).astype(np.uint8)


def blocks_of(sampler: ShardSampler, batches: int) -> set[int]:
    seen: set[int] = set()
    for _ in range(batches):
        inputs, _ = sampler.next_batch()
        seen.update(int(v) for v in inputs[:, 0])  # the block a window starts in
    return seen


def test_a_shard_is_spread_over_the_whole_corpus_and_disjoint_from_the_others():
    tokens = corpus(40)
    samplers = [ShardSampler(tokens, SEQ, 8, shards=4, peer_key=key, seed=0) for key in ("a", "b", "c", "d", "e")]
    for sampler in samplers:
        seen = blocks_of(sampler, 8)  # 8*8*16 tokens: far less than one shard, so no shard change
        assert seen <= set(range(sampler.shard, 40, 4)), seen
        assert max(seen) - min(seen) >= 20, f"shard {sampler.shard} drew from a narrow region: {sorted(seen)}"
    assert len({s.shard for s in samplers}) > 1  # the keys do not all hash to one shard


def test_a_peer_moves_to_the_next_shard_after_a_shards_worth_of_tokens():
    tokens = corpus(8)
    sampler = ShardSampler(tokens, SEQ, 64, shards=4, peer_key="x", seed=1)
    first = sampler.shard
    per_shard = 2 * ShardSampler.BLOCK_TOKENS  # 8 blocks / 4 shards
    for _ in range(per_shard // (64 * SEQ)):
        sampler.next_batch()
    assert sampler.shard == (first + 1) % 4


def test_same_key_and_seed_draw_the_same_batches():
    tokens = corpus(10)
    one, two = (ShardSampler(tokens, SEQ, 4, shards=3, peer_key="p", seed=7) for _ in range(2))
    for _ in range(5):
        assert all((a == b).all() for a, b in zip(one.next_batch(), two.next_batch()))


def test_small_corpora_still_work_and_too_small_ones_say_why():
    tokens = np.arange(100, dtype=np.uint8)  # far less than one block
    sampler = ShardSampler(tokens, SEQ, 4, shards=64, peer_key="p", seed=0)
    assert sampler.shards == 1
    inputs, targets = sampler.next_batch()
    assert inputs.shape == (4, SEQ) and (inputs[:, 1:] == targets[:, :-1]).all()
    with pytest.raises(DataError, match=r"too few for \[data\] seq_len = \d+ \(at least \d+\): give more data"):
        ShardSampler(np.zeros(20, dtype=np.uint8), SEQ, 4, shards=1, peer_key="p", seed=0)


def test_a_corpus_too_small_for_seq_len_names_its_path_and_the_fixes(tmp_path):
    # It said "training split has 0 tokens, too little for seq_len 128; add files", naming no file.
    from lowcomm.node.config import load_config
    from lowcomm.node.trainer import Trainer

    (tmp_path / "small.txt").write_text("hello world " * 30)
    config = load_config(overrides=[f"data.path='{tmp_path / 'small.txt'}'"], environ={})
    with pytest.raises(DataError) as info:
        Trainer(config, "peer-a")
    assert str(info.value) == (f"[data] path '{tmp_path / 'small.txt'}': its held-out split has 18 tokens, too few for "
                               "[data] seq_len = 128 (at least 130): give more data (text, documents or tokens), "
                               "a larger [data] eval_fraction, or a smaller seq_len")


def test_eval_batches_are_fixed():
    tokens = np.arange(5000, dtype=np.int64) % 251
    first, second = eval_batches(tokens, SEQ, 4, 3), eval_batches(tokens, SEQ, 4, 3)
    assert len(first) == 3 and all((a[0] == b[0]).all() for a, b in zip(first, second))


def test_the_held_out_set_of_a_split_past_2_to_the_24_tokens_ends_at_its_last_token():
    # 2**25 + 3 usable starts: float32 (torch.linspace's default) rounds the last start up to
    # 2**25 + 4, past the split's end (an IndexError for the held-out split of a large tokens file).
    tokens = np.zeros(2**25 + 3 + SEQ + 1, dtype=np.uint8)
    tokens[-1] = 7
    batches = eval_batches(tokens, SEQ, 4, 2)
    assert len(batches) == 2 and all(inputs.shape == (4, SEQ) for inputs, _ in batches)
    assert int(batches[-1][1][-1, -1]) == 7  # the last window ends exactly at the split's last token
