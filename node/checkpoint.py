"""Atomic, hash-checked checkpoints: write a temp file, fsync, rename; keep the last two.

A file is ``MAGIC || sha256(body) || body`` where the body is a ``torch.save`` of a plain dict.
A truncated or corrupted file fails the hash check and the loader falls back to the previous one.

Both directions stream: the body is hashed as ``torch.save`` writes it (the hash goes into its
place at the end) and as the loader reads it back in chunks, and ``torch.load`` reads the file
through a window past the header. No whole-file copy of the state is ever held in memory (at
the gpt2 preset's size, params, momentum, residuals and AdamW state are ~3 GB).
"""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import os
from pathlib import Path
from typing import Any, Callable, TypeVar, Union

import torch

log = logging.getLogger(__name__)
T = TypeVar("T")
PathLike = Union[str, os.PathLike]  # what every function here takes as a path

MAGIC = b"LOWCOMM-CKPT-1\n"
KEEP = 2


class CheckpointError(Exception):
    """A checkpoint file that cannot be trusted."""


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written (a full disk, a folder without write permission);
    the checkpoints written before it stay as they were. Its message says which file, why, and
    for a full disk what to do."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def system_error(err: BaseException) -> OSError | None:
    """The system's error behind ``err``: itself or one of the exceptions it wraps (``torch.save``
    reports a full disk as a RuntimeError of its zip writer, "unexpected pos ...", raised while
    handling the OSError of the write); None when there is none."""
    seen: BaseException | None = err
    while seen is not None and not isinstance(seen, OSError):
        seen = seen.__cause__ or seen.__context__
    return seen


def _write_error(err: BaseException, path: Path) -> CheckpointWriteError | None:
    """Why a write of ``path`` failed, as the system said; None when it did not say."""
    seen = system_error(err)
    if seen is None:
        return None
    reason = seen.strerror or str(seen)
    hint = ("; free space there, or give another --checkpoint-dir"
            if seen.errno in (errno.ENOSPC, errno.EDQUOT) else "")
    return CheckpointWriteError(seen.errno, f"could not write {path.name} in {path.parent}: {reason}{hint}")


def _path(directory: Path, step: int) -> Path:
    return directory / f"step-{step:09d}.ckpt"


HEADER = len(MAGIC) + 32
READ_CHUNK = 4 * 2**20


class _HashingWriter(io.RawIOBase):
    """The file ``torch.save`` writes into: every byte also goes into the hash (sequential
    writes only, which is all torch's zip writer does with a stream)."""

    def __init__(self, fh) -> None:
        super().__init__()
        self.fh = fh
        self.sha = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.sha.update(data)
        return self.fh.write(data)


class _Body(io.RawIOBase):
    """A read-only, seekable view of a checkpoint file from its body on (offsets as in the body)."""

    def __init__(self, fh) -> None:
        super().__init__()
        self.fh = fh

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            offset += HEADER
        return self.fh.seek(offset, whence) - HEADER

    def tell(self) -> int:
        return self.fh.tell() - HEADER

    def readinto(self, buffer) -> int:
        return self.fh.readinto(buffer)


def save(directory: PathLike, step: int, payload: dict[str, Any]) -> Path:
    """Write ``payload`` as the checkpoint of ``step``; a CheckpointWriteError when the system
    refuses (the earlier checkpoints stay).

    A new checkpoint is written beside the last KEEP before the oldest goes, so a disk needs room
    for KEEP + 1 of them. When it is full, the checkpoints older than the newest are removed and
    the write is tried once more: a disk with room for two would otherwise never save again after
    its second checkpoint (every round failed, and a restart went back to that step)."""
    directory = Path(directory)
    try:
        return _save(directory, step, payload)
    except CheckpointWriteError as err:
        older = list_checkpoints(directory)[:-1] if err.errno in (errno.ENOSPC, errno.EDQUOT) else []
        if not older:
            raise
        for old in older:
            old.unlink(missing_ok=True)
        log.warning("%s: removed the older checkpoint(s) %s to make room, keeping the newest", err,
                    ", ".join(old.name for old in older))
        return _save(directory, step, payload)


def _save(directory: Path, step: int, payload: dict[str, Any]) -> Path:
    final = _path(directory, step)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w+b") as fh:
            fh.write(MAGIC)
            fh.write(bytes(32))  # the body's hash, known once the body is written
            body = _HashingWriter(fh)
            torch.save(payload, body)
            fh.seek(len(MAGIC))
            fh.write(body.sha.digest())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException as err:
        # A failed save (disk full, interrupted) must not leave a partial file behind every round.
        tmp.unlink(missing_ok=True)
        failure = _write_error(err, final) if isinstance(err, Exception) else None
        if failure is not None:
            raise failure from err
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    for old in list_checkpoints(directory)[:-KEEP]:
        old.unlink(missing_ok=True)
    return final


def remove_stale_temporaries(directory: PathLike) -> list[Path]:
    """Delete temp files left by a process killed mid-write (call while holding the directory lock)."""
    directory = Path(directory)
    stale = sorted(directory.glob(".step-*.tmp")) if directory.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def list_checkpoints(directory: PathLike) -> list[Path]:
    """Checkpoint files, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(directory.glob("step-*.ckpt"))


def read(path: PathLike) -> dict[str, Any]:
    """The payload of the checkpoint file ``path`` (a plain ``torch.load`` cannot read it: the file
    starts with a header); a CheckpointError when the file is not one or fails its hash check."""
    path = Path(path)
    with open(path, "rb") as fh:
        head = fh.read(HEADER)
        if len(head) < HEADER or not head.startswith(MAGIC):
            raise CheckpointError(f"{path} is not a lowcomm checkpoint or is truncated")
        sha = hashlib.sha256()
        while chunk := fh.read(READ_CHUNK):
            sha.update(chunk)
        if sha.digest() != head[len(MAGIC):]:
            raise CheckpointError(f"{path} is corrupted (its hash does not match its content)")
        fh.seek(HEADER)
        # The directory is locked by this node (checkpoint_dir.lock_checkpoint_dir): nothing rewrites the
        # file between the hash check and the load.
        return torch.load(io.BufferedReader(_Body(fh)), weights_only=True)


def load_latest(directory: PathLike) -> tuple[dict[str, Any], Path] | None:
    """The newest checkpoint that passes its hash check; logs every file it had to skip."""
    return load_newest(directory, lambda payload: payload)


def load_newest(directory: PathLike, parse: Callable[[dict[str, Any]], T]) -> tuple[T, Path] | None:
    """``parse`` of the newest checkpoint whose file hash checks out *and* that ``parse``
    accepts (it raises ``KeyError``/``ValueError``/``CheckpointError`` for a payload it cannot
    use, e.g. parameters that do not match the hash stored with them): a damaged newest
    checkpoint falls back to the previous one, never straight to the initial weights.
    Every skipped file is logged. Other exceptions of ``parse`` propagate."""
    for path in reversed(list_checkpoints(directory)):
        try:
            return parse(read(path)), path
        except (CheckpointError, OSError, RuntimeError, EOFError, KeyError, ValueError) as err:
            log.warning("skipping checkpoint %s: %s; trying an older one", path.name, err)
    return None
