"""A ``TrainerPort`` (node/ports.py) over a model and optimizer whose inner steps the user's own
loop takes: the trainer of the Python API (``lowcomm.Swarm``, lowcomm/api.py).

The node asks its trainer for an inner phase (``train_phase(steps, ...)``) in its training
thread. Here that call hands the model to the user's thread one step at a time and takes it
back after each ``swarm.step()``: the two threads take turns (a ``Handoff``), so the model is
never touched by both at once. While the user's thread holds the turn, the node's training
thread waits inside ``train_phase``; while the node holds it (between two steps, at a round
boundary, during a blocking round), the user's thread waits inside ``swarm.step()``. An
overlapped round runs on the node's event loop while the user trains on, exactly as it does
beside the daemon's own training thread; its result reaches the model between two steps
(``on_step``), in the node's turn.

Every wait of the user's thread ends when the node stops or dies (``Handoff.close``), with
``SwarmStopped``: ``swarm.step()`` never hangs on a node that is gone.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Callable

import torch
import torch.nn as nn

from .averaged_params import TrainableSplit, frozen_definition
from .errors import FatalError
from .models import ModelError, check_float32, shapes_digest
from .ports import PhaseStats
from .buffers import load_buffers, persistent_buffers
from .trainer import FlatParams, copy_flat_into

WAIT_SLICE = 0.5  # seconds; waits are cut into slices so that Ctrl-C reaches a waiting main thread


class SwarmStopped(RuntimeError):
    """The node behind a ``Swarm`` stopped (or failed): no more steps can be taken."""


class Handoff:
    """Turns between the node's training thread ("node") and the user's thread ("user").

    The node gives the user one inner step with ``grant`` and waits until the user reports it
    with ``report`` (or leaves); the user then waits in ``report`` until the node grants the
    next step. ``close`` ends every wait on both sides for good.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._turn = "node"
        self._closed: str | None = None  # why the node is gone
        self._left = False  # the user's loop is over (the ``with`` block exited)
        self._started = False  # the node granted the first step: start-up and catch-up are done
        self.pending: tuple[int, float] = (0, math.nan)  # (tokens, loss) of the step just reported

    @property
    def started(self) -> bool:
        return self._started

    @property
    def closed(self) -> str | None:
        return self._closed

    @property
    def left(self) -> bool:
        return self._left

    # -- the node's side (its training thread) ---------------------------------------------

    def grant(self) -> bool:
        """Give the user one step and wait until it is reported; False if the user left (or the
        handoff closed) instead."""
        with self._cond:
            if self._left or self._closed is not None:
                return False
            self._turn = "user"
            self._started = True
            self._cond.notify_all()
            while self._turn == "user" and not self._left and self._closed is None:
                self._cond.wait(WAIT_SLICE)
            return self._turn == "node" and self._closed is None

    def close(self, reason: str) -> None:
        """The node is gone: every wait ends, and every later ``report`` raises."""
        with self._cond:
            if self._closed is None:
                self._closed = reason
            self._turn = "node"
            self._cond.notify_all()

    # -- the user's side ----------------------------------------------------------------------

    def wait_started(self, alive: Callable[[], bool]) -> None:
        """Until the node grants the first step (it joined and caught up); ``SwarmStopped`` if
        the node ends first. ``alive`` says whether the node's thread still runs."""
        with self._cond:
            while not self._started and self._closed is None:
                if not alive():
                    self._closed = self._closed or "the node ended during start-up"
                    break
                self._cond.wait(WAIT_SLICE)
            if self._closed is not None and not self._started:
                raise SwarmStopped(self._closed)

    def report(self, tokens: int, loss: float) -> None:
        """The user took the step granted: give the turn back, wait for the next grant."""
        with self._cond:
            if self._closed is not None:
                raise SwarmStopped(self._closed)
            if self._turn != "user":
                raise RuntimeError("swarm.step() was called while another step() waits in another thread; "
                                   "call it from one thread, once after each inner optimizer step")
            self.pending = (tokens, loss)
            self._turn = "node"
            self._cond.notify_all()
            while self._turn == "node" and self._closed is None:
                self._cond.wait(WAIT_SLICE)
            if self._closed is not None:
                raise SwarmStopped(self._closed)

    def leave(self) -> None:
        """The user's loop is over: the node's wait in ``grant`` ends (its phase ends early)."""
        with self._cond:
            self._left = True
            self._cond.notify_all()

    def holds_turn(self) -> bool:
        """Whether the user's thread may touch the model now (its turn, and the node is alive)."""
        with self._cond:
            return self._turn == "user" and self._closed is None


def named_shapes(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def external_definition(model: nn.Module) -> dict:
    """What the run fingerprint says about a model given as an object: its averaged (trainable)
    parameters' names and shapes, in order (two models line up exactly when these agree), and
    a digest of the frozen ones' values, which every peer must hold alike (node/averaged_params.py)."""
    split = TrainableSplit(model)
    parameters, digest = shapes_digest([(name, tuple(p.shape)) for name, p in split.averaged_named])
    return {"model": {"kind": "external", "parameters": parameters, "shapes_sha256": digest,
                      **frozen_definition(split.frozen)}}


class EvalFnFailed(FatalError):
    """The user's ``eval_fn`` raised or returned no number. Fatal before the first step (the
    node's first evaluation); later, that round's eval is nan (node/commit.py) and its checkpoint
    is written."""


def call_eval_fn(eval_fn: Callable[[nn.Module], float], model: nn.Module) -> float:
    try:
        return float(eval_fn(model))
    except Exception as err:  # noqa: BLE001 - the user's code: one line naming eval_fn, not a bare traceback
        raise EvalFnFailed(f"eval_fn raised {type(err).__name__}: {err}") from err


class ExternalTrainer(FlatParams):
    """The user's model and inner optimizer as a ``TrainerPort``; the inner steps come from the
    user's loop through ``handoff`` (see the module docstring)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 eval_fn: Callable[[nn.Module], float] | None = None,
                 averaged_mask: list[bool] | None = None) -> None:
        # ``averaged_mask``: which parameters the run averages (node/averaged_params.py); None:
        # the ones that require grad now.
        self.split = TrainableSplit(model, averaged_mask)
        check_float32(model, "the model given to lowcomm.Swarm", self.split.averaged)
        self.model = model
        self.optimizer = optimizer
        self.eval_fn = eval_fn
        self.params = self.split.averaged
        self.numel = sum(p.numel() for p in self.params)
        self.handoff = Handoff()
        self.inner_steps_done = 0

    # -- the inner phase: the user's loop takes the steps -------------------------------------

    def train_phase(self, steps: int, should_stop: Callable[[], bool],
                    on_step: Callable[[int, float], None] | None = None) -> PhaseStats:
        started = time.perf_counter()
        losses: list[float] = []
        tokens = 0
        for step in range(steps):
            if should_stop() or not self.handoff.grant():
                break
            step_tokens, loss = self.handoff.pending
            tokens += step_tokens
            losses.append(loss)
            self.inner_steps_done += 1
            if on_step is not None:
                on_step(step + 1, loss)  # in our turn: an overlapped round's result goes in here
        known = [loss for loss in losses if not math.isnan(loss)]
        mean = sum(known) / len(known) if known else math.nan
        return PhaseStats(len(losses), tokens, mean, time.perf_counter() - started)

    def evaluate(self) -> float:
        if self.eval_fn is None:
            return math.nan
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return call_eval_fn(self.eval_fn, self.model)
        finally:
            self.model.train(was_training)

    # -- checkpointable local state -------------------------------------------------------------

    def local_state(self) -> dict:
        return {"buffers": persistent_buffers(self.model), "optimizer": self.optimizer.state_dict(),
                "inner_steps_done": self.inner_steps_done}

    def load_local_state(self, state: dict) -> None:
        if "optimizer" not in state:
            raise ModelError("the checkpoint holds no inner optimizer state")
        if "buffers" in state:  # checkpoints of before 2026-12-07 hold none: the model's own stay
            try:
                load_buffers(self.model, state["buffers"])
            except ValueError as err:
                raise ModelError(f"{err}; resume with the model that wrote the checkpoint") from None
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError) as err:
            raise ModelError(f"the checkpoint's inner optimizer state does not fit the optimizer given to "
                             f"lowcomm.Swarm ({err}); resume with the same optimizer and parameters") from None
        self.inner_steps_done = int(state.get("inner_steps_done", 0))


class EvaluatingExternalTrainer(ExternalTrainer):
    """With an ``eval_fn``: θ_global of every committed round is evaluated on a replica of the
    model in the node's report thread (``ReplicaEvaluating``), while the user trains on."""

    def replica_evaluator(self) -> Callable[[torch.Tensor, dict[str, torch.Tensor] | None], float]:
        import copy

        replica = copy.deepcopy(self.model)  # the node's turn: no step is half done
        replica.requires_grad_(False)
        replica.eval()
        params = self.split.select(list(replica.parameters()))  # the frozen ones stay the model's
        eval_fn = self.eval_fn
        assert eval_fn is not None

        @torch.no_grad()
        def evaluate(flat: torch.Tensor, buffers: dict[str, torch.Tensor] | None = None) -> float:
            # ``buffers``: the model's as the round left them (node/buffers.py), else the replica's
            copy_flat_into(params, flat)
            if buffers is not None:
                load_buffers(replica, buffers)
            return call_eval_fn(eval_fn, replica)

        return evaluate
