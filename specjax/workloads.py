"""The benchmark's workloads: held-out prompts of the Python standard library, never
trained on.

The corpus is the Python standard library of the running interpreter: every ``*.py``
under ``sysconfig.get_paths()["stdlib"]`` except test suites (any path part named
``test`` or ``tests``, starting with ``test_`` or ending in ``_test``, e.g.
``idlelib/idle_test``), ``site-packages``, ``__pycache__``, files over 200 kB (generated
tables such as ``pydoc_data/topics.py``) and files that are not UTF-8.

Split rule (fixed, by file): a file is held out iff
``zlib.crc32(relative_posix_path.encode()) % 20 == 0`` (about 5 % of files), where the
path is relative to the stdlib root, e.g. ``"json/decoder.py"``. Held-out files are never
trained on (`train.corpus` trains on the rest); they feed evaluation and benchmark prompts.

Three workloads; the first two are cut from held-out files:
- edit: a rename instruction (`specjax.edits` format) whose reply copies the snippet with
  one identifier changed; preceded by held-out code of the same file and an end-of-text
  token, as documents are packed in training, to reach the requested prompt length;
- complete: a window of held-out code ending at a line boundary, to be continued;
- novel: uniformly random tokens, a prompt in which prompt lookup finds nothing to copy
  (what speculation costs when drafts fail).
"""

from __future__ import annotations

import dataclasses
import random
import sysconfig
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from . import edits
from .errors import PromptError

MAX_FILE_BYTES = 200_000
HELDOUT_MODULUS = 20
EXCLUDED_PARTS = frozenset({"test", "tests", "site-packages", "__pycache__"})


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


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: its token ids, the held-out file it came from and, for an edit,
    the exact reply expected."""

    kind: str          # "edit" or "complete"
    ids: list[int]
    source: str        # held-out file it came from
    answer: str = ""   # the exact expected reply text (edit only)


def _heldout() -> list[tuple[str, str]]:
    files = split(stdlib_files())[1]
    texts, _ = read_sources(files)
    return [(relative_path(f), t) for f, t in zip(files, texts)]


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
    if n > 0 and not files:
        raise PromptError(f"no held-out file is long enough for completion prompts of {prompt_tokens} tokens")
    out: list[Prompt] = []
    for _ in range(50 * n):
        if len(out) == n:
            break
        name, text = rng.choice(files)
        ids = tokenizer(text)["input_ids"]
        if len(ids) <= prompt_tokens + 64:  # (no start left to draw the window's from)
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


def _maker(tokenizer: Any, kind: str, folder: Path | None = None):
    """The prompt maker of workload `kind`, for a model with this tokenizer (from `folder`,
    named in the error when it has none)."""
    if kind not in MAKERS:
        raise PromptError(f"unknown workload {kind!r}; choose from {sorted(MAKERS)}")
    if tokenizer is None:
        raise PromptError(f"{'' if folder is None else f'{folder}: '}the benchmark's prompts are text: the model "
                          "folder needs a tokenizer (tokenizer.json or tokenizer_config.json)")
    return MAKERS[kind]


def workload(tokenizer: Any, kind: str, n: int, prompt_tokens: int, seed: int = 0) -> list[Prompt]:
    """Prompts of one workload by name."""
    return _maker(tokenizer, kind)(tokenizer, n, prompt_tokens, seed)


def benchmark_prompts(model: Any, kinds: Iterable[str], n: int, prompt_tokens: int, new_tokens: int
                      ) -> dict[str, list[Prompt]]:
    """Every workload's prompts (`workload`), each one `model` takes with `new_tokens` after
    it (`results.check_prompt`): built before anything is compiled or timed, so that a
    length the model cannot take is refused by its flags, not after other workloads ran."""
    import numpy as np

    from .results import GenerationError, check_prompt

    out = {}
    for kind in kinds:
        make = _maker(model.tokenizer, kind, model.path)
        try:  # a length the workload cannot build or the model cannot take: the flags' fault
            out[kind] = make(model.tokenizer, n, prompt_tokens)
            for p in out[kind]:
                check_prompt(model.config, np.asarray(p.ids), new_tokens)
        except (PromptError, GenerationError) as e:
            raise PromptError(f"--prompt-tokens {prompt_tokens} / --new-tokens {new_tokens} "
                              f"({kind} workload): {e}") from None
    return out
