"""node/memory.py: the allocator cap and the pre-fork freeze, each in a fresh interpreter."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

PROBE = """
import gc, json
from lowcomm.node.memory import freeze_before_fork, limit_malloc_arenas
capped = limit_malloc_arenas()
before = gc.get_freeze_count()
freeze_before_fork()
print(json.dumps({"capped": capped, "frozen_before": before, "frozen_after": gc.get_freeze_count()}))
"""


def probe(**env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | env
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, env=environ,
                         timeout=60).stdout
    return json.loads(out.splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="M_ARENA_MAX is glibc's; this libc is not glibc")
def test_arenas_are_capped_unless_the_user_chose_and_objects_are_frozen_before_the_fork():
    default = probe()
    assert default["capped"] is True  # glibc accepted M_ARENA_MAX
    assert default["frozen_before"] == 0 and default["frozen_after"] > 1000  # the imported modules' objects
    assert probe(MALLOC_ARENA_MAX="4")["capped"] is False  # the user's MALLOC_ARENA_MAX wins
