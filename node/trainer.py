"""Model, data and the inner optimizer: everything that runs in the training thread.

The daemon calls into a ``Trainer`` only from its one training thread (DESIGN §5), so nothing
here is locked. The global parameters cross the boundary as flat float32 CPU tensors.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Callable

import torch
from torch.nn.utils import parameters_to_vector

from .averaged_params import TrainableSplit
from .buffers import load_buffers, persistent_buffers
from .config import Config
from .data import Corpus, DataError, ShardSampler, eval_batches, load_data
from .errors import FatalError
from .models import build_model_for, vocab_size_of
from .ports import PhaseStats  # noqa: F401 (re-exported: part of this module's API)

log = logging.getLogger("lowcomm.node")


def pick_device(choice: str) -> torch.device:
    """The device ``[node] device`` names; ``cuda`` without a usable CUDA device is a FatalError
    that says why (a CPU-only torch build, or no GPU visible) and what to do instead."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise FatalError(f"--device cuda: {_why_no_cuda()}, or use --device auto (CUDA where "
                             "there is a GPU, else CPU) or --device cpu")
        return torch.device("cuda")
    return torch.device("cpu")


def _why_no_cuda() -> str:
    if torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is built without CUDA: install a CUDA build of "
                "torch in its place")
    return (f"torch (built for CUDA {torch.version.cuda}) sees no CUDA device: check the driver "
            "(nvidia-smi) and CUDA_VISIBLE_DEVICES")


def copy_flat_into(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy a flat vector into ``params``. Not torch's vector_to_parameters: that would make the
    parameters views of ``flat`` (θ_global itself on CPU), and training would modify θ_global."""
    with torch.no_grad():
        offset = 0
        for param in params:
            count = param.numel()
            param.copy_(flat[offset:offset + count].view_as(param))
            offset += count


@torch.no_grad()
def mean_eval_loss(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> float:
    """Mean loss of ``model`` on the fixed held-out batches (bf16 autocast on CUDA)."""
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext())
    was_training = model.training
    model.eval()
    total = 0.0
    for inputs, targets in batches:
        with autocast:
            _, loss = model(inputs.to(device), targets.to(device))
        total += loss.item()
    model.train(was_training)
    return total / len(batches)


def build_optimizer(config: Config, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The inner optimizer ``[train] optimizer`` names."""
    train = config.train
    if train.optimizer == "mtdao":
        from .optimizers import MTDAO

        return MTDAO(params, lr=train.lr, beta_fast=0.9, beta_slow=train.mtdao_beta_slow, beta2=0.95,
                     slow_weight=train.mtdao_slow_weight, weight_decay=train.weight_decay)
    return torch.optim.AdamW(params, lr=train.lr, betas=(0.9, 0.95), weight_decay=train.weight_decay)


def optimizer_state_flat(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], name: str) -> torch.Tensor:
    """The optimizer state ``name`` of every parameter as one flat float32 CPU vector, in the
    order of the flat parameters (zeros for a parameter that has no state yet)."""
    parts = []
    for param in params:
        value = optimizer.state.get(param, {}).get(name)
        parts.append(torch.zeros(param.numel()) if value is None else value.detach().reshape(-1).to("cpu", torch.float32))
    return torch.cat(parts) if parts else torch.zeros(0)


def load_optimizer_state_flat(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], name: str,
                              flat: torch.Tensor) -> None:
    """Overwrite the state ``name`` of every parameter that has one with its slice of ``flat``
    (a parameter without state yet gets it with its first step)."""
    offset = 0
    with torch.no_grad():
        for param in params:
            count = param.numel()
            value = optimizer.state.get(param, {}).get(name)
            if value is not None:
                value.copy_(flat[offset:offset + count].view_as(value))
            offset += count


class FlatParams:
    """TrainerPort's parameter half over ``self.params`` (the model's averaged parameters in
    order: ``self.split``, node/averaged_params.py) and ``self.optimizer``: one flat float32 CPU
    vector in and out. Both the daemon's Trainer and lowcomm.Swarm's ExternalTrainer use it."""

    params: list[torch.Tensor]
    split: TrainableSplit
    optimizer: torch.optim.Optimizer

    def get_params(self) -> torch.Tensor:
        # At every round boundary (and checkpoint): no parameter outside the averaged set trains.
        self.split.check()
        return parameters_to_vector(self.params).detach().to("cpu", torch.float32).clone()

    def set_params(self, flat: torch.Tensor) -> None:
        copy_flat_into(self.params, flat)

    def set_params_slice(self, fragment: slice, values: torch.Tensor) -> None:
        """Overwrite ``fragment`` of the flat parameters (the rest keeps training)."""
        flat = self.get_params()
        flat[fragment] = values
        self.set_params(flat)

    def add_to_slice(self, fragment: slice, shift: torch.Tensor) -> None:
        """Shift ``fragment`` of the flat parameters by ``shift`` (overlap mode's correction)."""
        flat = self.get_params()
        flat[fragment] += shift
        self.set_params(flat)

    def reset_to(self, flat: torch.Tensor) -> None:
        """Start over from ``flat`` after a divergence: the optimizer's moments may hold NaN too."""
        self.set_params(flat)
        self.optimizer.state.clear()


def vocabulary_fix(config: Config, needed: int, has: int) -> str:
    """How to fit a tokenizer of ``needed`` ids to the model of ``config`` (which takes ``has``):
    where a model's vocabulary is set depends on its kind (the presets have no key for it; "a model
    with vocab_size >= N" sent users to a [model] vocab_size that does not exist)."""
    model = config.model
    if model.kind == "hf_config":
        return (f"set \"vocab_size\" to {needed} or more in the config.json of [model] hf_config "
                f"({model.hf_config}), or use a tokenizer of at most {has} ids")
    if model.kind == "hf_pretrained":
        return f"use the tokenizer.json made for the model in {model.hf_pretrained} ([model] hf_pretrained)"
    if model.kind == "factory":
        return (f"make [model] factory build a module that takes {needed} or more token ids (its vocab_size "
                f"attribute says how many), e.g. through [model] factory_kwargs, or use a tokenizer of at most "
                f"{has} ids")
    return (f"lowcomm's preset models are byte-level and no key changes their vocabulary: set [data] tokenizer = "
            f"\"bytes\", or train a model of your own with {needed} or more token ids ([model] hf_config, a "
            f"config.json with \"vocab_size\": {needed}, or [model] factory)")


def data_summary(config: Config, corpus: Corpus, parameters: int, frozen: int = 0) -> str:
    """One line of what the node trains on, so that a wrong glob or format shows at start (a run
    on the wrong data otherwise looks like any other run)."""
    data = config.data
    source = f"[data] path {data.path!r}" if data.path else "the standard library's .py files (no [data] path)"
    return (f"data: {source}, format {data.format}, tokenizer {data.tokenizer}: {corpus.files} file(s), "
            f"{len(corpus.train):,} training tokens, {len(corpus.eval):,} held out; model: {parameters:,} parameters"
            + (f" averaged ({frozen:,} frozen, not averaged)" if frozen else ""))


class Trainer(FlatParams):
    """The daemon's trainer: a ``TrainerPort`` (node/ports.py) that is also ``ReplicaEvaluating``."""

    def __init__(self, config: Config, peer_key: str, corpus: Corpus | None = None) -> None:
        self.config = config
        self.device = pick_device(config.node.device)
        if config.node.torch_threads:
            torch.set_num_threads(config.node.torch_threads)
        corpus = corpus or load_data(config.data)
        # Any model kind of node/models, called as model(inputs, targets) -> (logits, loss).
        self.model: torch.nn.Module = build_model_for(config).to(self.device)
        # A factory's frozen parameters (a base under adapters) are not averaged: node/averaged_params.py
        self.split = TrainableSplit(self.model)
        self.params = self.split.averaged
        self.numel = sum(p.numel() for p in self.params)
        vocab = vocab_size_of(self.model)
        if vocab is not None and corpus.vocab_size is not None and corpus.vocab_size > vocab:
            raise DataError(f"[data] tokenizer {config.data.tokenizer!r} has a vocabulary of {corpus.vocab_size}, "
                            f"more than the model's {vocab}: {vocabulary_fix(config, corpus.vocab_size, vocab)}")
        # Ids of tokens files (whose vocabulary nothing states) are checked batch by batch.
        try:
            self.sampler = ShardSampler(corpus.train, config.data.seq_len, config.train.batch_size,
                                        config.data.shards, peer_key, config.train.seed, vocab_limit=vocab)
            self.eval_set = eval_batches(corpus.eval, config.data.seq_len, config.train.batch_size,
                                         config.data.eval_batches, vocab_limit=vocab)
        except DataError as err:  # name the data the split came from
            source = f"[data] path {config.data.path!r}" if config.data.path else "the bundled corpus"
            raise DataError(f"{source}: {err}") from None
        frozen = sum(p.numel() for _, p in self.split.frozen)
        log.info("%s", data_summary(config, corpus, self.numel, frozen), extra={
            "event": "data_loaded", "files": corpus.files, "train_tokens": len(corpus.train),
            "eval_tokens": len(corpus.eval), "parameters": self.numel, "frozen_parameters": frozen})
        self.optimizer = build_optimizer(config, self.params)
        self.inner_steps_done = 0
        # bf16 autocast on CUDA: the usual speed-up for transformer training, weights stay fp32.
        self._autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else contextlib.nullcontext()
        )


    def optimizer_state(self, name: str) -> torch.Tensor:
        """Training thread: the inner optimizer's state ``name`` as a flat float32 CPU vector."""
        return optimizer_state_flat(self.optimizer, self.params, name)

    def load_optimizer_state(self, name: str, flat: torch.Tensor) -> None:
        """Training thread: replace the inner optimizer's state ``name`` (node/state_sync.py)."""
        load_optimizer_state_flat(self.optimizer, self.params, name, flat)

    # -- the inner loop ---------------------------------------------------------------------

    def _lr(self) -> float:
        warmup = self.config.train.warmup_steps
        if warmup and self.inner_steps_done < warmup:
            return self.config.train.lr * (self.inner_steps_done + 1) / warmup
        return self.config.train.lr

    def train_phase(self, steps: int, should_stop: Callable[[], bool],
                    on_step: Callable[[int, float], None] | None = None) -> PhaseStats:
        """Run up to ``steps`` inner optimizer steps; returns early (with what it did) on ``should_stop``."""
        self.model.train()
        started = time.perf_counter()
        losses: list[float] = []
        micro = self.config.train.micro_batches
        for step in range(steps):
            if should_stop():
                break
            for group in self.optimizer.param_groups:
                group["lr"] = self._lr()
            self.optimizer.zero_grad(set_to_none=True)
            # Gradient accumulation: micro_batches forward/backward passes of batch_size sequences
            # add up (each scaled by 1/micro) to the gradient of one effective batch.
            step_loss = torch.zeros((), device=self.device)
            for _ in range(micro):
                inputs, targets = self.sampler.next_batch()
                inputs, targets = inputs.to(self.device), targets.to(self.device)
                with self._autocast:
                    _, loss = self.model(inputs, targets)
                (loss / micro).backward()
                step_loss += loss.detach().float() / micro
            torch.nn.utils.clip_grad_norm_(self.params, self.config.train.grad_clip)
            self.optimizer.step()
            self.inner_steps_done += 1
            losses.append(step_loss.item())  # one device sync per step, as before
            if on_step is not None:
                on_step(step + 1, losses[-1])
        tokens = len(losses) * micro * self.config.train.batch_size * self.config.data.seq_len
        mean = sum(losses) / len(losses) if losses else math.nan
        return PhaseStats(len(losses), tokens, mean, time.perf_counter() - started)

    def evaluate(self) -> float:
        """Mean loss of the current model on the fixed held-out batches."""
        return mean_eval_loss(self.model, self.eval_set, self.device)

    def replica_evaluator(self) -> Callable[[torch.Tensor, dict[str, torch.Tensor] | None], float]:
        """The eval of θ_global on a replica of the model (node/evaluator.py)."""
        from .evaluator import Evaluator  # it imports this module

        return Evaluator(self).evaluate

    # -- checkpointable local state -----------------------------------------------------------

    def local_state(self) -> dict:
        return {
            "buffers": persistent_buffers(self.model),  # local, as the optimizer's state (node/buffers.py)
            "optimizer": self.optimizer.state_dict(),
            "inner_steps_done": self.inner_steps_done,
            "sampler_shard": self.sampler.shard,
            "sampler_rng": self.sampler.generator.get_state(),
        }

    def load_local_state(self, state: dict) -> None:
        if "buffers" in state:  # checkpoints of before 2026-12-07 hold none: the model's own stay
            load_buffers(self.model, state["buffers"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.inner_steps_done = int(state["inner_steps_done"])
        self.sampler.shard = int(state["sampler_shard"]) % self.sampler.shards
        self.sampler.generator.set_state(state["sampler_rng"])
