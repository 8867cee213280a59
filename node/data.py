"""Corpora, the fixed held-out split, and per-peer shards of the training split.

The default corpus is the Python standard library's own ``.py`` files, read from the running
interpreter: it exists offline on every machine that can run the node. A user's own text comes
in through ``[data] path`` (a glob) in one of the formats of node/formats.py. Files go to the
eval split by a hash of their relative path, so the split is the same on every peer and does not
depend on file order; a corpus of one file (or one dataset) holds out the tail of its tokens.

Token ids live in a ``TokenArray``: the files' arrays side by side, never concatenated, so that a
memory-mapped ``tokens`` file is read only where a batch's windows fall.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

import numpy as np
import torch

from . import formats
from .config_sections import relative_to_cwd

if TYPE_CHECKING:
    from .config import DataSection


log = logging.getLogger("lowcomm.node")


class DataError(Exception):
    """The configured corpus cannot be used; the message says why and what to change."""


def default_corpus_files() -> tuple[Path, list[Path]]:
    """The standard library's .py files (without tests, which are large and repetitive)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.relative_to(root).parts[0].lower()
                   and "site-packages" not in p.parts)
    return root, files


# A glob of the files each format reads, for the hints of a path that matches none. Token files
# have no fixed name: nanoGPT's prepare.py writes train.bin and val.bin, lowcomm reads any file.
EXAMPLE_GLOBS = {"text": "**/*.txt", "jsonl": "**/*.jsonl", "tokens": "*.bin"}


def resolve_files(pattern: str | None, fmt: str = "text") -> tuple[Path, list[Path]]:
    """The files of ``[data] path`` (a glob) for ``[data] format`` ``fmt``, whose hints name
    files of that format (and which warns of JSON files read as text)."""
    if pattern is None:
        return default_corpus_files()
    expanded = Path(pattern).expanduser()
    files = [p for p in sorted(Path(p) for p in glob.glob(str(expanded), recursive=True)) if p.is_file()]
    example = EXAMPLE_GLOBS.get(fmt, EXAMPLE_GLOBS["text"])
    if not files and expanded.is_dir():
        folder = pattern.rstrip("/")
        raise DataError(f"[data] path {pattern!r} is a folder; give a glob of its files, such as "
                        f"'{folder}/{example}'{_what_it_reads(fmt)}")
    if not files:
        raise DataError(f"[data] path {pattern!r} matches no files; give a glob such as 'corpus/{example}'"
                        f"{_what_it_reads(fmt)}{relative_to_cwd(pattern)}")
    if fmt == "text":
        warn_json_as_text(files)
    return expanded.parent, files


def _what_it_reads(fmt: str) -> str:
    """For tokens: what its files are, since unlike text they have no usual extension to guess."""
    if fmt != "tokens":
        return ""
    return (" (format = \"tokens\" reads each file the glob matches as one flat array of token ids of [data] "
            "token_dtype, as nanoGPT's train.bin; any name will do, so leave files such as meta.pkl out of the glob)")


# Names of JSON files: read as text, their syntax is trained on too.
JSON_SUFFIXES = (".jsonl", ".json")


def warn_json_as_text(files: list[Path]) -> None:
    """One warning when format = "text" reads files named .jsonl/.json: it trains on their raw
    JSON (braces, keys, escapes), which may be meant, but is more often a forgotten
    format = "jsonl" (it trained without a word)."""
    named = [path for path in files if path.suffix.lower() in JSON_SUFFIXES]
    if not named:
        return
    more = f" (and {len(named) - 1} more .jsonl/.json file(s))" if len(named) > 1 else ""
    log.warning("[data] path matches %s%s, which format = \"text\" reads as plain text, JSON syntax and all; to "
                "train on the text of each record instead, set [data] format = \"jsonl\" (and [data] field, "
                "default \"text\")", named[0], more, extra={"event": "data_json_as_text"})


def _is_eval(relative_name: str, eval_fraction: float) -> bool:
    digest = hashlib.sha256(relative_name.encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < eval_fraction


class TokenArray:
    """Token ids of several arrays (in-memory or memory-mapped) read as one sequence, without
    copying them: windows are gathered on demand, and may cross from one array into the next."""

    def __init__(self, parts: Sequence[np.ndarray]) -> None:
        self.parts = [part for part in parts if len(part)]
        self.offsets = np.cumsum([0, *(len(part) for part in self.parts)])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def slice(self, start: int, stop: int) -> "TokenArray":
        """Tokens ``[start, stop)`` as views of the same arrays."""
        views = []
        for part, offset in zip(self.parts, self.offsets[:-1]):
            lo, hi = max(start - offset, 0), min(stop - offset, len(part))
            if lo < hi:
                views.append(part[lo:hi])
        return TokenArray(views)

    def release(self) -> None:
        """Let the pages of memory-mapped parts go (see formats.release); the data stays readable."""
        formats.release(self.parts)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """int64 array ``[len(starts), length]``: the ``length`` tokens from each start."""
        if len(self.parts) == 1:
            return self.parts[0][starts[:, None] + np.arange(length)].astype(np.int64)
        out = np.empty((len(starts), length), dtype=np.int64)
        for row, start in enumerate(starts.tolist()):
            index = int(np.searchsorted(self.offsets, start, side="right")) - 1
            filled = 0
            while filled < length:
                part = self.parts[index]
                local = start + filled - int(self.offsets[index])
                take = min(length - filled, len(part) - local)
                out[row, filled:filled + take] = part[local:local + take]
                filled += take
                index += 1
        return out


Tokens = np.ndarray | TokenArray


def as_token_array(tokens: Tokens) -> TokenArray:
    return tokens if isinstance(tokens, TokenArray) else TokenArray([np.asarray(tokens)])


@dataclass
class Corpus:
    train: Tokens
    """Token ids of the training files, in file order (uint8 bytes for the byte tokenizer)."""
    eval: Tokens
    """Token ids of the held-out files."""
    files: int
    vocab_size: int | None = 256
    """Ids lie below this (the tokenizer's vocabulary); None: a tokens file that does not say."""


def load_corpus(pattern: str | None, eval_fraction: float, max_bytes: int = 64 * 2**20) -> Corpus:
    """The text format with the byte tokenizer (the default corpus): at most ``max_bytes`` read."""
    root, files = resolve_files(pattern)
    train_parts: list[bytes] = []
    eval_parts: list[bytes] = []
    total = 0
    for path in files:
        try:
            data = _read_head(path, max_bytes - total)
        except OSError:
            continue  # an unreadable file in a glob is not worth stopping the node for
        if pattern is not None:  # the user's files (the standard library's own are text)
            formats.decode_text(path, data)  # the byte tokenizer takes the bytes: only the check
        (eval_parts if _is_eval(_name(path, root), eval_fraction) else train_parts).append(data)
        total += len(data)
        if total >= max_bytes:
            break
    train = np.frombuffer(b"\n".join(train_parts), dtype=np.uint8)
    held_out = np.frombuffer(b"\n".join(eval_parts), dtype=np.uint8)
    if len(held_out) == 0 or len(train) == 0:
        # Few files (all of them on one side of the hash): hold out the tail of the text instead.
        text = train if len(train) else held_out
        cut = int(len(text) * (1 - eval_fraction))
        train, held_out = text[:cut], text[cut:]
    return Corpus(train=train, eval=held_out, files=len(files))


def _name(path: Path, root: Path) -> str:
    return str(path.relative_to(root)) if path.is_relative_to(root) else path.name


def _tail_split(train: TokenArray, eval_fraction: float) -> tuple[TokenArray, TokenArray]:
    cut = int(len(train) * (1 - eval_fraction))
    return train.slice(0, cut), train.slice(cut, len(train))


def _read_head(path: Path, limit: int) -> bytes:
    """At most ``limit`` bytes from the start of ``path``: the cap holds for a file of any size
    (reading it whole first made a 600 MB file cost 1.5 GB before the cap cut it)."""
    with path.open("rb") as fh:
        return fh.read(max(0, limit))


def _split_documents(named: Iterable[tuple[str, list[np.ndarray]]], eval_fraction: float,
                     tokenizer: formats.Tokenizer, max_tokens: int) -> tuple[TokenArray, TokenArray]:
    """Tokenized files to the two splits by a hash of their names (each file's documents joined
    with newline tokens, and so are the files), then the tail rule for corpora of one file."""
    sep = formats.separator(tokenizer)
    splits: dict[bool, list[np.ndarray]] = {True: [], False: []}
    total = 0
    for name, documents in named:
        splits[_is_eval(name, eval_fraction)].append(formats.join(documents, sep, tokenizer.dtype))
        total += sum(len(d) for d in documents)
        if total >= max_tokens:
            break
    train = TokenArray([formats.join(splits[False], sep, tokenizer.dtype)])
    held_out = TokenArray([formats.join(splits[True], sep, tokenizer.dtype)])
    if len(held_out) == 0 or len(train) == 0:
        train, held_out = _tail_split(train if len(train) else held_out, eval_fraction)
    return train, held_out


def load_data(section: "DataSection", max_bytes: int = 64 * 2**20) -> Corpus:
    """The corpus of ``[data]``. Text-like formats read at most about ``max_bytes`` of text (or
    ids) into memory; ``tokens`` files are memory-mapped whatever their size."""
    try:
        if section.format == "text" and section.tokenizer == "bytes":
            return load_corpus(section.path, section.eval_fraction, max_bytes)
        return _load_formatted(section, max_bytes)
    except formats.FormatError as err:
        raise DataError(str(err)) from None


def _load_formatted(section: "DataSection", max_bytes: int) -> Corpus:
    tokenizer = formats.make_tokenizer(section.tokenizer)
    vocab: int | None = tokenizer.vocab_size
    if section.format == "hf":
        train_rows, held_rows, pretokenized = formats.hf_splits(section.path or "", section.field, tokenizer, max_bytes)
        sep = formats.separator(tokenizer)
        dtype: type = tokenizer.dtype
        if pretokenized:
            # Ids from the dataset itself: kept in the narrowest type that holds them. Unless
            # [data] tokenizer names the tokenizer that made them, their vocabulary is unknown
            # (they are checked against the model's as drawn) and so is the id of a newline.
            largest = max((int(r.max()) for r in (*train_rows, *(held_rows or [])) if r.size), default=0)
            dtype = np.uint16 if largest < 2**16 else np.uint32
            if section.tokenizer == "bytes":
                sep, vocab = np.zeros(0, dtype=np.uint8), None
        train = TokenArray([formats.join(train_rows, sep, dtype)])
        if held_rows is None:
            train, held_out = _tail_split(train, section.eval_fraction)
        else:
            held_out = TokenArray([formats.join(held_rows, sep, dtype)])
        return Corpus(train=train, eval=held_out, files=1, vocab_size=vocab)
    root, files = resolve_files(section.path, section.format)
    if section.format == "tokens":
        maps = [(_name(path, root), formats.open_tokens(path, section.token_dtype)) for path in files]
        train = TokenArray([m for name, m in maps if not _is_eval(name, section.eval_fraction)])
        held_out = TokenArray([m for name, m in maps if _is_eval(name, section.eval_fraction)])
        if len(held_out) == 0 or len(train) == 0:  # one file, or all on one side of the hash
            train, held_out = _tail_split(train if len(train) else held_out, section.eval_fraction)
        # The default "bytes" says nothing about a tokens file: ids are checked against the model.
        return Corpus(train=train, eval=held_out, files=len(files),
                      vocab_size=vocab if section.tokenizer != "bytes" else None)

    def documents() -> Iterator[tuple[str, list[np.ndarray]]]:
        budget = max_bytes  # of text read, so that no file is read whole past the cap
        for path in files:
            if budget <= 0:
                return
            if section.format == "jsonl":
                texts = []
                for text in formats.jsonl_documents(path, section.field or "text"):
                    texts.append(text)
                    budget -= len(text)
                    if budget <= 0:
                        break
            else:
                try:
                    raw = _read_head(path, budget)
                except OSError:
                    continue  # as load_corpus: an unreadable file in a glob is skipped
                budget -= len(raw)
                texts = [formats.decode_text(path, raw)]
            yield _name(path, root), tokenizer.encode(texts)

    train, held_out = _split_documents(documents(), section.eval_fraction, tokenizer, max_bytes)
    return Corpus(train=train, eval=held_out, files=len(files), vocab_size=vocab)


class ShardSampler:
    """Random windows from this peer's shard of the training split.

    The training split is cut into blocks of ``BLOCK_TOKENS`` and shard ``k`` of ``shards`` is
    every ``shards``-th block starting at ``k``: each shard is spread over the whole corpus, so
    every peer's data looks like the held-out set (contiguous shards made each peer train on a
    few neighbouring files, and the peers' local models drifted apart between rounds). A peer
    starts on the shard its id hashes to and moves to the next one after drawing about one
    shard's worth of tokens, so peers see different data at the same time while every byte
    stays reachable.
    """

    BLOCK_TOKENS = 4096

    def __init__(self, tokens: Tokens, seq_len: int, batch_size: int, shards: int, peer_key: str, seed: int,
                 vocab_limit: int | None = None):
        """``vocab_limit``: ids must lie below it (the model's vocabulary); every batch is checked,
        since a large tokens file cannot be scanned up front without reading all of it."""
        if len(tokens) < (seq_len + 1) * 2:
            raise DataError(f"its training split has {len(tokens)} tokens, too few for [data] seq_len = {seq_len} (at "
                            f"least {(seq_len + 1) * 2}): give more data (text, documents or tokens), "
                            f"or a smaller seq_len")
        # Kept as they are (uint8 bytes, a memory map of a tokens file): windows become int64
        # when drawn. As int64 the default corpus (12 MB of bytes) held ~100 MB for nothing.
        self.tokens = as_token_array(tokens)
        self.vocab_limit = vocab_limit
        self.seq_len, self.batch_size = seq_len, batch_size
        usable = len(tokens) - seq_len - 1  # window starts lie in [0, usable)
        self.block = max(1, min(self.BLOCK_TOKENS, usable))
        self.blocks = max(1, usable // self.block)
        self.shards = max(1, min(shards, self.blocks))
        digest = hashlib.sha256(f"{seed}/{peer_key}".encode()).digest()
        self.shard = int.from_bytes(digest[:8], "little") % self.shards
        self.generator = torch.Generator().manual_seed(int.from_bytes(digest[8:16], "little") % 2**63)
        self.drawn = 0

    def shard_blocks(self, shard: int) -> torch.Tensor:
        """Indices of the blocks that make up ``shard``."""
        return torch.arange(shard, self.blocks, self.shards)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = self.shard_blocks(self.shard)
        chosen = blocks[torch.randint(len(blocks), (self.batch_size,), generator=self.generator)]
        starts = chosen * self.block + torch.randint(self.block, (self.batch_size,), generator=self.generator)
        windows = torch.from_numpy(self.tokens.windows(starts.numpy(), self.seq_len + 1))
        check_ids(windows, self.vocab_limit, "training split")
        # The windows are copies: the mapped pages they came from can go. Each window faults in a
        # whole page-cache folio (measured: ~160 KiB on average, up to 2 MiB), so without this a
        # few hundred steps kept a 1 GB tokens file resident (bench/data_memory.py).
        self.tokens.release()
        self.drawn += self.batch_size * self.seq_len
        if self.drawn >= len(blocks) * self.block:
            self.shard, self.drawn = (self.shard + 1) % self.shards, 0
        return windows[:, :-1], windows[:, 1:]


def eval_batches(tokens: Tokens, seq_len: int, batch_size: int, batches: int,
                 vocab_limit: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed held-out set: evenly spaced windows, the same on every peer and every round."""
    data = as_token_array(tokens)
    count = batches * batch_size
    usable = len(data) - seq_len - 1
    if usable <= 0:
        raise DataError(f"its held-out split has {len(data)} tokens, too few for [data] seq_len = {seq_len} (at "
                        f"least {seq_len + 2}): give more data (text, documents or tokens), a larger [data] "
                        f"eval_fraction, or a smaller seq_len")
    # Integer arithmetic: float32 (linspace's default) rounds starts past 2**24 tokens, the last
    # one beyond the split (an IndexError for a held-out split of a large tokens file).
    starts = torch.arange(count, dtype=torch.int64) * usable // max(1, count - 1)
    windows = torch.from_numpy(data.windows(starts.numpy(), seq_len + 1))
    data.release()
    check_ids(windows, vocab_limit, "held-out split")
    return [(w[:, :-1], w[:, 1:]) for w in windows.split(batch_size)]


def check_ids(windows: torch.Tensor, vocab_limit: int | None, where: str) -> None:
    if vocab_limit is not None and windows.numel() and int(windows.max()) >= vocab_limit:
        raise DataError(f"the {where} holds token id {int(windows.max())}, outside the model's vocabulary of "
                        f"{vocab_limit}: the data was made with another tokenizer than the model's (or, for a "
                        "tokens file, [data] token_dtype is wrong)")
