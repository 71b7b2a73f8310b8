"""The corpus split is fixed and disjoint, and training never sees held-out files."""

import itertools
import random
import zlib

import numpy as np

from specjax import workloads
from specjax.edits import INSTRUCTION, edit_examples, render_prompt, rename_identifier
from train import corpus, data


def _stripped_lines(text: str) -> str:
    return "\n".join(line.strip() for line in text.split("\n"))


def test_split_is_deterministic_disjoint_and_documented():
    files = workloads.stdlib_files()
    train, heldout = workloads.split(files)
    assert (train, heldout) == workloads.split(workloads.stdlib_files())
    assert not set(train) & set(heldout)
    assert sorted(train + heldout) == files
    assert 0.02 < len(heldout) / len(files) < 0.10
    for path in heldout:
        assert zlib.crc32(workloads.relative_path(path).encode()) % 20 == 0
    for path in train:
        assert zlib.crc32(workloads.relative_path(path).encode()) % 20 != 0


def test_excludes_tests_site_packages_and_large_files():
    for path in workloads.stdlib_files():
        parts = path.relative_to(workloads.stdlib_root()).parts
        assert not {"test", "tests", "site-packages", "__pycache__"} & set(parts), path
        assert not any(p.startswith("test_") or p.endswith("_test") for p in parts), path
        assert path.stat().st_size <= workloads.MAX_FILE_BYTES


def test_training_documents_hold_no_heldout_text():
    train_files, heldout_files = corpus.split(corpus.stdlib_files())
    train_texts = corpus.read_sources(train_files)[0]
    # (Empty __init__.py files and the like are in both splits.)
    heldout_texts = set(corpus.read_sources(heldout_files)[0]) - set(train_texts)
    train_lines = _stripped_lines("\n".join(train_texts))

    docs = list(corpus.training_documents(seed=0))
    train_set = set(train_texts)
    whole = [d for d in docs if d in train_set]
    edits = [d for d in docs if d not in train_set]
    assert sorted(whole) == sorted(train_texts)  # every training file exactly once
    assert not heldout_texts & set(docs)
    edit_share = sum(map(len, edits)) / sum(map(len, docs))
    assert abs(edit_share - corpus.EDIT_SHARE) < 0.02

    for doc in edits:
        match = INSTRUCTION.search(doc)
        snippet, answer = doc[: match.start()], doc[match.end() :]
        old, new = match.groups()
        assert doc[: match.end()] == render_prompt(snippet, old, new)
        assert answer == rename_identifier(snippet, old, new)
        # The snippet is a run of lines of some training file (up to indentation).
        assert _stripped_lines(snippet.rstrip("\n")) in train_lines


def test_heldout_mixture_cuts_edits_from_heldout_files_only():
    train_files, heldout_files = corpus.split(corpus.stdlib_files())
    heldout_texts = corpus.read_sources(heldout_files)[0]
    assert list(corpus.heldout_documents()) == heldout_texts  # default: the files alone
    heldout_lines = _stripped_lines("\n".join(heldout_texts))

    docs = list(corpus.heldout_documents(seed=3, edit_share=0.5))
    edits = [d for d in docs if d not in set(heldout_texts)]
    assert sorted(d for d in docs if d in set(heldout_texts)) == sorted(heldout_texts)
    assert abs(sum(map(len, edits)) / sum(map(len, docs)) - 0.5) < 0.03
    for doc in edits:
        match = INSTRUCTION.search(doc)
        assert _stripped_lines(doc[: match.start()].rstrip("\n")) in heldout_lines


def test_copy_drills_repeat_their_span_and_keep_every_document():
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    eos = 0
    docs = [np.append(rng.integers(1, 500, size=int(rng.integers(5, 300))), eos) for _ in range(60)]
    tokens = np.concatenate(docs).astype(np.uint16)
    marks = np.concatenate([rng.integers(0, 3, d.size) for d in docs]).astype(np.uint8)
    doc_marks = dict(zip(map(tuple, docs), np.split(marks, np.cumsum([d.size for d in docs])[:-1])))
    mixed, mixed_marks, drill_tokens = data._with_drills(tokens, marks, eos, 0.3, seed=int(rng.integers(2**31)))
    cuts = np.flatnonzero(mixed == eos)[:-1] + 1
    pieces, piece_marks = np.split(mixed, cuts), np.split(mixed_marks, cuts)
    originals = [tuple(d) for d in docs]
    drills = [p for p in pieces if tuple(p) not in set(originals)]
    # Every document survives intact, once, with its marks; nothing else is added but drills.
    assert sorted(tuple(p) for p in pieces if tuple(p) in set(originals)) == sorted(originals)
    for p, m in zip(pieces, piece_marks):
        assert np.array_equal(m, doc_marks.get(tuple(p), np.full(p.size, data.PLAIN)))
    assert sum(d.size for d in drills) == drill_tokens == mixed.size - tokens.size
    assert abs(drill_tokens / mixed.size - 0.3) < 0.05
    for d in drills:
        span = d[:-1]
        half = span.size // 2
        assert d[-1] == eos and span.size % 2 == 0 and half >= 16
        assert np.array_equal(span[:half], span[half:]) and eos not in span


def test_drills_from_a_small_alphabet_repeat_spans_where_one_token_does_not_place_the_copy():
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    eos, alphabet = 0, int(rng.integers(3, 12))
    tokens = np.append(rng.integers(1, 4000, size=20_000), eos).astype(np.uint16)
    corpus_tokens = set(tokens.tolist())
    drills = data.repeat_drills(tokens, eos, 20_000, rng, alphabet=alphabet)
    assert sum(d.size for d in drills) >= 20_000
    for i, d in enumerate(drills):
        half = (d.size - 1) // 2
        assert d[-1] == eos and np.array_equal(d[:half], d[half:-1]) and eos not in d[:-1]
        if i % 2:  # drawn spans: at most `alphabet` distinct tokens, all from the corpus
            assert len(set(d[:half].tolist())) <= alphabet and set(d[:half].tolist()) <= corpus_tokens
        else:  # windows of the corpus, as without an alphabet
            window = d[:half]
            assert any(np.array_equal(tokens[s:s + half], window) for s in np.flatnonzero(tokens == window[0]))
    # Without an alphabet the drawn spans have (almost) no repeats: the alphabet is what adds them.
    plain = data.repeat_drills(tokens, eos, 20_000, rng)
    assert all(len(set(d[:(d.size - 1) // 2].tolist())) > alphabet for d in plain[1::2])


def test_marks_label_edit_replies_their_new_names_and_the_token_after_each():
    """Token extents come from decoding prefixes (not the tokenizer's offsets), the new
    name's places from a plain substring search (it is fresh: it occurs only where renamed)."""
    from tokenizers import Tokenizer

    from test_tokenizer import SHIPPED
    from train.tokenizer import EOS

    tok = Tokenizer.from_file(str(SHIPPED / "tokenizer.json"))
    seed = random.SystemRandom().randrange(2**32)
    source = (workloads.stdlib_root() / "argparse.py").read_text(encoding="utf-8")
    examples = [ex for ex in itertools.islice(edit_examples([source], random.Random(seed)), 12) if ex.text.isascii()]
    docs = [source[:3000]] + [ex.text for ex in examples]
    tokens, marks, stats = data.encode_documents(tok, docs, "test")
    assert marks.shape == tokens.shape and marks.dtype == np.uint8
    assert (stats["reply_tokens"], stats["renamed_tokens"]) == ((marks == 1).sum(), (marks == 2).sum())
    ends = np.flatnonzero(tokens == tok.token_to_id(EOS))
    assert len(ends) == len(docs) and not marks[: ends[0] + 1].any() and not marks[ends].any()
    for ex, start, end in zip(examples, ends[:-1] + 1, ends[1:]):
        ids = tokens[start:end].tolist()
        at = [len(tok.decode(ids[:i])) for i in range(len(ids) + 1)]
        spans = [(i, i + len(ex.new)) for i in range(len(ex.prompt), len(ex.text)) if ex.text.startswith(ex.new, i)]
        want = np.where(np.asarray(at[:-1]) >= len(ex.prompt), 1, 0)  # the reply: tokens starting in the answer
        for s, e in spans:
            want[[a < e and b > s for a, b in zip(at, at[1:])]] = 2
            after = [i for i, a in enumerate(at[:-1]) if a >= e]
            want[after[:1]] = 2
        assert spans and np.array_equal(marks[start:end], want), f"seed={seed} {ex.old}->{ex.new}"
