"""Start N peers of a training script on this machine, each in its own process (no torchrun).

    python examples/launch.py --nproc 2                       # examples/train_hf.py, 2 peers
    python examples/launch.py --nproc 3 --workdir runs/x -- examples/train_hf.py --steps 400

The first process starts the swarm; once it prints its multiaddr (the JSON line
{"event": "example_ready", "multiaddrs": [...]}), the others start with ``--peers <multiaddr>``.
Each gets ``--checkpoint-dir <workdir>/peer-<i>`` and ``--min-peers N`` (the script waits for
the N peers before it trains: ``swarm.wait_for_peers``), so running the same command again resumes
every peer from its checkpoints. Ctrl-C stops them all gracefully (a second Ctrl-C kills them).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent


def start(index: int, nproc: int, script: list[str], workdir: Path, peers: list[str], ready: threading.Event,
          maddrs: list[str]) -> subprocess.Popen:
    command = [sys.executable, *script, "--checkpoint-dir", str(workdir / f"peer-{index}"), "--min-peers", str(nproc)]
    if peers:
        command += ["--peers", *peers]
    # Its own session: a Ctrl-C reaches the launcher only, which stops the peers in order.
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def relay() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if not isinstance(event, dict):
                print(f"[peer-{index}] {line}", end="", flush=True)
                continue
            # The peers log JSON lines (their output is a pipe): shown here as their message.
            print(f"[peer-{index}] {event.get('msg') or json.dumps(event)}", flush=True)
            if event.get("event") == "example_ready" and not ready.is_set():
                maddrs.extend(event["multiaddrs"])
                ready.set()
        ready.set()  # it ended before it was ready: the launcher stops waiting

    threading.Thread(target=relay, daemon=True).start()
    return proc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="number of peers (default 2)")
    parser.add_argument("--workdir", type=Path, default=Path("runs/launch"), help="checkpoints of the peers")
    parser.add_argument("script", nargs="*", help="script and its arguments, after --")
    args = parser.parse_args()
    script = args.script or [str(HERE / "train_hf.py")]
    ready, maddrs = threading.Event(), []
    procs = [start(0, args.nproc, script, args.workdir, [], ready, maddrs)]
    try:
        ready.wait()
        if not maddrs:
            return procs[0].wait() or 1
        for index in range(1, args.nproc):
            procs.append(start(index, args.nproc, script, args.workdir, maddrs[:1], threading.Event(), []))
        codes = [proc.wait() for proc in procs]
    except KeyboardInterrupt:
        print("stopping the peers (Ctrl-C again kills them)", file=sys.stderr, flush=True)
        try:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGINT)
            for proc in procs:
                proc.wait()
        except KeyboardInterrupt:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
        return 130  # each peer stopped gracefully (checkpoint written) or was killed on the second Ctrl-C
    failed = [f"peer-{i} exited with {code}" for i, code in enumerate(codes) if code]
    if failed:
        print("; ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
