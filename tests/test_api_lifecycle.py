"""``lowcomm.Swarm`` before, across and after its start: a checkpoint written for another model or
run config (node/restore.py), the checkpoint folder a failed start made, what its members say
before it is open, and checkpoint files read by path (node/checkpoint.py).

The scripts run in their own process (one open Swarm per process; a few seconds each); the rest
needs no sockets.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import lowcomm
from lowcomm.api_config import SwarmError, resolve_config
from lowcomm.node import checkpoint, restore
from lowcomm.node.errors import FatalError
from lowcomm.node.external_trainer import ExternalTrainer
from lowcomm.node.globalstate import GlobalState

TIMEOUT = 120  # seconds: a bound on a script that only a hang reaches


def run_script(tmp_path: Path, name: str, source: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / name).write_text(source)
    return subprocess.run([sys.executable, str(tmp_path / name), *args], capture_output=True, text=True,
                          timeout=TIMEOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=subprocess.DEVNULL)


# -- a Swarm resuming a checkpoint of another model or run config ------------------------------------


def mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 1))


def save_swarm_checkpoint(model: nn.Module, config: dict) -> None:
    """The checkpoint a Swarm of ``model`` and ``config`` writes (as its node's restore.save does)."""
    swarm_config = resolve_config(config, None, model)
    params = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    state = GlobalState.fresh(params, swarm_config.sync.outer_lr, swarm_config.sync.outer_momentum)
    trainer = ExternalTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    restore.save(swarm_config, state.to_checkpoint(), trainer.local_state(), tokens_total=0)


def restore_in_swarm(model: nn.Module, config: dict) -> str:
    """The FatalError message of the node of a Swarm of ``model`` and ``config`` as it restores."""
    swarm_config = resolve_config(config, None, model)
    with pytest.raises(FatalError) as info:
        restore.restore(swarm_config, ExternalTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1)))
    return str(info.value)


def test_a_swarm_whose_model_changed_since_its_checkpoint_is_told_the_parameter_counts(tmp_path):
    config = {"train": {"inner_steps": 10}, "node": {"checkpoint_dir": str(tmp_path)}}
    save_swarm_checkpoint(mlp(32), config)
    [written] = checkpoint.list_checkpoints(tmp_path)
    before = written.read_bytes()
    message = restore_in_swarm(mlp(48), config)
    # It said "written by a lowcomm.Swarm script for a model of its own, which lowcomm-node cannot
    # build": the message for the daemon, to a script that wrote the checkpoint itself.
    assert message == (f"a checkpoint in {tmp_path} was written for another model or run config (the checkpoint's "
                       f"model has 577 parameters, this one 865); resume with the model and config that wrote it, "
                       f"or use another --checkpoint-dir")
    assert written.read_bytes() == before  # left as it was
    # Same count, other shapes: said as such, not as two digests.
    other = tmp_path / "same-count"
    save_swarm_checkpoint(nn.Linear(3, 4), {"node": {"checkpoint_dir": str(other)}})  # 12 + 4 parameters
    message = restore_in_swarm(nn.Linear(7, 2), {"node": {"checkpoint_dir": str(other)}})  # 14 + 2
    assert "(the checkpoint's model has other parameter names or shapes (16 parameters, as this one))" in message
    assert "lowcomm-node" not in message and "shapes_sha256" not in message


def test_a_swarm_whose_run_config_changed_since_its_checkpoint_is_told_which_key(tmp_path):
    save_swarm_checkpoint(mlp(32), {"train": {"inner_steps": 10}, "node": {"checkpoint_dir": str(tmp_path)}})
    message = restore_in_swarm(mlp(32), {"train": {"inner_steps": 20}, "node": {"checkpoint_dir": str(tmp_path)}})
    assert message == (f"a checkpoint in {tmp_path} was written for another model or run config ([train] "
                       f"inner_steps: checkpoint 10, now 20); resume with the model and config that wrote it, or "
                       f"use another --checkpoint-dir")
    # Both at once: each is named.
    message = restore_in_swarm(mlp(48), {"train": {"inner_steps": 20}, "node": {"checkpoint_dir": str(tmp_path)}})
    assert ("(the checkpoint's model has 577 parameters, this one 865; [train] inner_steps: checkpoint 10, now 20)"
            in message)


def test_a_swarm_of_its_own_model_meeting_a_daemons_checkpoint_is_told_so(tmp_path):
    from lowcomm.node.config import load_config

    daemon = load_config(overrides=["model.preset=tiny", f"node.checkpoint_dir={tmp_path}"], environ={})
    state = GlobalState.fresh(torch.zeros(10), daemon.sync.outer_lr, daemon.sync.outer_momentum)
    restore.save(daemon, state.to_checkpoint(), {"sampler_shard": 0}, tokens_total=0)
    message = restore_in_swarm(mlp(32), {"node": {"checkpoint_dir": str(tmp_path)}})
    assert message.startswith(f"a checkpoint in {tmp_path} was written for another model or run config (the "
                              f"checkpoint's model is the config's [model] section, this one the script's own (no "
                              f"[model] section)"), message
    assert "lowcomm-node cannot build" not in message and "[train] inner_steps: checkpoint 50, now 50" not in message


CHANGED = textwrap.dedent("""
    import sys, torch, torch.nn as nn, lowcomm
    width, inner_steps = int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    config = {"train": {"inner_steps": inner_steps}, "node": {"host": "127.0.0.1", "checkpoint_dir": sys.argv[1]}}
    try:
        with lowcomm.Swarm(model, optimizer, config=config, log=False) as swarm:
            for _ in range(inner_steps):
                loss = model(torch.randn(8, 16)).pow(2).mean()
                loss.backward(); optimizer.step(); optimizer.zero_grad()
                swarm.step(tokens=8, loss=loss)
    except lowcomm.SwarmError as err:
        print("SwarmError:", err, flush=True)
        sys.exit(3)
    print("outer step", swarm.outer_step, flush=True)
""")


@pytest.mark.multiprocess
def test_a_swarm_script_rerun_with_another_model_or_config_says_what_differs_and_keeps_its_checkpoint(tmp_path):
    folder = tmp_path / "ckpt"
    first = run_script(tmp_path, "changed.py", CHANGED, str(folder), "32", "10")
    assert first.returncode == 0 and "outer step 1" in first.stdout, first.stderr[-2000:]
    kept = {path.name: path.read_bytes() for path in checkpoint.list_checkpoints(folder)}
    assert kept
    wider = run_script(tmp_path, "changed.py", CHANGED, str(folder), "48", "10")
    assert wider.returncode == 3, wider.stderr[-2000:]
    assert wider.stdout.splitlines() == [
        f"SwarmError: a checkpoint in {folder} was written for another model or run config (the checkpoint's model "
        f"has 577 parameters, this one 865); resume with the model and config that wrote it, or use another "
        f"[node] checkpoint_dir"]
    longer = run_script(tmp_path, "changed.py", CHANGED, str(folder), "32", "20")
    assert longer.returncode == 3, longer.stderr[-2000:]
    assert "([train] inner_steps: checkpoint 10, now 20); resume with the model and config" in longer.stdout
    # A failed start in a folder that holds checkpoints leaves it as it was.
    assert {path.name: path.read_bytes() for path in checkpoint.list_checkpoints(folder)} == kept
    assert "Traceback" not in wider.stdout + wider.stderr + longer.stdout + longer.stderr


# -- a failed start leaves no folder it made --------------------------------------------------------


FAILS_TO_OPEN = textwrap.dedent("""
    import os, sys, torch, torch.nn as nn, lowcomm
    base = sys.argv[1]
    nobody = "/ip4/127.0.0.1/tcp/9/p2p/QmXbRMyETbuiU1CjR7iKZ5u2uXxxQsZ5JXrsHtJGc9HsvS"

    def eval_bug(model):
        raise ValueError("my eval bug")

    cases = [("unanswered", {"peers": [nobody]}), ("hello", {"peers": "hello"}), ("eval", {"eval_fn": eval_bug})]
    for name, kwargs in cases:
        for where in ("new/nested", "existing"):  # a folder open() makes, and one that was there
            folder = os.path.join(base, name, where)
            model = nn.Linear(4, 1)
            config = {"train": {"inner_steps": 2}, "node": {"host": "127.0.0.1", "checkpoint_dir": folder}}
            swarm = lowcomm.Swarm(model, torch.optim.SGD(model.parameters(), lr=0.1), config=config, log=False,
                                  **kwargs)
            try:
                if where == "new/nested":
                    swarm.open()
                else:
                    with swarm:
                        pass
            except lowcomm.SwarmError as err:
                print(name, where, "SwarmError:", str(err).splitlines()[0], flush=True)
            try:
                swarm.open()
            except Exception as err:
                print(name, where, "again:", type(err).__name__, err, flush=True)
""")


@pytest.mark.multiprocess
def test_a_failed_open_removes_the_checkpoint_folder_it_made_and_leaves_one_that_was_there(tmp_path):
    for name in ("unanswered", "hello", "eval"):
        (tmp_path / name / "existing").mkdir(parents=True)
        (tmp_path / name / "existing" / "notes.txt").write_text("mine")
    result = run_script(tmp_path, "fails.py", FAILS_TO_OPEN, str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    for name, why in [("unanswered", "none of the peers answered"), ("hello", "invalid"),
                      ("eval", "eval_fn raised ValueError: my eval bug")]:
        # The folder (with .lock and identity.key) was left behind, and its parent with it.
        assert sorted(path.name for path in (tmp_path / name).iterdir()) == ["existing"], name
        # A folder that was there stays, with what it held (the start's .lock and identity too).
        assert (tmp_path / name / "existing" / "notes.txt").read_text() == "mine"
        for where in ("new/nested", "existing"):
            assert any(line.startswith(f"{name} {where} SwarmError: {why}") for line in lines), (name, lines)
            # Opening the same Swarm again is refused (it was a RuntimeError, or, when the DHT had
            # not started, a node started that leaving the block no longer stopped).
            assert (f"{name} {where} again: SwarmError a Swarm can be entered (opened) once; make a new "
                    f"lowcomm.Swarm to join again") in lines


FAILS_AFTER_OPEN = textwrap.dedent("""
    import errno, os, sys, torch, torch.nn as nn, lowcomm
    from lowcomm.node import restore

    def no_space(*args, **kwargs):  # every checkpoint write fails, the one at the stop too
        raise OSError(errno.ENOSPC, "No space left on device")

    restore.save = no_space
    folder = os.path.join(sys.argv[1], "new", "nested")
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"train": {"inner_steps": 50}, "node": {"host": "127.0.0.1", "checkpoint_dir": folder}}
    try:
        with lowcomm.Swarm(model, optimizer, config=config, log=False) as swarm:
            print("open:", sorted(os.listdir(folder)), flush=True)
            for _ in range(3):
                model(torch.randn(8, 4)).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                swarm.step()
    except lowcomm.SwarmError as err:
        print("SwarmError:", str(err).splitlines()[0], flush=True)
""")


def test_a_node_that_fails_before_its_first_checkpoint_leaves_no_folder_it_made(tmp_path):
    # The folder (its lock and identity) stayed when the node failed after open().
    result = run_script(tmp_path, "fails_later.py", FAILS_AFTER_OPEN, str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert "open: ['.lock', 'identity.key']" in lines, lines
    assert any(line.startswith("SwarmError:") and "No space left on device" in line for line in lines), lines
    assert list(tmp_path.iterdir()) == [tmp_path / "fails_later.py"]


def test_a_folder_another_node_made_and_locked_meanwhile_is_left_to_it(tmp_path, monkeypatch):
    from lowcomm.node import checkpoint_dir

    folder = tmp_path / "busy"
    lock = checkpoint_dir.lock_checkpoint_dir(folder)  # another node's
    # As if the folder did not exist yet when this Swarm looked, and the other node made it just after.
    monkeypatch.setattr(checkpoint_dir, "first_missing", lambda directory: folder)
    try:
        model = nn.Linear(4, 1)
        swarm = lowcomm.Swarm(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              config={"node": {"checkpoint_dir": str(folder)}}, log=False)
        with pytest.raises(SwarmError, match=r"in use by another node .*give each node its own \[node\] checkpoint_dir"):
            swarm.open()
        assert sorted(path.name for path in folder.iterdir()) == [".lock"]  # its lock file stays
    finally:
        lock.close()


# -- before the Swarm is open ------------------------------------------------------------------------


def test_every_member_that_needs_the_node_says_how_to_open_the_swarm_before_it_is_open(tmp_path):
    model = nn.Linear(2, 2)
    swarm = lowcomm.Swarm(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          config={"node": {"checkpoint_dir": str(tmp_path / "ck")}})
    uses = {"step()": lambda: swarm.step(tokens=1), "status()": swarm.status,
            "wait_for_peers()": lambda: swarm.wait_for_peers(1), "multiaddrs": lambda: swarm.multiaddrs,
            "peer_id": lambda: swarm.peer_id, "outer_step": lambda: swarm.outer_step,
            "inner_steps": lambda: swarm.inner_steps}
    for what, use in uses.items():
        with pytest.raises(SwarmError) as info:  # was SwarmStopped, RuntimeError, or 0 (outer_step)
            use()
        assert str(info.value) == (f"Swarm.{what} needs an open Swarm: use it inside `with lowcomm.Swarm(...) as "
                                   f"swarm:`, or after swarm = lowcomm.Swarm(...).open()"), what
    assert not (tmp_path / "ck").exists()  # nothing was started, nothing made


# -- checkpoint files read by path -------------------------------------------------------------------


def test_checkpoint_functions_take_a_str_path_and_read_is_what_load_state_dict_takes(tmp_path):
    model = nn.Linear(3, 1)
    config = {"node": {"checkpoint_dir": str(tmp_path)}}
    save_swarm_checkpoint(model, config)
    folder = str(tmp_path)  # was AttributeError: 'str' object has no attribute 'is_dir'
    loaded, path = checkpoint.load_latest(folder)
    assert path == tmp_path / "step-000000000.ckpt" and loaded["step"] == 0
    assert checkpoint.list_checkpoints(folder) == [path]
    assert checkpoint.read(str(path))["params_sha256"] == loaded["params_sha256"]
    assert checkpoint.save(folder, 1, {**loaded, "step": 1}) == tmp_path / "step-000000001.ckpt"
    assert checkpoint.remove_stale_temporaries(folder) == []
    assert checkpoint.load_newest(folder, lambda payload: payload["step"])[0] == 1

    swarm = lowcomm.Swarm(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          config={"node": {"checkpoint_dir": str(tmp_path / "resumed")}})
    swarm.load_state_dict(checkpoint.read(path))  # what the message names is accepted
    with pytest.raises(SwarmError) as info:
        swarm.load_state_dict(path)  # type: ignore[arg-type]
    # It named torch.load, which cannot read a checkpoint file (its header: "invalid literal for int()").
    assert str(info.value) == ("load_state_dict takes the dict Swarm.state_dict() returned (or "
                               "lowcomm.node.checkpoint.read(path) of a checkpoint file the node wrote), not PosixPath")
