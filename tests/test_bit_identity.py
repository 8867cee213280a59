"""θ_global is bit-identical whatever a member's CPU kernels and thread count (DESIGN §4).

The round arithmetic (tests/round_arithmetic.py: decode, owner average, outer step, over 1M+
values and six rounds through every lossy codec) runs in subprocesses, each under another
``ATEN_CPU_CAPABILITY`` (torch's generic, AVX2 or AVX-512 kernels) and 1 or 2 torch threads,
and every run must print the same SHA-256. Each run reports the kernels torch actually picked: the
tests of a capability this CPU lacks are skipped, naming the kernels torch ran instead (or the
illegal instruction the worker died of, as torch 2.13 asked for AVX-512 on an AMD EPYC without it).
"""

from __future__ import annotations

import ast
import json
import os
import platform
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("round_arithmetic.py")
# The ``ATEN_CPU_CAPABILITY`` values of this architecture's torch builds (on arm64 the default
# kernels are NEON ones).
CAPABILITIES = {"x86_64": ("default", "avx2", "avx512"), "AMD64": ("default", "avx2", "avx512"),
                "aarch64": ("default", "sve256"), "arm64": ("default", "sve256")}.get(platform.machine(), ("default",))
THREADS = (1, 2)


def run_worker(capability: str) -> list[dict] | None:
    """The worker's result per thread count; None when this CPU cannot run those kernels: torch
    falls back to the best the CPU has on some machines, and on others (torch 2.13 asked for
    AVX-512 on an AMD EPYC without it) the worker dies of an illegal instruction."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    out = subprocess.run([sys.executable, str(WORKER), "--threads", *map(str, THREADS)], env=env,
                         capture_output=True, text=True, timeout=240)
    if out.returncode == -signal.SIGILL:
        return None
    assert out.returncode == 0, f"ATEN_CPU_CAPABILITY={capability} failed:\n{out.stderr}"
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict] | None]:
    """capability -> the worker's result per thread count (in THREADS order)."""
    with ThreadPoolExecutor(2) as pool:  # two at a time: the suite's machine has two cores
        results = dict(zip(CAPABILITIES, pool.map(run_worker, CAPABILITIES)))
    for per_thread in filter(None, results.values()):
        assert [r["threads"] for r in per_thread] == list(THREADS), "torch.set_num_threads did not take effect"
    return results


def honoured(runs: dict[str, list[dict] | None], capability: str) -> list[dict]:
    """The runs under ``capability``; a skip with the reason when torch did not pick those kernels
    (it falls back to the best the CPU has when asked for more, or the worker died of SIGILL)."""
    if runs[capability] is None:
        pytest.skip(f"this CPU lacks ATEN_CPU_CAPABILITY={capability}: the worker died of an illegal instruction")
    ran = {r["capability"] for r in runs[capability]}
    if ran != {capability.upper()}:
        pytest.skip(f"this CPU lacks ATEN_CPU_CAPABILITY={capability}: torch ran its {', '.join(sorted(ran))} kernels")
    return runs[capability]


def test_generic_kernels_give_one_digest_on_1_and_2_threads(runs):
    generic = honoured(runs, "default")
    assert len({r["sha256"] for r in generic}) == 1, generic


@pytest.mark.parametrize("capability", CAPABILITIES[1:])
def test_vectorised_kernels_give_the_generic_digest(runs, capability):
    generic = honoured(runs, "default")[0]["sha256"]
    digests = {f"{capability}/{r['threads']} threads": r["sha256"] for r in honoured(runs, capability)}
    assert set(digests.values()) == {generic}, f"θ_global differs from the generic kernels' {generic}: {digests}"


@pytest.mark.parametrize("capability", CAPABILITIES[1:])
def test_the_former_fused_outer_step_gives_other_bits(runs, capability):
    """The checks above can fail: the outer step as written before (``add/sub(..., alpha=)``)
    gives the vectorised kernels other bits than the generic ones on the same inputs. Thread
    counts never mattered (the ops are elementwise); the kernels did."""
    generic = honoured(runs, "default")
    vectorised = honoured(runs, capability)
    assert len({r["fused_sha256"] for r in generic + vectorised}) == 2
    assert vectorised[0]["fused_sha256"] != generic[0]["fused_sha256"]


# Modules whose arithmetic reaches θ_global, the outer momentum or a decoded average.
SHARED_STATE_MODULES = ("protocol/outer.py", "protocol/aggregation.py", "protocol/allreduce.py", "protocol/gossip.py",
                        "protocol/state.py", "protocol/codecs", "node/averaging.py", "node/commit.py", "node/driver.py",
                        "node/overlap.py", "node/globalstate.py",
                        "node/gossip_mode.py")
FUSED = {"addcmul", "addcmul_", "addcdiv", "addcdiv_", "lerp", "lerp_", "addmm", "addmv", "baddbmm", "fma"}


def test_no_fused_multiply_add_where_the_shared_state_is_computed():
    """The subprocess runs above cover the code they run; this covers the rest of those modules:
    no ``alpha=`` keyword (a fused multiply-add in vectorised kernels only) and no fused op."""
    root = Path(__file__).resolve().parent.parent
    found = []
    for name in SHARED_STATE_MODULES:
        path = root / name
        for source in sorted(path.glob("*.py")) if path.is_dir() else [path]:
            for node in ast.walk(ast.parse(source.read_text(), str(source))):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if called in FUSED or any(k.arg == "alpha" for k in node.keywords):
                    found.append(f"{source.relative_to(root)}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not found, "fused multiply-adds round differently per CPU kernel (see protocol/outer.py):\n" + "\n".join(found)
