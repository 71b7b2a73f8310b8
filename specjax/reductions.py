"""Sums over the last axis in one fixed order, and the softmaxes built on them.

XLA:CPU's reduce picks its summation order by the operand's shape, so a row summed among
others (a verify step's T rows, a batch's rows, a vmap's) can differ in the last bit from
the same row summed alone. These functions give a row the same bits whatever the other
axes' sizes, which is what lets a verify step's rows equal the decode steps' and a
batched request equal its run alone, token for token."""

from __future__ import annotations

import jax
import jax.numpy as jnp


WAYS = 16  # chunks one pass of `sum_last` adds (each pass is one XLA loop: fewer passes, fewer thunks)


def sum_last(v: jax.Array) -> jax.Array:
    """The sum over the last axis (kept, size 1) in one fixed order, by elementwise adds
    only: a row of n >= WAYS entries is cut into WAYS equal chunks (plus the n % WAYS
    entries left over), the chunks are added in a fixed pairwise tree, and the result and
    the leftover are summed the same way and added; a shorter row halves pairwise. XLA
    fuses each pass into one loop, so a [1, 8192] sum is 4 passes (halving it 13).

    The chunks are an axis of their own and each level of the tree adds its even chunks to
    its odd ones (two strided slices), in lax primitives: a handful of operations per sum
    however many chunks, which keeps tracing the model's norms cheap."""
    n = v.shape[-1]
    if n <= 1:
        return v if n else jnp.zeros(v.shape[:-1] + (1,), v.dtype)
    ways = WAYS if n >= WAYS else 2
    m = n // ways
    lead, last = v.shape[:-1], v.ndim - 1
    chunks = jax.lax.reshape(jax.lax.slice_in_dim(v, 0, ways * m, axis=last), lead + (ways, m))
    while chunks.shape[last] > 1:  # chunk 2j plus chunk 2j + 1, level by level
        c = chunks.shape[last]
        chunks = jax.lax.add(jax.lax.slice_in_dim(chunks, 0, c - 1, 2, axis=last),
                             jax.lax.slice_in_dim(chunks, 1, c, 2, axis=last))
    total = sum_last(jax.lax.reshape(chunks, lead + (m,)))
    if ways * m == n:
        return total
    return jax.lax.add(total, sum_last(jax.lax.slice_in_dim(v, ways * m, n, axis=last)))


def logsumexp_last(x: jax.Array) -> jax.Array:
    """log(sum(exp(x))) over the last axis (kept), as `jax.nn.logsumexp`: the row's largest
    finite maximum subtracted first, so a row of -inf gives -inf and one holding +inf +inf."""
    top = jnp.max(x, axis=-1, keepdims=True)  # a maximum has no order to depend on
    top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
    return top + jnp.log(sum_last(jnp.exp(x - top)))


def log_softmax_last(x: jax.Array) -> jax.Array:
    """`jax.nn.log_softmax` over the last axis (the same NaN for a row of -inf or holding
    +inf), its sum in the fixed order."""
    shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    return shifted - jnp.log(sum_last(jnp.exp(shifted)))


def softmax_last(x: jax.Array) -> jax.Array:
    """`jax.nn.softmax` over the last axis, its sum in the fixed order."""
    e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))
    return e / sum_last(e)
