"""The corpus formats of ``[data] format`` and the tokenizers of ``[data] tokenizer`` (node/formats.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lowcomm.node.config import ConfigError, load_config
from lowcomm.node.data import DataError, ShardSampler, TokenArray, eval_batches, load_data

from .hf_assets import stdlib_text, train_tokenizer


def data_section(*overrides: str):
    return load_config(overrides=["data.seq_len=16", *overrides], environ={}).data


def as_array(tokens) -> np.ndarray:
    return np.concatenate([np.asarray(p) for p in tokens.parts]) if isinstance(tokens, TokenArray) else tokens


DOCS = [stdlib_text(60_000).decode()[i:i + 3000] for i in range(0, 60_000, 3000)]


# -- text ---------------------------------------------------------------------------------------------


def test_a_file_of_token_ids_given_as_text_is_refused_with_the_fix(tmp_path):
    # Without format = "tokens" it trained on the bytes of its ids (exit 0, nothing said).
    (np.arange(50_000) % 1000).astype(np.uint16).tofile(tmp_path / "train.bin")
    with pytest.raises(DataError, match=r"train.bin is not text: \d+% of its bytes are NUL or not UTF-8; .*"
                                        r"format = \"tokens\""):
        load_data(data_section(f"data.path={tmp_path / 'train.bin'}"))
    with pytest.raises(DataError, match=r"is a folder; give a glob of its files, such as '.*/\*\*/\*.txt'"):
        load_data(data_section(f"data.path={tmp_path}"))  # it said "matches no files"
    # Text with a few bytes outside UTF-8 (Latin-1 accents) still trains, those bytes replaced.
    (tmp_path / "latin.txt").write_bytes("Le café est prêt; nous partons demain pour la ville. ".encode("latin-1") * 200)
    assert len(load_data(data_section(f"data.path={tmp_path / 'latin.txt'}")).train) > 0



@pytest.mark.parametrize("name,raw,encoding", [
    ("fr.txt", "Élève à côté, été déjà là; où ça? ".encode("latin-1") * 300, "latin1"),  # 35% accents
    ("ru.txt", "Съешь же ещё этих мягких французских булок. ".encode("cp1251") * 300, "latin1"),
    ("win.txt", "\ufeffplain text from Notepad\r\n".encode("utf-16") * 300, "utf-16"),
])
def test_text_in_another_encoding_is_refused_with_the_hint_to_convert_it(tmp_path, name, raw, encoding):
    # It was told to set format = "tokens", which would have trained on its bytes as token ids.
    (tmp_path / name).write_bytes(raw)
    with pytest.raises(DataError, match=rf"{name} is (not )?UTF-(8|16).*convert it.*`iconv -f {encoding} -t utf-8 "
                                        rf"OLD > NEW`") as caught:
        load_data(data_section(f"data.path={tmp_path / name}"))
    assert "tokens" not in str(caught.value)


def test_a_folder_given_to_the_tokens_format_gets_the_hint_of_token_files(tmp_path):
    # It got the text format's "such as 'DIR/**/*.txt'".
    (np.arange(5_000) % 1000).astype(np.uint16).tofile(tmp_path / "train.bin")
    hint = r"reads each file the glob matches as one flat array of token ids of \[data\] token_dtype"
    with pytest.raises(DataError, match=rf"is a folder; give a glob of its files, such as '.*/\*\.bin' \(.*{hint}"):
        load_data(data_section("data.format=tokens", f"data.path={tmp_path}"))
    with pytest.raises(DataError, match=rf"matches no files; give a glob such as 'corpus/\*\.bin' \(.*{hint}"):
        load_data(data_section("data.format=tokens", f"data.path={tmp_path}/*.npy"))


# -- tokens -----------------------------------------------------------------------------------------


def test_a_tokens_file_is_memory_mapped_and_split_at_its_tail(tmp_path):
    ids = (np.arange(50_000) % 1000).astype(np.uint16)
    ids.tofile(tmp_path / "train.bin")
    corpus = load_data(data_section("data.format=tokens", f"data.path={tmp_path / 'train.bin'}"))
    assert all(isinstance(part, np.memmap) for part in corpus.train.parts + corpus.eval.parts)
    assert len(corpus.train) == 47_500 and len(corpus.eval) == 2_500  # eval_fraction 0.05 of one file
    assert (as_array(corpus.train) == ids[:47_500]).all() and (as_array(corpus.eval) == ids[47_500:]).all()
    assert corpus.vocab_size is None  # the default tokenizer says nothing about a tokens file


def test_uint32_tokens_and_a_wrong_dtype(tmp_path):
    ids = np.arange(100_001, dtype=np.uint32) * 7
    ids.tofile(tmp_path / "big.bin")
    corpus = load_data(data_section("data.format=tokens", "data.token_dtype=uint32", f"data.path={tmp_path}/*.bin"))
    assert as_array(corpus.train)[-1] == ids[len(corpus.train) - 1]
    with pytest.raises(DataError, match="not a whole number of uint16 ids"):
        (tmp_path / "odd.bin").write_bytes(b"abc")
        load_data(data_section("data.format=tokens", f"data.path={tmp_path / 'odd.bin'}"))


def test_many_token_files_split_by_name_and_windows_cross_files(tmp_path):
    for index in range(40):
        np.full(500, index, dtype=np.uint16).tofile(tmp_path / f"part-{index:02d}.bin")
    corpus = load_data(data_section("data.format=tokens", f"data.path={tmp_path}/*.bin", "data.eval_fraction=0.2"))
    train_ids, eval_ids = set(as_array(corpus.train).tolist()), set(as_array(corpus.eval).tolist())
    assert train_ids and eval_ids and not train_ids & eval_ids and len(train_ids | eval_ids) == 40
    # A window may run from one file into the next, as over one concatenated array.
    glued = as_array(corpus.train)
    starts = np.array([0, 490, 1999, len(glued) - 17])
    assert (corpus.train.windows(starts, 17) == glued[starts[:, None] + np.arange(17)]).all()


def test_sampling_a_memory_map_is_deterministic_and_matches_an_array(tmp_path):
    ids = (np.arange(30_000) * 31 % 997).astype(np.uint16)
    ids.tofile(tmp_path / "t.bin")
    corpus = load_data(data_section("data.format=tokens", f"data.path={tmp_path / 't.bin'}"))
    mapped = ShardSampler(corpus.train, 16, 4, shards=3, peer_key="p", seed=2)
    in_memory = ShardSampler(ids[:len(corpus.train)].copy(), 16, 4, shards=3, peer_key="p", seed=2)
    for _ in range(5):
        for got, want in zip(mapped.next_batch(), in_memory.next_batch()):
            assert (got == want).all()
    with pytest.raises(DataError, match=r"token id 996, outside the model's vocabulary of 500: the data was made "
                                        r"with another tokenizer than the model's \(or, for a tokens file, \[data\] "
                                        r"token_dtype is wrong\)"):
        eval_batches(corpus.eval, 16, 4, 2, vocab_limit=500)


# -- jsonl --------------------------------------------------------------------------------------------


def test_jsonl_reads_the_configured_field(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"body": doc, "id": i}) for i, doc in enumerate(DOCS)) + "\n\n")
    corpus = load_data(data_section("data.format=jsonl", f"data.path={path}", "data.field=body"))
    text = "\n".join(DOCS).encode()
    assert bytes(as_array(corpus.train)) + bytes(as_array(corpus.eval)) == text  # bytes: one token per byte
    with pytest.raises(DataError, match=r"docs.jsonl:1 has no text under 'text' \(it has: body, id\)"):
        load_data(data_section("data.format=jsonl", f"data.path={path}"))
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(DataError, match="bad.jsonl:2 is not JSON"):
        load_data(data_section("data.format=jsonl", f"data.path={tmp_path / 'bad.jsonl'}"))



@pytest.mark.parametrize("value,kind", [(5, "number"), (["a", "b"], "array"), ({"t": "x"}, "object"),
                                        (None, "null"), (True, "boolean")])
def test_a_jsonl_record_whose_text_is_not_a_string_names_its_json_type(tmp_path, value, kind):
    # It said "has no text under 'content' (it has: content)": the key it said was missing.
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"content": "fine"}) + "\n" + json.dumps({"content": value, "id": 2}) + "\n")
    with pytest.raises(DataError, match=rf"docs.jsonl:2: the value under 'content' is a JSON {kind}, not a string; "
                                        r"each record's text must be one string \(e.g. \{\"content\": \"...\"\}\)"):
        load_data(data_section("data.format=jsonl", f"data.path={path}", "data.field=content"))


def test_a_jsonl_line_that_is_not_an_object_says_so(tmp_path):
    (tmp_path / "docs.jsonl").write_text('["a list", "of text"]\n')
    with pytest.raises(DataError, match=r"docs.jsonl:1 is a JSON array, not an object; format = \"jsonl\" reads"):
        load_data(data_section("data.format=jsonl", f"data.path={tmp_path / 'docs.jsonl'}"))


def data_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if getattr(r, "event", None) == "data_json_as_text"]


def test_json_files_read_as_text_train_with_one_warning_to_set_the_jsonl_format(tmp_path, caplog):
    # It trained on the raw JSON without a word.
    for name in ("a.jsonl", "b.json"):
        (tmp_path / name).write_text("\n".join(json.dumps({"text": doc}) for doc in DOCS[:5]))
    (tmp_path / "c.txt").write_text(DOCS[5])
    caplog.set_level("WARNING", logger="lowcomm.node")
    corpus = load_data(data_section(f"data.path={tmp_path}/*"))
    assert len(corpus.train) > 0  # raw JSON may be meant: it still trains
    [warning] = data_warnings(caplog)
    assert warning.startswith(f"[data] path matches {tmp_path / 'a.jsonl'} (and 1 more .jsonl/.json file(s)), "
                              f"which format = \"text\" reads as plain text")
    assert 'set [data] format = "jsonl"' in warning
    caplog.clear()
    load_data(data_section(f"data.path={tmp_path}/*.txt"))
    load_data(data_section("data.format=jsonl", f"data.path={tmp_path}/*.jsonl"))
    assert data_warnings(caplog) == []


def test_text_and_jsonl_read_no_more_than_the_cap_of_a_file_larger_than_it(tmp_path):
    # The cap applied after a whole file was read: a 600 MB file cost 1.5 GB at start.
    text = "\n".join(DOCS)
    (tmp_path / "big.txt").write_text(text)
    corpus = load_data(data_section(f"data.path={tmp_path / 'big.txt'}"), max_bytes=10_000)
    assert bytes(as_array(corpus.train)) + bytes(as_array(corpus.eval)) == text.encode()[:10_000]
    (tmp_path / "big.jsonl").write_text("\n".join(json.dumps({"text": doc}) for doc in DOCS))
    corpus = load_data(data_section("data.format=jsonl", f"data.path={tmp_path / 'big.jsonl'}"), max_bytes=10_000)
    held = bytes(as_array(corpus.train)) + bytes(as_array(corpus.eval))
    assert held == "\n".join(DOCS[:4]).encode()  # whole records, up to the first that reaches the cap


def test_the_node_says_what_it_trains_on_in_one_line(tmp_path, caplog):
    """A wrong glob or format used to show nowhere: the node trained on whatever it matched."""
    from lowcomm.node.trainer import Trainer

    (tmp_path / "a.txt").write_text(DOCS[0])
    (tmp_path / "b.txt").write_text(DOCS[1])
    config = load_config(overrides=["data.seq_len=16", f"data.path={tmp_path}/*.txt"], environ={})
    caplog.set_level("INFO", logger="lowcomm.node")
    trainer = Trainer(config, "peer")
    [line] = [r for r in caplog.records if getattr(r, "event", None) == "data_loaded"]
    corpus = load_data(config.data)
    assert line.getMessage() == (
        f"data: [data] path '{tmp_path}/*.txt', format text, tokenizer bytes: 2 file(s), "
        f"{len(corpus.train):,} training tokens, {len(corpus.eval):,} held out; model: {trainer.numel:,} parameters")
    assert (line.files, line.train_tokens + line.eval_tokens) == (2, len(DOCS[0].encode()) + len(DOCS[1].encode()))


def test_formats_other_than_text_need_a_path():
    with pytest.raises(ConfigError, match='format = "jsonl" needs path'):
        data_section("data.format=jsonl")


# -- tokenizer.json -------------------------------------------------------------------------------------


@pytest.fixture
def tokenizer(tmp_path: Path) -> Path:
    pytest.importorskip("tokenizers", reason="the hf extra (tokenizers) is not installed")
    return train_tokenizer(tmp_path / "tokenizer.json", DOCS, vocab_size=400)


def test_text_through_a_trained_tokenizer(tmp_path, tokenizer):
    from tokenizers import Tokenizer

    (tmp_path / "a.txt").write_text(DOCS[0])
    section = data_section(f"data.path={tmp_path / 'a.txt'}", f"data.tokenizer={tokenizer}")
    corpus = load_data(section)
    assert corpus.vocab_size == 400
    ids = np.concatenate([as_array(corpus.train), as_array(corpus.eval)])
    assert Tokenizer.from_file(str(tokenizer)).decode(ids.tolist()) == DOCS[0]
    assert len(ids) < len(DOCS[0]) / 1.5  # merges: fewer tokens than bytes
    assert ids.max() >= 256  # ids beyond the byte range: a uint8 array would have wrapped them



def test_a_json_file_read_as_text_through_a_tokenizer_is_warned_about_too(tmp_path, tokenizer, caplog):
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": doc}) for doc in DOCS[:5]))
    caplog.set_level("WARNING", logger="lowcomm.node")
    load_data(data_section(f"data.path={tmp_path / 'docs.jsonl'}", f"data.tokenizer={tokenizer}"))
    assert len(data_warnings(caplog)) == 1


def test_a_tokenizer_larger_than_the_preset_model_names_a_fix_that_exists(tmp_path, tokenizer):
    # It said "or a model with vocab_size >= 400": [model] has no vocab_size key (a config error).
    from lowcomm.node.trainer import Trainer

    (tmp_path / "a.txt").write_text("\n".join(DOCS))
    config = load_config(overrides=["data.seq_len=16", f"data.path={tmp_path / 'a.txt'}",
                                    f"data.tokenizer={tokenizer}"], environ={})
    with pytest.raises(DataError, match=r"has a vocabulary of 400, more than the model's 256: lowcomm's preset "
                                        r"models are byte-level and no key changes their vocabulary: set \[data\] "
                                        r"tokenizer = \"bytes\", or train a model of your own with 400 or more token "
                                        r"ids \(\[model\] hf_config, a config.json with \"vocab_size\": 400") as caught:
        Trainer(config, "peer-a")
    assert "vocab_size >=" not in str(caught.value)


def test_the_tokenizer_enters_the_fingerprint_by_content(tmp_path, tokenizer):
    copy = tmp_path / "elsewhere.json"
    copy.write_bytes(tokenizer.read_bytes())
    fingerprint = [load_config(overrides=[f"data.tokenizer={t}"], environ={}).run_fingerprint() for t in (tokenizer, copy)]
    assert fingerprint[0] == fingerprint[1] != load_config(environ={}).run_fingerprint()
    body = json.loads(load_config(overrides=[f"data.tokenizer={tokenizer}"], environ={}).run_config_json())["data"]
    assert body["vocab_size"] == 400 and len(body["tokenizer_sha256"]) == 64
    with pytest.raises(ConfigError, match="not a file"):
        load_config(overrides=[f"data.tokenizer={tmp_path / 'none.json'}"], environ={})


# -- hf datasets ------------------------------------------------------------------------------------


def test_hf_dataset_text_column_with_a_tokenizer_and_its_validation_split(tmp_path, tokenizer):
    datasets = pytest.importorskip("datasets", reason="the hf extra (datasets) is not installed")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS[:15]}),
                                   "validation": datasets.Dataset.from_dict({"text": DOCS[15:]})})
    splits.save_to_disk(str(tmp_path / "ds"))
    corpus = load_data(data_section("data.format=hf", f"data.path={tmp_path / 'ds'}", f"data.tokenizer={tokenizer}"))
    from tokenizers import Tokenizer

    decode = Tokenizer.from_file(str(tokenizer)).decode
    assert decode(as_array(corpus.train).tolist()) == "\n".join(DOCS[:15])
    assert decode(as_array(corpus.eval).tolist()) == "\n".join(DOCS[15:])
    assert corpus.vocab_size == 400


def test_hf_dataset_of_token_ids_is_tail_split(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the hf extra (datasets) is not installed")
    rows = [list(range(i, i + 1000)) for i in range(0, 70_000, 1000)]  # ids past uint16
    datasets.Dataset.from_dict({"input_ids": rows, "text": ["unused"] * len(rows)}).save_to_disk(str(tmp_path / "ds"))
    corpus = load_data(data_section("data.format=hf", f"data.path={tmp_path / 'ds'}"))
    ids = np.concatenate([as_array(corpus.train), as_array(corpus.eval)])
    assert (ids == np.arange(70_000)).all()  # input_ids by default, no separator, no wrap-around
    assert len(corpus.eval) == 3_500 and corpus.vocab_size is None
    with pytest.raises(DataError, match="no column 'body'"):
        load_data(data_section("data.format=hf", f"data.path={tmp_path / 'ds'}", "data.field=body"))
    with pytest.raises(DataError, match="not a directory written by save_to_disk"):
        load_data(data_section("data.format=hf", f"data.path={tmp_path}"))


def mapped_rss(path: Path) -> int:
    """Resident bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isdigit() or line[:1] in "abcdef" and "-" in line.split()[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc/self/smaps")
def test_drawing_batches_keeps_no_pages_of_a_tokens_file_resident(tmp_path):
    ids = (np.arange(4_000_000) % 50_000).astype(np.uint16)  # 8 MB
    path = tmp_path / "big.bin"
    ids.tofile(path)
    corpus = load_data(data_section("data.format=tokens", f"data.path={path}"))
    assert mapped_rss(path) == 0
    held_out = eval_batches(corpus.eval, 16, 8, 2)
    sampler = ShardSampler(corpus.train, 16, 8, shards=4, peer_key="p", seed=0)
    corpus.train.windows(np.array([0, 1_000_000, 3_000_000]), 16)
    assert mapped_rss(path) > 0  # reading a window maps its pages ...
    for _ in range(20):
        inputs, targets = sampler.next_batch()
        assert mapped_rss(path) == 0  # ... and every batch lets them go
        assert (inputs[:, 1:] == targets[:, :-1]).all() and (inputs < 50_000).all()
    assert (held_out[0][0][0] == torch.from_numpy(ids[len(corpus.train):len(corpus.train) + 16].astype(np.int64))).all()


@pytest.mark.parametrize("fmt", ["tokens", "text"])
def test_a_single_file_whose_name_hashes_to_the_held_out_side_is_tail_split(tmp_path, fmt):
    from lowcomm.node.data import _is_eval

    name = next(f"corpus-{i}.bin" for i in range(10_000) if _is_eval(f"corpus-{i}.bin", 0.05))
    ids = np.arange(40_000) % 200 if fmt == "tokens" else np.arange(40_000) % 95 + 32  # text: printable ASCII
    ids.astype(np.uint16 if fmt == "tokens" else np.uint8).tofile(tmp_path / name)
    corpus = load_data(data_section(f"data.format={fmt}", f"data.path={tmp_path / name}"))
    assert len(corpus.train) == 38_000 and len(corpus.eval) == 2_000  # not an empty training split
