"""Draft trees: the lookup trie, the layout, the walk, the ancestor mask and compaction,
each against a brute-force reference (a Python trie, explicit path following, a forward
over each node's own path, a fresh forward over the committed tokens)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import cpu_kernels, drafters, kv as kvlib, lookup, trees
from specjax.qwen3 import unembed
from conftest import hidden_states


def _random_parents(rng, w: int) -> np.ndarray:
    return np.array([-1] + [int(rng.integers(0, i)) for i in range(1, w)], np.int32)


def _path_to(parents: np.ndarray, i: int) -> list[int]:
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


def test_ancestor_bits_and_depths_follow_the_parents(rng):
    # random trees are shallow; the chain is as deep as 16 nodes go
    parents = np.stack([_random_parents(rng, 16) for _ in range(3)] + [np.arange(16, dtype=np.int32) - 1])
    bits = np.asarray(trees.ancestor_bits(jnp.asarray(parents))).view(np.uint32)
    depth = np.asarray(trees.depths(jnp.asarray(parents)))
    for r in range(4):
        for i in range(16):
            path = _path_to(parents[r], i)
            assert bits[r, i] == sum(1 << j for j in path)
            assert depth[r, i] == len(path) - 1


def _walk_reference(tokens, parents, n, target):
    cur, path = 0, [0]
    while True:
        kids = [c for c in range(1, n + 1) if parents[c] == cur and tokens[c] == target[cur]]
        assert len(kids) <= 1
        if not kids:
            return path
        cur = kids[0]
        path.append(cur)


@pytest.mark.parametrize("shape", ["chain", "star", "deep", "ragged"])
def test_walk_follows_the_target_token_from_the_root(rng, shape):
    w, rows = 12, 6
    tokens, parents, ns, targets = [], [], [], []
    for _ in range(rows):
        par = {"chain": np.arange(w) - 1, "star": np.array([-1] + [0] * (w - 1)),
               "deep": np.array([-1, 0, 1, 2, 3, 4, 5, 6, 0, 8, 9, 10]),
               "ragged": _random_parents(rng, w)}[shape].astype(np.int32)
        tok = np.zeros(w, np.int32)
        for i in range(1, w):  # siblings distinct, mostly small tokens so paths often match
            taken = {tok[j] for j in range(1, i) if par[j] == par[i]}
            free = [t for t in range(w) if t not in taken]
            tok[i] = rng.choice(free[:3])
        n = int(rng.integers(0, w))
        target = rng.integers(0, 3, w).astype(np.int32)
        tokens.append(tok), parents.append(par), ns.append(n), targets.append(target)
    path, accepted = trees.walk(jnp.asarray(np.stack(tokens)), jnp.asarray(np.stack(parents)),
                                jnp.asarray(ns, jnp.int32), jnp.asarray(np.stack(targets)))
    for r in range(rows):
        want = _walk_reference(tokens[r], parents[r], ns[r], targets[r])
        assert int(accepted[r]) == len(want) - 1
        assert list(np.asarray(path[r, :len(want)])) == want
        assert list(np.asarray(path[r, len(want):])) == list(range(len(want), w))  # padded with the ids


def test_held_depths_are_the_longest_drafted_prefix_of_the_committed_tokens(rng):
    """`rounds._held` / `_tree_held`: the deepest chain prefix / tree path whose tokens
    are a prefix of the committed tokens out[:count], by enumerating every node's path."""
    from specjax.rounds import _held, _tree_held

    rows, w = 256, 10
    parents = np.stack([_random_parents(rng, w + 1) for _ in range(rows)])
    tokens = np.zeros((rows, w + 1), np.int32)
    for r in range(rows):  # siblings distinct, from a small alphabet so paths often match
        for i in range(1, w + 1):
            taken = {tokens[r, j] for j in range(1, i) if parents[r, j] == parents[r, i]}
            tokens[r, i] = rng.choice([t for t in range(3) if t not in taken] or [9 + i])
    out = rng.integers(0, 3, (rows, 16)).astype(np.int32)
    count = rng.integers(1, 8, rows).astype(np.int32)
    n = rng.integers(0, w + 1, rows).astype(np.int32)
    chain = rng.integers(0, 2, (rows, w)).astype(np.int32)
    got_tree = np.asarray(_tree_held(jnp.asarray(tokens[:, 1:]), jnp.asarray(parents), jnp.asarray(n),
                                     jnp.asarray(out), jnp.asarray(count)))
    got_chain = np.asarray(_held(jnp.asarray(chain), jnp.asarray(n), jnp.asarray(out), jnp.asarray(count)))
    for r in range(rows):
        known = list(out[r, :count[r]])
        deepest = 0
        for i in range(1, n[r] + 1):
            path = [int(tokens[r, j]) for j in _path_to(parents[r], i)[1:]]
            if path == known[:len(path)]:
                deepest = max(deepest, len(path))
        assert got_tree[r] == deepest
        held = next((j for j in range(n[r]) if j >= count[r] or chain[r, j] != out[r, j]), n[r])
        assert got_chain[r] == held


def _trie_reference(history: np.ndarray, size: int, k: int, max_ngram: int, min_ngram: int):
    """The lookup trie by brute force: {token path tuple: (its continuations' match lengths,
    first sequence, depth)}."""
    scored = []
    for end in range(size - 1):
        m = 0
        while m < max_ngram and end - m >= 0 and history[end - m] == history[size - 1 - m]:
            m += 1
        if m >= min_ngram:
            scored.append((m, end))
    scored.sort(reverse=True)
    nodes: dict[tuple, list] = {}
    for s, (m, end) in enumerate(scored[:lookup.TREE_MATCHES]):
        cont = [int(t) for t in history[end + 1:min(end + 1 + k, size)]]
        for d in range(1, len(cont) + 1):
            key = tuple(cont[:d])
            if key in nodes:
                nodes[key][0].append(m)
            else:
                nodes[key] = [[m], s, d]
    return nodes


def _trie_rank(node: list) -> tuple:
    """A trie node's place, best first: per match length, longest first, more continuations
    through it of that length; then the earlier sequence; then the shallower node."""
    lengths, first, depth = node
    return tuple(-lengths.count(m) for m in range(lookup.MAX_NGRAM, 0, -1)) + (first, depth)


def test_lookup_tree_is_the_trie_of_the_best_continuations(rng):
    """Histories with a few recurring phrases that continue differently; the first n nodes
    of the ranking, laid out, are the n best trie nodes (the most continuations of the longest
    match through them, then of the next length, then the better occurrence, then shallower),
    as a tree with distinct siblings: the first continuation as a chain, then the other nodes
    breadth first."""
    k, max_ngram, n_nodes = 6, 3, 10
    for _ in range(30):
        phrases = [rng.integers(0, 5, int(rng.integers(2, 6))) for _ in range(3)]
        seq = np.concatenate([phrases[int(rng.integers(0, 3))] for _ in range(int(rng.integers(3, 9)))])
        size = len(seq)
        history = np.zeros(size + k + 4, np.int32)
        history[:size] = seq
        ranked = jax.jit(lambda h, s: lookup.tree(h, s, k, *lookup.matches(h, s, max_ngram, 1), n_nodes))(
            jnp.asarray(history), size)
        ref = _trie_reference(history, size, k, max_ngram, 1)
        order = sorted(ref, key=lambda p: _trie_rank(ref[p]))
        for n in (1, 4, n_nodes):
            batch = jax.tree.map(lambda x: x[None], ranked)
            drafts, parents, main, got_n = trees.arrange(batch, jnp.asarray([n]), lookup.capacity(k))
            drafts, parents, got_n = np.asarray(drafts[0]), np.asarray(parents[0]), int(got_n[0])
            want = set(order[:n])
            assert got_n == len(want)
            tokens = np.concatenate([[-1], drafts])
            got = set()
            for i in range(1, got_n + 1):
                assert 0 <= parents[i] < i
                path = _path_to(parents, i)
                got.add(tuple(int(tokens[j]) for j in path[1:]))
            assert got == want
            on = np.asarray(main[0, 1:got_n + 1])  # the first continuation leads, as a plain chain
            m = int(on.sum())
            assert on[:m].all() and list(parents[1:m + 1]) == list(range(m))
            depth = [len(_path_to(parents, i)) for i in range(m + 1, got_n + 1)]
            assert depth == sorted(depth)  # the rest breadth first
            for i in range(1, got_n + 1):
                siblings = [tokens[j] for j in range(1, got_n + 1) if parents[j] == parents[i]]
                assert len(siblings) == len(set(siblings))
            on_main = {p for p in want if ref[p][1] == 0}
            assert {tuple(int(tokens[j]) for j in _path_to(parents, i)[1:]) for i in range(1, got_n + 1)
                    if main[0, i]} == on_main


def _prefilled(model, prompt: np.ndarray, capacity: int = 64):
    cfg = model.config
    kv = kvlib.init(cfg, 1, capacity, page_size=8)
    kv = kv.replace(page_table=jnp.asarray(np.random.default_rng(0).permutation(kv.page_table.shape[1])[None],
                                           jnp.int32))
    _, kv, _ = hidden_states(model.params, cfg, jnp.asarray(prompt[None]), jnp.arange(len(prompt))[None], kv)
    return kv.replace(lengths=jnp.asarray([len(prompt)], jnp.int32))


def _tree_step(model, kv, tokens: np.ndarray, parents: np.ndarray):
    """One tree step over nodes `tokens` (node 0 the root): logits [W, V] and the cache."""
    start = kv.lengths
    par = jnp.asarray(parents[None])
    depth = trees.depths(par)
    h, kv, _ = hidden_states(model.params, model.config, jnp.asarray(tokens[None]), start[:, None] + depth, kv,
                             sees=start[:, None] + jnp.arange(len(tokens)), ancestors=trees.ancestor_bits(par))
    return np.asarray(unembed(model.params, model.config, h))[0], kv


def _forward(model, ids: np.ndarray) -> np.ndarray:
    """Logits of a plain forward (cache-paged as the engine runs it) over ids: [len, V]."""
    kv = kvlib.init(model.config, 1, 64, page_size=8)
    h, _, _ = hidden_states(model.params, model.config, jnp.asarray(ids[None]), jnp.arange(len(ids))[None], kv)
    return np.asarray(unembed(model.params, model.config, h))[0]


def test_each_node_sees_its_own_path_only(tiny, rng):
    """A node's logits equal those of a forward over the committed tokens and its path
    (bitwise with the CPU kernels, whose results do not depend on the step's other rows)."""
    _, _, model = tiny
    v = model.config.vocab_size
    prompt = rng.integers(0, v, 13).astype(np.int32)
    parents = np.array([-1, 0, 0, 1, 1, 2, 3, 0, 5, 8], np.int32)
    tokens = rng.integers(0, v, len(parents)).astype(np.int32)
    logits, _ = _tree_step(model, _prefilled(model, prompt), tokens, parents)
    for i in range(len(parents)):
        path = _path_to(parents, i)
        alone = _tree_step(model, _prefilled(model, prompt), tokens[path], np.arange(len(path), dtype=np.int32) - 1)[0]
        if cpu_kernels.available():
            np.testing.assert_array_equal(logits[i], alone[-1])
        np.testing.assert_allclose(logits[i], _forward(model, np.concatenate([prompt, tokens[path]]))[-1],
                                   rtol=1e-4, atol=1e-4)


def test_after_compaction_the_next_step_sees_a_plain_prefix(tiny, rng):
    """Accept a path through a non-first branch, compact, and step again: the next logits
    equal a fresh forward over the committed tokens."""
    _, _, model = tiny
    v = model.config.vocab_size
    prompt = rng.integers(0, v, 11).astype(np.int32)
    parents = np.array([-1, 0, 0, 1, 2, 2, 4, 5, 6], np.int32)
    tokens = rng.integers(0, v, len(parents)).astype(np.int32)
    kv = _prefilled(model, prompt)
    _, kv = _tree_step(model, kv, tokens, parents)
    path = np.array(_path_to(parents, 8), np.int32)  # 0 -> 2 -> 4 -> 6 -> 8
    padded = np.concatenate([path, np.arange(len(path), len(parents))]).astype(np.int32)
    k_pool, v_pool = trees.compact(kv.k, kv.v, kv.page_table, kv.page_size, kv.lengths, jnp.asarray(padded[None]),
                                   lambda *a: kvlib.write_layer(*a, kv.page_size))
    kv = kv.replace(k=k_pool, v=v_pool, lengths=kv.lengths + len(path))
    nxt = np.int32(rng.integers(0, v))
    logits, _ = _tree_step(model, kv, np.array([nxt]), np.array([-1], np.int32))
    want = _forward(model, np.concatenate([prompt, tokens[path], [nxt]]))[-1]
    np.testing.assert_allclose(logits[0], want, rtol=1e-4, atol=1e-4)


def test_dflash_tree_is_the_best_scored_set_of_prefixes(rng):
    """DDTree's selection by brute force: every prefix of choices among each block row's top
    two tokens that takes a second token at most TREE_DETOURS times, scored by summed
    log-softmax; the first n ranked nodes are the n best."""
    k, v, nodes = 5, 9, 12
    logits = rng.standard_normal((2, k, v)).astype(np.float32) * 2
    ranked = jax.jit(lambda x: drafters.block_tree(x, None, nodes))(jnp.asarray(logits))
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    for r in range(2):
        top = np.argsort(-lp[r], axis=1)[:, :drafters.TREE_BRANCH]
        prefixes = {}
        frontier = [()]
        for d in range(k):
            frontier = [p + (int(t),) for p in frontier for t in top[d]
                        if sum(int(a != top[i, 0]) for i, a in enumerate(p + (int(t),))) <= drafters.TREE_DETOURS]
            for p in frontier:
                prefixes[p] = sum(lp[r, i, t] for i, t in enumerate(p))
        best = sorted(prefixes, key=lambda p: -prefixes[p])
        for n in (1, 5, nodes):
            batch = jax.tree.map(lambda x: x[r:r + 1], ranked)
            cap = drafters.tree_capacity(k, nodes, False)
            drafts, parents, main, got_n = trees.arrange(batch, jnp.asarray([n]), cap)
            drafts, parents = np.asarray(drafts[0]), np.asarray(parents[0])
            tokens = np.concatenate([[-1], drafts])
            got = {tuple(int(tokens[j]) for j in _path_to(parents, i)[1:]) for i in range(1, int(got_n[0]) + 1)}
            assert got == set(best[:n])
            argmax_chain = {tuple(int(t) for t in np.argmax(lp[r], axis=1)[:d]) for d in range(1, k + 1)}
            on_main = {tuple(int(tokens[j]) for j in _path_to(parents, i)[1:]) for i in range(1, int(got_n[0]) + 1)
                       if main[0, i]}
            assert on_main == argmax_chain & got
