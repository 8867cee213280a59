"""Reading the corpus formats of ``[data] format`` and turning text into token ids.

* ``text``: UTF-8 files (node/data.py reads them; this module only tokenizes);
* ``jsonl``: one JSON object per line, the document under ``[data] field``;
* ``tokens``: a flat binary file of uint16/uint32 token ids (nanoGPT's ``train.bin``), opened
  with ``numpy.memmap`` so that only the windows a batch draws are ever read;
* ``hf``: a Hugging Face ``datasets`` directory written by ``save_to_disk``, with a text column
  or a column of token id lists.

Tokenizers: ``bytes`` (each UTF-8 byte is a token, vocabulary 256) or a local ``tokenizer.json``
read by the ``tokenizers`` library. Documents are joined with the tokens of a newline, as the
text format has always joined files.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import json
import mmap
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .errors import FatalError


class FormatError(FatalError):
    """A corpus file or tokenizer cannot be read (node/data.py re-raises it as a DataError). A
    FatalError: the fingerprint reads the tokenizer before any corpus, and must end the node
    with one line too."""


# A text file with more of its bytes outside UTF-8 (or NUL) than this is refused; below it, the
# stray bytes (a few Latin-1 accents in English text) are replaced and the text trains.
NOT_TEXT_SHARE = 0.1

# Bytes that text in no encoding in use puts in its prose: NUL and the C0 controls other than
# whitespace, ESC (terminal colours) and SUB (DOS end of file). Token ids are full of them (an id
# below 8192 has one as its high byte, a uint32 id two NULs); Latin-1 or Windows-1251 text, whose
# letters are the bytes above 127, has none.
CONTROL_BYTES = bytes(b for b in range(32) if b not in b"\t\n\v\f\r\x1a\x1b")

# A refused file with more control bytes than this is binary (token ids given without
# format = "tokens"); with fewer it is text in another encoding than UTF-8.
BINARY_SHARE = 0.05


def decode_text(path: Path, raw: bytes) -> str:
    """``raw`` (the content of ``path``) as UTF-8 text, a stray invalid byte replaced; a file that
    is not UTF-8 text raises FormatError."""
    text = raw.decode("utf-8", errors="replace")
    share = (raw.count(0) + text.count("\ufffd")) / max(1, len(raw))
    if share > NOT_TEXT_SHARE:
        raise FormatError(_not_text_message(path, raw, share))
    return text


def _not_text_message(path: Path, raw: bytes, share: float) -> str:
    """Why ``path`` is refused, and the fix for what it most likely is: text in another encoding
    (convert it) or binary token ids (the tokens format). Both used to get the tokens hint, which
    sent a user with a Latin-1 file to a format that would have trained on its bytes as ids."""
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):  # before the NUL count: UTF-16 is half NUL
        return (f"{path} is UTF-16 text (it starts with a UTF-16 byte-order mark), not UTF-8: convert it, "
                f"e.g. `iconv -f utf-16 -t utf-8 OLD > NEW`")
    controls = (len(raw) - len(raw.translate(None, CONTROL_BYTES))) / max(1, len(raw))
    if controls > BINARY_SHARE:
        return (f"{path} is not text: {share:.0%} of its bytes are NUL or not UTF-8; for a file of token "
                f"ids set [data] format = \"tokens\" (and token_dtype), or point [data] path at text files")
    return (f"{path} is not UTF-8: {share:.0%} of its bytes are not UTF-8, and it looks like text in another "
            f"encoding (such as Latin-1, Windows-1252 or Windows-1251): convert it to UTF-8, e.g. "
            f"`iconv -f latin1 -t utf-8 OLD > NEW` (-f names its encoding; `iconv -l` lists them)")


class ByteTokenizer:
    """UTF-8 bytes as tokens: any text trains without a vocabulary file."""

    vocab_size = 256
    dtype = np.uint8

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]


class FileTokenizer:
    """A Hugging Face ``tokenizer.json`` (any model the ``tokenizers`` library reads)."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise FormatError("[data] tokenizer needs the tokenizers package: pip install 'lowcomm[hf]'") from None
        try:
            self.tokenizer = Tokenizer.from_file(str(Path(path).expanduser()))
        except Exception as err:  # noqa: BLE001 - the library raises a bare Exception on bad files
            raise FormatError(f"[data] tokenizer {path} is not a readable tokenizer.json ({err}): give the "
                              f"tokenizer.json of the model's tokenizer (as the tokenizers library or "
                              f"save_pretrained writes it), or \"bytes\"") from None
        self.vocab_size = int(self.tokenizer.get_vocab_size(with_added_tokens=True))
        self.dtype = np.uint16 if self.vocab_size <= 2**16 else np.uint32

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        # add_special_tokens=False: a BOS/EOS template per document would differ from how a
        # tokens file made by the same tokenizer looks; documents are joined by newlines instead.
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=self.dtype) for e in encodings]


Tokenizer = ByteTokenizer | FileTokenizer


def make_tokenizer(spec: str) -> Tokenizer:
    return ByteTokenizer() if spec == "bytes" else FileTokenizer(spec)


@functools.lru_cache(maxsize=4)
def tokenizer_definition(path: str) -> dict[str, Any]:
    """What the run fingerprint says about a tokenizer file: its content hash and vocabulary size
    (the path is local to each peer and stays out)."""
    try:
        content = Path(path).expanduser().read_bytes()
    except OSError as err:
        raise FormatError(f"[data] tokenizer {path} cannot be read ({err.strerror}): give a readable "
                          f"tokenizer.json, or \"bytes\"") from None
    return {"tokenizer_sha256": hashlib.sha256(content).hexdigest(),
            "vocab_size": FileTokenizer(path).vocab_size}


def separator(tokenizer: Tokenizer) -> np.ndarray:
    return tokenizer.encode(["\n"])[0]


def join(parts: list[np.ndarray], sep: np.ndarray, dtype: Any) -> np.ndarray:
    """``parts`` with ``sep`` between them, as one array."""
    pieces: list[np.ndarray] = []
    for index, part in enumerate(parts):
        if index:
            pieces.append(sep)
        pieces.append(part)
    return np.concatenate(pieces).astype(dtype, copy=False) if pieces else np.zeros(0, dtype=dtype)


def jsonl_documents(path: Path, field: str) -> Iterator[str]:
    """The ``field`` of every record of a JSON-lines file (blank lines are skipped)."""
    with path.open("r", encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise FormatError(f"{path}:{number} is not JSON ({err.msg})") from None
            yield _record_text(path, number, record, field)


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type (what the user sees in the file, not Python's)."""
    if value is None:
        return "null"
    if isinstance(value, bool):  # before int: bool is an int in Python
        return "boolean"
    return {dict: "object", list: "array", str: "string"}.get(type(value), "number")


def _record_text(path: Path, number: int, record: Any, field: str) -> str:
    """The text of one parsed record (line ``number``), or a FormatError that says which of the
    three things is wrong: not an object, no such key, or a value under the key that is no text."""
    if not isinstance(record, dict):
        raise FormatError(f"{path}:{number} is a JSON {json_type(record)}, not an object; format = \"jsonl\" reads "
                          f"one object per line, its text under [data] field")
    if field not in record:
        raise FormatError(f"{path}:{number} has no text under {field!r} (it has: {', '.join(sorted(record))}); "
                          f"set [data] field")
    value = record[field]
    if not isinstance(value, str):
        # Not "has no text under": the key is there (the old message listed it as present).
        raise FormatError(f"{path}:{number}: the value under {field!r} is a JSON {json_type(value)}, not a string; "
                          f"each record's text must be one string (e.g. {{{json.dumps(field)}: \"...\"}}): write "
                          f"the file that way, or set [data] field to the key that holds the text")
    return value


def open_tokens(path: Path, dtype: str) -> np.ndarray:
    """A read-only memory map of a flat token file: nothing is read until a window is."""
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise FormatError(f"{path} is {size} bytes, not a whole number of {dtype} ids; check [data] token_dtype")
    if size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def release(parts: list[np.ndarray]) -> None:
    """Drop the pages of memory-mapped ``parts`` from this process's resident set. They are
    read-only file pages: the next window that needs one faults it back from the page cache
    (a minor fault), so this costs a syscall and no disk read. No-op for in-memory arrays."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return
    # numpy keeps the mmap.mmap of a memmap (and of its views) in ``_mmap``.
    mappings = {id(m): m for m in (getattr(part, "_mmap", None) for part in parts) if m is not None}
    for mapping in mappings.values():
        mapping.madvise(mmap.MADV_DONTNEED)


def hf_splits(path: str, field: str | None, tokenizer: Tokenizer, max_tokens: int
              ) -> tuple[list[np.ndarray], list[np.ndarray] | None, bool]:
    """Token ids of the rows of a ``save_to_disk`` directory: (train rows, held-out rows or None,
    whether the column held token ids rather than text).

    A DatasetDict's "validation" (or "test") split is the held-out set; a single Dataset (or a
    dict without one) is split by node/data.py like one text file, at the tail."""
    try:
        import datasets
    except ImportError:
        raise FormatError("[data] format = \"hf\" needs the datasets package: pip install 'lowcomm[hf]'") from None
    datasets.disable_progress_bars()
    try:
        loaded = datasets.load_from_disk(str(Path(path).expanduser()))
    except (FileNotFoundError, ValueError) as err:
        raise FormatError(f"[data] path {path} is not a directory written by save_to_disk ({err})") from None
    if isinstance(loaded, datasets.DatasetDict):
        train_name = "train" if "train" in loaded else sorted(loaded)[0]
        held_name = next((name for name in ("validation", "test") if name in loaded and name != train_name), None)
        train_set, held_set = loaded[train_name], (loaded[held_name] if held_name else None)
    else:
        train_set, held_set = loaded, None
    column = field or ("input_ids" if "input_ids" in train_set.column_names else "text")
    if column not in train_set.column_names:
        raise FormatError(f"[data] path {path} has no column {column!r} (columns: "
                          f"{', '.join(train_set.column_names)}); set [data] field")
    train, pretokenized = _rows(train_set, column, tokenizer, max_tokens)
    held = _rows(held_set, column, tokenizer, max_tokens)[0] if held_set is not None else None
    return train, held, pretokenized


def _rows(dataset: Any, column: str, tokenizer: Tokenizer, max_tokens: int) -> tuple[list[np.ndarray], bool]:
    rows: list[np.ndarray] = []
    total = 0
    pretokenized = False
    for batch in dataset.iter(batch_size=1024):
        values = batch[column]
        if values and isinstance(values[0], str):
            encoded = tokenizer.encode(values)
        elif values and isinstance(values[0], (list, np.ndarray)):
            encoded = [np.asarray(v, dtype=np.int64) for v in values]
            pretokenized = True
        else:
            raise FormatError(f"column {column!r} holds {type(values[0]).__name__ if values else 'nothing'}, "
                              "not text or lists of token ids")
        rows.extend(encoded)
        total += sum(len(r) for r in encoded)
        if total >= max_tokens:
            break
    return rows, pretokenized
