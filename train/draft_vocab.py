"""A DFlash drafter's draft vocabulary: the target tokens most frequent in the training
corpus, so a block is scored against those rows of the target's head only (EAGLE-3's
reduced draft vocabulary, arXiv:2503.01840). Drafts are only proposals: the output does
not change, only what a block pass costs and how often its drafts are accepted.

    python -m train.draft_vocab --drafter checkpoints/tiny-code-dflash --size 2048

writes draft_vocab.json into the drafter's folder (`specjax.dflash.VOCAB_FILE`) and prints
the share of corpus tokens and of held-out tokens the vocabulary covers.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from specjax.dflash import VOCAB_FILE, DFlashConfig, check_vocab
from specjax.errors import SpecjaxError
from train import corpus
from train.lm import positive_int


def token_counts(tokenizer: Any, documents: Iterable[str], vocab_size: int, chars: int, desc: str) -> np.ndarray:
    """Occurrences [vocab_size] of each token id in the documents, up to `chars` characters."""
    counts = np.zeros(vocab_size, np.int64)
    seen = 0
    with tqdm(total=chars, desc=desc, unit="char", unit_scale=True) as bar:
        for doc in documents:
            doc = doc[:chars - seen]
            ids = np.asarray(tokenizer(doc)["input_ids"], np.int64)
            if ids.size and ids.max() >= vocab_size:
                raise SpecjaxError(f"the tokenizer gives id {int(ids.max())}, beyond the drafter's vocab_size "
                                   f"{vocab_size}: it is not the target's tokenizer")
            counts += np.bincount(ids, minlength=vocab_size)
            seen += len(doc)
            bar.update(len(doc))
            if seen >= chars:
                break
    return counts


def most_frequent(counts: np.ndarray, size: int, always: Sequence[int] = ()) -> np.ndarray:
    """The `size` ids with the largest counts (ties: the smaller id), plus `always`, sorted."""
    if not 1 <= size <= counts.size:
        raise SpecjaxError(f"--size must be in [1, {counts.size}] (the vocabulary), got {size}")
    order = np.lexsort((np.arange(counts.size), -counts))  # by count descending, then id
    return np.unique(np.concatenate([order[:size], np.asarray(always, np.int64)])).astype(np.int32)


def coverage(counts: np.ndarray, ids: np.ndarray) -> float:
    """Share of the counted tokens whose id is in `ids`."""
    return float(counts[ids].sum() / max(counts.sum(), 1))


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m train.draft_vocab", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--drafter", type=Path, required=True, help="DFlash drafter folder (draft_vocab.json goes here)")
    p.add_argument("--target", type=Path, default=Path("checkpoints/tiny-code"),
                   help="the target folder whose tokenizer counts the corpus")
    p.add_argument("--size", type=positive_int, default=2048, help="tokens in the draft vocabulary")
    p.add_argument("--chars", type=positive_int, default=20_000_000, help="training-corpus characters to count")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    cfg = DFlashConfig.from_file(args.drafter / "config.json")
    if args.size > cfg.vocab_size:  # before minutes of counting
        p.error(f"--size {args.size}: more than the drafter's vocabulary of {cfg.vocab_size} tokens")
    tokenizer = AutoTokenizer.from_pretrained(str(args.target))
    counts = token_counts(tokenizer, corpus.training_documents(), cfg.vocab_size, args.chars, "training corpus")
    ids = check_vocab(most_frequent(counts, args.size, tokenizer.all_special_ids), cfg.vocab_size, "draft vocabulary")
    held = token_counts(tokenizer, corpus.heldout_documents(), cfg.vocab_size, args.chars // 10, "held-out files")
    (args.drafter / VOCAB_FILE).write_text(json.dumps({"token_ids": ids.tolist()}))
    print(f"{args.drafter / VOCAB_FILE}: {len(ids)} tokens of {cfg.vocab_size}; they are "
          f"{coverage(counts, ids):.1%} of the training tokens counted, {coverage(held, ids):.1%} of held-out ones")


if __name__ == "__main__":
    from train import run

    run(main, "python -m train.draft_vocab")
