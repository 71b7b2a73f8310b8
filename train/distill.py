"""Distillation shards for a draft model: the target's own replies as training text.

``python -m train.distill --data runs/tiny-code-dflash/data --out runs/distill`` turns a
``train.dflash`` data folder (prompts + the target's replies) into the shard layout that
:mod:`train.lm` reads: ``train.npy`` holds every sequence but the held-out ones (prompt
and reply through its eos, one after another), ``heldout.npy`` every 20th sequence. Then

    python -m train.draft --data runs/distill --init checkpoints/tiny-code-draft ...

fine-tunes the draft towards what the target says: a draft model is paid for agreeing
with the target, not for modelling the corpus. Held-out loss is on unseen replies.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from specjax.config import Qwen3Config
from specjax.errors import SpecjaxError
from train.dflash_data import reply_lengths

HELDOUT_EVERY = 20


def build(data: Path, out: Path, tokenizer_dir: Path) -> dict:
    """Write train.npy, heldout.npy and meta.json to `out`; returns the meta."""
    plan = json.loads((data / "meta.json").read_text())
    shards = sorted(data.glob("seqs-*.npy"))
    if not shards:
        raise SpecjaxError(f"{data}: no seqs-*.npy shards (generate them with python -m train.dflash)")
    seqs = np.concatenate([np.load(f) for f in shards])
    target = Qwen3Config.from_hf(plan["target"]["config"])
    if target.vocab_size > np.iinfo(np.uint16).max + 1:  # shards are uint16 (train.data, train.lm)
        raise SpecjaxError(f"{data / 'meta.json'}: the target's vocabulary of {target.vocab_size} tokens does not "
                           f"fit uint16 shards (at most {np.iinfo(np.uint16).max + 1})")
    eos_ids = target.eos_ids
    if not eos_ids:
        raise SpecjaxError(f"{data / 'meta.json'}: the target has no eos_token_id")
    if len(seqs) < 2:  # every HELDOUT_EVERY-th, the first included, is held out: both parts need one
        raise SpecjaxError(f"{data}: {len(seqs)} sequence(s); a train and a held-out part need at least 2")
    eos = eos_ids[0]
    prompts = data / "prompts.npy"  # -1 after a shorter prompt's end (the user's prompts)
    starts = (np.load(prompts) >= 0).sum(axis=1)[:len(seqs)] if prompts.is_file() else plan["prompt_len"]
    lengths = reply_lengths(seqs, starts, eos_ids, plan["response_len"])
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    out.mkdir(parents=True, exist_ok=True)
    meta = {"source": str(data), "tokenizer": str(tokenizer_dir), "eos_id": eos}
    for name, rows in (("train", np.arange(len(seqs)) % HELDOUT_EVERY != 0),
                       ("heldout", np.arange(len(seqs)) % HELDOUT_EVERY == 0)):
        # a reply that ran to the length limit gets an eos appended, as documents are packed
        docs = [seq[:n] if seq[n - 1] in eos_ids else np.append(seq[:n], eos)
                for seq, n in zip(seqs[rows], lengths[rows])]
        tokens = np.concatenate(docs).astype(np.uint16)
        text_bytes = sum(len(tokenizer.decode(d.tolist(), skip_special_tokens=False).encode()) for d in docs)
        np.save(out / f"{name}.npy", tokens)
        meta[name] = {"documents": len(docs), "tokens": int(tokens.size), "bytes": text_bytes}
        print(f"{name}: {meta[name]}")
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m train.distill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="a train.dflash data folder")
    p.add_argument("--out", type=Path, required=True, help="shard folder to write")
    p.add_argument("--tokenizer", type=Path, default=Path("checkpoints/tiny-code"), help="folder with tokenizer.json")
    args = p.parse_args(argv)
    build(args.data, args.out, args.tokenizer)


if __name__ == "__main__":
    from train import run

    run(main, "python -m train.distill")
