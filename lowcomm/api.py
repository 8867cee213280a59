"""``lowcomm.Swarm``: lowcomm's sync inside your own training loop.

::

    with lowcomm.Swarm(model, optimizer, config={"train": {"inner_steps": 50}}, peers=[maddr]) as swarm:
        for batch in data:
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            swarm.step(tokens=batch["input_ids"].numel(), loss=loss)

Entering starts a full lowcomm node (the daemon's own code: DHT, gRPC server, rounds, codecs,
catch-up, checkpoints, metrics) in a background thread with its own event loop, and returns once
the node has joined the swarm and caught up: the model then holds the swarm's θ_global. Every
``[train] inner_steps`` calls of ``swarm.step()`` the node runs a round: blocking (``step()``
returns after it) or overlapped (``[sync] overlap``: ``step()`` returns at once and the round's
result reaches the model between two later steps). The node touches the model only while your
thread waits in ``step()`` (node/external_trainer.py), so nothing needs a lock.

Leaving the block stops the node as SIGINT stops the daemon: the round in flight gets the grace
period, local progress is folded into the residual, a checkpoint is written, the peer leaves the
DHT, and the model holds θ_global. A Ctrl-C in the loop does the same, and so do SIGTERM and
SIGHUP (lowcomm/api_signals.py); a second one while it stops ends the process within seconds, as
with the daemon. ``step()`` raises ``SwarmStopped`` once the node is gone (it failed, or
``[node] max_rounds`` was reached), never hangs.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import math
import numbers
import re
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn
import uvloop

from lowcomm.node import checkpoint
from lowcomm.node.external_trainer import EvaluatingExternalTrainer, ExternalTrainer, SwarmStopped

from .api_config import ConfigLike, SwarmConfig, SwarmError, resolve_config
from .api_signals import Terminated, give_back_stop_signals, take_stop_signals

__all__ = ["Swarm", "SwarmError", "SwarmStopped"]

log = logging.getLogger("lowcomm.api")
STOP_WAIT = 5.0  # seconds for the node's loop to take a stop request
PEER_POLL = 0.25  # seconds between two looks at the node's view in wait_for_peers
FORCED_EXIT_WAIT = 15.0  # after a second Ctrl-C the node's own watchdog ends the process within 10 s


class _ThreadLoop(uvloop.Loop):
    """The node's event loop in a thread that is not the main thread, where signal handlers
    cannot be installed: signals reach your main thread (Ctrl-C as KeyboardInterrupt), and
    leaving the ``with`` block stops the node instead."""

    def add_signal_handler(self, sig: int, callback: Callable[..., Any], *args: Any) -> None:
        return None


_open_swarm: "weakref.ref[Swarm] | None" = None  # the one Swarm of this process that is open
_open_guard = threading.Lock()


class Swarm:
    """A lowcomm peer driven by your training loop; use it as a context manager (module docstring).

    ``model``: a ``torch.nn.Module`` (any device); its trainable parameters (``requires_grad``
    when the Swarm is made, float32) are what peers average, in ``model.parameters()`` order;
    frozen ones (a LoRA fine-tune's base: any dtype) must be equal on every peer, which the run
    fingerprint checks (node/averaged_params.py). With a ``[model]`` section in ``config`` the
    averaged ones are those the config's model trains, as ``lowcomm-node`` peers of it average.
    ``inner_optimizer``: the optimizer your loop steps; its state is checkpointed with the node's.
    ``config``: a ``lowcomm.node.config.Config``, a dict of the CLI config file's sections
    (``{"train": {"inner_steps": 20}, "sync": {"codec": "int8"}}``) or the path of such a TOML
    file; ``[train] inner_steps`` is H, ``[node]`` says where to listen and checkpoint (ports
    default to free ones). ``peers``: multiaddrs of peers in the swarm (none:
    start a new swarm). ``eval_fn(model) -> float``: optional held-out loss; with it every
    committed θ_global is evaluated on a replica of the model (one more copy of the parameters).
    ``log``: lowcomm's log lines on stdout (``[node] log_format``/``log_level``); False: they
    propagate to your own logging setup instead.
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, config: ConfigLike = None,
                 peers: list[str] | None = None, eval_fn: Callable[[nn.Module], float] | None = None,
                 log: bool = True) -> None:
        if not isinstance(model, nn.Module):
            raise SwarmError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise SwarmError(f"inner_optimizer must be a torch.optim.Optimizer, not {type(inner_optimizer).__name__}")
        _check_model_holds_values(model)
        if eval_fn is not None and not callable(eval_fn):
            raise SwarmError(f"eval_fn must be a function of the model returning its held-out loss, "
                             f"not {type(eval_fn).__name__}")
        self.config: SwarmConfig = resolve_config(config, peers, model)
        _check_model_and_optimizer(model, inner_optimizer, self.config.averaged_mask)
        self.model = model
        self._optimizer = inner_optimizer
        self._eval_fn = eval_fn
        self._log = log
        self._to_load: dict[str, Any] | None = None
        self._trainer: ExternalTrainer | None = None
        self._node: Any = None  # lowcomm.node.daemon.Node, built in the node's thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dht: Any = None
        self._lock: Any = None
        self._error: BaseException | None = None
        self._stop_sent = False  # the user's side asked the node to stop
        self._stop_delivered = False  # the node got that request (exactly once)
        self._stop_lock = threading.Lock()
        self._signals: dict[int, Any] = {}  # stop signals' handlers replaced while open
        self._exited = False
        self._made_from: Path | None = None  # the outermost folder of checkpoint_dir that open() made
        self._discard_if_unused = False  # open() failed: remove that folder if nothing of value is in it
        self._restore_logging: Callable[[], None] = lambda: None

    # -- entering and leaving -------------------------------------------------------------------

    def __enter__(self) -> "Swarm":
        if self._thread is not None or self._exited:
            raise SwarmError("a Swarm can be entered (opened) once; make a new lowcomm.Swarm to join again")
        from lowcomm.node.checkpoint_dir import first_missing, lock_checkpoint_dir, remove_if_never_used
        from lowcomm.node.cli import read_credentials, start_dht
        from lowcomm.node.memory import limit_malloc_arenas, share_tensors_by_descriptor

        self._claim_the_process()  # before the checkpoint folder is locked: the other may hold it
        cfg = self.config
        directory = Path(cfg.node.checkpoint_dir)
        self._made_from = first_missing(directory)  # as `lowcomm-node join`: a failed start leaves no new folder
        try:
            secret, tls = read_credentials(cfg.node)
            self._lock = lock_checkpoint_dir(directory)
        except RuntimeError as err:
            self._release_the_process()  # nothing started
            if not (directory / ".lock").exists():  # else another node made the folder meanwhile and holds it
                remove_if_never_used(directory, self._made_from)
            raise SwarmError(_in_api_terms(str(err))) from None
        try:
            if self._to_load is not None:
                self._write_loaded_state(self._to_load)
            limit_malloc_arenas()
            import hivemind  # noqa: F401 - its import selects torch's file_system sharing; undone next

            share_tensors_by_descriptor()  # before hivemind's first future: no torch_shm_manager process
            # After hivemind's import, which sets its logger to INFO ("Generating new identity ..." on
            # stderr, in your program's output whatever ``log`` says): its warnings only, as in the CLI.
            logging.getLogger("hivemind").setLevel(logging.WARNING)
            self._restore_logging = self._setup_logging() if self._log else (lambda: None)
            try:
                self._dht = start_dht(cfg)  # forks the DHT process: before any gRPC object exists
            except RuntimeError as err:
                raise SwarmError(_in_api_terms(str(err))) from None
            kind = EvaluatingExternalTrainer if self._eval_fn is not None else ExternalTrainer
            self._trainer = kind(self.model, self._optimizer, self._eval_fn, averaged_mask=cfg.averaged_mask)
            _say_frozen_parameters_are_averaged(self._trainer)
            self._thread = threading.Thread(target=self._run_node, args=(secret, tls), name="lowcomm-node",
                                            daemon=True)
            self._thread.start()
            _close_when_the_program_ends(self)
            self._signals = take_stop_signals()  # SIGTERM, SIGHUP: leave as on Ctrl-C (api_signals.py)
            self._trainer.handoff.wait_started(self._thread.is_alive)
        except BaseException as err:
            self._discard_if_unused = True  # a folder this open() made and nothing was written in: removed
            self._close(err)
            if isinstance(err, SwarmStopped):
                raise SwarmError(str(err)) from None
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._close(exc)
        if self._error is not None and exc is None:
            raise SwarmError(_describe_failure(self._error)) from None

    def open(self) -> "Swarm":
        """Join the swarm as entering the ``with`` block does, for a loop that cannot sit in one
        (callbacks, a notebook): ``swarm = lowcomm.Swarm(...).open()``, and ``swarm.close()``
        at the end (or the Swarm is left as the program ends). Returns the Swarm."""
        return self.__enter__()

    def close(self) -> None:
        """Leave the swarm as leaving the ``with`` block does, for a loop that cannot sit in one
        (callbacks, a notebook). Idempotent; raises SwarmError if the node failed. A Swarm never
        opened has nothing to leave: it stays as it was, and may still be opened."""
        if self._thread is None and self._dht is None and self._lock is None and not self._exited:
            return  # it marked the Swarm as left: a later open() was refused as "entered once"
        self.__exit__(None, None, None)

    def _require_open(self, what: str) -> ExternalTrainer:
        """The trainer ``what`` talks to; SwarmError before the Swarm is open, SwarmStopped once left."""
        if self._exited:
            raise SwarmStopped(f"Swarm.{what} after the Swarm was left (closed): its node is gone; make a new "
                               f"Swarm to join again")
        if self._trainer is None:
            raise _not_open(what)
        return self._trainer

    def _run_node(self, secret: bytes | None, tls: Any) -> None:
        """The node's thread: its own event loop, until the node stops."""
        from lowcomm.node.daemon import Node

        assert self._trainer is not None
        reason = "the node stopped"

        async def main() -> int:
            self._loop = asyncio.get_running_loop()
            self._node = Node(self.config, self._dht, False, secret, tls, trainer=self._trainer)
            if self._stop_sent:  # the block was left (or interrupted) before the loop could take the request
                self._deliver_stop()
            return await self._node.run()

        try:
            with asyncio.Runner(loop_factory=_ThreadLoop) as runner:
                runner.run(main())
            if self._node is not None and self._node.unsaved is not None:  # a full disk, say
                from lowcomm.node.errors import FatalError

                raise FatalError(self._node.unsaved)
            max_rounds = self.config.node.max_rounds
            if not self._stop_sent and max_rounds is not None:
                reason = f"the node stopped after [node] max_rounds = {max_rounds} rounds"
        except BaseException as err:  # noqa: BLE001 - handed to the user's thread, never lost
            self._error = err
            reason = _describe_failure(err)
            if not _is_user_facing(err):
                log.exception("the node failed")
        finally:
            self._trainer.handoff.close(reason)

    def _claim_the_process(self) -> None:
        """One open Swarm per process: hivemind forks the second one's DHT process while the
        first one's gRPC threads run, and the second node then hung (README, Limits)."""
        global _open_swarm
        with _open_guard:
            other = _open_swarm() if _open_swarm is not None else None
            if other is not None and other is not self:
                raise SwarmError("another lowcomm.Swarm is open in this process: leave it first, or run each peer "
                                 "in its own process (examples/launch.py starts N of them)")
            _open_swarm = weakref.ref(self)

    def _release_the_process(self) -> None:
        global _open_swarm
        with _open_guard:
            if _open_swarm is not None and _open_swarm() is self:
                _open_swarm = None

    def _close(self, exc: BaseException | None) -> None:
        """Stop the node gracefully (a second KeyboardInterrupt: forced), then the DHT; idempotent."""
        if self._exited:
            return
        self._exited = True
        try:
            if self._thread is not None:
                self._request_stop()
                if self._trainer is not None:
                    self._trainer.handoff.leave()  # the phase in progress ends with the steps taken
                try:
                    _join(self._thread)
                except (KeyboardInterrupt, Terminated):
                    log.warning("second interrupt: the node abandons what it does and exits within seconds")
                    self._call_in_loop(lambda: self._node.request_stop())  # the second request forces
                    self._thread.join(FORCED_EXIT_WAIT)
                    raise
        finally:
            if self._dht is not None:
                self._dht.shutdown()
            # A failed open, or a node that failed later without a checkpoint written (the folder
            # holds its lock and identity only: remove_if_never_used checks), leaves no folder it
            # made, as `lowcomm-node join` does; a node still running keeps it.
            failed = self._discard_if_unused or self._error is not None
            if failed and not (self._thread is not None and self._thread.is_alive()):
                from lowcomm.node.checkpoint_dir import remove_if_never_used

                # Still holding the lock: no other node can have started in the folder meanwhile.
                remove_if_never_used(Path(self.config.node.checkpoint_dir), self._made_from)
            if self._lock is not None:
                self._lock.close()
            self._restore_logging()
            give_back_stop_signals(self._signals)
            self._release_the_process()

    def _request_stop(self) -> None:
        if self._stop_sent or self._thread is None or not self._thread.is_alive():
            return
        self._stop_sent = True  # a node built after this point is stopped by main() itself
        done = threading.Event()

        def stop() -> None:
            self._deliver_stop()
            done.set()

        if self._call_in_loop(stop):
            done.wait(STOP_WAIT)

    def _deliver_stop(self) -> None:
        """The one graceful stop request (a second one would force the stop); in the node's loop."""
        with self._stop_lock:
            if self._stop_delivered or self._node is None:
                return
            self._stop_delivered = True
        self._node.request_stop()

    def _call_in_loop(self, fn: Callable[[], None]) -> bool:
        loop = self._loop
        if loop is None or loop.is_closed():
            return False
        try:
            loop.call_soon_threadsafe(fn)
        except RuntimeError:  # closed in between
            return False
        return True

    def _setup_logging(self) -> Callable[[], None]:
        """lowcomm's records on stdout, in the CLI's format, without touching the root logger."""
        from lowcomm.node.logs import HumanFormatter, JsonFormatter, TerminalHandler

        node = self.config.node
        human = node.log_format == "text" or (node.log_format == "auto" and sys.stdout.isatty())
        handler = TerminalHandler(sys.stdout) if human else logging.StreamHandler(sys.stdout)
        handler.setFormatter(HumanFormatter() if human else JsonFormatter())
        logger = logging.getLogger("lowcomm")
        before = (logger.level, logger.propagate)
        logger.addHandler(handler)
        logger.setLevel(node.log_level.upper())
        logger.propagate = False
        logging.getLogger("hivemind").setLevel(max(logging.WARNING, logger.level))  # log_level error: theirs too

        def restore() -> None:
            logger.removeHandler(handler)
            logger.setLevel(before[0])
            logger.propagate = before[1]

        return restore

    # -- the training loop ----------------------------------------------------------------------

    def step(self, tokens: int = 1, loss: float | torch.Tensor | None = None) -> None:
        """Call once after each inner optimizer step. ``tokens``: what the step trained on (its
        weight in the average; say the same unit on every peer, e.g. tokens or samples). ``loss``:
        for the logs and metrics. Every ``[train] inner_steps`` calls it runs a round (see the
        module docstring). Raises ``SwarmStopped`` when the node is gone."""
        trainer = self._require_open("step()")
        if isinstance(tokens, torch.Tensor) and tokens.numel() == 1 and not tokens.is_floating_point():
            tokens = int(tokens.item())  # attention_mask.sum()
        if isinstance(tokens, bool) or not isinstance(tokens, numbers.Integral) or tokens <= 0:
            # A fraction would be truncated to a weight of 0: the step would count for nothing.
            raise ValueError(f"tokens must be a positive whole number (tokens or samples of the step), got {tokens!r}")
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(f"loss must be the step's scalar loss, got a tensor of shape {tuple(loss.shape)}")
            loss = float(loss.detach())
        elif loss is not None and (isinstance(loss, bool) or not isinstance(loss, numbers.Real)):
            # A list or a string reached float(): Python's TypeError or "could not convert string to float".
            raise ValueError(f"loss must be the step's scalar loss (a number or a one-element tensor), got "
                             f"{type(loss).__name__} {loss!r}"[:200])
        trainer.handoff.report(int(tokens), math.nan if loss is None else float(loss))

    # -- state ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This peer's newest checkpoint, as the node writes it: ``step``, ``params`` (θ_global),
        ``momentum`` (outer optimizer), ``residual``/``owner_residual`` (error feedback),
        ``params_sha256``, ``config_fingerprint``, ``trainer`` (the inner optimizer's state) and
        ``tokens_total``. Inside the block: as of the last committed round (its checkpoint, what a
        crash would resume from); after it: as of the stop, local progress folded in."""
        self._wait_for_pending_checkpoints()
        found = checkpoint.load_latest(self.config.node.checkpoint_dir)
        failure = self._node.checkpoint_failure if self._node is not None else None
        newest_step = None if found is None else int(found[0]["step"])
        if failure is not None and (newest_step is None or newest_step < failure[0]):
            newest = "none was written" if newest_step is None else f"the newest written is of step {newest_step}"
            raise SwarmError(_in_api_terms(f"the checkpoint of step {failure[0]} could not be written "
                                           f"({failure[1]}), and {newest}"))
        if found is None:
            raise SwarmError(f"no checkpoint in {self.config.node.checkpoint_dir} yet: the node writes one after "
                             f"each round and when it stops")
        return found[0]

    def _wait_for_pending_checkpoints(self) -> None:
        """Inside the block, wait until the report thread wrote the checkpoints of the rounds
        committed so far: it writes each just after its round commits, so right after ``step()``
        returned from a round the newest file on disk was still the one before (or none)."""
        node, loop, thread = self._node, self._loop, self._thread
        if self._exited or node is None or loop is None or thread is None:
            return
        if threading.current_thread().name.startswith("lowcomm"):
            return  # called from the node's own threads (an eval_fn runs in the report thread): it would wait on itself
        try:
            written = asyncio.run_coroutine_threadsafe(node.reports.flush(), loop)
        except RuntimeError:  # the loop closed meanwhile: the stop has written the last checkpoint
            return
        while True:
            try:
                written.result(PEER_POLL)
                return
            except concurrent.futures.TimeoutError:
                if not thread.is_alive():  # a loop that ended never runs the flush
                    written.cancel()
                    return

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state`` (what ``state_dict`` returned, or a checkpoint the node wrote):
        call it before entering; the node then restores θ_global, the outer state, the step and
        the inner optimizer, and the model starts from θ_global. A swarm further ahead is caught up
        with as usual."""
        if self._thread is not None or self._exited:
            raise SwarmError("call load_state_dict before entering the Swarm (or opening it): a running peer takes "
                             "its state from the swarm, not from a file")
        if not isinstance(state, Mapping):
            raise SwarmError(f"load_state_dict takes the dict Swarm.state_dict() returned (or "
                             f"lowcomm.node.checkpoint.read(path) of a checkpoint file the node wrote), not "
                             f"{type(state).__name__}")
        missing = [key for key in ("step", "params", "momentum", "params_sha256", "trainer") if key not in state]
        if missing:
            raise SwarmError(f"the state given to load_state_dict lacks {', '.join(missing)}: pass what "
                             f"Swarm.state_dict() returned")
        if state.get("config_fingerprint") != self.config.run_fingerprint():
            raise SwarmError("the state given to load_state_dict belongs to another run config or model (its "
                             "fingerprint differs): resume with the config and model it was saved with")
        self._to_load = state

    def _write_loaded_state(self, state: dict[str, Any]) -> None:
        """The state to resume from becomes the newest checkpoint of the (locked) directory,
        where the node's start-up reads it like any other."""
        directory = self.config.node.checkpoint_dir
        newer = [p for p in checkpoint.list_checkpoints(directory) if _step_of(p) > int(state["step"])]
        if newer:
            raise SwarmError(f"{directory} holds a newer checkpoint ({newer[-1].name}) than the state given to "
                             f"load_state_dict (step {int(state['step'])}): the node would resume from that one; "
                             f"use another [node] checkpoint_dir")
        checkpoint.save(directory, int(state["step"]), state)

    # -- what the node says ---------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """What ``lowcomm-node status --json`` prints: step, params hash, swarm peers, losses, ..."""
        from lowcomm.node.cli import status_dict

        self._require_open("status()")
        node, loop = self._node, self._loop
        if node is None or loop is None or loop.is_closed():
            raise SwarmStopped("Swarm.status(): the node is not running (it stopped or failed); make a new Swarm to "
                               "join again")
        return status_dict(asyncio.run_coroutine_threadsafe(node.status(), loop).result(10))

    def wait_for_peers(self, count: int, timeout: float | None = None) -> int:
        """Wait until the swarm has at least ``count`` live peers of this run (this one included)
        and return how many it has: a launcher's first peer waits for the others this way
        instead of training its first rounds alone. The node's view is refreshed every
        ``[node] heartbeat_interval``. Raises ``TimeoutError`` after ``timeout`` seconds."""
        trainer = self._require_open("wait_for_peers()")
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1:
            raise ValueError(f"count must be a whole number of peers, at least 1 (this one), got {count!r}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
                                    or not 0 <= timeout < math.inf):
            # "1" failed as float + str (a TypeError); -1 timed out at once, "after -1 s".
            raise ValueError(f"timeout must be a number of seconds, 0 or more (None: wait as long as it takes), "
                             f"got {timeout!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if trainer.handoff.closed is not None:
                raise SwarmStopped(trainer.handoff.closed)
            node = self._node
            seen = len(set(node.view.peers) | {node.peer_id})  # the view is replaced whole, never edited
            if seen >= count:
                return seen
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"the swarm has {seen} peer(s) after {timeout:.0f} s, not {count}")
            time.sleep(PEER_POLL)

    # Once open, these stay readable after the Swarm is left: the last values of its run. Before it is
    # open there is nothing to read (the step comes from the checkpoint the node restores as it
    # starts): SwarmError, as for every other use of a Swarm that is not open.

    @property
    def peer_id(self) -> str:
        """This peer's libp2p id."""
        return str(self._require_dht("peer_id").peer_id)

    @property
    def multiaddrs(self) -> list[str]:
        """Where other peers join this one: pass one of them as their ``peers``."""
        node = self._node
        if node is not None:
            return list(node.multiaddrs)
        return [str(m) for m in self._require_dht("multiaddrs").get_visible_maddrs()]

    @property
    def outer_step(self) -> int:
        """The committed outer step (the one restored from the checkpoint, before the first round)."""
        if self._trainer is None:
            raise _not_open("outer_step")
        node = self._node
        return node.state.published()[0] if node is not None and hasattr(node, "state") else 0

    @property
    def inner_steps(self) -> int:
        """Inner steps this peer took, over all its runs from the same checkpoints."""
        if self._trainer is None:
            raise _not_open("inner_steps")
        return self._trainer.inner_steps_done

    def _require_dht(self, what: str) -> Any:
        if self._dht is None:
            raise _not_open(what)
        return self._dht


def _not_open(what: str) -> SwarmError:
    """The one error of every use of a Swarm that needs its node, before the Swarm is open."""
    return SwarmError(f"Swarm.{what} needs an open Swarm: use it inside `with lowcomm.Swarm(...) as swarm:`, or "
                      f"after swarm = lowcomm.Swarm(...).open()")


def _close_when_the_program_ends(swarm: Swarm) -> None:
    """A Swarm still open when the program ends is left as the ``with`` block would leave it.

    It must happen before Python joins its thread pools at exit: the node's training thread is
    one of them, waiting inside the Swarm for steps that will not come, and the program hung
    there. ``atexit`` runs too late; ``threading``'s own exit hooks run first (newest first), the
    way ``concurrent.futures`` registers its join."""
    ref = weakref.ref(swarm)

    def close() -> None:
        open_swarm = ref()
        if open_swarm is None or open_swarm._exited:
            return
        log.warning("the program ended inside a lowcomm.Swarm; leaving it now (use `with` or call close())")
        try:
            open_swarm._close(None)
        except BaseException:  # noqa: BLE001 - at exit: say it, let the interpreter finish
            log.exception("leaving the swarm at exit failed")

    register = getattr(threading, "_register_atexit", atexit.register)
    register(close)


def _say_frozen_parameters_are_averaged(trainer: ExternalTrainer) -> None:
    """A [model] run averages what the config's model trains, also where the model given freezes
    it (lowcomm-node peers of the config train it): one line that says what they cost and how
    to leave them out, since a LoRA user would not expect it."""
    frozen = [p for p, averaged in zip(trainer.model.parameters(), trainer.split.averaged_mask)
              if averaged and not p.requires_grad]
    if frozen:
        count = sum(p.numel() for p in frozen)
        log.warning("%s frozen parameters (requires_grad=False) are averaged in every round, as lowcomm-node peers "
                    "of the config's [model] section train them: their zero Δ costs their bytes; leave [model] out "
                    "of the config to average the trainable parameters only", f"{count:,}",
                    extra={"event": "frozen_parameters_averaged", "parameters": count})


def _check_model_holds_values(model: nn.Module) -> None:
    """Parameters on the meta device hold no values to average (or to fingerprint, when frozen)."""
    if any(p.is_meta for p in model.parameters()):
        raise SwarmError("the model given to lowcomm.Swarm has parameters on the meta device, which hold no values: "
                         "materialize them first (model.to_empty(device=...), then initialize or load weights)")


def _check_model_and_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, averaged_mask: list[bool]) -> None:
    """What ``ExternalTrainer`` would refuse after the DHT started, as the documented ``SwarmError``
    before anything starts; and an optimizer that steps none of the averaged parameters (built
    for another model, or over frozen ones only), which would otherwise average a model that
    never trains. ``averaged_mask``: which parameters the run averages (SwarmConfig.averaged_mask)."""
    from lowcomm.node.averaged_params import TrainableSplit
    from lowcomm.node.models import ModelError, check_float32

    split = TrainableSplit(model, averaged_mask)
    averaged = split.averaged
    try:
        check_float32(model, "the model given to lowcomm.Swarm", averaged)
    except ModelError as err:
        raise SwarmError(str(err)) from None
    ours = {id(p) for p in averaged}
    if not any(id(p) in ours for group in optimizer.param_groups for p in group["params"]):
        which = "model's trainable parameters (requires_grad)" if split.frozen else "model's parameters"
        raise SwarmError(f"inner_optimizer holds none of the {which}: build it from the model given "
                         f"to lowcomm.Swarm (torch.optim.AdamW(model.parameters(), ...))")


def _join(thread: threading.Thread) -> None:
    while thread.is_alive():  # in slices: a Ctrl-C reaches the waiting main thread
        thread.join(0.5)


def _step_of(path: Path) -> int:
    try:
        return int(path.stem.split("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def _is_user_facing(err: BaseException) -> bool:
    from lowcomm.node.data import DataError
    from lowcomm.node.errors import FatalError

    return isinstance(err, (FatalError, DataError))


def _describe_failure(err: BaseException) -> str:
    if _is_user_facing(err):
        return _in_api_terms(str(err))
    return f"the node failed: {type(err).__name__}: {err}"


_FLAG = re.compile(r"--([a-z][a-z-]*)(?: \(or LOWCOMM_[A-Z_]+\))?")


def _in_api_terms(message: str) -> str:
    """The node's messages name its command-line flags (``--checkpoint-dir (or
    LOWCOMM_CHECKPOINT_DIR)``); a Swarm reads neither flags nor variables: name the config key
    (``[node] checkpoint_dir``), or the ``peers`` argument."""
    from lowcomm.node.config import ALIASES

    def key(match: re.Match[str]) -> str:
        name = match.group(1).replace("-", "_")
        if name == "peers":
            return "peers"
        section, field = ALIASES.get(name, ("node", name))
        return f"[{section}] {field}"

    message = message.replace("copy the whole address the first peer printed after `--peers`",
                              "copy a whole address from a peer's swarm.multiaddrs")
    if "[model] frozen_sha256:" in message and "refused" in message:  # a peer's fingerprint, not a checkpoint's
        message += ("; the model's frozen parameters (requires_grad=False), which no state download carries, "
                    "differ from the swarm's: load the same base weights as the other peers")
    return _FLAG.sub(key, message)
