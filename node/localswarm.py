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
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from .stopsignals import stop_signals

Event = dict[str, Any]


class NodeExited(TimeoutError):
    """The awaited event can no longer come: the node process has ended. A ``TimeoutError`` for
    the callers that give up on an event either way; ``code`` and ``error`` (the node's own error
    line) say why."""

    def __init__(self, message: str, name: str, code: int, error: str) -> None:
        super().__init__(message)
        self.name = name
        self.code = code
        self.error = error


def node_command() -> list[str]:
    """The CLI of the running installation (the console script next to this interpreter)."""
    script = Path(sys.executable).with_name("lowcomm-node")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lowcomm.node.entry"]


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
                code = self.proc.poll()
                if code is not None and not self._reader.is_alive():
                    error = self._error_line()
                    raise NodeExited(f"{self.name} exited with code {code} before the expected event: {error}\n"
                                     f"last lines:\n{self._tail()}", self.name, code, error)
                if remaining <= 0:
                    raise TimeoutError(f"{self.name}: expected event did not come within {timeout:.0f}s; "
                                       f"exit code {code}; last lines:\n{self._tail()}")
                self._cond.wait(min(remaining, 1.0))

    def _tail(self) -> str:
        return "\n".join(self.raw_lines[-15:])

    def _error_line(self) -> str:
        """The node's own account of its failure: its last error (a JSON error record or a plain
        ``...: error: ...`` line from the CLI or argparse), else its last line. Under ``_cond``."""
        for event in reversed(self.events):
            msg = str(event.get("msg", ""))
            if event.get("level") in ("error", "critical") or (event.get("level") == "raw" and "error" in msg.lower()):
                return msg
        return self.raw_lines[-1] if self.raw_lines else "(no output)"

    def error_line(self) -> str:
        with self._cond:
            return self._error_line()

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
        """SIGKILL the node's process group; its DHT process and p2pd, in a group of their own,
        die with it (node/parentdeath.py)."""
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
    elif kind in ("round_done", "state_downloaded", "waiting_for_peers", "node_stopped") or level in ("warning", "error", "raw"):
        print(f"[{name}] {event.get('msg')}", flush=True)


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


# What the demo makes in its workdir: one checkpoint folder per peer (``peer_args``).
PEER_FOLDER = re.compile(r"peer-[0-9]+")


def clear_workdir(workdir: Path) -> str | None:
    """Start the demo afresh: remove the peer folders a previous demo left in ``workdir``, and
    nothing else. A workdir that holds anything the demo did not make is left alone; the
    returned message says why (None: cleared)."""
    if not workdir.exists():
        return None
    if not workdir.is_dir():
        return f"--workdir {workdir} is a file, not a folder; pick an empty or new folder"
    entries = sorted(workdir.iterdir())
    foreign = [p.name for p in entries if not (PEER_FOLDER.fullmatch(p.name) and p.is_dir() and not p.is_symlink())]
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        return (f"--workdir {workdir} holds {foreign[0]!r}{more}, which the demo did not make (it starts "
                f"afresh by removing only its own peer-N folders); pick an empty or new folder, or pass --keep "
                f"to resume from the checkpoints there")
    for path in entries:
        shutil.rmtree(path)
    return None


def export_command(workdir: Path, extra: list[str]) -> str:
    """The `lowcomm-node export` line that takes the demo's model out of peer-0's checkpoints:
    with the peers' --config and --set flags, which may describe the model."""
    flags, given = [], iter(extra)
    for flag in given:
        if flag in ("--config", "--set"):
            flags += [flag, next(given, "")]
        elif flag.startswith(("--config=", "--set=")):
            flags.append(flag)
    # Outside the workdir: the next demo refuses a workdir holding anything it did not make.
    return shlex.join(["lowcomm-node", "export", "--checkpoint-dir", str(workdir / "peer-0"), *flags,
                       "--out", "demo-model"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lowcomm.node.localswarm",
                                     description="Start a local swarm of lowcomm nodes on loopback.")
    parser.add_argument("--peers", type=_at_least_one, default=3, help="number of peers, at least 1 (default 3)")
    parser.add_argument("--rounds", type=_at_least_one, default=None,
                        help="stop once every peer has completed this many rounds (default: until Ctrl-C)")
    parser.add_argument("--workdir", type=Path, default=Path("runs/demo"),
                        help="checkpoints of the peers, in peer-N folders, removed at the start unless --keep "
                             "(default runs/demo; a folder holding anything else is refused)")
    parser.add_argument("--keep", action="store_true", help="resume from the checkpoints of a previous demo")
    parser.add_argument("extra", nargs="*", help="extra `join` flags for every peer (after --)")
    args = parser.parse_args(argv)
    if not args.keep:
        try:
            refused = clear_workdir(args.workdir)
        except OSError as err:
            refused = f"cannot clear --workdir {args.workdir}: {err}"
        if refused:
            print(f"{parser.prog}: error: {refused}", file=sys.stderr)
            return 2
    extra = list(args.extra)
    nodes: list[NodeProcess] = []
    stopping = threading.Event()
    news = threading.Event()  # an event was logged: look again

    def stop(*_: Any) -> None:
        stopping.set()
        news.set()

    def echo(name: str, event: Event) -> None:
        _print_event(name, event)
        news.set()

    # SIGHUP too (node/stopsignals.py): the nodes run in sessions of their own, where no hangup
    # reaches them, and trained on as orphans when the terminal that ran `make demo` closed.
    previous = {sig: signal.signal(sig, stop) for sig in stop_signals()}
    print(f"starting {args.peers} peers on loopback (checkpoints in {args.workdir}); "
          + (f"they stop once every peer has completed {args.rounds} round(s); " if args.rounds else "")
          + "Ctrl-C stops them", flush=True)
    reported: set[str] = set()  # peers whose failure is told already
    start_failed = False
    try:
        # Every peer waits for all the others before it trains (--wait-for-peers): the first one,
        # which the others bootstrap from, would otherwise take outer steps alone while they start
        # up. So all of them take part in every round, and with --rounds each stops by itself
        # after its rounds (--max-rounds).
        peer_extra = [*extra, "--wait-for-peers", str(args.peers),
                      *(["--max-rounds", str(args.rounds)] if args.rounds else [])]
        first = NodeProcess("peer-0", peer_args(args.workdir, 0, extra=peer_extra), echo=echo)
        nodes.append(first)
        maddr = first.multiaddr
        for index in range(1, args.peers):
            nodes.append(NodeProcess(f"peer-{index}", peer_args(args.workdir, index, [maddr], peer_extra),
                                     echo=echo))
        while not stopping.is_set():
            news.clear()
            if all(n.proc.poll() is not None for n in nodes):
                if args.rounds and all(n.proc.poll() == 0 for n in nodes):
                    print(f"every peer completed {args.rounds} round(s)", flush=True)
                break
            if args.rounds:
                broken = [n for n in nodes if n.proc.poll() not in (None, 0)]
                if broken:
                    for node in broken:
                        print(f"{node.name} exited with code {node.proc.poll()}: {node.error_line()}",
                              file=sys.stderr, flush=True)
                        reported.add(node.name)
                    break
            news.wait(0.5)  # and look at the processes again: an exit logs nothing
    except NodeExited as err:
        print(f"local swarm failed to start: {err.name} exited with code {err.code}: {err.error}", file=sys.stderr)
        reported.add(err.name)
        start_failed = True
    except TimeoutError as err:
        print(f"local swarm failed to start: {err}", file=sys.stderr)
        start_failed = True
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
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    failed = [f"{n.name}={c}" for n, c in zip(nodes, codes) if c != 0 and n.name not in reported]
    if failed:
        print(f"some peers did not exit cleanly: {', '.join(failed)}", file=sys.stderr)
    if failed or reported or start_failed:
        return 1
    print("all peers stopped cleanly", flush=True)
    print(f"the trained model, as a file torch loads: {export_command(args.workdir, extra)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
