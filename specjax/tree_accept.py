"""Lossless acceptance for trees of SAMPLED drafts: recursive rejection sampling without
replacement (Jeon et al. 2024, "Recursive Speculative Decoding", arXiv:2402.14160).

`trees.walk` accepts a child when its token equals the target's own token at the parent:
exact for deterministic drafts, but for sampled drafts it wastes most of them (a sampled
child matches an independent target draw only by chance). The chain rule for sampled
drafts (Leviathan et al. 2023, Chen et al. 2023; `sampling.accept_rows`) accepts draft d
with probability min(1, p(d)/q(d)) and replaces a rejection with a draw from
normalize(max(p - q, 0)). With several children per node that rule cannot simply be
applied to each sibling in turn with the same q: siblings drawn WITHOUT replacement are
not independent draws from q (SpecTr, Sun et al. 2023, solves the general several-draft
case by optimal transport; Jeon et al. give the cheap exact rule used here).

The rule at a node whose children c_1, c_2, ... (in node-id order) were drawn without
replacement from q (c_1 ~ q, c_2 ~ q without c_1 renormalized, ...), with target law p:

    p_0, q_0 = p, q
    try c_j: accept with probability min(1, p_{j-1}(c_j) / q_{j-1}(c_j));
    on rejection: p_j = normalize(max(p_{j-1} - q_{j-1}, 0)),
                  q_j = q_{j-1} with c_j's mass removed, renormalized
                  (exactly the law c_{j+1} was drawn from);
    all rejected: emit a draw from the last p_j.

Stage j emits x with probability min(p_{j-1}(x), q_{j-1}(x)) + (rejection mass) * p_j(x)
= p_{j-1}(x), and p_j does not depend on which c_j was drawn, so by induction the node
emits x with probability p(x); an accepted child continues at its own subtree with the
target's law given the longer prefix. A node without children emits the target's own
position-keyed token. A chain (one child per node) is exactly the chain rule, and with
the same randomness `accept_tree_rows` gives bitwise `sampling.accept_rows`'s tokens.
Greedy rows (one-hot p) reduce to `trees.walk`: a child is accepted iff it is the argmax.

Randomness is position-keyed as everywhere in specjax (`sampling.position_key`): the
uniform for the j-th child tried at node i comes from key(seed, ACCEPT, positions[i])
(j == 0) or fold_in of it with j; the all-rejected draw from key(seed, RESIDUAL,
positions[i]). A walk visits one node per depth, so no number is used twice in a step.
Drafters should draw children from another stream (e.g. `children_without_replacement`
with a key from the DRAFT stream), independent of these.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import cpu_kernels, threefry
from .reductions import logsumexp_last
from .sampling import ACCEPT, RESIDUAL, RowSampling, position_key, residual_logprobs, sample, target_tokens_rows
from .sampling import transform_rows

__all__ = ["children_without_replacement", "accept_tree_rows", "check_children"]


def children_without_replacement(logq: jax.Array, key: jax.Array, m: int) -> jax.Array:
    """m distinct tokens [m] (int32) drawn from the log-distribution logq [V] without
    replacement, in draw order.

    Gumbel-top-k: perturb log q with independent Gumbel noise and take the m largest; the
    order of the perturbed values is the law of sequential draws without replacement
    (each next token from q restricted to the tokens not yet drawn, renormalized), which
    is the law `accept_tree_rows` assumes for siblings in node-id order. Tokens with
    q == 0 (-inf) are never drawn: if fewer than m tokens have q > 0, the surplus entries
    are -1. `m` is static; vmap for rows."""
    v = logq.shape[-1]
    k = min(m, v)
    noisy = logq.astype(jnp.float32) + threefry.gumbel(key, (v,))
    vals, idx = cpu_kernels.top_k(noisy, k)
    tokens = jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32)
    if k < m:
        tokens = jnp.concatenate([tokens, jnp.full((m - k,), -1, jnp.int32)])
    return tokens


def _without(logq: jax.Array, c: jax.Array) -> jax.Array:
    """logq [V] with token c's mass removed and the rest renormalized (all -inf when
    nothing is left): the law of the next sibling drawn without replacement."""
    rest = jnp.where(jnp.arange(logq.shape[-1]) == c, -jnp.inf, logq)
    total = logsumexp_last(rest)[0]
    return jnp.where(jnp.isfinite(total), rest - jnp.where(jnp.isfinite(total), total, 0.0), -jnp.inf)


def _accept_ratio(logp_c: jax.Array, logq_c: jax.Array, greedy: jax.Array) -> jax.Array:
    """min(1, p(c)/q(c)) in log space, NaN-free: 0 when p(c) == 0 (whatever q(c) is), 1
    when q(c) is 0 or underflows and p(c) > 0. Greedy rows: 1 iff p(c) > 0 (c is the argmax)."""
    possible = logp_c > -jnp.inf
    ratio = jnp.where(possible, jnp.exp(jnp.minimum(0.0, logp_c - logq_c)), 0.0)
    return jnp.where(greedy, possible.astype(jnp.float32), ratio)


def _walk_row(logp: jax.Array, logq: jax.Array, tokens: jax.Array, parents: jax.Array, n: jax.Array,
              positions: jax.Array, seed: jax.Array, own: jax.Array,
              greedy: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One row of `accept_tree_rows` (logp, logq [W, V]; tokens, parents, positions, own [W]).

    One pass over nodes k = 1 .. W-1 in id order suffices: a node's children have larger
    ids than it, so when the walk moves to child k its own children are all still ahead,
    and the current node's untried children come in the order they were drawn."""
    w, v = logp.shape
    ids = jnp.arange(w)

    def step(carry, k):
        cur, lp, lq, tries, accepted, path = carry
        child = (k <= n) & (parents[k] == cur)
        c = jnp.clip(tokens[k], 0, v - 1)
        ratio = _accept_ratio(lp[c], lq[c], greedy)
        key = position_key(seed, ACCEPT, positions[cur])
        u = jnp.where(tries == 0, threefry.uniform(key), threefry.uniform(threefry.fold_in(key, tries)))
        accept = child & (u < ratio)
        reject = child & ~accept
        lp = jnp.where(accept, logp[k], jnp.where(reject, residual_logprobs(lp, lq), lp))
        lq = jnp.where(accept, logq[k], jnp.where(reject, _without(lq, c), lq))
        path = jnp.where(accept & (ids == accepted + 1), k, path)
        accepted = accepted + accept.astype(jnp.int32)
        cur = jnp.where(accept, k, cur)
        tries = jnp.where(accept, 0, tries + reject.astype(jnp.int32))
        return (cur, lp, lq, tries, accepted, path), None

    start = (jnp.int32(0), logp[0], logq[0], jnp.int32(0), jnp.int32(0), ids.astype(jnp.int32))
    (cur, lp, _, tries, accepted, path), _ = jax.lax.scan(step, start, jnp.arange(1, w, dtype=jnp.int32))
    residual = sample(lp, position_key(seed, RESIDUAL, positions[cur]))
    final = jnp.where((tries > 0) & ~greedy, residual, own[cur])
    on_path = jnp.concatenate([tokens[path[1:]], jnp.zeros((1,), jnp.int32)])
    out = jnp.where(ids < accepted, on_path, final).astype(jnp.int32)
    return path, accepted, out


def accept_tree_rows(logits: jax.Array | None, tokens: jax.Array, parents: jax.Array, n: jax.Array,
                     logq: jax.Array, positions: jax.Array, seeds: jax.Array, rs: RowSampling,
                     own: jax.Array | None = None,
                     logp: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The accepted path of each row's tree of SAMPLED drafts, by recursive rejection
    sampling without replacement (module docstring); the committed tokens follow the
    target's law exactly for any draft distributions.

    logits [R, W, V]: the target's logits after each node (node 0 the root, the last
    committed token); tokens [R, W] the nodes' tokens; parents [R, W] with parents[:, i] <
    i (`trees` layout; node 0's is ignored); n [R]: nodes 1 .. n are real; logq [R, W, V]:
    the log-distribution node i's children were drawn from, without replacement, in the
    order of their node ids (one q per depth, as a DFlash block gives, or one per parent,
    as a draft model gives: both fit); positions [R, W]: the absolute position node i's
    logits decide (committed length + depth(i)); seeds [R]; rs: the rows' settings (the
    target law at node i is exp(transform_rows(logits[r, i]))). Siblings must carry
    distinct tokens (`check_children`).

    From the root, children are tried in id order: accepted with probability min(1,
    p(c)/q(c)); on rejection p <- normalize(max(p - q, 0)) and q <- q without c; after
    the last rejection a draw from p (stream RESIDUAL at the node's position); at a node
    without real children the target's own token (`target_tokens_rows`; `own` [R, W]: those
    tokens, and `logp` [R, W, V]: `transform_rows` of the logits, which are then not read,
    where the caller has them already).

    Returns (path [R, W]: the accepted nodes from the root, padded past the end with the
    node ids as `trees.walk` does; accepted [R]: drafted nodes on it; out [R, W]: the
    committed tokens out[:, :accepted + 1], the accepted children's then the final one,
    which also fills out[:, accepted + 1:] as `sampling.accept_rows` does)."""
    r, w, v = logq.shape
    flat = rs.repeat(w)
    if logp is None:
        logp = transform_rows(logits.reshape(r * w, v), flat).reshape(r, w, v)
    if own is None:
        own = target_tokens_rows(logits.reshape(r * w, v), positions.reshape(-1), jnp.repeat(seeds, w), flat,
                                 True).reshape(r, w)
    greedy = rs.temperature <= 0
    return jax.vmap(_walk_row)(logp, logq.astype(jnp.float32), tokens.astype(jnp.int32), parents.astype(jnp.int32),
                               n.astype(jnp.int32), positions, seeds, own, greedy)


def check_children(tokens, parents, n) -> None:
    """Host-side check of a tree batch (NumPy arrays [R, W], [R, W], [R]): every real node
    1 .. n[r] has a parent before it, and siblings carry distinct tokens (the rule draws
    children without replacement; two equal siblings would give one token two chances).
    Raises ValueError naming the row and nodes."""
    tokens, parents, n = np.asarray(tokens), np.asarray(parents), np.asarray(n)
    for r in range(tokens.shape[0]):
        seen: dict[tuple[int, int], int] = {}
        for i in range(1, int(n[r]) + 1):
            parent = int(parents[r, i])
            if not 0 <= parent < i:
                raise ValueError(f"row {r}, node {i}: parent {parent} is not an earlier node")
            key = (parent, int(tokens[r, i]))
            if key in seen:
                raise ValueError(f"row {r}, node {i}: token {key[1]} repeats its sibling node {seen[key]} "
                                 f"(children of node {parent} must carry distinct tokens)")
            seen[key] = i
