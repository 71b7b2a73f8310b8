"""Token shards and batch sampling for causal-LM training.

A shard is one flat ``uint16`` array (``.npy``): every document's tokens followed by the
eos id. ``train.npy`` holds one epoch of :func:`train.corpus.training_documents` (files
plus rename edits), ``heldout.npy`` the held-out files (mixed with edits cut from them at
the same share when it is not the default); ``meta.json`` records sizes. ``train_marks.npy``
labels each training token plain, rename reply, or the reply's new name (:func:`token_marks`):
``train.lm --reply-weight / --rename-weight`` weigh them in the loss.

``python -m train.data --out runs/data-edits --seed 1 --edit-share 0.5`` tokenizes another
epoch with an existing tokenizer (a new file order and new edits, or another mixture);
``python -m train.tokenizer --shards`` builds the default shards with a new tokenizer.

``--repeat-share`` adds copy drills to the training shard only: a span of tokens followed
by the same span again. Half the spans are windows of the corpus, half are corpus tokens
drawn independently (no structure to predict but the repeat). They are the plainest
signal for induction-style copying, which rename edits alone had not taught the target.
``--drill-alphabet N`` draws each independent span from only N corpus tokens, so a token
recurs throughout its span and one token no longer tells the copy where it is: it has to
match the few tokens before it, as when copying code where `` self`` or ``(`` recur.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from specjax import edits
from train import corpus

EOS = "<|endoftext|>"  # the document separator: the tokenizer's eos token (train.tokenizer)

MARKS_FILE = "train_marks.npy"  # the training shard's token marks (uint8 per token)
PLAIN, REPLY, RENAMED = 0, 1, 2  # the marks (train.lm weighs them)


def encode_documents(tokenizer: Tokenizer, docs: Iterable[str], desc: str,
                     chunk: int = 64) -> tuple[np.ndarray, np.ndarray, dict]:
    """Concatenate the tokens of ``docs``, each followed by eos; returns (tokens, marks,
    stats), with one :func:`token_marks` label per token (eos: ``PLAIN``)."""
    eos = tokenizer.token_to_id(EOS)
    docs = list(docs)
    parts, marks, chars, nbytes = [], [], 0, 0
    for i in tqdm(range(0, len(docs), chunk), desc=desc, unit="chunk"):
        batch = docs[i : i + chunk]
        for doc, enc in zip(batch, tokenizer.encode_batch(batch, add_special_tokens=False)):
            parts.append(np.asarray(enc.ids + [eos], dtype=np.uint16))
            marks.append(np.append(token_marks(enc.offsets, doc), np.uint8(PLAIN)))
        chars += sum(map(len, batch))
        nbytes += sum(len(d.encode()) for d in batch)
    tokens = np.concatenate(parts)
    marks = np.concatenate(marks)
    stats = {"documents": len(docs), "chars": chars, "bytes": nbytes, "tokens": int(tokens.size),
             "reply_tokens": int((marks == REPLY).sum()), "renamed_tokens": int((marks == RENAMED).sum())}
    return tokens, marks, stats


def token_marks(offsets: Sequence[tuple[int, int]], text: str) -> np.ndarray:
    """A label per token of ``text`` (by character ``offsets``): ``RENAMED`` where an edit
    document's answer writes the new name, and on the token after each such run (where the
    reply must find its place in the snippet again), ``REPLY`` on the answer's other
    tokens, ``PLAIN`` elsewhere (the prompt, any other document)."""
    marks = np.full(len(offsets), PLAIN, np.uint8)
    edit = edits.edit_reply(text)
    if edit is None or not offsets:
        return marks
    reply_start, spans = edit
    starts, ends = np.asarray(offsets).T
    marks[starts >= reply_start] = REPLY
    for s, e in spans:
        marks[(starts < e) & (ends > s)] = RENAMED
        after = np.flatnonzero(starts >= e)
        if after.size:
            marks[after[0]] = RENAMED
    return marks


def repeat_drills(tokens: np.ndarray, eos: int, n_tokens: int, rng: np.random.Generator,
                  min_len: int = 16, max_len: int = 256, alphabet: int = 0) -> list[np.ndarray]:
    """Copy drills of about ``n_tokens`` in all, each ``span + span + [eos]`` with a span of
    ``min_len..max_len`` tokens taken from ``tokens``: alternately a contiguous window and
    independently drawn positions (with ``alphabet`` > 0, drawn from that many positions
    picked for the drill, so the span has at most ``alphabet`` distinct tokens). Spans never
    contain ``eos``."""
    drills, total = [], 0
    while total < n_tokens:
        n = int(rng.integers(min_len, max_len + 1))
        if len(drills) % 2 == 0:
            start = int(rng.integers(0, tokens.size - n))
            span = np.asarray(tokens[start : start + n])
        elif alphabet > 0:
            span = np.asarray(tokens[rng.choice(rng.integers(0, tokens.size, size=alphabet), size=n)])
        else:
            span = np.asarray(tokens[rng.integers(0, tokens.size, size=n)])
        span = span[span != eos]
        if span.size < min_len:
            continue
        drills.append(np.concatenate([span, span, [eos]]).astype(tokens.dtype))
        total += drills[-1].size
    return drills


def _with_drills(tokens: np.ndarray, marks: np.ndarray, eos: int, share: float,
                 seed: int, alphabet: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """``tokens`` (eos-terminated documents) and their ``marks`` with copy drills
    (:func:`repeat_drills`) making up ``share`` of the result, placed between documents in a
    seeded order; returns (tokens, marks, drill tokens). Drill tokens are ``PLAIN``."""
    rng = np.random.default_rng(seed)
    cuts = np.flatnonzero(tokens == eos)[:-1] + 1
    docs, doc_marks = np.split(tokens, cuts), np.split(marks, cuts)
    drills = repeat_drills(tokens, eos, int(tokens.size * share / (1.0 - share)), rng, alphabet=alphabet)
    order = rng.permutation(len(docs) + len(drills))
    pieces = [docs[i] if i < len(docs) else drills[i - len(docs)] for i in order]
    mark_pieces = [doc_marks[i] if i < len(docs) else np.full(drills[i - len(docs)].size, PLAIN, np.uint8)
                   for i in order]
    return np.concatenate(pieces), np.concatenate(mark_pieces), sum(d.size for d in drills)


def build_shards(tokenizer_dir: Path, out_dir: Path, seed: int = 0, edit_share: float = corpus.EDIT_SHARE,
                 repeat_share: float = 0.0, drill_alphabet: int = 0) -> dict:
    """Write ``train.npy``, ``heldout.npy`` and ``meta.json`` to ``out_dir``; returns the meta.

    With the default edit share the held-out shard is the held-out files alone (the
    language-model loss reported so far); with another share it is their mixture at that
    share, so held-out loss measures what the run trains on. ``repeat_share`` of the
    training tokens are copy drills (:func:`repeat_drills`, ``drill_alphabet`` its
    ``alphabet``); the held-out shard has none."""
    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    if tokenizer.get_vocab_size() > np.iinfo(np.uint16).max + 1:
        raise ValueError(f"vocab of {tokenizer_dir} does not fit uint16 shards")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, share in (("edit_share", edit_share), ("repeat_share", repeat_share)):
        if not 0.0 <= share < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {share}")
    if drill_alphabet < 0:
        raise ValueError(f"drill_alphabet must be >= 0, got {drill_alphabet}")
    eos = tokenizer.token_to_id(EOS)
    meta = {"tokenizer": str(tokenizer_dir), "seed": seed, "edit_share": edit_share,
            "repeat_share": repeat_share, "drill_alphabet": drill_alphabet, "eos_id": eos}
    heldout_share = 0.0 if edit_share == corpus.EDIT_SHARE else edit_share
    for name, docs in (("train", corpus.training_documents(seed, edit_share)),
                       ("heldout", corpus.heldout_documents(seed, heldout_share))):
        tokens, marks, meta[name] = encode_documents(tokenizer, docs, desc=f"tokenizing {name}")
        if name == "train" and repeat_share > 0:
            tokens, marks, meta[name]["drill_tokens"] = _with_drills(
                tokens, marks, eos, repeat_share, seed, drill_alphabet)
            meta[name]["tokens"] = int(tokens.size)
        np.save(out_dir / f"{name}.npy", tokens)
        if name == "train":
            np.save(out_dir / MARKS_FILE, marks)
        print(f"{name}: {meta[name]}")
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def load_shard(path: Path) -> np.ndarray:
    """A shard, memory-mapped."""
    return np.load(path, mmap_mode="r")


def random_batches(tokens: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator,
                   marks: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """``batch`` windows of ``seq_len + 1`` tokens at uniform random offsets: int32
    ``[batch, seq_len + 1]`` (inputs are ``[:, :-1]``, targets ``[:, 1:]``), and the same
    windows of ``marks`` (None without them)."""
    starts = rng.integers(0, tokens.size - seq_len, size=batch)
    windows = np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int32)
    if marks is None:
        return windows, None
    return windows, np.stack([marks[s : s + seq_len + 1] for s in starts])


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m train.data", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", type=Path, default=Path("checkpoints/tiny-code"), help="folder with tokenizer.json")
    p.add_argument("--out", type=Path, required=True, help="shard directory to write")
    p.add_argument("--seed", type=int, default=0, help="file order and edit examples")
    p.add_argument("--edit-share", type=float, default=corpus.EDIT_SHARE, help="share of characters that are rename edits")
    p.add_argument("--repeat-share", type=float, default=0.0, help="share of training tokens that are copy drills")
    p.add_argument("--drill-alphabet", type=int, default=0,
                   help="draw each drill's independent span from this many corpus tokens (0: from the whole corpus)")
    args = p.parse_args(argv)
    if not (args.tokenizer / "tokenizer.json").is_file():
        p.error(f"{args.tokenizer}/tokenizer.json not found")
    if args.drill_alphabet < 0:
        p.error(f"--drill-alphabet must be >= 0, got {args.drill_alphabet}")
    build_shards(args.tokenizer, args.out, args.seed, args.edit_share, args.repeat_share, args.drill_alphabet)


if __name__ == "__main__":
    from train import run

    run(main, "python -m train.data")
