"""Bad input through the real CLI: one clear line, the right exit code, nothing lost."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from lowcomm.node import checkpoint_dir, cli
from lowcomm.node.checkpoint import list_checkpoints, read
from lowcomm.node.localswarm import node_command

from .conftest import FAST, act_at_line, assert_stopped_cleanly_with_its_checkpoint, json_messages

pytestmark = pytest.mark.multiprocess

# A syntactically valid peer id nobody runs.
STRANGER = "QmXRFQRfTWsEXpbA9u6eaaWzmMBrx6k2vW1ppoC8ot9rtN"


def join_command(tmp_path: Path, *args: str) -> list[str]:
    return [*node_command(), "join", "--host", "127.0.0.1", "--dht-port", "0", "--grpc-port", "0",
            "--metrics-port", "0", "--checkpoint-dir", str(tmp_path / "ckpt"), "--torch-threads", "1",
            "--log-format", "json", *args]


def run_join(tmp_path: Path, *args: str, timeout: float = 60,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(join_command(tmp_path, *args), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env=None if env is None else {**os.environ, **env})


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr + result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("lowcomm-node: error:")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in result.stderr, f"{needle!r} not in {result.stderr!r}"
    return errors[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def test_an_empty_peer_address_says_so():
    # `--peers ""`: "invalid --peers multiaddr : it must end in /p2p/<peer id>", the address unseen.
    with pytest.raises(RuntimeError, match=r"^invalid --peers multiaddr: an empty address; copy the whole address "
                                           r"the first peer printed after `--peers`, or leave it out to start a new "
                                           r"swarm$"):
        cli._check_peer_multiaddrs([f"/ip4/127.0.0.1/tcp/4001/p2p/{STRANGER}", " "])

def test_unanswered_peers_fail_fast_naming_the_address(tmp_path):
    maddr = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{STRANGER}"
    started = time.monotonic()
    result = run_join(tmp_path, "--peers", maddr, timeout=60)
    assert time.monotonic() - started < 30
    assert_one_line_error(result, maddr)


@pytest.mark.parametrize("maddr, why", [
    ("not-a-multiaddr", "it must end in /p2p/<peer id>"),
    # Parsed before p2pd starts: p2pd said "the DHT daemon failed to start: Daemon failed to start:
    # <its log time stamp> failed to parse multiaddr ...".
    (f"/ip4/1.2.3/tcp/4001/p2p/{STRANGER}", "protocol ip4: base address '1.2.3' is not IPv4"),
])
def test_malformed_multiaddr_is_a_clear_error(tmp_path, maddr, why):
    line = assert_one_line_error(run_join(tmp_path, "--peers", maddr), maddr, why)
    assert "daemon" not in line, line


@pytest.mark.parametrize("maddr, why", [
    (f"/ip4/127.0.0.1/tcp/99999/p2p/{STRANGER}", "protocol tcp: Integer not in range(65536)"),
    ("/ip4/127.0.0.1/tcp/4001/p2p/notapeerid", "'notapeerid' is not a peer id"),
    (f"/ip4/127.0.0.1/tcp/4001/p2p/{STRANGER}/extra", "protocol extra: Unknown Protocol"),
])
def test_peer_multiaddrs_are_parsed_before_the_dht_starts(maddr, why):
    with pytest.raises(RuntimeError) as raised:
        cli._check_peer_multiaddrs([f"/ip4/127.0.0.1/tcp/4001/p2p/{STRANGER}", maddr])
    assert str(raised.value).startswith(f"invalid --peers multiaddr {maddr}: {why}")
    cli._check_peer_multiaddrs([f"/dns4/peer-0/tcp/4001/p2p/{STRANGER}", f"/ip6/::1/tcp/4001/p2p/{STRANGER}"])


def test_multiaddr_without_a_peer_id_names_it_and_the_fix(tmp_path):
    # p2pd alone said "invalid p2p multiaddr", naming neither the address nor what is missing.
    maddr = f"/ip4/127.0.0.1/tcp/{free_port()}"
    assert_one_line_error(run_join(tmp_path, "--peers", maddr), maddr, "/p2p/<peer id>")


def test_a_failed_dht_start_leaves_no_p2pd_socket_behind(tmp_path):
    # p2pd exits by itself when no bootstrap peer answers; hivemind then left its socket in TMPDIR.
    folder = Path(tempfile.mkdtemp(prefix="f-"))  # short: the session's TMPDIR (tests/conftest.py)
    try:
        maddr = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{STRANGER}"
        assert_one_line_error(run_join(tmp_path, "--peers", maddr, env={"TMPDIR": str(folder)}), maddr)
        assert not list(folder.glob("hivemind-*.sock")), list(folder.iterdir())
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_mistake_found_after_the_start_leaves_no_checkpoint_folder_it_made(tmp_path):
    # Found once the DHT ran, a data mistake left ./lowcomm-checkpoints/{identity.key,.lock} behind.
    cmd = [*node_command(), "join", "--host", "127.0.0.1", "--dht-port", "0", "--grpc-port", "0",
           "--metrics-port", "0", "--torch-threads", "1", "--data", str(tmp_path / "no-such-corpus.txt")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert_one_line_error(result, "no-such-corpus.txt")
    assert list(tmp_path.iterdir()) == []
    result = run_join(tmp_path, "--checkpoint-dir", str(tmp_path / "new" / "ckpt"), "--set", "model.factory=nope:make")
    assert_one_line_error(result, "nope:make")
    assert list(tmp_path.iterdir()) == []  # the folders above it that it made went too
    (tmp_path / "ckpt").mkdir()  # a folder the user made is theirs: the identity made in it stays
    assert_one_line_error(run_join(tmp_path, "--data", str(tmp_path / "no-such-corpus.txt")), "no-such-corpus.txt")
    assert sorted(path.name for path in (tmp_path / "ckpt").iterdir()) == [".lock", "identity.key"]


def test_checkpoint_dir_or_identity_folder_that_is_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "ckpt").write_text("a file, not a folder")
    assert_one_line_error(run_join(tmp_path), str(tmp_path / "ckpt"), "--checkpoint-dir")
    (tmp_path / "ckpt").unlink()
    (tmp_path / "keys").write_text("a file, not a folder")
    key = tmp_path / "keys" / "identity.key"
    assert_one_line_error(run_join(tmp_path, "--identity", str(key)), str(key), "--identity")


@pytest.mark.parametrize("content", ["not a key", ""])  # "": p2pd's 'required field ... not set', not named
def test_identity_file_that_is_not_a_key_is_named(tmp_path, content):
    key = tmp_path / "identity.key"
    key.write_text(content)
    assert_one_line_error(run_join(tmp_path, "--identity", str(key)), str(key), "not a peer key", "--identity")


def test_an_identity_in_use_by_a_running_node_is_named_with_what_to_do(tmp_path, swarm):
    # A copied checkpoint folder carries identity.key: hivemind's own words said only "already
    # taken by another peer".
    first = swarm.start(0)
    maddr = first.multiaddr  # ready: its identity file is written
    key = tmp_path / "copy" / "identity.key"
    key.parent.mkdir()
    shutil.copy(tmp_path / "peer-0" / "identity.key", key)
    result = run_join(tmp_path, "--identity", str(key), "--peers", maddr)
    assert_one_line_error(result, f"identity file {key} is in use by another running node",
                          "give this one another --identity or --checkpoint-dir")

def test_config_that_is_not_utf8_is_a_clear_error(tmp_path):
    config = tmp_path / "run.toml"
    config.write_bytes("[train]\ninner_steps = 5\n".encode("utf-16"))  # as some editors save it
    result = run_join(tmp_path, "--config", str(config))
    assert result.returncode == 2
    assert_one_line_error(result, str(config), "UTF-8")


def test_malformed_config_names_file_key_and_expectation(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[sync]\ncodec = "int9"\n')
    result = run_join(tmp_path, "--config", str(config))
    assert result.returncode == 2
    assert_one_line_error(result, str(config), "[sync] codec", "'int8'")

    config.write_text("[train]\ninner_step = 5\n")
    assert_one_line_error(run_join(tmp_path, "--config", str(config)), str(config), "inner_step", "inner_steps")

    config.write_text("[train\n")
    assert_one_line_error(run_join(tmp_path, "--config", str(config)), str(config), "not valid TOML")


def assert_refused_before_anything_started(result: subprocess.CompletedProcess, folder: Path) -> None:
    """A usage error (code 2) found before the node locked ``folder`` (a checkpoint folder the user
    made, which keeps what a start writes in it) and before its DHT wrote the identity there."""
    assert result.returncode == 2, result.stderr
    assert list(folder.iterdir()) == [], "the checkpoint folder was locked (or the DHT started) first"


def run_join_on_busy_port(tmp_path: Path, flag: str,
                          reuseport: bool = False) -> tuple[subprocess.CompletedProcess, int]:
    """``join`` with ``flag`` set to a port this test listens on, into a checkpoint folder made here."""
    (tmp_path / "ckpt").mkdir()
    with socket.socket() as busy:
        if reuseport:  # as p2pd listens
            busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        return run_join(tmp_path, flag, str(port)), port


def test_busy_grpc_port_names_the_port_and_the_flag(tmp_path):
    # It was found when the gRPC server bound it, after the DHT's start (12 s), with code 1.
    result, port = run_join_on_busy_port(tmp_path, "--grpc-port")
    assert_refused_before_anything_started(result, tmp_path / "ckpt")
    assert_one_line_error(result, f"gRPC port {port} on 127.0.0.1 is already in use", "--grpc-port", "or 0")
    assert "add_port" not in result.stderr  # gRPC core's own error line came before ours


def test_a_host_address_that_is_not_this_machines_names_the_flag(tmp_path):
    # It was p2pd's Go log line: "failed to listen on any addresses: [listen tcp4 ...]".
    (tmp_path / "ckpt").mkdir()
    result = run_join(tmp_path, "--host", "192.0.2.1")  # TEST-NET-1: never a local address
    assert_one_line_error(result, "--host 192.0.2.1 is not an address of this machine", "0.0.0.0")
    assert_refused_before_anything_started(result, tmp_path / "ckpt")  # it was exit 1, after the folder's lock


def test_a_host_name_instead_of_an_address_is_one_line_naming_the_flag(tmp_path):
    # It was p2pd's Go log line: 'failed to parse multiaddr "/ip4/localhost/tcp/0"'.
    result = run_join(tmp_path, "--host", "localhost")
    assert_one_line_error(result, "flag --host", "not an IP address", "127.0.0.1")
    assert result.returncode == 2
    assert not (tmp_path / "ckpt").exists()

def test_dht_port_of_a_running_node_names_the_port_and_the_flag(tmp_path):
    # p2pd listens with SO_REUSEPORT, as this stand-in does: a second node's p2pd shared the port
    # with it (a dialled multiaddr reached either) instead of failing.
    result, port = run_join_on_busy_port(tmp_path, "--dht-port", reuseport=True)
    assert_refused_before_anything_started(result, tmp_path / "ckpt")  # it was code 1, after the lock
    assert_one_line_error(result, f"DHT port {port} on 127.0.0.1 is already in use", "--dht-port")


def test_busy_metrics_port_names_the_port_and_the_flag(tmp_path):
    # It was found when the metrics server bound it, after the DHT's start, with code 1.
    result, port = run_join_on_busy_port(tmp_path, "--metrics-port")
    assert_refused_before_anything_started(result, tmp_path / "ckpt")
    assert_one_line_error(result, f"metrics port {port} on 127.0.0.1 is already in use", "--metrics-port")


def test_a_metrics_port_taken_after_the_check_is_still_a_usage_error():
    # A port another process takes between check_ports and the server's own bind is named there:
    # a SettingError, which `join` ends with code 2 as the check does (it was a FatalError, code 1).
    from types import SimpleNamespace

    from lowcomm.node.config import load_config
    from lowcomm.node.daemon import Node
    from lowcomm.node.errors import SettingError
    from lowcomm.node.metrics import NodeMetrics

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = load_config(None, {"host": "127.0.0.1", "metrics_port": port}, [], environ={})
        with pytest.raises(SettingError, match=f"metrics on 127.0.0.1:{port} .*--metrics-port"):
            Node._start_metrics(SimpleNamespace(config=config, metrics=NodeMetrics()))


_OUT_OF_MEMORY = """
import sys, torch
from lowcomm.node import cli, daemon

errors = {"numpy": MemoryError("Unable to allocate 384. GiB for an array with shape (400000000, 129) and data "
                               "type int64"),
          "cuda": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                         "capacity of 79.11 GiB\\nIf reserved but unallocated memory is large ..."),
          "cpu": RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                              "memory: you tried to allocate 32000000000 bytes. Error code 12 (Cannot allocate memory)")}

def trainer(*args):  # what a batch too large for the machine raised as the node built or ran it
    raise errors[sys.argv[1]]

daemon.Trainer = trainer
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("kind, said", [
    ("numpy", "Unable to allocate 384. GiB for an array with shape (400000000, 129) and data type int64"),
    ("cuda", "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB"),
    ("cpu", "DefaultCPUAllocator: can't allocate memory: you tried to allocate 32000000000 bytes"),
])
def test_a_batch_larger_than_the_memory_is_one_line_naming_the_settings_to_lower(tmp_path, kind, said):
    # `--set train.batch_size=100000000` ended the node with numpy's traceback (its eval batches),
    # and a CUDA or CPU allocation by torch with its own, code 1.
    command = [sys.executable, "-c", _OUT_OF_MEMORY, kind, *join_command(tmp_path)[len(node_command()):]]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 2, result.stderr
    assert_one_line_error(result, f"out of memory with [train] batch_size = 16, micro_batches = 1 and [data] seq_len "
                                  f"= 128 ({said}): lower batch_size (and raise micro_batches")
    assert not (tmp_path / "ckpt").exists()  # nothing was written: the folder the start made is gone


@pytest.mark.parametrize("content", ['{"version": "1.0"', "not json", ""], ids=["truncated", "not-json", "empty"])
def test_a_tokenizer_file_that_cannot_be_read_is_a_usage_error_before_anything_starts(tmp_path, content):
    # It was found as the node built its run fingerprint, after the DHT's start, with code 1.
    pytest.importorskip("tokenizers", reason="the hf extra (tokenizers) is not installed")
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(content)
    (tmp_path / "ckpt").mkdir()
    result = run_join(tmp_path, "--set", f"data.tokenizer={tokenizer}")
    assert_refused_before_anything_started(result, tmp_path / "ckpt")
    assert_one_line_error(result, f"[data] tokenizer {tokenizer} is not a readable tokenizer.json", '"bytes"')


def test_seq_len_beyond_an_hf_models_positions_is_a_usage_error_before_anything_starts(tmp_path):
    # It was found as the node built the model, after the DHT's start, with code 1.
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    from .hf_assets import write_llama_config

    config = write_llama_config(tmp_path / "llama" / "config.json", max_position_embeddings=16)
    (tmp_path / "ckpt").mkdir()
    result = run_join(tmp_path, "--set", f"model.hf_config={config}", "--set", "data.seq_len=32")
    assert_refused_before_anything_started(result, tmp_path / "ckpt")
    assert_one_line_error(result, "[data] seq_len 32 is longer than the model's max_position_embeddings 16",
                          str(config), "--set data.seq_len=16")


def test_hf_pretrained_directory_without_weights_is_a_usage_error_before_anything_starts(tmp_path):
    # from_pretrained said so as the node built the model, after the DHT's start, with code 1.
    from .hf_assets import write_llama_config

    folder = write_llama_config(tmp_path / "llama" / "config.json").parent
    (tmp_path / "ckpt").mkdir()
    result = run_join(tmp_path, "--set", f"model.hf_pretrained={folder}")
    assert_refused_before_anything_started(result, tmp_path / "ckpt")
    assert_one_line_error(result, f"[model] hf_pretrained = '{folder}'", "no weights", "model.safetensors",
                          "save_pretrained")


def test_corrupted_checkpoint_falls_back_to_the_previous_one(tmp_path):
    first = run_join(tmp_path, *FAST, "--max-rounds", "2")
    assert first.returncode == 0, first.stderr
    # The stop is logged after the last round's line (it came before it, while its eval ran).
    messages = [json.loads(line)["msg"] for line in first.stdout.splitlines() if line.startswith("{")]
    last_round = max(i for i, msg in enumerate(messages) if msg.startswith("step 2 |"))
    assert "completed 2 round(s) (--max-rounds); stopping" in messages[last_round + 1:]
    files = list_checkpoints(tmp_path / "ckpt")
    assert [f.name for f in files] == ["step-000000001.ckpt", "step-000000002.ckpt"]
    newest = files[-1]
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a torn write

    second = run_join(tmp_path, *FAST, "--max-rounds", "1")
    assert second.returncode == 0, second.stderr
    assert "skipping checkpoint step-000000002.ckpt" in second.stdout
    assert "resumed from checkpoint" in second.stdout and "step-000000001.ckpt" in second.stdout


def test_a_local_model_that_diverges_every_round_stops_the_node_naming_what_to_lower(tmp_path):
    # It reset to θ_global and diverged again, one error line a round, forever.
    result = run_join(tmp_path, *FAST, "--set", "train.inner_steps=2", "--set", "model.factory=tests.factory_model:build_exploding",
                      "--max-rounds", "10")
    error = assert_one_line_error(result, "diverged (non-finite weights) in 3 rounds in a row", "lower [train] lr (now 0.001)")
    assert result.returncode == 1, error
    assert result.stdout.count('"event": "diverged"') == 3
    (newest,) = list_checkpoints(tmp_path / "ckpt")  # the stop's, of step 0: the global parameters, finite
    assert newest.name == "step-000000000.ckpt" and bool(read(newest)["params"].isfinite().all())


def test_checkpoints_the_disk_refuses_cost_no_round_and_the_stop_says_it_saved_nothing(tmp_path):
    # On a full disk every round logged torch's zip-writer traceback instead of its line, and the
    # stop's checkpoint ended the node with a traceback. A file size limit fails every checkpoint
    # write the way a full disk does (with EFBIG instead of ENOSPC; Python ignores SIGXFSZ).
    def refuse_large_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))

    proc = subprocess.run(join_command(tmp_path, *FAST, "--max-rounds", "2"), capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL, preexec_fn=refuse_large_files)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    messages = json_messages(proc.stdout)
    folder = tmp_path / "ckpt"
    for step in (1, 2):
        assert f"checkpoint of step {step} not written: could not write step-{step:09d}.ckpt in {folder}: File too " \
               f"large; training goes on (a restart resumes from the last checkpoint written, or downloads the " \
               f"swarm's state)" in messages, messages
        assert any(msg.startswith(f"step {step} | ") for msg in messages), messages  # the round's line
    assert messages[-1] == (f"stopped at outer step 2 without saving it: could not write step-000000002.ckpt in "
                            f"{folder}: File too large; a restart resumes from the last checkpoint written, or "
                            f"downloads the swarm's state")
    assert not list(folder.glob("*.ckpt")) and not list(folder.glob(".*.tmp"))


def test_a_checkpoint_folder_on_a_full_disk_is_one_clear_error(tmp_path, monkeypatch):
    # Writing the lock file's pid was a traceback (OSError from flush, then again from close).
    def disk_full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint_dir.os, "pwrite", disk_full)
    with pytest.raises(RuntimeError) as info:
        checkpoint_dir.lock_checkpoint_dir(tmp_path / "ckpt")
    assert str(info.value) == (f"cannot use checkpoint directory {tmp_path / 'ckpt'}: No space left on device; free "
                               "space there, or choose another with --checkpoint-dir (or LOWCOMM_CHECKPOINT_DIR)")
    monkeypatch.undo()
    checkpoint_dir.lock_checkpoint_dir(tmp_path / "ckpt").close()  # the failed attempt held no lock


_INTERRUPTED_IMPORT = """
import atexit, logging, sys
from lowcomm.node import cli
from lowcomm.node.logs import setup_logging

def join(args):
    setup_logging("json", "info")
    # What a Ctrl-C during torch's import leaves behind: a logger of its own at INFO and an
    # at-exit hook that logs through it (torch/_subclasses/fake_tensor.py dump_cache_stats).
    noisy = logging.getLogger("torch._subclasses.fake_tensor")
    noisy.setLevel(logging.INFO)
    atexit.register(lambda: noisy.info("FakeTensor cache stats:"))
    raise KeyboardInterrupt

cli.cmd_join = join
sys.exit(cli.main(["join"]))
"""


def test_a_ctrl_c_before_the_node_takes_its_signals_exits_130_without_library_lines_at_exit():
    proc = subprocess.run([sys.executable, "-c", _INTERRUPTED_IMPORT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130
    assert proc.stdout == "" and proc.stderr == "", (proc.stdout, proc.stderr)


def test_a_stop_during_start_up_ends_the_node_before_it_joins(tmp_path):
    # It went on to say "ready: others join with ...", joined the swarm, then stopped.
    marker, release = tmp_path / "building", tmp_path / "release"
    kwargs = f"model.factory_kwargs={{marker = '{marker}', release = '{release}'}}"
    proc = subprocess.Popen(join_command(tmp_path, "--set", "model.factory=tests.factory_model:build_held",
                                         "--set", kwargs),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)  # the model's build began: the node's signal handlers are in place
        assert marker.exists(), proc.communicate(timeout=10)
        proc.send_signal(signal.SIGINT)
        seen = []
        for line in proc.stdout:  # the build waits (at most 60 s) until the node has taken the stop
            seen.append(line)
            if "stop requested" in line:
                break
        release.touch()
        out, err = proc.communicate(timeout=60)
        out = "".join(seen) + out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    messages = [json.loads(line)["msg"] for line in out.splitlines() if line.startswith("{")]
    assert "stop requested during start-up: stopping before joining the swarm" in messages
    assert any(msg.startswith("stopped during start-up, before joining the swarm") for msg in messages)
    assert not [msg for msg in messages if " ready: " in msg or msg.startswith("stopped cleanly")]


def test_a_stop_while_waiting_for_peers_stops_at_once_with_the_start_saved(tmp_path):
    _, code, out, err = act_at_line(join_command(tmp_path, *FAST, "--wait-for-peers", "2"),
                                 '"event": "waiting_for_peers"', lambda proc: proc.send_signal(signal.SIGINT))
    assert code == 0, err
    messages = json_messages(out)
    assert "waiting for 2 peers before training (--wait-for-peers): 1 in the swarm" in messages
    assert "stop requested while waiting for peers to start with: stopping" in messages
    assert not [msg for msg in messages if msg.startswith("step ")]  # it never trained
    assert any(msg.startswith("stopped cleanly at outer step 0") for msg in messages), messages
    assert [path.name for path in list_checkpoints(tmp_path / "ckpt")] == ["step-000000000.ckpt"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP], ids=["ctrl-c", "hangup"])
def test_a_terminal_signal_to_the_nodes_process_group_stops_it_cleanly_and_at_once(tmp_path, sig):
    # A terminal sends Ctrl-C (SIGINT) and its hangup (SIGHUP) to its whole foreground process
    # group. A hangup killed the node at once (no checkpoint of the progress since the last round,
    # no goodbye in the DHT); Ctrl-C reached its DHT process and p2pd as well, which quit under
    # the node's orderly stop: p2pd's "error accepting connection" line, then "DHT did not shut
    # down within the grace period" 3 s later.
    _, code, out, err = act_at_line(join_command(tmp_path, *FAST), '"event": "round_done"',
                                 lambda proc: os.killpg(proc.pid, sig))
    assert code == 0, err
    assert_stopped_cleanly_with_its_checkpoint(out, tmp_path / "ckpt")
    assert not [line for line in (out + err).splitlines()
                if "error accepting connection" in line or "did not shut down" in line]


def test_a_node_started_with_nohup_outlives_a_hangup(tmp_path):
    # nohup ignores hangups so that the node outlives its terminal: the node's own SIGHUP handler
    # must not undo that.
    _, code, out, err = act_at_line(["nohup", *join_command(tmp_path, *FAST, "--max-rounds", "3")],
                                    '"event": "round_done"', lambda proc: os.killpg(proc.pid, signal.SIGHUP))
    assert code == 0, err
    messages = json_messages(out)
    assert "completed 3 round(s) (--max-rounds); stopping" in messages, messages
    assert not [msg for msg in messages if msg.startswith("stop requested")]

def test_a_checkpoint_of_another_run_config_names_the_keys_that_differ(tmp_path):
    assert run_join(tmp_path, *FAST, "--max-rounds", "1").returncode == 0
    kept = {path: path.read_bytes() for path in list_checkpoints(tmp_path / "ckpt")}
    result = run_join(tmp_path, *FAST, "--set", "train.lr=0.002", "--max-rounds", "1")
    error = assert_one_line_error(result, "belongs to another run config ([train] lr: checkpoint 0.001, now 0.002)",
                                  "use another --checkpoint-dir")
    assert result.returncode == 1, error
    assert {path: path.read_bytes() for path in list_checkpoints(tmp_path / "ckpt")} == kept  # nothing written


def test_peer_with_another_run_config_is_refused_on_both_sides(swarm, tmp_path):
    first = swarm.start(0)
    first.ready()
    result = run_join(tmp_path, *FAST, "--set", "sync.codec=int4", "--peers", first.multiaddr, timeout=120)
    assert_one_line_error(result, "[sync] codec", "int4", "int8")
    first.wait_for(lambda e: e.get("level") == "warning" and "[sync] codec" in e.get("msg", ""), 30)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a CUDA device")
def test_device_cuda_without_cuda_is_one_line_before_anything_starts(tmp_path):
    # It was a traceback from the training thread, after the DHT had started.
    result = run_join(tmp_path, "--device", "cuda")
    assert_one_line_error(result, "--device cuda", "without CUDA", "--device auto")
    assert not (tmp_path / "ckpt").exists()


def test_a_mistyped_fault_injection_variable_is_one_line(tmp_path):
    # It was a traceback out of the node's constructor.
    result = run_join(tmp_path, env={"LOWCOMM_FAULT_HOLD_RUOND": "2"})
    assert_one_line_error(result, "LOWCOMM_FAULT_HOLD_RUOND", "LOWCOMM_FAULT_HOLD_ROUND")
