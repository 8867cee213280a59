"""``lowcomm.Swarm`` in real swarms on loopback: the example script as two processes (one params
hash per step, then a resume from its checkpoint), the LoRA example as two processes (the adapters
alone averaged) beside a third of another base (refused), and an API peer in this process averaging
with a ``lowcomm-node`` daemon peer in overlapped rounds (catch-up before the first step, state_dict/load_state_dict,
nothing left running after the block, an eval_fn on a replica).
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from torch.nn.utils import parameters_to_vector

from lowcomm.node.localswarm import NodeProcess
from lowcomm.protocol.state import params_sha256

from .conftest import session_processes
from .hf_assets import write_byte_tokens, write_llama_config

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_hf.py"
MAX_STEPS = 200  # inner steps the API peer takes at most to see its two rounds with the daemon
WAIT = 120  # start-up (torch, transformers, hivemind) and a few rounds on a loaded 2-core machine


def example(swarm, name: str, workdir: Path, *args: str, script: Path = EXAMPLE) -> NodeProcess:
    """examples/train_hf.py (or ``script``) as one peer; registered with the ``swarm`` fixture, which kills it."""
    command = [sys.executable, str(script), "--checkpoint-dir", str(workdir / name), *args]
    node = NodeProcess(name, [], command=command, env={"OMP_NUM_THREADS": "1"})
    swarm.nodes.append(node)
    return node


def hashes(node: NodeProcess, group_size: int = 1) -> dict[int, str]:
    return {e["outer_step"]: e["params_sha256"] for e in node.rounds() if e["group_size"] >= group_size}


def nothing_left_in_session(node: NodeProcess) -> bool:
    """No process of the peer's session (its DHT process, p2pd) outlived it."""
    return session_processes(node.proc.pid) == []


def test_the_example_as_two_processes_agrees_per_step_and_resumes_from_its_checkpoint(swarm, tmp_path):
    first = example(swarm, "peer-0", tmp_path, "--min-peers", "2", "--steps", "30")
    maddr = first.wait_event("example_ready", WAIT)["multiaddrs"][0]
    second = example(swarm, "peer-1", tmp_path, "--min-peers", "2", "--steps", "30", "--peers", maddr)
    assert first.wait_exit(WAIT) == 0 and second.wait_exit(WAIT) == 0
    ours, theirs = hashes(first, 2), hashes(second, 2)
    # 30 inner steps at H = 10: three rounds, all of both peers, one params hash per step.
    assert sorted(ours) == [1, 2, 3] and ours == theirs
    assert nothing_left_in_session(first) and nothing_left_in_session(second)

    # Run again from the same checkpoint directory: it resumes at step 3 with step 3's hash (the
    # stop folded the local progress into the residual) and goes on from there.
    again = example(swarm, "peer-0", tmp_path, "--steps", "40")
    resumed = again.wait_event("resumed", WAIT)
    assert (resumed["outer_step"], resumed["params_sha256"]) == (3, ours[3])
    assert again.wait_exit(WAIT) == 0
    assert sorted(hashes(again)) == [4]  # the inner step count came back too: 10 more steps, one round
    assert again.wait_event("example_done", 1)["outer_step"] == 4


LORA = REPO / "examples" / "finetune_lora.py"


@pytest.mark.slow
def test_the_lora_example_averages_the_adapters_alone_and_refuses_a_peer_of_another_base(swarm, tmp_path):
    first = example(swarm, "peer-0", tmp_path, "--min-peers", "2", "--steps", "30", script=LORA)
    ready = first.wait_event("example_ready", WAIT)
    maddr = ready["multiaddrs"][0]
    assert (ready["trainable"], ready["frozen"]) == (2048, 115008)
    # Another base (the seed that stands in for loading it): refused, and told what to do.
    other = tmp_path / "other_base.py"
    source = LORA.read_text()
    assert source.count("torch.manual_seed(0)  # stands in") == 1
    other.write_text(source.replace("torch.manual_seed(0)  # stands in", "torch.manual_seed(1)  # stands in"))
    refused = subprocess.run([sys.executable, str(other), "--peers", maddr, "--checkpoint-dir", str(tmp_path / "other")],
                             capture_output=True, text=True, timeout=WAIT, stdin=subprocess.DEVNULL,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(LORA.parent)})
    assert refused.returncode == 1
    assert "[model] frozen_sha256:" in refused.stderr and "load the same base weights" in refused.stderr, \
        refused.stderr[-2000:]
    second = example(swarm, "peer-1", tmp_path, "--min-peers", "2", "--steps", "30", "--peers", maddr, script=LORA)
    assert first.wait_exit(WAIT) == 0 and second.wait_exit(WAIT) == 0
    ours, theirs = hashes(first, 2), hashes(second, 2)
    assert sorted(ours) == [1, 2, 3] and ours == theirs
    for event in first.rounds():  # a round carries the adapters' Δ only: 2,048 int8 values and their scales
        assert event["numel"] == 2048 and event["bytes_sent"] < 4096, event


def build_llama(config_json: Path) -> torch.nn.Module:
    """The user's own model from the run's config.json (what lowcomm-node builds, unwrapped)."""
    config = transformers.AutoConfig.for_model(**json.loads(config_json.read_text()))
    return transformers.AutoModelForCausalLM.from_config(config)


class Events(logging.Handler):
    """The node's structured events (``round_done``, ``resumed``...) in this process."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "event", None):
            self.events.append(dict(record.__dict__))


@pytest.fixture
def events():
    handler = Events()
    logger = logging.getLogger("lowcomm")
    level = logger.level
    logger.setLevel(logging.INFO)  # the events are INFO records; the root logger's level would drop them
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_an_api_peer_and_a_daemon_peer_average_together(swarm, tmp_path, events):
    import lowcomm

    llama = write_llama_config(tmp_path / "llama" / "config.json")
    tokens = write_byte_tokens(tmp_path / "train.bin", 200_000)
    run = {"model": {"hf_config": str(llama)},
           "data": {"format": "tokens", "path": str(tokens), "seq_len": 64, "eval_batches": 2},
           "train": {"inner_steps": 10, "batch_size": 8, "lr": 3e-3, "warmup_steps": 0},
           # Overlapped: the round runs while the API user's loop trains on (the example covers blocking rounds).
           "sync": {"group_size": 2, "matchmaking_timeout": 15, "reduce_timeout": 8, "overlap": "delayed"}}
    toml = tmp_path / "run.toml"
    toml.write_text("".join(f"[{section}]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in body.items())
                            for section, body in run.items()))
    daemon = swarm.start(0, extra=["--config", str(toml), "--set", "node.heartbeat_interval=1"], fast=False)

    # The API peer (built while the daemon starts): the same model, built by the user from the
    # same config.json.
    torch.manual_seed(1)  # other initial weights than the daemon's: the catch-up replaces them
    model = build_llama(llama)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.from_numpy(np.fromfile(tokens, dtype=np.uint16).astype(np.int64))
    node = {"host": "127.0.0.1", "checkpoint_dir": str(tmp_path / "api"), "heartbeat_interval": 1, "grace_period": 10}
    maddr = daemon.multiaddr
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    held_out = data[-65 * 4:].view(4, 65)

    def eval_fn(replica) -> float:
        return replica(input_ids=held_out, labels=held_out).loss.item()

    with lowcomm.Swarm(model, optimizer, config={**run, "node": node}, peers=[maddr], eval_fn=eval_fn,
                       log=False) as api:
        # Joined and caught up before the first step: the model holds the swarm's θ_global.
        assert params_sha256(parameters_to_vector(model.parameters()).detach()) == api.status()["params_sha256"]
        assert api.status()["swarm_peers"] == 2
        for wrong in (0.5, 0, True, torch.tensor(2.0)):  # a fraction was truncated to a weight of 0
            with pytest.raises(ValueError, match="positive whole number"):
                api.step(tokens=wrong)
        with pytest.raises(ValueError, match=r"loss must be the step's scalar loss, got a tensor of shape \(2,\)"):
            api.step(tokens=1, loss=torch.ones(2))
        for _ in range(MAX_STEPS):  # bounded: a failure must not train forever
            if len([e for e in events.events if e["event"] == "round_done" and e["group_size"] == 2]) >= 2:
                break
            starts = torch.randint(len(data) - 65, (8,))
            batch = torch.stack([data[s:s + 65] for s in starts])
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            api.step(tokens=torch.ones_like(batch).sum(), loss=loss)  # an integer tensor, as attention_mask.sum()
    ours = {e["outer_step"]: e["params_sha256"] for e in events.events
            if e["event"] == "round_done" and e["group_size"] == 2}
    for step, digest in ours.items():
        event = daemon.wait_for(lambda e: e.get("event") == "round_done" and e.get("outer_step") == step, WAIT)
        assert event["params_sha256"] == digest and event["group_size"] == 2, f"step {step}"

    # After the block: the node stopped cleanly, nothing of it runs, the model holds θ_global.
    assert not [t.name for t in threading.enumerate() if t.name.startswith("lowcomm")]
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in children_before]
    assert not [(p.pid, p.name(), p.status()) for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    # eval_fn ran on the starting model and on a replica for every committed θ_global.
    assert math.isfinite(next(e for e in events.events if e["event"] == "node_ready")["eval_loss"])
    assert all(math.isfinite(e["eval_loss"]) for e in events.events if e["event"] == "round_done")
    state = api.state_dict()
    last = max(ours)
    assert state["step"] == last and state["params_sha256"] == ours[last]
    assert params_sha256(parameters_to_vector(model.parameters()).detach()) == ours[last]
    assert state["trainer"]["optimizer"]["state"]  # the inner AdamW moments are in it

    # load_state_dict: a new peer (empty checkpoint directory, alone) resumes from that state.
    fresh = build_llama(llama)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=3e-3)
    other = lowcomm.Swarm(fresh, fresh_optimizer, log=False,
                          config={**run, "node": {**node, "checkpoint_dir": str(tmp_path / "b")}})
    other.load_state_dict(state)
    with other:
        assert other.outer_step == last
        assert params_sha256(parameters_to_vector(fresh.parameters()).detach()) == ours[last]
        moments = fresh_optimizer.state_dict()["state"][0]["exp_avg"]
        assert torch.equal(moments, state["trainer"]["optimizer"]["state"][0]["exp_avg"])

    # A peer whose model the run's [model] does not describe (no [model] section: the fingerprint
    # names its own model) is refused by the daemon's swarm, with the difference, before any step.
    small = torch.nn.Linear(8, 8)
    stranger = lowcomm.Swarm(small, torch.optim.SGD(small.parameters(), lr=0.1), peers=[maddr], log=False,
                             config={"train": run["train"], "sync": run["sync"], "data": {"seq_len": 64},
                                     "node": {**node, "checkpoint_dir": str(tmp_path / "stranger")}})
    with pytest.raises(lowcomm.SwarmError, match=r"refused by the swarm: .*\[model\] kind"):
        with stranger:
            pytest.fail("a refused peer must not get to its first step")
