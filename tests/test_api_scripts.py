"""``lowcomm.Swarm`` in small scripts, one process each: a Swarm left open when the program ends
(opened without ``with``, never closed) is left as the ``with`` block would leave it, with nothing
left running; an ``eval_fn`` that fails costs the round its eval (nan, its traceback logged once),
never its checkpoint."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap

import pytest

from lowcomm.node.checkpoint import list_checkpoints

from .conftest import act_at_line, assert_stopped_cleanly_with_its_checkpoint, session_processes

pytestmark = pytest.mark.multiprocess

SCRIPT = textwrap.dedent("""
    import sys, torch, torch.nn as nn, lowcomm
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"train": {"inner_steps": 3}, "node": {"host": "127.0.0.1", "checkpoint_dir": sys.argv[1]}}
    swarm = lowcomm.Swarm(model, optimizer, config=config).open()  # a loop split across callbacks
    for wrong in (lambda: swarm.wait_for_peers(0), lambda: swarm.wait_for_peers(2, timeout="1"),
                  lambda: swarm.step(loss=[0.5])):  # the last two: Python's TypeError from inside lowcomm
        try:
            wrong()
        except ValueError as err:
            print("refused:", err, flush=True)
    for _ in range(7):
        x = torch.randn(32, 16)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        loss.backward(); optimizer.step(); optimizer.zero_grad()
        swarm.step(tokens=len(x), loss=loss)
    if sys.argv[2] == "close":
        swarm.close(); swarm.close()  # idempotent
        try:
            swarm.step()
        except lowcomm.SwarmStopped as err:
            print("after close:", err, flush=True)
    print("end of script", flush=True)
""")


@pytest.mark.parametrize("ending", ["forgotten", "close"])
def test_a_swarm_left_open_or_closed_by_hand_ends_the_program_with_its_checkpoint(tmp_path, ending):
    (tmp_path / "loop.py").write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "loop.py"), str(tmp_path / "ckpt"), ending],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=subprocess.DEVNULL)
    try:
        # It used to hang at exit: Python joined the node's training thread, which waited in the
        # Swarm for a step. The timeout only bounds that failure.
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    assert "end of script" in out and "Traceback" not in out + err
    assert ("the program ended inside a lowcomm.Swarm" in out) == (ending == "forgotten")
    assert "refused: count must be a whole number of peers, at least 1 (this one), got 0" in out
    assert "refused: timeout must be a number of seconds, 0 or more (None: wait as long as it takes), got '1'" in out
    assert "refused: loss must be the step's scalar loss (a number or a one-element tensor), got list [0.5]" in out
    assert ("after close: Swarm.step() after the Swarm was left (closed)" in out) == (ending == "close")
    assert "Generating new identity" not in err  # hivemind's INFO line, from its own stderr handler
    assert "stopped cleanly at outer step 2" in out  # 7 steps at H = 3: two rounds
    assert [path.name for path in list_checkpoints(tmp_path / "ckpt")][-1] == "step-000000002.ckpt"
    assert session_processes(proc.pid) == []  # nothing of the node (its DHT process, p2pd) outlived it


EVAL_FAILS = textwrap.dedent("""
    import os, sys, time, torch, torch.nn as nn, lowcomm
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"train": {"inner_steps": 3}, "node": {"host": "127.0.0.1", "checkpoint_dir": sys.argv[1]}}
    calls = []

    def eval_fn(replica):
        calls.append(1)
        if len(calls) > 1:  # the start's evaluation passes, every round's fails: a bug in the user's eval
            raise RuntimeError("my eval bug")
        return 1.0

    with lowcomm.Swarm(model, optimizer, config=config, eval_fn=eval_fn) as swarm:
        for _ in range(7):
            x = torch.randn(32, 16)
            loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            loss.backward(); optimizer.step(); optimizer.zero_grad()
            swarm.step(tokens=len(x), loss=loss)
        wanted = os.path.join(sys.argv[1], "step-000000002.ckpt")
        deadline = time.monotonic() + 60  # the report thread writes it after the round
        while not os.path.exists(wanted) and time.monotonic() < deadline:
            time.sleep(0.05)
        # The verdict is the exit code: a print could land inside a log line the node's threads
        # write to the same stdout at that moment. A crash: no stop-time checkpoint, only the rounds'.
        os._exit(9 if os.path.exists(wanted) else 8)
""")


def test_an_eval_fn_that_fails_costs_the_rounds_eval_not_its_checkpoint(tmp_path):
    (tmp_path / "loop.py").write_text(EVAL_FAILS)
    result = subprocess.run([sys.executable, str(tmp_path / "loop.py"), str(tmp_path / "ckpt")], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=subprocess.DEVNULL)
    # 8 was "not saved": the failing eval skipped the round's checkpoint write
    assert result.returncode == 9, (result.returncode, result.stderr[-2000:])
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    ready = next(line for line in lines if line.get("event") == "node_ready")
    # Others join a Swarm from their own script, not with lowcomm-node (it said `lowcomm-node join`).
    assert ready["join_command"] in [f'lowcomm.Swarm(..., peers=["{maddr}"])' for maddr in ready["multiaddrs"]]
    failures = [line for line in lines if "eval_fn raised RuntimeError: my eval bug" in line["msg"]]
    assert len(failures) == 2, failures  # both rounds' evals failed...
    assert ["my eval bug" in line.get("exc", "") for line in failures] == [True, False]  # ...its traceback once
    assert "(round of step 2; 2 rounds so far)" in failures[1]["msg"]
    step_1 = [line for line in lines if line.get("event") == "round_done" and line["outer_step"] == 1]
    assert len(step_1) == 1 and step_1[0]["eval_loss"] is None  # the round is reported, without an eval


STATE_RIGHT_AFTER_A_ROUND = textwrap.dedent("""
    import os, sys, time, torch, torch.nn as nn, lowcomm
    from lowcomm.protocol.snapshot import params_sha256
    from torch.nn.utils import parameters_to_vector
    model = nn.Linear(4, 1)
    config = {"train": {"inner_steps": 2}, "node": {"host": "127.0.0.1", "checkpoint_dir": sys.argv[1]}}
    evals, from_eval = [], []

    def eval_fn(replica):  # a slow held-out eval: the round's checkpoint is written after it
        evals.append(1)
        if len(evals) > 1:
            time.sleep(1.0)
            try:  # from the report thread: must not wait for the report it is part of
                from_eval.append(swarm.state_dict()["step"])
            except lowcomm.SwarmError:
                from_eval.append(None)  # no checkpoint on disk yet
        return 1.0

    with lowcomm.Swarm(model, torch.optim.SGD(model.parameters(), lr=0.1), config=config, eval_fn=eval_fn,
                       log=False) as swarm:
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
            swarm.step(tokens=2)
        try:
            state = swarm.state_dict()  # right after the first round
        except lowcomm.SwarmError:
            os._exit(4)  # "no checkpoint yet": the round's write was still pending
        current = params_sha256(parameters_to_vector(model.parameters()).detach())
    sys.exit(0 if (state["step"], state["params_sha256"], len(from_eval)) == (1, current, 1) else 3)
""")


def test_state_dict_right_after_a_round_waits_for_that_rounds_checkpoint(tmp_path):
    # Also called from the eval_fn, in the report thread: waiting there for the reports hung.
    (tmp_path / "state.py").write_text(STATE_RIGHT_AFTER_A_ROUND)
    result = subprocess.run([sys.executable, str(tmp_path / "state.py"), str(tmp_path / "ckpt")], capture_output=True,
                            text=True, timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])


TWO_AT_ONCE = textwrap.dedent("""
    import sys, torch, torch.nn as nn, lowcomm

    def swarm(folder):
        model = nn.Linear(4, 1)
        config = {"train": {"inner_steps": 2}, "node": {"host": "127.0.0.1", "checkpoint_dir": folder}}
        return lowcomm.Swarm(model, torch.optim.SGD(model.parameters(), lr=0.1), config=config, log=False)

    with swarm(sys.argv[1] + "/a") as first:
        try:
            with swarm(sys.argv[1] + "/b"):
                print("second entered", flush=True)
        except lowcomm.SwarmError as err:
            print("refused:", err, flush=True)
    with swarm(sys.argv[1] + "/b"):  # one after the other is fine
        print("second entered after the first left", flush=True)
""")


def test_a_second_swarm_open_at_once_in_one_process_is_refused_and_one_after_the_other_is_fine(tmp_path):
    (tmp_path / "two.py").write_text(TWO_AT_ONCE)
    # The second one's DHT process was forked while the first one's gRPC threads ran: it hung.
    result = subprocess.run([sys.executable, str(tmp_path / "two.py"), str(tmp_path)], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines() == [
        "refused: another lowcomm.Swarm is open in this process: leave it first, or run each peer in its own "
        "process (examples/launch.py starts N of them)",
        "second entered after the first left"]
    # log=False hands lowcomm's lines to the program's logging; hivemind's INFO line about the new
    # identity went to stderr by hivemind's own handler all the same.
    assert "Generating new identity" not in result.stderr


UNTIL_STOPPED = textwrap.dedent("""
    import signal, sys, torch, torch.nn as nn, lowcomm
    torch.manual_seed(0)
    if sys.argv[2] == "own-handler":  # the program's own handler is left alone
        signal.signal(signal.SIGTERM, lambda *_: print("own handler", flush=True))
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"train": {"inner_steps": 3}, "node": {"host": "127.0.0.1", "checkpoint_dir": sys.argv[1]}}
    with lowcomm.Swarm(model, optimizer, config=config) as swarm:
        while True:  # until stopped
            x = torch.randn(32, 16)
            loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            loss.backward(); optimizer.step(); optimizer.zero_grad()
            swarm.step(tokens=len(x), loss=loss)
            if sys.argv[2] == "own-handler" and swarm.outer_step >= 2:
                break
    print("after the block", flush=True)
""")


def run_until_stopped(tmp_path, mode: str, sig: int) -> tuple[int, int, str, str]:
    """UNTIL_STOPPED, sent ``sig`` once it logged its first round."""
    (tmp_path / "loop.py").write_text(UNTIL_STOPPED)
    return act_at_line([sys.executable, str(tmp_path / "loop.py"), str(tmp_path / "ckpt"), mode],
                       '"event": "round_done"', lambda proc: proc.send_signal(sig), env={"OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_leaves_the_block_as_ctrl_c_does_and_ends_the_program_quietly(tmp_path, sig):
    # A scheduler's SIGTERM (or a closed terminal's SIGHUP) ended the program at once: its progress
    # since the last round lost, no goodbye to its peers.
    pid, code, out, err = run_until_stopped(tmp_path, "default", sig)
    assert code == 128 + sig, err[-2000:]
    assert "Traceback" not in out + err and "after the block" not in out
    assert_stopped_cleanly_with_its_checkpoint(out, tmp_path / "ckpt")
    assert session_processes(pid) == []  # nothing of the node (its DHT process, p2pd) outlived it


def test_a_programs_own_stop_signal_handler_is_left_alone(tmp_path):
    _, code, out, err = run_until_stopped(tmp_path, "own-handler", signal.SIGTERM)
    assert code == 0, err[-2000:]
    assert "own handler" in out and "after the block" in out  # the loop went on to its own end


DISK_REFUSES = textwrap.dedent("""
    import json, sys, torch, torch.nn as nn, lowcomm
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"train": {"inner_steps": 3}, "node": {"host": "127.0.0.1", "checkpoint_dir": sys.argv[1]}}
    try:
        with lowcomm.Swarm(model, optimizer, config=config) as swarm:
            for _ in range(7):
                x = torch.randn(32, 16)
                loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
                loss.backward(); optimizer.step(); optimizer.zero_grad()
                swarm.step(tokens=len(x), loss=loss)
            try:
                swarm.state_dict()
            except lowcomm.SwarmError as err:
                print("state_dict:", err, flush=True)
            print("status:", json.dumps(swarm.status()["checkpoint_failure"]), flush=True)
    except lowcomm.SwarmError as err:
        print("SwarmError:", err, flush=True)
        sys.exit(3)
""")


def test_checkpoints_the_disk_refuses_are_a_swarm_error_from_state_dict_and_as_the_block_is_left(tmp_path):
    # The stop's checkpoint failed with torch's zip-writer traceback in the node's thread, and
    # leaving the block said nothing: the program went on as if its state were saved.
    def refuse_large_files() -> None:  # every checkpoint write fails, as on a full disk (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8 * 1024, 8 * 1024))

    (tmp_path / "loop.py").write_text(DISK_REFUSES)
    proc = subprocess.run([sys.executable, str(tmp_path / "loop.py"), str(tmp_path / "ckpt")], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL, preexec_fn=refuse_large_files,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert (f"SwarmError: stopped at outer step 2 without saving it: could not write step-000000002.ckpt in "
            f"{tmp_path / 'ckpt'}: File too large; a restart resumes from the last checkpoint written, or downloads "
            f"the swarm's state") in proc.stdout
    assert "checkpoint of step 1 not written" in proc.stdout  # each round's, logged, training went on
    # state_dict() inside the block gave the newest checkpoint on disk, older than the last round
    # (or "no checkpoint yet"), without a word of why.
    assert (f"state_dict: the checkpoint of step 2 could not be written (could not write step-000000002.ckpt in "
            f"{tmp_path / 'ckpt'}: File too large), and none was written") in proc.stdout
    status = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("status:"))[7:])
    assert status == {"outer_step": 2,
                      "reason": f"could not write step-000000002.ckpt in {tmp_path / 'ckpt'}: File too large"}
