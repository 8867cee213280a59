"""A model's buffers (BatchNorm's running statistics) are each peer's own state: checkpointed,
restored at a resume, exported, and seen by the eval of θ_global as the round left them
(node/buffers.py). The replica that evaluates θ_global used to keep the buffers it was copied
with at start: a BatchNorm model's every eval ran with its initial statistics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from lowcomm.node import restore
from lowcomm.node.buffers import load_buffers, persistent_buffers
from lowcomm.node.config import load_config
from lowcomm.node.external_trainer import EvaluatingExternalTrainer, ExternalTrainer
from lowcomm.node.globalstate import GlobalState
from lowcomm.node.models import ModelError, build_model_for
from torch.nn.utils import parameters_to_vector

from .test_export import cli_export, sets


def normalized() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


def train_a_little(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    for _ in range(steps):
        x = torch.randn(16, 4) + 3.0  # a mean far from BatchNorm's initial 0
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_only_persistent_buffers_are_the_models_state() -> None:
    model = normalized()
    model.register_buffer("mask", torch.ones(3), persistent=False)  # rebuilt by the model: not state
    assert sorted(persistent_buffers(model)) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]


def test_buffers_round_trip_through_the_local_state_and_another_models_are_refused() -> None:
    torch.manual_seed(0)
    model = normalized()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    train_a_little(model, optimizer)
    state = ExternalTrainer(model, optimizer).local_state()
    resumed_model = normalized()
    ExternalTrainer(resumed_model, torch.optim.SGD(resumed_model.parameters(), lr=0.01)).load_local_state(state)
    assert torch.equal(resumed_model[1].running_mean, model[1].running_mean)
    assert int(resumed_model[1].num_batches_tracked) == 3
    wider = nn.Sequential(nn.Linear(4, 9), nn.BatchNorm1d(9), nn.ReLU(), nn.Linear(9, 1))
    with pytest.raises(ModelError, match=r"buffer 1.running_mean has shape \(8,\) saved, \(9,\) in this model"):
        ExternalTrainer(wider, torch.optim.SGD(wider.parameters(), lr=0.01)).load_local_state(state)
    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with pytest.raises(ValueError, match="another model's"):
        load_buffers(plain, state["buffers"])


def test_the_replica_evaluates_with_the_buffers_the_round_left() -> None:
    torch.manual_seed(0)
    model = normalized()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []

    def eval_fn(replica: nn.Module) -> float:
        seen.append(replica[1].running_mean.clone())
        return 0.0

    trainer = EvaluatingExternalTrainer(model, optimizer, eval_fn)
    evaluate = trainer.replica_evaluator()  # built at start: initial statistics
    train_a_little(model, optimizer)
    flat = parameters_to_vector(model.parameters()).detach()
    evaluate(flat, trainer.local_state()["buffers"])
    assert torch.equal(seen[-1], model[1].running_mean) and seen[-1].abs().sum() > 1.0


SCRIPT = textwrap.dedent("""
    import json, sys, torch, torch.nn as nn, lowcomm
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    config = {"train": {"inner_steps": 2}, "node": {"host": "127.0.0.1", "checkpoint_dir": sys.argv[1]}}
    seen = []
    def eval_fn(replica):
        seen.append(replica[1].running_mean.tolist())
        return 0.0
    with lowcomm.Swarm(model, optimizer, config=config, eval_fn=eval_fn, log=False) as swarm:
        at_open = model[1].running_mean.tolist()
        for _ in range(2):
            x = torch.randn(16, 4) + 3.0
            loss = model(x).pow(2).mean()
            loss.backward(); optimizer.step(); optimizer.zero_grad()
            swarm.step(tokens=16, loss=loss)
        at_round = model[1].running_mean.tolist()
        swarm.state_dict()  # waits for the round's report: its eval ran
    print(json.dumps({"at_open": at_open, "at_round": at_round, "seen": seen}), flush=True)
""")


def test_a_swarm_evaluates_checkpoints_and_resumes_its_models_running_statistics(tmp_path) -> None:
    (tmp_path / "loop.py").write_text(SCRIPT)

    def run() -> dict:
        done = subprocess.run([sys.executable, str(tmp_path / "loop.py"), str(tmp_path / "ckpt")],
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = run()
    assert first["at_open"] == [0.0] * 8
    # The start's eval saw the initial statistics, the round's eval those of the round's end.
    assert first["seen"][0] == [0.0] * 8 and first["seen"][1] == first["at_round"]
    second = run()  # resumes from the stop's checkpoint (outer step 1)
    assert second["at_open"] == first["at_round"]
    assert second["seen"][0] == first["at_round"]  # the start's eval: the resumed statistics


def test_an_export_carries_the_checkpointing_peers_buffers(tmp_path) -> None:
    run = ["model.factory=tests.factory_model:build_normalized", "data.seq_len=64"]
    config = load_config(overrides=[*run, f"node.checkpoint_dir={tmp_path / 'ck'}"], environ={})
    model = build_model_for(config)
    buffers = {name: buffer.clone() for name, buffer in persistent_buffers(model).items()}
    for name, buffer in buffers.items():
        if buffer.is_floating_point():
            buffer.add_(0.5)  # statistics a peer gathered
    state = GlobalState.fresh(parameters_to_vector(model.parameters()).detach(), 1.0, 0.5)
    state.commit()
    restore.save(config, state.to_checkpoint(), {"buffers": buffers}, tokens_total=64)
    done = cli_export("--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "model"), *sets(run))
    assert done.returncode == 0, done.stderr
    exported = torch.load(tmp_path / "model" / "model.pt", weights_only=True)
    running_mean = next(buffer for name, buffer in buffers.items() if name.endswith("norm.running_mean"))
    assert torch.equal(exported["norm.running_mean"], running_mean) and float(running_mean.sum()) == 8.0
