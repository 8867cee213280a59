"""θ_global is bit-identical whatever a member's CPU kernels and thread count (DESIGN §4).

The round arithmetic (tests/round_arithmetic.py: decode, owner average, outer step, over 1M+
values and six rounds through every lossy codec) runs in subprocesses, each under another
``ATEN_CPU_CAPABILITY`` (torch's generic, AVX2 or AVX-512 kernels) and 1 or 2 torch threads,
and every run must print the same SHA-256. Each run reports the kernels torch actually picked: a
capability this CPU lacks is left out, with the reason in the test output.
"""

from __future__ import annotations

import json
import os
import platform
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


def run_worker(capability: str) -> list[dict]:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    out = subprocess.run([sys.executable, str(WORKER), "--threads", *map(str, THREADS)], env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, f"ATEN_CPU_CAPABILITY={capability} failed:\n{out.stderr}"
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, int], dict]:
    """(capability, threads) -> the worker's result, for the capabilities torch honoured here."""
    with ThreadPoolExecutor(2) as pool:  # two at a time: the suite's machine has two cores
        results = dict(zip(CAPABILITIES, pool.map(run_worker, CAPABILITIES)))
    honoured = {}
    for capability, per_thread in results.items():
        for threads, result in zip(THREADS, per_thread, strict=True):
            if result["capability"].lower() != capability:
                # torch falls back to the best kernels the CPU has when asked for more.
                print(f"left out ATEN_CPU_CAPABILITY={capability}: this CPU ran {result['capability']} kernels instead")
                break
            assert result["threads"] == threads, f"torch.set_num_threads({threads}) did not take effect"
            honoured[capability, threads] = result
    return honoured


def kernels(runs: dict) -> set[str]:
    return {capability for capability, _ in runs}


def test_round_arithmetic_is_bit_identical_across_kernels_and_threads(runs):
    assert ("default", 1) in runs and ("default", 2) in runs, "the generic kernels run everywhere"
    if len(kernels(runs)) < 2:
        pytest.skip("this CPU offers torch no vectorised kernels besides the default ones")
    digests = {f"{capability}/{threads} threads": r["sha256"] for (capability, threads), r in runs.items()}
    assert len(set(digests.values())) == 1, f"θ_global differs between kernels or thread counts: {digests}"


def test_the_former_fused_outer_step_differs_across_kernels(runs):
    """The check above can fail: the outer step as written before (``add/sub(..., alpha=)``)
    gives the generic kernels other bits than the vectorised ones on the same inputs. Thread
    counts never mattered (the ops are elementwise); the kernels did."""
    vectorised = kernels(runs) - {"default"}
    if not vectorised:
        pytest.skip("this CPU offers torch no vectorised kernels besides the default ones")
    for capability in kernels(runs):
        assert len({runs[capability, t]["fused_sha256"] for t in THREADS}) == 1
    generic = runs["default", 1]["fused_sha256"]
    for capability in vectorised:
        assert runs[capability, 1]["fused_sha256"] != generic, (
            f"the fused step gave the same bits on {capability} as on the generic kernels")
