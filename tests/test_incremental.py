"""Chunked prefill, decode and verify through the paged cache equal one full forward."""

import jax.numpy as jnp
import numpy as np
import pytest

from specjax import kv as kvlib
from specjax import qwen3
from conftest import hidden_states


@pytest.fixture(scope="module")
def model(calm):
    return calm[1]


def _forward(params, cfg, tokens, positions, cache=None):
    """Logits [B, T, V] and the cache of one compiled step (`conftest.hidden_states`)."""
    h, cache, _ = hidden_states(params, cfg, tokens, positions, cache)
    return qwen3.unembed(params, cfg, h), cache


def _step(model, cache, tokens, n_valid=None):
    """Feed tokens at the cache's length; commit n_valid of them (default all)."""
    start = int(cache.lengths[0])
    pos = start + np.arange(len(tokens))
    logits, cache = _forward(model.params, model.config, jnp.asarray(tokens)[None], pos[None], cache)
    n = len(tokens) if n_valid is None else n_valid
    return np.asarray(logits[0]), cache.replace(lengths=cache.lengths + n)


def _full(model, ids):
    logits, _ = _forward(model.params, model.config, jnp.asarray(ids)[None], np.arange(len(ids))[None])
    return np.asarray(logits[0])


def test_chunked_prefill_decode_verify_equal_full_forward(model, rng):
    ids = rng.integers(0, model.config.vocab_size, 40)
    full = _full(model, ids)
    cache = kvlib.init(model.config, 1, 64, page_size=8)
    got = []
    # a padded chunk: 13 real tokens in a 16-wide call; the padding is written, never committed
    padded = np.concatenate([ids[:13], rng.integers(0, model.config.vocab_size, 3)])
    logits, cache = _step(model, cache, padded, n_valid=13)
    got.append(logits[:13])
    for a, b in [(13, 29), (29, 30), (30, 31), (31, 40)]:  # chunk, decode, decode, verify T=9
        logits, cache = _step(model, cache, ids[a:b])
        got.append(logits)
    assert int(cache.lengths[0]) == 40
    assert np.abs(np.concatenate(got) - full).max() <= 1e-5


def test_truncate_then_decode_equals_fresh(model, rng):
    v = model.config.vocab_size
    ids = rng.integers(0, v, 20)
    cache = kvlib.init(model.config, 1, 64, page_size=16)
    _, cache = _step(model, cache, ids)
    _, cache = _step(model, cache, rng.integers(0, v, 6))  # a verify whose drafts get rejected
    cache = kvlib.truncate(cache, jnp.array([22]))  # keep 2 of the 6
    kept = np.asarray(cache.lengths)[0]
    assert kept == 22
    # recompute what the kept two were, then continue with fresh tokens
    committed = np.concatenate([ids, np.zeros(2, int)])
    fresh_cache = kvlib.init(model.config, 1, 64, page_size=16)
    _, fresh_cache = _step(model, fresh_cache, ids)
    _, cache = _step(model, kvlib.truncate(cache, jnp.array([20])), np.zeros(2, int))
    _, fresh_cache = _step(model, fresh_cache, np.zeros(2, int))
    nxt = rng.integers(0, v, 5)
    got, _ = _step(model, cache, nxt)
    want = _full(model, np.concatenate([committed, nxt]))[22:]
    assert np.abs(got - want).max() <= 1e-5


def test_shuffled_pages_two_rows_equal_dense(model, rng):
    """Two rows sharing one pool through a shuffled page table, at different lengths."""
    v, cap, z = model.config.vocab_size, 64, 8
    cache = kvlib.init(model.config, 2, cap, page_size=z)
    perm = rng.permutation(2 * cap // z).astype(np.int32).reshape(2, cap // z)
    cache = cache.replace(page_table=jnp.asarray(perm))
    seqs = [rng.integers(0, v, 30), rng.integers(0, v, 30)]
    starts = [0, 0]
    got = [[], []]
    for n0, n1 in [(9, 13), (6, 1), (7, 8), (8, 8)]:  # per-row chunk sizes, one call per pair (T = max)
        t = max(n0, n1)
        toks = np.zeros((2, t), np.int64)
        pos = np.zeros((2, t), np.int64)
        for r, n in enumerate((n0, n1)):
            toks[r, :n] = seqs[r][starts[r]:starts[r] + n]
            pos[r] = starts[r] + np.arange(t)
        logits, cache = _forward(model.params, model.config, jnp.asarray(toks), jnp.asarray(pos), cache)
        for r, n in enumerate((n0, n1)):
            got[r].append(np.asarray(logits[r, :n]))
            starts[r] += n
    for r in range(2):
        want = _full(model, seqs[r][:starts[r]])
        assert np.abs(np.concatenate(got[r]) - want).max() <= 1e-5


def test_stacked_and_unstacked_layouts_agree(model, rng):
    """The training layout (scan over stacked layers) and the inference layout (a loop over
    per-layer trees) give the same logits, cache contents and taps; stack inverts unstack."""
    from conftest import assert_trees_equal
    from specjax import checkpoint, cpu_kernels

    stacked = checkpoint.stack(model.params)
    assert not isinstance(stacked[checkpoint.LAYERS], tuple)
    assert_trees_equal(checkpoint.unstack(stacked), cpu_kernels.unpack_tree(model.params))
    ids = rng.integers(0, model.config.vocab_size, 21)
    taps = (0, model.config.num_hidden_layers - 1)
    outs = []
    for params in (stacked, model.params):
        cache = kvlib.init(model.config, 1, 64)
        logits, cache, tapped = qwen3.forward(params, model.config, jnp.asarray(ids)[None],
                                              np.arange(len(ids))[None], cache, taps)
        outs.append((np.asarray(logits), np.asarray(cache.k), np.asarray(cache.v), np.asarray(tapped)))
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
