"""Models built by the user's own function: ``[model] factory = "package.module:function"``.

The contract (README, "Train your own model"):

* lowcomm imports ``package.module`` (the node's working directory is on the import path, as
  with ``python -m``) and calls ``function(**factory_kwargs)`` on the CPU, with torch's global
  RNG seeded from ``[train] seed`` just before the call: every draw the function makes from
  torch's RNG (``nn.Linear``'s init, ``torch.randn``, ...) is then the same on every peer, and
  so are the initial weights. Draws from ``random`` or numpy are not seeded: do not use them.
* It returns either an ``nn.Module`` whose ``forward(inputs, targets)`` returns the scalar mean
  loss, or a pair ``(module, loss_fn)`` where ``module(inputs)`` gives an output and
  ``loss_fn(output, targets)`` the scalar loss (``loss_fn`` holds no parameters).
* ``inputs`` and ``targets`` are ``torch.int64`` tensors of shape ``[batch_size, seq_len]`` on
  the training device; ``targets`` are the inputs shifted left by one token (the next token at
  every position). Under CUDA the forward runs in bf16 autocast.
* Every parameter is float32. Parameters are what peers average; buffers stay local.
* A ``vocab_size`` attribute on the module, if present, is checked against the data's vocabulary.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import traceback
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn

from ..averaged_params import TrainableSplit, frozen_shapes
from . import ModelError, check_float32, seeded, shapes_digest

if TYPE_CHECKING:
    from ..config import ModelSection

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def resolve(spec: str) -> Callable[..., Any]:
    """The function named by ``package.module:function``."""
    module_name, _, function_name = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        # The console script does not put the working directory on the path; `python -m` does.
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ModelError(f"[model] factory {spec!r}: cannot import {module_name} ({err})") from None
    except SystemExit as err:  # argparse's parse_args() at the module's top level, say: it saw the node's argv
        raise ModelError(f"[model] factory {spec!r}: importing {module_name} called exit({err.code!r}); a module "
                         f"that parses its command line or exits must do so under "
                         f"`if __name__ == \"__main__\":`") from None
    except Exception as err:  # noqa: BLE001 - a bug in the user's module (SyntaxError, NameError, ...): one line
        raise ModelError(f"[model] factory {spec!r}: importing {module_name} raised {type(err).__name__}"
                         f"{_where(err)}: {err.msg if isinstance(err, SyntaxError) else err}") from None
    function = getattr(module, function_name, None)
    if function is None:
        raise ModelError(f"[model] factory {spec!r}: {module_name} has no function {function_name}")
    if not callable(function):
        raise ModelError(f"[model] factory {spec!r}: {module_name}.{function_name} is a {type(function).__name__}, "
                         f"not a function that builds the model")
    return function


def _where(err: BaseException) -> str:
    """`` at FILE:LINE`` of the user's line that raised ``err`` (a SyntaxError's own place), or ''."""
    if isinstance(err, SyntaxError) and err.filename:
        return f" at {err.filename}:{err.lineno}"
    frames = [frame for frame in traceback.extract_tb(err.__traceback__) if not frame.filename.startswith("<")]
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


class FactoryModel(nn.Module):
    """The user's module (and loss function) under the preset GPT's calling convention."""

    def __init__(self, net: nn.Module, loss_fn: LossFn | None, spec: str) -> None:
        super().__init__()
        self.net = net
        self.loss_fn = loss_fn
        self.spec = spec
        vocab = getattr(net, "vocab_size", None)
        self.vocab_size = int(vocab) if isinstance(vocab, int) else None

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[None, torch.Tensor]:
        try:
            loss = self.loss_fn(self.net(inputs), targets) if self.loss_fn is not None else self.net(inputs, targets)
        except IndexError:
            self._check_token_ids(inputs)
            raise
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            got = f"a {tuple(loss.shape)} {loss.dtype} tensor" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ModelError(f"[model] factory {self.spec!r}: the loss must be a scalar float tensor, got {got}")
        return None, loss.reshape(())

    def _check_token_ids(self, inputs: torch.Tensor) -> None:
        """After an IndexError: name an embedding too small for the data's token ids. Without a
        ``vocab_size`` attribute the node could not compare them before training."""
        largest = int(inputs.max())
        for name, module in self.net.named_modules():
            if isinstance(module, nn.Embedding) and module.num_embeddings <= largest:
                raise ModelError(f"[model] factory {self.spec!r}: the data has token id {largest}, but embedding "
                                 f"{name or 'net'!r} holds {module.num_embeddings} ids; build the model for the "
                                 f"tokenizer's vocabulary (and give the module a vocab_size attribute, which the "
                                 f"node checks against the data before training)") from None


class FactoryRaised(ModelError):
    """The user's factory function raised (a bug in it, or ``factory_kwargs`` it does not take)."""


def _call(section: "ModelSection") -> tuple[nn.Module, LossFn | None]:
    spec = section.factory or ""
    function = resolve(spec)
    kwargs = section.factory_kwargs or {}
    try:
        result = function(**kwargs)
    # The user's code: one line that names the call, not a traceback. SystemExit too: a factory that
    # parses "its" command line with argparse reads the node's and exits, 0 or 2, without a word of why.
    except (Exception, SystemExit) as err:  # noqa: BLE001
        if isinstance(err, SystemExit):
            raise FactoryRaised(f"[model] factory {spec!r} called exit({err.code!r}) when called with factory_kwargs "
                                f"{kwargs}; a factory returns the model: it must not parse the command line (the "
                                f"node's) or exit") from None
        raise FactoryRaised(f"[model] factory {spec!r} raised {type(err).__name__} when called with "
                            f"factory_kwargs {kwargs}: {err}") from err
    if isinstance(result, nn.Module):
        return result, None
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module) and callable(result[1]):
        return result[0], result[1]
    raise ModelError(f"[model] factory {spec!r} returned {type(result).__name__}; "
                     "return a torch.nn.Module or a (module, loss_fn) pair")


def _check_calls(net: nn.Module, loss_fn: LossFn | None, spec: str) -> None:
    """The calls the node will make must fit the signatures: before the DHT starts, one line
    that says which call and how to fix it, not a TypeError from the first inner step."""
    calls = [("the module's forward", net.forward, ["inputs", "targets"] if loss_fn is None else ["inputs"])]
    if loss_fn is not None:
        calls.append(("loss_fn", loss_fn, ["output", "targets"]))
    for what, function, arguments in calls:
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):  # no signature to read (a builtin): the call itself will tell
            continue
        try:
            signature.bind(*arguments)
        except TypeError as err:
            fix = ("return (module, loss_fn) from the factory when forward takes only the inputs, or give forward "
                   "a targets argument and return the loss" if loss_fn is None else
                   "the node calls module(inputs), then loss_fn(output, targets)")
            takes = ", ".join(str(p.replace(annotation=inspect.Parameter.empty, default=inspect.Parameter.empty))
                              for p in signature.parameters.values())
            raise ModelError(f"[model] factory {spec!r}: {what}({takes}) cannot be called as "
                             f"({', '.join(arguments)}): {err}; {fix}") from None


def build_factory_model(section: "ModelSection", seed: int) -> FactoryModel:
    with seeded(seed):
        net, loss_fn = _call(section)
    _check_calls(net, loss_fn, section.factory or "")
    model = FactoryModel(net, loss_fn, section.factory or "")
    # Frozen parameters (a base under adapters) are not averaged and may keep any dtype.
    check_float32(model, f"the model of factory {section.factory!r}", TrainableSplit(model).averaged)
    return model


def factory_definition(section: "ModelSection") -> dict[str, Any]:
    """The factory's name and arguments and its parameters' shapes.

    The shapes come from one call on the meta device (no memory, no init), or, for a factory that
    cannot run there (one that loads a file, say), from one ordinary call."""
    try:
        with torch.device("meta"):
            net, _ = _call(section)
    except FactoryRaised:  # any failure of the function on meta: fall back to a real (seeded) call
        with seeded(0):
            net, _ = _call(section)
    split = TrainableSplit(net)  # the averaged ones: those the factory leaves trainable
    parameters, shapes = shapes_digest((name, tuple(p.shape)) for name, p in split.averaged_named)
    return {"kind": "factory", "factory": section.factory, "factory_kwargs": section.factory_kwargs or {},
            "parameters": parameters, "shapes_sha256": shapes, **frozen_shapes(split.frozen)}
