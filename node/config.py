"""Typed, validated configuration: defaults < ``--config`` TOML < ``LOWCOMM_*`` env < flags.

A config has two halves:

* the **run config** (``[run]``, ``[model]``, ``[data]``, ``[train]``, ``[sync]``): what every peer
  of one run must agree on. Its canonical JSON is hashed into a fingerprint that peers compare
  before they average (``run_fingerprint``);
* the **node config** (``[node]``): where this one process listens, stores and logs. Every
  ``[node]`` key is also a ``join`` flag and a ``LOWCOMM_<KEY>`` environment variable.

Errors never surface as pydantic tracebacks: ``load_config`` raises ``ConfigError`` whose message
names the source (file, variable or flag), the key and what was expected.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from pydantic import ValidationError, model_validator

# The sections live in node/config_sections.py; they are re-exported here, where callers import them.
from .config_sections import (  # noqa: F401
    CODEC_CHOICES,
    METHOD_DEFAULTS,
    METHOD_FIXED,
    METHOD_OPTIMIZER,
    STATE_NAMES,
    TEXT_KEYS,
    ConfigSection,
    DataSection,
    ModelSection,
    NodeSection,
    RunSection,
    SyncSection,
    TrainSection,
)

class Config(ConfigSection):
    run: RunSection = RunSection()
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    train: TrainSection = TrainSection()
    sync: SyncSection = SyncSection()
    node: NodeSection = NodeSection()

    @model_validator(mode="after")
    def _modes_combine(self) -> "Config":
        if self.sync.mode == "gossip" and (self.sync.overlap != "none" or self.sync.fragments > 1):
            raise ValueError("[sync] overlap and fragments work with mode = \"allreduce\" only")
        if self.sync.fragments > self.train.inner_steps:
            # A round comes every H/K inner steps, at least one: with more fragments than that,
            # some would be synced less often than every H steps, or (K beyond the parameter
            # count) hold nothing at all.
            raise ValueError(f"[sync] fragments = {self.sync.fragments} is more than [train] inner_steps = "
                             f"{self.train.inner_steps}: each fragment is synced once every inner_steps steps, "
                             f"so there can be at most that many")
        self._check_state_sync()
        return self

    @model_validator(mode="before")
    @classmethod
    def _method_sets_optimizer(cls, data: Any) -> Any:
        """``[sync] method = "mtdao"`` (or "desloc") chooses the inner optimizer too."""
        if not isinstance(data, Mapping) or not isinstance(data.get("sync"), Mapping):
            return data
        needed = METHOD_OPTIMIZER.get(data["sync"].get("method"))
        train = data.get("train", {})
        if needed is None or not isinstance(train, Mapping):
            return data
        if train.get("optimizer", needed) != needed:
            raise ValueError(f"[sync] method = \"{data['sync']['method']}\" needs [train] optimizer = \"{needed}\", "
                             f"not {train['optimizer']!r}")
        return {**data, "train": {**train, "optimizer": needed}}

    def _check_state_sync(self) -> None:
        sync = self.sync
        if not sync.state_sync:
            return
        known = STATE_NAMES[self.train.optimizer]
        unknown = sorted(set(sync.state_sync) - set(known))
        if unknown:
            raise ValueError(f"[sync] state_sync names {', '.join(unknown)}, which [train] optimizer = "
                             f"\"{self.train.optimizer}\" does not have (its states: {', '.join(known)})")
        if sync.mode != "allreduce" or sync.overlap != "none" or sync.fragments != 1:
            raise ValueError("[sync] state_sync works with mode = \"allreduce\", overlap = \"none\" and fragments = 1 "
                             "only")

    def run_config(self) -> dict[str, Any]:
        """The part every peer of a run must share, as plain JSON-able data.

        Paths are local to each peer, so they never enter it: a model or tokenizer given by a file
        is described by a hash of its content and by the model's parameter shapes (node/models)."""
        # Imported here: they import torch (and transformers), which `status` and `init-config` never need.
        from .formats import tokenizer_definition
        from .models import model_definition

        # ``method`` is a shorthand for keys that are in here already: leaving it out keeps the
        # fingerprints (and checkpoints) of runs made before it existed, and of equivalent spellings.
        sync = self.sync.model_dump(exclude={"matchmaking_timeout", "matchmaking_buckets", "reduce_timeout", "quorum", "straggler_wait",
                                             "method"})
        # Keys added later enter the fingerprint only when set: runs without them keep theirs.
        if not sync["state_sync"]:
            del sync["state_sync"], sync["state_codec"]
        if sync["schedule"] == "butterfly":
            del sync["schedule"]
        train = self.train.model_dump()
        if train["optimizer"] == "adamw":
            for key in ("optimizer", "mtdao_beta_slow", "mtdao_slow_weight"):
                del train[key]
        data: dict[str, Any] = {"seq_len": self.data.seq_len}
        if self.data.tokenizer != "bytes":
            data.update(tokenizer_definition(self.data.tokenizer))
        return {
            "run": self.run.model_dump(),
            **model_definition(self.model),
            "data": data,
            "train": train,
            "sync": sync,
        }

    def run_config_json(self) -> str:
        return json.dumps(self.run_config(), sort_keys=True, separators=(",", ":"))

    def run_fingerprint(self) -> str:
        return fingerprint_of(self.run_config_json())

    @property
    def identity_path(self) -> Path:
        return self.node.identity or self.node.checkpoint_dir / "identity.key"


def fingerprint_of(run_config_json: str) -> str:
    """The run fingerprint of a ``Config.run_config_json()`` (for a caller that keeps the JSON
    too: building it reads the tokenizer's and the model config's files)."""
    return hashlib.sha256(run_config_json.encode()).hexdigest()


class ConfigError(Exception):
    """A user mistake in the configuration; the message is complete and printed without traceback."""


# Flags and environment variables that set keys outside [node].
ALIASES: dict[str, tuple[str, str]] = {"data": ("data", "path")}
NODE_KEYS = tuple(NodeSection.model_fields)
ENV_PREFIX = "LOWCOMM_"


@dataclass
class ConfigLayers:
    """The merged raw config plus, for every key, where its value came from, and which keys came
    from text (variables, flags, ``--set``) rather than from a file that writes its types."""

    values: dict[str, dict[str, Any]] = field(default_factory=dict)
    sources: dict[tuple[str, str], str] = field(default_factory=dict)
    text: set[tuple[str, str]] = field(default_factory=set)

    def set(self, section: str, key: str, value: Any, source: str, text: bool = False) -> None:
        self.values.setdefault(section, {})[key] = value
        self.sources[(section, key)] = source
        if text:
            self.text.add((section, key))
        else:
            self.text.discard((section, key))

    def context(self) -> dict[str, Any]:
        """The validation context: the keys whose values are converted from text, per section
        class (config_sections.TEXT_KEYS); every other value must have its key's type."""
        keys: dict[type, set[str]] = {}
        for section, key in self.text:
            if section in Config.model_fields:
                keys.setdefault(Config.model_fields[section].annotation, set()).add(key)
        return {TEXT_KEYS: keys}

    def merge_file(self, data: Mapping[str, Any], source: str) -> None:
        for section, body in data.items():
            if not isinstance(section, str):  # only a dict can hold one (a Swarm's config)
                raise ConfigError(f"{source}: {section!r} is not a section name ({type(section).__name__}, not a "
                                  f"string); the sections are {_known_sections()}")
            if not isinstance(body, Mapping):
                raise ConfigError(_not_a_table(source, section, body))
            # Validation names an unknown section too, but only by its keys: an empty one or one
            # with a key that is not a string would be passed over or misnamed.
            if section not in Config.model_fields and (not body or not all(isinstance(key, str) for key in body)):
                raise ConfigError(f"{source}: unknown section [{section}] (known: {_known_sections()})")
            for key, value in body.items():
                if not isinstance(key, str):
                    raise ConfigError(f"{source}: {key!r} in [{section}] is not a key name ({type(key).__name__}, "
                                      f"not a string); its keys are: {_known_keys(section)}")
                self.set(section, key, value, source)


def _known_sections() -> str:
    return ", ".join(f"[{name}]" for name in Config.model_fields)


def _known_keys(section: str) -> str:
    return ", ".join(Config.model_fields[section].annotation.model_fields)


def _not_a_table(source: str, name: str, value: Any) -> str:
    """The message for a value where a section's table belongs: a key written above every section
    header (``inner_steps = 20`` at the top of the file, or ``{"inner_steps": 20}`` as a Swarm's
    config) or a dotted name as a dict key (``{"train.inner_steps": 20}``): say in which section it goes."""
    head, dot, tail = name.partition(".")
    if dot and head in Config.model_fields and tail in Config.model_fields[head].annotation.model_fields:
        return (f"{source}: '{name}' is not a section: in a dict write {{'{head}': {{'{tail}': ...}}}}, in a TOML "
                f"file `{tail} = ...` under [{head}]")
    homes = [section for section, info in Config.model_fields.items() if name in info.annotation.model_fields]
    if homes:
        where = " or ".join(f"[{section}]" for section in homes)
        return (f"{source}: '{name}' is set outside any section, but it is a key of {where}: in a TOML file write "
                f"it under the [{homes[0]}] header, in a dict as {{'{homes[0]}': {{'{name}': ...}}}}")
    return f"{source}: '{name}' must be a table like [{name}], got {type(value).__name__}"


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML config file as a dict; ConfigError with one line (and how to fix it) otherwise."""
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist (create one with `lowcomm-node init-config > {path}`)")
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {path} is not valid TOML: {err}") from None
    except UnicodeDecodeError as err:  # tomllib decodes the bytes itself and lets this through
        raise ConfigError(f"config file {path} is not valid TOML: it is not UTF-8 text ({err.reason} at byte "
                          f"{err.start})") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror}") from None


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` (value in TOML syntax, bare words as strings) for ``--set``."""
    name, sep, raw = text.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"--set {text!r}: expected SECTION.KEY=VALUE, for example --set sync.codec=int4")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return section, key, value


def load_config(
    config_file: Path | None = None,
    flags: Mapping[str, Any] | None = None,
    overrides: list[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Merge defaults < TOML file < ``LOWCOMM_*`` env < flags (< ``--set``) and validate.

    ``flags`` maps a node key (or an alias such as ``data``) to a value given on the command line;
    keys whose value is ``None`` were not given and do not override anything.
    """
    return validate_layers(read_layers(config_file, flags, overrides, environ))


def read_layers(
    config_file: Path | None = None,
    flags: Mapping[str, Any] | None = None,
    overrides: list[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ConfigLayers:
    """The sources of ``load_config`` merged, not validated yet (the CLI names them in its messages)."""
    environ = os.environ if environ is None else environ
    layers = ConfigLayers()
    if config_file is None and environ.get(ENV_PREFIX + "CONFIG"):
        config_file = Path(environ[ENV_PREFIX + "CONFIG"])
    if config_file is not None:
        layers.merge_file(read_toml(config_file), str(config_file))

    env_keys = {key: (("node", key)) for key in NODE_KEYS} | ALIASES | {"initial_peers": ("node", "peers")}
    for key, (section, target) in env_keys.items():
        var = ENV_PREFIX + key.upper()
        if var in environ and environ[var] != "":
            layers.set(section, target, environ[var], f"environment variable {var}", text=True)

    for key, value in (flags or {}).items():
        if value is None:
            continue
        section, target = ALIASES.get(key, ("node", key))
        layers.set(section, target, value, f"flag --{key.replace('_', '-')}", text=True)

    for text in overrides or []:
        section, key, value = parse_override(text)
        layers.set(section, key, value, f"--set {text}", text=True)
    return layers


def validate_layers(layers: ConfigLayers) -> Config:
    try:
        return Config.model_validate(layers.values, context=layers.context())
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err, layers)) from None


def describe_validation_error(err: ValidationError, layers: ConfigLayers) -> str:
    """One line per problem, each naming where the bad value came from (file, variable, flag, --set)."""
    lines = []
    for problem in err.errors():
        loc = [str(part) for part in problem["loc"]]
        if not loc:  # a rule across sections: its message names the sections and keys
            message = problem["msg"].removeprefix("Value error, ")
            named = set(re.findall(r"\[(\w+)\]", message))
            lines.append(f"{_sources_of(layers, named, message)}: {message}")
            continue
        section = loc[0]
        key = loc[1] if len(loc) > 1 else None
        source = layers.sources.get((section, key), "defaults") if key else "config"
        if problem["type"] == "extra_forbidden":
            if key is None:
                lines.append(f"{_sources_of(layers, {section})}: unknown section [{section}] (known: "
                             f"{_known_sections()})")
            else:
                lines.append(f"{source}: unknown key '{key}' in [{section}] (known keys: {_known_keys(section)})")
            continue
        if key is None and isinstance(problem.get("input"), Mapping):  # a rule across keys of one section
            message = problem["msg"].removeprefix("Value error, ")
            lines.append(f"{_sources_of(layers, {section}, message)}: [{section}] is invalid: {message}")
            continue
        where = f"[{section}] {key}" if key else f"[{section}]"
        if problem["type"] == "lowcomm_wrong_type":  # its message quotes what was given
            lines.append(f"{source}: {where}: {problem['msg']}")
            continue
        got = problem.get("input")
        got = str(got).lower() if isinstance(got, bool) else repr(got)  # as TOML writes it
        lines.append(f"{source}: {where} = {got} is invalid: {problem['msg'].removeprefix('Value error, ')}")
    if len(lines) == 1:  # the usual case: one line, as every other error of the CLI
        return f"invalid configuration: {lines[0]}"
    return "invalid configuration:\n  " + "\n  ".join(lines)


def _sources_of(layers: ConfigLayers, sections: set[str], message: str | None = None) -> str:
    """The sources (file, variable, flag, --set) that set a key of ``sections``, in order: those
    of the keys ``message`` names when it names any (a rule across keys names the keys it
    relates; every flag given was blamed for `client_mode needs peers`), else all of them."""
    keys = [(sec, key) for sec, key in layers.sources if sec in sections]
    if message is not None:
        named = [(sec, key) for sec, key in keys
                 if re.search(rf"\b({re.escape(key)}|{re.escape(key.replace('_', '-'))})\b", message)]
        keys = named or keys
    sources = list(dict.fromkeys(layers.sources[key] for key in keys))
    return ", ".join(sources) or "defaults"


def ignored_settings(config: Config, sources: Mapping[tuple[str, str], str] | None = None) -> list[str]:
    """One line for each key set to a value that the kind the config chose never reads (a jsonl
    ``field`` with ``format = "text"``, a preset's ``dropout`` with a factory model, ...; the
    sections' ``ignored()`` rules), naming where it was set when ``sources`` says. A key at its
    default (or at the value its ``[sync] method`` gives it) is not reported: `init-config`
    writes every key, and a run config may be shared across kinds, so this is no error."""
    lines = []
    for section in Config.model_fields:
        body = getattr(config, section)
        for key, why in body.ignored().items():
            default = type(body).model_fields[key].default
            if section == "sync":
                default = {**METHOD_DEFAULTS[body.method], **METHOD_FIXED[body.method]}.get(key, default)
            if getattr(body, key) == default:
                continue
            source = (sources or {}).get((section, key))
            lines.append(f"{source + ': ' if source else ''}[{section}] {key} is ignored: {why}")
    return lines


def warn_ignored_settings(config: Config, sources: Mapping[tuple[str, str], str] | None = None) -> None:
    """Log ``ignored_settings`` as warnings, through the ``lowcomm`` logger (which a
    ``lowcomm.Swarm`` prints as well as the CLI)."""
    log = logging.getLogger("lowcomm.node.config")
    for line in ignored_settings(config, sources):
        log.warning("%s", line, extra={"event": "config_key_ignored"})
