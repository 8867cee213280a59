"""The checkpoint folder a node (``lowcomm-node join`` or a ``lowcomm.Swarm``) owns while it runs.

One node per folder, held with an exclusive lock for the node's lifetime; a start that fails
before the node wrote anything there leaves no folder it made behind.
"""

from __future__ import annotations

import os
from pathlib import Path


def first_missing(directory: Path) -> Path | None:
    """The outermost folder of ``directory``'s path that does not exist yet (None: it exists)."""
    missing = None
    for path in (directory, *directory.parents):
        if path.exists():
            return missing
        missing = path
    return missing


def remove_if_never_used(directory: Path, made_from: Path | None) -> None:
    """A node that stopped on an error before its first checkpoint, in a checkpoint directory it
    made, leaves no folder behind: a mistyped data path run without --checkpoint-dir must not
    leave ./lowcomm-checkpoints with a fresh identity (the next start makes a new one anyway)."""
    if made_from is None:
        return
    try:
        left = list(directory.iterdir())
        if not {path.name for path in left} <= {".lock", "identity.key"}:
            return
        for path in left:
            path.unlink()
        for folder in (directory, *directory.parents):
            folder.rmdir()  # only empty ones: anything else put there meanwhile stays
            if folder == made_from:
                return
    except OSError:
        pass


def lock_checkpoint_dir(directory: Path):
    """Hold an exclusive lock on the checkpoint directory for the node's lifetime.

    Two nodes in one directory would share an identity (one peer id for two processes) and
    overwrite each other's checkpoints; the second one stops with a clear message instead.
    """
    import fcntl

    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle = open(directory / ".lock", "a+")
    except OSError as err:  # a file of that name, a folder we may not write: a user mistake, no traceback
        raise RuntimeError(f"cannot use checkpoint directory {directory}: {err.strerror}; choose another with "
                           f"--checkpoint-dir (or LOWCOMM_CHECKPOINT_DIR)") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "?"
        handle.close()
        raise RuntimeError(f"checkpoint directory {directory} is in use by another node (pid {owner}); "
                           f"give each node its own --checkpoint-dir") from None
    try:  # unbuffered: a write that fails must not fail again when the file is closed
        os.ftruncate(handle.fileno(), 0)
        os.pwrite(handle.fileno(), str(os.getpid()).encode(), 0)
    except OSError as err:  # a full disk
        handle.close()
        raise RuntimeError(f"cannot use checkpoint directory {directory}: {err.strerror}; free space there, or "
                           f"choose another with --checkpoint-dir (or LOWCOMM_CHECKPOINT_DIR)") from None
    return handle
