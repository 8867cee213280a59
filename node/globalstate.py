"""What a node holds between rounds: θ_global, the outer optimizer and the error-feedback residuals.

θ_global and the outer momentum are shared by the swarm (identical on every member after a
round, downloaded by joiners); the residuals are this peer's own (what its contributions and its
shard averages did not deliver yet).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from lowcomm.protocol.outer import NesterovOuter
from lowcomm.protocol.state import Snapshot, params_sha256


@dataclass
class GlobalState:
    step: int
    params: torch.Tensor  # θ_global, flat float32 on CPU
    outer: NesterovOuter
    residual: torch.Tensor  # sender-side error feedback
    owner_residual: torch.Tensor  # reducer-side error feedback of the shards this peer owns
    params_hash: str
    # Step and hash change together: the heartbeat (event loop) reads them while a download is
    # adopted in the training thread, and must never announce a new step with the old hash.
    _published: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def published(self) -> tuple[int, str]:
        """(step, params hash), read together."""
        with self._published:
            return self.step, self.params_hash

    def _set_published(self, step: int, digest: str) -> None:
        with self._published:
            self.step, self.params_hash = step, digest

    @classmethod
    def fresh(cls, params: torch.Tensor, lr: float, momentum: float) -> "GlobalState":
        numel = params.numel()
        return cls(0, params.clone(), NesterovOuter.zeros(lr, momentum, numel),
                   torch.zeros(numel), torch.zeros(numel), params_sha256(params))

    def adopt(self, step: int, params: torch.Tensor, momentum: torch.Tensor) -> None:
        """Take over the swarm's state (a download); our residuals stay: they are still our work.
        Runs off the event loop (hashing the parameters is slow for large models)."""
        params = params.clone()
        digest = params_sha256(params)
        self.params = params
        self.outer.buffer = momentum.clone()
        self.owner_residual.zero_()
        self._set_published(step, digest)

    def commit(self, params_hash: str | None = None) -> None:
        """The next step: θ_global now holds its result. ``params_hash`` when already computed
        (elsewhere, off the event loop), so that step and hash change together."""
        digest = params_hash or params_sha256(self.params)
        self._set_published(self.step + 1, digest)

    def snapshot(self) -> Snapshot:
        return Snapshot.build(self.step, self.params, self.outer.buffer)

    def to_checkpoint(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "params": self.params,
            "momentum": self.outer.buffer,
            "residual": self.residual,
            "owner_residual": self.owner_residual,
            "params_sha256": self.params_hash,
        }

    def frozen_checkpoint(self) -> dict[str, Any]:
        """``to_checkpoint`` with copies of the tensors: written in another thread while the next
        round (overlapped mode) already changes the originals."""
        return {key: value.clone() if isinstance(value, torch.Tensor) else value
                for key, value in self.to_checkpoint().items()}

    @classmethod
    def from_checkpoint(cls, payload: dict[str, Any], lr: float, momentum: float) -> "GlobalState":
        params = payload["params"].to(torch.float32)
        state = cls(int(payload["step"]), params, NesterovOuter(lr, momentum, payload["momentum"].to(torch.float32)),
                    payload["residual"].to(torch.float32), payload["owner_residual"].to(torch.float32),
                    params_sha256(params))
        if state.params_hash != payload.get("params_sha256"):
            raise ValueError("checkpoint params do not match the hash stored with them")
        return state
