"""Synthetic rename-edit examples: the copy-heavy workload speculative decoding wins on.

An example is a code snippet, one instruction line, and the snippet again with one
identifier renamed::

    <snippet>
    # Rename `old` to `new`.
    <snippet with every NAME token `old` replaced by `new`>

The rewrite goes through :mod:`tokenize`: only NAME tokens equal to ``old`` change
(attribute accesses included); whitespace, comments and strings stay byte-identical.
:func:`render_prompt` is the single definition of the format (training and benchmark).
"""

from __future__ import annotations

import ast
import builtins
import io
import itertools
import keyword
import random
import re
import textwrap
import tokenize
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

MIN_LINES, MAX_LINES = 10, 40
RESERVED = frozenset(keyword.kwlist + keyword.softkwlist + dir(builtins) + ["self", "cls"])
WORDS = (
    "item", "value", "node", "entry", "record", "buffer", "state", "token", "result",
    "handler", "reader", "writer", "parser", "target", "source", "config", "option",
    "widget", "cursor", "packet", "payload", "frame", "block", "chunk", "index", "offset",
    "count", "total", "limit", "label", "field", "column", "table", "cache", "queue",
    "stack", "batch", "group", "layer", "task", "job", "worker", "client", "server",
    "request", "response", "message", "event", "signal", "path", "name", "key", "data",
    "info", "spec", "meta", "context", "helper", "builder", "loader", "runner", "manager",
)
ASSIGN_OPS = frozenset({"=", ":=", "+=", "-=", "*=", "/=", "//=", "%=", "|=", "&=", "^="})


@dataclass(frozen=True)
class EditExample:
    """One rename example; ``prompt + answer`` is the training document."""

    snippet: str
    old: str
    new: str
    prompt: str
    answer: str

    @property
    def text(self) -> str:
        return self.prompt + self.answer


def render_prompt(snippet: str, old: str, new: str) -> str:
    """The prompt: the snippet (ending in a newline), then the instruction line."""
    return f"{snippet}# Rename `{old}` to `{new}`.\n"


# The instruction line of render_prompt, at the start of a line.
INSTRUCTION = re.compile(r"^# Rename `(\w+)` to `(\w+)`\.\n", re.MULTILINE)


def _lines(source: str) -> list[str]:
    # tokenize splits lines on "\n" only (not on "\f" etc. like str.splitlines).
    return io.StringIO(source).readlines()


def name_spans(source: str, name: str) -> list[tuple[int, int]]:
    """Character spans ``(start, end)`` of the NAME tokens of ``source`` equal to ``name``.

    Raises whatever :mod:`tokenize` raises on source it cannot tokenize."""
    line_starts = list(itertools.accumulate(map(len, _lines(source)), initial=0))
    return [(start, start + len(name))
            for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.NAME and tok.string == name
            for start in [line_starts[tok.start[0] - 1] + tok.start[1]]]


def rename_identifier(source: str, old: str, new: str) -> str:
    """``source`` with every NAME token equal to ``old`` replaced by ``new``.

    Raises whatever :mod:`tokenize` raises on source it cannot tokenize."""
    pieces, pos = [], 0
    for start, end in name_spans(source, old):
        pieces += [source[pos:start], new]
        pos = end
    pieces.append(source[pos:])
    return "".join(pieces)


def edit_reply(text: str) -> tuple[int, list[tuple[int, int]]] | None:
    """Where the answer of an edit document (``prompt + answer``, :attr:`EditExample.text`)
    starts, and the character spans of the new name in it; None for any other text.

    The answer is the copy a model must write, the new name's places where copying the
    snippet is wrong: the training loss can weigh both (``train.data.token_marks``).
    Every instruction-like line is tried (a snippet may hold one in a comment or string)."""
    for m in INSTRUCTION.finditer(text):
        snippet, answer = text[:m.start()], text[m.end():]
        old, new = m.groups()
        try:
            if rename_identifier(snippet, old, new) == answer:
                return m.end(), [(m.end() + s, m.end() + e) for s, e in name_spans(answer, new)]
        except (tokenize.TokenError, SyntaxError):
            continue
    return None


def sample_snippet(source: str, rng: random.Random) -> str | None:
    """A dedented run of 10-40 whole lines that parses, preferably starting at a
    ``def``/``class``/decorator; None if no such run was found at the chosen start."""
    lines = _lines(source)
    if len(lines) < MIN_LINES:
        return None
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "class ", "async def ", "@"))]
    start = rng.choice(starts) if starts else rng.randrange(len(lines))
    for end in range(min(start + rng.randint(MIN_LINES, MAX_LINES), len(lines)), start + MIN_LINES - 1, -1):
        if not lines[end - 1].strip():
            continue
        snippet = textwrap.dedent("".join(lines[start:end]))
        if not snippet.endswith("\n"):
            snippet += "\n"
        try:
            ast.parse(snippet)
        except SyntaxError:
            continue
        return snippet
    return None


def _candidates(snippet: str) -> tuple[list[str], list[str]]:
    """(def/class names, other bound names: assignment targets, loop/with/except
    variables and parameters) that occur as NAME tokens at least twice."""
    toks = [t for t in tokenize.generate_tokens(io.StringIO(snippet).readline)
            if t.type not in (tokenize.COMMENT, tokenize.NL)]
    counts = Counter(t.string for t in toks if t.type == tokenize.NAME)
    defined, bound = set(), set()
    depth, in_params = 0, False
    for prev, tok, nxt in zip([None, *toks], toks, [*toks[1:], None]):
        p = prev.string if prev else ""
        if tok.string in ("(", "[", "{"):
            depth += 1
        elif tok.string in (")", "]", "}"):
            depth -= 1
            in_params = in_params and depth > 0
        if tok.type != tokenize.NAME:
            continue
        if p in ("def", "class"):
            defined.add(tok.string)
            in_params = p == "def"
        elif p in ("for", "as") or (in_params and depth == 1 and p in ("(", ",", "*", "**")):
            bound.add(tok.string)
        elif nxt is not None and nxt.string in ASSIGN_OPS and (prev is None or prev.type in (
                tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)):
            bound.add(tok.string)

    def usable(names: set[str]) -> list[str]:
        return sorted(n for n in names if counts[n] >= 2 and len(n) >= 2 and n not in RESERVED
                      and not (n.startswith("__") and n.endswith("__")))

    return usable(defined), usable(bound - defined)


def new_name(old: str, snippet: str, rng: random.Random) -> str | None:
    """A fresh identifier in the style of ``old`` (CapWords, UPPER_CASE or snake_case,
    same leading underscores) that does not occur anywhere in ``snippet``."""
    core = old.lstrip("_")
    prefix = old[: len(old) - len(core)]
    for _ in range(20):
        words = rng.sample(WORDS, rng.randint(1, 3))
        if core[:1].isupper() and not core.isupper():
            name = "".join(w.capitalize() for w in words)
        elif core.isupper():
            name = "_".join(words).upper()
        else:
            name = "_".join(words)
        name = prefix + name
        if name not in snippet and name not in RESERVED:
            return name
    return None


def make_edit(snippet: str, rng: random.Random) -> EditExample | None:
    """A rename example for ``snippet`` (which must end in a newline), or None if it has
    no suitable identifier or does not tokenize. Prefers def/class names (60 %)."""
    try:
        defined, bound = _candidates(snippet)
    except (tokenize.TokenError, SyntaxError):
        return None
    pool = defined if defined and (not bound or rng.random() < 0.6) else bound
    if not pool:
        return None
    old = rng.choice(pool)
    new = new_name(old, snippet, rng)
    if new is None:
        return None
    answer = rename_identifier(snippet, old, new)
    return EditExample(snippet, old, new, render_prompt(snippet, old, new), answer)


def edit_examples(sources: Sequence[str], rng: random.Random) -> Iterator[EditExample]:
    """An endless stream of edit examples cut from random files of ``sources``."""
    while True:
        snippet = sample_snippet(rng.choice(sources), rng)
        example = make_edit(snippet, rng) if snippet else None
        if example is not None:
            yield example
