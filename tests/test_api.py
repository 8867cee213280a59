"""``lowcomm.Swarm`` without sockets: the turns between the user's loop and the node's training
thread (node/external_trainer.py), the API's config and model checks (lowcomm/api_config.py).

The swarms themselves (processes, rounds, hashes, resume) are in tests/test_api_swarm.py.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
import torch.nn as nn

import lowcomm
from lowcomm.api_config import SwarmError, resolve_config
from lowcomm.node.config import load_config
from lowcomm.node.external_trainer import ExternalTrainer, SwarmStopped

from .hf_assets import TINY_LLAMA, write_llama_config

JOIN = 10  # seconds: a bound on thread joins that only a broken handoff reaches


class Touches(nn.Module):
    """A model that records which thread touches it, and whether two ever overlap."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4))
        self.busy = threading.Lock()
        self.overlaps = 0
        self.log: list[str] = []

    def touch(self, who: str) -> None:
        if not self.busy.acquire(blocking=False):
            self.overlaps += 1
            return
        try:
            self.log.append(who)
            with torch.no_grad():
                self.weight.add_(1.0)
        finally:
            self.busy.release()


def trainer_for(model: nn.Module) -> ExternalTrainer:
    return ExternalTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))


def run_driver(trainer: ExternalTrainer, phases: list[int], results: list, between=None) -> threading.Thread:
    """The node's side: ``train_phase`` for each phase length, ``between`` at each boundary."""
    def drive() -> None:
        for steps in phases:
            stats = trainer.train_phase(steps, lambda: False,
                                        lambda done, loss: trainer.model.touch("node"))  # type: ignore[operator]
            results.append(stats)
            if between is not None:
                between()
        trainer.handoff.close("the node stopped")

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    return thread


def test_the_user_and_the_node_take_turns_and_phases_count_the_steps_reported():
    model = Touches()
    trainer = trainer_for(model)
    results: list = []
    driver = run_driver(trainer, [3, 2], results, between=lambda: model.touch("boundary"))
    trainer.handoff.wait_started(driver.is_alive)
    with pytest.raises(SwarmStopped, match="the node stopped"):
        for step in range(10):
            model.touch("user")
            trainer.handoff.report(tokens=10 * (step + 1), loss=float(step))
    driver.join(JOIN)
    assert model.overlaps == 0
    # Each user step is followed by the node's on_step, a boundary after each phase of 3 and 2;
    # the 6th step() waited for a phase that never came and raised.
    assert model.log == ["user", "node"] * 3 + ["boundary"] + ["user", "node"] * 2 + ["boundary"]
    assert [(s.steps, s.tokens, s.mean_loss) for s in results] == [(3, 60, 1.0), (2, 90, 3.5)]
    assert trainer.inner_steps_done == 5


def test_leaving_ends_the_phase_with_the_steps_taken_and_a_closed_node_never_hangs_a_step():
    model = Touches()
    trainer = trainer_for(model)
    results: list = []
    driver = run_driver(trainer, [50], results)
    trainer.handoff.wait_started(driver.is_alive)
    trainer.handoff.report(tokens=1, loss=math.nan)
    trainer.handoff.leave()  # the user's `with` block ends in the middle of the phase
    driver.join(JOIN)
    assert not driver.is_alive() and results[0].steps == 1 and math.isnan(results[0].mean_loss)
    with pytest.raises(SwarmStopped):
        trainer.handoff.report(tokens=1, loss=0.0)


def test_a_node_that_dies_during_start_up_is_reported_to_the_waiting_user():
    trainer = trainer_for(Touches())
    dead = threading.Thread(target=lambda: trainer.handoff.close("refused by the swarm: [model] kind differs"))
    dead.start()
    dead.join(JOIN)
    with pytest.raises(SwarmStopped, match="refused by the swarm"):
        trainer.handoff.wait_started(dead.is_alive)
    # A thread that ended without a word is noticed too.
    silent = trainer_for(Touches())
    gone = threading.Thread(target=lambda: None)
    gone.start()
    gone.join(JOIN)
    with pytest.raises(SwarmStopped, match="during start-up"):
        silent.handoff.wait_started(gone.is_alive)


def test_params_cross_as_one_flat_float32_vector_in_parameter_order():
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    trainer = trainer_for(model)
    flat = torch.arange(trainer.numel, dtype=torch.float32)
    trainer.set_params(flat)
    assert torch.equal(model[0].weight.detach().flatten(), flat[:6]) and model[1].bias.item() == flat[-1]
    flat[0] = 99.0  # the node's vector stays its own: the model holds a copy
    assert model[0].weight[0, 0].item() == 0.0
    trainer.add_to_slice(slice(0, 2), torch.ones(2))
    assert trainer.get_params()[:3].tolist() == [1.0, 2.0, 2.0]
    trainer.set_params_slice(slice(10, 11), torch.tensor([-1.0]))
    assert model[1].bias.item() == -1.0
    with pytest.raises(lowcomm.node.models.ModelError, match="float32"):
        trainer_for(nn.Linear(2, 2).half())


def test_inner_optimizer_state_round_trips_through_local_state():
    model = nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    trainer = ExternalTrainer(model, optimizer)
    state = trainer.local_state()
    other_model = nn.Linear(4, 1)
    other = ExternalTrainer(other_model, torch.optim.AdamW(other_model.parameters(), lr=0.1))
    other.load_local_state(state)
    moments = other.optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(moments, optimizer.state_dict()["state"][0]["exp_avg"])
    with pytest.raises(lowcomm.node.models.ModelError, match="does not fit"):
        ExternalTrainer(nn.Linear(4, 1), torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)).load_local_state(state)


# -- config and model checks --------------------------------------------------------------------


def test_config_mistakes_come_out_as_one_readable_error(tmp_path):
    model = nn.Linear(2, 2)
    with pytest.raises(SwarmError, match=r"unknown key 'inner_step' in \[train\]"):
        resolve_config({"train": {"inner_step": 5}}, None, model)
    with pytest.raises(SwarmError, match=r"\[sync\] codec = 'int3' is invalid"):
        resolve_config({"sync": {"codec": "int3"}}, None, model)
    with pytest.raises(SwarmError, match="does not exist"):
        resolve_config(tmp_path / "missing.toml", None, model)
    toml = tmp_path / "run.toml"
    toml.write_text('[train]\ninner_steps = 7\n[node]\ngrpc_port = 7777\n')
    resolved = resolve_config(str(toml), ["/ip4/127.0.0.1/tcp/1/p2p/QmX"], model)
    assert resolved.train.inner_steps == 7 and resolved.node.peers == ["/ip4/127.0.0.1/tcp/1/p2p/QmX"]
    assert (resolved.node.grpc_port, resolved.node.dht_port, resolved.node.metrics_port) == (7777, 0, 0)
    # A Config object keeps what it set; the API's free ports fill in the rest.
    given = load_config(overrides=["train.inner_steps=9"], environ={})
    assert resolve_config(given, None, model).train.inner_steps == 9


def test_errors_name_the_config_key_or_argument_not_the_clis_flags(tmp_path):
    # The node's own checks said "choose another with --checkpoint-dir (or LOWCOMM_CHECKPOINT_DIR)"
    # and "invalid --peers multiaddr": a Swarm reads neither flags nor variables.
    model = nn.Linear(2, 2)
    (tmp_path / "a-file").write_text("")
    swarm = lowcomm.Swarm(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          config={"node": {"checkpoint_dir": str(tmp_path / "a-file")}})
    with pytest.raises(SwarmError) as err:
        swarm.__enter__()
    assert "[node] checkpoint_dir" in str(err.value) and "--" not in str(err.value) and "LOWCOMM_" not in str(err.value)
    swarm = lowcomm.Swarm(model, torch.optim.SGD(model.parameters(), lr=0.1), peers=["/ip4/1.2.3/tcp/1/p2p/x"],
                          config={"node": {"checkpoint_dir": str(tmp_path / "ckpt")}})
    with pytest.raises(SwarmError, match=r"^invalid peers multiaddr /ip4/1.2.3/tcp/1/p2p/x: .*; copy a whole address "
                                         r"from a peer's swarm.multiaddrs$"):
        swarm.__enter__()


def test_without_a_model_section_the_fingerprint_covers_the_models_names_and_shapes():
    def fingerprint(model: nn.Module) -> str:
        return resolve_config({"train": {"inner_steps": 5}}, None, model).run_fingerprint()

    base = fingerprint(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
    assert fingerprint(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))) == base  # weights do not count
    assert fingerprint(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))) != base  # a shape
    renamed = nn.Sequential()
    renamed.add_module("first", nn.Linear(4, 8))
    renamed.add_module("second", nn.Linear(8, 2))
    assert fingerprint(renamed) != base  # a name
    run = resolve_config({}, None, nn.Linear(4, 8)).run_config()
    assert run["model"] == {"kind": "external", "parameters": 40, "shapes_sha256": run["model"]["shapes_sha256"]}


def test_a_model_section_keeps_the_daemons_fingerprint_and_the_model_must_match_it(tmp_path):
    transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    path = write_llama_config(tmp_path / "llama" / "config.json")
    config = {"model": {"hf_config": str(path)}, "data": {"seq_len": 64}}
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    resolved = resolve_config(config, None, llama)
    daemon = load_config(overrides=[f"model.hf_config={path}", "data.seq_len=64"], environ={})
    assert resolved.run_fingerprint() == daemon.run_fingerprint()  # lowcomm-node peers of this config join
    wider = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY_LLAMA, "intermediate_size": 96}))
    with pytest.raises(SwarmError, match=r"parameter 5 is model\.layers\.0\.mlp\.gate_proj\.weight \(96, 64\)"):
        resolve_config(config, None, wider)


def test_step_outside_the_block_and_late_load_state_dict_are_refused():
    model = nn.Linear(2, 2)
    swarm = lowcomm.Swarm(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="inside `with lowcomm.Swarm"):
        swarm.step(tokens=4)
    with pytest.raises(SwarmError, match="fingerprint differs"):
        swarm.load_state_dict({"step": 1, "params": torch.zeros(6), "momentum": torch.zeros(6),
                               "params_sha256": "0", "trainer": {}, "config_fingerprint": "another run"})
    with pytest.raises(SwarmError, match="lacks params"):
        swarm.load_state_dict({"step": 1})
    with pytest.raises(SwarmError, match=r"takes the dict Swarm.state_dict\(\) returned .*, not NoneType$"):
        swarm.load_state_dict(None)  # type: ignore[arg-type]  # was Python's TypeError
    with pytest.raises(SwarmError, match=r"^peers must be a list of multiaddrs .*, not int"):
        lowcomm.Swarm(model, torch.optim.SGD(model.parameters(), lr=0.1), peers=1234)  # type: ignore[arg-type]
    with pytest.raises(SwarmError, match="torch.optim.Optimizer"):
        lowcomm.Swarm(model, "adam")  # type: ignore[arg-type]


def test_closing_a_swarm_never_opened_leaves_it_to_be_opened():
    # close() marked it as left: step() then said "after the Swarm was left (closed)" and open()
    # "a Swarm can be entered (opened) once", of a Swarm that never was.
    model = nn.Linear(2, 2)
    swarm = lowcomm.Swarm(model, torch.optim.SGD(model.parameters(), lr=0.1))
    swarm.close()
    swarm.close()
    with pytest.raises(SwarmError, match=r"Swarm.step\(\) needs an open Swarm"):
        swarm.step()
    assert not swarm._exited  # open() may still follow


def test_model_and_optimizer_mistakes_are_swarm_errors_before_anything_starts():
    def swarm(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> lowcomm.Swarm:
        optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1)
        return lowcomm.Swarm(model, optimizer)

    with pytest.raises(SwarmError, match="torch.float16 parameters"):
        swarm(nn.Linear(2, 2).half())
    with pytest.raises(SwarmError, match="no parameters to train"):
        swarm(nn.Identity(), torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))
    with pytest.raises(SwarmError, match="meta device"):
        swarm(nn.Linear(2, 2, device="meta"))
    with pytest.raises(SwarmError, match="inner_optimizer holds none of the model's parameters"):
        swarm(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    partly_frozen = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    swarm(partly_frozen, torch.optim.SGD(partly_frozen[1].parameters(), lr=0.1))  # a subset is fine
    model = nn.Linear(2, 2)
    with pytest.raises(SwarmError, match="eval_fn must be a function of the model .*, not float"):
        lowcomm.Swarm(model, torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=3.0)  # type: ignore[arg-type]
