"""The engine's device side: R speculative rounds over a batch of rows in one compiled call.

One round, for every row at once:
1. draft: prompt lookup on the row's own history (the tokens after the latest earlier
   occurrence of its longest suffix of max_ngram .. min_ngram tokens) and the engine's
   model proposers (`specjax.drafters`): a draft model, fed the committed tokens its cache
   lacks, which gives d1, in rounds where some row expects the most tokens per second from
   it (every round of an engine that does not choose) or lags a round's worth behind (so a
   row that leaves it for lookup or plain steps pays for feeding it once per 16-31 tokens
   rather than once per round); chained W - 2 more steps when the round uses it (and some
   row takes it as a chain), or
   for rows with a tree budget its best tree (`drafters.draft_tree`: one draft step per
   depth over a frontier of the best nodes); a DFlash drafter, one block pass over its
   context rows when the round uses it;
2. choose: one verify width W for the step, which model proposers run, and each row's
   proposer and drafts, so that the batch's expected committed tokens per second is
   largest. A row's expected tokens come from its own acceptance per proposer (first and
   later drafts; for lookup per n-gram length matched; decayed counts), the cost of a step
   from measured times of steps of this many rows at each width, for each set of model
   proposers run (`StepCosts`), so speculation narrows as the batch fills;
3. verify and commit: every row's [last, d1 .. d_{W-1}] scored in one target step. A row
   with deterministic drafts keeps them up to the first that differs from the target's
   own position-keyed token, plus that token; a row with sampled model drafts takes the
   general rule (`sampling.accept_rows`; where the engine drafts trees, recursive
   rejection sampling without replacement, `tree_accept.accept_tree_rows`, the same on
   chains). A row with a tree budget drafts a tree instead of a chain: lookup rows the
   trie of their matches, draft-model rows with greedy drafts the model's best nodes by
   cumulative log-probability (EAGLE-2; the draft cache keeps the fed nodes of the
   accepted path, `drafters.tree_kept`, and the next feed feeds the rest) and with
   sampled drafts the
   chain plus second children (`drafters.draft_sampled_tree`, from the chain's own steps'
   q; the cache keeps the spine's committed prefix, as a chain's), DFlash rows the block's
   best tree (deterministic drafts) or,
   for sampled drafts, a tree whose shape the node budget alone fixes
   (`drafters.sampled_tree`: the chain plus second children, drawn without replacement at
   the shallowest depths; never a function of the round's draws, which the rule's
   exactness needs). The step's taps of the target (along the accepted path) become
   DFlash context rows;
4. score every proposer's drafts that the committed tokens decide (drafted or not), into
   that row's acceptance counts.
The choice is a function of committed tokens and past acceptance only (never of this
round's draft values), and each committed token is what plain decoding draws at its
position, so a row's output is, token for token, what it generates alone (for sampled
drafts: in distribution).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from . import sampling as smp
from . import steps, trees
from .checkpoint import Params
from .config import Qwen3Config
from .dflash import MARKOV, DFlashConfig
from .drafters import (DFlashCache, Head, block_drafts, chain, draft_sampled_tree, draft_token, draft_tree,
                       draft_tree_capacity, feed, sampled_tree, stash, tree_capacity, tree_kept)
from .kv import KVCache, write_layer
from .lookup import (ACCEPT_DECAY, PRIOR_ACCEPT, PSEUDO, capacity, expected_tokens, find, matches,
                     tree as lookup_tree)
from .qwen3 import hidden_states, unembed
from .sampling import RowSampling
from .tree_accept import accept_tree_rows

SPAN = steps.BUCKETS[-1]  # widest verify step: tokens a row commits per round at most
# draft-model feed widths: after a round it drafted, after any round, catching up a row that lags
FEEDS = (2, SPAN, 2 * SPAN)
DRAFT_COLUMN, HOST_COLUMN, DFLASH_COLUMN = 1, 2, 3  # past max_ngram: acceptance state columns
SOURCES = ("lookup", "draft", "dflash")  # where a round's drafts came from (lookup: or a host drafter)


CHAIN, TREE = 0, 1  # the two shapes of a row's drafts, as the "shapes" state indexes them
SHAPE_PRIOR = 1.0  # prior accepted depth of either shape, worth PSEUDO rounds: a tie (`rounds` breaks it)
# except a draft model's tree, measured (with the chain it holds) only in the rounds that grow it, whose draft
# steps cost more than the chain's: its prior has a row try it where a quarter deeper acceptance would pay
GROWN_PRIOR = 1.25
# an auto row that drafts the chain still has its lookup / DFlash tree built every MEASURE_EVERY-th round, so
# the depth its tree would hold stays measured while the rounds between skip the build's cost
MEASURE_EVERY = 4


def columns(max_ngram: int) -> int:
    """Acceptance-state columns: lookup per match length 0 .. max_ngram, the draft model,
    host drafts, DFlash."""
    return max_ngram + DFLASH_COLUMN + 1


def new_state(rows: int, max_ngram: int) -> dict:
    """The acceptance state of `rows` rows that have drafted nothing yet (`rounds`)."""
    counts = np.zeros((rows, 2, columns(max_ngram)), np.float32)
    return {"accepted": counts, "judged": counts.copy(), "shapes": np.zeros((rows, len(SOURCES), 2, 2), np.float32)}


def _forward(params: Params, cfg: Qwen3Config, kv: KVCache, last: jax.Array, drafts: jax.Array,
             parents: jax.Array | None, width: int, taps: tuple[int, ...]):
    """Run [last, d1 .. d_{W-1}] of every row [R] through the target at verify width
    `width` (static; a verify-width branch of `rounds`). With `parents` [R, >= W] the
    drafts are trees (`specjax.trees`; a chain row's parents are i - 1): node i sits at
    committed length + depth(i) and attends to the prefix and its ancestors.

    Returns (tokens [R, W], positions [R, W] (each node's absolute position), logits
    [R, W, V], cache, the target's taps [n, R, W, D] or None)."""
    rows = last.shape[0]
    start = kv.lengths
    tokens = jnp.concatenate([last[:, None], _fit(drafts, width - 1)], axis=1).astype(jnp.int32)
    steps_at = jnp.broadcast_to(jnp.arange(width), (rows, width))
    if parents is None:
        positions = start[:, None] + steps_at
        h, kv, tapped = hidden_states(params, cfg, tokens, positions, kv, taps)
    else:
        parents = parents[:, :width]
        positions = start[:, None] + trees.depths(parents)
        h, kv, tapped = hidden_states(params, cfg, tokens, positions, kv, taps, sees=start[:, None] + steps_at,
                                      ancestors=trees.ancestor_bits(parents))
    return tokens, positions, unembed(params, cfg, h), kv, tapped


def _commit(scratch: jax.Array | None, tokens: jax.Array, positions: jax.Array, own: jax.Array, width: jax.Array,
            n: jax.Array, live: jax.Array, general: jax.Array, logq: jax.Array | None, seeds: jax.Array,
            rs: RowSampling, parents: jax.Array | None, sampled_trees: bool, treed: jax.Array):
    """Each row's accepted prefix (trees: path) of a verify step of traced `width`, once
    after the width switch at the engine's widest width Wm: tokens, positions [R, Wm] of
    the step's nodes (`_forward`, padded past the width). Greedy engines pass the target's
    own tokens `own` [R, Wm]; sampled ones pass `scratch` [R, Wm, V], the step's logits in
    its first `width` columns, and the tokens are drawn here column by column (one
    compiled copy of the sampler whatever the width; with sampled model drafts each
    column's log-probabilities replace its logits). Rows where `general` is set take the
    rule for sampled drafts with their logq [R, >= n, V] (`sampling.accept_rows`, or with
    `sampled_trees` and `parents`, in a step where such a row is `treed` [R] (verifies a
    tree), `tree_accept.accept_tree_rows`, logq[:, i] the q node i's children were drawn
    from). Nodes past a row's n are never read.

    Returns (tokens [R, SPAN]: t_1 .. t_W, count [R] = accepted + 1 (0 for rows not live),
    path [R, SPAN] (the accepted path's nodes, then the node ids; the identity for
    chains), scratch)."""
    rows, wm = tokens.shape
    n = jnp.minimum(n, width - 1)
    if scratch is not None:
        def draw(j, carry):
            own, scratch = carry
            x = jax.lax.dynamic_index_in_dim(scratch, j, axis=1, keepdims=False)
            own = own.at[:, j].set(smp.target_tokens_rows(x, positions[:, j] + 1, seeds, rs, True))
            if logq is not None:
                scratch = jax.lax.dynamic_update_index_in_dim(scratch, smp.transform_rows(x, rs), j, axis=1)
            return own, scratch
        own, scratch = jax.lax.fori_loop(0, width, draw, (jnp.zeros((rows, wm), jnp.int32), scratch))
    ids = jnp.broadcast_to(jnp.arange(wm), (rows, wm))

    def chain_accepted():
        ok = (tokens[:, 1:] == own[:, :-1]) & (ids[:, :-1] < n[:, None])
        return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)

    if parents is None:
        out, path, accepted = own, ids, chain_accepted()
    else:  # the walk only in steps where some row verifies a tree (on a chain it is the chain's rule)
        parents = parents[:, :wm]

        def tree_walk():
            path, accepted = trees.walk(tokens, parents, n, own)
            return jnp.take_along_axis(own, path, axis=1), path, accepted

        out, path, accepted = jax.lax.cond(jnp.any(treed), tree_walk, lambda: (own, ids, chain_accepted()))
    if scratch is not None and logq is not None and wm > 1:
        lq = _fit(logq, wm - 1)
        def chains():
            g_out, g_accepted = smp.accept_rows(None, tokens[:, 1:], lq, n, positions + 1, seeds, rs, own, scratch)
            return ids, g_accepted, g_out

        def sampled_tree_rule():  # lq[:, i] is node i's children's q
            return accept_tree_rows(None, tokens, parents, n, jnp.pad(lq, ((0, 0), (0, 1), (0, 0))),
                                    positions + 1, seeds, rs, own, scratch)

        if parents is None or not sampled_trees:
            g_path, g_accepted, g_out = chains()
        else:  # the tree rule only in steps where a row verifies a tree of sampled drafts (on a chain it is
            # bitwise the chain's rule, at a higher cost)
            g_path, g_accepted, g_out = jax.lax.cond(jnp.any(general & treed), sampled_tree_rule, chains)
        out = jnp.where(general[:, None], g_out, out)
        accepted = jnp.where(general, g_accepted, accepted)
        path = jnp.where(general[:, None], g_path, path)
    count = jnp.where(live, accepted + 1, 0)
    path = jnp.concatenate([path, jnp.broadcast_to(jnp.arange(wm, SPAN), (rows, SPAN - wm))], axis=1)
    return jnp.pad(out, ((0, 0), (0, SPAN - wm))), count, path, scratch


def compact_paths(kv: KVCache, path: jax.Array, count: jax.Array) -> KVCache:
    """The cache with each row's accepted tree path [R, SPAN] (`_commit`) moved to the
    row's next positions, so later steps see a plain prefix. Runs once after the step,
    whatever its width, and only when some row's path left its first nodes: entries past
    a row's count are rolled back, and the engine keeps SPAN positions of room past every
    row's budget, so moving all SPAN entries never touches another row's pages."""
    ids = jnp.arange(path.shape[1])[None, :]
    moved = jnp.any((path != ids) & (ids < count[:, None]))
    k_pool, v_pool = jax.lax.cond(
        moved, lambda: trees.compact(kv.k, kv.v, kv.page_table, kv.page_size, kv.lengths, path,
                                     partial(write_layer, page_size=kv.page_size)),
        lambda: (kv.k, kv.v))
    return kv.replace(k=k_pool, v=v_pool)


def _rates(state: dict, column: jax.Array) -> jax.Array:
    """[R, 2] estimated acceptance of a row's first and later drafts in `column`."""
    at = jnp.arange(column.shape[0])
    return (state["accepted"][at, :, column] + PRIOR_ACCEPT * PSEUDO) / (state["judged"][at, :, column] + PSEUDO)


def _score(state: dict, column: jax.Array, drafts: jax.Array, n: jax.Array, out: jax.Array, count: jax.Array,
           decay: jax.Array) -> dict:
    """Fold into each row's `column` the first n of its drafts [R, K] that the committed
    tokens decide: draft j is judged when j < count and the ones before it held."""
    k = drafts.shape[1]
    idx = jnp.arange(k)
    hit = drafts == out[:, :k]
    held = jnp.cumprod(hit.astype(jnp.int32), axis=1)
    before = jnp.concatenate([jnp.ones_like(held[:, :1]), held[:, :-1]], axis=1) > 0
    judged = (idx < n[:, None]) & (idx < count[:, None]) & before
    hit = judged & hit
    later = idx > 0
    at = jnp.arange(drafts.shape[0])

    def fold(counts, mask):
        per = jnp.stack([jnp.sum(mask & ~later, axis=1), jnp.sum(mask & later, axis=1)], axis=1)
        return counts.at[at, :, column].set(counts[at, :, column] * decay[:, None] + per.astype(counts.dtype))
    return {**state, "accepted": fold(state["accepted"], hit), "judged": fold(state["judged"], judged)}


@partial(jax.jit, static_argnames=("cfg", "dcfg", "fcfg", "k", "max_ngram", "min_ngram", "n_rounds", "sampled",
                                   "sample_drafts", "adaptive", "tree"), donate_argnames=("kv", "dkv", "fkv"))
def rounds(params: Params, cfg: Qwen3Config, kv: KVCache, history: jax.Array, size: jax.Array,
           budget: jax.Array, stops: jax.Array, row_k: jax.Array, use: jax.Array, state: dict, costs: jax.Array,
           seeds: jax.Array, rs: RowSampling, dparams: Params | None = None, dkv: KVCache | None = None,
           fparams: Params | None = None, fkv: DFlashCache | None = None, fhead: Head | None = None,
           given: tuple[jax.Array, jax.Array] | None = None, limit: jax.Array | None = None,
           row_tree: jax.Array | None = None, row_auto: jax.Array | None = None, *, dcfg: Qwen3Config | None = None, fcfg: DFlashConfig | None = None,
           k: int, max_ngram: int, min_ngram: int, n_rounds: int, sampled: bool, sample_drafts: bool = False,
           adaptive: bool = True, tree: int = 0):
    """Up to `n_rounds` speculative rounds over R rows (module docstring), or up to the
    traced `limit` (a scalar, at most n_rounds): fewer rounds without a new compile.

    history [R, H]: each row's committed tokens (prompt and output), size [R] of them, the
    last being the one the next step feeds (the target cache holds the others); budget
    [R]: tokens a row may commit in this call (0: idle); stops [R, STOPS] (-1 padded);
    row_k [R]: a row's most drafts (0: plain decoding); use [R, 3]: whether the row may
    take lookup (or host) drafts, draft-model drafts and DFlash drafts; state
    (`new_state`) {"accepted", "judged"} [R, 2, columns(max_ngram)]: decayed counts of
    first / later drafts per lookup match length, of the draft model, of host drafts and
    of DFlash, and "shapes" [R, SOURCES, (CHAIN, TREE), 2]: for rows with a tree budget,
    decayed sums of the depth each shape of a proposer's drafts held (`_fold_shapes`) and
    the rounds summed; given: host
    drafts (drafts [R, k], count [R], -1 for rows without) that replace those rows' lookup
    drafts (a proposer written in Python; one round a call); costs [2^M, widths]: t(W) /
    t(1) of a step of R rows for each subset of the M step parts present (bit 0 the
    draft model's chain, then DFlash's block pass, then a draft model's tree where
    tree > 0, then building lookup tries or DFlash trees where tree > 0); seeds [R]; rs:
    per-row sampling. With
    a draft model (dparams, dcfg): dkv its cache over the same page table, dkv.lengths the
    committed tokens it holds (at most size). With a DFlash drafter (fparams, fcfg): fkv its
    state (`drafters.DFlashCache`) over the same page table, fhead the head of its
    draft vocabulary (`drafters.draft_head`) or None for the whole vocabulary. sample_drafts: rows with
    temperature > 0 sample the models' drafts. adaptive False: every row drafts in full,
    from a model where it may use one (a fixed-k baseline for the chooser). tree (static,
    most nodes) > 0 with row_tree [R] (a row's node budget, 0: chains): a row whose round
    takes prompt lookup drafts the lookup trie of its best matches (`lookup.tree`) instead
    of the chain, and a row taking DFlash drafts the block's best tree when they are not
    sampled (`drafters.block_tree`, or `drafters.markov_tree` for a drafter with a Markov head;
    verified by `trees.walk`), and when they are a tree
    whose shape only the node budget fixes (`drafters.sampled_tree`: the chain's own draws
    plus second children, drawn without replacement from the same block rows, verified by
    `tree_accept.accept_tree_rows`), a row taking sampled draft-model drafts the same
    shape over the chain's draws (`drafters.draft_sampled_tree`), and a row taking greedy
    draft-model drafts the draft model's best tree (`drafters.draft_tree`, EAGLE-2: a frontier of the best nodes by
    cumulative log-prob expanded one draft step per depth, run in place of the chain when
    no row takes the chain; its nodes sit at scratch slots of the draft cache, whose
    accepted path's are then moved into place), at most as many nodes as the chain would
    have drafts (and row_tree). A draft-model tree's draft steps are a step kind of their own in costs (the
    subset bit after the models'): a round grows trees or runs the chain or both as it
    expects most tokens per second; so is building the lookup tries and DFlash trees, which a
    round does where a row with a fixed budget drafts one, where the trees' expected extra
    tokens pay for the build, and every MEASURE_EVERY-th round for auto rows. row_auto [R]
    (with row_tree): rows whose shape the chooser picks each round, per proposer: the tree
    where the depth its trees held is more than the chain's (`_shape_means`) and the round
    builds it, for the draft model where the tree is expected to give more tokens per second
    (more tokens, in a round that runs both), else the chain; rows with sampled model drafts
    take that proposer's chain (a sampled tree's depth is not decided by the committed
    tokens).
    Returns (log, the rows whose logits met NaN [R], cache, draft cache, DFlash pools,
    state); log holds "tokens"
    [n_rounds, R, SPAN], "counts" [n_rounds, R], "drafts" judged [n_rounds, R], "source"
    [n_rounds, R] of those drafts (index into SOURCES; -1: none), "branched" [n_rounds, R]
    (the accepted path left a tree's first continuation), "treed" [n_rounds, R] (the row
    verified a tree) and "width" [n_rounds],
    each round's step kind (width index into steps.BUCKETS plus len(BUCKETS) times the
    subset of step parts run; -1: no round).
    """
    rows = history.shape[0]
    widths = steps.BUCKETS[:steps.BUCKETS.index(steps.bucket(k + 1)) + 1]
    room = jnp.array([min(w - 1, k) for w in widths])  # drafts each width judges
    drawn = sample_drafts & (rs.temperature > 0)  # rows whose model drafts are sampled
    # the model proposers present, in subset-bit order: (name, state column, use column)
    models = [m for m, there in (("draft", dcfg is not None), ("dflash", fcfg is not None)) if there]
    bit = {m: 1 << i for i, m in enumerate(models)}
    d_nodes = min(tree, k) if dcfg is not None else 0
    grow_bit = 1 << len(models) if d_nodes else 0  # the subset bit of rounds growing draft-model trees
    t_nodes = min(tree, k)  # a tree has at most as many nodes as a chain has drafts
    unbuilt = (1 << len(models)) * (2 if d_nodes else 1)  # subsets of the parts before the build bit
    # the subset bit of rounds building a lookup trie or a DFlash block's tree (`_arranged`)
    build_bit = unbuilt if t_nodes else 0
    subsets = unbuilt * (2 if t_nodes else 1)
    column = {"draft": max_ngram + DRAFT_COLUMN, "dflash": max_ngram + DFLASH_COLUMN}
    use_col = {"draft": 1, "dflash": 2}
    codes = jnp.array([0] + [SOURCES.index(m) for m in models], jnp.int32)  # row's src -> SOURCES index
    fk = 0 if fcfg is None else min(k, fcfg.block_size - 1)  # DFlash drafts per pass
    taps = () if fcfg is None else fcfg.target_layer_ids

    f_nodes = min(tree, fk)
    sampled_trees = bool(f_nodes or d_nodes) and sample_drafts  # sampled model drafts may branch

    wm = widths[-1]  # every branch returns its step padded to the widest width

    def branch(width):
        def go(carry, last, drafts, parents):
            kv, scratch = carry
            tokens, positions, logits, kv, tapped = _forward(params, cfg, kv, last, drafts, parents, width, taps)
            nan = jnp.isnan(logits).any(axis=(1, 2))
            if sampled:  # the tokens are drawn after the switch, from the logits left in the scratch
                scratch = jax.lax.dynamic_update_slice(scratch, logits.astype(jnp.float32), (0, 0, 0))
                own = jnp.zeros((rows, wm), jnp.int32)
            else:
                own = _fit(smp.argmax(logits), wm)
            if tapped is not None:  # padded to SPAN, so every width returns one shape
                tapped = jnp.pad(tapped, ((0, 0), (0, 0), (0, SPAN - width), (0, 0)))
            return (_fit(tokens, wm), _fit(positions, wm), own, nan, tapped), (kv, scratch)
        return go

    def feed_at(width):  # (the draft logits after the last fed token, d1 and its log-probs)
        def go(dkv, history, size):
            logits, dkv = feed(dparams, dcfg, dkv, history, size, width)
            return (logits, *draft_token(logits, size, seeds, rs, drawn, sample_drafts)), dkv
        return go

    def no_feed(dkv, history, size):
        return steps.zeros_of(lambda: feed_at(FEEDS[0])(dkv, history, size)[0]), dkv

    def block(fkv, last, start, ranks, pairs):
        drafts, logq, fkv, ranked = block_drafts(fparams, fcfg, fkv, params, cfg, last, start, fk, seeds, rs, drawn,
                                                 sample_drafts, fhead, f_nodes, ranks, pairs)
        return (drafts, logq, ranked), fkv

    def no_block(fkv, last, start, ranks, pairs):
        return steps.zeros_of(lambda: block(fkv, last, start, ranks, pairs)[0]), fkv

    def grow(dkv, logits, size, levels):
        ranked, greedy, greedy_n, fed, dkv = draft_tree(dparams, dcfg, dkv, logits, size, d_nodes, levels)
        return (ranked, greedy, greedy_n, fed), dkv

    def no_grow(dkv, logits, size, levels):
        return steps.zeros_of(lambda: grow(dkv, logits, size, levels)[0]), dkv

    def body(c):
        kv, dkv, fkv, history, size, made, i, state, bad, stopped, log, scratch = c
        live = (made < budget) & ~stopped
        limit = jnp.where(live, jnp.minimum(row_k, jnp.maximum(budget - made - 1, 0)), 0)
        if k:
            lookup_drafts, found, m = jax.vmap(lambda h, s: find(h, s, k, max_ngram, min_ngram))(history, size)
        else:
            lookup_drafts, found, m = (jnp.zeros((rows, 1), jnp.int32), jnp.zeros(rows, jnp.int32),
                                       jnp.zeros(rows, jnp.int32))
        hosted = jnp.zeros(rows, bool)
        if given is not None and k:
            hosted = given[1] >= 0
            lookup_drafts = jnp.where(hosted[:, None], given[0], lookup_drafts)
            found = jnp.where(hosted, given[1], found)
            m = jnp.where(hosted, max_ngram + HOST_COLUMN, m)
        found = jnp.where(use[:, 0], jnp.minimum(found, limit), 0)
        rate = _rates(state, m)
        e_l = expected_tokens(rate[:, :1], rate[:, 1:], jnp.minimum(room[None, :], found[:, None]))  # [R, widths]
        # each model proposer's drafts a row may take and its expected tokens at each width
        offered, expect = {}, {}
        for name in models:
            offered[name] = jnp.where(use[:, use_col[name]], jnp.minimum(limit, fk if name == "dflash" else k), 0)
            rate = _rates(state, jnp.full((rows,), column[name], jnp.int32))
            expect[name] = expected_tokens(rate[:, :1], rate[:, 1:],
                                           jnp.minimum(room[None, :], offered[name][:, None]))
        # per proposer whose tree costs no draft steps beyond its chain's (lookup, DFlash; building it is a step
        # part of its own, build_bit): the rows drafting its tree when it is built (the rest its chain), and
        # their expected tokens in such rounds (the chain's scaled by the ratio of the depths the shapes held)
        treeing, budgeted = {}, (row_tree > 0) if t_nodes else jnp.zeros(rows, bool)
        auto = jnp.zeros(rows, bool) if row_auto is None else row_auto
        built_e = {}
        if t_nodes:
            means = _shape_means(state)
            for name, there in (("lookup", True), ("dflash", bool(f_nodes))):
                if not there:
                    continue
                j = SOURCES.index(name)
                tree_mean, chain_mean = means[:, j, TREE], means[:, j, CHAIN]  # a tie drafts the chain
                may = ~hosted if name == "lookup" else jnp.ones(rows, bool)
                picked = tree_mean > chain_mean if name == "lookup" else (tree_mean > chain_mean) & ~drawn
                treeing[name] = budgeted & may & jnp.where(auto, picked, True)  # (a sampled tree's depth is unmeasured)
                gain = jnp.where(treeing[name], tree_mean / chain_mean, 1.0)[:, None]
                built_e[name] = 1.0 + ((e_l if name == "lookup" else expect[name]) - 1.0) * gain

        def expect_in(name: str, subset) -> jax.Array:
            """[R, widths] a row's expected tokens from lookup or DFlash in a round running `subset`."""
            chain_e = e_l if name == "lookup" else expect[name]
            return jnp.where((subset & build_bit) > 0, built_e[name], chain_e) if name in built_e else chain_e
        # the draft model: rows with sampled drafts and a node budget draft the chain's own tree (no extra
        # draft step); the others with a budget may grow its best tree, which costs draft steps of its own
        # (subset bit grow_bit): a row with a fixed budget takes the draft model only in rounds that grow, an
        # auto row the tree or the chain, by expected tokens per second at the round's costs
        growable = budgeted & ~drawn & (d_nodes > 0)
        grown_expect = None
        if d_nodes:
            treeing["draft"] = budgeted & drawn & ~auto
            j = SOURCES.index("draft")
            grown_expect = 1.0 + (expect["draft"] - 1.0) * (means[:, j, TREE] / means[:, j, CHAIN])[:, None]

        def draft_expect(subset: int) -> jax.Array:
            """[R, widths] a row's expected tokens from the draft model in a round running `subset`."""
            chain_e = jnp.where((subset & bit["draft"]) > 0, expect["draft"], 0.0)
            if not d_nodes:
                return chain_e
            chain_e = jnp.where((growable & ~auto)[:, None], 0.0, chain_e)
            grows = growable[:, None] & ((subset & grow_bit) > 0)
            return jnp.maximum(chain_e, jnp.where(grows, grown_expect, 0.0))

        def offers(subset: int) -> dict:
            """[R, widths] each model proposer's expected tokens a row may take in a round running `subset`."""
            return {name: jnp.where(offered[name][:, None] > 0, draft_expect(subset) if name == "draft"
                                    else jnp.where((subset & bit[name]) > 0, expect_in(name, subset), 0.0), 0.0)
                    for name in models}

        first, first_logq, dlen, caught = jnp.zeros(rows, jnp.int32), None, None, jnp.zeros(rows, bool)
        if dcfg is not None:
            # fed where a row may take its drafts this round (one that chooses: where they are its best
            # tokens per second) or lags a round's worth (caught up whole: no row lags 2 * SPAN); only a
            # row fed up to its last token is offered its drafts or scored
            dlen = dkv.lengths
            lag = size - dlen
            drafting = live & (offered["draft"] > 0)
            wanted = drafting
            if adaptive:
                n_w = len(widths)
                mine = expect["draft"] / costs[bit["draft"], :n_w]
                if d_nodes:
                    mine = jnp.maximum(mine, jnp.where(growable[:, None], grown_expect / costs[grow_bit, :n_w], 0.0))
                wanted = wanted & (jnp.max(mine, axis=1) >= jnp.max(e_l / costs[0, :n_w], axis=1))
            feeding = wanted | (drafting & (lag >= SPAN))
            widest = jnp.max(jnp.where(feeding, lag, 0))
            which = jnp.where(jnp.any(feeding), 1 + jnp.sum(widest > jnp.array(FEEDS[:-1])), 0)
            (logits, first, first_logq), dkv = steps.switch(which, [no_feed] + [feed_at(w) for w in FEEDS], dkv,
                                                            history, size)
            caught = jnp.any(feeding) & (dkv.lengths >= size)
            fed_len = dkv.lengths
            offered["draft"] = jnp.where(caught, offered["draft"], 0)
            if d_nodes:
                growable = growable & caught
        any_drafts = jnp.any(found > 0)
        # the rows drafting each tree a round builds (lookup's trie of their matches, DFlash's ranked block tree)
        tree_rows = {}
        if t_nodes:
            tree_rows["lookup"] = budgeted & ~hosted & (found > 0)
            if f_nodes:
                tree_rows["dflash"] = budgeted & ~drawn & (offered["dflash"] > 0)
        for name in models:
            any_drafts = any_drafts | jnp.any(offered[name] > 0)
        at = jnp.arange(rows)
        if adaptive:
            # expected tokens of the batch per second for each (subset of models, width)
            gains, offered_by = [], [offers(s) for s in range(subsets)]
            for s, by_model in enumerate(offered_by):
                e = expect_in("lookup", s)
                for e_m in by_model.values():
                    e = jnp.maximum(e, e_m)
                gains.append(jnp.sum(e * live[:, None], axis=0))
            gain = jnp.stack(gains) / costs[:, :len(widths)]
            if t_nodes:  # a round builds the trees where a row with a fixed budget drafts one, or an auto row's is due
                wants = tree_rows["lookup"] | tree_rows.get("dflash", False)
                due = jnp.any(live & wants & (~auto | (i % MEASURE_EVERY == 0)))
                gain = jnp.where(due & ((np.arange(subsets) & build_bit) == 0)[:, None], -jnp.inf, gain)
            best = jnp.argmax(gain.reshape(-1))
            pick = jnp.where(any_drafts, best % len(widths), 0)
            subset = jnp.where(pick > 0, best // len(widths), 0)
            # each row: the proposer of the chosen subset it expects most tokens from
            chosen = jax.tree.map(lambda *e: jnp.stack(e)[subset, at, pick], *offered_by)
            src, top = jnp.zeros(rows, jnp.int32), expect_in("lookup", subset)[at, pick]
            for j, name in enumerate(models):
                better = chosen[name] > top
                src = jnp.where(better, j + 1, src)
                top = jnp.where(better, chosen[name], top)
            grow_on = (subset & grow_bit) > 0
            chain_on = (subset & bit.get("draft", 0)) > 0
        else:  # fixed k: the first model a row may use, else lookup; the narrowest width that drafts all
            src = jnp.zeros(rows, jnp.int32)
            for j, name in reversed(list(enumerate(models))):
                src = jnp.where(offered[name] > 0, j + 1, src)
            wanted = jnp.max(_by_source(src, [found] + [offered[name] for name in models]))
            pick = jnp.argmax(room >= wanted)
            subset = jnp.int32(0)
            for j, name in enumerate(models):
                subset = subset | jnp.where(jnp.any(src == j + 1), bit[name], 0)
            grow_on = chain_on = jnp.bool_(True)
            if d_nodes:  # an auto row grows the tree where it expects more tokens per second than from the chain
                plain = subset & ~bit["draft"]
                per_second = [jnp.where(growable, grown_expect[at, pick], 0.0) / costs[plain | grow_bit, pick],
                              expect["draft"][at, pick] / costs[plain | bit["draft"], pick]]
                grow_on = jnp.where(auto, per_second[0] >= per_second[1], True)
                subset = jnp.where(jnp.any(growable & grow_on & (src == 1)), subset | grow_bit, subset)
            subset = jnp.where(pick > 0, subset | build_bit, 0)
        building = (subset & build_bit) > 0  # (the trees are built where some row has one)
        offer = _by_source(src, [found] + [offered[name] for name in models])
        n = jnp.where(pick > 0, jnp.minimum(room[pick], offer), 0)
        last = jnp.take_along_axis(history, jnp.maximum(size - 1, 0)[:, None], axis=1)[:, 0]
        candidates, logqs = [_fit(lookup_drafts, k)], []
        if dcfg is not None:  # the draft model's slot: its chain, filled below (and its trees after it)
            candidates.append(jnp.zeros((rows, k), jnp.int32))
            logqs.append(None)
        block_drafts_ = block_ranked = None
        if fcfg is not None:  # DFlash's block pass, when the round uses it
            ran = (subset & bit["dflash"]) > 0
            # the block's ranked tree where a row builds it (`options` below), second children where a row
            # verifies a sampled tree
            ranks = jnp.any(tree_rows["dflash"]) & building if f_nodes else jnp.bool_(False)
            pairs = jnp.any(treeing["dflash"] & drawn) if f_nodes and sample_drafts else jnp.bool_(False)
            (block_drafts_, block_logq, block_ranked), fkv = steps.switch(ran.astype(jnp.int32), [no_block, block],
                                                                          fkv, last, kv.lengths, ranks, pairs)
            candidates.append(_fit(block_drafts_, k))
            logqs.append(None if block_logq is None else _fit(block_logq, k))
        parents, main = None, jnp.ones((rows, SPAN), bool)
        grown = jnp.zeros(rows, bool)  # rows drafting a draft-model best tree (greedy drafts)
        if d_nodes:  # the draft model's best tree (`drafters.draft_tree`), as deep as the deepest row needs
            if adaptive:  # an auto row in a round running both: the shape it expects more tokens from
                grow_on = grow_on & (~auto | ~chain_on | (grown_expect[at, pick] >= expect["draft"][at, pick]))
            grown = growable & grow_on & (src == 1) & (n > 0)
            treeing["draft"] = treeing["draft"] | grown
            deepest = jnp.max(jnp.where(grown, jnp.minimum(jnp.minimum(room[pick], offered["draft"]), row_tree), 0))
            (draft_ranked, greedy, greedy_n, fed_nodes), dkv = steps.switch(
                jnp.any(grown).astype(jnp.int32), [no_grow, grow], dkv, logits, size, jnp.maximum(deepest - 1, 0))
        built, verified = {}, jnp.zeros(rows, bool)  # trees the committed tokens will judge; rows verifying one
        ranked_built = jnp.bool_(False)  # whether the round built a lookup trie or a DFlash block's tree
        chained = False
        if dcfg is not None:  # its chain, once before the step, when the round uses it and some row takes it
            chained = ((subset & bit["draft"]) > 0) & jnp.any(live & (src == 1) & ~grown)
            model_drafts, model_logq = first[:, None], None if first_logq is None else first_logq[:, None]
            if k > 1:  # as many drafts as the chosen width judges
                model_drafts, model_logq, dkv = chain(dparams, dcfg, dkv, first, first_logq, size,
                                                      jnp.where(chained, jnp.maximum(room[pick] - 1, 0), 0), k,
                                                      seeds, rs, drawn, sample_drafts)
            candidates[1] = _fit(model_drafts, k)
            logqs[0] = None if model_logq is None else _fit(model_logq, k)
        if t_nodes:  # rows with a tree budget: their proposer's best tree, as many nodes as a chain's drafts
            parents = chain_ = trees.chain_parents(rows, SPAN)
            # (proposer, its candidates slot, its ranked nodes (made on demand), trie entries, the rows whose tree
            # is built, most nodes); each tree is built only in rounds where some row has one
            options = [("lookup", 0, partial(_lookup_ranked, history, size, k, max_ngram, min_ngram, t_nodes),
                        capacity(k), tree_rows["lookup"] & building, jnp.minimum(room[pick], limit))]
            if d_nodes:  # a draft model's tree, for rows that grew one
                options.append(("draft", 1, lambda: draft_ranked, draft_tree_capacity(d_nodes), grown,
                                jnp.minimum(room[pick], offered["draft"])))
            if f_nodes:  # a DFlash block's tree, for rows whose drafts are not sampled
                options.append(("dflash", len(candidates) - 1, lambda: block_ranked,
                                tree_capacity(fk, f_nodes, MARKOV in fparams),
                                tree_rows["dflash"] & ran & building,
                                jnp.minimum(room[pick], offered["dflash"])))
            for name, at_c, ranked, cap, ready, most in options:
                source = 0 if name == "lookup" else models.index(name) + 1
                ready = ready & (most > 0)
                treed = treeing[name] & ready & (src == source) & (n > 0)
                build = partial(_arranged, ranked, jnp.where(ready, jnp.minimum(most, row_tree), 0), cap)
                t_drafts, t_parents, t_main, t_n = jax.lax.cond(jnp.any(ready), build, partial(steps.zeros_of, build))
                nodes = t_drafts.shape[1]
                built[name] = (t_drafts, t_parents, t_n, ready)
                if name != "draft":
                    ranked_built = ranked_built | jnp.any(ready)
                verified = verified | treed
                candidates[at_c] = jnp.where(treed[:, None], _fit(t_drafts, k), candidates[at_c])
                n = jnp.where(treed, t_n, n)
                parents = jnp.where(treed[:, None], jnp.concatenate([t_parents, chain_[:, nodes + 1:]], axis=1), parents)
                main = jnp.where(treed[:, None], jnp.pad(t_main, ((0, 0), (0, SPAN - nodes - 1)), constant_values=True),
                                 main)
            if d_nodes > 1 and sample_drafts:  # sampled draft-model drafts: `draft_sampled_tree`
                treed = treeing["draft"] & drawn & (src == 1) & (n > 0)
                verified = verified | treed
                s_drafts, s_parents, s_main, s_n = draft_sampled_tree(
                    model_drafts, model_logq, size, seeds, jnp.where(treed, jnp.minimum(n, row_tree), 0), d_nodes)
                candidates[1] = jnp.where(treed[:, None], _fit(s_drafts, k), candidates[1])
                n = jnp.where(treed, s_n, n)
                parents = jnp.where(treed[:, None], jnp.concatenate([s_parents, chain_[:, d_nodes + 1:]], axis=1),
                                    parents)
                main = jnp.where(treed[:, None], jnp.pad(s_main, ((0, 0), (0, SPAN - d_nodes - 1)),
                                                         constant_values=True), main)
            if f_nodes and sample_drafts:  # sampled DFlash drafts: a tree of fixed shape (`drafters.sampled_tree`)
                treed = treeing["dflash"] & (src == len(models)) & (n > 0) & drawn
                verified = verified | treed
                s_drafts, s_parents, s_main, s_n, s_depth = sampled_tree(
                    block_drafts_, block_ranked["second"], jnp.where(treed, jnp.minimum(n, row_tree), 0), f_nodes)
                at_c = len(candidates) - 1
                candidates[at_c] = jnp.where(treed[:, None], _fit(s_drafts, k), candidates[at_c])
                n = jnp.where(treed, s_n, n)
                parents = jnp.where(treed[:, None], jnp.concatenate([s_parents, chain_[:, f_nodes + 1:]], axis=1),
                                    parents)
                main = jnp.where(treed[:, None], jnp.pad(s_main, ((0, 0), (0, SPAN - f_nodes - 1)),
                                                         constant_values=True), main)
                # node i's children were drawn from q of block row depth(i) (a chain's: row i)
                rows_q = jnp.concatenate([s_depth, jnp.arange(f_nodes + 1, max(k, f_nodes + 1))[None, :]
                                          + jnp.zeros((rows, 1), jnp.int32)], axis=1)[:, :k]
                node_q = jnp.take_along_axis(logqs[-1], jnp.minimum(rows_q, k - 1)[:, :, None], axis=1)
                logqs[-1] = jnp.where(treed[:, None, None], node_q, logqs[-1])
        # the step kind run: the chosen subset, its draft-model and build bits as the round ran them
        kind = (subset & ~(bit.get("draft", 0) | grow_bit | build_bit) | jnp.where(chained, bit.get("draft", 0), 0)
                | jnp.where(jnp.any(grown), grow_bit, 0) | jnp.where(ranked_built, build_bit, 0))
        (tokens, positions, own, nan, tapped), (kv, scratch) = steps.switch(
            pick, [branch(w) for w in widths], (kv, scratch), last, _by_source(src, candidates), parents)
        out, count, path, scratch = _commit(scratch if sampled else None, tokens, positions, own,
                                            jnp.asarray(widths)[pick], n, live, (src > 0) & drawn,
                                            _by_source(src - 1, logqs) if sample_drafts and models else None,
                                            seeds, rs, parents, sampled_trees, verified)
        nan = nan & live
        if t_nodes:  # the accepted paths become plain prefixes (taps past the width are stale anyway)
            kv = compact_paths(kv, path, count)
            if tapped is not None:
                tapped = jnp.take_along_axis(tapped, path[None, :, :, None], axis=2)
        on_path = jnp.arange(SPAN)[None, :] < count[:, None]
        branched = jnp.any(on_path & ~jnp.take_along_axis(main, path, axis=1), axis=1)
        if fcfg is not None:  # (taps past the step's width are stale: positions nothing has committed)
            fkv = stash(fkv, tapped, kv.lengths)
        # score every lookup (a plain step judges its first draft) and every model draft made
        judged = jnp.where(pick > 0, room[pick], 1)
        if k:
            state = _score(state, m, lookup_drafts, jnp.minimum(found, judged), out, count, jnp.where(m > 0, ACCEPT_DECAY, 1.0))
        if dcfg is not None:
            model_n = jnp.where(use[:, 1] & live & caught, jnp.where(chained, jnp.minimum(room[pick], limit),
                                                            jnp.minimum(limit, 1)), 0)
            if d_nodes:  # a tree row's draft chain is the tree's greedy chain, as far as it was expanded
                model_drafts = jnp.where(grown[:, None], _fit(greedy, model_drafts.shape[1]), model_drafts)
                model_n = jnp.where(grown, jnp.minimum(jnp.minimum(room[pick], limit), greedy_n), model_n)
            state = _score(state, jnp.full((rows,), column["draft"], jnp.int32), model_drafts, model_n, out, count,
                           jnp.where(model_n > 0, ACCEPT_DECAY, 1.0))
            # the draft cache keeps the chain's fed drafts that were committed (never the newest token), and a
            # tree row the fed nodes of its accepted path, moved from their slots into place, where no chain
            # ran; a later feed feeds the rest (a row not caught up keeps what its feed reached)
            agree = jnp.sum(jnp.cumprod((model_drafts == out[:, :model_drafts.shape[1]]).astype(jnp.int32),
                                        axis=1), axis=1)
            fed = jnp.where(chained & ~grown, jnp.minimum(room[pick], k) - 1, 0)
            kept = jnp.minimum(jnp.minimum(agree, fed), jnp.maximum(count - 1, 0))
            if d_nodes:  # (a round that also ran the chain wrote its drafts over every row's tree slots)
                held_nodes = partial(tree_kept, fed_nodes, out, count)  # (only in rounds that grew a tree)
                in_tree, slots = jax.lax.cond(jnp.any(grown), held_nodes, partial(steps.zeros_of, held_nodes))
                in_tree = jnp.where(grown & ~chained, in_tree, 0)
                dkv = compact_paths(dkv.replace(lengths=size), slots, in_tree)
                kept = jnp.where(grown, in_tree, kept)
            dkv = dkv.replace(lengths=jnp.where(count > 0, jnp.where(caught, size + kept, fed_len), dlen))
        if fcfg is not None:  # a pass's drafts are judged for every row that may take them
            block_n = jnp.where(((subset & bit["dflash"]) > 0) & live, jnp.minimum(offered["dflash"], judged), 0)
            state = _score(state, jnp.full((rows,), column["dflash"], jnp.int32), block_drafts_, block_n, out, count,
                           jnp.where(block_n > 0, ACCEPT_DECAY, 1.0))
        if t_nodes:  # the depth each shape held, where the committed tokens decide both (a draft chain round: its own)
            chains = {"lookup": (lookup_drafts, jnp.minimum(found, judged))}
            if d_nodes:
                chains["draft"] = (greedy, jnp.minimum(jnp.minimum(room[pick], limit), greedy_n))
            if f_nodes:
                chains["dflash"] = (block_drafts_, jnp.minimum(offered["dflash"], judged))
            for name, (t_drafts, t_parents, t_n, ready) in built.items():
                c_drafts, c_n = chains[name]
                ready = ready & (count > 0)
                fold = partial(_fold_shapes, source=SOURCES.index(name), chain_known=ready, tree_known=ready)
                state = jax.lax.cond(  # (a round that built no tree of this proposer leaves its means as they are)
                    jnp.any(ready), lambda st: fold(st, chain=_held(c_drafts, c_n, out, count),
                                                    tree=_tree_held(t_drafts, t_parents, t_n, out, count)),
                    lambda st: st, state)
        history = jax.vmap(lambda h, o, s: jax.lax.dynamic_update_slice(h, o, (s,)))(history, out, size)
        committed = jnp.arange(SPAN)[None, :] < count[:, None]
        stopped = stopped | jnp.any(committed[:, :, None] & (out[:, :, None] == stops[:, None, :]), axis=(1, 2))
        kv = kv.replace(lengths=kv.lengths + count)
        log = {"tokens": log["tokens"].at[i].set(out), "counts": log["counts"].at[i].set(count),
               "drafts": log["drafts"].at[i].set(jnp.where(count > 0, n, 0)),
               "width": log["width"].at[i].set(pick + kind * len(steps.BUCKETS)),
               "source": log["source"].at[i].set(jnp.where(n > 0, codes[src], -1)),
               "branched": log["branched"].at[i].set(branched),
               "treed": log["treed"].at[i].set(verified & (count > 0))}
        return kv, dkv, fkv, history, size + count, made + count, i + 1, state, bad | nan, stopped, log, scratch

    def more(c):
        made, i, stopped = c[5], c[6], c[9]
        going = (i < n_rounds) if limit is None else (i < jnp.minimum(limit, n_rounds))
        return going & jnp.any((made < budget) & ~stopped)

    log = {"tokens": jnp.zeros((n_rounds, rows, SPAN), jnp.int32),
           "counts": jnp.zeros((n_rounds, rows), jnp.int32), "drafts": jnp.zeros((n_rounds, rows), jnp.int32),
           "width": jnp.full((n_rounds,), -1, jnp.int32), "source": jnp.full((n_rounds, rows), -1, jnp.int32),
           "branched": jnp.zeros((n_rounds, rows), bool), "treed": jnp.zeros((n_rounds, rows), bool)}
    init = (kv, dkv, fkv, history, size, jnp.zeros(rows, jnp.int32), jnp.int32(0), state, jnp.zeros(rows, bool),
            jnp.zeros(rows, bool), log,
            jnp.zeros((rows, wm, cfg.vocab_size), jnp.float32) if sampled else None)  # (`_commit`)
    kv, dkv, fkv, _, _, _, _, state, bad, _, log, _ = jax.lax.while_loop(more, body, init)
    return log, bad, kv, dkv, fkv, state


def _shape_means(state: dict) -> jax.Array:
    """[R, SOURCES, (CHAIN, TREE)] the mean depth of each shape of a row's drafts per
    proposer that the committed tokens held (SHAPE_PRIOR before any round)."""
    sums = state["shapes"]
    prior = jnp.full(sums.shape[1:3], SHAPE_PRIOR).at[SOURCES.index("draft"), TREE].set(GROWN_PRIOR)
    return (sums[..., 0] + prior * PSEUDO) / (sums[..., 1] + PSEUDO)


def _fold_shapes(state: dict, source: int, chain: jax.Array, chain_known: jax.Array, tree: jax.Array,
                 tree_known: jax.Array) -> dict:
    """Fold one round's depths held [R] by the chain and by the tree of proposer `source`
    into the rows where they are known."""
    shapes = state["shapes"]
    for shape, held, known in ((CHAIN, chain, chain_known), (TREE, tree, tree_known)):
        old = shapes[:, source, shape]
        new = jnp.stack([old[:, 0] * ACCEPT_DECAY + held, old[:, 1] * ACCEPT_DECAY + 1.0], axis=1)
        shapes = shapes.at[:, source, shape].set(jnp.where(known[:, None], new, old))
    return {**state, "shapes": shapes}


def _held(drafts: jax.Array, n: jax.Array, out: jax.Array, count: jax.Array) -> jax.Array:
    """[R] how many of a chain's first n drafts [R, K] the committed tokens out[:, :count]
    hold: those a step verifying the chain would have accepted, as far as count decides."""
    k = drafts.shape[1]
    hit = (drafts == out[:, :k]) & (jnp.arange(k)[None, :] < n[:, None])
    return jnp.minimum(jnp.sum(jnp.cumprod(hit.astype(jnp.int32), axis=1), axis=1), count)


def _tree_held(drafts: jax.Array, parents: jax.Array, n: jax.Array, out: jax.Array, count: jax.Array) -> jax.Array:
    """[R] the depth of a tree (`trees.arrange`: drafts [R, N], parents [R, N + 1] with the
    root first, n nodes) that the committed tokens out[:, :count] hold: the walk with
    out[d] as the target's token after every node at depth d, as far as count decides."""
    tokens = jnp.concatenate([jnp.zeros_like(drafts[:, :1]), drafts], axis=1)
    depth = trees.depths(parents)
    _, held = trees.walk(tokens, parents, n, jnp.take_along_axis(out, jnp.minimum(depth, out.shape[1] - 1), axis=1))
    return jnp.minimum(held, count)


def _lookup_ranked(history: jax.Array, size: jax.Array, k: int, max_ngram: int, min_ngram: int, nodes: int) -> dict:
    """Each row's lookup trie (`lookup.tree`) of its best earlier occurrences (`lookup.matches`,
    searched again only in rounds that build it; the first is the one `lookup.find` drafts)."""
    def one(h, s):
        best, ends = matches(h, s, max_ngram, min_ngram)
        return lookup_tree(h, s, k, best, ends, nodes)
    return jax.vmap(one)(history, size)


def _arranged(ranked: Callable[[], dict], n: jax.Array, capacity: int):
    """`trees.arrange` of the ranked nodes `ranked()` makes."""
    return trees.arrange(ranked(), n, capacity)


def _by_source(src: jax.Array, options: list[jax.Array]) -> jax.Array:
    """Row r of options[src[r]] (options [R, ...] each; src outside them: options[0])."""
    out = options[0]
    for j, option in enumerate(options[1:], 1):
        out = jnp.where(src.reshape(src.shape + (1,) * (option.ndim - 1)) == j, option, out)
    return out


def _fit(x: jax.Array, n: int) -> jax.Array:
    """x [R, m, ...] cut or zero-padded to [R, n, ...] along its second axis."""
    x = x[:, :n]
    return jnp.pad(x, [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


@partial(jax.jit, static_argnames=("cfg", "sampled", "taps"), donate_argnames=("kv", "fkv"))
def prefill_chunk(params: Params, cfg: Qwen3Config, kv: KVCache, tokens: jax.Array, n_valid: jax.Array,
                  seed: jax.Array, rs: RowSampling, sampled: bool, fkv: DFlashCache | None = None,
                  taps: tuple[int, ...] = ()):
    """Append one chunk [C] (first n_valid real) to the one row of `kv` (its page table
    [1, pages]) and draw the token after it with that row's settings; with a DFlash
    drafter's state `fkv`, the chunk's target `taps` are stashed there too.

    Returns (token, nan flag, cache with length + n_valid, DFlash state)."""
    start = kv.lengths[0]
    positions = start + jnp.arange(tokens.shape[0])
    h, kv, tapped = hidden_states(params, cfg, tokens[None], positions[None], kv, taps)
    if fkv is not None:
        fkv = stash(fkv, tapped, kv.lengths)
    logits = unembed(params, cfg, h[0, n_valid - 1][None])
    token = smp.target_tokens_rows(logits, (start + n_valid)[None], seed[None], rs, sampled)[0]
    return token, jnp.any(jnp.isnan(logits)), kv.replace(lengths=kv.lengths + n_valid), fkv
