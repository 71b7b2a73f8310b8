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
    fuses each pass into one loop, so a [1, 8192] sum is 4 passes (halving it 13)."""
    n = v.shape[-1]
    if n <= 1:
        return v if n else jnp.zeros(v.shape[:-1] + (1,), v.dtype)
    ways = WAYS if n >= WAYS else 2
    m = n // ways
    parts = [v[..., i * m:(i + 1) * m] for i in range(ways)]
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    total = sum_last(parts[0])
    return total if ways * m == n else total + sum_last(v[..., ways * m:])


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
