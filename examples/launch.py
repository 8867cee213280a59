"""Start N peers of a training script on this machine, each in its own process (no torchrun).

    python examples/launch.py --nproc 2                       # examples/train_hf.py, 2 peers
    python examples/launch.py --nproc 3 --workdir runs/x -- examples/train_hf.py --steps 400

The first process starts the swarm; once it prints its multiaddr (the JSON line
{"event": "example_ready", "multiaddrs": [...]}), the others start with ``--peers <multiaddr>``.
Each gets ``--checkpoint-dir <workdir>/peer-<i>`` and ``--min-peers N`` (the script waits for
the N peers before it trains: ``swarm.wait_for_peers``), so running the same command again resumes
every peer from its checkpoints. Ctrl-C stops them all gracefully (a second Ctrl-C kills them), and
so do SIGTERM and SIGHUP (a closed terminal); a peer that fails stops the others, and a launcher
killed outright (SIGKILL) takes its peers along (each gets SIGTERM: it stops gracefully).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

from lowcomm.node.stopsignals import RepeatFilter

HERE = Path(__file__).resolve().parent


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # Ctrl-C, a scheduler's stop, a closed terminal
# The longest the main thread sleeps in events.get() at a time. Python runs a signal's handler
# when the signal interrupts that wait; one that arrives just before the wait begins (in get()'s
# own C code) interrupts nothing, and with quiet peers the launcher slept on with its stop
# unhandled (CI, twice: SIGTERM and SIGHUP sent back to back). Waking up to run pending handlers
# bounds that to this many seconds.
SIGNAL_CHECK_SECONDS = 0.5

# What a peer runs before it becomes the script: the peers run in sessions of their own, so a
# launcher killed outright (SIGKILL, the OOM killer), which cannot stop them, left them training
# as orphans. Each asks for a SIGTERM, its graceful stop, when the launcher dies (argv[1]: the
# launcher's pid; a peer that finds it gone already does not start).
ORPHAN_GUARD = ("import os, signal, sys\n"
                "from lowcomm.node.parentdeath import die_with_parent\n"
                "die_with_parent(signal.SIGTERM, parent=int(sys.argv[1]))\n"
                "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n")


def start(index: int, nproc: int, script: list[str], workdir: Path, peers: list[str],
          events: queue.SimpleQueue) -> subprocess.Popen:
    command = [sys.executable, "-c", ORPHAN_GUARD, str(os.getpid()), *script,
               "--checkpoint-dir", str(workdir / f"peer-{index}"), "--min-peers", str(nproc)]
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
            if event.get("event") == "example_ready":
                events.put(("ready", index, event["multiaddrs"]))
        # Its exit is reported once its last line is shown: the launcher never ends before that.
        events.put(("exit", index, proc.wait()))

    # Python runs signal handlers in the main thread only, but the kernel gives a signal sent to
    # the process to any thread that does not block it. Taken by a relay thread asleep in read(),
    # a Ctrl-C or SIGTERM left the main thread asleep in events.get() until a peer printed
    # something: with quiet peers, forever. The relay threads block them (a thread inherits the
    # mask of the one that starts it), so they always reach the main thread and wake it.
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        threading.Thread(target=relay, daemon=True).start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
    return proc


def signal_all(procs: dict[int, subprocess.Popen], exited: set[int], signum: int) -> None:
    for index, proc in procs.items():
        if index not in exited:
            try:
                os.killpg(proc.pid, signum)
            except ProcessLookupError:  # it ended just now; its exit event is on its way
                pass


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of peers, at least 1 (got {text!r})")
    return int(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=positive_int, default=2, help="number of peers (default 2)")
    parser.add_argument("--workdir", type=Path, default=Path("runs/launch"), help="checkpoints of the peers")
    parser.add_argument("script", nargs="*", help="script and its arguments, after --")
    args = parser.parse_args()
    script = args.script or [str(HERE / "train_hf.py")]

    # Everything the launcher reacts to arrives here: a peer ready, a peer's exit, a stop signal
    # (SimpleQueue.put may be called from a signal handler; Queue.put may deadlock there).
    events: queue.SimpleQueue = queue.SimpleQueue()
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda signum, _frame: events.put(("signal", signum, None)))
    procs = {0: start(0, args.nproc, script, args.workdir, [], events)}
    exited: dict[int, int] = {}
    failure: str | None = None  # the first exit with an error the launcher did not ask for
    stopped_by: int | None = None  # the signal that stopped the launcher
    ready = False
    repeats = RepeatFilter()  # a stop signal within a second of the first repeats it
    while len(exited) < len(procs):
        try:
            kind, key, value = events.get(timeout=SIGNAL_CHECK_SECONDS)
        except queue.Empty:
            continue  # a stop signal that came in just as get() went to sleep is handled now
        if kind == "ready" and key == 0 and not ready:
            ready = True
            if stopped_by is None and failure is None:
                for index in range(1, args.nproc):
                    procs[index] = start(index, args.nproc, script, args.workdir, value[:1], events)
        elif kind == "exit":
            exited[key] = value
            if value and failure is None and stopped_by is None:  # not an exit the launcher asked for
                failure = f"peer-{key} exited with {value}"
                if len(exited) < len(procs):
                    # The others would wait for it (--min-peers) or train on without it: stop them too.
                    print(f"{failure}: stopping the others", file=sys.stderr, flush=True)
                    signal_all(procs, set(exited), signal.SIGTERM)
        elif kind == "signal":
            if repeats.is_repeat():
                continue  # the same stop: `timeout` signals the launcher and then its process group
            if stopped_by is None:
                stopped_by = key
                print("stopping the peers (Ctrl-C again kills them)", file=sys.stderr, flush=True)
                # A Swarm stops gracefully on SIGTERM (checkpoint written) and its script ends quietly
                # with 143; a SIGINT would end each with a KeyboardInterrupt traceback.
                signal_all(procs, set(exited), signal.SIGTERM)
            else:
                signal_all(procs, set(exited), signal.SIGKILL)
    if stopped_by is not None:
        return 128 + stopped_by
    if not ready:
        print(f"peer-0 ended (exit {exited[0]}) before it printed its example_ready line", file=sys.stderr)
        return exited[0] or 1
    if failure is not None:
        print(failure, file=sys.stderr)
    return 1 if failure is not None else 0


if __name__ == "__main__":
    sys.exit(main())
