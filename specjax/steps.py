"""The jitted fixed-shape steps: prefill chunk, verify (T = 1 is plain decode), a run of
plain decode steps, and draft.

Static (recompile keys): config, sampling, taps, chunk / bucket sizes, k. Traced: lengths,
token values, counts, seed. The KV cache is donated, so steps update it in place.
Cache convention for every model: it holds all committed tokens except the newest one
(`last`), which the next step feeds.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from . import sampling as smp
from .checkpoint import Params
from .config import Qwen3Config
from .kv import KVCache
from .qwen3 import hidden_states, unembed
from .sampling import Sampling

BUCKETS = (1, 2, 4, 8, 16)


def bucket(n: int, buckets: tuple[int, ...] = BUCKETS) -> int:
    """Smallest compiled size holding n tokens."""
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} tokens exceed the largest compiled bucket {buckets[-1]}")


def bucket_below(n: int, buckets: tuple[int, ...] = BUCKETS) -> int:
    """Largest compiled size that is at most n (n >= 1)."""
    return max(b for b in buckets if b <= n)


def draft_length(limit: int, k: int) -> int:
    """Drafts to make when at most `limit` can be judged: the smallest k' = bucket - 1
    covering limit, capped at the proposer's k (so draft shapes match verify widths)."""
    return min([b - 1 for b in BUCKETS[1:] if b - 1 >= limit] + [k])


def switch(index: jax.Array, branches: list, carry, *args):
    """lax.switch(index, branches, carry, *args) for branches returning (outputs, carry),
    as a chain of while loops that run zero or one time.

    Why: XLA:CPU copies a cache that a conditional's branch updates (two pool copies per
    step, ~1 ms on tiny-code), but updates a while loop's carried buffers in place.
    """
    shapes = jax.eval_shape(branches[0], carry, *args)[0]
    init = (jnp.int32(index), jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes), carry)
    for j, branch in enumerate(branches):
        def body(c, branch=branch):
            outputs, carry = branch(c[2], *args)
            return jnp.int32(-1), outputs, carry
        init = jax.lax.while_loop(lambda c, j=j: c[0] == j, body, init)
    return init[1], init[2]


def _fit(x: jax.Array, n: int) -> jax.Array:
    """First n rows of x, zero-padded to n (static shapes)."""
    x = x[:n]
    return jnp.pad(x, [(0, n - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def _has_nan(x: jax.Array) -> jax.Array:
    return jnp.any(jnp.isnan(x))


@partial(jax.jit, static_argnames=("cfg", "sampling", "taps"), donate_argnames=("kv",))
def prefill(params: Params, cfg: Qwen3Config, kv: KVCache, tokens: jax.Array, n_valid: jax.Array,
            seed: jax.Array, sampling: Sampling, taps: tuple[int, ...] = ()):
    """Append one chunk [C] (first n_valid real) and sample the token after it.

    Returns (next token, nan flag, cache, taps [n, C, D] or None).
    """
    start = kv.lengths[0]
    positions = start + jnp.arange(tokens.shape[0])
    h, kv, tapped = hidden_states(params, cfg, tokens[None], positions[None], kv, taps)
    logits = unembed(params, cfg, h[0, n_valid - 1][None])
    token = smp.target_tokens(logits, (start + n_valid)[None], seed, sampling)[0]
    kv = kv.replace(lengths=kv.lengths + n_valid)
    return token, _has_nan(logits), kv, (None if tapped is None else tapped[:, 0])


@partial(jax.jit, static_argnames=("cfg", "sampling", "width", "taps"), donate_argnames=("kv",))
def verify(params: Params, cfg: Qwen3Config, kv: KVCache, last: jax.Array, drafts: jax.Array,
           n_drafts: jax.Array, seed: jax.Array, sampling: Sampling, width: int,
           logq: jax.Array | None = None, taps: tuple[int, ...] = ()):
    """Score [last, d1 .. d_{T-1}] (T = width; first n_drafts drafts real) and commit the accepted prefix.

    Deterministic drafts (logq None): t_i is the target's own token after each prefix,
    drawn with the same position keys as plain decoding; drafts are kept while d_i == t_i,
    so the committed tokens are t_1 .. t_{a+1}: token for token what plain decoding emits.
    Sampled drafts (logq [T-1, V]) use the general rule in sampling.accept_sampled.
    Returns (tokens [T], count = a + 1, nan flag, cache with length + count, taps [n, T, D]).
    """
    return judge(params, cfg, kv, last, drafts, n_drafts, seed, sampling, width, logq, taps)


def judge(params: Params, cfg: Qwen3Config, kv: KVCache, last: jax.Array, drafts: jax.Array,
          n_drafts: jax.Array, seed: jax.Array, sampling: Sampling, width: int,
          logq: jax.Array | None = None, taps: tuple[int, ...] = ()):
    """The body of `verify`, unjitted, for callers that trace it inside their own loop."""
    start = kv.lengths[0]
    t = width
    tokens = jnp.concatenate([jnp.reshape(last, (1,)).astype(jnp.int32), _fit(drafts.astype(jnp.int32), t - 1)])
    if logq is not None:
        logq = _fit(logq, t - 1)
    positions = start + jnp.arange(t)
    h, kv, tapped = hidden_states(params, cfg, tokens[None], positions[None], kv, taps)
    logits = unembed(params, cfg, h[0])  # [T, V]
    drafts = tokens[1:]
    if logq is None:
        out = smp.target_tokens(logits, positions + 1, seed, sampling)
        ok = (drafts == out[:-1]) & (jnp.arange(t - 1) < n_drafts)
        accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))
    else:
        out, accepted = smp.accept_sampled(logits, drafts, logq, n_drafts, positions + 1, seed, sampling)
    count = accepted + 1
    kv = kv.replace(lengths=kv.lengths + count)
    return out, count, _has_nan(logits), kv, (None if tapped is None else tapped[:, 0])


@partial(jax.jit, static_argnames=("cfg", "sampling", "n", "taps"), donate_argnames=("kv",))
def decode(params: Params, cfg: Qwen3Config, kv: KVCache, last: jax.Array, seed: jax.Array,
           sampling: Sampling, n: int, taps: tuple[int, ...] = ()):
    """n plain decode steps in one call, with no host round trip between tokens.

    Each step is a T = 1 verify step without drafts (same position keys), so the tokens are
    those n verify steps would commit. Returns (tokens [n], nan flag, cache with length
    + n, taps [n_taps, n, D] or None: the features of `last` and the first n - 1 tokens).
    """
    def body(carry, _):
        kv, token = carry
        position = kv.lengths[:1]
        h, kv, tapped = hidden_states(params, cfg, token[None, None], position[None], kv, taps)
        logits = unembed(params, cfg, h[0])  # [1, V]
        token = smp.target_tokens(logits, position + 1, seed, sampling)[0]
        feats = None if tapped is None else tapped[:, 0, 0]
        return (kv.replace(lengths=kv.lengths + 1), token), (token, _has_nan(logits), feats)

    (kv, _), (tokens, bad, feats) = jax.lax.scan(body, (kv, jnp.asarray(last, jnp.int32)), None, length=n)
    return tokens, jnp.any(bad), kv, (None if feats is None else jnp.swapaxes(feats, 0, 1))


@partial(jax.jit, static_argnames=("cfg", "k", "sampling", "sample"), donate_argnames=("kv",))
def draft(params: Params, cfg: Qwen3Config, kv: KVCache, feed: jax.Array, n_feed: jax.Array,
          length: jax.Array, seed: jax.Array, k: int, sampling: Sampling, sample: bool):
    """Rewind a draft model's cache to `length`, feed 1-2 committed tokens, chain k drafts.

    The draft cache may lag one token behind the target (after all k drafts were accepted
    its cache lacks d_k), so `feed` [2] holds that token, if any, and the newest one.
    Returns (drafts [k], draft log-probs [k, V] when sampling else None, cache).
    """
    kv = kv.replace(lengths=jnp.reshape(length, (1,)).astype(jnp.int32))
    positions = length + jnp.arange(2)
    h, kv, _ = hidden_states(params, cfg, feed[None], positions[None], kv)
    logits = unembed(params, cfg, h[0, n_feed - 1])
    pos = length + n_feed  # absolute position of d1
    kv = kv.replace(lengths=kv.lengths + n_feed)

    def pick(logits, pos):
        if not sample:
            return jnp.argmax(logits).astype(jnp.int32), None
        logq = smp.transform(logits, sampling)
        return smp.sample(logq, smp.position_key(seed, smp.DRAFT, pos)), logq

    def body(carry, _):
        kv, d, pos = carry
        h, kv, _ = hidden_states(params, cfg, d[None, None], (pos)[None, None], kv)
        kv = kv.replace(lengths=kv.lengths + 1)
        nxt, logq = pick(unembed(params, cfg, h[0, 0]), pos + 1)
        return (kv, nxt, pos + 1), (nxt, logq)

    d1, logq1 = pick(logits, pos)
    (kv, _, _), (rest, rest_logq) = jax.lax.scan(body, (kv, d1, pos), None, length=k - 1)
    drafts = jnp.concatenate([d1[None], rest])
    logq = None if not sample else jnp.concatenate([logq1[None], rest_logq])
    return drafts, logq, kv
