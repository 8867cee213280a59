"""What a node holds between rounds: θ_global, the outer optimizer and the error-feedback residuals.

θ_global and the outer momentum are shared by the swarm (identical on every member after a
round, downloaded by joiners); the residuals are this peer's own (what its contributions and its
shard averages did not deliver yet). In runs that average the inner optimizer's state
(``[sync] state_sync``, node/state_sync.py) it also holds that sync's residuals, one pair per
state (checkpointed with the rest), and the optimizer state its snapshots serve to joiners.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from lowcomm.protocol.outer import NesterovOuter
from lowcomm.protocol.state import OptimizerStates, Snapshot, params_sha256

log = logging.getLogger("lowcomm.node")


@dataclass
class GlobalState:
    step: int
    params: torch.Tensor  # θ_global, flat float32 on CPU
    outer: NesterovOuter
    residual: torch.Tensor  # sender-side error feedback
    owner_residual: torch.Tensor  # reducer-side error feedback of the shards this peer owns
    params_hash: str
    # State sync's error feedback, per state name: what this peer's contributions of the state
    # (sender) and its shard averages (owner) did not deliver yet. Empty without state sync.
    state_residuals: dict[str, torch.Tensor] = field(default_factory=dict)
    state_owner_residuals: dict[str, torch.Tensor] = field(default_factory=dict)
    # The inner optimizer's state this peer's snapshots serve (state sync only; None: snapshots
    # hold θ_global and the outer momentum). Taken at the round boundary, at restore and on a
    # download, in the training thread (node/commit.py, node/restore.py, node/catchup.py).
    optimizer_states: OptimizerStates | None = None
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
    def fresh(cls, params: torch.Tensor, lr: float, momentum: float,
              synced_states: tuple[str, ...] = ()) -> "GlobalState":
        """``synced_states``: the optimizer states ``[sync] state_sync`` averages (their residuals)."""
        numel = params.numel()
        return cls(0, params.clone(), NesterovOuter.zeros(lr, momentum, numel),
                   torch.zeros(numel), torch.zeros(numel), params_sha256(params),
                   {name: torch.zeros(numel) for name in synced_states},
                   {name: torch.zeros(numel) for name in synced_states})

    def adopt(self, step: int, params: torch.Tensor, momentum: torch.Tensor,
              optimizer_states: OptimizerStates | None = None) -> None:
        """Take over the swarm's state (a download); our residuals stay: they are still our work.
        With ``optimizer_states`` (loaded into the trainer by the caller) the state-sync residuals
        start over: they were the errors of sending the optimizer state this peer no longer has.
        Runs off the event loop (hashing the parameters is slow for large models)."""
        params = params.clone()
        digest = params_sha256(params)
        self.params = params
        self.outer.buffer = momentum.clone()
        self.owner_residual.zero_()
        if optimizer_states is not None:
            self.optimizer_states = optimizer_states
            for residual in (*self.state_residuals.values(), *self.state_owner_residuals.values()):
                residual.zero_()
        self._set_published(step, digest)

    def commit(self, params_hash: str | None = None) -> None:
        """The next step: θ_global now holds its result. ``params_hash`` when already computed
        (elsewhere, off the event loop), so that step and hash change together."""
        digest = params_hash or params_sha256(self.params)
        self._set_published(self.step + 1, digest)

    def snapshot(self) -> Snapshot:
        return Snapshot.build(self.step, self.params, self.outer.buffer, optimizer=self.optimizer_states)

    def to_checkpoint(self) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "step": self.step,
            "params": self.params,
            "momentum": self.outer.buffer,
            "residual": self.residual,
            "owner_residual": self.owner_residual,
            "params_sha256": self.params_hash,
        }
        if self.state_residuals:  # runs without state sync write the checkpoint they always wrote
            payload |= self.state_residuals_checkpoint()
        return payload

    def state_residuals_checkpoint(self) -> dict[str, Any]:
        """State sync's residuals as ``to_checkpoint`` holds them (the tensors themselves)."""
        return {"state_residuals": dict(self.state_residuals),
                "state_owner_residuals": dict(self.state_owner_residuals)}

    def frozen_checkpoint(self) -> dict[str, Any]:
        """``to_checkpoint`` with copies of the tensors: written in another thread while the next
        round (overlapped mode) already changes the originals."""
        return copy_payload(self.to_checkpoint())

    @classmethod
    def from_checkpoint(cls, payload: dict[str, Any], lr: float, momentum: float,
                        synced_states: tuple[str, ...] = ()) -> "GlobalState":
        """``synced_states``: the states the run's ``[sync] state_sync`` averages; a checkpoint
        written before their residuals were checkpointed starts them at zero (and says so)."""
        params = payload["params"].to(torch.float32)
        numel = params.numel()
        state = cls(int(payload["step"]), params, NesterovOuter(lr, momentum, payload["momentum"].to(torch.float32)),
                    payload["residual"].to(torch.float32), payload["owner_residual"].to(torch.float32),
                    params_sha256(params))
        if state.params_hash != payload.get("params_sha256"):
            raise ValueError("checkpoint params do not match the hash stored with them")
        saved = payload.get("state_residuals"), payload.get("state_owner_residuals")
        missing = [name for name in synced_states
                   if not all(isinstance(part, dict) and name in part for part in saved)]
        if missing:
            log.info("the checkpoint holds no state-sync residuals of %s (written before they were checkpointed, "
                     "or before state sync was on): they start at zero", ", ".join(missing),
                     extra={"event": "state_residuals_reset", "states": missing})
        for target, part in zip((state.state_residuals, state.state_owner_residuals), saved):
            for name in synced_states:
                value = part.get(name) if name not in missing and isinstance(part, dict) else None
                if value is not None and (not isinstance(value, torch.Tensor) or value.numel() != numel):
                    raise ValueError(f"checkpoint's state-sync residual of {name} does not fit the model")
                target[name] = torch.zeros(numel) if value is None else value.to(torch.float32).reshape(-1)
        return state


def copy_payload(payload: dict[str, Any]) -> dict[str, Any]:
    """Copies of the tensors of a checkpoint payload (one level of dicts deep, as the state
    residuals are)."""
    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.clone()
        if isinstance(value, dict):
            return {key: copy(item) for key, item in value.items()}
        return value

    return {key: copy(value) for key, value in payload.items()}
