"""Multi-process swarms of the model and data plug-ins through the real CLI on loopback.

Two swarms only (they are the slow part): a Hugging Face Llama trained by three peers from a local
config.json on a memory-mapped tokens file, with a fourth peer of another model refused on both
sides; and a factory model with gradient accumulation on jsonl text through a tokenizer.json
trained here.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from lowcomm.node.localswarm import node_command

from .hf_assets import stdlib_text, train_tokenizer, write_byte_tokens, write_llama_config

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # make test-slow: make test stays under 15 min

ROUND_WAIT = 120  # one round on a loaded 2-core machine, model import and build included
REPO = Path(__file__).resolve().parents[1]
LIGHT = ["--set", "data.seq_len=64", "--set", "data.eval_batches=2", "--set", "train.warmup_steps=0"]


def group_rounds(node, size: int) -> list[dict]:
    return [e for e in node.rounds() if e["group_size"] >= size]


def hash_at(node, step: int) -> str:
    event = node.wait_for(lambda e: e.get("event") in ("round_done", "state_downloaded")
                          and e.get("outer_step") == step, ROUND_WAIT)
    return event["params_sha256"]


def first_event(nodes, predicate, timeout: float = ROUND_WAIT) -> dict:
    """The first event matching ``predicate`` on any of ``nodes`` (each is polled for a second in turn)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for node in nodes:
            try:
                return node.wait_for(predicate, 1)
            except TimeoutError:
                continue
    raise TimeoutError(f"no node logged the expected event within {timeout:.0f}s")


def test_three_peers_train_a_llama_from_config_json_on_tokens_and_refuse_another_model(swarm, tmp_path):
    config = write_llama_config(tmp_path / "llama" / "config.json")
    tokens = write_byte_tokens(tmp_path / "data" / "train.bin", 1_000_000)
    run = [*LIGHT, "--set", f"model.hf_config={config}", "--set", "data.format=tokens",
           "--set", f"data.path={tokens}", "--set", "train.lr=3e-3", "--set", "sync.group_size=3",
           "--set", "train.inner_steps=10"]
    first = swarm.start(0, extra=run)
    initial_eval = first.ready(ROUND_WAIT)["eval_loss"]
    trio = [first, *(swarm.start(i, [first.multiaddr], extra=run) for i in (1, 2))]

    # Three rounds of all three, one params hash per step.
    trio[1].wait_for(lambda e: e.get("event") == "round_done" and len(group_rounds(trio[1], 3)) >= 3,
                     ROUND_WAIT * 4)
    for event in group_rounds(trio[1], 3)[:3]:
        step = event["outer_step"]
        assert {hash_at(node, step) for node in trio} == {event["params_sha256"]}, f"hashes differ at step {step}"
    assert first.rounds()[-1]["eval_loss"] < initial_eval

    # `lowcomm-node export` of a running peer's newest checkpoint: the swarm's θ_global of that
    # step, which from_pretrained loads.
    out = tmp_path / "exported"
    done = subprocess.run([*node_command(), "export", "--checkpoint-dir", str(swarm.workdir / "peer-1"),
                           "--out", str(out), *run], capture_output=True, text=True, timeout=ROUND_WAIT)
    assert done.returncode == 0, done.stderr
    about = json.loads((out / "lowcomm.json").read_text())
    assert about["params_sha256"] == hash_at(trio[1], about["outer_step"])
    from transformers import AutoModelForCausalLM
    from torch.nn.utils import parameters_to_vector

    from lowcomm.protocol.snapshot import params_sha256

    loaded = parameters_to_vector(AutoModelForCausalLM.from_pretrained(out).parameters()).detach()
    assert params_sha256(loaded) == about["params_sha256"]

    # A peer whose config.json has one more layer is refused, and both sides say what differs.
    other = write_llama_config(tmp_path / "other" / "config.json", num_hidden_layers=3)
    stranger = swarm.start(3, [first.multiaddr], extra=[*run, "--set", f"model.hf_config={other}"])
    assert stranger.wait_exit(ROUND_WAIT) != 0
    error = next(line for line in stranger.raw_lines if line.startswith("lowcomm-node: error:"))
    assert "refused by the swarm" in error and "[hf_config] num_hidden_layers" in error, error
    assert "Traceback" not in "\n".join(stranger.raw_lines)
    # The peer it asked (any of the three) logged the refusal with the same difference.
    assert "[hf_config] num_hidden_layers" in first_event(trio, lambda e: "refused" in e.get("msg", ""))["msg"]


def test_a_factory_model_trains_on_jsonl_through_a_trained_tokenizer(swarm, tmp_path):
    pytest.importorskip("tokenizers", reason="the hf extra (tokenizers) is not installed")
    text = stdlib_text(400_000).decode()
    documents = [text[i:i + 2000] for i in range(0, len(text), 2000)]
    tokenizer = train_tokenizer(tmp_path / "tokenizer.json", documents, vocab_size=320)
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"content": doc}) + "\n" for doc in documents))
    run = [*LIGHT, "--set", "model.factory=tests.factory_model:build_pair",
           "--set", "model.factory_kwargs={ vocab_size = 320, width = 32 }", "--set", "train.lr=1e-2",
           "--set", "data.format=jsonl", "--set", f"data.path={corpus}", "--set", "data.field=content",
           "--set", f"data.tokenizer={tokenizer}", "--set", "sync.group_size=2", "--set", "train.micro_batches=2"]
    env = {"PYTHONPATH": str(REPO)}  # the factory module lives in tests/
    first = swarm.start(0, extra=run, env=env)
    initial_eval = first.ready(ROUND_WAIT)["eval_loss"]
    second = swarm.start(1, [first.multiaddr], extra=run, env=env)
    second.wait_for(lambda e: e.get("event") == "round_done" and len(group_rounds(second, 2)) >= 2, ROUND_WAIT * 3)
    for event in group_rounds(second, 2)[:2]:
        assert hash_at(first, event["outer_step"]) == event["params_sha256"]
    assert first.rounds()[-1]["eval_loss"] < initial_eval
    # Gradient accumulation counts every micro-batch: tokens come in steps of 2 × 4 × 64 (FAST's batch_size 4).
    assert all(e["tokens_total"] > 0 and e["tokens_total"] % (2 * 4 * 64) == 0 for e in first.rounds())


@pytest.mark.parametrize("factory, message", [
    ("no_such_package.models:build", "cannot import no_such_package.models"),
    # A module whose forward takes only the inputs, returned without its loss function: named
    # before the node starts, not a TypeError traceback from inside the user's class.
    ("tests.factory_model:build_logits_only", "the module's forward(inputs) cannot be called as (inputs, targets)"),
])
def test_a_factory_that_cannot_be_used_ends_the_node_with_one_line(tmp_path, factory, message):
    cmd = [*node_command(), "join", "--host", "127.0.0.1", "--dht-port", "0", "--grpc-port", "0",
           "--metrics-port", "0", "--checkpoint-dir", str(tmp_path / "ckpt"), "--log-format", "json",
           "--set", f"model.factory={factory}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(REPO)})  # the factory module lives in tests/
    errors = [line for line in result.stderr.splitlines() if line.startswith("lowcomm-node: error:")]
    assert result.returncode != 0 and "Traceback" not in result.stderr + result.stdout
    assert len(errors) == 1 and message in errors[0], result.stderr


def test_a_node_trains_on_a_hugging_face_dataset_saved_to_disk(tmp_path):
    """`[data] format = "hf"` through the CLI: one node (solo steps) on a `save_to_disk` directory,
    one round, eval and tokens reported, exit 0."""
    datasets = pytest.importorskip("datasets", reason="the hf extra (datasets) is not installed")
    path = tmp_path / "dataset"
    text = stdlib_text(200_000).decode("utf-8", errors="replace")
    documents = [text[i:i + 2000] for i in range(0, len(text), 2000)]
    datasets.Dataset.from_dict({"text": documents}).save_to_disk(str(path))
    cmd = [*node_command(), "join", "--host", "127.0.0.1", "--dht-port", "0", "--grpc-port", "0",
           "--metrics-port", "0", "--checkpoint-dir", str(tmp_path / "ckpt"), "--log-format", "json",
           "--torch-threads", "1", "--max-rounds", "1", *LIGHT, "--set", "model.preset=tiny",
           "--set", "train.inner_steps=5", "--set", "train.batch_size=4",
           "--set", "data.format=hf", "--set", f"data.path={path}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    rounds = [e for e in events if e.get("event") == "round_done"]
    assert rounds and rounds[0]["tokens_total"] == 5 * 4 * 64, rounds
    assert rounds[0]["eval_loss"] is not None  # a number, not NaN (null in JSON)
