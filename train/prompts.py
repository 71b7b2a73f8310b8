"""The user's own prompts for drafter training: deduplicated, split and padded.

They are read by `specjax.prompt_files` (``--prompt-file`` JSONL or text, ``--prompt-dir``);
here they become the data plan's prompts: duplicates by token ids dropped, a seeded share
held out for tau, the rest padded into prompts.npy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from specjax.prompt_files import Prompt, PromptError, read_prompt_dir, read_prompt_file

__all__ = ["Prompt", "PromptError", "read_prompt_dir", "read_prompt_file", "dedupe", "split", "pad", "digest"]


def dedupe(prompts: Sequence[Prompt]) -> list[Prompt]:
    """The prompts with repeated token ids dropped (the first occurrence kept)."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for p in prompts:
        if p.ids not in seen:
            seen.add(p.ids)
            out.append(p)
    return out


def split(prompts: Sequence[Prompt], heldout_share: float, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held-out): a seeded random `heldout_share` of the prompts, at least one of
    each (held-out tau is what decides the export), each part in its original order."""
    if not 0 < heldout_share < 1:
        raise PromptError(f"--heldout-share must be in (0, 1), got {heldout_share}")
    n = len(prompts)
    if n < 2:
        raise PromptError(f"{n} distinct prompt(s): training and held-out tau need at least 2")
    k = min(n - 1, max(1, round(heldout_share * n)))
    held = set(np.random.default_rng(seed).permutation(n)[:k].tolist())
    return [p for i, p in enumerate(prompts) if i not in held], [p for i, p in enumerate(prompts) if i in held]


def pad(prompts: Sequence[Prompt], width: int) -> np.ndarray:
    """int32 [n, width]: each prompt's ids, then -1; a prompt longer than `width` is a
    PromptError naming it."""
    out = np.full((len(prompts), width), -1, np.int32)
    for i, p in enumerate(prompts):
        if len(p.ids) > width:
            raise PromptError(f"{p.where}: the prompt has {len(p.ids)} tokens, more than --prompt-len {width}")
        out[i, :len(p.ids)] = p.ids
    return out


def digest(prompts: np.ndarray) -> str:
    """sha256 of a padded prompt array (what a data folder's plan records of them)."""
    return hashlib.sha256(np.ascontiguousarray(prompts, np.int32).tobytes()).hexdigest()
