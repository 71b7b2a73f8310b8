"""Recursive rejection sampling without replacement over sampled draft trees
(`specjax.tree_accept`), against references written apart from it:

- an exact float64 re-derivation of the rule, whose outcome law, averaged over every
  ordered without-replacement draw of the children, must equal the target's law;
- the JAX function against that re-derivation given the same random numbers (the
  position keys reproduced here with jax.random);
- chi-square of the JAX function end to end (trees drawn by `children_without_replacement`);
- chains: bitwise `sampling.accept_rows`; greedy rows: `trees.walk`;
- `children_without_replacement`'s ordered-draw law; `check_children`'s refusals.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import sampling as smp
from specjax import trees
from specjax.sampling import ACCEPT, DRAFT, RESIDUAL, RowSampling, Sampling, position_key
from specjax.tree_accept import accept_tree_rows, check_children, children_without_replacement
from conftest import assert_follows

accept_jit = jax.jit(accept_tree_rows)


# ---------------------------------------------------------------------------------------
# The rule, re-derived in float64 NumPy (distributions as probability vectors).

def _residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    r = np.maximum(p - q, 0.0)
    return r / r.sum() if r.sum() > 0 else p


def _without(q: np.ndarray, c: int) -> np.ndarray:
    q = q.copy()
    q[c] = 0.0
    return q / q.sum() if q.sum() > 0 else q


def _ratio(p: np.ndarray, q: np.ndarray, c: int) -> float:
    if p[c] == 0:
        return 0.0
    if q[c] == 0:
        return 1.0
    return min(1.0, p[c] / q[c])


def _node_law(p, q, children, renormalize_q=True) -> dict:
    """Exact law of the committed tokens from a node with target law p, draft law q and
    children [(token, law of its subtree's committed tokens)] tried in order."""
    out: dict = defaultdict(float)
    if not children:
        for x in np.flatnonzero(p > 0):
            out[(int(x),)] += p[x]
        return out
    mass = 1.0
    for c, sub in children:
        a = _ratio(p, q, c)
        for seq, pr in sub.items():
            out[(c,) + seq] += mass * a * pr
        mass *= 1.0 - a
        p, q = _residual(p, q), (_without(q, c) if renormalize_q else q)
    for x in np.flatnonzero(p > 0):
        out[(int(x),)] += mass * p[x]
    return out


def _ordered_draws(q: np.ndarray, m: int):
    """Every ordered draw of up to m distinct tokens from q without replacement (fewer
    when q's support runs out) with its probability."""
    def go(prefix, left, prob):
        if len(prefix) == m or left.sum() <= 0:
            yield tuple(prefix), prob
            return
        for c in np.flatnonzero(left > 0):
            yield from go(prefix + [int(c)], _without(left, c), prob * left[c] / left.sum())
    yield from go([], q / q.sum(), 1.0)


class Model:
    """A synthetic target and drafter over vocabulary V: target laws P(prefix) for prefixes
    up to `depth` tokens, draft laws Q(prefix) for shorter ones (per depth or per parent)."""

    def __init__(self, target: dict, draft: dict, depth: int):
        self.target, self.draft, self.depth = target, draft, depth

    def expected_law(self, ms, prefix=(), renormalize_q=True) -> dict:
        """Law of the committed tokens, averaged over every ordered child draw. A node's law
        is linear in each child's subtree law and the children's subtrees are drawn
        independently, so each child's subtree law may be replaced by its own average."""
        p = self.target[prefix]
        if len(prefix) == self.depth:
            return _node_law(p, None, [])
        q = self.draft[prefix]
        total: dict = defaultdict(float)
        subs = {}
        for draw, prob in _ordered_draws(q, ms[len(prefix)]):
            children = []
            for c in draw:
                if c not in subs:
                    subs[c] = self.expected_law(ms, prefix + (c,), renormalize_q)
                children.append((c, subs[c]))
            for seq, pr in _node_law(p, q, children, renormalize_q).items():
                total[seq] += prob * pr
        return total

    def completed(self, law: dict) -> dict:
        """Each committed sequence continued by the target's own law to depth + 1 tokens:
        lossless iff this equals the target's law of depth + 1 tokens."""
        out: dict = defaultdict(float)
        for seq, pr in law.items():
            stack = [(seq, pr)]
            while stack:
                s, w = stack.pop()
                if len(s) == self.depth + 1:
                    out[s] += w
                    continue
                p = self.target[s]
                stack.extend((s + (int(x),), w * p[x]) for x in np.flatnonzero(p > 0))
        return out

    def target_law(self) -> dict:
        v = len(self.target[()])
        out = {}
        for seq in itertools.product(range(v), repeat=self.depth + 1):
            pr = 1.0
            for j in range(len(seq)):
                pr *= self.target[seq[:j]][seq[j]]
            if pr > 0:
                out[seq] = pr
        return out


def _normalize(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x / x.sum()


def _model(rng, v: int, depth: int, case: str) -> Model:
    """Random tables with the case's feature."""
    prefixes = [s for d in range(depth + 1) for s in itertools.product(range(v), repeat=d)]
    target = {s: _normalize(rng.random(v) + 0.05) for s in prefixes}
    draft = {s: _normalize(rng.random(v) + 0.05) for s in prefixes if len(s) < depth}
    per_depth = {d: _normalize(rng.random(v) + 0.05) for d in range(depth)}
    if case == "per_depth":  # a DFlash block: one q per depth, whatever the parent
        draft = {s: per_depth[len(s)] for s in draft}
    elif case == "p_zero":  # the target rules out tokens the drafter proposes
        for s in target:
            target[s] = target[s].copy()
            target[s][rng.choice(v, size=v // 2, replace=False)] = 0.0
            target[s] = _normalize(target[s])
    elif case == "q_zero":  # the drafter's support is smaller than the children asked for
        for s in draft:
            q = draft[s].copy()
            q[rng.choice(v, size=v - 2, replace=False)] = 0.0
            draft[s] = _normalize(q)
    elif case == "ties":
        for s in target:
            target[s] = _normalize([2, 2, 1, 1][:v])
        for s in draft:
            draft[s] = _normalize([1, 3, 3, 1][:v])
    elif case == "p_equals_q":
        draft = {s: target[s] for s in draft}
    elif case == "underflow":  # a token with q = 1e-45 (a float32 subnormal)
        for s in draft:
            q = draft[s].copy()
            q[0] = 1e-45
            draft[s] = q / q.sum()
    elif case == "disjoint":  # q's support is exactly where p is 0
        for s in draft:
            draft[s] = _normalize([1, 1, 0, 0][:v] + [0] * (v - 4))
        for s in target:
            target[s] = _normalize([0, 0, 1, 2][:v] + [1] * (v - 4))
    return Model(target, draft, depth)


CASES = ["generic", "per_depth", "p_zero", "q_zero", "ties", "p_equals_q", "underflow", "disjoint"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("v,ms", [(4, (3, 3)), (3, (2, 3)), (3, (1, 1))], ids=["V4-3x3", "V3-2x3", "V3-chain"])
def test_rule_is_lossless_by_exhaustive_enumeration(case, v, ms):
    """Every ordered draw of the children, weighted by its probability: the committed
    tokens, continued by the target, have exactly the target's law (depth 2: 3 tokens)."""
    model = _model(np.random.default_rng(10 * CASES.index(case) + v), v, 2, case)
    got = model.completed(model.expected_law(ms))
    want = model.target_law()
    for seq in set(got) | set(want):
        assert abs(got.get(seq, 0.0) - want.get(seq, 0.0)) < 1e-12, (seq, got.get(seq), want.get(seq))
    assert abs(sum(got.values()) - 1.0) < 1e-12


def test_enumeration_catches_a_wrong_rule():
    """The enumeration has teeth: keeping q unchanged after a rejection (ignoring that
    siblings were drawn without replacement) is not lossless."""
    model = _model(np.random.default_rng(0), 4, 2, "generic")
    got = model.completed(model.expected_law((3, 3), renormalize_q=False))
    want = model.target_law()
    assert max(abs(got.get(s, 0.0) - want[s]) for s in want) > 1e-3


# ---------------------------------------------------------------------------------------
# Given randomness: the JAX function against the re-derivation with the same numbers.

@jax.jit
def _numbers(logits, positions, seeds, rs):
    """What the rule may draw on, from the position keys, for every node of every row:
    the target's law p, the uniforms u [R, W, W] for the j-th child tried at a node, the
    residual draw's Gumbel noise [R, W, V] and the target's own token [R, W]."""
    r, w, v = logits.shape
    flat = rs.repeat(w)
    logp = smp.transform_rows(logits.reshape(r * w, v), flat).reshape(r, w, v)
    own = smp.target_tokens_rows(logits.reshape(r * w, v), positions.reshape(-1), jnp.repeat(seeds, w), flat,
                                 True).reshape(r, w)

    def at(seed, pos):
        key = position_key(seed, ACCEPT, pos)
        u = jnp.array([jax.random.uniform(key if j == 0 else jax.random.fold_in(key, j)) for j in range(w)])
        return u, jax.random.gumbel(position_key(seed, RESIDUAL, pos), (v,), jnp.float32)

    u, g = jax.vmap(jax.vmap(at, (None, 0)))(seeds, positions)
    return logp, u, g, own


def _reference_walk(p, q, tokens, parents, n, u, g, own):
    """The rule on one row with the position-keyed numbers: p, q [W, V] float64, u [W, W]
    (node, try), g [W, V] (node), own [W]."""
    cur, path, out = 0, [0], []
    pc, qc = p[0], q[0]
    while True:
        kids = [i for i in range(1, n + 1) if parents[i] == cur]
        if not kids:
            out.append(int(own[cur]))
            return path, out
        for j, k in enumerate(kids):
            c = int(tokens[k])
            if u[cur, j] < _ratio(pc, qc, c):
                cur = k
                path.append(k)
                out.append(c)
                pc, qc = p[k], q[k]
                break
            pc, qc = _residual(pc, qc), _without(qc, c)
        else:
            with np.errstate(divide="ignore"):
                out.append(int(np.argmax(np.log(pc) + g[cur].astype(np.float64))))
            return path, out


def _random_tree(rng, w: int, v: int, fanout: int):
    """parents [w] in breadth-first order (at most `fanout` children each) and tokens
    distinct among siblings."""
    parents, tokens, queue, i = [-1], [int(rng.integers(v))], [0], 1
    while i < w:
        node = queue.pop(0) if queue else 0
        kids = rng.choice(v, size=min(int(rng.integers(1, fanout + 1)), v, w - i), replace=False)
        for t in kids:
            parents.append(node)
            tokens.append(int(t))
            queue.append(i)
            i += 1
    return np.array(parents, np.int32), np.array(tokens, np.int32)


SETTINGS = [Sampling(1.0), Sampling(0.7, top_k=3), Sampling(1.3, top_p=0.8), Sampling(0.9, min_p=0.1),
            Sampling(0.0)]


def _random_batch(rng, r: int, w: int, v: int, fanout: int):
    shapes = [_random_tree(rng, w, v, fanout) for _ in range(r)]
    parents = np.stack([s[0] for s in shapes])
    tokens = np.stack([s[1] for s in shapes])
    n = rng.integers(0, w, size=r).astype(np.int32)
    n[:2] = w - 1
    logits = (rng.standard_normal((r, w, v)) * 2).astype(np.float32)
    logits[rng.random((r, w, v)) < 0.1] = -np.inf  # some tokens the target rules out
    logits[..., 0] = np.maximum(logits[..., 0], 0.0)  # never a whole row of -inf
    qlogits = (rng.standard_normal((r, w, v)) * 2).astype(np.float32)
    qlogits[rng.random((r, w, v)) < 0.2] = -np.inf  # tokens the drafter cannot propose
    qlogits[..., 1] = np.maximum(qlogits[..., 1], 0.0)
    qlogits[..., 2] = qlogits.max(axis=-1) - 104.0  # q(2) ~ 1e-46: a float32 subnormal, 0 once flushed
    logq = np.asarray(jax.nn.log_softmax(jnp.asarray(qlogits), axis=-1))
    depth = np.asarray(trees.depths(jnp.asarray(parents)))
    start = rng.integers(0, 50, size=(r, 1))
    positions = (start + depth).astype(np.int32)
    seeds = rng.integers(0, 2**31, size=r).astype(np.uint32)
    rs = RowSampling.of([SETTINGS[i % len(SETTINGS)] for i in range(r)])
    return logits, tokens, parents, n, logq, positions, seeds, rs


def test_jax_matches_the_rederivation_given_the_same_numbers():
    rng = np.random.default_rng(1)
    r, w, v = 300, 10, 6
    batch = _random_batch(rng, r, w, v, fanout=3)
    logits, tokens, parents, n, logq, positions, seeds, rs = batch
    path, accepted, out = (np.asarray(x) for x in accept_jit(*map(jnp.asarray, batch[:7]), rs))
    logp, u, g, own = (np.asarray(x) for x in _numbers(jnp.asarray(logits), jnp.asarray(positions),
                                                       jnp.asarray(seeds), rs))
    p, q = np.exp(logp.astype(np.float64)), np.exp(np.asarray(logq, np.float64))
    assert np.isfinite(q).all()
    lengths, later = [], []
    for row in range(r):
        want_path, want_out = _reference_walk(p[row], q[row], tokens[row], parents[row], int(n[row]), u[row], g[row],
                                              own[row])
        a = len(want_path) - 1
        assert accepted[row] == a, row
        assert list(path[row, :a + 1]) == want_path, row
        assert list(path[row, a + 1:]) == list(range(a + 1, w)), row
        assert list(out[row, :a + 1]) == want_out, row
        assert (out[row, a + 1:] == want_out[-1]).all(), row
        lengths.append(a)
        later.append(any(k != min(np.flatnonzero(parents[row, :n[row] + 1] == parents[row, k])) for k in want_path[1:]))
    assert max(lengths) >= 2 and min(lengths) == 0  # the batch exercised deep and shallow walks ...
    assert any(later)  # ... and acceptances after a sibling's rejection


def test_forced_underflowing_and_impossible_children_give_no_nan():
    """A child with q ~ 1e-45 (or q == 0) is accepted when p > 0; a child with p == 0 is
    always rejected, whatever q; the rest of the walk stays well-defined."""
    v, w = 4, 4
    logits = np.zeros((2, w, v), np.float32)
    logits[:, :, 3] = -np.inf  # p(3) == 0 everywhere
    logq = np.full((2, w, v), -np.inf, np.float32)
    logq[:, :, 0] = 0.0  # q is all on token 0 ...
    logq[:, :, 1] = np.log(np.float32(1e-45))  # ... 1 underflows (-103.3 here, 0 in linear float32)
    tokens = np.array([[0, 3, 1, 2], [0, 3, 2, 1]], np.int32)  # root's children 3 (p=0), then 1 / 2
    parents = np.array([[-1, 0, 0, 0], [-1, 0, 0, 0]], np.int32)
    path, accepted, out = accept_jit(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(parents),
                                     jnp.array([3, 3]), jnp.asarray(logq), jnp.zeros((2, w), jnp.int32),
                                     jnp.array([5, 6], jnp.uint32), RowSampling.of([Sampling(1.0)] * 2))
    assert list(np.asarray(accepted)) == [1, 1]
    assert list(np.asarray(path)[:, 1]) == [2, 2]  # node 1 (token 3) rejected, node 2 accepted
    assert list(np.asarray(out)[:, 0]) == [1, 2]
    assert (np.asarray(out)[:, 1] != 3).all()


# ---------------------------------------------------------------------------------------
# End to end: many seeds, trees drawn by children_without_replacement, chi-square.

def _tables(rng, v: int, case: str):
    """Target logits per prefix (LP0 [V], LP1 [V, V], LP2 [V, V, V]) and draft laws per
    parent (Q0 [V], Q1 [V, V])."""
    lp = [rng.standard_normal((v,) * (d + 1)).astype(np.float32) for d in range(3)]
    q0 = _normalize(rng.random(v) + 0.1)
    q1 = np.stack([_normalize(rng.random(v) + 0.1) for _ in range(v)])
    if case == "zeros":
        lp[1][..., 1] = -np.inf  # the target never says 1 after one token
        q0[2] = 0.0  # the drafter never proposes 2 at the root
        q1[:, [0, 3]] = 0.0  # two tokens left for three children: the surplus is dropped
        q0, q1 = _normalize(q0), q1 / q1.sum(-1, keepdims=True)
    elif case == "adversarial":  # the drafter favours what the target dislikes: many rejections
        lp[0][:] = np.log([0.05, 0.05, 0.45, 0.45])
        q0 = _normalize([0.45, 0.45, 0.05, 0.05])
    elif case == "ties":
        lp[0][:] = [1.0, 1.0, 0.5, 0.5]
        q0 = _normalize([2, 2, 1, 1])
        q1 = np.tile(_normalize([1, 1, 1, 2]), (v, 1))
    return lp, q0, q1


@pytest.mark.parametrize("case,setting,ms", [("zeros", Sampling(1.0), (3, 3)),
                                             ("adversarial", Sampling(1.0), (3, 3)),
                                             ("ties", Sampling(0.8, top_k=3), (2, 3))],
                         ids=["zeros", "adversarial", "ties-topk"])
def test_end_to_end_chi_square(case, setting, ms):
    v, rows = 4, 24000
    rng = np.random.default_rng(7)
    lp, q0, q1 = _tables(rng, v, case)
    m1, m2 = ms
    w = 1 + m1 + m1 * m2
    with np.errstate(divide="ignore"):
        lq0, lq1 = jnp.asarray(np.log(q0), jnp.float32), jnp.asarray(np.log(q1), jnp.float32)
    lp0, lp1, lp2 = map(jnp.asarray, lp)

    @jax.jit
    def step(seeds, start):
        def build(seed, start):
            first = children_without_replacement(lq0, position_key(seed, DRAFT, start), m1)  # [m1]
            k1 = position_key(seed, DRAFT, start + 1)
            second = jax.vmap(lambda a, t: children_without_replacement(lq1[jnp.maximum(t, 0)],
                                                                        jax.random.fold_in(k1, a), m2))(
                jnp.arange(m1), first)  # [m1, m2]
            second = jnp.where(first[:, None] >= 0, second, -1)
            toks = jnp.concatenate([jnp.zeros(1, jnp.int32), first, second.reshape(-1)])
            par = jnp.concatenate([jnp.array([-1, *[0] * m1], jnp.int32), jnp.repeat(jnp.arange(1, m1 + 1), m2)])
            dep = jnp.concatenate([jnp.array([0, *[1] * m1], jnp.int32), jnp.full(m1 * m2, 2, jnp.int32)])
            a_tok = jnp.concatenate([jnp.zeros(1, jnp.int32), first, jnp.repeat(first, m2)])
            lg = jnp.where((dep == 0)[:, None], lp0[None],
                           jnp.where((dep == 1)[:, None], lp1[jnp.maximum(a_tok, 0)],
                                     lp2[jnp.maximum(a_tok, 0), jnp.maximum(toks, 0)]))
            lq = jnp.where((dep == 0)[:, None], lq0[None],
                           jnp.where((dep == 1)[:, None], lq1[jnp.maximum(toks, 0)], 0.0))
            valid = toks >= 0
            order = jnp.argsort(jnp.where(valid, jnp.arange(w), w + jnp.arange(w)))  # real nodes first, in order
            new_id = jnp.argsort(order)
            par = jnp.where(valid[order], new_id[jnp.maximum(par[order], 0)], jnp.arange(w)).at[0].set(-1)
            return (toks[order], par, jnp.sum(valid) - 1, lg[order], lq[order], start + dep[order])

        toks, par, n, lg, lq, pos = jax.vmap(build)(seeds, start)
        rs = RowSampling.every(setting, seeds.shape[0])
        return accept_tree_rows(lg, jnp.maximum(toks, 0), par, n, lq, pos, seeds, rs), toks, par, n

    seeds = jnp.arange(rows, dtype=jnp.uint32) + 1000
    start = jnp.asarray(rng.integers(0, 100, size=rows), jnp.int32)
    (path, accepted, out), toks, par, n = step(seeds, start)
    check_children(np.asarray(toks), np.asarray(par), np.asarray(n))
    if case == "zeros":
        assert (np.asarray(n) < w - 1).any()  # q's support ran out: surplus children dropped
    accepted, out = np.asarray(accepted), np.asarray(out)
    assert accepted.max() == 2 and (accepted == 1).any() and ((accepted == 0).any() or case == "adversarial")
    assert (np.asarray(path)[:, 1] > 1).sum() >= 50  # the root's first child rejected, a later one taken

    # the target's law, as the library defines it, per prefix (float64), in one compiled call
    tables = jnp.asarray(np.concatenate([x.reshape(-1, v) for x in lp]))
    laws = jax.jit(smp.transform_rows)(tables, RowSampling.every(setting, tables.shape[0]))
    laws = np.exp(np.asarray(laws, np.float64))
    p0, p1, p2 = laws[:1].reshape(v), laws[1:1 + v].reshape(v, v), laws[1 + v:].reshape(v, v, v)

    def draw(probs):
        return (rng.random(len(probs))[:, None] > np.cumsum(probs, -1)[:, :-1]).sum(-1)

    x1 = out[:, 0]
    x2 = np.where(accepted >= 1, out[:, 1], draw(p1[x1]))
    x3 = np.where(accepted >= 2, out[:, 2], draw(p2[x1, x2]))
    counts = np.bincount((x1 * v + x2) * v + x3, minlength=v ** 3)
    assert_follows(counts, p0[:, None, None] * p1[:, :, None] * p2)
    # accepted drafts are committed in the target's law too, not only completions
    deep = accepted == 2
    pairs = np.bincount(out[deep, 0] * v + out[deep, 1], minlength=v * v)
    assert pairs[(p0[:, None] * p1).reshape(-1) == 0].sum() == 0


# ---------------------------------------------------------------------------------------
# Chains and greedy rows.

def test_chain_is_bitwise_accept_rows():
    rng = np.random.default_rng(3)
    r, w, v = 30, 6, 12
    logits = (rng.standard_normal((r, w, v)) * 2).astype(np.float32)
    logits[rng.random((r, w, v)) < 0.15] = -np.inf
    logits[..., 0] = np.maximum(logits[..., 0], 0.0)
    qlogits = np.where(np.isfinite(logits), logits, 0.0) + rng.standard_normal((r, w, v)).astype(np.float32)
    qlogits[rng.random((r, w, v)) < 0.2] = -np.inf  # a drafter close to the target, with its own holes
    qlogits[..., 1] = np.maximum(qlogits[..., 1], 0.0)
    logq = jax.nn.log_softmax(jnp.asarray(qlogits), axis=-1)
    seeds = jnp.asarray(rng.integers(0, 2**31, size=r), jnp.uint32)
    positions = jnp.asarray(rng.integers(0, 40, size=(r, 1)) + np.arange(w), jnp.int32)
    # drafts sampled from q (often accepted) or arbitrary tokens (some with p == 0 or q == 0)
    keys = jax.vmap(jax.vmap(lambda s, p: position_key(s, DRAFT, p), (None, 0)))(seeds, positions[:, :w - 1])
    sampled = jax.vmap(jax.vmap(smp.sample))(logq[:, :w - 1], keys)
    drafts = jnp.where(jnp.asarray(rng.random((r, w - 1)) < 0.7), sampled, jnp.asarray(rng.integers(0, v, (r, w - 1))))
    n = jnp.asarray(rng.integers(0, w, size=r), jnp.int32).at[:3].set(w - 1)
    rs = RowSampling.of([SETTINGS[i % len(SETTINGS)] for i in range(r)])
    want_tokens, want_accepted = jax.jit(smp.accept_rows)(jnp.asarray(logits), drafts, logq[:, :w - 1], n, positions,
                                                          seeds, rs)
    tokens = jnp.concatenate([jnp.zeros((r, 1), jnp.int32), drafts.astype(jnp.int32)], axis=1)
    path, accepted, out = accept_jit(jnp.asarray(logits), tokens, trees.chain_parents(r, w), n, logq, positions, seeds,
                                     rs)
    np.testing.assert_array_equal(np.asarray(accepted), np.asarray(want_accepted))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want_tokens))
    np.testing.assert_array_equal(np.asarray(path), np.broadcast_to(np.arange(w), (r, w)))
    assert np.asarray(accepted).max() >= 2 and (np.asarray(accepted) < np.asarray(n)).any()


def test_greedy_rows_are_trees_walk():
    """Greedy rows (mixed in a batch with sampled ones) accept a child iff it is the argmax
    and commit trees.walk's path and tokens, whatever q says."""
    rng = np.random.default_rng(4)
    r, w, v = 40, 12, 5
    logits, tokens, parents, n, logq, positions, seeds, _ = _random_batch(rng, r, w, v, fanout=3)
    target = np.argmax(logits, axis=-1)
    for row in range(r):  # put the target's token among many nodes' children
        for i in range(1, w):
            sib = tokens[row][parents[row] == parents[row, i]]
            want = target[row, parents[row, i]]
            if rng.random() < 0.6 and want not in sib:
                tokens[row, i] = want
    check_children(tokens, parents, n)
    greedy = np.arange(r) % 2 == 0
    rs = RowSampling.of([Sampling(0.0) if g else Sampling(1.0) for g in greedy])
    path, accepted, out = (np.asarray(x) for x in accept_jit(*map(jnp.asarray, (logits, tokens, parents, n, logq,
                                                                                 positions, seeds)), rs))
    want_path, want_accepted = (np.asarray(x) for x in trees.walk(jnp.asarray(tokens), jnp.asarray(parents),
                                                                  jnp.asarray(n), jnp.asarray(target)))
    np.testing.assert_array_equal(accepted[greedy], want_accepted[greedy])
    np.testing.assert_array_equal(path[greedy], want_path[greedy])
    for row in np.flatnonzero(greedy):
        a = accepted[row]
        assert list(out[row, :a + 1]) == [target[row, want_path[row, j]] for j in range(a + 1)]
    assert want_accepted[greedy].max() >= 2


# ---------------------------------------------------------------------------------------
# children_without_replacement and check_children.

@pytest.mark.parametrize("q,m", [([0.4, 0.3, 0.2, 0.1, 0.0], 2), ([0.25, 0.25, 0.35, 0.15, 0.0], 3)],
                         ids=["pairs", "triples-ties"])
def test_children_follow_the_without_replacement_law(q, m):
    q = np.array(q)
    v, draws = len(q), 30000
    with np.errstate(divide="ignore"):
        logq = jnp.asarray(np.log(q), jnp.float32)
    got = np.asarray(jax.jit(jax.vmap(lambda k: children_without_replacement(logq, k, m)))(
        jax.random.split(jax.random.key(9), draws)))
    assert got.shape == (draws, m) and (got >= 0).all()
    assert (np.diff(np.sort(got, axis=1), axis=1) > 0).all()  # distinct
    assert (got != v - 1).all()  # q == 0 is never drawn
    want = dict(_ordered_draws(q, m))
    index = {seq: i for i, seq in enumerate(want)}
    counts = np.bincount([index[tuple(row)] for row in got.tolist()], minlength=len(want))
    assert_follows(counts, np.array(list(want.values())))


def test_children_surplus_is_marked_invalid():
    logq = jnp.log(jnp.array([0.0, 0.7, 0.0, 0.3, 0.0]))
    got = np.asarray(jax.vmap(lambda k: children_without_replacement(logq, k, 4))(
        jax.random.split(jax.random.key(2), 200)))
    assert (got[:, 2:] == -1).all()
    assert all(sorted(row[:2]) == [1, 3] for row in got.tolist())
    assert {tuple(row[:2]) for row in got.tolist()} == {(1, 3), (3, 1)}
    wide = np.asarray(children_without_replacement(jnp.zeros(3), jax.random.key(0), 5))  # m > V
    assert sorted(wide[:3]) == [0, 1, 2] and list(wide[3:]) == [-1, -1]


def test_check_children_refuses_duplicate_siblings():
    tokens = np.array([[0, 5, 6, 7, 7], [0, 5, 6, 5, 5]])
    parents = np.array([[-1, 0, 0, 1, 2], [-1, 0, 0, 1, 0]])
    check_children(tokens, parents, np.array([4, 3]))  # cousins may share a token; row 1's node 4 is not real
    with pytest.raises(ValueError, match=r"row 1, node 4: token 5 repeats its sibling node 1"):
        check_children(tokens, parents, np.array([4, 4]))
    with pytest.raises(ValueError, match=r"row 0, node 2: parent 2"):
        check_children(tokens, np.array([[-1, 0, 2, 1, 2], parents[1]]), np.array([4, 3]))
