"""The training corpus: the Python standard library of the running interpreter.

Which files belong to it and which are held out (never trained on, not even as
edit-example snippets) is `specjax.workloads`' split rule, shared with the benchmark's
prompts; its functions are re-exported here for the training stages. This module mixes
the training files with synthetic rename edits (`specjax.edits`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from specjax.edits import edit_examples
from specjax.workloads import read_sources, split, stdlib_files

# Share of training characters that are synthetic edit examples. Training files average
# ~15 kB and an edit example ~1.6 kB, so 0.25 is about 3 edit examples per file (~2.2k
# per epoch): enough renames for a ~10M-parameter model to learn the copy-with-change
# pattern, while three quarters of the text is still plain code.
EDIT_SHARE = 0.25


def _mixed(sources: list[str], seed: int, edit_share: float) -> Iterator[str]:
    """Every text of ``sources`` once, in a seeded order, interleaved with rename-edit
    examples cut from random texts of ``sources`` so that they make up about
    ``edit_share`` of the characters."""
    rng = random.Random(seed)
    order = list(range(len(sources)))
    rng.shuffle(order)
    edits = edit_examples(sources, rng) if edit_share > 0 else None
    budget = 0.0
    for i in order:
        yield sources[i]
        budget += len(sources[i]) * edit_share / (1.0 - edit_share)
        while budget > 0:
            text = next(edits).text
            budget -= len(text)
            yield text


def training_documents(seed: int = 0, edit_share: float = EDIT_SHARE) -> Iterator[str]:
    """One epoch of training documents: every training file once, mixed with rename edits
    cut from training files (about ``edit_share`` of the characters)."""
    yield from _mixed(read_sources(split(stdlib_files())[0])[0], seed, edit_share)


def heldout_documents(seed: int = 0, edit_share: float = 0.0) -> Iterator[str]:
    """Every held-out file's text: in path order without edits; with ``edit_share`` > 0,
    in a seeded order mixed with rename edits cut from held-out files (a held-out set
    of the training mixture)."""
    sources = read_sources(split(stdlib_files())[1])[0]
    yield from _mixed(sources, seed, edit_share) if edit_share > 0 else sources
