"""Rename edits change every NAME token equal to the old name, and nothing else."""

import io
import itertools
import keyword
import random
import tokenize

import pytest

from specjax import workloads
from specjax.edits import edit_examples, edit_reply, make_edit, rename_identifier, render_prompt

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
    source = (workloads.stdlib_root() / module).read_text(encoding="utf-8")
    for ex in itertools.islice(edit_examples([source], random.Random(seed)), 25):
        context = f"seed={seed} {ex.old}->{ex.new}"
        assert ex.prompt == render_prompt(ex.snippet, ex.old, ex.new), context
        assert ex.prompt.endswith(f"# Rename `{ex.old}` to `{ex.new}`.\n"), context
        assert ex.text == ex.prompt + ex.answer
        assert ex.new not in ex.snippet and ex.new.isidentifier() and not keyword.iskeyword(ex.new), context
        assert sum(t.string == ex.old for t in _tokens(ex.snippet)) >= 2, context
        assert 10 <= ex.snippet.count("\n") <= 40, context
        assert_only_name_changed(ex.snippet, ex.answer, ex.old, ex.new)


@pytest.mark.parametrize("module", MODULES[:3])
def test_edit_reply_finds_the_answer_and_its_new_names(module):
    """Putting the old name back at the spans gives the snippet; any other text is no edit."""
    seed = random.SystemRandom().randrange(2**32)
    source = (workloads.stdlib_root() / module).read_text(encoding="utf-8")
    assert edit_reply(source) is None
    for ex in itertools.islice(edit_examples([source], random.Random(seed)), 10):
        start, spans = edit_reply(ex.text)
        assert start == len(ex.prompt)
        assert len(spans) == sum(t.type == tokenize.NAME and t.string == ex.old for t in _tokens(ex.snippet))
        assert spans[0][0] >= start and all(ex.text[s:e] == ex.new for s, e in spans)
        pieces, pos = [], len(ex.prompt)
        for s, e in spans:
            pieces += [ex.text[pos:s], ex.old]
            pos = e
        assert "".join(pieces) + ex.text[pos:] == ex.snippet, f"seed={seed}"
        assert edit_reply(ex.prompt + ex.answer.replace(ex.new, ex.new + "x", 1)) is None  # not the rename
        assert edit_reply(ex.prompt) is None  # no answer


def test_edit_reply_skips_instruction_like_lines_inside_the_snippet():
    snippet = ('def spam(x):\n    """Usage:\n# Rename `a` to `b`.\n    """\n    return spam(x)\n\n\n'
               "spam(1)\n# Rename `c` to `d`.\n")
    ex = make_edit(snippet, random.Random(0))
    assert ex is not None and ex.old == "spam"
    start, spans = edit_reply(ex.text)
    assert start == len(ex.prompt) and [ex.text[s:e] for s, e in spans] == [ex.new] * 3


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


def test_line_match_counts_lines_in_place_and_text_similarity():
    from train.evaluate import line_match

    want = "class Spam:\n    x = 1\n    y = 2\n"
    assert line_match(want, want) == (1.0, 1.0)
    assert line_match(want + "extra = 3\n", want) == (1.0, 1.0)  # lines past the snippet are not judged
    share, ratio = line_match("class Spam:\n    x = 9\n    y = 2\n", want)
    assert share == 2 / 3 and 0.9 < ratio < 1.0
    share, ratio = line_match("    x = 1\n    y = 2\n", want)  # the first line lost: nothing in place
    assert share == 0.0 and 0.6 < ratio < 0.9
    assert line_match("", want) == (0.0, 0.0)


def test_teacher_forced_hits_match_transformers_and_split_on_the_new_name():
    """Hits re-derived with transformers' forward, the new-name tokens found by decoding
    prefixes of the reply (not from the tokenizer's offsets)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    import specjax
    from train.evaluate import teacher_forced_hits
    from specjax.workloads import Prompt

    from test_tokenizer import SHIPPED as folder

    model = specjax.load(folder)
    tok = model.tokenizer
    snippet = "def spam(x):\n    return spam(x - 1) + spammy\n\n\nprint(spam(3))\n"
    answer = rename_identifier(snippet, "spam", "eggs_value")
    ids = [tok.eos_token_id] + tok(render_prompt(snippet, "spam", "eggs_value"))["input_ids"]
    got = teacher_forced_hits(model, Prompt("edit", ids, "", answer))

    reply = tok(answer)["input_ids"]
    ref = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = ref(torch.tensor([ids + reply])).logits[0, len(ids) - 1:-1]
    hits = logits.argmax(-1).numpy() == np.asarray(reply)
    starts = [len(tok.decode(reply[:i])) for i in range(len(reply) + 1)]
    spans = [(i, i + len("eggs_value")) for i in range(len(answer)) if answer.startswith("eggs_value", i)]
    is_new = np.array([any(a < e and b > s for s, e in spans) for a, b in zip(starts, starts[1:])])
    assert is_new.sum() >= 3  # the three renamed occurrences, `spammy` untouched
    assert got["rename"] == (int(hits[is_new].sum()), int(is_new.sum()))
    assert got["copy"] == (int(hits[~is_new].sum()), int((~is_new).sum()))
    firsts = [next(i for i, (a, b) in enumerate(zip(starts, starts[1:])) if a < e and b > s) for s, e in spans]
    assert len(firsts) == 3 and got["first"] == (int(hits[firsts].sum()), 3)
