#!/usr/bin/env python
"""The standard benchmark set (`make bench`): codecs, convergence, slow links, transport, results.

    python bench/run_all.py [--only codecs,convergence,slow_links,transport] [--no-results]

Runs each benchmark with its standard arguments (below) one after the other, records how long
each took in bench/out/standard.jsonl, and regenerates bench/RESULTS.md and bench/plots/ with
``bench/results.py``. Benchmarks that need root (slow links, transport) write a "skipped"
record with the reason instead where network namespaces are unavailable. A benchmark that
exits non-zero is reported and the set goes on with the next one.

The overlap benchmark (``python bench/overlap.py``, issue #8) is not part of the set: it would
take it past 30 minutes on 2 cores. Run it separately; results.py includes its newest run.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import BENCH, OUT, PY, append_jsonl, handle_signals, now_iso, say

# The standard set: sized to finish in under 30 minutes on 2 cores (see bench/README.md).
STANDARD: dict[str, list[str]] = {
    "codecs": [str(BENCH / "codecs.py"), "--repeat", "5"],
    "convergence": [str(BENCH / "convergence.py")],
    "slow_links": [str(BENCH / "slow_links.py")],
    "transport": [str(BENCH / "transport.py")],
}


def run(argv: list[str]) -> int:
    """A benchmark as a child; on SIGTERM/SIGINT it gets SIGTERM too and cleans up before we exit."""
    proc = subprocess.Popen(argv)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGTERM)
        proc.wait(180)
        raise


def run_codecs(argv: list[str], run_id: str) -> int:
    """codecs.py prints bare lines; store them with the run id and date like the others."""
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as tmp:
        code = run([PY, *argv, "--json-out", tmp.name])
        for line in Path(tmp.name).read_text().splitlines():
            record = json.loads(line)
            append_jsonl(OUT / "codecs.jsonl", {"bench": "codecs", "run_id": run_id, "date": now_iso(),
                                               "command": "python bench/codecs.py " + " ".join(argv[1:]), **record})
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(STANDARD), help="comma-separated subset of " + ",".join(STANDARD))
    parser.add_argument("--no-results", action="store_true", help="do not regenerate RESULTS.md and the plots")
    args = parser.parse_args(argv)
    handle_signals()
    steps = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STANDARD]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}; choose from {', '.join(STANDARD)}")
    run_id = time.strftime("%Y%m%dT%H%M%S")
    total = time.monotonic()
    failed = []
    for name in steps:
        started = time.monotonic()
        shown = [Path(a).relative_to(BENCH.parent).as_posix() if a.startswith("/") else a for a in STANDARD[name]]
        say(f"== {name}: python {' '.join(shown)}")
        code = run_codecs(STANDARD[name], run_id) if name == "codecs" else run([PY, *STANDARD[name]])
        seconds = time.monotonic() - started
        append_jsonl(OUT / "standard.jsonl", {"bench": "standard", "run_id": run_id, "date": now_iso(), "step": name,
                                             "seconds": seconds, "returncode": code})
        say(f"== {name}: exit {code} after {seconds:.0f} s")
        if code != 0:
            failed.append(name)
    append_jsonl(OUT / "standard.jsonl", {"bench": "standard", "run_id": run_id, "date": now_iso(), "step": "total",
                                         "seconds": time.monotonic() - total, "returncode": len(failed)})
    if not args.no_results:
        run([PY, str(BENCH / "results.py")])
    say(f"standard set done in {time.monotonic() - total:.0f} s" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
