"""``lowcomm.Swarm`` with frozen parameters, as a LoRA or adapter fine-tune has them
(node/averaged_params.py): only the trainable parameters are averaged, the frozen ones are left
alone and may be of any dtype, a digest of them is in the run fingerprint, and a parameter frozen
or unfrozen after the Swarm was made stops the node with what to do.

The example's two-process swarm (examples/finetune_lora.py) is in tests/test_api_swarm.py.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
from torch.nn.utils import parameters_to_vector

import lowcomm
import pytest
from lowcomm.api import _say_frozen_parameters_are_averaged
from lowcomm.api_config import SwarmError, resolve_config
from lowcomm.node import checkpoint, restore
from lowcomm.node.averaged_params import TrainableSetChanged
from lowcomm.node.errors import FatalError
from lowcomm.node.external_trainer import EvaluatingExternalTrainer, ExternalTrainer
from lowcomm.node.globalstate import GlobalState
from lowcomm.node.config import load_config
from lowcomm.node.models import build_model_for


class Adapted(nn.Module):
    """A frozen base (any dtype) with a trainable float32 head: 8·16 + 16 = 144 frozen and
    16·4 + 4 = 68 trainable parameters."""

    def __init__(self, base_seed: int = 0, base_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(base_seed)
            self.base = nn.Linear(8, 16).to(base_dtype)
        self.base.requires_grad_(False)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.base(x.to(self.base.weight.dtype)).float()))


def fingerprint_model(model: nn.Module) -> dict:
    return resolve_config({}, None, model).run_config()["model"]


def test_the_fingerprint_counts_the_trainable_parameters_and_digests_the_frozen_ones():
    model = fingerprint_model(Adapted())
    assert (model["parameters"], model["frozen_parameters"]) == (68, 144)
    assert fingerprint_model(Adapted()) == model  # the same base: the same fingerprint
    assert fingerprint_model(Adapted(base_seed=1))["frozen_sha256"] != model["frozen_sha256"]  # other base weights
    assert fingerprint_model(Adapted(base_dtype=torch.bfloat16))["frozen_sha256"] != model["frozen_sha256"]
    trained = Adapted()
    with torch.no_grad():
        trained.head.weight.add_(1.0)  # trainable values are the run's state, not its definition
    assert fingerprint_model(trained) == model
    # A model that trains everything has no frozen keys: its fingerprint is what it was before.
    assert set(fingerprint_model(nn.Linear(4, 8))) == {"kind", "parameters", "shapes_sha256"}


def test_the_trainer_averages_the_trainable_parameters_and_leaves_the_frozen_ones_alone():
    model = Adapted(base_dtype=torch.bfloat16)  # a bf16 base: averaged parameters alone must be float32
    base = model.base.weight.detach().clone()
    trainer = ExternalTrainer(model, torch.optim.SGD(model.head.parameters(), lr=0.1), every_parameter=False)
    flat = trainer.get_params()
    assert trainer.numel == flat.numel() == 68
    assert torch.equal(flat, parameters_to_vector(model.head.parameters()))
    trainer.set_params(torch.zeros(68))
    assert all(bool((p == 0).all()) for p in model.head.parameters())
    assert torch.equal(model.base.weight, base)  # untouched, bit for bit, in its own dtype
    # The CLI's run (a [model] section) averages every parameter, frozen or not.
    every = ExternalTrainer(Adapted(), torch.optim.SGD(model.head.parameters(), lr=0.1), every_parameter=True)
    assert every.get_params().numel() == 212


def test_the_eval_replica_takes_theta_global_into_the_trainable_parameters_only():
    model = Adapted()
    x = torch.randn(5, 8)
    trainer = EvaluatingExternalTrainer(model, torch.optim.SGD(model.head.parameters(), lr=0.1),
                                        eval_fn=lambda replica: float(replica(x).sum()), every_parameter=False)
    evaluate = trainer.replica_evaluator()
    zeros_head = Adapted()
    with torch.no_grad():
        for p in zeros_head.head.parameters():
            p.zero_()
    with torch.no_grad():
        expected = float(zeros_head(x).sum())
    assert evaluate(torch.zeros(68)) == pytest.approx(expected)
    theta = torch.randn(68)
    trainer.set_params(theta)
    with torch.no_grad():
        expected = float(model(x).sum())
    assert evaluate(theta) == pytest.approx(expected)  # the replica keeps the model's frozen base


def test_a_parameter_frozen_or_unfrozen_after_the_swarm_was_made_stops_the_node_with_what_to_do():
    model = Adapted()
    trainer = ExternalTrainer(model, torch.optim.SGD(model.head.parameters(), lr=0.1), every_parameter=False)
    trainer.get_params()
    model.base.weight.requires_grad_(True)
    with pytest.raises(TrainableSetChanged, match=r"^parameter base\.weight was unfrozen after the lowcomm\.Swarm was "
                                                   r"made \(it is not averaged, so each peer would train it apart\); "):
        trainer.get_params()
    model.base.weight.requires_grad_(False)
    model.head.bias.requires_grad_(False)
    with pytest.raises(TrainableSetChanged, match=r"^parameter head\.bias was frozen .*make a new Swarm"):
        trainer.get_params()
    # Where every parameter is averaged anyway (a [model] run), requires_grad plays no part.
    ExternalTrainer(model, torch.optim.SGD(model.head.parameters(), lr=0.1), every_parameter=True).get_params()


def test_the_swarm_refuses_what_cannot_train_and_takes_a_base_of_any_dtype():
    def swarm(model: nn.Module, params=None) -> lowcomm.Swarm:
        return lowcomm.Swarm(model, torch.optim.SGD(params or model.parameters(), lr=0.1))

    swarm(Adapted(base_dtype=torch.bfloat16))  # refused before: every parameter had to be float32
    half_head = Adapted()
    half_head.head.half()
    with pytest.raises(SwarmError, match=r"torch\.float16 trainable parameters; .* \(its frozen parameters, "
                                         r"requires_grad=False, may keep any dtype\)$"):
        swarm(half_head)
    all_frozen = Adapted()
    all_frozen.requires_grad_(False)
    with pytest.raises(SwarmError, match=r"every parameter of the model given to lowcomm\.Swarm has "
                                         r"requires_grad=False, so nothing would train"):
        swarm(all_frozen)
    model = Adapted()
    with pytest.raises(SwarmError, match=r"inner_optimizer holds none of the model's trainable parameters"):
        swarm(model, list(model.base.parameters()))  # an optimizer over the frozen base only


def test_a_model_section_averages_every_parameter_as_the_daemon_does(caplog):
    config = {"model": {"preset": "tiny"}, "data": {"seq_len": 32}}
    gpt = build_model_for(load_config(overrides=["model.preset=tiny", "data.seq_len=32"], environ={}))
    gpt.blocks.requires_grad_(False)
    resolved = resolve_config(config, None, gpt)
    assert resolved.averages_every_parameter  # lowcomm-node peers of this config train them all
    trainer = ExternalTrainer(gpt, torch.optim.SGD(gpt.parameters(), lr=0.1),
                              every_parameter=resolved.averages_every_parameter)
    assert trainer.numel == sum(p.numel() for p in gpt.parameters())
    with caplog.at_level(logging.WARNING, logger="lowcomm.api"):
        _say_frozen_parameters_are_averaged(trainer)  # as the Swarm opens: what they cost, how to leave them out
    frozen = sum(p.numel() for p in gpt.blocks.parameters())
    [line] = [r for r in caplog.records if getattr(r, "event", None) == "frozen_parameters_averaged"]
    assert line.parameters == frozen and f"{frozen:,} frozen parameters" in line.getMessage()
    assert "leave [model] out of the config" in line.getMessage()
    assert not resolve_config({}, None, gpt).averages_every_parameter


def test_unfreezing_a_parameter_in_a_running_swarm_ends_it_with_a_swarm_error(tmp_path):
    model = Adapted()
    optimizer = torch.optim.SGD(model.head.parameters(), lr=0.1)
    config = {"train": {"inner_steps": 2}, "node": {"host": "127.0.0.1", "checkpoint_dir": str(tmp_path / "ckpt")}}

    def train(swarm: lowcomm.Swarm, steps: int) -> None:
        for _ in range(steps):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            swarm.step(tokens=4, loss=loss)

    with pytest.raises(SwarmError, match=r"^parameter base\.bias was unfrozen after the lowcomm\.Swarm was made"):
        with lowcomm.Swarm(model, optimizer, config=config, log=False) as swarm:
            train(swarm, 2)  # one round (alone) of the head's 68 parameters
            assert swarm.outer_step == 1
            assert swarm.state_dict()["params"].numel() == 68
            model.base.bias.requires_grad_(True)
            with pytest.raises(lowcomm.SwarmStopped):
                train(swarm, 4)  # the next boundary stops the node
    assert swarm.outer_step == 1  # no round of a changed split was averaged or checkpointed
    assert checkpoint.list_checkpoints(tmp_path / "ckpt")[-1].name == "step-000000001.ckpt"


def test_a_checkpoint_of_another_base_says_so_and_is_kept(tmp_path):
    config = {"node": {"checkpoint_dir": str(tmp_path)}}
    model = Adapted()
    trainer = ExternalTrainer(model, torch.optim.SGD(model.head.parameters(), lr=0.1), every_parameter=False)
    swarm_config = resolve_config(config, None, model)
    state = GlobalState.fresh(trainer.get_params(), swarm_config.sync.outer_lr, swarm_config.sync.outer_momentum)
    restore.save(swarm_config, state.to_checkpoint(), trainer.local_state(), tokens_total=0)
    [written] = checkpoint.list_checkpoints(tmp_path)
    before = written.read_bytes()

    other = Adapted(base_seed=1)
    with pytest.raises(FatalError) as info:
        restore.restore(resolve_config(config, None, other),
                        ExternalTrainer(other, torch.optim.SGD(other.head.parameters(), lr=0.1), every_parameter=False))
    assert ("(the model's frozen parameters (requires_grad=False) differ from the checkpoint's run's in names, dtypes, "
            "shapes or values: load the same base weights)") in str(info.value)
    assert written.read_bytes() == before
    # The same base resumes.
    again = Adapted()
    restore.restore(resolve_config(config, None, again),
                    ExternalTrainer(again, torch.optim.SGD(again.head.parameters(), lr=0.1), every_parameter=False))
