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


def _doubling_steps(w: int) -> int:
    """Pointer-doubling rounds that reach the root from any of w nodes (a path holds at most w)."""
    return max(0, (w - 1).bit_length())


def depths(parents: jax.Array) -> jax.Array:
    """[R, W] each node's depth (the root's 0) from parents [R, W] in parent-first order.

    By pointer doubling: each node holds its distance to a pointer up the tree and moves
    the pointer to the pointer's own, doubling the span each round, so log2(W) rounds of
    whole-row gathers replace a pass over the nodes one by one (less to compile, and
    nothing sequential in W)."""
    w = parents.shape[1]
    up = jnp.maximum(parents, 0).at[:, 0].set(0)  # the root points at itself
    depth = (jnp.arange(w) > 0).astype(jnp.int32) + jnp.zeros_like(parents)
    for _ in range(_doubling_steps(w)):
        depth = depth + jnp.take_along_axis(depth, up, axis=1)
        up = jnp.take_along_axis(up, up, axis=1)
    return depth


def ancestor_bits(parents: jax.Array) -> jax.Array:
    """[R, W] int32: bit j of node i set when node j is i's ancestor or i itself (a node
    whose parent is < 0 has no ancestors). By pointer doubling, as `depths`."""
    r, w = parents.shape
    if w > MAX_NODES:
        raise ValueError(f"a tree step has at most {MAX_NODES} nodes, got {w}")
    ids = jnp.arange(w, dtype=jnp.uint32)
    bits = jnp.broadcast_to(jnp.left_shift(jnp.uint32(1), ids), (r, w))
    up = parents.astype(jnp.int32)  # bits[i] covers i up to (not including) up[i]; -1: the path's end
    for _ in range(_doubling_steps(w)):
        there = up >= 0
        at = jnp.maximum(up, 0)
        bits = bits | jnp.where(there, jnp.take_along_axis(bits, at, axis=1), jnp.uint32(0))
        up = jnp.where(there, jnp.take_along_axis(up, at, axis=1), -1)
    return jax.lax.bitcast_convert_type(bits, jnp.int32)


def walk(tokens: jax.Array, parents: jax.Array, n: jax.Array, target: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The accepted path of each row's tree.

    tokens [R, W] (node 0 the root), parents [R, W], n [R] drafted nodes (nodes 1 .. n are
    real), target [R, W] the target's token after each node. Returns (path [R, W]: the
    path's nodes from the root, padded past its end with the node ids themselves, and
    accepted [R]: drafted nodes on it). The committed tokens are target[path[j]] for
    j <= accepted.

    A real node holds when its token is the target's token at its parent; the walk from
    the root reaches exactly the nodes all of whose ancestors (and they themselves) hold,
    at most one per depth because siblings carry distinct tokens. So the path is read off
    the ancestor masks at once instead of stepping down the tree."""
    r, w = tokens.shape
    ids = jnp.arange(w)
    real = (ids[None, :] >= 1) & (ids[None, :] <= n[:, None])
    holds = real & (parents >= 0) & (tokens == jnp.take_along_axis(target, jnp.maximum(parents, 0), axis=1))
    holds = holds | (ids[None, :] == 0)
    held = jnp.sum(jnp.where(holds, jnp.left_shift(jnp.uint32(1), ids.astype(jnp.uint32)), jnp.uint32(0)),
                   axis=1, dtype=jnp.uint32)
    bits = jax.lax.bitcast_convert_type(ancestor_bits(parents), jnp.uint32)
    on = (bits & ~held[:, None]) == 0  # every node from the root down to it holds
    depth = depths(parents)
    path = jax.vmap(lambda p, d, o: p.at[jnp.where(o, d, w)].set(ids.astype(jnp.int32), mode="drop"))(
        jnp.broadcast_to(ids, (r, w)).astype(jnp.int32), depth, on)
    return path, (jnp.sum(on, axis=1) - 1).astype(jnp.int32)


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
    every prefix of the ranking holds its nodes' ancestors) as a tree (`capacity`: entries
    of the rows' tries): the proposer's first candidate continuation (its "main" nodes)
    first, so that when the target takes it the path is already a plain prefix and
    `compact` has nothing to move, then the other nodes in breadth-first order; either way
    every parent comes before its children. Returns (drafts [R, N], parents [R, N + 1]
    with the root first, main [R, N + 1]: the nodes of that first continuation, and the
    nodes drafted [R])."""
    r, count = ranked["token"].shape
    rank = jnp.arange(count)
    keep = ranked["valid"] & (rank[None, :] < n[:, None])
    ranks = jnp.broadcast_to(rank, (r, count))  # kept main nodes, then kept others, each by depth then rank
    order = jnp.lexsort((ranks, ranked["depth"], ~ranked["main"], ~keep), axis=1)
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
