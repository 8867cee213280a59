"""Small, offline model and data files for the model/data plug-in tests (written per test)."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np

# A Llama-architecture causal LM small enough for a 2-core CPU: 2 layers, hidden 64, the byte
# vocabulary (so that byte-valued token files train it without a tokenizer).
TINY_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}


def write_llama_config(path: Path, **changes: object) -> Path:
    """A config.json of ``TINY_LLAMA`` with ``changes``; returns its path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**TINY_LLAMA, **changes}, indent=2))
    return path


def stdlib_text(max_bytes: int) -> bytes:
    """Real text that exists offline: the standard library's top-level modules, in name order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for file in sorted(root.glob("*.py")):
        parts.append(file.read_bytes())
        total += len(parts[-1])
        if total >= max_bytes:
            break
    return b"\n".join(parts)[:max_bytes]


def write_byte_tokens(path: Path, max_bytes: int, dtype: str = "uint16") -> Path:
    """A nanoGPT-style flat token file whose ids are the bytes of ``stdlib_text``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.frombuffer(stdlib_text(max_bytes), dtype=np.uint8).astype(dtype).tofile(path)
    return path


def train_tokenizer(path: Path, texts: list[str], vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer.json trained on ``texts`` with the tokenizers library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(path))
    return path
