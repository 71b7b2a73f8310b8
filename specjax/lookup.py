"""Prompt lookup on the device: the n-gram search (`find`), its tree form (`tree`), and
the acceptance model the engine's chooser uses for every proposer.

The acceptance model: a proposer's drafts in one class (for prompt lookup, the n-gram
length m matched; the draft model is one class) are accepted at two rates, q that the
first draft is, and r that a later draft is given the ones before it were (each decayed
accepted / judged, shrunk to a prior). Two rates because copying is bursty: a lookup often
starts at the wrong occurrence, but once its first draft holds the copy tends to run on
(edit prompts on tiny-code: first draft 0.66, later ones 0.85-1.0), and one pooled rate
sees ~0.8 and drafts too few. Every lookup is scored, drafted or not (a plain step still
judges the first draft against the token it commits), so a weak match that stops paying is
skipped and one that starts paying is taken again; r's prior is optimistic so wide drafts
get tried.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


MAX_NGRAM = 32  # find() unrolls one comparison per n: compile time grows with it


def find(history: jax.Array, size: jax.Array, k: int, max_ngram: int, min_ngram: int
         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Prompt lookup on the device: the k tokens after the latest earlier occurrence of
    the longest suffix of history[:size] (max_ngram .. min_ngram tokens).

    history must hold at least size + k entries. Returns (drafts [k], real drafts, n matched).
    """
    score = _scores(history, size, max_ngram, min_ngram)
    end = jnp.argmax(score)
    best = score[end]
    found = best >= 0
    drafts = jax.lax.dynamic_slice(history, (end + 1,), (k,))
    n = jnp.where(found, jnp.minimum(k, size - 1 - end), 0)
    return drafts, n, jnp.where(found, best // history.shape[0], 0)


def _scores(history: jax.Array, size: jax.Array, max_ngram: int, min_ngram: int) -> jax.Array:
    """[H] for each i, the length m of the suffix of history[:size] that ends at i too (at
    most max_ngram), scored m * H + i (longest, then latest), or -1 below min_ngram or
    without a continuation at i + 1 < size."""
    at = jnp.arange(history.shape[0])
    run = at < size - 1
    matched = jnp.zeros_like(at)
    for back in range(max_ngram):
        shifted = jnp.roll(history, back)  # shifted[i] = history[i - back]
        run = run & (at >= back) & (shifted == history[size - 1 - back]) & (size - 1 - back >= 0)
        matched = matched + run
    return jnp.where(matched >= min_ngram, matched * history.shape[0] + at, -1)


TREE_MATCHES = 4  # earlier occurrences a lookup tree merges


def matches(history: jax.Array, size: jax.Array, max_ngram: int, min_ngram: int) -> tuple[jax.Array, jax.Array]:
    """The TREE_MATCHES best earlier occurrences of the suffix of history[:size] (longest,
    then latest; `find` drafts the first): (scores [M], -1 where there is none; the
    indices where they end [M])."""
    return top_k_ints(_scores(history, size, max_ngram, min_ngram), TREE_MATCHES)


def tree(history: jax.Array, size: jax.Array, k: int, best: jax.Array, ends: jax.Array, nodes: int) -> dict:
    """Prompt lookup as a tree: the continuations (k tokens each) of the row's best earlier
    occurrences of its suffix (`matches`: scores `best`, ending at `ends`), merged into
    a trie, and its `nodes` best nodes ranked by the continuations through each node: those
    of the longest match first (a longer match outweighs all shorter ones together), then
    how many of the next length, and so on; then the better occurrence, then the shallower
    node. So each node ranks below its parent and any first n of the ranking is a tree
    (`trees.arrange` lays it out). Counting every occurrence alike let three short
    matches that agree outvote the longest one, which `find` drafts: on tiny-code's edit
    prompts (teacher-forced, 8 nodes) 4.72 tokens per round against the chain's 5.21;
    5.27 with these weights. Where all continuations agree the tree is the chain `find`
    drafts; where they part, it branches (SGLang's n-gram tree is the model: github.com/sgl-project/sglang,
    python/sglang/srt/speculative/ngram_worker.py).

    Returns {"token", "parent" (trie index), "trie", "depth", "main" (on the best
    continuation), "valid"} each [nodes]; the trie has `capacity(k)` entries. history must
    hold size + k entries; nodes <= capacity(k) - 1."""
    m = best.shape[0]
    lengths = jnp.where(best >= 0, jnp.minimum(k, size - 1 - ends), 0)
    # each continuation's weight: m ** (m - 1 - level), level the distinct match lengths above
    # its own (the matches come longest first), so one of a longer match outweighs m - 1 others
    matched = best // history.shape[0]  # n-gram lengths, non-increasing
    level = jnp.cumsum(jnp.concatenate([jnp.zeros(1, jnp.int32), (matched[1:] < matched[:-1]).astype(jnp.int32)]))
    weight = m ** (m - 1 - level)
    seqs = jax.vmap(lambda e: jax.lax.dynamic_slice(history, (e + 1,), (k,)))(ends)
    # the trie without a loop: continuation s's first d + 1 tokens are one node with every
    # continuation s' that shares them; the first such continuation creates it (node id
    # 1 + s * k + d), and the summed weight of the continuations through it is its count
    d = jnp.arange(k)
    real = d[None, :] < lengths[:, None]  # [M, k]
    same = (seqs[:, None, :] == seqs[None, :, :]) & real[:, None, :] & real[None, :, :]  # [M, M, k]
    shared = jnp.cumprod(same.astype(jnp.int32), axis=2) > 0  # same first d + 1 tokens
    first = jnp.argmax(shared, axis=1).astype(jnp.int32)  # [M, k]: the continuation that creates the node
    s = jnp.arange(m)[:, None]
    creates = real & (first == s)
    count = jnp.sum(shared * weight[None, :, None], axis=1)  # the weight of the continuations through it
    parent = jnp.where(d[None, :] == 0, 0, 1 + jnp.roll(first, 1, axis=1) * k + d[None, :] - 1)
    key = jnp.where(creates, (count * m + (m - 1 - s)) * (k + 1) + (k - 1 - d[None, :]), -1).reshape(-1)
    ranked_key, flat = top_k_ints(key, nodes)
    return {"token": seqs.reshape(-1)[flat], "parent": parent.reshape(-1)[flat].astype(jnp.int32),
            "trie": (flat + 1).astype(jnp.int32), "depth": flat % k + 1, "main": flat // k == 0,
            "valid": ranked_key >= 0}


PAIRWISE_TOP_K = 128  # rows up to this long rank their entries by all pairwise comparisons


def top_k_ints(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` of integers along the last axis (the k largest, ties by the lower
    index; k at most the row's length). XLA:CPU sorts a whole row for an integer top-k
    (about 100 us for one row of 1152 lookup scores). A short row (PAIRWISE_TOP_K entries
    at most, a lookup tree's candidates) ranks every entry at once by comparing it with
    every other, one fused pass: for 15 of 60 entries 7.5 us a call against 50 us for 15
    dependent rounds of argmax. A long row takes k rounds of argmax (4 us for four of 1152
    scores); every value of x must then be above the dtype's minimum (a taken entry is
    set to it)."""
    n = x.shape[-1]
    at = jnp.arange(n)
    if n <= PAIRWISE_TOP_K:
        xi, xj = x[..., :, None], x[..., None, :]
        rank = jnp.sum((xj > xi) | ((xj == xi) & (at[None, :] < at[:, None])), axis=-1)  # a permutation of 0 .. n-1
        idx = jnp.argmax(rank[..., None, :] == jnp.arange(k)[:, None], axis=-1).astype(jnp.int32)  # [..., k]
        return jnp.take_along_axis(x, idx, axis=-1), idx
    low = jnp.iinfo(x.dtype).min
    values, indices = [], []
    for _ in range(k):
        i = jnp.argmax(x, axis=-1)
        values.append(jnp.take_along_axis(x, i[..., None], axis=-1)[..., 0])
        indices.append(i.astype(jnp.int32))
        x = jnp.where(at == i[..., None], low, x)
    return jnp.stack(values, axis=-1), jnp.stack(indices, axis=-1)


def capacity(k: int) -> int:
    """Entries of a lookup trie of k-token continuations: the root and one per token."""
    return TREE_MATCHES * k + 1


def expected_tokens(q: jax.Array, r: jax.Array, n: jax.Array) -> jax.Array:
    """1 + q (1 + r + .. + r^(n-1)): committed tokens of a step with n drafts, the first
    accepted at rate q and each later one, given those before it, at rate r."""
    run = jnp.where(r < 1.0, (1.0 - r ** n) / (1.0 - jnp.minimum(r, 1.0 - 1e-6)), n)
    return 1.0 + q * run


# Prior acceptance, after any match, of the first draft and of a later one given the
# earlier (optimistic, so a match whose first draft pays gets drafted wide and r measured);
# each prior is worth PSEUDO judged drafts.
PRIOR_ACCEPT = np.array([0.5, 0.8], np.float32)
PSEUDO = 2.0
ACCEPT_DECAY = 0.95  # weight of the past per scored lookup (~20 lookups)
