"""Draft trees: several candidate continuations of a row verified in one target step.

A step of width W scores nodes 0 .. W-1 of each row: node 0 is the row's last committed
token (the root), node i > 0 a drafted token whose parent is parents[:, i] < i (every
parent before its children). A chain is the tree whose parents are i - 1. Node i is
written at the row's position start + i but takes position start + depth(i) (RoPE, the
target's randomness), and attends to the committed prefix, its ancestors and itself
(`ancestor_bits`, `qwen3.visible`), so its logits are those of a forward over its own path.

The accepted path starts at the root and moves to the child whose token equals the target's
token at the current node (siblings are distinct, so there is at most one); where none does,
that target token is the bonus. Each committed token is the target's own draw at its
position, so output equals plain decoding token for token for any tree of deterministic
drafts. `compact` then moves the path's keys and values to the row's next positions, so
later steps see a plain prefix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MAX_NODES = 32  # ancestor sets are 32-bit masks (`qwen3.visible`)


def chain_parents(rows: int, width: int) -> jax.Array:
    """[rows, width] the parents of a chain: node i's parent is i - 1 (the root's -1)."""
    return jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32) - 1, (rows, width))


def depths(parents: jax.Array) -> jax.Array:
    """[R, W] each node's depth (the root's 0) from parents [R, W] in parent-first order."""
    w = parents.shape[1]
    depth = jnp.zeros(parents.shape, jnp.int32)
    for i in range(1, w):
        depth = depth.at[:, i].set(jnp.take_along_axis(depth, jnp.maximum(parents[:, i:i + 1], 0), axis=1)[:, 0] + 1)
    return depth


def ancestor_bits(parents: jax.Array) -> jax.Array:
    """[R, W] int32: bit j of node i set when node j is i's ancestor or i itself."""
    r, w = parents.shape
    if w > MAX_NODES:
        raise ValueError(f"a tree step has at most {MAX_NODES} nodes, got {w}")
    bits = jnp.zeros((r, w), jnp.uint32)
    for i in range(w):
        up = jnp.take_along_axis(bits, jnp.maximum(parents[:, i:i + 1], 0), axis=1)[:, 0]
        own = jnp.uint32(1 << i) | jnp.where(parents[:, i] >= 0, up, jnp.uint32(0))
        bits = bits.at[:, i].set(own)
    return jax.lax.bitcast_convert_type(bits, jnp.int32)


def walk(tokens: jax.Array, parents: jax.Array, n: jax.Array, target: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The accepted path of each row's tree.

    tokens [R, W] (node 0 the root), parents [R, W], n [R] drafted nodes (nodes 1 .. n are
    real), target [R, W] the target's token after each node. Returns (path [R, W]: the
    path's nodes from the root, padded past its end with the node ids themselves, and
    accepted [R]: drafted nodes on it). The committed tokens are target[path[j]] for
    j <= accepted."""
    r, w = tokens.shape
    ids = jnp.arange(w)
    real = (ids[None, :] >= 1) & (ids[None, :] <= n[:, None])
    cur = jnp.zeros(r, jnp.int32)
    going = jnp.ones(r, bool)
    path = jnp.broadcast_to(ids, (r, w)).astype(jnp.int32)
    accepted = jnp.zeros(r, jnp.int32)
    want = jnp.take_along_axis(target, cur[:, None], axis=1)
    for j in range(1, w):
        match = real & (parents == cur[:, None]) & (tokens == want)
        going = going & jnp.any(match, axis=1)
        cur = jnp.where(going, jnp.argmax(match, axis=1).astype(jnp.int32), cur)
        path = path.at[:, j].set(jnp.where(going, cur, path[:, j]))
        accepted = accepted + going
        want = jnp.take_along_axis(target, cur[:, None], axis=1)
    return path, accepted


def compact(k_pool: jax.Array, v_pool: jax.Array, page_table: jax.Array, page_size: int, start: jax.Array,
            path: jax.Array, write) -> tuple[jax.Array, jax.Array]:
    """Both pools [L, K, P, Z, E] with each row's entries at start + path[j] moved to
    start + j (j < W), every layer: the accepted path becomes a plain prefix. `write(k_pool,
    v_pool, layer, k, v, page_table, start)` stores a layer's [B, W, K, E] entries at start
    (`kv.write_layer`). A path is increasing, and every entry is read before any is written."""
    z = page_size
    src = start[:, None] + path  # [B, W] positions
    page = jnp.minimum(src // z, page_table.shape[1] - 1)
    slot = jnp.take_along_axis(page_table, page, axis=1) * z + src % z
    for layer in range(k_pool.shape[0]):
        flat_k = k_pool[layer].reshape(k_pool.shape[1], -1, k_pool.shape[-1])  # [K, P * Z, E]
        flat_v = v_pool[layer].reshape(v_pool.shape[1], -1, v_pool.shape[-1])
        k = jnp.take(flat_k, slot, axis=1).transpose(1, 2, 0, 3)  # [B, W, K, E]
        v = jnp.take(flat_v, slot, axis=1).transpose(1, 2, 0, 3)
        k_pool, v_pool = write(k_pool, v_pool, jnp.int32(layer), k, v, page_table, start)
    return k_pool, v_pool


def arrange(ranked: dict, n: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The first n [R] of each row's ranked candidate nodes (`lookup.tree`: best first, so
    every prefix of the ranking holds its nodes' ancestors) as a tree in breadth-first
    order (`capacity`: entries of the rows' tries). Returns (drafts [R, N], parents
    [R, N + 1] with the root first, main [R, N + 1]: nodes on the proposer's first
    candidate continuation, and the nodes drafted [R])."""
    r, count = ranked["token"].shape
    rank = jnp.arange(count)
    keep = ranked["valid"] & (rank[None, :] < n[:, None])
    order = jnp.argsort(jnp.where(keep, ranked["depth"] * count + rank, 2 * count * count + rank), axis=1)
    pick = lambda x: jnp.take_along_axis(x, order, axis=1)  # noqa: E731
    trie = ranked["trie"]  # each ranked node's index in its row's trie (the root is 0)
    kept = pick(keep)
    where = jnp.zeros((r, capacity), jnp.int32)  # trie index of a kept node -> its node index (0: root)
    where = jax.vmap(lambda w, t: w.at[t].set(jnp.arange(1, count + 1, dtype=jnp.int32), mode="drop"))(
        where, jnp.where(kept, pick(trie), capacity))
    parents = jnp.take_along_axis(where, jnp.maximum(pick(ranked["parent"]), 0), axis=1)
    parents = jnp.where(kept, parents, jnp.arange(count)[None, :])  # padding: a chain off the last node
    drafts = jnp.where(kept, pick(ranked["token"]), 0)
    root = jnp.zeros((r, 1), jnp.int32)
    main = jnp.concatenate([jnp.ones((r, 1), bool), kept & pick(ranked["main"])], axis=1)
    return drafts, jnp.concatenate([root - 1, parents], axis=1), main, jnp.sum(keep, axis=1).astype(jnp.int32)
