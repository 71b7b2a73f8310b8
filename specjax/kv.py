"""Functional paged KV state.

Shapes (letters used across specjax):
    L layers, B batch rows, T new tokens, S = pages_per_seq * page_size slots per row,
    P pages in the pool, Z page_size, K kv heads, G query heads per kv head, H = K * G,
    E head_dim, D hidden size, V vocabulary.

A rejection is a length change, not a copy: every step writes its tokens at absolute
positions and attention masks keys by position, so later steps overwrite rejected slots.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import struct

from . import cpu_kernels
from .config import Qwen3Config


@partial(jax.jit, static_argnums=(0, 1))
def zeros(shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
    """jnp.zeros(shape, dtype) in one compiled call (a pool, made once per engine). Outside a
    trace jnp.zeros dispatches its primitives one by one: ~1.6 ms for a test model's pool
    against 0.06 ms, paid by every `generate` call, which builds an engine."""
    return jnp.zeros(shape, dtype)


@struct.dataclass
class KVCache:
    k: jax.Array           # [L, K, P, Z, E] key pool
    v: jax.Array           # [L, K, P, Z, E] value pool
    page_table: jax.Array  # [B, S // Z] int32: pool page of each logical page of a row
    lengths: jax.Array     # [B] int32: committed tokens held per row
    page_size: int = struct.field(pytree_node=False, default=16)

    @property
    def capacity(self) -> int:
        """Token slots per row (static)."""
        return self.page_table.shape[1] * self.page_size


def init(cfg: Qwen3Config, batch: int, capacity: int, dtype=jnp.float32, page_size: int = 16) -> KVCache:
    """An empty cache; each row owns `capacity / page_size` pages, laid out row after row."""
    if capacity % page_size:
        raise ValueError(f"capacity {capacity} must be a multiple of page_size {page_size}")
    pages = capacity // page_size
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, batch * pages, page_size, cfg.head_dim)
    return KVCache(
        k=zeros(shape, dtype),
        v=zeros(shape, dtype),
        page_table=jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages),
        lengths=jnp.zeros((batch,), jnp.int32),
        page_size=page_size,
    )


def write(pool: jax.Array, layer: jax.Array, new: jax.Array, page_table: jax.Array,
          start: jax.Array, page_size: int) -> jax.Array:
    """Store one layer's new entries [B, T, K, E] at positions start[b] + 0 .. T-1.

    One [K, E] dynamic_update_slice per token inside a fori_loop: XLA does these in place
    on the loop-carried pool (a scatter, or a page-sized read-modify-write, was lowered to
    copies of the whole pool: 20-100x slower). Positions past the row's capacity are dropped.
    """
    b_size, t, _, _ = new.shape
    z, n_pages = page_size, page_table.shape[1]
    for b in range(b_size):
        def body(i, pool, b=b):
            pos = start[b] + i
            page = page_table[b, jnp.minimum(pos // z, n_pages - 1)]
            at = (layer, 0, page, pos % z, 0)
            row = jax.lax.dynamic_index_in_dim(new[b], i, keepdims=False)[None, :, None, None, :]
            cur = jax.lax.dynamic_slice(pool, at, row.shape)
            return jax.lax.dynamic_update_slice(pool, jnp.where(pos < n_pages * z, row.astype(pool.dtype), cur), at)
        pool = jax.lax.fori_loop(0, t, body, pool)
    return pool


def write_layer(k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array, k: jax.Array, v: jax.Array,
                page_table: jax.Array, start: jax.Array, page_size: int) -> tuple[jax.Array, jax.Array]:
    """Both pools with one layer's new keys and values [B, T, K, E]: the in-place CPU kernel
    where it applies, else :func:`write` (the same stores)."""
    if cpu_kernels.applies_write(k_pool):
        return cpu_kernels.kv_write(k_pool, v_pool, layer, k, v, page_table, start,
                                    partial(write, page_size=page_size))
    return (write(k_pool, layer, k, page_table, start, page_size),
            write(v_pool, layer, v, page_table, start, page_size))


def layer_slots(pool: jax.Array, layer: jax.Array) -> jax.Array:
    """One layer's whole pool as [K, P * Z, E] slots in physical order (no copy of pages)."""
    _, k, p, z, e = pool.shape
    return pool[layer].reshape(k, p * z, e)


def row_slots(page_table: jax.Array, page_size: int) -> jax.Array:
    """[B, Pr * Z] the pool slot (page * Z + offset) that holds each position of each row:
    what attention reads, in position order, wherever a row's pages lie in the pool."""
    b, per_row = page_table.shape
    return (page_table[:, :, None] * page_size + jnp.arange(page_size, dtype=jnp.int32)).reshape(b, per_row * page_size)


def truncate(kv: KVCache, lengths: jax.Array) -> KVCache:
    """Forget everything at or after `lengths` [B] (a rollback; no data moves)."""
    return kv.replace(lengths=jnp.minimum(kv.lengths, lengths.astype(jnp.int32)))
