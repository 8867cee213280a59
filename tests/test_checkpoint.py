"""Atomic, hash-checked checkpoints with fallback to the previous one (node/checkpoint.py)."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest
import torch

from lowcomm.node import checkpoint
from lowcomm.node.checkpoint import CheckpointError


def payload(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    return {"step": step, "params": torch.randn(1000, generator=gen), "momentum": torch.randn(1000, generator=gen),
            "tokens_total": 123 * step, "meta": {"codec": "int8"}}


def assert_payload_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value)
        else:
            assert got[key] == value


def test_round_trip(tmp_path):
    path = checkpoint.save(tmp_path / "ck", 3, payload(3))
    assert path.exists() and path.parent == tmp_path / "ck"
    assert_payload_equal(checkpoint.read(path), payload(3))
    loaded, where = checkpoint.load_latest(tmp_path / "ck")
    assert where == path
    assert_payload_equal(loaded, payload(3))


def test_empty_or_missing_directory(tmp_path):
    assert checkpoint.load_latest(tmp_path / "missing") is None
    assert checkpoint.list_checkpoints(tmp_path / "missing") == []
    (tmp_path / "empty").mkdir()
    assert checkpoint.load_latest(tmp_path / "empty") is None


def test_keeps_only_the_last_two(tmp_path):
    for step in (1, 2, 3, 10, 11):
        checkpoint.save(tmp_path, step, payload(step))
    names = [p.name for p in checkpoint.list_checkpoints(tmp_path)]
    assert names == ["step-000000010.ckpt", "step-000000011.ckpt"]  # numeric order, not 1 < 10 < 2
    assert sorted(p.name for p in tmp_path.iterdir()) == names  # no temp files left behind
    loaded, _ = checkpoint.load_latest(tmp_path)
    assert loaded["step"] == 11


def corrupt_truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def corrupt_bitflip(path):
    data = bytearray(path.read_bytes())
    data[len(data) - 100] ^= 0x10  # inside the torch.save body
    path.write_bytes(bytes(data))


def corrupt_header(path):
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))


def corrupt_empty(path):
    path.write_bytes(b"")


@pytest.mark.parametrize("corrupt", [corrupt_truncate, corrupt_bitflip, corrupt_header, corrupt_empty])
def test_corrupt_newest_falls_back_to_previous(tmp_path, caplog, corrupt):
    checkpoint.save(tmp_path, 4, payload(4))
    newest = checkpoint.save(tmp_path, 5, payload(5))
    corrupt(newest)
    with pytest.raises(CheckpointError, match=newest.name):
        checkpoint.read(newest)
    with caplog.at_level(logging.WARNING, logger=checkpoint.log.name):
        loaded, where = checkpoint.load_latest(tmp_path)
    assert where.name == "step-000000004.ckpt"
    assert_payload_equal(loaded, payload(4))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and newest.name in warnings[0].getMessage()
    # Neutral: `lowcomm-node export` reads checkpoints too, and it has no peer state to fall back to.
    assert warnings[0].getMessage().endswith("; trying an older one"), warnings[0].getMessage()


def test_all_corrupt_gives_none(tmp_path, caplog):
    for step in (1, 2):
        corrupt_bitflip(checkpoint.save(tmp_path, step, payload(step)))
    with caplog.at_level(logging.WARNING, logger=checkpoint.log.name):
        assert checkpoint.load_latest(tmp_path) is None
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_temp_files_never_count_as_checkpoints(tmp_path):
    good = checkpoint.save(tmp_path, 7, payload(7))
    # What a save killed before its rename leaves behind: a partial temp file of a newer step.
    full = (tmp_path / "scratch")
    checkpoint.save(full, 8, payload(8))
    partial = full.joinpath("step-000000008.ckpt").read_bytes()[:500]
    tmp = tmp_path / ".step-000000008.ckpt.4242.tmp"
    tmp.write_bytes(partial)
    assert checkpoint.list_checkpoints(tmp_path) == [good]
    loaded, where = checkpoint.load_latest(tmp_path)
    assert where == good
    assert_payload_equal(loaded, payload(7))
    # The next save of that step succeeds and pruning leaves the stray temp file alone.
    again = checkpoint.save(tmp_path, 8, payload(8))
    assert checkpoint.list_checkpoints(tmp_path) == [good, again]
    assert_payload_equal(checkpoint.load_latest(tmp_path)[0], payload(8))


@pytest.mark.parametrize("error", [KeyboardInterrupt("interrupted before the rename"),
                                   OSError(28, "No space left on device")])
def test_failed_save_leaves_previous_usable_and_no_temp_file(tmp_path, monkeypatch, error):
    good = checkpoint.save(tmp_path, 1, payload(1))
    renames = []

    def fail_rename(src, dst):
        renames.append(src)
        assert src.exists()  # the temp file was complete and synced at this point
        raise error

    monkeypatch.setattr(checkpoint.os, "replace", fail_rename)
    with pytest.raises(type(error)):
        checkpoint.save(tmp_path, 2, payload(2))
    monkeypatch.undo()
    assert renames and renames[0].name.startswith(".step-000000002.ckpt.")
    assert sorted(p.name for p in tmp_path.iterdir()) == [good.name]  # no partial file left behind
    loaded, where = checkpoint.load_latest(tmp_path)
    assert where == good
    assert_payload_equal(loaded, payload(1))


def test_overwrite_same_step_is_atomic(tmp_path):
    checkpoint.save(tmp_path, 3, payload(3))
    checkpoint.save(tmp_path, 3, payload(30))
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-000000003.ckpt"]
    assert_payload_equal(checkpoint.load_latest(tmp_path)[0], payload(30))


def test_a_checkpoint_of_another_trainer_kind_stops_the_node_with_the_reason(tmp_path):
    """Same run config, but the trainer state was written by lowcomm.Swarm (an optimizer and a step
    count, no data position): the daemon's trainer cannot resume from it. One clear FatalError,
    and the file is left as it was."""
    from lowcomm.node import restore
    from lowcomm.node.config import load_config
    from lowcomm.node.errors import FatalError
    from lowcomm.node.globalstate import GlobalState
    from lowcomm.node.trainer import Trainer

    config = load_config(overrides=["model.preset=tiny", f"node.checkpoint_dir={tmp_path}"], environ={})
    trainer = Trainer(config, "peer-test")
    state = GlobalState.fresh(trainer.get_params(), config.sync.outer_lr, config.sync.outer_momentum)
    api_state = {"optimizer": trainer.optimizer.state_dict(), "inner_steps_done": 40}
    restore.save(config, state.to_checkpoint(), api_state, tokens_total=1)
    [written] = checkpoint.list_checkpoints(tmp_path)
    before = written.read_bytes()
    with pytest.raises(FatalError, match=r"holds a trainer state this node cannot load \(KeyError: 'sampler_shard'\)"
                                         r".*use another --checkpoint-dir"):
        restore.restore(config, Trainer(config, "peer-test"))
    assert written.read_bytes() == before


def test_a_lowcomm_swarm_checkpoint_of_its_own_model_is_named_as_such(tmp_path):
    """A checkpoint that lowcomm.Swarm wrote for a model object ([model] kind "external"): no run
    config builds that model, so "use the run config it was made with" would send the user looking
    for one that does not exist."""
    from lowcomm.api_config import resolve_config
    from lowcomm.node import restore
    from lowcomm.node.config import load_config
    from lowcomm.node.errors import FatalError
    from lowcomm.node.globalstate import GlobalState
    from lowcomm.node.trainer import Trainer

    model = torch.nn.Linear(8, 8)
    swarm_config = resolve_config({"node": {"checkpoint_dir": str(tmp_path)}}, None, model)
    params = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    state = GlobalState.fresh(params, swarm_config.sync.outer_lr, swarm_config.sync.outer_momentum)
    restore.save(swarm_config, state.to_checkpoint(), {"inner_steps_done": 0}, tokens_total=0)
    [written] = checkpoint.list_checkpoints(tmp_path)
    before = written.read_bytes()

    config = load_config(overrides=["model.preset=tiny", f"node.checkpoint_dir={tmp_path}"], environ={})
    with pytest.raises(FatalError) as info:
        restore.restore(config, Trainer(config, "peer-test"))
    message = str(info.value)
    assert (f"a checkpoint in {tmp_path} was written by a lowcomm.Swarm script for a model of its own, which "
            f"lowcomm-node cannot build; use another --checkpoint-dir") in message, message
    assert "run config it was made with" not in message and "external" not in message, message
    assert written.read_bytes() == before


def test_a_full_disk_is_one_clear_error_and_leaves_the_earlier_checkpoint_and_no_partial_file(tmp_path, monkeypatch):
    # torch.save reports a write that fails as a RuntimeError of its zip writer ("[enforce fail
    # at inline_container.cc] unexpected pos ..."); the node logged that traceback every round,
    # dropped the round's line, and died with it at its stop.
    directory = tmp_path / "ck"
    checkpoint.save(directory, 1, payload(1))
    written = 0

    def fill_up(self, data) -> int:
        nonlocal written
        written += len(data)
        if written > 4096:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.fh.write(data)

    monkeypatch.setattr(checkpoint._HashingWriter, "write", fill_up)
    with pytest.raises(checkpoint.CheckpointWriteError) as info:
        checkpoint.save(directory, 2, payload(2))
    assert str(info.value) == (f"could not write step-000000002.ckpt in {directory}: No space left on device; "
                               "free space there, or give another --checkpoint-dir")
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    assert sorted(p.name for p in directory.iterdir()) == ["step-000000001.ckpt"]
    loaded, where = checkpoint.load_latest(directory)
    assert where.name == "step-000000001.ckpt"
    assert_payload_equal(loaded, payload(1))


def test_a_disk_with_room_for_two_checkpoints_keeps_saving_the_newest(tmp_path, monkeypatch, caplog):
    # A new checkpoint is written beside the last two: on a disk with room for two, every write
    # after the second failed, and the node never saved again (audit: a 25 MB tmpfs, 10.7 MB each).
    directory = tmp_path / "ck"
    size = checkpoint.save(tmp_path / "probe", 1, payload(1)).stat().st_size
    budget = int(2.5 * size)
    write = checkpoint._HashingWriter.write

    def bounded(self, data) -> int:
        used = sum(p.stat().st_size for p in directory.iterdir() if p.name != Path(self.fh.name).name)
        if used + self.fh.tell() + len(data) > budget:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, data)

    monkeypatch.setattr(checkpoint._HashingWriter, "write", bounded)
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        for step in range(1, 6):
            checkpoint.save(directory, step, payload(step))
    assert [p.name for p in checkpoint.list_checkpoints(directory)] == ["step-000000004.ckpt", "step-000000005.ckpt"]
    loaded, where = checkpoint.load_latest(directory)
    assert where.name == "step-000000005.ckpt"
    assert_payload_equal(loaded, payload(5))
    made_room = [r.getMessage() for r in caplog.records]
    assert len(made_room) == 3 and made_room[0].endswith(
        "removed the older checkpoint(s) step-000000001.ckpt to make room, keeping the newest"), made_room


def test_an_error_that_is_not_the_systems_is_not_called_a_write_failure(tmp_path):
    with pytest.raises(Exception) as info:  # torch cannot pickle a lambda
        checkpoint.save(tmp_path / "ck", 1, {"fn": lambda: None})
    assert not isinstance(info.value, checkpoint.CheckpointWriteError)
    assert list((tmp_path / "ck").iterdir()) == []
