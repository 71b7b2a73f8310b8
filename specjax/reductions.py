"""Sums over the last axis in one fixed order, and the softmaxes built on them.

XLA:CPU's reduce picks its summation order by the operand's shape, so a row summed among
others (a verify step's T rows, a batch's rows, a vmap's) can differ in the last bit from
the same row summed alone. These functions give a row the same bits whatever the other
axes' sizes, which is what lets a verify step's rows equal the decode steps' and a
batched request equal its run alone, token for token."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sum_last(v: jax.Array) -> jax.Array:
    """The sum over the last axis (kept, size 1) in one fixed order: the longest prefix
    whose length is a power of two is halved by elementwise adds of its halves until one
    entry is left, the rest of the row is summed the same way, and the two are added.
    Only slices and adds: no pads, so XLA fuses it into a few loops (a [8, 151936] sum
    runs faster than its reduce)."""
    n = v.shape[-1]
    if n == 0:
        return jnp.zeros(v.shape[:-1] + (1,), v.dtype)
    head = 1 << (n.bit_length() - 1)
    s = v[..., :head]
    while s.shape[-1] > 1:
        half = s.shape[-1] // 2
        s = s[..., :half] + s[..., half:]
    return s if head == n else s + sum_last(v[..., head:])


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
