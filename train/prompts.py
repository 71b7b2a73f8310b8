"""Held-out prompts for evaluation and the benchmark (never trained on).

Three workloads; the first two are cut from held-out stdlib files (train.corpus split rule):
- edit: a rename instruction (train.edits format) whose reply copies the snippet with one
  identifier changed; preceded by held-out code of the same file and an end-of-text token,
  as documents are packed in training, to reach the requested prompt length;
- complete: a window of held-out code ending at a line boundary, to be continued;
- novel: uniformly random tokens, a prompt in which prompt lookup finds nothing to copy
  (what speculation costs when drafts fail).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from train import corpus, edits


class PromptError(ValueError):
    """Benchmark prompts that cannot be built (too short a length, too few held-out files)."""


@dataclasses.dataclass(frozen=True)
class Prompt:
    kind: str          # "edit" or "complete"
    ids: list[int]
    source: str        # held-out file it came from
    answer: str = ""   # the exact expected reply text (edit only)


def _heldout() -> list[tuple[str, str]]:
    files = corpus.split(corpus.stdlib_files())[1]
    texts, _ = corpus.read_sources(files)
    return [(corpus.relative_path(f), t) for f, t in zip(files, texts)]


def edit_prompts(tokenizer: Any, n: int, prompt_tokens: int, seed: int = 0) -> list[Prompt]:
    """n rename-edit prompts of about prompt_tokens tokens (the edit itself never cut)."""
    rng = random.Random(seed)
    files = _heldout()
    eos = [tokenizer.eos_token_id]
    out: list[Prompt] = []
    for _ in range(200 * n):
        if len(out) == n:
            break
        name, text = rng.choice(files)
        snippet = edits.sample_snippet(text, rng)
        example = edits.make_edit(snippet, rng) if snippet else None
        if example is None:
            continue
        tail = tokenizer(example.prompt)["input_ids"]
        budget = prompt_tokens - len(tail) - 1
        if budget < 0:
            continue
        prefix = tokenizer(text)["input_ids"][:budget]
        out.append(Prompt("edit", prefix + eos + tail, name, example.answer))
    if len(out) < n:
        raise PromptError(f"could only build {len(out)} of {n} edit prompts of {prompt_tokens} tokens")
    return out


def completion_prompts(tokenizer: Any, n: int, prompt_tokens: int, seed: int = 0) -> list[Prompt]:
    """n windows of held-out code (about prompt_tokens tokens, ending at a newline)."""
    rng = random.Random(seed)
    files = [(name, text) for name, text in _heldout() if len(text) > 8 * prompt_tokens]
    out: list[Prompt] = []
    for _ in range(50 * n):
        if len(out) == n:
            break
        name, text = rng.choice(files)
        ids = tokenizer(text)["input_ids"]
        if len(ids) < prompt_tokens + 64:
            continue
        start = rng.randrange(len(ids) - prompt_tokens - 64)
        window = ids[start:start + prompt_tokens]
        decoded = tokenizer.decode(window)
        cut = decoded.rfind("\n")
        ids = tokenizer(decoded[:cut + 1])["input_ids"] if cut > 0 else window
        out.append(Prompt("complete", ids, name))
    if len(out) < n:
        raise PromptError(f"could only build {len(out)} of {n} completion prompts of {prompt_tokens} tokens")
    return out


def novel_prompts(tokenizer: Any, n: int, prompt_tokens: int, seed: int = 0) -> list[Prompt]:
    """n prompts of prompt_tokens tokens drawn uniformly from the non-special vocabulary."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    return [Prompt("novel", [rng.choice(vocab) for _ in range(prompt_tokens)], "random tokens") for _ in range(n)]


MAKERS = {"edit": edit_prompts, "complete": completion_prompts, "novel": novel_prompts}
WORKLOADS = tuple(MAKERS)


def workload(tokenizer: Any, kind: str, n: int, prompt_tokens: int, seed: int = 0) -> list[Prompt]:
    """Prompts of one workload by name."""
    if kind not in MAKERS:
        raise PromptError(f"unknown workload {kind!r}; choose from {sorted(MAKERS)}")
    if tokenizer is None:
        raise PromptError("the benchmark's prompts are text: the model folder needs a tokenizer "
                          "(tokenizer.json or tokenizer_config.json)")
    return MAKERS[kind](tokenizer, n, prompt_tokens, seed)
