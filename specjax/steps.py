"""Compiled shapes shared by the engine's device code: the verify widths (buckets) and a
branch switch that keeps cache updates in place.

Static shapes are recompile keys, so every variable-length step is padded to a bucket:
a verify step of T tokens (T = 1 is plain decoding) runs at the smallest bucket >= T.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

BUCKETS = (1, 2, 4, 8, 16)


def bucket(n: int, buckets: tuple[int, ...] = BUCKETS) -> int:
    """Smallest compiled size holding n tokens."""
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} tokens exceed the largest compiled bucket {buckets[-1]}")


def switch(index: jax.Array, branches: list, carry, *args):
    """lax.switch(index, branches, carry, *args) for branches returning (outputs, carry),
    as a chain of while loops that run zero or one time.

    Why: XLA:CPU copies a cache that a conditional's branch updates (two pool copies per
    step, ~1 ms on tiny-code), but updates a while loop's carried buffers in place.
    """
    init = (jnp.int32(index), zeros_of(lambda: branches[0](carry, *args)[0]), carry)
    for j, branch in enumerate(branches):
        def body(c, branch=branch):
            outputs, carry = branch(c[2], *args)
            return jnp.int32(-1), outputs, carry
        init = jax.lax.while_loop(lambda c, j=j: c[0] == j, body, init)
    return init[1], init[2]


def zeros_of(make: Callable[[], Any]) -> Any:
    """Zeros shaped as what `make()` returns, computing none of it (the idle side of a
    branch that may skip work)."""
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(make))
