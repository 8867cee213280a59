"""The sections of a config and their keys: what each ``[section] key`` means, its default and its
checks (pydantic models). node/config.py assembles them into one ``Config`` and loads it from
defaults, the TOML file, the environment and flags.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
import tomllib
import types
from pathlib import Path
from typing import Any, Literal, Mapping, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

CODEC_CHOICES = ("fp32", "fp16", "bf16", "int8", "int4", "topk", "sparseloco")


def _numeric_only(annotation: Any) -> bool:
    """Whether a field's type is a number (int, float, or a union of those with None) that pydantic
    would take a boolean for."""
    kinds = set(get_args(annotation)) or {annotation}
    return bool(kinds & {int, float}) and bool not in kinds


def _numeric_values(annotation: Any) -> bool:
    """Whether a field is a table of numbers (``dict[str, int]``, as ``[sync] state_sync``)."""
    args = get_args(annotation)
    return get_origin(annotation) is dict and len(args) == 2 and _numeric_only(args[1])


# Where a value came from decides how its type is read. A TOML file writes its types (so does a
# dict given to lowcomm.Swarm): `inner_steps = "5"` or `client_mode = "true"` there is a mistake,
# which pydantic's lax mode ran as 5 and True. The environment, flags and --set hand over text,
# which must still convert ("5" is 5; --set values are read as TOML literals first, bare words as
# strings). So values are read as typed unless load_config names their keys in the validation
# context under TEXT_KEYS ({section class: {key, ...}}); pydantic's own lax checks run after.
TEXT_KEYS = "lowcomm_text_keys"
_EXPECTED = {bool: "a boolean (true or false)", int: "an integer", float: "a number"}


def _from_text(cls: type, info: ValidationInfo) -> bool:
    """Whether this value of ``cls``'s field came from text (a variable, a flag, ``--set``)."""
    return info.field_name in ((info.context or {}).get(TEXT_KEYS) or {}).get(cls, ())


def _scalar_kinds(annotation: Any) -> set[type]:
    """The scalar types a field takes when they are only numbers and booleans (``int``, ``float | None``);
    empty for any other field."""
    kinds = set(get_args(annotation)) if get_origin(annotation) in (Union, types.UnionType) else {annotation}
    kinds.discard(type(None))
    return kinds if kinds and kinds <= set(_EXPECTED) else set()


def _mistyped(value: Any, kinds: set[type]) -> str | None:
    """What is wrong with a value written with its type (TOML) for a field of ``kinds``: a
    string for a number or boolean, or a number for a boolean; None when nothing is."""
    if not kinds:
        return None
    expected = " or ".join(_EXPECTED[kind] for kind in (bool, int, float) if kind in kinds)
    if isinstance(value, str):
        try:
            unquoted = tomllib.loads(f"v = {value}")["v"] if "\n" not in value else None
        except tomllib.TOMLDecodeError:
            unquoted = None
        fits = (isinstance(unquoted, bool) and bool in kinds
                or type(unquoted) is int and bool(kinds & {int, float})
                or type(unquoted) is float and float in kinds and math.isfinite(unquoted))
        return (f"expected {expected}, got the string {json.dumps(value, ensure_ascii=False)}"
                + (" (write it without quotes)" if fits else ""))
    if kinds == {bool} and isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"expected {expected}, got the number {value!r}"
    return None


def _wrong_type(message: str) -> PydanticCustomError:
    # Its own error type: describe_validation_error (node/config.py) writes it as "[section] key:
    # message", without the value that the message already quotes.
    return PydanticCustomError("lowcomm_wrong_type", "{message}", {"message": message})


class ConfigSection(BaseModel):
    # Unknown keys are errors: a typo in a run config must not silently fall back to a default.
    # inf and nan are refused everywhere: an outer_lr of inf committed a NaN model to the
    # checkpoint, and no rate, factor or timeout means anything at infinity.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True,
                              allow_inf_nan=False,
                              coerce_numbers_to_str=True)  # --set run.name=123 means the string

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads true as 1 and false as 0: `inner_steps = true` would train one
        # step a round and `--set train.seed=false` pick seed 0. Numbers given as strings (the
        # LOWCOMM_* variables, flags) still convert; written as strings in a file they do not
        # (TEXT_KEYS above).
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, bool) and _numeric_only(annotation):
            raise ValueError(f"expected a number, got the boolean {str(value).lower()}")
        if isinstance(value, Mapping) and _numeric_values(annotation):  # state_sync = {exp_avg = true}
            for key, item in value.items():
                if isinstance(item, bool):
                    raise ValueError(f"{key} = {str(item).lower()}: expected a number, got a boolean")
        if _from_text(cls, info):
            return value
        mistake = _mistyped(value, _scalar_kinds(annotation))
        if mistake is None and isinstance(value, Mapping) and _numeric_values(annotation):  # {exp_avg = "3"}
            kinds = _scalar_kinds(get_args(annotation)[1])
            mistake = next((f"{key}: {wrong}" for key, item in value.items()
                            if (wrong := _mistyped(item, kinds)) is not None), None)
        if mistake is not None:
            raise _wrong_type(mistake)
        return value

    def ignored(self) -> dict[str, str]:
        """Keys of this section that do nothing with the kind it chose (another format, model,
        optimizer...), each with why; node/config.py's ``ignored_settings`` warns of those set."""
        return {}


class RunSection(ConfigSection):
    name: str = Field("lowcomm", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """Name of the run; prefixes every DHT key, so two runs can share one DHT."""


# The weight files transformers' from_pretrained looks for in a local directory (without the
# from_tf, from_flax or variant arguments, which lowcomm never passes): one file or a shard index.
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                   "pytorch_model.bin.index.json")


def relative_to_cwd(path: str) -> str:
    """For a message about a relative path that was not found: where it was looked for. A path in
    a config file is read from the current directory, not from the file's."""
    if Path(path).expanduser().is_absolute():
        return ""
    return f" (relative paths, also in a config file, are read from the current directory: {Path.cwd()})"


class ModelSection(ConfigSection):
    preset: Literal["tiny", "small", "medium", "gpt2"] = "tiny"
    """lowcomm's byte-level GPT by size: tiny (CPU, ~0.5M params) up to gpt2 (124M, for GPUs). Used
    when none of factory, hf_config and hf_pretrained is set."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout probability inside the preset's transformer blocks."""
    factory: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$")
    """Your own model, as "package.module:function": the function returns a torch.nn.Module whose
    forward(inputs, targets) returns the loss, or a (module, loss_fn) pair (README, "Train your own model")."""
    factory_kwargs: dict[str, str | int | float | bool] | None = None
    """Keyword arguments of the factory call, e.g. { width = 256 } (part of the run fingerprint)."""
    hf_config: str | None = None
    """A Hugging Face transformers causal LM with random initial weights (drawn from [train] seed):
    path of a local config.json, or of a directory holding one."""
    hf_pretrained: str | None = None
    """A Hugging Face causal LM loaded with from_pretrained from a local directory (config.json and
    weights); lowcomm never downloads a model at run time."""

    @field_validator("factory_kwargs", mode="before")
    @classmethod
    def _plain_values(cls, value: Any) -> Any:
        # pydantic tried each type of the union and reported all four failures, on lines that
        # named the table but not the key.
        if isinstance(value, Mapping):
            for key, item in value.items():
                if not isinstance(item, (str, int, float, bool)):
                    raise ValueError(f"{key} = {item!r}: a keyword's value must be a string, number or boolean; "
                                     f"give a list or table as a string and parse it in your factory")
        return value

    @field_validator("hf_config")
    @classmethod
    def _config_exists(cls, value: str | None) -> str | None:
        if value is not None:
            path = Path(value).expanduser()
            if not (path.is_file() or (path / "config.json").is_file()):
                raise ValueError(f"{value!r} is neither a config.json file nor a directory holding one"
                                 f"{relative_to_cwd(value)}")
        return value

    @field_validator("hf_pretrained")
    @classmethod
    def _local_directory(cls, value: str | None) -> str | None:
        if value is not None and not (Path(value).expanduser() / "config.json").is_file():
            if Path(value).expanduser().exists():
                raise ValueError(f"{value!r} holds no config.json; give the directory that save_pretrained wrote"
                                 f"{relative_to_cwd(value)}")
            raise ValueError(
                f"{value!r} is not a local directory: lowcomm loads models from local files only (no hub "
                f"access at run time). Download it first with huggingface_hub's CLI, e.g. "
                f"`hf download {value} --local-dir DIR`, and set hf_pretrained = \"DIR\"")
        if value is not None and not any((Path(value).expanduser() / name).is_file() for name in HF_WEIGHT_FILES):
            # Else from_pretrained said so only as the model was built, after the DHT's start.
            raise ValueError(f"{value!r} holds a config.json but no weights ({', '.join(HF_WEIGHT_FILES)}); give the "
                             f"directory that save_pretrained (or `hf download`) wrote, or set hf_config to its "
                             f"config.json instead for random initial weights")
        return value

    @model_validator(mode="after")
    def _one_kind(self) -> "ModelSection":
        chosen = [key for key in ("factory", "hf_config", "hf_pretrained") if getattr(self, key) is not None]
        if "preset" in self.model_fields_set and self.preset != "tiny":
            chosen.insert(0, "preset")
        if len(chosen) > 1:
            raise ValueError(f"set one of preset, factory, hf_config and hf_pretrained, not {' and '.join(chosen)}")
        if self.factory_kwargs is not None and self.factory is None:
            raise ValueError("factory_kwargs needs factory")
        return self

    @property
    def kind(self) -> Literal["preset", "factory", "hf_config", "hf_pretrained"]:
        """Which of the four ways of defining the model this section uses."""
        for key in ("factory", "hf_config", "hf_pretrained"):
            if getattr(self, key) is not None:
                return key  # type: ignore[return-value]
        return "preset"

    def ignored(self) -> dict[str, str]:
        if self.kind == "preset":
            return {}
        return {"dropout": f"it is the dropout of lowcomm's preset models, and this [model] sets {self.kind}"}


class DataSection(ConfigSection):
    format: Literal["text", "jsonl", "tokens", "hf"] = "text"
    """text: UTF-8 files (path is a glob); jsonl: one JSON object per line, text under `field`;
    tokens: flat binary token ids (nanoGPT's train.bin), memory-mapped; hf: a Hugging Face
    `datasets` directory written by save_to_disk (path is that directory)."""
    path: str | None = None
    """Glob of the files to train on (or the save_to_disk directory for hf); unset with format =
    "text": the Python standard library's own .py files."""
    field: str | None = None
    """jsonl: key of the text in each record (default "text"); hf: column of text or of token ids
    (default "input_ids" when the dataset has one, else "text")."""
    tokenizer: str = "bytes"
    """bytes: every byte is a token (vocabulary 256); or the path of a local Hugging Face
    tokenizer.json (the `tokenizers` library). With format = "tokens" it only states the vocabulary."""
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    """tokens: the integer type of the ids in the file (nanoGPT writes uint16)."""
    seq_len: int = Field(128, ge=8, le=4096)
    """Tokens per training sequence."""
    eval_fraction: float = Field(0.05, gt=0.0, lt=0.5)
    """Share of the files held out for evaluation (chosen by a hash of the file name); with one file,
    the tail of its tokens."""
    eval_batches: int = Field(4, ge=1)
    """Batches of the fixed held-out set averaged into one eval loss."""
    shards: int = Field(64, ge=1)
    """Shards of the training split (each one interleaved blocks spread over the whole corpus); each peer
    starts on a shard chosen by its id."""

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_exists(cls, value: str) -> str:
        if value != "bytes" and not Path(value).expanduser().is_file():
            raise ValueError(f"{value!r} is not a file; give \"bytes\" or the path of a local tokenizer.json")
        return value

    @model_validator(mode="after")
    def _path_for_format(self) -> "DataSection":
        if self.format != "text" and self.path is None:
            raise ValueError(f"format = \"{self.format}\" needs path (only text has a default corpus)")
        return self

    def ignored(self) -> dict[str, str]:
        found = {}
        if self.format not in ("jsonl", "hf"):
            found["field"] = (f"it names the text field of format = \"jsonl\" files (the column of format = \"hf\"), "
                              f"and format is \"{self.format}\"")
        if self.format != "tokens":
            found["token_dtype"] = f"it is the id type of format = \"tokens\" files, and format is \"{self.format}\""
        return found


class TrainSection(ConfigSection):
    inner_steps: int = Field(50, ge=1)
    """H: inner optimizer steps between two outer rounds."""
    batch_size: int = Field(16, ge=1)
    """Sequences per forward pass; an inner step sees batch_size × micro_batches of them."""
    lr: float = Field(1e-3, gt=0.0, le=10.0)
    """Peak learning rate of the inner AdamW optimizer. At most 10: Adam moves every weight by
    about lr a step, so far less than 1 is what trains (beyond ~1e37 torch's step overflows)."""
    weight_decay: float = Field(0.1, ge=0.0)
    """AdamW weight decay."""
    warmup_steps: int = Field(20, ge=0)
    """Linear warm-up of the inner learning rate, in inner steps of this process."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Global gradient-norm clip of the inner steps."""
    micro_batches: int = Field(1, ge=1)
    """Gradient accumulation: each inner step adds the gradients of this many batches of batch_size
    sequences (an effective batch of batch_size × micro_batches at the memory of one)."""
    seed: int = 0
    """Seed of the initial weights (identical on every peer) and of the data order."""
    optimizer: Literal["adamw", "mtdao"] = "adamw"
    """The inner optimizer. adamw: AdamW (β = 0.9, 0.95). mtdao: MT-DAO, Adam with a fast (β 0.9)
    and a slow first moment mixed quasi-hyperbolically (node/optimizers.py); meant with [sync]
    state_sync averaging its slow moment (method = "mtdao" sets both)."""
    mtdao_beta_slow: float = Field(0.99, gt=0.0, lt=1.0)
    """mtdao: decay of the slow first moment (0.99..0.999: a horizon longer than an inner phase)."""
    mtdao_slow_weight: float = Field(0.5, ge=0.0, le=1.0)
    """mtdao: weight of the slow moment in the step (1 − it is the fast moment's)."""

    @model_validator(mode="after")
    def _decay_keeps_the_weights(self) -> "TrainSection":
        # Decoupled weight decay scales every weight by 1 − lr·weight_decay each step: at 1 or
        # more it zeroes or flips them, and the local model diverged every round, forever.
        if self.lr * self.weight_decay >= 1.0:
            raise ValueError(f"lr × weight_decay is {self.lr * self.weight_decay:g}: each step scales the weights by "
                             f"1 − lr·weight_decay, so it must stay below 1 (e.g. weight_decay = 0.1 with lr = 1e-3)")
        return self

    def ignored(self) -> dict[str, str]:
        if self.optimizer == "mtdao":
            return {}
        why = f"it tunes optimizer = \"mtdao\", and optimizer is \"{self.optimizer}\""
        return {"mtdao_beta_slow": why, "mtdao_slow_weight": why}


# ``[sync] method``: a named sync algorithm sets several keys together (README, "Sync options").
# FIXED keys are the method's definition: setting one to another value is an error. DEFAULTS are
# its tuned starting points: an explicit value of the key wins over them.
METHOD_FIXED: dict[str, dict[str, Any]] = {
    "diloco": {},
    # The decayed error feedback of the sparseloco codec stands in for the outer momentum.
    "sparseloco": {"codec": "sparseloco", "outer_momentum": 0.0},
    "desloc": {},
    "mtdao": {},
}
METHOD_DEFAULTS: dict[str, dict[str, Any]] = {
    "diloco": {},
    # θ ← θ − α·mean(decoded), every contribution's norm clipped to the shard's median norm. The
    # paper's α is 1. On the long benchmark (4 peers, 1,000 steps, H = 20, 3 seeds, emulator and
    # real node: bench/analysis.md, "SparseLoCo's step size") α = 3 ends 7.8 % below 1.5; 4 is as
    # good within the seeds' spread and 5–6 fall off, so 3 keeps a margin from that edge.
    "sparseloco": {"outer_lr": 3.0, "aggregation": "clipped_mean", "clip_factor": 1.0},
    # DES-LOC: parameters every round, AdamW's first moment every 3 rounds, its second every 6.
    "desloc": {"state_sync": {"exp_avg": 3, "exp_avg_sq": 6}},
    # MT-DAO: the slow moment every round (the swarm's long-horizon direction), the fast one never
    # (it is this peer's own recent gradients), the second moment with DES-LOC's period.
    "mtdao": {"state_sync": {"exp_avg_slow": 1, "exp_avg_sq": 6}},
}
# Which inner optimizer a method needs ([train] optimizer; set by the method when not given).
METHOD_OPTIMIZER: dict[str, str] = {"desloc": "adamw", "mtdao": "mtdao"}
# The optimizer states ``state_sync`` may name, per [train] optimizer (node/optimizers.py).
STATE_NAMES: dict[str, tuple[str, ...]] = {
    "adamw": ("exp_avg", "exp_avg_sq"),
    "mtdao": ("exp_avg_fast", "exp_avg_slow", "exp_avg_sq"),
}


class SyncSection(ConfigSection):
    method: Literal["diloco", "sparseloco", "desloc", "mtdao"] = "diloco"
    """diloco: the codec below under outer Nesterov SGD. sparseloco: top-k 2-bit sparse
    pseudo-gradients with decayed error feedback and no outer momentum; sets codec = "sparseloco"
    and outer_momentum = 0 (other values are an error) and defaults outer_lr = 3.0, aggregation =
    "clipped_mean", clip_factor = 1.0 (explicit values win). desloc: DES-LOC, AdamW's moments
    synced on their own periods; defaults state_sync = {exp_avg = 3, exp_avg_sq = 6}. mtdao:
    sets [train] optimizer = "mtdao" and defaults state_sync = {exp_avg_slow = 1, exp_avg_sq = 6}."""
    state_sync: dict[str, int] = {}
    """Inner-optimizer states averaged across the group, each every N rounds (on the rounds that
    produce an outer step divisible by N), through the same all-reduce and codec as the
    pseudo-gradients, with their own error feedback; every member then loads the same average.
    Names: adamw exp_avg, exp_avg_sq; mtdao exp_avg_fast, exp_avg_slow, exp_avg_sq. Empty: the
    optimizer state stays local (DiLoCo)."""
    state_codec: Literal["bf16", "fp32"] = "bf16"
    """Encoding of the optimizer states on the wire, whatever the codec of the pseudo-gradients:
    a second moment spans many orders of magnitude, and a block-scaled integer codec (int8, int4)
    rounds its small entries to zero, which blows up those coordinates' steps; bf16 keeps 8 bits
    of every entry at fp32's range (2 bytes per value, error feedback carries the rest)."""
    mode: Literal["allreduce", "gossip"] = "allreduce"
    """How peers average: butterfly all-reduce inside groups (identical state), or gossip with a few
    random partners per round (states differ by design; the consensus distance is measured)."""
    overlap: Literal["none", "delayed", "eager"] = "none"
    """none: training waits for each round. delayed: the round of step r runs while the inner phase
    of step r+1 trains, and its result is applied at the next boundary (the local model is shifted
    by the difference, so no local progress is lost). eager: as delayed, but the local model
    continues from an outer step taken with its own pseudo-gradient as a stand-in for the average."""
    overlap_apply: Literal["arrival", "boundary"] = "arrival"
    """delayed/eager: when the averaged update reaches the local model. arrival: between two inner
    steps as soon as the background round is done (Streaming DiLoCo's overlap: the local model
    trains on a stale θ_global only while the round is on the wire). boundary: at the end of the
    inner phase (DiLoCoX's one-step delay: the whole phase trains on the stale θ_global)."""
    fragments: int = Field(1, ge=1)
    """K: the model is cut into K contiguous fragments synced in turn (Streaming DiLoCo); a round
    then comes every inner_steps/K steps and carries about 1/K of the bytes. At most inner_steps."""
    gossip_partners: int = Field(2, ge=1)
    """Gossip mode: partners a peer averages with in each round (k)."""
    aggregation: Literal["mean", "clipped_mean", "trimmed_mean"] = "mean"
    """How a shard owner combines contributions: plain weighted mean, mean after clipping every
    contribution's norm to clip_factor × the median norm, or coordinate-wise trimmed mean."""
    clip_factor: float = Field(2.0, gt=0.0)
    """clipped_mean: contributions are scaled down to at most this multiple of the median norm."""
    trim_fraction: float = Field(0.2, ge=0.0, lt=0.5)
    """trimmed_mean: share of the largest and of the smallest values dropped per coordinate."""
    norm_bound_factor: float = Field(20.0, gt=1.0)
    """A contribution whose norm exceeds this multiple of the median norm of its shard is rejected."""
    codec: Literal["fp32", "fp16", "bf16", "int8", "int4", "topk", "sparseloco"] = "int8"
    """Encoding of pseudo-gradients on the wire (lossy codecs use error feedback)."""
    schedule: Literal["butterfly", "ring", "auto"] = "butterfly"
    """How a group exchanges its parts. butterfly: every member sends each shard owner its part
    and gets the owner's average back; the owner checks every contribution (norm bound, the
    aggregation rule), and a failed owner costs only its shard. ring: the members pass running
    sums round a ring (protocol/ring.py), one flow per link, no link shared; no owner sees a
    contribution on its own, so it needs aggregation = "mean", applies no norm bound, and a
    member that fails costs the whole round (every peer carries its part to the next). For
    swarms whose members trust each other. Split steps and groups with a client-mode member
    run as a butterfly. auto: the leader makes each group a ring or a butterfly, whichever the
    members' declared bandwidths say is faster (a ring on equal links, a butterfly when one
    member is several times slower: protocol/layout.py choose_schedule), and a butterfly every
    10th step, which refreshes the bandwidths; it needs what a ring needs."""
    group_size: int = Field(16, ge=2)
    """Largest group a leader closes, except that no group is left with one member (size 2 and an
    odd count: one group of three) and client-mode peers join the groups of reachable ones."""
    outer_lr: float = Field(1.0, gt=0.0, le=10.0)
    """Learning rate of the outer Nesterov SGD step. 1.0 with momentum 0.5 measured best at 4 peers and
    H=50 (bench/RESULTS.md section 1c; the DiLoCo paper's 0.7 / 0.9 ended 1.4 % higher). At most
    10: the step moves θ_global by outer_lr times the averaged change of the inner steps."""
    outer_momentum: float = Field(0.5, ge=0.0, lt=1.0)
    """Momentum of the outer step (see outer_lr)."""
    matchmaking_buckets: bool = True
    """Two-level matchmaking for large steps (protocol/buckets.py): from four groups' worth of
    peers at a step, peers meet in buckets and their leaders at one step coordinator, so no peer
    receives more than about group_size + buckets JoinGroup calls (one leader receives every call
    otherwise: 1,050 per round at 1,024 simulated peers in groups of 16, against 121 with
    buckets, at the same share of peers averaged, 0.99–1.00; 32 real processes in groups of 8:
    28.5 calls per round at the busiest peer against 45.2, one hash per step, no download after
    the first catch-up, but formation 8.0 s p50 against 4.2 s; bench/RESULTS.md section 8).
    Smaller steps matchmake on one level either way. A local choice, not part of the run
    fingerprint: peers with it off meet the buckets' coordinator as ordinary registrants."""
    matchmaking_timeout: float = Field(30.0, gt=0.0)
    """Longest a leader waits for the expected peers before it closes the group with who came."""
    quorum: float = Field(2 / 3, gt=0.0, le=1.0)
    """Share of the expected peers after which a leader stops waiting for everyone and gives the
    rest an adaptive grace (twice the recent straggler delay, at least straggler_wait). Rounded
    up: with 2/3, two of three peers are a quorum; with 0.67 all three are needed."""
    straggler_wait: float = Field(2.0, ge=0.0)
    """Floor of the adaptive grace for stragglers, in seconds."""
    reduce_timeout: float = Field(60.0, gt=0.0)
    """Seconds a member waits for one shard's average before it skips that shard."""

    @model_validator(mode="before")
    @classmethod
    def _apply_method(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or data.get("method", "diloco") not in METHOD_FIXED:
            return data  # not a mapping, or an unknown method: the field's own check reports it
        method = data.get("method", "diloco")
        for key, value in METHOD_FIXED[method].items():
            if key in data and data[key] != value:
                raise ValueError(f"method = \"{method}\" sets {key} = {value!r}; remove {key} = {data[key]!r} "
                                 f"or choose method = \"diloco\"")
        return {**METHOD_DEFAULTS[method], **METHOD_FIXED[method], **data}

    @field_validator("state_sync")
    @classmethod
    def _periods_positive(cls, value: dict[str, int]) -> dict[str, int]:
        bad = {name: period for name, period in value.items() if period < 1}
        if bad:
            raise ValueError(f"periods are rounds, at least 1; got {bad}")
        return value

    @model_validator(mode="after")
    def _ring_needs_trust_and_a_dense_codec(self) -> "SyncSection":
        if self.schedule in ("ring", "auto"):
            mine = f"schedule = \"{self.schedule}\"" + (" may run a ring, which" if self.schedule == "auto" else "")
            if self.aggregation != "mean":
                raise ValueError(f"{mine} sums contributions on the way, so no owner can apply "
                                 f"aggregation = \"{self.aggregation}\"; set aggregation = \"mean\" or "
                                 f"schedule = \"butterfly\"")
            if self.codec in ("topk", "sparseloco"):
                raise ValueError(f"{mine} re-encodes running sums at every hop, which a sparse codec "
                                 f"(codec = \"{self.codec}\") would thin out; use fp32, fp16, bf16, int8 or int4, "
                                 f"or schedule = \"butterfly\"")
            if self.mode != "allreduce":
                raise ValueError(f"schedule = \"{self.schedule}\" is an all-reduce schedule; it needs "
                                 "mode = \"allreduce\"")
        return self

    @model_validator(mode="after")
    def _sparse_needs_allreduce(self) -> "SyncSection":
        # Gossip averages parameters, not pseudo-gradients: a sparse top-k of θ would zero most of it.
        if self.mode == "gossip" and self.codec == "sparseloco":
            raise ValueError("codec = \"sparseloco\" (and method = \"sparseloco\") work with mode = \"allreduce\" only")
        return self

    def ignored(self) -> dict[str, str]:
        found = {}
        if self.mode != "gossip":
            found["gossip_partners"] = f"it is the partner count of mode = \"gossip\", and mode is \"{self.mode}\""
        for key, aggregation in (("clip_factor", "clipped_mean"), ("trim_fraction", "trimmed_mean")):
            if self.aggregation != aggregation:
                found[key] = (f"it applies to aggregation = \"{aggregation}\", and aggregation is "
                              f"\"{self.aggregation}\"")
        if self.overlap == "none":
            found["overlap_apply"] = "it applies to overlap = \"delayed\" or \"eager\", and overlap is \"none\""
        if not self.state_sync:
            found["state_codec"] = "it encodes the optimizer states of state_sync, and state_sync is empty"
        return found

    @model_validator(mode="after")
    def _robust_aggregation_needs_allreduce(self) -> "SyncSection":
        # A gossip peer takes the plain mean of the parameters it pulled: asked for a robust
        # aggregation, it would have run without one and said nothing.
        if self.mode == "gossip" and self.aggregation != "mean":
            raise ValueError(f"aggregation = \"{self.aggregation}\" is applied by the shard owners of an all-reduce; "
                             f"mode = \"gossip\" averages its partners' parameters with the plain mean: set "
                             f"aggregation = \"mean\" or mode = \"allreduce\"")
        return self


# One label of a DNS name (RFC 1123): letters, digits and inner hyphens, 63 characters at most;
# underscores too, which Docker Compose service names carry and resolvers accept.
_HOST_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def _is_host_name(value: str) -> bool:
    """Whether ``value`` is a DNS host name (a trailing dot allowed; no all-digit last label, so
    that a mistyped address such as 10.0.0.256 is not taken for a name)."""
    labels = value.removesuffix(".").split(".")
    return (len(value) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in labels)
            and not labels[-1].isdigit())


class NodeSection(ConfigSection):
    peers: list[str] = []
    """Multiaddrs of peers already in the swarm; empty: start a new swarm."""
    host: str = "0.0.0.0"
    """IP address of the interface the DHT and gRPC servers listen on (0.0.0.0: every interface)."""
    announce_host: str | None = None
    """Host other peers use to reach this node's gRPC server (default: the listen host, or the
    first non-loopback address the DHT sees when listening on 0.0.0.0)."""
    grpc_port: int = Field(7701, ge=0, le=65535)
    """gRPC port (averaging, state download, status, health); 0 picks a free port."""
    dht_port: int = Field(7700, ge=0, le=65535)
    """libp2p port of the DHT; 0 picks a free port."""
    metrics_port: int = Field(7702, ge=0, le=65535)
    """Prometheus /metrics port; 0 picks a free port."""
    identity: Path | None = None
    """libp2p private key file (created if missing); default: <checkpoint_dir>/identity.key."""
    checkpoint_dir: Path = Path("lowcomm-checkpoints")
    """Directory of the atomic checkpoints (the last two are kept)."""
    run_secret_file: Path | None = None
    """File holding the run secret: with it every RPC and DHT record is authenticated (HMAC)."""
    tls_cert: Path | None = None
    """PEM certificate of this node's gRPC server (with tls_key): peers then connect over TLS."""
    tls_key: Path | None = None
    """PEM private key matching tls_cert."""
    client_mode: bool = False
    """No inbound connections: own no shard, serve no state (for peers behind NAT; needs peers)."""
    max_rounds: int | None = Field(None, ge=1)
    """Exit 0 after this many outer rounds of this process."""
    wait_for_peers: int = Field(1, ge=1)
    """Start training only once this many peers, this one included, are in the swarm, or once
    another peer trains (the swarm has started); each time the node starts, and it then trains on
    whoever leaves. 1: at once. For a swarm started together: its first peer would otherwise take
    outer steps alone while the others start up."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where inner steps run; auto: CUDA (with bf16 autocast) when available."""
    torch_threads: int | None = Field(None, ge=1)
    """Torch intra-op threads of the training thread; unset: torch's default."""
    compute_niceness: int = Field(10, ge=0, le=19)
    """Linux: the training and eval threads run this much nicer than the rest of the node, so
    that RPCs, the DHT and the all-reduce (latency-bound) never queue behind compute
    (throughput-bound) on a busy CPU. 0: same priority."""
    log_format: Literal["auto", "text", "json"] = "auto"
    """auto: human lines on a terminal, JSON lines otherwise."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest level printed."""
    heartbeat_interval: float = Field(5.0, gt=0.0)
    """Seconds between refreshes of this peer's DHT record (records live 3 intervals)."""
    grace_period: float = Field(20.0, gt=0.0)
    """Seconds SIGTERM/SIGINT leaves a round in flight before abandoning it."""
    max_clock_offset: float = Field(86_400.0, ge=0.0)
    """Largest offset of this machine's clock from its bootstrap peers' that the node corrects
    (it then runs on swarm time); beyond it the node stops and asks to synchronise the clock.
    0: never correct (then a clock more than 0.5 s off stops the node)."""

    @field_validator("host")
    @classmethod
    def _host_is_an_address(cls, value: str) -> str:
        # p2pd listens on the multiaddr /ip4/<host>/tcp/<port>, which takes no name: `--host
        # localhost` was p2pd's Go log line "failed to parse multiaddr".
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"not an IP address: give an address of this machine (127.0.0.1 for "
                             f"loopback, 0.0.0.0 for every interface); a name other peers should use goes to "
                             f"announce_host") from None
        return value

    @field_validator("announce_host")
    @classmethod
    def _announce_host_is_reachable(cls, value: str | None) -> str | None:
        # Peers dial "<announce_host>:<grpc_port>": `--announce-host 'bad host'` was announced as
        # "bad host:34713", which no peer could connect to. Empty: unset, as before.
        if not value:
            return value
        bare = value[1:-1] if value.startswith("[") and value.endswith("]") else value
        try:
            address = ipaddress.ip_address(bare)
        except ValueError:
            if _is_host_name(value):
                return value
            raise ValueError("not a host name or IP address: give the DNS name or address other peers reach "
                             "this node at (e.g. node-3.example.org, 203.0.113.7), without a port (the port is "
                             "grpc_port)") from None
        # An IPv6 address goes in brackets, or "::1:7701" would read as an address without a port.
        return f"[{address}]" if address.version == 6 else str(address)

    @field_validator("peers", mode="before")
    @classmethod
    def _split_peers(cls, value: Any, info: ValidationInfo) -> Any:
        # From the environment, peers arrive as one string: accept commas and whitespace. A
        # string in a file is a mistake (TEXT_KEYS): `peers = "notalist"` was reported as an
        # invalid --peers multiaddr, which named neither the file nor what to write.
        if isinstance(value, str):
            parts = [part for part in value.replace(",", " ").split() if part]
            if _from_text(cls, info):
                return parts
            example = ", ".join(json.dumps(part) for part in parts) if parts and all(
                part.startswith("/") for part in parts) else '"/ip4/<address>/tcp/<port>/p2p/<peer id>"'
            given = json.dumps(value, ensure_ascii=False)
            raise _wrong_type(f"expected a list of multiaddrs, got the string {given}: write peers = [{example}]")
        return value

    @field_validator("identity", "checkpoint_dir", "run_secret_file", "tls_cert", "tls_key")
    @classmethod
    def _expand_home(cls, value: Path | None) -> Path | None:
        # A shell expands ~ in a flag, but not in a config file, an environment variable or
        # systemd's EnvironmentFile: "~/ckpt" made a folder named "~" in the current directory
        # while every message said "~/ckpt" (the data and model paths were expanded already).
        return value.expanduser() if value is not None else None

    @model_validator(mode="after")
    def _ports_differ(self) -> "NodeSection":
        # The second server to bind a shared port failed with "is it already in use?", which
        # sent the user looking for another process.
        taken: dict[int, str] = {}
        for name, port in (("dht_port", self.dht_port), ("grpc_port", self.grpc_port),
                           ("metrics_port", self.metrics_port)):
            if port and port in taken:
                raise ValueError(f"{taken[port]} and {name} are both {port}: the DHT, gRPC and metrics servers need "
                                 f"a port each (0: a free one)")
            taken[port] = name
        return self

    @model_validator(mode="after")
    def _client_has_peers(self) -> "NodeSection":
        # A client owns no shard and accepts no connection, so nobody can average with it until it
        # reaches a listening peer: without peers it waited at step 0 forever.
        if self.client_mode and not self.peers:
            raise ValueError("client_mode needs peers: a client-mode node only connects out, so it cannot start a "
                             "swarm; give --peers the multiaddr of a reachable node (one started without --client-mode)")
        return self
