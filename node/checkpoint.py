"""Atomic, hash-checked checkpoints: write a temp file, fsync, rename; keep the last two.

A file is ``MAGIC || sha256(body) || body`` where the body is a ``torch.save`` of a plain dict.
A truncated or corrupted file fails the hash check and the loader falls back to the previous one.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

log = logging.getLogger(__name__)
T = TypeVar("T")

MAGIC = b"LOWCOMM-CKPT-1\n"
KEEP = 2


class CheckpointError(Exception):
    """A checkpoint file that cannot be trusted."""


def _path(directory: Path, step: int) -> Path:
    return directory / f"step-{step:09d}.ckpt"


def save(directory: Path, step: int, payload: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    body = buffer.getvalue()
    final = _path(directory, step)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(MAGIC)
            fh.write(hashlib.sha256(body).digest())
            fh.write(body)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException:
        # A failed save (disk full, interrupted) must not leave a partial file behind every round.
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    for old in list_checkpoints(directory)[:-KEEP]:
        old.unlink(missing_ok=True)
    return final


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Delete temp files left by a process killed mid-write (call while holding the directory lock)."""
    stale = sorted(directory.glob(".step-*.tmp")) if directory.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(directory.glob("step-*.ckpt"))


def read(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    header = len(MAGIC) + 32
    if len(data) < header or not data.startswith(MAGIC):
        raise CheckpointError(f"{path} is not a lowcomm checkpoint or is truncated")
    digest, body = data[len(MAGIC):header], data[header:]
    if hashlib.sha256(body).digest() != digest:
        raise CheckpointError(f"{path} is corrupted (its hash does not match its content)")
    return torch.load(io.BytesIO(body), weights_only=True)


def load_latest(directory: Path) -> tuple[dict[str, Any], Path] | None:
    """The newest checkpoint that passes its hash check; logs every file it had to skip."""
    return load_newest(directory, lambda payload: payload)


def load_newest(directory: Path, parse: Callable[[dict[str, Any]], T]) -> tuple[T, Path] | None:
    """``parse`` of the newest checkpoint whose file hash checks out *and* that ``parse``
    accepts (it raises ``KeyError``/``ValueError``/``CheckpointError`` for a payload it cannot
    use, e.g. parameters that do not match the hash stored with them): a damaged newest
    checkpoint falls back to the previous one, never straight to the initial weights.
    Every skipped file is logged. Other exceptions of ``parse`` propagate."""
    for path in reversed(list_checkpoints(directory)):
        try:
            return parse(read(path)), path
        except (CheckpointError, OSError, RuntimeError, EOFError, KeyError, ValueError) as err:
            log.warning("skipping checkpoint %s: %s; falling back to an older one or to peer state", path.name, err)
    return None
