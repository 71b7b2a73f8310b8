"""Byte-level BPE tokenizer for the tiny code models.

``python -m train.tokenizer --out checkpoints/tiny-code [--vocab-size 8192] [--shards runs/data]``

Trained on the training split only (see :mod:`train.corpus`). Byte-level pre-tokenizer
without prefix space, ByteLevel decoder and no normalizer, so decoding round-trips any
text exactly. Special tokens: ``<|endoftext|>`` (id 0, eos and pad) and ``<|mask|>``
(id 1, reserved for the DFlash drafter's masked block positions). Saved with
``save_pretrained`` so ``transformers.AutoTokenizer.from_pretrained(dir)`` loads it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from train import corpus
from train.data import EOS, build_shards

MASK = "<|mask|>"


def train_tokenizer(texts: Sequence[str], vocab_size: int = 8192) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts``; ids 0 and 1 are ``EOS`` and ``MASK``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS, MASK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        mask_token=MASK,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """``save_pretrained`` to ``out``, naming the class ``PreTrainedTokenizerFast`` (which
    transformers 4.x and 5.x both resolve) instead of the 5.x-only ``TokenizersBackend``."""
    tokenizer.save_pretrained(out)
    config_path = Path(out) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def bytes_per_token(tokenizer: PreTrainedTokenizerFast, texts: Sequence[str]) -> float:
    """UTF-8 bytes per token over ``texts`` (higher is better compression)."""
    n_tokens = sum(len(ids) for ids in tokenizer(list(texts))["input_ids"])
    return sum(len(t.encode()) for t in texts) / n_tokens


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.tokenizer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the tokenizer files")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--shards", type=Path, help="also tokenize the corpus into token shards here")
    args = parser.parse_args(argv)

    train_files, heldout_files = corpus.split(corpus.stdlib_files())
    texts, skipped = corpus.read_sources(train_files)
    print(f"training BPE on {len(texts)} files ({sum(map(len, texts)):,} chars, {skipped} not UTF-8)")
    tokenizer = train_tokenizer(texts, args.vocab_size)
    save_tokenizer(tokenizer, args.out)
    heldout, _ = corpus.read_sources(heldout_files)
    print(f"saved {len(tokenizer)} tokens to {args.out}; "
          f"held-out bytes/token {bytes_per_token(tokenizer, heldout):.3f}")
    if args.shards:
        build_shards(args.out, args.shards)


if __name__ == "__main__":
    from train import run

    run(main, "python -m train.tokenizer")
