"""A node's checkpoints: where its state comes from at start, and how a committed state is saved.

``restore`` (training thread, at start) loads the newest usable checkpoint of the run's
directory (a damaged newest one falls back to the previous one) into the trainer, or starts
from the seed's initial weights when there is none. When checkpoints exist but none is usable
it says so: the node must then download the swarm's state (node/catchup.py) rather than
silently start over. ``save`` writes one atomically (node/checkpoint.py); the newest is never
replaced by a half-written file.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from ..protocol.handshake import describe_difference
from . import checkpoint
from .config import Config, fingerprint_of
from .errors import FatalError
from .globalstate import GlobalState
from .optimizers import capture_served, served_state_names
from .ports import TrainerPort

log = logging.getLogger("lowcomm.node")


@dataclass
class Restored:
    state: GlobalState
    tokens_total: int
    must_download: bool  # checkpoints exist, none usable: the state must come from the swarm


def restore(config: Config, trainer: TrainerPort) -> Restored:
    """Training thread: the state to start from, with the trainer's local state loaded."""
    cfg = config
    synced = tuple(sorted(cfg.sync.state_sync))  # their residuals are checkpointed
    served = served_state_names(cfg)  # the optimizer states our snapshots serve to joiners
    for stale in checkpoint.remove_stale_temporaries(cfg.node.checkpoint_dir):
        log.info("removed %s, left by an interrupted checkpoint write", stale.name)

    def parse(payload: dict[str, Any]) -> tuple[GlobalState, dict[str, Any]]:
        if payload.get("config_fingerprint") != cfg.run_fingerprint():
            made_with = payload.get("run_config")  # checkpoints from before it was kept lack it
            if _model_kind(made_with) == "external":
                # No run config describes that model, so "the run config it was made with" cannot help.
                raise FatalError(
                    f"a checkpoint in {cfg.node.checkpoint_dir} was written by a lowcomm.Swarm script for a model "
                    f"of its own, which lowcomm-node cannot build; use another --checkpoint-dir (resume that run "
                    f"with the script that wrote it)"
                )
            differs = (f" ({describe_difference(made_with, cfg.run_config_json(), 'checkpoint', 'now')})"
                       if isinstance(made_with, str) else "")
            raise FatalError(
                f"a checkpoint in {cfg.node.checkpoint_dir} belongs to another run config{differs}; use another "
                f"--checkpoint-dir or the run config it was made with"
            )
        if not isinstance(payload.get("trainer"), dict):
            raise KeyError("trainer state missing")
        return GlobalState.from_checkpoint(payload, cfg.sync.outer_lr, cfg.sync.outer_momentum, synced), payload

    found = checkpoint.load_newest(cfg.node.checkpoint_dir, parse)
    if found is not None:
        (state, payload), path = found
        trainer.set_params(state.params)
        try:
            trainer.load_local_state(payload["trainer"])
        except (KeyError, ValueError, TypeError) as err:
            # Same run config, but the local part was written by another kind of trainer (e.g. by
            # lowcomm.Swarm from a Python loop: no data position) or does not fit this optimizer.
            # Stop with the reason and leave the file as it is; never start over silently.
            raise FatalError(
                f"checkpoint {path} holds a trainer state this node cannot load ({type(err).__name__}: {err}); "
                f"it was written by another trainer (lowcomm.Swarm checkpoints are for lowcomm.Swarm), "
                f"use another --checkpoint-dir"
            ) from None
        state.optimizer_states = capture_served(trainer, served)
        log.info("resumed from checkpoint %s (outer step %d)", path, state.step,
                 extra={"event": "resumed", "outer_step": state.step, "params_sha256": state.params_hash,
                        "checkpoint": path.name})
        return Restored(state, int(payload.get("tokens_total", 0)), must_download=False)
    damaged = checkpoint.list_checkpoints(cfg.node.checkpoint_dir)
    if damaged:
        log.error("no usable checkpoint in %s (%d damaged file(s) skipped): the node downloads the swarm's "
                  "state instead of starting over", cfg.node.checkpoint_dir, len(damaged),
                  extra={"event": "checkpoints_unusable"})
    state = GlobalState.fresh(trainer.get_params(), cfg.sync.outer_lr, cfg.sync.outer_momentum, synced)
    state.optimizer_states = capture_served(trainer, served)
    return Restored(state, 0, must_download=bool(damaged))


def _model_kind(run_config: Any) -> Any:
    """``[model] kind`` of a checkpoint's stored run config JSON (None: none readable)."""
    try:
        model = json.loads(run_config).get("model")
    except (TypeError, ValueError, AttributeError):
        return None
    return model.get("kind") if isinstance(model, dict) else None


def save(config: Config, state: dict[str, Any], trainer_state: dict[str, Any], tokens_total: int) -> None:
    """Write the checkpoint of ``state`` (``GlobalState.to_checkpoint`` or a frozen copy of it)."""
    run_config = config.run_config_json()
    payload = state | {
        "config_fingerprint": fingerprint_of(run_config),
        "run_config": run_config,  # so that a mismatch can name the keys that differ
        "trainer": trainer_state,
        "tokens_total": tokens_total,
    }
    path = checkpoint.save(config.node.checkpoint_dir, int(state["step"]), payload)
    log.debug("checkpoint written: %s", path)
