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
            raise FatalError(_another_run(cfg, payload.get("run_config"), _is_swarm(trainer)))
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


def _is_swarm(trainer: TrainerPort) -> bool:
    """The node runs inside a ``lowcomm.Swarm`` (the user's model and loop), not ``lowcomm-node``."""
    from .external_trainer import ExternalTrainer

    return isinstance(trainer, ExternalTrainer)


def _another_run(cfg: Config, made_with: Any, swarm: bool) -> str:
    """Why a checkpoint of another run config (``made_with``: the run config JSON stored with it,
    absent in checkpoints of before it was kept) cannot be resumed, and what to do instead."""
    directory = cfg.node.checkpoint_dir
    theirs, ours = _parsed(made_with), cfg.run_config()
    external = (_model_kind(theirs) == "external", _model_kind(ours) == "external")
    if external[0] and not swarm:
        # lowcomm-node meets a Swarm's checkpoint: no run config describes that model, so "the run
        # config it was made with" cannot help.
        return (f"a checkpoint in {directory} was written by a lowcomm.Swarm script for a model of its own, which "
                f"lowcomm-node cannot build; use another --checkpoint-dir (resume that run with the script that "
                f"wrote it)")
    if swarm and any(external):
        # A Swarm whose model (or config) changed since its checkpoint: say what differs, in the
        # script's terms (a parameter count, not a digest of shapes).
        differs = f" ({_swarm_difference(theirs, ours)})" if theirs is not None else ""
        return (f"a checkpoint in {directory} was written for another model or run config{differs}; resume with "
                f"the model and config that wrote it, or use another --checkpoint-dir")
    differs = (f" ({describe_difference(made_with, cfg.run_config_json(), 'checkpoint', 'now')})"
               if isinstance(made_with, str) else "")
    return (f"a checkpoint in {directory} belongs to another run config{differs}; use another --checkpoint-dir "
            f"or the run config it was made with")


def _swarm_difference(theirs: dict[str, Any], ours: dict[str, Any]) -> str:
    """How a checkpoint's run config differs from a Swarm's, where one of the two models is a
    model object of a script (``[model] kind = "external"``: its trainable parameter count, a
    digest of their names and shapes, and one of its frozen parameters: node/averaged_params.py)."""
    model_a, model_b = theirs.get("model") or {}, ours.get("model") or {}
    diffs = []
    if model_a.get("kind") == "external" and model_b.get("kind") == "external":
        count_a, count_b = model_a.get("parameters"), model_b.get("parameters")
        frozen_a, frozen_b = model_a.get("frozen_parameters"), model_b.get("frozen_parameters")
        if count_a != count_b:
            which = "trainable parameters" if frozen_a or frozen_b else "parameters"
            diffs.append(f"the checkpoint's model has {_count(count_a)} {which}, this one {_count(count_b)}")
        elif model_a.get("frozen_sha256") != model_b.get("frozen_sha256"):
            # Frozen parameters are not in the checkpoint: the model must bring the same ones.
            diffs.append(f"the checkpoint's model has {_count(frozen_a or 0)} frozen parameters, this one "
                         f"{_count(frozen_b or 0)}" if frozen_a != frozen_b else
                         f"the model's frozen parameters (requires_grad=False) differ from the checkpoint's "
                         f"run's in names, dtypes, shapes or values: load the same base weights")
        elif model_a != model_b:
            diffs.append(f"the checkpoint's model has other parameter names or shapes ({_count(count_a)} "
                         f"parameters, as this one)")
        sections = (set(theirs) | set(ours)) - {"model"}
    else:
        def what(model: dict[str, Any]) -> str:
            return ("the script's own (no [model] section)" if model.get("kind") == "external"
                    else "the config's [model] section")

        diffs.append(f"the checkpoint's model is {what(model_a)}, this one {what(model_b)}")
        sections = (set(theirs) & set(ours)) - {"model"}  # the others describe the model of one side
    rest = describe_difference(json.dumps({k: theirs[k] for k in sections if k in theirs}),
                               json.dumps({k: ours[k] for k in sections if k in ours}), "checkpoint", "now")
    if not diffs or {k: theirs.get(k) for k in sections} != {k: ours.get(k) for k in sections}:
        diffs.append(rest)
    return "; ".join(diffs)


def _count(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else "?"


def _parsed(run_config: Any) -> dict[str, Any] | None:
    """A checkpoint's stored run config JSON as a dict (None: none readable)."""
    try:
        parsed = json.loads(run_config)
    except (TypeError, ValueError):
        return None
    return parsed if isinstance(parsed, dict) else None


def _model_kind(run_config: dict[str, Any] | None) -> Any:
    """``[model] kind`` of a run config (None: none readable, or a kind that names no ``kind``)."""
    model = (run_config or {}).get("model")
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
