"""Process-wide memory settings of the node, applied once at start-up, before any thread runs and
before the DHT process is forked.

**Arenas.** glibc's malloc gives threads that allocate at the same time arenas of their own (up
to 8 per core) and keeps in every arena what its threads once used there, for reuse by the same
arena only. The node's threads touch batch- and model-sized buffers at their own moments: the
training thread (activations, gradients), the report thread (eval on the replica), the codec
threads (Δ, encoded payloads, averages), the event loop (messages), gRPC's and hivemind's. Two
arenas are enough for a process whose heavy work runs in one thread at a time; measured on the
``tiny`` preset in a 3-peer swarm (bench/analysis.md, "Memory of a node") the main process holds
10-20 MB less and grows more slowly over its first rounds; a lone node (no all-reduce) shows no
difference. The DHT process, forked from this one, inherits the setting.

``MALLOC_ARENA_MAX`` in the environment (read by glibc itself) wins over this default.

**Fork.** hivemind's DHT runs in a process forked from the node after torch, hivemind and gRPC
are imported: its pages are shared with the node until either side writes to them, and Python's
garbage collector writes to every object it examines. Freezing the objects that exist at the
fork (``gc.freeze``) keeps both collectors off them: measured on the ``tiny`` preset the DHT
process's private memory drops from 80 MB to 52 MB. They are import-time objects (modules,
classes, functions) that live as long as the process anyway.

**Shared tensors.** hivemind's futures (``MPFuture``) keep their state in bytes of torch shared
memory, and hivemind selects torch's ``file_system`` sharing strategy, for which torch starts a
``torch_shm_manager`` process per node (105 MB RSS, 56 MB of it private: libtorch's relocated
data). With the ``file_descriptor`` strategy the DHT process receives a descriptor per shared
buffer instead and no such process runs; over a 100-round soak with restarts the node's and its
DHT process's open descriptors stayed flat (37-39 and 31). ``HIVEMIND_MEMORY_SHARING_STRATEGY``
in the environment (hivemind's own setting) wins.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's malloc.h
DEFAULT_ARENAS = 2


def limit_malloc_arenas(count: int = DEFAULT_ARENAS) -> bool:
    """Cap glibc's malloc arenas at ``count``; False where it does not apply (another libc, or the
    user set ``MALLOC_ARENA_MAX``). Call it before threads start: arenas made earlier stay."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, Windows): nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(M_ARENA_MAX, count))
    log.debug("malloc arenas capped at %d: %s", count, ok)
    return ok


def freeze_before_fork() -> None:
    """Collect, then move every object into the permanent generation (see "Fork" above)."""
    gc.collect()
    gc.freeze()


def share_tensors_by_descriptor() -> bool:
    """torch's ``file_descriptor`` sharing strategy instead of hivemind's ``file_system`` (see
    "Shared tensors" above); False when the user chose one. Call it before the DHT is created."""
    if os.environ.get("HIVEMIND_MEMORY_SHARING_STRATEGY"):
        return False
    import torch.multiprocessing

    if "file_descriptor" not in torch.multiprocessing.get_all_sharing_strategies():
        return False  # not offered on this platform (macOS has file_system only)
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    return True
