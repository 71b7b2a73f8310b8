"""The training corpus: the Python standard library of the running interpreter.

Files are every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` except test suites
(any path part named ``test`` or ``tests``, starting with ``test_`` or ending in
``_test``, e.g. ``idlelib/idle_test``), ``site-packages``, ``__pycache__``, files over
200 kB (generated tables such as ``pydoc_data/topics.py``) and files that are not UTF-8.

Split rule (fixed, by file): a file is held out iff
``zlib.crc32(relative_posix_path.encode()) % 20 == 0`` (about 5 % of files), where the
path is relative to the stdlib root, e.g. ``"json/decoder.py"``. Held-out files are never
trained on (not even as edit-example snippets); they feed evaluation and benchmark prompts.
"""

from __future__ import annotations

import random
import sysconfig
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from train.edits import edit_examples

MAX_FILE_BYTES = 200_000
HELDOUT_MODULUS = 20
EXCLUDED_PARTS = frozenset({"test", "tests", "site-packages", "__pycache__"})

# Share of training characters that are synthetic edit examples. Training files average
# ~15 kB and an edit example ~1.6 kB, so 0.25 is about 3 edit examples per file (~2.2k
# per epoch): enough renames for a ~10M-parameter model to learn the copy-with-change
# pattern, while three quarters of the text is still plain code.
EDIT_SHARE = 0.25


def stdlib_root() -> Path:
    """The stdlib directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def relative_path(path: Path, root: Path | None = None) -> str:
    """``path`` relative to the stdlib root, in POSIX form (the key of the split rule)."""
    return path.relative_to(root or stdlib_root()).as_posix()


def _excluded(rel: Path) -> bool:
    return any(
        part in EXCLUDED_PARTS or part.startswith("test_") or part.endswith("_test")
        for part in rel.parts
    )


def stdlib_files(root: Path | None = None) -> list[Path]:
    """All corpus source files (sorted), before the split; see the module docstring."""
    root = root or stdlib_root()
    return sorted(
        p
        for p in root.rglob("*.py")
        if not _excluded(p.relative_to(root)) and p.stat().st_size <= MAX_FILE_BYTES
    )


def is_heldout(rel_path: str) -> bool:
    """The fixed split rule: held out iff crc32 of the relative POSIX path is 0 mod 20."""
    return zlib.crc32(rel_path.encode()) % HELDOUT_MODULUS == 0


def split(files: Iterable[Path], root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """Partition ``files`` into (train, heldout) by :func:`is_heldout`."""
    train, heldout = [], []
    for path in files:
        (heldout if is_heldout(relative_path(path, root)) else train).append(path)
    return train, heldout


def read_sources(files: Iterable[Path]) -> tuple[list[str], int]:
    """UTF-8 texts of ``files``; returns (texts, number of undecodable files skipped)."""
    texts, skipped = [], 0
    for path in files:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            skipped += 1
    return texts, skipped


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
