"""Token shards and batch sampling for causal-LM training.

A shard is one flat ``uint16`` array (``.npy``): every document's tokens followed by the
eos id. ``train.npy`` holds one epoch of :func:`train.corpus.training_documents` (files
plus rename edits), ``heldout.npy`` the held-out files; ``meta.json`` records sizes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from train import corpus
from train.tokenizer import EOS


def encode_documents(tokenizer: Tokenizer, docs: Iterable[str], desc: str, chunk: int = 64) -> tuple[np.ndarray, dict]:
    """Concatenate the tokens of ``docs``, each followed by eos; returns (tokens, stats)."""
    eos = tokenizer.token_to_id(EOS)
    docs = list(docs)
    parts, chars, nbytes = [], 0, 0
    for i in tqdm(range(0, len(docs), chunk), desc=desc, unit="chunk"):
        batch = docs[i : i + chunk]
        for enc in tokenizer.encode_batch(batch, add_special_tokens=False):
            parts.append(np.asarray(enc.ids + [eos], dtype=np.uint16))
        chars += sum(map(len, batch))
        nbytes += sum(len(d.encode()) for d in batch)
    tokens = np.concatenate(parts)
    return tokens, {"documents": len(docs), "chars": chars, "bytes": nbytes, "tokens": int(tokens.size)}


def build_shards(tokenizer_dir: Path, out_dir: Path, seed: int = 0) -> dict:
    """Write ``train.npy``, ``heldout.npy`` and ``meta.json`` to ``out_dir``; returns the meta."""
    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    if tokenizer.get_vocab_size() > np.iinfo(np.uint16).max + 1:
        raise ValueError(f"vocab of {tokenizer_dir} does not fit uint16 shards")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"tokenizer": str(tokenizer_dir), "seed": seed, "eos_id": tokenizer.token_to_id(EOS)}
    for name, docs in (("train", corpus.training_documents(seed)), ("heldout", corpus.heldout_documents())):
        tokens, meta[name] = encode_documents(tokenizer, docs, desc=f"tokenizing {name}")
        np.save(out_dir / f"{name}.npy", tokens)
        print(f"{name}: {meta[name]}")
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def load_shard(path: Path) -> np.ndarray:
    """A shard, memory-mapped."""
    return np.load(path, mmap_mode="r")


def random_batches(tokens: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """``batch`` windows of ``seq_len + 1`` tokens at uniform random offsets: int32
    ``[batch, seq_len + 1]`` (inputs are ``[:, :-1]``, targets ``[:, 1:]``)."""
    starts = rng.integers(0, tokens.size - seq_len, size=batch)
    return np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int32)
