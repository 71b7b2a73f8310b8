"""Evaluate a trained model folder: held-out loss, rename-edit accuracy, sample continuations.

`python -m train.evaluate --model checkpoints/tiny-code [--edits 20] [--samples 3]
[--dtype int8]` prints a JSON report (the numbers in checkpoints/README.md come from it).
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import specjax
from specjax import cpu_kernels, qwen3
from specjax import edits
from specjax.errors import PromptError, SpecjaxError
from specjax.model import COMPUTE_DTYPES, TOKENIZER_FILES
from specjax.workloads import Prompt, completion_prompts, edit_prompts
from train import corpus
from train.data import encode_documents


HELDOUT_WINDOW = 512  # tokens per held-out window, for models whose context holds them


def heldout_loss(model: specjax.Model, tokens: np.ndarray, seq: int = HELDOUT_WINDOW, windows: int = 48) -> float:
    """Mean next-token cross-entropy (nats) over evenly spaced held-out windows of `seq`
    tokens (at most the model's context)."""
    if seq > model.config.max_position_embeddings:
        raise SpecjaxError(f"held-out windows of {seq} tokens exceed the model's context "
                         f"({model.config.max_position_embeddings})")
    starts = np.linspace(0, len(tokens) - seq - 2, windows).astype(int)
    losses = []
    for s in starts:
        w = np.asarray(tokens[s:s + seq + 1], np.int32)
        logits, _, _ = qwen3.forward(model.params, model.config, w[None, :-1], np.arange(seq)[None])
        losses.append(float(optax.softmax_cross_entropy_with_integer_labels(logits[0], jnp.asarray(w[1:])).mean()))
    return float(np.mean(losses))


def prefix_fraction(got: str, want: str) -> float:
    """Share of `want` that `got` reproduces before its first differing character."""
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return same / len(want) if want else 1.0


def line_match(got: str, want: str) -> tuple[float, float]:
    """Lenient measures of a reply against the expected snippet: the share of its lines
    reproduced exactly at their place, and difflib's similarity ratio of the text (the
    reply cut to as many lines as the snippet has)."""
    want_lines = want.splitlines()
    got_lines = got.splitlines()[:len(want_lines)]
    same = sum(a == b for a, b in zip(got_lines, want_lines))
    ratio = difflib.SequenceMatcher(None, "\n".join(got_lines), "\n".join(want_lines), autojunk=False).ratio()
    return same / max(len(want_lines), 1), ratio


def teacher_forced_hits(model: specjax.Model, prompt: Prompt) -> dict:
    """Greedy next-token hits on the reply of an edit prompt given the true reply so far,
    as (hits, total) for: the tokens that write the new name ("rename"), the first of them
    at each occurrence, where the reply must stop copying the snippet ("first"), and all
    other tokens ("copy"). Whether the model copies, and whether it renames, before it gets
    whole edits right."""
    tok = model.tokenizer
    new = edits.INSTRUCTION.findall(tok.decode(prompt.ids[-60:]))[-1][1]
    enc = tok(prompt.answer, return_offsets_mapping=True)
    ids = np.asarray(prompt.ids + enc["input_ids"], np.int32)
    logits, _, _ = qwen3.forward(model.params, model.config, ids[None, :-1], np.arange(len(ids) - 1)[None])
    hits = np.asarray(jnp.argmax(logits[0, len(prompt.ids) - 1:], -1)) == ids[len(prompt.ids):]
    starts, ends = np.asarray(enc["offset_mapping"]).T
    is_new, first = np.zeros(len(hits), bool), np.zeros(len(hits), bool)
    for s, e in edits.name_spans(prompt.answer, new):
        overlap = (starts < e) & (ends > s)
        is_new |= overlap
        first[np.argmax(overlap)] = True
    return {"copy": (int(hits[~is_new].sum()), int((~is_new).sum())),
            "rename": (int(hits[is_new].sum()), int(is_new.sum())),
            "first": (int(hits[first].sum()), int(first.sum()))}


def rename_accuracy(model: specjax.Model, n: int, prompt_tokens: int = 300, seed: int = 1) -> dict:
    """Held-out rename edits: the fraction whose greedy reply is exactly the renamed snippet,
    the mean share of the snippet reproduced before the first mistake, of its lines
    reproduced in place and the text similarity (:func:`line_match`), and teacher-forced
    token accuracy on the copied and on the renamed tokens (:func:`teacher_forced_hits`)."""
    tok = model.tokenizer
    right, prefix, lines, similar = 0, 0.0, 0.0, 0.0
    hits = {"copy": [0, 0], "rename": [0, 0], "first": [0, 0]}
    for p in edit_prompts(tok, n, prompt_tokens, seed=seed):
        want = len(tok(p.answer)["input_ids"])
        room = model.config.max_position_embeddings - len(p.ids)
        if room < want:  # a reply cut short would count as a wrong edit
            raise PromptError(f"--edits: an edit prompt of {len(p.ids)} tokens and its {want}-token reply exceed the "
                              f"model's context (max_position_embeddings {model.config.max_position_embeddings}); "
                              "pass --edits 0")
        for kind, (h, total) in teacher_forced_hits(model, p).items():
            hits[kind][0] += h
            hits[kind][1] += total
        out = specjax.generate(model, p.ids, max_new_tokens=min(want + 8, room), stop_ids=model.eos_ids,
                               speculative=specjax.NgramProposer(k=7))
        got = tok.decode(out.tokens)
        right += got.startswith(p.answer)
        prefix += prefix_fraction(got, p.answer)
        line_share, ratio = line_match(got, p.answer)
        lines += line_share
        similar += ratio
    return {"edits": n, "exact": right, "accuracy": right / n, "mean_prefix_right": prefix / n,
            "mean_lines_right": lines / n, "mean_similarity": similar / n,
            **{f"{kind}_token_accuracy": h / max(total, 1) for kind, (h, total) in hits.items()}}


def continuations(model: specjax.Model, n: int, new_tokens: int = 64, prompt_tokens: int = 200) -> list[dict]:
    """n greedy continuations of held-out code windows of about `prompt_tokens` tokens."""
    if n and prompt_tokens + new_tokens > model.config.max_position_embeddings:
        raise PromptError(f"--samples: {prompt_tokens}-token prompts and {new_tokens} new tokens exceed the model's "
                          f"context (max_position_embeddings {model.config.max_position_embeddings}); pass --samples 0")
    tok = model.tokenizer
    out = []
    for p in completion_prompts(tok, n, prompt_tokens, seed=2):
        res = specjax.generate(model, p.ids, max_new_tokens=new_tokens, stop_ids=model.eos_ids)
        out.append({"file": p.source, "prompt_tail": tok.decode(p.ids[-40:]), "continuation": tok.decode(res.tokens)})
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m train.evaluate", description=__doc__)
    ap.add_argument("--model", type=Path, default=Path("checkpoints/tiny-code"))
    ap.add_argument("--edits", type=int, default=20)
    ap.add_argument("--edit-seed", type=int, default=1, help="which held-out edits (1: the model card's)")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--dtype", choices=[d.name for d in COMPUTE_DTYPES],
                    help="load with this dtype (default: specjax.load's; int8: the quantized model)")
    args = ap.parse_args(argv)
    for flag, value in (("--edits", args.edits), ("--samples", args.samples)):
        if value < 0:
            ap.error(f"{flag} must be >= 0 (0 skips that part), got {value}")
    if args.model.is_dir() and not any((args.model / name).is_file() for name in TOKENIZER_FILES):
        ap.error(f"--model {args.model}: no tokenizer files ({' / '.join(TOKENIZER_FILES)}); the held-out text, "
                 "edits and samples need one")
    model = specjax.load(args.model, dtype=args.dtype)
    tokens, _, stats = encode_documents(model.tokenizer.backend_tokenizer, corpus.heldout_documents(), "held-out files")
    window = min(HELDOUT_WINDOW, model.config.max_position_embeddings)
    loss = heldout_loss(model, tokens, window)
    bytes_per_token = stats["bytes"] / stats["tokens"]
    report = {
        "model": str(args.model),
        "dtype": args.dtype or "default",
        "parameters": int(sum(np.prod(x.shape) for x in jax.tree.leaves(cpu_kernels.unpack_tree(model.params)))),
        "heldout_window_tokens": window,
        "heldout_nats_per_token": loss,
        "heldout_bits_per_byte": loss / math.log(2) / bytes_per_token,
    }
    if args.edits:
        report["rename"] = rename_accuracy(model, args.edits, seed=args.edit_seed)
    report["samples"] = continuations(model, args.samples)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    from train import run

    run(main, "python -m train.evaluate")
