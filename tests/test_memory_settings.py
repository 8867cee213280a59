"""node/memory.py: the allocator cap and the pre-fork freeze, each in a fresh interpreter."""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys

import pytest

PROBE = """
import gc, json
import hivemind  # selects torch's file_system strategy at import
import torch.multiprocessing
from lowcomm.node.memory import freeze_before_fork, limit_malloc_arenas, share_tensors_by_descriptor
capped = limit_malloc_arenas()
by_descriptor = share_tensors_by_descriptor()
before = gc.get_freeze_count()
freeze_before_fork()
print(json.dumps({"capped": capped, "by_descriptor": by_descriptor, "strategy": torch.multiprocessing.get_sharing_strategy(),
                  "frozen_before": before, "frozen_after": gc.get_freeze_count()}))
"""


@functools.lru_cache(maxsize=None)  # one interpreter per environment: each costs seconds of imports
def _probe(env: tuple[tuple[str, str], ...]) -> dict:
    return _run_probe(dict(env))


def probe(**env: str) -> dict:
    return _probe(tuple(sorted(env.items())))


def user_chose() -> dict:
    """The probe with both of the user's overrides set (one interpreter for both tests)."""
    return probe(MALLOC_ARENA_MAX="4", HIVEMIND_MEMORY_SHARING_STRATEGY="file_system")


def _run_probe(env: dict[str, str]) -> dict:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("MALLOC_ARENA_MAX", "HIVEMIND_MEMORY_SHARING_STRATEGY")} | env
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, env=environ,
                         timeout=60).stdout
    return json.loads(out.splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="M_ARENA_MAX is glibc's; this libc is not glibc")
def test_arenas_are_capped_unless_the_user_chose_and_objects_are_frozen_before_the_fork():
    default = probe()
    assert default["capped"] is True  # glibc accepted M_ARENA_MAX
    assert default["frozen_before"] == 0 and default["frozen_after"] > 1000  # the imported modules' objects
    assert user_chose()["capped"] is False  # the user's MALLOC_ARENA_MAX wins


def _has_descriptor_sharing() -> bool:
    import torch.multiprocessing

    return "file_descriptor" in torch.multiprocessing.get_all_sharing_strategies()


@pytest.mark.skipif(not _has_descriptor_sharing(), reason="torch offers no file_descriptor sharing on this platform")
def test_tensors_are_shared_by_descriptor_unless_the_user_chose():
    default = probe()
    assert default["by_descriptor"] is True and default["strategy"] == "file_descriptor"
    chosen = user_chose()
    assert chosen["by_descriptor"] is False and chosen["strategy"] == "file_system"
