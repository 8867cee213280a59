"""Run several real ``lowcomm-node join`` processes on this machine and follow their events.

Used by ``make demo`` (``python -m lowcomm.node.localswarm``), by the multi-process tests and by
the benchmarks. Each node runs in its own session (so that a signal reaches it and its p2pd
child, and nothing else), logs JSON lines, and a reader thread turns those lines into events
that callers wait for with a condition variable instead of sleeping.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

Event = dict[str, Any]


def node_command() -> list[str]:
    """The CLI of the running installation (the console script next to this interpreter)."""
    script = Path(sys.executable).with_name("lowcomm-node")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lowcomm.node.cli"]


class NodeProcess:
    """One ``lowcomm-node join`` subprocess with its parsed log events."""

    def __init__(self, name: str, args: list[str], env: dict[str, str] | None = None,
                 echo: Callable[[str, Event], None] | None = None, *, command: list[str] | None = None,
                 stdin: bool = False, log_path: Path | None = None) -> None:
        """``command``: another whole command line instead of ``lowcomm-node join args`` (the
        benchmarks run baselines this way); ``stdin``: keep a pipe to it; ``log_path``: copy every
        output line there as it comes."""
        self.name = name
        self.args = args
        self.events: list[Event] = []
        self.raw_lines: list[str] = []
        self._cond = threading.Condition()
        self._echo = echo
        self._log = log_path.open("w", encoding="utf-8") if log_path else None
        full_env = {**os.environ, "LOWCOMM_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            command or [*node_command(), "join", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, env=full_env, text=True, bufsize=1,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                line = line.rstrip("\n")
                if self._log is not None:
                    self._log.write(line + "\n")
                    self._log.flush()
                try:
                    event = json.loads(line)
                    if not isinstance(event, dict):
                        raise ValueError
                except ValueError:
                    event = {"msg": line, "level": "raw"}
                with self._cond:
                    self.raw_lines.append(line)
                    self.events.append(event)
                    self._cond.notify_all()
                if self._echo is not None:
                    self._echo(self.name, event)
        finally:
            if self._log is not None:
                self._log.close()
            with self._cond:
                self._cond.notify_all()

    # -- waiting for what the node says ---------------------------------------------------------

    def wait_for(self, predicate: Callable[[Event], bool], timeout: float, start: int = 0) -> Event:
        """The first event (from index ``start``) matching ``predicate``; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        with self._cond:
            index = start
            while True:
                while index < len(self.events):
                    if predicate(self.events[index]):
                        return self.events[index]
                    index += 1
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    tail = "\n".join(self.raw_lines[-15:])
                    raise TimeoutError(f"{self.name}: expected event did not come within {timeout:.0f}s; "
                                       f"exit code {self.proc.poll()}; last lines:\n{tail}")
                self._cond.wait(min(remaining, 1.0))

    def wait_event(self, name: str, timeout: float, start: int = 0, **fields: Any) -> Event:
        return self.wait_for(lambda e: e.get("event") == name and all(e.get(k) == v for k, v in fields.items()),
                             timeout, start)

    def rounds(self) -> list[Event]:
        with self._cond:
            return [e for e in self.events if e.get("event") == "round_done"]

    def ready(self, timeout: float = 90.0) -> Event:
        return self.wait_event("node_ready", timeout)

    @property
    def multiaddr(self) -> str:
        return self.ready()["multiaddrs"][0]

    # -- stopping -----------------------------------------------------------------------------

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait_exit(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(timeout=5)
        return code

    def kill_all(self) -> None:
        """SIGKILL the node's whole session (the node and its p2pd daemon)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


def peer_args(workdir: Path, index: int, peers: Iterable[str] = (), extra: Iterable[str] = ()) -> list[str]:
    """Loopback flags for peer ``index``: free ports, its own checkpoint directory."""
    args = ["--host", "127.0.0.1", "--grpc-port", "0", "--dht-port", "0", "--metrics-port", "0",
            "--checkpoint-dir", str(workdir / f"peer-{index}"), "--torch-threads", "1"]
    peers = list(peers)
    if peers:
        args += ["--peers", *peers]
    return args + list(extra)


# -- the demo ------------------------------------------------------------------------------------


def _print_event(name: str, event: Event) -> None:
    kind = event.get("event")
    level = event.get("level")
    if kind == "node_ready":
        print(f"[{name}] ready: {event.get('join_command')}", flush=True)
    elif kind in ("round_done", "state_downloaded", "node_stopped") or level in ("warning", "error", "raw"):
        print(f"[{name}] {event.get('msg')}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Start a local swarm of lowcomm nodes on loopback.")
    parser.add_argument("--peers", type=int, default=3, help="number of peers (default 3)")
    parser.add_argument("--rounds", type=int, default=None, help="stop after this many rounds (default: until Ctrl-C)")
    parser.add_argument("--workdir", type=Path, default=Path("runs/demo"), help="checkpoints of the peers")
    parser.add_argument("--keep", action="store_true", help="resume from the checkpoints of a previous demo")
    parser.add_argument("extra", nargs="*", help="extra `join` flags for every peer (after --)")
    args = parser.parse_args(argv)
    if args.workdir.exists() and not args.keep:
        shutil.rmtree(args.workdir)
    extra = list(args.extra) + (["--max-rounds", str(args.rounds)] if args.rounds else [])
    nodes: list[NodeProcess] = []
    stopping = threading.Event()

    def stop(*_: Any) -> None:
        stopping.set()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    print(f"starting {args.peers} peers on loopback (checkpoints in {args.workdir}); Ctrl-C stops them", flush=True)
    try:
        first = NodeProcess("peer-0", peer_args(args.workdir, 0, extra=extra), echo=_print_event)
        nodes.append(first)
        maddr = first.multiaddr
        for index in range(1, args.peers):
            nodes.append(NodeProcess(f"peer-{index}", peer_args(args.workdir, index, [maddr], extra), echo=_print_event))
        while not stopping.is_set() and any(n.proc.poll() is None for n in nodes):
            stopping.wait(0.5)
    except TimeoutError as err:
        print(f"local swarm failed to start: {err}", file=sys.stderr)
        stopping.set()
    finally:
        for node in nodes:
            node.signal(signal.SIGTERM)
        codes = []
        for node in nodes:
            try:
                codes.append(node.wait_exit(60))
            except subprocess.TimeoutExpired:
                node.kill_all()
                codes.append(-9)
    failed = [f"{n.name}={c}" for n, c in zip(nodes, codes) if c != 0]
    if failed:
        print(f"some peers did not exit cleanly: {', '.join(failed)}", file=sys.stderr)
        return 1
    print("all peers stopped cleanly", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
