"""Evaluating θ_global on a replica, off the training thread."""

from __future__ import annotations

import numpy as np
import torch

from lowcomm.node.config import Config
from lowcomm.node.data import Corpus
from lowcomm.node.evaluator import Evaluator
from lowcomm.node.trainer import Trainer


def small_trainer() -> Trainer:
    rng = np.random.default_rng(0)
    text = rng.integers(32, 127, size=200_000, dtype=np.uint8)
    corpus = Corpus(train=text[:180_000], eval=text[180_000:], files=1)
    config = Config.model_validate({"train": {"batch_size": 4}, "data": {"eval_batches": 2}})
    return Trainer(config, "peer-00", corpus)


def test_replica_gives_the_trainers_eval_loss_and_leaves_the_local_model_alone():
    trainer = small_trainer()
    evaluator = Evaluator(trainer)
    global_params = trainer.get_params()
    trainer.train_phase(3, lambda: False)  # the local model moves on; θ_global stays behind
    local = trainer.get_params()
    assert not torch.equal(local, global_params)

    on_replica = evaluator.evaluate(global_params)

    assert torch.equal(trainer.get_params(), local)  # training state untouched
    trainer.set_params(global_params)
    assert on_replica == trainer.evaluate()  # same weights, same batches, same number
    assert evaluator.evaluate(local) != on_replica  # and it does follow what it is given
