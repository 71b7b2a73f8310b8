"""The engine's model proposers on the device, over the rows' shared page table.

- A draft model (a smaller Qwen3 of the same vocabulary) has its own paged cache. Each
  round feeds it the row's newly committed tokens, which gives its first draft d1, and
  chains more steps when the round uses it.
- A DFlash drafter (`specjax.dflash`) has a paged cache of context rows (`DFlashCache`):
  per drafter layer the K / V of c = hidden_norm(fc(target taps)) of committed tokens.
  Every verify step (and prefill chunk) only stashes the target's taps at their
  positions, a copy (rows past what the row commits are stale and overwritten later). A
  round that uses the drafter first turns the stashed taps of every committed token but
  the newest into context rows (`catch_up`), then runs one block pass (`block_logits`):
  the block [last, mask x (B-1)] at the row's next positions is a Qwen3 stack whose every
  row attends to the context before the block and to the whole block. The block's own
  keys and values are written at the block's positions, where later context rows
  overwrite them; a pass at start s reads nothing at or past s that it did not write
  itself. Rounds that do not use the drafter cost it one copy of taps. A drafter with a
  Markov head then chooses the block's tokens left to right, each row's logits biased
  by the token chosen at the row before (`markov_drafts`), and a greedy row's tree gives
  each node the children its own token makes likeliest (`markov_tree`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from . import cpu_kernels, steps, trees
from . import kv as kvlib
from . import sampling as smp
from .checkpoint import LAYERS, Params
from .config import Qwen3Config
from .dflash import DRAFT_LAYERS, MARKOV, DFlashConfig, context_rows, markov_bias
from .kv import KVCache
from .qwen3 import head_weight, hidden_states, project, unembed
from .reductions import log_softmax_last, logsumexp_last
from .sampling import RowSampling
from .tree_accept import children_without_replacement

CATCH_UP_FAR = (16, 64)  # a row more than 16 behind (after a prompt) catches up 64 context rows a step


@struct.dataclass
class DFlashCache:
    """A DFlash drafter's paged state over the rows' page table."""

    kv: KVCache         # context K / V pools [L, K, P, Z, E]; kv.lengths unused
    taps: jax.Array     # [1, n, P, Z, D] the target's taps per position (a pool of one "layer")
    written: jax.Array  # [R] context rows written per row: positions 0 .. written - 1


def stash(fc: DFlashCache, taps: jax.Array, start: jax.Array) -> DFlashCache:
    """Keep target taps [n, R, T, D] (row r's tokens at start[r] + t) for later context rows."""
    pool = kvlib.write(fc.taps, jnp.int32(0), taps.transpose(1, 2, 0, 3), fc.kv.page_table, start,
                       fc.kv.page_size)
    return fc.replace(taps=pool)


def catch_up(fparams: Params, fcfg: DFlashConfig, fc: DFlashCache, upto: jax.Array) -> DFlashCache:
    """Context rows for every row's stashed positions written .. upto - 1: 64 at a time
    while some row is more than 16 behind (after a prompt; `CATCH_UP_FAR`), then a block's
    worth (fcfg.block_size) at a time: a round that drafted with the drafter commits at
    most that many tokens, so one such step follows it (a round of a wider lookup chain
    takes two; a step's cost grows with its width). A row already there rewrites
    positions past upto, which nothing reads yet."""
    _, n, _, _, d = fc.taps.shape
    flat = fc.taps[0].reshape(n, -1, d)  # [n, P * Z, D]
    slots = kvlib.row_slots(fc.kv.page_table, fc.kv.page_size)  # [R, N]

    def body(fc, width):
        at = jnp.minimum(fc.written[:, None] + jnp.arange(width), slots.shape[1] - 1)
        taps = flat[:, jnp.take_along_axis(slots, at, axis=1)]  # [n, R, width, D]
        kv = write_context(fparams, fcfg, fc.kv, taps, fc.written)
        return fc.replace(kv=kv, written=jnp.maximum(fc.written, jnp.minimum(upto, fc.written + width)))

    far, wide = CATCH_UP_FAR
    fc = jax.lax.while_loop(lambda fc: jnp.any(upto - fc.written > far), lambda fc: body(fc, wide), fc)
    return jax.lax.while_loop(lambda fc: jnp.any(fc.written < upto), lambda fc: body(fc, fcfg.block_size), fc)


def draft_token(logits: jax.Array, positions: jax.Array, seeds: jax.Array, rs: RowSampling, sample: jax.Array,
                 sample_drafts: bool):
    """The draft model's token for each row [R] (its argmax, or where `sample` is set a
    draw from its transformed distribution, keyed by (seed, DRAFT stream, position)), and
    the draft log-probs [R, V] when drafts may be sampled."""
    greedy = smp.argmax(logits)
    if not sample_drafts:
        return greedy, None
    keys = jax.vmap(lambda s, p: smp.position_key(s, smp.DRAFT, p))(seeds, positions)
    logq = smp.transform_rows(logits, rs)
    drawn = jax.vmap(smp.sample)(logq, keys)
    return jnp.where(sample, drawn, greedy), logq


def feed(dparams: Params, dcfg: Qwen3Config, dkv: KVCache, history: jax.Array, size: jax.Array, width: int):
    """Append history[dlen : size] (the committed tokens the draft cache lacks, dlen =
    dkv.lengths), at most `width` of them, to the draft cache; returns (draft logits after
    the last fed [R, V], cache). Slots up to dlen + width - 1 are written."""
    rows = history.shape[0]
    start = dkv.lengths
    at = start[:, None] + jnp.arange(width)
    tokens = jnp.take_along_axis(history, jnp.minimum(at, history.shape[1] - 1), axis=1)
    h, dkv, _ = hidden_states(dparams, dcfg, tokens, at, dkv)
    last = jnp.clip(size - start - 1, 0, width - 1)
    logits = unembed(dparams, dcfg, h[jnp.arange(rows), last])
    return logits, dkv.replace(lengths=jnp.maximum(jnp.minimum(size, start + width), start))


def chain(dparams: Params, dcfg: Qwen3Config, dkv: KVCache, first: jax.Array, first_logq: jax.Array | None,
           size: jax.Array, n_steps: jax.Array, k: int, seeds: jax.Array, rs: RowSampling, sample: jax.Array,
           sample_drafts: bool):
    """Drafts d1 .. d_{1 + n_steps} [R, k] (d1 given, at position size) by n_steps chained
    draft-model steps, each feeding the previous draft; their log-probs [R, k, V] or None."""
    drafts = jnp.zeros((first.shape[0], k), jnp.int32).at[:, 0].set(first)
    logq = None if first_logq is None else jnp.zeros((first.shape[0], k, first_logq.shape[-1])).at[:, 0].set(first_logq)

    def body(j, c):
        dkv, drafts, logq = c
        pos = size + j - 1
        h, dkv, _ = hidden_states(dparams, dcfg, drafts[:, j - 1][:, None], pos[:, None], dkv)
        token, lq = draft_token(unembed(dparams, dcfg, h[:, 0]), pos + 1, seeds, rs, sample, sample_drafts)
        drafts = drafts.at[:, j].set(token)
        return dkv, drafts, (None if logq is None else logq.at[:, j].set(lq))

    dkv, drafts, logq = jax.lax.fori_loop(1, 1 + n_steps, body, (dkv, drafts, logq))
    return drafts, logq, dkv


TREE_FRONTIER = 4  # nodes a draft-model tree expands per depth (EAGLE-2's top-k)


def draft_tree_shape(nodes: int) -> tuple[int, int]:
    """(frontier K, depth D) of a draft-model tree of at most `nodes` nodes (`draft_tree`):
    K = min(TREE_FRONTIER, nodes) nodes expanded per depth, and as deep as the budget (a
    confident draft's best tree is its chain) while the (D - 1) * K fed nodes fit one
    32-slot ancestor window (`qwen3.visible`): D = min(nodes, 1 + 32 // K)."""
    width = min(TREE_FRONTIER, nodes)
    return width, min(nodes, 1 + trees.MAX_NODES // width)


def draft_tree_slots(nodes: int) -> int:
    """Draft-cache slots past a row's committed tokens that its tree of `nodes` writes."""
    width, depth = draft_tree_shape(nodes)
    return (depth - 1) * width


def draft_tree_capacity(nodes: int) -> int:
    """Candidate entries of a draft-model tree of `nodes` (`draft_tree`), the root first."""
    width, depth = draft_tree_shape(nodes)
    return 1 + width + (depth - 1) * width * width


def draft_tree(dparams: Params, dcfg: Qwen3Config, dkv: KVCache, logits: jax.Array, size: jax.Array, nodes: int,
               levels: jax.Array) -> tuple[dict, jax.Array, jax.Array, KVCache]:
    """A draft model's best tree of `nodes` (static) greedy drafts after each row's
    committed tokens (EAGLE-2, Li et al. 2024, arXiv:2406.16858: a dynamic tree by
    cumulative draft log-probability).

    logits [R, V]: the draft's logits after the row's last committed token (at position
    size - 1; the cache holds positions 0 .. size - 1). Depth 1's candidates are the top
    K tokens of their log-softmax (K, D: `draft_tree_shape`). Then `levels` times (traced;
    D - 1 at most): the frontier, the K candidates of the newest depth with the highest
    cumulative log-probability (the path's summed log-softmax), goes through the draft
    model in one step, each node at its depth's position and attending to the committed
    tokens, its ancestors and itself (`qwen3.hidden_states` with ancestor bits), and each
    frontier node's top K tokens become the next depth's K * K candidates. The frontier of
    depth l is written at slots size + (l - 1) K + j (j < K), which later rounds
    overwrite but for the accepted path's (`tree_kept`). Every candidate is then ranked by its
    cumulative log-probability; a child adds a log-prob <= 0 to its parent's and comes
    later in candidate order, which breaks ties, so a node never ranks above its parent
    and any first n of the ranking is a tree (`trees.arrange` lays it out). "main" marks
    the draft's greedy chain (each node its parent's argmax child) as far as the
    candidates hold it.

    Returns ({"token", "parent" (candidate index, the root 0), "trie", "depth", "main",
    "valid"} each [R, min(nodes, candidates)], over `draft_tree_capacity(nodes)` entries;
    the greedy chain [R, D]; its length among the candidates [R]; the fed nodes (tokens
    [R, D - 1, K] of each depth's slots, -1 where none was fed, and the slot of each one's
    parent at the depth before, for `tree_kept`); the draft cache)."""
    rows = logits.shape[0]
    width, depth = draft_tree_shape(nodes)
    count = draft_tree_capacity(nodes) - 1
    cand_depth = np.concatenate([np.ones(width, np.int32)] + [np.full(width * width, d, np.int32)
                                                              for d in range(2, depth + 1)])
    top, tok = cpu_kernels.top_k(log_softmax_last(logits.astype(jnp.float32)), width)
    token = jnp.zeros((rows, count), jnp.int32).at[:, :width].set(tok.astype(jnp.int32))
    score = jnp.full((rows, count), -jnp.inf, jnp.float32).at[:, :width].set(top)
    parent = jnp.full((rows, count), -1, jnp.int32)  # candidate index of the parent; -1: the root
    main = jnp.zeros((rows, count), bool).at[:, 0].set(True)
    frontier = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (rows, width))  # candidate indices
    above = jnp.zeros((rows, width), jnp.uint32)  # a frontier node's ancestors: bit o = slot size + o
    lane = jnp.arange(width)

    def level(l, c):
        dkv, token, score, parent, main, frontier, above, fed, up = c
        at = size + (l - 1) * width  # this depth's slots
        own = above | jnp.left_shift(jnp.uint32(1), ((l - 1) * width + lane).astype(jnp.uint32))[None, :]
        feeding = jnp.take_along_axis(token, frontier, axis=1)
        fed = jax.lax.dynamic_update_slice_in_dim(fed, feeding[:, None], l - 1, axis=1)
        h, dkv, _ = hidden_states(dparams, dcfg, feeding,
                                  jnp.broadcast_to((size + l - 1)[:, None], (rows, width)), dkv,
                                  sees=at[:, None] + lane, ancestors=jax.lax.bitcast_convert_type(own, jnp.int32),
                                  at=at, base=size)
        lp, child = cpu_kernels.top_k(log_softmax_last(unembed(dparams, dcfg, h)), width)  # [R, K, K]
        scores = (jnp.take_along_axis(score, frontier, axis=1)[:, :, None] + lp).reshape(rows, -1)
        first = width + (l - 1) * width * width  # the block of depth l + 1, parent-major
        put = lambda x, new: jax.lax.dynamic_update_slice_in_dim(x, new, first, axis=1)  # noqa: E731
        token = put(token, child.reshape(rows, -1).astype(jnp.int32))
        score = put(score, scores)
        parent = put(parent, jnp.repeat(frontier, width, axis=1))
        main = put(main, (jnp.take_along_axis(main, frontier, axis=1)[:, :, None] & (lane == 0)).reshape(rows, -1))
        _, best = cpu_kernels.top_k(scores, width)  # the next frontier, and its ancestors: its parents' and theirs
        up = jax.lax.dynamic_update_slice_in_dim(up, (best // width).astype(jnp.int32)[:, None], l, axis=1)
        return (dkv, token, score, parent, main, first + best.astype(jnp.int32),
                jnp.take_along_axis(own, best // width, axis=1), fed, up)

    fed = jnp.full((rows, depth - 1, width), -1, jnp.int32)  # the tokens fed at each depth's slots (-1: none)
    up = jnp.full((rows, depth, width), -1, jnp.int32)  # each fed node's parent among the depth before's slots
    if depth > 1:  # (a tree of one node is the root's best child: no draft step)
        carry = (dkv, token, score, parent, main, frontier, above, fed, up)
        dkv, token, score, parent, main, _, _, fed, up = jax.lax.fori_loop(
            1, 1 + jnp.minimum(levels, depth - 1), level, carry)
    best, pick = cpu_kernels.top_k(score, min(nodes, count))  # ties: the lower index, so a parent first
    take = lambda x: jnp.take_along_axis(x, pick, axis=1)  # noqa: E731
    ranked = {"token": take(token), "parent": take(parent) + 1, "trie": (pick + 1).astype(jnp.int32),
              "depth": jnp.asarray(cand_depth)[pick], "main": take(main), "valid": best > -jnp.inf}
    by_depth = jnp.asarray(cand_depth[:, None] == np.arange(1, depth + 1)[None, :], jnp.int32)  # [C, D]
    on_chain = (main & (score > -jnp.inf)).astype(jnp.int32)
    greedy = jnp.einsum("rc,cd->rd", on_chain * token, by_depth)
    return ranked, greedy, jnp.sum(on_chain, axis=1).astype(jnp.int32), (fed, up[:, :depth - 1]), dkv


def tree_kept(fed: tuple[jax.Array, jax.Array], out: jax.Array, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """How much of a round's committed tokens out[:, :count] [R, >= D] a draft-model tree's
    fed nodes hold (`draft_tree`'s fed tokens and their parents' slots [R, D - 1, K]): the
    accepted drafts, from the first, while each is the fed child of the one before (never
    the newest token, which was not drafted). Returns (kept [R], slots [R, D - 1]: the
    offset past the committed tokens where the kept draft of each depth sits, else the
    depth's own offset, so that `rounds.compact_paths` moves the kept ones into place)."""
    tokens, up = fed
    rows, levels, width = tokens.shape
    if not levels:  # a tree of one node fed nothing
        return jnp.zeros(rows, jnp.int32), jnp.zeros((rows, 0), jnp.int32)
    kept, lane = jnp.zeros(rows, jnp.int32), jnp.full(rows, -1, jnp.int32)
    slots, going = [], jnp.ones(rows, bool)
    for d in range(levels):
        match = (tokens[:, d] == out[:, d:d + 1]) & ((up[:, d] == lane[:, None]) if d else True)
        going = going & jnp.any(match, axis=1) & (d + 1 < count)
        lane = jnp.where(going, jnp.argmax(match, axis=1).astype(jnp.int32), lane)
        kept = kept + going
        slots.append(jnp.where(going, d * width + lane, d))
    return kept, jnp.stack(slots, axis=1)


def draft_sampled_tree(drafts: jax.Array, logq: jax.Array, size: jax.Array, seeds: jax.Array, nodes: jax.Array,
                       width: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """A tree of SAMPLED draft-model drafts, verified by `tree_accept.accept_tree_rows`.

    The shape is `sampled_tree`'s, fixed by the node budget alone (`sampled_tree_shape`):
    a spine, the chain's own draws (`chain`, so a tree row's randomness is its chain's),
    and second children under the shallowest spine nodes. Unlike a DFlash block's, the
    draft's q depends on the path, so node d's children must come from q after spine node
    d, which is what the chain's step there gave (logq[:, d]): the second child is the
    second token of a draw without replacement (`children_without_replacement`) from that
    q on the chain's own key there (seed, DRAFT stream, position size + d), whose first
    token is the spine's. So no draft step beyond the chain's is needed, and every node's
    children's q is the chain's logq at the node's id: the spine keeps its ids, and the
    second children are leaves, whose q the rule never reads. Deeper trees (subtrees under
    second children) would need draft steps over them, and cost a frontier as
    `draft_tree` does.

    drafts [R, >= width] the chain's draws (d1 at position size); logq [R, >= width, V]
    their q; seeds [R]; nodes [R] (at most width, the static most nodes). Returns (tokens
    [R, width], parents [R, width + 1] with the root first, main [R, width + 1]: the
    spine, the nodes drafted [R])."""
    depth = max(1, width // 3) if width >= 2 else 0  # most second children (`sampled_tree_shape`)
    keys = jax.vmap(lambda s, p: jax.vmap(lambda q: smp.position_key(s, smp.DRAFT, q))(p))(
        seeds, size[:, None] + jnp.arange(depth))
    pairs = jax.vmap(jax.vmap(lambda lq, key: children_without_replacement(lq, key, 2)))(logq[:, :depth], keys)
    second = jnp.pad(pairs[..., 1], ((0, 0), (0, width - depth)), constant_values=-1)
    tokens, parents, main, n, _ = sampled_tree(drafts, second, nodes, width)
    return tokens, parents, main, n


def write_context(fparams: Params, fcfg: DFlashConfig, fkv: KVCache, taps: jax.Array, start: jax.Array) -> KVCache:
    """Context rows of target taps [n, R, T, D] (row r's tokens at start[r] + t) into the
    DFlash pools; lengths are not kept here (the target cache's lengths are the context's)."""
    n, rows, t, d = taps.shape
    x = taps.transpose(1, 2, 0, 3).reshape(rows, t, n * d)  # [R, T, n*D] in target_layer_ids order
    k_pool, v_pool = fkv.k, fkv.v
    for i, (k, v) in enumerate(context_rows(fparams, fcfg, x, start[:, None] + jnp.arange(t))):
        k_pool, v_pool = kvlib.write_layer(k_pool, v_pool, jnp.int32(i), k, v, fkv.page_table, start, fkv.page_size)
    return fkv.replace(k=k_pool, v=v_pool)


class Head(NamedTuple):
    """What a DFlash block is scored with when the drafter has a draft vocabulary of N
    tokens (`draft_head`)."""

    rows: jax.Array | cpu_kernels.Packed  # the target head's rows of the vocabulary [N, D]
    ids: jax.Array  # their token ids [N]
    # the drafter's Markov head over the vocabulary: w1 [V, r] (any previous token) and w2's
    # rows of the vocabulary [N, r], taken once here rather than in every block pass; None
    # for a drafter without one
    markov: Params | None


def draft_head(params: Params, cfg: Qwen3Config, vocab: np.ndarray, markov: Params | None) -> Head:
    """The head of a draft vocabulary `vocab` (token ids): the target head's rows of it
    (stored as the head is: packed, in its panels' dtype, where the CPU kernel runs), the
    ids, and the drafter's Markov head `markov` (its params[MARKOV], or None) over it."""
    ids = jnp.asarray(vocab, jnp.int32)
    over = None if markov is None else {"w1": markov["w1"], "w2": markov["w2"][ids]}
    return Head(cpu_kernels.select(head_weight(params, cfg), ids), ids, over)


def _markov_over(markov: Params, head: Head | None) -> Params:
    """A drafter's Markov head over the vocabulary its block scores: as loaded, or a draft
    vocabulary's (`Head.markov`)."""
    if head is None:
        return markov
    if head.markov is None:
        raise ValueError("the drafter has a Markov head: build its draft vocabulary's head with "
                         "draft_head(..., markov=drafter.params[MARKOV])")
    return head.markov


def block_logits(fparams: Params, fcfg: DFlashConfig, fkv: KVCache, params: Params, cfg: Qwen3Config,
                 last: jax.Array, start: jax.Array, k: int, head: Head | None = None) -> tuple[jax.Array, KVCache]:
    """DFlash draft logits [R, k, V] for the k tokens after each row's `last` (at position
    start [R]): one pass of the block [last, mask x (B-1)] (module docstring). With a draft
    vocabulary's `head`, logits [R, k, N] over its tokens only."""
    b = fcfg.block_size
    tokens = jnp.full((last.shape[0], b), fcfg.mask_token_id, jnp.int32).at[:, 0].set(last)
    positions = start[:, None] + jnp.arange(b)
    sees = jnp.broadcast_to(positions[:, -1:], positions.shape)
    # the drafter layers as a Qwen3 stack over the target's embedding
    view = {"model.embed_tokens.weight": params["model.embed_tokens.weight"], LAYERS: fparams[DRAFT_LAYERS],
            "model.norm.weight": fparams["norm.weight"]}
    h, fkv, _ = hidden_states(view, fcfg.layer_config, tokens, positions, fkv, sees=sees)
    h = h[:, 1:k + 1]
    return (unembed(params, cfg, h) if head is None else project(head.rows, h)), fkv


TREE_BRANCH = 2  # children a DFlash tree considers per node: the block row's top-2 tokens
TREE_DETOURS = 2  # a DFlash tree's paths take a block row's second token at most this often


@functools.lru_cache(maxsize=None)
def _tree_candidates(k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The prefixes a DFlash tree of depth <= k chooses from, by depth: (second [C, k] bool,
    which block rows take their second token; depth [C]; parent [C], the prefix one
    shorter, -1 for depth 1), every path with at most TREE_DETOURS second tokens."""
    depth, parent, second = [], [], []
    index = {}
    for d in range(1, k + 1):
        for detours in (c for n in range(TREE_DETOURS + 1) for c in itertools.combinations(range(d), n)):
            up = tuple(x for x in detours if x < d - 1)
            index[(d, detours)] = len(depth)
            depth.append(d)
            parent.append(index[(d - 1, up)] if d > 1 else -1)
            second.append([j in detours for j in range(k)])
    return np.array(second, bool), np.array(depth, np.int32), np.array(parent, np.int32)


def tree_capacity(k: int, nodes: int, markov: bool) -> int:
    """Trie entries of a DFlash tree of `nodes` over k block rows, the root first: every
    candidate `block_tree` ranks, or with a Markov head the nodes of `markov_tree`."""
    return nodes + 1 if markov else 1 + len(_tree_candidates(k)[1])


def block_tree(logits: jax.Array, head: Head | None, nodes: int) -> dict:
    """A DFlash block's best `nodes` continuations as a ranked tree (DDTree, Ringel and
    Romano 2026, arXiv:2604.12989: the per-position top tokens of one block pass, scored by
    summed log-probability). The block's rows do not condition on each other, so the
    children of a node at depth d are block row d's top TREE_BRANCH tokens whatever the
    node, and a path's score is the sum of its tokens' log-softmax. Every path that takes a
    row's second token at most TREE_DETOURS times is scored at once (DDTree's best-first
    heap, without its loop); a path scores no higher than its prefix and prefixes come
    first on ties, so any first n of the ranking is a tree (`trees.arrange` lays it out).
    "main" marks the argmax chain.

    logits [R, k, N] (N: the vocabulary, or a draft vocabulary whose ids `head` holds).
    Returns {"token", "parent" (candidate index), "trie", "depth", "main", "valid"} each
    [R, nodes], over `tree_capacity(k, nodes, False)` candidates."""
    k = logits.shape[1]
    second, depth, parent = _tree_candidates(k)
    x = logits.astype(jnp.float32)
    # log-softmax of the top tokens only (of the whole row, XLA fused it into every use: 2 ms)
    top, idx = cpu_kernels.top_k(x, TREE_BRANCH)
    lp = top - logsumexp_last(x)
    tok = (idx if head is None else head.ids[idx]).astype(jnp.int32)  # [R, k, 2]
    within = np.arange(k)[None, :] < depth[:, None]  # [C, k]: block rows on the path
    pick = jnp.where(jnp.asarray(second)[None], lp[:, None, :, 1], lp[:, None, :, 0])  # [R, C, k]
    score = jnp.sum(jnp.where(jnp.asarray(within)[None], pick, 0.0), axis=-1)
    last = depth - 1  # the block row of a candidate's own token
    own = jnp.where(jnp.asarray(second[np.arange(len(depth)), last])[None], tok[:, last, 1], tok[:, last, 0])
    nodes = min(nodes, len(depth))
    best, at = cpu_kernels.top_k(score, nodes)  # ties: the lower index, so a prefix before its extensions
    cand = lambda table: jnp.asarray(table)[at]  # noqa: E731
    return {"token": jnp.take_along_axis(own, at, axis=1), "parent": cand(parent + 1),
            "trie": (at + 1).astype(jnp.int32), "depth": cand(depth), "main": cand(~second.any(axis=1)),
            "valid": best > -jnp.inf}


MARKOV_BRANCH = 3  # children a Markov-head DFlash tree considers per node


def markov_tree(markov: Params, logits: jax.Array, last: jax.Array, head: Head | None, nodes: int) -> dict:
    """A DFlash block's best `nodes` continuations through a Markov head, best first.

    With the head a block row's logits depend on the token chosen at the row before
    (`dflash.markov_bias`), so unlike `block_tree` the children of a node are the top
    MARKOV_BRANCH tokens of the node's own row biased by the node's own token. DDTree's
    best-first loop (Ringel and Romano 2026, arXiv:2604.12989) run for `nodes` steps: take
    the open candidate with the highest summed log-softmax (ties: the earlier candidate),
    make it the next node, and open its children. A child's score is at most its parent's
    and it opens only after its parent is taken, so any first n of the nodes is a tree.
    "main" marks the argmax chain: the drafts `markov_drafts` chooses for a greedy row.

    logits [R, k, N]: `block_logits`' (unbiased; N: the vocabulary, or a draft
    vocabulary whose ids `head` holds, with its Markov head `head.markov` used in place of
    `markov`, the drafter's params[MARKOV]); last [R] the token before the block. Returns
    {"token", "parent" (the parent's trie index, the root 0), "trie" (node i's: i + 1),
    "depth", "main", "valid"} each [R, nodes], over `tree_capacity(k, nodes, True)` trie
    entries."""
    rows, k, _ = logits.shape
    branch = min(MARKOV_BRANCH, logits.shape[-1])
    slots = branch * (nodes + 1)  # the root's children, then branch per node
    markov = _markov_over(markov, head)
    rowwise = jnp.arange(rows)

    def children(at: jax.Array, prev: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(log-softmax [R, branch], tokens [R, branch]) of block row `at` [R] after `prev` [R]."""
        biased = logits[rowwise, at].astype(jnp.float32) + markov_bias(markov, prev)
        top, idx = cpu_kernels.top_k(biased, branch)
        tok = idx if head is None else head.ids[idx]
        return top - logsumexp_last(biased), tok.astype(jnp.int32)

    lane = jnp.arange(branch)

    def opened(tok: jax.Array, parent: jax.Array | int, depth: jax.Array, main: jax.Array) -> jax.Array:
        """[R, branch, 4] the fields of candidates just opened (token, parent's trie index,
        depth, on the main chain), one int32 array so a step moves them in one op."""
        shape = (rows, branch)
        return jnp.stack([tok, jnp.broadcast_to(parent, shape), jnp.broadcast_to(depth[:, None], shape),
                          (main[:, None] & (lane == 0)[None, :]).astype(jnp.int32)], axis=-1)

    lp, tok = children(jnp.zeros(rows, jnp.int32), last.astype(jnp.int32))
    score = jnp.full((rows, slots), -jnp.inf, jnp.float32).at[:, :branch].set(lp)  # an open candidate's
    fields = jnp.zeros((rows, slots, 4), jnp.int32).at[:, :branch].set(
        opened(tok, 0, jnp.ones(rows, jnp.int32), jnp.ones(rows, bool)))
    taken = (jnp.zeros((rows, nodes, 4), jnp.int32), jnp.zeros((rows, nodes), jnp.float32))

    def step(i, c):
        score, fields, (taken_fields, taken_score) = c
        best = jnp.argmax(score, axis=1)
        got, got_score = fields[rowwise, best], score[rowwise, best]
        taken = (taken_fields.at[:, i].set(got), taken_score.at[:, i].set(got_score))
        token, depth = got[:, 0], got[:, 2]
        lp, tok = children(jnp.minimum(depth, k - 1), token)
        grows = (got_score > -jnp.inf) & (depth < k)
        score = score.at[rowwise, best].set(-jnp.inf)  # taken: no longer open
        score = jax.lax.dynamic_update_slice_in_dim(
            score, jnp.where(grows[:, None], got_score[:, None] + lp, -jnp.inf), branch * (i + 1), axis=1)
        fields = jax.lax.dynamic_update_slice_in_dim(
            fields, opened(tok, i + 1, depth + 1, got[:, 3] > 0), branch * (i + 1), axis=1)
        return score, fields, taken

    _, _, (out, out_score) = jax.lax.fori_loop(0, nodes, step, (score, fields, taken))
    return {"token": out[..., 0], "parent": out[..., 1], "depth": out[..., 2], "main": out[..., 3] > 0,
            "valid": out_score > -jnp.inf,
            "trie": jnp.broadcast_to(jnp.arange(1, nodes + 1, dtype=jnp.int32), (rows, nodes))}


def block_drafts(fparams: Params, fcfg: DFlashConfig, fc: DFlashCache, params: Params, cfg: Qwen3Config,
                 last: jax.Array, start: jax.Array, k: int, seeds: jax.Array, rs: RowSampling, sample: jax.Array,
                 sample_drafts: bool, head: Head | None = None, tree_nodes: int = 0, ranks: jax.Array | bool = True,
                 pairs: jax.Array | bool = True) -> tuple[jax.Array, jax.Array | None, DFlashCache, dict | None]:
    """DFlash drafts [R, k] after the context catches up to `start` (argmax per block row,
    or where `sample` is set one independent draw per row from its transformed q, keyed by
    (seed, DRAFT stream, position)), their log-probs [R, k, V] when drafts may be sampled,
    the state, and with tree_nodes > 0 the block's ranked tree (`block_tree`; else None),
    which when drafts may be sampled also holds "second" [R, k]: per block row the second
    token of a draw without replacement (`tree_accept.children_without_replacement`) on the
    same DRAFT-stream noise, whose first token is that row's sampled draft (-1 where q has
    one token only): a sampled tree's second children (`sampled_tree`). With a draft
    vocabulary's `head`, q is zero outside it. With a Markov head (fparams[MARKOV]) the
    drafts and q are `markov_drafts`' and the tree `markov_tree`'s.

    `ranks` and `pairs` (traced bools) say whether this pass needs the ranked tree and the
    second tokens; where one is False it is zeros, and costs nothing to make."""
    fc = catch_up(fparams, fcfg, fc, start)
    logits, fkv = block_logits(fparams, fcfg, fc.kv, params, cfg, last, start, k, head)
    fc = fc.replace(kv=fkv)

    def ranking(make: Callable[[], dict]) -> dict | None:
        return jax.lax.cond(ranks, make, functools.partial(steps.zeros_of, make)) if tree_nodes else None

    if MARKOV in fparams:
        drafts, logq, second = markov_drafts(fparams[MARKOV], logits, last, start, seeds, rs, sample,
                                             sample_drafts, cfg.vocab_size, head, pairs if tree_nodes else False)
        ranked = ranking(lambda: markov_tree(fparams[MARKOV], logits, last, head, tree_nodes))
        if ranked is not None and second is not None:
            ranked = {**ranked, "second": second}
        return drafts, logq, fc, ranked
    rows = last.shape[0]
    ranked = ranking(lambda: block_tree(logits, head, tree_nodes))
    greedy = smp.argmax(logits)
    if head is not None:
        greedy = head.ids[greedy]
    if not sample_drafts:
        return greedy, None, fc, ranked
    positions = (start[:, None] + 1 + jnp.arange(k)).reshape(-1)
    logq = smp.transform_rows(_whole_vocabulary(logits, head, cfg.vocab_size).reshape(rows * k, -1), rs.repeat(k))
    drawn, second = _draws(logq, jnp.repeat(seeds, k), positions, pairs if tree_nodes else False)
    if tree_nodes:
        ranked = {**ranked, "second": second.reshape(rows, k)}
    return jnp.where(sample[:, None], drawn.reshape(rows, k), greedy), logq.reshape(rows, k, -1), fc, ranked


def _whole_vocabulary(logits: jax.Array, head: Head | None, vocab_size: int) -> jax.Array:
    """Logits [..., N] over a draft vocabulary's tokens as [..., V] (-inf elsewhere): q over
    the whole vocabulary, for the acceptance rule; as they are without one."""
    if head is None:
        return logits
    return jnp.full((*logits.shape[:-1], vocab_size), -jnp.inf, logits.dtype).at[..., head.ids].set(logits)


def _draws(logq: jax.Array, seeds: jax.Array, positions: jax.Array, pairs: jax.Array | bool
           ) -> tuple[jax.Array, jax.Array | None]:
    """Per row of logq [N, V] a draft token drawn with the (seed, DRAFT stream, position)
    noise (`smp.sample`'s draw), and unless `pairs` is False (static) the second token of a
    draw without replacement on the same noise, whose first is that token: drawn where
    `pairs` (a traced bool) is set, -1 where not."""
    keys = jax.vmap(lambda s, p: smp.position_key(s, smp.DRAFT, p))(seeds, positions)

    def single():
        return jax.vmap(smp.sample)(logq, keys)

    if pairs is False:
        return single(), None

    def both():
        pair = jax.vmap(lambda lq, key: children_without_replacement(lq, key, 2))(logq, keys)
        return pair[:, 0], pair[:, 1]

    return jax.lax.cond(pairs, both, lambda: (single(), jnp.full(logq.shape[:1], -1, jnp.int32)))


def markov_drafts(markov: Params, logits: jax.Array, last: jax.Array, start: jax.Array, seeds: jax.Array,
                  rs: RowSampling, sample: jax.Array, sample_drafts: bool, vocab_size: int, head: Head | None,
                  pairs: jax.Array | bool) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """A block's drafts chosen left to right through a Markov head (`dflash.markov_bias`):
    block row j's logits [R, N] (`block_logits`') plus the head's bias from the token
    chosen at row j - 1 (`last` for row 0); then its argmax, or where `sample` is set a
    draw from its transformed q keyed by (seed, DRAFT stream, position), as `block_drafts`
    draws. Every q is that of the tokens before it as drafted, so the acceptance rule
    sees the distribution that produced each draft. `markov`: the drafter's params[MARKOV]
    (with a draft vocabulary's `head`, `head.markov` instead).

    Returns (drafts [R, k], logq [R, k, V] when sample_drafts else None, unless `pairs` is
    False the second token of each row's draw without replacement [R, k] with
    sample_drafts (`_draws`) else None)."""
    markov = _markov_over(markov, head)
    ids = None if head is None else head.ids

    def row(prev, j):
        biased = logits[:, j].astype(jnp.float32) + markov_bias(markov, prev)  # [R, N]
        greedy = smp.argmax(biased)
        greedy = greedy if ids is None else ids[greedy]
        if not sample_drafts:
            return greedy, (greedy,)
        logq = smp.transform_rows(_whole_vocabulary(biased, head, vocab_size), rs)
        drawn, second = _draws(logq, seeds, start + 1 + j, pairs)
        chosen = jnp.where(sample, drawn, greedy)
        return chosen, (chosen, logq, greedy if second is None else second)

    _, out = jax.lax.scan(row, last.astype(jnp.int32), jnp.arange(logits.shape[1]))
    out = [x.swapaxes(0, 1) for x in out]  # rows first
    if not sample_drafts:
        return out[0], None, None
    return out[0], out[1], None if pairs is False else out[2]


def sampled_tree_shape(nodes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(spine, seconds) [R] of a sampled DFlash tree of `nodes` [R] nodes: the chain of the
    block's first `spine` draws and a second child under each of its first `seconds`
    nodes (the root first), seconds = max(1, nodes // 3) from 2 nodes on (0 below).
    A function of the node budget only, never of what was drawn: the rejection rule
    (`tree_accept`) is exact for a tree fixed before its tokens are drawn."""
    seconds = jnp.where(nodes >= 2, jnp.maximum(1, nodes // 3), 0)
    return nodes - seconds, seconds


def sampled_tree(drafts: jax.Array, second: jax.Array, nodes: jax.Array, width: int
                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """A tree of SAMPLED DFlash drafts, verified by `tree_accept.accept_tree_rows`.

    The shape is fixed by the node budget alone (`sampled_tree_shape`): a spine, the
    chain's own draws drafts[:, :spine] (node j at depth j), then the second children,
    node spine + d at depth d under spine node d - 1, the second token of block row d - 1's
    draw without replacement (`block_drafts`' "second", whose first is the spine's token).
    The block's rows do not condition on each other, so every node at depth d draws its
    children from q of block row d, as the rule asks, and in node-id order the siblings
    come in draw order. Second children that q cannot give (-1: one token has all its mass)
    are left out, the rest move up (a shape that depends on q's support, not on the draws).

    drafts, second [R, >= width]; nodes [R] (at most width, the static most nodes).
    Returns (tokens [R, width], parents [R, width + 1] with the root first (padding: a
    chain off the last node), main [R, width + 1]: the spine, the nodes drafted [R], depth
    [R, width + 1]: each node's depth, its children's block row)."""
    r = drafts.shape[0]
    spine, seconds = sampled_tree_shape(nodes)
    ids = jnp.arange(1, width + 1)[None, :]  # node ids 1 .. width; also the depths of the candidate seconds
    ok = (ids <= seconds[:, None]) & (second[:, :width] >= 0)
    order = jnp.argsort(jnp.where(ok, ids, width + ids), axis=1)  # the kept seconds first, shallowest first
    count = jnp.sum(ok, axis=1)
    on_spine = ids <= spine[:, None]
    s = jnp.clip(ids - spine[:, None] - 1, 0, width - 1)  # node j's place among the seconds
    sec_depth = jnp.take_along_axis(order, s, axis=1) + 1
    is_second = ~on_spine & (ids <= (spine + count)[:, None])
    tokens = jnp.where(on_spine, drafts[:, :width],
                       jnp.where(is_second, jnp.take_along_axis(second[:, :width], sec_depth - 1, axis=1), 0))
    parents = jnp.where(is_second, sec_depth - 1, ids - 1)
    depth = jnp.where(is_second, sec_depth, ids)
    root = jnp.zeros((r, 1), jnp.int32)
    return (tokens.astype(jnp.int32), jnp.concatenate([root - 1, parents], axis=1).astype(jnp.int32),
            jnp.concatenate([jnp.ones((r, 1), bool), on_spine], axis=1), (spine + count).astype(jnp.int32),
            jnp.concatenate([root, depth], axis=1).astype(jnp.int32))
