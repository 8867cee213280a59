"""``lowcomm.Swarm`` with frozen parameters, as a LoRA or adapter fine-tune has them
(node/averaged_params.py): only the trainable parameters are averaged, the frozen ones are left
alone and may be of any dtype, a digest of them is in the run fingerprint, and a parameter frozen
or unfrozen after the Swarm was made stops the node with what to do.

The example's two-process swarm (examples/finetune_lora.py) is in tests/test_api_swarm.py.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from pathlib import Path

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
from lowcomm.node.config import load_config
from lowcomm.node.globalstate import GlobalState
from lowcomm.node.localswarm import node_command
from lowcomm.node.models import build_model_for
from lowcomm.protocol.snapshot import params_sha256
from tests.factory_model import build_frozen_embed

REPO = Path(__file__).resolve().parents[1]
WAIT = 120  # seconds: start-up and a round on a loaded 2-core machine


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
    trainer = ExternalTrainer(model, torch.optim.SGD(model.head.parameters(), lr=0.1))
    flat = trainer.get_params()
    assert trainer.numel == flat.numel() == 68
    assert torch.equal(flat, parameters_to_vector(model.head.parameters()))
    trainer.set_params(torch.zeros(68))
    assert all(bool((p == 0).all()) for p in model.head.parameters())
    assert torch.equal(model.base.weight, base)  # untouched, bit for bit, in its own dtype
    # A run whose definition trains every parameter (a [model] preset) averages them all, frozen here or not.
    every = ExternalTrainer(Adapted(), torch.optim.SGD(model.head.parameters(), lr=0.1), averaged_mask=[True] * 4)
    assert every.get_params().numel() == 212


def test_the_eval_replica_takes_theta_global_into_the_trainable_parameters_only():
    model = Adapted()
    x = torch.randn(5, 8)
    trainer = EvaluatingExternalTrainer(model, torch.optim.SGD(model.head.parameters(), lr=0.1),
                                        eval_fn=lambda replica: float(replica(x).sum()))
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


def test_a_parameter_unfrozen_outside_the_averaged_set_stops_the_node_and_one_frozen_later_is_fine():
    model = Adapted()
    trainer = ExternalTrainer(model, torch.optim.SGD(model.head.parameters(), lr=0.1))
    trainer.get_params()
    model.base.weight.requires_grad_(True)
    with pytest.raises(TrainableSetChanged, match=r"^parameter base\.weight was unfrozen, but the swarm does not "
                                                   r"average it .* so each peer would train it apart: keep it frozen"):
        trainer.get_params()
    model.base.weight.requires_grad_(False)
    model.head.bias.requires_grad_(False)  # frozen after a warm-up, say: its Δ is zero, it stays averaged
    assert trainer.get_params().numel() == 68


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


def test_a_model_section_averages_what_the_configs_model_trains(caplog):
    config = {"model": {"preset": "tiny"}, "data": {"seq_len": 32}}
    gpt = build_model_for(load_config(overrides=["model.preset=tiny", "data.seq_len=32"], environ={}))
    gpt.blocks.requires_grad_(False)  # frozen here, trained by lowcomm-node peers of the config
    resolved = resolve_config(config, None, gpt)
    assert resolved.averaged_mask == [True] * len(list(gpt.parameters()))
    trainer = ExternalTrainer(gpt, torch.optim.SGD(gpt.parameters(), lr=0.1), averaged_mask=resolved.averaged_mask)
    assert trainer.numel == sum(p.numel() for p in gpt.parameters())
    with caplog.at_level(logging.WARNING, logger="lowcomm.api"):
        _say_frozen_parameters_are_averaged(trainer)  # as the Swarm opens: what they cost, how to leave them out
    frozen = sum(p.numel() for p in gpt.blocks.parameters())
    [line] = [r for r in caplog.records if getattr(r, "event", None) == "frozen_parameters_averaged"]
    assert line.parameters == frozen and f"{frozen:,} frozen parameters" in line.getMessage()
    assert "leave [model] out of the config" in line.getMessage()
    assert resolve_config({}, None, gpt).averaged_mask == [p.requires_grad for p in gpt.parameters()]


def test_a_factory_that_freezes_a_part_is_averaged_without_it_in_the_daemon_and_in_a_swarm():
    run = ["model.factory=tests.factory_model:build_frozen_embed", "data.seq_len=32"]
    config = load_config(overrides=run, environ={})
    built = build_model_for(config)
    embed = built.net.embed.weight.numel()
    trainable = sum(p.numel() for p in built.parameters()) - embed
    definition = config.run_config()["model"]
    assert (definition["parameters"], definition["frozen_parameters"]) == (trainable, embed)
    plain = load_config(overrides=["model.factory=tests.factory_model:build", "data.seq_len=32"], environ={})
    assert "frozen_parameters" not in plain.run_config()["model"]  # as before for a model that trains everything
    # lowcomm.Swarm with that [model]: the same set, and the model given must freeze what it freezes.
    swarm_config = {"model": {"factory": "tests.factory_model:build_frozen_embed"}, "data": {"seq_len": 32}}
    assert resolve_config(swarm_config, None, build_frozen_embed()).averaged_mask == [False, True, True, True, True]
    unfrozen = build_frozen_embed()
    unfrozen.embed.requires_grad_(True)
    with pytest.raises(SwarmError, match=r"^parameter embed\.weight trains in the model given to lowcomm\.Swarm, but "
                                         r"the config's \[model\] factory = .* freezes it"):
        resolve_config(swarm_config, None, unfrozen)


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

    with pytest.raises(SwarmError, match=r"^parameter base\.bias was unfrozen, but the swarm does not average it"):
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
    trainer = ExternalTrainer(model, torch.optim.SGD(model.head.parameters(), lr=0.1))
    swarm_config = resolve_config(config, None, model)
    state = GlobalState.fresh(trainer.get_params(), swarm_config.sync.outer_lr, swarm_config.sync.outer_momentum)
    restore.save(swarm_config, state.to_checkpoint(), trainer.local_state(), tokens_total=0)
    [written] = checkpoint.list_checkpoints(tmp_path)
    before = written.read_bytes()

    other = Adapted(base_seed=1)
    with pytest.raises(FatalError) as info:
        restore.restore(resolve_config(config, None, other),
                        ExternalTrainer(other, torch.optim.SGD(other.head.parameters(), lr=0.1)))
    assert ("(the model's frozen parameters (requires_grad=False) differ from the checkpoint's run's in names, dtypes, "
            "shapes or values: load the same base weights)") in str(info.value)
    assert written.read_bytes() == before
    # The same base resumes.
    again = Adapted()
    restore.restore(resolve_config(config, None, again),
                    ExternalTrainer(again, torch.optim.SGD(again.head.parameters(), lr=0.1)))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_lowcomm_node_peers_of_a_factory_with_a_frozen_part_average_the_rest_and_export_it_whole(swarm, tmp_path):
    factory = ["model.factory=tests.factory_model:build_frozen_embed", "data.seq_len=64"]
    run = [*(flag for key in factory for flag in ("--set", key)), "--set", "data.eval_batches=2",
           "--set", "train.warmup_steps=0", "--set", "sync.group_size=2"]
    env = {"PYTHONPATH": str(REPO)}  # the factory module lives in tests/
    first = swarm.start(0, extra=run, env=env)
    loaded = first.wait_event("data_loaded", WAIT)
    # BigramLoss(256, 32): a frozen 256 × 32 embedding; the mix and the head train.
    assert (loaded["parameters"], loaded["frozen_parameters"]) == (10528, 8192)
    assert "model: 10,528 parameters averaged (8,192 frozen, not averaged)" in loaded["msg"]
    second = swarm.start(1, [first.ready(WAIT)["multiaddrs"][0]], extra=run, env=env)
    second.wait_for(lambda e: e.get("event") == "round_done" and e["group_size"] == 2, WAIT * 2)
    [shared] = [e for e in second.rounds() if e["group_size"] == 2][:1]
    ours = first.wait_event("round_done", WAIT, outer_step=shared["outer_step"])
    assert ours["params_sha256"] == shared["params_sha256"] and ours["numel"] == shared["numel"] == 10528
    first.signal(signal.SIGTERM)
    assert first.wait_exit(WAIT) == 0
    last = first.wait_event("node_stopped", 5)["outer_step"]
    committed = {e["outer_step"]: e["params_sha256"] for e in first.rounds()}

    # The export holds the whole module: the averaged parameters of the last checkpoint, and the
    # embedding as the factory built it.
    out = tmp_path / "model"
    done = subprocess.run([*node_command(), "export", "--checkpoint-dir", str(swarm.workdir / "peer-0"),
                           "--out", str(out), *(flag for key in factory for flag in ("--set", key))],
                          capture_output=True, text=True, timeout=WAIT, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    state = torch.load(out / "model.pt", weights_only=True)
    module = build_frozen_embed()
    module.load_state_dict(state)
    built = build_model_for(load_config(overrides=factory, environ={}))
    assert torch.equal(module.embed.weight, built.net.embed.weight)
    trainable = parameters_to_vector([p for name, p in module.named_parameters() if not name.startswith("embed.")])
    assert done.stdout.startswith(f"exported outer step {last} (params {committed[last][:12]})"), done.stdout
    assert params_sha256(trainable.detach()) == committed[last]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_lora_factory_fine_tunes_a_saved_model_through_lowcomm_node(swarm, tmp_path):
    transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    from .hf_assets import TINY_LLAMA

    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    base.save_pretrained(tmp_path / "base")  # the pretrained model a fine-tune starts from
    before = {name: p.detach().clone() for name, p in base.named_parameters()}
    run = ["--set", "model.factory=examples.lora:build",
           "--set", f'model.factory_kwargs={{ pretrained = "{tmp_path / "base"}", rank = 4 }}',
           "--set", "data.seq_len=64", "--set", "data.eval_batches=2", "--set", "train.warmup_steps=0",
           "--set", "sync.group_size=2"]
    env = {"PYTHONPATH": str(REPO)}  # examples/lora.py, imported as examples.lora from the repository
    first = swarm.start(0, extra=run, env=env)
    loaded = first.wait_event("data_loaded", WAIT)
    # Rank-4 adapters on q_proj and v_proj (64 × 64) of 2 layers train; the saved model is frozen.
    assert (loaded["parameters"], loaded["frozen_parameters"]) == (4 * (64 * 4 + 4 * 64), 115008)
    initial_eval = first.ready(WAIT)["eval_loss"]
    second = swarm.start(1, [first.multiaddr], extra=run, env=env)
    second.wait_for(lambda e: e.get("event") == "round_done" and e["group_size"] == 2, WAIT * 2)
    [shared] = [e for e in second.rounds() if e["group_size"] == 2][:1]
    ours = first.wait_event("round_done", WAIT, outer_step=shared["outer_step"])
    assert ours["params_sha256"] == shared["params_sha256"] and shared["numel"] == 2048
    assert ours["eval_loss"] < initial_eval  # the adapters learn

    # The export holds the saved model as it was and the adapters of the last checkpoint.
    first.signal(signal.SIGTERM)
    assert first.wait_exit(WAIT) == 0
    done = subprocess.run([*node_command(), "export", "--checkpoint-dir", str(swarm.workdir / "peer-0"),
                           "--out", str(tmp_path / "out"), *run[:4], "--set", "data.seq_len=64"],
                          capture_output=True, text=True, timeout=WAIT, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    state = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    for name, saved in before.items():
        wrapped = name.replace(".q_proj.", ".q_proj.base.").replace(".v_proj.", ".v_proj.base.")
        assert torch.equal(state[f"lm.{wrapped}"], saved), name
    assert any(bool(state[key].abs().sum() > 0) for key in state if key.endswith(".up.weight"))  # trained from 0


def test_merging_the_lora_adapters_keeps_what_the_model_computes():
    transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    from examples.lora import LoRALinear, add_lora, merge_lora

    from .hf_assets import TINY_LLAMA

    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    adapters = add_lora(lm, rank=4)
    with torch.no_grad():
        for p in adapters:
            p.normal_(std=0.05)  # trained adapters: up is no longer zero
    inputs = torch.randint(256, (2, 16))
    with torch.no_grad():
        adapted = lm(input_ids=inputs).logits
        merged = merge_lora(lm)
        assert not any(isinstance(m, LoRALinear) for m in merged.modules())
        assert torch.allclose(merged(input_ids=inputs).logits, adapted, atol=1e-5)
    assert [name for name, _ in merged.named_parameters()] == [
        name for name, _ in transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA)).named_parameters()]
