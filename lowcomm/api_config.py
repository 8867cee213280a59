"""The run config of a ``lowcomm.Swarm``: the CLI's config keys and checks, and a fingerprint that
covers the user's model object.

A ``Swarm`` takes a ``Config``, a dict of the same sections as the CLI's TOML file, or the path of
such a file; each is validated by node/config.py, and a mistake comes out as one readable
``SwarmError`` (no pydantic traceback). ``LOWCOMM_*`` environment variables are *not* read: a
library call means what its arguments say.

Two ways to describe the model in the run fingerprint (peers refuse to average with a peer whose
fingerprint differs, naming the difference):

* no ``[model]`` section: the fingerprint describes the model given to ``Swarm`` itself (kind
  ``external``: its parameters' names and shapes). Every peer runs the API with the same model.
* a ``[model]`` section (``hf_config``, ``factory``, ``hf_pretrained``, a preset): the fingerprint
  is the CLI's, so ``lowcomm-node`` peers of the same config join the run; the model given must
  have that model's parameter names and shapes (checked here).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Union

import torch
import torch.nn as nn
from pydantic import PrivateAttr, ValidationError

from lowcomm.node.config import Config, ConfigError, describe_validation_error, ConfigLayers, read_toml
from lowcomm.node.averaged_params import trainable_mask
from lowcomm.node.external_trainer import external_definition, named_shapes

ConfigLike = Union[Config, Mapping[str, Any], str, os.PathLike, None]

# [node] defaults of the API where they differ from the daemon's: several processes of one
# machine (a launcher, tests) each get free ports unless the config names them.
API_NODE_DEFAULTS = {"grpc_port": 0, "dht_port": 0, "metrics_port": 0}


class SwarmError(RuntimeError):
    """A mistake in what was given to ``lowcomm.Swarm`` (config, model, state), or a node that
    could not start; the message says what to change."""


class SwarmConfig(Config):
    """A ``Config`` whose fingerprint's model part may describe a model object (see the module
    docstring); everything else is the CLI's."""

    _external_model: dict[str, Any] | None = PrivateAttr(None)
    _averaged_mask: list[bool] | None = PrivateAttr(None)

    @property
    def averaged_mask(self) -> list[bool]:
        """Which of the model's parameters the run averages, in ``parameters()`` order
        (node/averaged_params.py): without a [model] section the ones the model given trains
        (``requires_grad`` as the Swarm was made); with one, those the config's model trains, as
        ``lowcomm-node`` peers of it average them."""
        if self._averaged_mask is None:
            raise RuntimeError("averaged_mask is set by resolve_config")
        return self._averaged_mask

    def run_config(self) -> dict[str, Any]:
        run = super().run_config()
        if self._external_model is not None:
            run.update(self._external_model)
        return run


def _raw(config: ConfigLike) -> tuple[ConfigLayers, str]:
    """The config's sections as raw layers (values and where each came from)."""
    layers = ConfigLayers()
    if config is None:
        return layers, "defaults"
    if isinstance(config, Config):
        # Only the keys that were set: defaults of the API (ports) can still apply to the rest.
        layers.merge_file(config.model_dump(exclude_unset=True), "the Config given")
        return layers, "the Config given"
    if isinstance(config, Mapping):
        try:
            layers.merge_file(config, "config")
        except ConfigError as err:
            raise SwarmError(str(err)) from None
        return layers, "config"
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        try:
            layers.merge_file(read_toml(path), str(path))
        except ConfigError as err:
            raise SwarmError(str(err)) from None
        return layers, str(path)
    raise SwarmError(f"config must be a lowcomm.node.config.Config, a dict or the path of a TOML file, "
                     f"not {type(config).__name__}")


def resolve_config(config: ConfigLike, peers: list[str] | None, model: nn.Module) -> SwarmConfig:
    """Validate ``config`` (with ``peers`` as ``[node] peers``) and tie its fingerprint to ``model``."""
    layers, source = _raw(config)
    for key, value in API_NODE_DEFAULTS.items():
        if ("node", key) not in layers.sources:
            layers.set("node", key, value, "lowcomm.Swarm's default")
    if peers is not None:
        if isinstance(peers, str):
            peers = [peers]
        elif not isinstance(peers, (list, tuple)):
            raise SwarmError(f"peers must be a list of multiaddrs (or one as a string), not {type(peers).__name__}: "
                             f"pass [other_swarm.multiaddrs[0]]")
        layers.set("node", "peers", list(peers), "peers=")
    try:
        resolved = SwarmConfig.model_validate(layers.values)
    except ValidationError as err:
        raise SwarmError(describe_validation_error(err, layers)) from None
    if resolved.model.model_fields_set:
        resolved._averaged_mask = check_model_matches(model, resolved)
    else:
        resolved._external_model = external_definition(model)
        resolved._averaged_mask = trainable_mask(model)
    return resolved


def _expected_model(config: Config) -> nn.Module:
    """The model that ``config``'s [model] section builds (on the meta device where it can: no
    memory, no init)."""
    from lowcomm.node.models import build_model_for

    try:
        with torch.device("meta"):
            return build_model_for(config)
    except Exception:  # noqa: BLE001 - a model that cannot be built on meta: build it for real
        return build_model_for(config)


def check_model_matches(model: nn.Module, config: Config) -> list[bool]:
    """The model given has the parameter names and shapes of the config's [model], in order, and
    trains none of the parameters that model freezes; returns which parameters the run averages
    (those the config's model trains: node/averaged_params.py).

    lowcomm wraps transformers and factory models (their parameters are named ``net.*``); the
    model given may be the wrapped module itself."""
    from lowcomm.node.models import ModelError

    section = config.model
    described = {"preset": f'preset = "{section.preset}"', "factory": f'factory = "{section.factory}"',
                 "hf_config": f'hf_config = "{section.hf_config}"',
                 "hf_pretrained": f'hf_pretrained = "{section.hf_pretrained}"'}[section.kind]
    try:
        built = _expected_model(config)
    except ModelError as err:
        raise SwarmError(str(err)) from None
    expected, mask = named_shapes(built), trainable_mask(built)
    given = named_shapes(model)
    unwrapped = [(name.removeprefix("net."), shape) for name, shape in expected]
    if given in (expected, unwrapped):
        for (name, _), averaged, param in zip(given, mask, model.parameters()):
            if param.requires_grad and not averaged:
                raise SwarmError(f"parameter {name} trains in the model given to lowcomm.Swarm, but the config's "
                                 f"[model] {described} freezes it, so no peer of the run averages it and each would "
                                 f"train it apart: freeze it (requires_grad_(False)) before making the Swarm, as "
                                 f"the config's model does")
        return mask
    ours = unwrapped if any(name.startswith("net.") for name, _ in expected) else expected
    where = f"the config's [model] {described}"
    if len(given) != len(ours):
        detail = f"it has {len(given)} parameter tensors, {where} has {len(ours)}"
    else:
        index = next(i for i, (a, b) in enumerate(zip(given, ours)) if a != b)
        (name, shape), (other, other_shape) = given[index], ours[index]
        detail = (f"parameter {index} is {name} {tuple(shape)} in it and {other} {tuple(other_shape)} in "
                  f"{where}")
    raise SwarmError(f"the model given to lowcomm.Swarm is not the config's [model]: {detail}; build the "
                     f"model from the same definition, or leave [model] out of the config (the run "
                     f"fingerprint then describes the model given)")
