"""Rename edits change every NAME token equal to the old name, and nothing else."""

import io
import itertools
import keyword
import random
import tokenize

import pytest

from train import corpus
from train.edits import edit_examples, make_edit, rename_identifier, render_prompt

MODULES = ("argparse.py", "json/decoder.py", "textwrap.py", "email/message.py", "asyncio/tasks.py")


def _tokens(source: str) -> list[tokenize.TokenInfo]:
    return list(tokenize.generate_tokens(io.StringIO(source).readline))


def assert_only_name_changed(before: str, after: str, old: str, new: str) -> None:
    """Token streams agree except NAME tokens ``old`` -> ``new``; and since ``new`` is
    fresh, renaming back restores ``before`` byte for byte."""
    a, b = _tokens(before), _tokens(after)
    assert [t.type for t in a] == [t.type for t in b]
    for ta, tb in zip(a, b):
        expected = new if ta.type == tokenize.NAME and ta.string == old else ta.string
        assert tb.string == expected, (ta, tb)
    assert rename_identifier(after, new, old) == before


def test_rename_touches_names_only():
    source = (
        "class Foo(Base):\n"
        "    # Foo is renamed; this comment is not.\n"
        "    name = 'Foo'\n"
        "    def make(self, Foo_x):\n"
        '        """Return a Foo."""\n'
        "        return Foo(Foo_x) + mod.Foo + self.Foo\n"
    )
    expected = source.replace("class Foo(", "class Bar(").replace(
        "return Foo(Foo_x) + mod.Foo + self.Foo", "return Bar(Foo_x) + mod.Bar + self.Bar")
    assert rename_identifier(source, "Foo", "Bar") == expected
    assert_only_name_changed(source, expected, "Foo", "Bar")


@pytest.mark.parametrize("module", MODULES)
def test_edits_of_real_snippets(module):
    seed = random.SystemRandom().randrange(2**32)
    source = (corpus.stdlib_root() / module).read_text(encoding="utf-8")
    for ex in itertools.islice(edit_examples([source], random.Random(seed)), 25):
        context = f"seed={seed} {ex.old}->{ex.new}"
        assert ex.prompt == render_prompt(ex.snippet, ex.old, ex.new), context
        assert ex.prompt.endswith(f"# Rename `{ex.old}` to `{ex.new}`.\n"), context
        assert ex.text == ex.prompt + ex.answer
        assert ex.new not in ex.snippet and ex.new.isidentifier() and not keyword.iskeyword(ex.new), context
        assert sum(t.string == ex.old for t in _tokens(ex.snippet)) >= 2, context
        assert 10 <= ex.snippet.count("\n") <= 40, context
        assert_only_name_changed(ex.snippet, ex.answer, ex.old, ex.new)


def test_new_name_follows_old_style_and_no_candidates_gives_none():
    snippet = "class Parser:\n    pass\n\n\np = Parser()\nq = Parser()\n"
    ex = make_edit(snippet, random.Random(0))
    assert ex.old == "Parser" and ex.new[0].isupper() and "_" not in ex.new
    assert make_edit("x = 1\nprint(len([]))\n", random.Random(0)) is None


def test_prefix_fraction_counts_up_to_the_first_mistake():
    from train.evaluate import prefix_fraction

    assert prefix_fraction("def spam(x):", "def spam(x):") == 1.0
    assert prefix_fraction("def spam(y):", "def spam(x):") == 9 / 12
    assert prefix_fraction("def sp", "def spam(x):") == 6 / 12  # stopped early
    assert prefix_fraction("def spam(x): pass", "def spam(x):") == 1.0  # more after it
    assert prefix_fraction("", "abc") == 0.0
