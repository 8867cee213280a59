"""What the round driver needs of its surroundings: a trainer (``TrainerPort``, and the
``PhaseStats`` it returns) and the swarm (``SwarmPort``).

The node drives rounds around *some* training loop. The daemon's own is ``Trainer``
(node/trainer.py: a model preset, the data shards, AdamW); a Python API user brings another one
whose inner steps their own loop takes. Both satisfy ``TrainerPort``, and the node and its round
driver use nothing else of a trainer.

Contract (every method is called from the node's one training thread, never concurrently, so an
implementation needs no locks):

- Parameters cross the boundary as one flat float32 CPU vector of ``numel`` elements, in a
  fixed order (``torch.nn.utils.parameters_to_vector`` of the model's parameters). Vectors
  handed in are the node's own (θ_global): copy from them, never keep a view of them.
- ``train_phase`` takes up to ``steps`` inner steps, checks ``should_stop()`` before each and
  calls ``on_step(done, loss)`` after each (the node applies an overlapped round's result there);
  it returns what it did, also when it stopped early.
- ``evaluate`` is the held-out loss of the *local* model (the node's initial eval); the eval of
  θ_global after each round runs on a replica when the trainer offers one (``ReplicaEvaluating``),
  otherwise it is reported as NaN.
- ``local_state``/``load_local_state``: whatever the trainer must checkpoint besides θ_global
  (inner optimizer, data position), as a ``torch.save``-able dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from .decisions import Position
    from .swarm import SwarmView


@dataclass
class PhaseStats:
    """What one inner phase did."""

    steps: int
    tokens: int  # the phase's weight in the round (an API trainer may count samples instead)
    mean_loss: float
    seconds: float  # spent in inner steps (compute utilization counts it)


@runtime_checkable
class TrainerPort(Protocol):
    """The trainer as the node and its round driver see it (see the module docstring)."""

    numel: int  # length of the flat parameter vector

    def get_params(self) -> torch.Tensor:
        """A new flat float32 CPU copy of the local model's parameters."""

    def set_params(self, flat: torch.Tensor) -> None:
        """Overwrite the local model's parameters with ``flat`` (copied, not viewed)."""

    def set_params_slice(self, fragment: slice, values: torch.Tensor) -> None:
        """Overwrite ``fragment`` of the flat parameters; the rest is left as it is."""

    def add_to_slice(self, fragment: slice, shift: torch.Tensor) -> None:
        """Add ``shift`` to ``fragment`` of the flat parameters (overlapped rounds' correction)."""

    def reset_to(self, flat: torch.Tensor) -> None:
        """Start over from ``flat`` after a divergence, dropping inner-optimizer state (it may hold NaN)."""

    def train_phase(self, steps: int, should_stop: Callable[[], bool],
                    on_step: Callable[[int, float], None] | None = None) -> PhaseStats:
        """Up to ``steps`` inner steps (see the module docstring)."""

    def evaluate(self) -> float:
        """Held-out loss of the local model."""

    def local_state(self) -> dict:
        """The trainer's own checkpointable state."""

    def load_local_state(self, state: dict) -> None:
        """Restore what ``local_state`` returned."""


@runtime_checkable
class ReplicaEvaluating(Protocol):
    """Optional for a trainer: an evaluator of θ_global on a replica of the model, called from the
    node's report thread while training goes on (the daemon's ``Trainer`` offers one)."""

    def replica_evaluator(self) -> Callable[[torch.Tensor, dict[str, torch.Tensor] | None], float]:
        """Built in the training thread while it is idle; the callable takes a flat vector and the
        model's buffers as ``local_state`` gave them (or None: the replica's own)."""


class SwarmPort(Protocol):
    """What the round driver asks about the swarm: views and our record (node/swarmlink.py)."""

    def last_view(self) -> "SwarmView":
        """The swarm as the heartbeat last read it (no DHT call)."""

    def want_view(self) -> None:
        """A step coordinator waits on ``last_view`` (RoundPeers.watch): the heartbeat reads the
        table at its next beat (otherwise a large swarm's heartbeat reads it only every few beats)."""

    async def refresh_view(self) -> "SwarmView":
        """Read the swarm from the DHT now (the heartbeat's view is updated too)."""

    async def current_view(self) -> "SwarmView":
        """The last view, or a fresh one when the swarm moved since (node/swarmpace.py)."""

    def recent_view(self) -> "SwarmView | None":
        """The last view when the marks of the last beat show no move that could make us
        download, else None (no DHT call)."""

    async def publish_record(self) -> None:
        """Publish this peer's record (step, hash, phase) now."""

    def position(self) -> "Position":
        """This peer's (id, step, params hash), read together."""

    def round_open(self) -> bool:
        """Whether the heartbeat's last reads show another peer averaging at our step with our
        parameters (decisions.round_opened, or the progress record's open marks; no DHT call)."""
