"""The engine's device side: R speculative rounds over a batch of rows in one compiled call.

One round, for every row at once:
1. draft: prompt lookup on the row's own history (the tokens after the latest earlier
   occurrence of its longest suffix of max_ngram .. min_ngram tokens) and, when the engine
   has a draft model, that model's drafts: its cache is fed the row's newly committed
   tokens (1-2 after a round it drafted, up to a round's worth otherwise), which gives d1,
   and chained W - 2 more steps when the round uses it;
2. choose: one verify width W for the step, whether the draft model chains, and each
   row's proposer and drafts, so that the batch's expected committed tokens per second is
   largest. A row's expected tokens come from its own acceptance per proposer (first and
   later drafts; for lookup per n-gram length matched; decayed counts), the cost of a step
   from measured times of steps of this many rows at each width, with and without the
   chain (`StepCosts`), so speculation narrows as the batch fills;
3. verify and commit: every row's [last, d1 .. d_{W-1}] scored in one target step. A row
   with deterministic drafts keeps them up to the first that differs from the target's own
   position-keyed token, plus that token; a row with sampled draft-model drafts takes the
   general rule (`sampling.accept_rows`);
4. score every proposer's drafts that the committed tokens decide (drafted or not), into
   that row's acceptance counts.
The choice is a function of committed tokens and past acceptance only (never of this
round's draft values), and each committed token is what plain decoding draws at its
position, so a row's output is, token for token, what it generates alone (for sampled
drafts: in distribution).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from . import sampling as smp
from . import steps
from .checkpoint import Params
from .config import Qwen3Config
from .kv import KVCache
from .lookup import ACCEPT_DECAY, PRIOR_ACCEPT, PSEUDO, expected_tokens, find
from .qwen3 import hidden_states, unembed
from .sampling import RowSampling

SPAN = steps.BUCKETS[-1]  # widest verify step: tokens a row commits per round at most
FEEDS = (2, SPAN)  # draft-model feed widths: after a round it drafted, and after any round


def _verify(params: Params, cfg: Qwen3Config, kv: KVCache, last: jax.Array, drafts: jax.Array,
            n: jax.Array, live: jax.Array, general: jax.Array, logq: jax.Array | None, seeds: jax.Array,
            rs: RowSampling, width: int, sampled: bool):
    """Score [last, d1 .. d_{W-1}] for every row [R] and commit each row's accepted prefix
    (rows where `general` is set by the rule for sampled drafts, with their logq).

    Returns (tokens [R, SPAN]: t_1 .. t_W, count [R] = accepted + 1 (0 for rows not live),
    nan flag over live rows, cache)."""
    rows = last.shape[0]
    start = kv.lengths
    drafts = jnp.pad(drafts, ((0, 0), (0, max(0, width - 1 - drafts.shape[1]))))[:, :width - 1]
    tokens = jnp.concatenate([last[:, None], drafts], axis=1).astype(jnp.int32)
    positions = start[:, None] + jnp.arange(width)
    h, kv, _ = hidden_states(params, cfg, tokens, positions, kv)
    logits = unembed(params, cfg, h)  # [R, W, V]
    flat = smp.target_tokens_rows(logits.reshape(rows * width, -1), (positions + 1).reshape(-1),
                                  jnp.repeat(seeds, width), rs.repeat(width), sampled)
    out = flat.reshape(rows, width)
    ok = (tokens[:, 1:] == out[:, :-1]) & (jnp.arange(width - 1) < n[:, None])
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    if logq is not None and width > 1:
        lq = jnp.pad(logq, ((0, 0), (0, max(0, width - 1 - logq.shape[1])), (0, 0)))[:, :width - 1]
        g_out, g_accepted = smp.accept_rows(logits, drafts, lq, n, positions + 1, seeds, rs)
        out = jnp.where(general[:, None], g_out, out)
        accepted = jnp.where(general, g_accepted, accepted)
    count = jnp.where(live, accepted + 1, 0)
    bad = jnp.any(jnp.isnan(logits).any(axis=(1, 2)) & live)
    return jnp.pad(out, ((0, 0), (0, SPAN - width))), count, bad, kv


def _draft_token(logits: jax.Array, positions: jax.Array, seeds: jax.Array, rs: RowSampling, sample: jax.Array,
                 sample_drafts: bool):
    """The draft model's token for each row [R] (its argmax, or where `sample` is set a
    draw from its transformed distribution, keyed by (seed, DRAFT stream, position)), and
    the draft log-probs [R, V] when drafts may be sampled."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not sample_drafts:
        return greedy, None
    keys = jax.vmap(lambda s, p: smp.position_key(s, smp.DRAFT, p))(seeds, positions)
    logq = smp.transform_rows(logits, rs)
    drawn = jax.vmap(smp.sample)(logq, keys)
    return jnp.where(sample, drawn, greedy), logq


def _feed(dparams: Params, dcfg: Qwen3Config, dkv: KVCache, history: jax.Array, size: jax.Array, width: int):
    """Append history[dlen : size] (the committed tokens the draft cache lacks, dlen =
    dkv.lengths) to the draft cache; returns (draft logits after the last [R, V], cache)."""
    rows = history.shape[0]
    start = dkv.lengths
    at = start[:, None] + jnp.arange(width)
    tokens = jnp.take_along_axis(history, jnp.minimum(at, history.shape[1] - 1), axis=1)
    h, dkv, _ = hidden_states(dparams, dcfg, tokens, at, dkv)
    last = jnp.clip(size - start - 1, 0, width - 1)
    logits = unembed(dparams, dcfg, h[jnp.arange(rows), last])
    return logits, dkv.replace(lengths=jnp.maximum(size, start))


def _chain(dparams: Params, dcfg: Qwen3Config, dkv: KVCache, first: jax.Array, first_logq: jax.Array | None,
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
        token, lq = _draft_token(unembed(dparams, dcfg, h[:, 0]), pos + 1, seeds, rs, sample, sample_drafts)
        drafts = drafts.at[:, j].set(token)
        return dkv, drafts, (None if logq is None else logq.at[:, j].set(lq))

    dkv, drafts, logq = jax.lax.fori_loop(1, 1 + n_steps, body, (dkv, drafts, logq))
    return drafts, logq, dkv


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
    return {"accepted": fold(state["accepted"], hit), "judged": fold(state["judged"], judged)}


@partial(jax.jit, static_argnames=("cfg", "dcfg", "k", "max_ngram", "min_ngram", "n_rounds", "sampled",
                                   "sample_drafts", "adaptive"), donate_argnames=("kv", "dkv"))
def rounds(params: Params, cfg: Qwen3Config, kv: KVCache, history: jax.Array, size: jax.Array,
           budget: jax.Array, stops: jax.Array, row_k: jax.Array, use: jax.Array, state: dict, costs: jax.Array,
           seeds: jax.Array, rs: RowSampling, dparams: Params | None = None, dkv: KVCache | None = None,
           given: tuple[jax.Array, jax.Array] | None = None, *,
           dcfg: Qwen3Config | None = None, k: int, max_ngram: int, min_ngram: int, n_rounds: int, sampled: bool,
           sample_drafts: bool = False, adaptive: bool = True):
    """Up to `n_rounds` speculative rounds over R rows (module docstring).

    history [R, H]: each row's committed tokens (prompt and output), size [R] of them, the
    last being the one the next step feeds (the target cache holds the others); budget
    [R]: tokens a row may commit in this call (0: idle); stops [R, STOPS] (-1 padded);
    row_k [R]: a row's most drafts (0: plain decoding); use [R, 2]: whether the row may
    take lookup drafts (column 0) and draft-model drafts (column 1); state {"accepted",
    "judged"} [R, 2, max_ngram + 3]: decayed counts of first / later drafts per lookup
    match length (columns 0 .. max_ngram), of the draft model and of host drafts (the last
    two columns); given: host drafts (drafts [R, k], count [R], -1 for rows without) that
    replace those rows' lookup drafts (a proposer written in Python; one round a call);
    costs [2, widths]: t(W) / t(1) of a step of R rows without / with the draft chain;
    seeds [R]; rs: per-row sampling. With a draft model (dparams, dcfg): dkv its cache over
    the same page table, dkv.lengths the committed tokens it holds (at most size);
    sample_drafts: rows with temperature > 0 sample the model's drafts. adaptive False:
    every row drafts in full (a fixed-k baseline for the chooser).
    Returns (tokens [n_rounds, R, SPAN], counts [n_rounds, R], drafts judged
    [n_rounds, R], width of each round [n_rounds] (index into steps.BUCKETS, plus
    len(BUCKETS) when the chain ran; -1: no round), nan flag, cache, draft cache, state).
    """
    rows = history.shape[0]
    widths = steps.BUCKETS[:steps.BUCKETS.index(steps.bucket(k + 1)) + 1]
    room = jnp.array([min(w - 1, k) for w in widths])  # drafts each width judges
    model_col = jnp.full((rows,), max_ngram + 1, jnp.int32)
    host_col = max_ngram + 2
    drawn = sample_drafts & (rs.temperature > 0)  # rows whose model drafts are sampled

    def branch(width):
        def go(carry, size, last, lookup_drafts, first, first_logq, row_model, n, live, chain):
            kv, dkv = carry
            model_drafts = first[:, None]
            logq = None if first_logq is None else first_logq[:, None]
            if dcfg is not None and k > 1:
                steps_n = jnp.where(chain, max(min(width - 1, k) - 1, 0), 0)
                model_drafts, logq, dkv = _chain(dparams, dcfg, dkv, first, first_logq, size, steps_n, k,
                                                 seeds, rs, drawn, sample_drafts)
            if dcfg is not None:
                model_drafts = jnp.pad(model_drafts, ((0, 0), (0, k - model_drafts.shape[1])))
                drafts = jnp.where(row_model[:, None], model_drafts, lookup_drafts)
            else:
                drafts = lookup_drafts
            out, count, bad, kv = _verify(params, cfg, kv, last, drafts, n, live, row_model & drawn, logq, seeds,
                                          rs, width, sampled)
            return (out, count, bad, model_drafts), (kv, dkv)
        return go

    def feed(width):
        def go(dkv, history, size):
            return _feed(dparams, dcfg, dkv, history, size, width)
        return go

    def body(c):
        kv, dkv, history, size, made, i, state, bad, stopped, log = c
        live = (made < budget) & ~stopped
        limit = jnp.where(live, jnp.minimum(row_k, jnp.maximum(budget - made - 1, 0)), 0)
        if k:
            lookup_drafts, found, m = jax.vmap(lambda h, s: find(h, s, k, max_ngram, min_ngram))(history, size)
        else:
            lookup_drafts, found, m = (jnp.zeros((rows, 1), jnp.int32), jnp.zeros(rows, jnp.int32),
                                       jnp.zeros(rows, jnp.int32))
        if given is not None and k:
            hosted = given[1] >= 0
            lookup_drafts = jnp.where(hosted[:, None], given[0], lookup_drafts)
            found = jnp.where(hosted, given[1], found)
            m = jnp.where(hosted, host_col, m)
        found = jnp.where(use[:, 0], jnp.minimum(found, limit), 0)
        rate = _rates(state, m)
        e_l = expected_tokens(rate[:, :1], rate[:, 1:], jnp.minimum(room[None, :], found[:, None]))  # [R, widths]
        per_row = [e_l]  # expected tokens of each row at each width: lookup only, or with the chain
        any_drafts = jnp.any(found > 0)
        first, first_logq, dlen = jnp.zeros(rows, jnp.int32), None, None
        found_m = e_m = None
        if dcfg is not None:
            dlen = dkv.lengths
            big = jnp.any(live & (size - dlen > FEEDS[0]))
            logits, dkv = steps.switch(big.astype(jnp.int32), [feed(w) for w in FEEDS], dkv, history, size)
            first, first_logq = _draft_token(logits, size, seeds, rs, drawn, sample_drafts)
            found_m = jnp.where(use[:, 1], limit, 0)
            rate = _rates(state, model_col)
            e_m = expected_tokens(rate[:, :1], rate[:, 1:], jnp.minimum(room[None, :], found_m[:, None]))
            per_row.append(jnp.maximum(e_l, e_m))
            any_drafts = any_drafts | jnp.any(found_m > 0)
        if adaptive:
            gain = jnp.stack([jnp.sum(e * live[:, None], axis=0) for e in per_row]) / costs[:len(per_row), :len(widths)]
            best = jnp.argmax(gain.reshape(-1))
            pick = jnp.where(any_drafts, best % len(widths), 0)
            chain = (best // len(widths) > 0) & (pick > 0)
            at = jnp.arange(rows)
            row_model = (chain & (e_m[at, pick] > e_l[at, pick]) & (found_m > 0) if dcfg is not None
                         else jnp.zeros(rows, bool))
        else:  # fixed k: the draft model where a row may use it, else lookup; the narrowest width for all
            row_model = (found_m > 0) if dcfg is not None else jnp.zeros(rows, bool)
            wanted = jnp.max(jnp.where(row_model, found_m, found)) if dcfg is not None else jnp.max(found)
            pick = jnp.argmax(room >= wanted)
            chain = jnp.any(row_model) & (pick > 0)
        n = jnp.where(pick > 0, jnp.minimum(room[pick], jnp.where(row_model, found_m, found) if dcfg is not None
                                            else found), 0)
        last = jnp.take_along_axis(history, jnp.maximum(size - 1, 0)[:, None], axis=1)[:, 0]
        (out, count, nan, model_drafts), (kv, dkv) = steps.switch(
            pick, [branch(w) for w in widths], (kv, dkv), size, last, lookup_drafts, first, first_logq, row_model, n,
            live, chain)
        # score every lookup (a plain step judges its first draft) and every model draft made
        lookup_n = jnp.where(pick > 0, jnp.where(row_model, jnp.minimum(found, room[pick]), n), jnp.minimum(found, 1))
        if k:
            state = _score(state, m, lookup_drafts, lookup_n, out, count, jnp.where(m > 0, ACCEPT_DECAY, 1.0))
        if dcfg is not None:
            model_n = jnp.where(use[:, 1] & live, jnp.where(chain, jnp.minimum(room[pick], limit),
                                                            jnp.minimum(limit, 1)), 0)
            state = _score(state, model_col, model_drafts, model_n, out, count,
                           jnp.where(model_n > 0, ACCEPT_DECAY, 1.0))
            # the draft cache keeps the chain's fed drafts that were committed (never the newest token)
            agree = jnp.sum(jnp.cumprod((model_drafts == out[:, :k]).astype(jnp.int32), axis=1), axis=1)
            fed = jnp.where(chain, jnp.minimum(room[pick], k) - 1, 0)
            kept = jnp.minimum(jnp.minimum(agree, fed), jnp.maximum(count - 1, 0))
            dkv = dkv.replace(lengths=jnp.where(count > 0, size + kept, dlen))
        history = jax.vmap(lambda h, o, s: jax.lax.dynamic_update_slice(h, o, (s,)))(history, out, size)
        committed = jnp.arange(SPAN)[None, :] < count[:, None]
        stopped = stopped | jnp.any(committed[:, :, None] & (out[:, :, None] == stops[:, None, :]), axis=(1, 2))
        kv = kv.replace(lengths=kv.lengths + count)
        log = {"tokens": log["tokens"].at[i].set(out), "counts": log["counts"].at[i].set(count),
               "drafts": log["drafts"].at[i].set(jnp.where(count > 0, n, 0)),
               "width": log["width"].at[i].set(pick + jnp.where(chain, len(steps.BUCKETS), 0))}
        return kv, dkv, history, size + count, made + count, i + 1, state, bad | nan, stopped, log

    def more(c):
        made, i, stopped = c[4], c[5], c[8]
        return (i < n_rounds) & jnp.any((made < budget) & ~stopped)

    log = {"tokens": jnp.zeros((n_rounds, rows, SPAN), jnp.int32),
           "counts": jnp.zeros((n_rounds, rows), jnp.int32), "drafts": jnp.zeros((n_rounds, rows), jnp.int32),
           "width": jnp.full((n_rounds,), -1, jnp.int32)}
    init = (kv, dkv, history, size, jnp.zeros(rows, jnp.int32), jnp.int32(0), state, jnp.bool_(False),
            jnp.zeros(rows, bool), log)
    kv, dkv, _, _, _, _, state, bad, _, log = jax.lax.while_loop(more, body, init)
    return log["tokens"], log["counts"], log["drafts"], log["width"], bad, kv, dkv, state


@partial(jax.jit, static_argnames=("cfg", "sampled"), donate_argnames=("kv",))
def prefill_chunk(params: Params, cfg: Qwen3Config, kv: KVCache, tokens: jax.Array, n_valid: jax.Array,
                  seed: jax.Array, rs: RowSampling, sampled: bool):
    """Append one chunk [C] (first n_valid real) to the one row of `kv` (its page table
    [1, pages]) and draw the token after it with that row's settings.

    Returns (token, nan flag, cache with length + n_valid)."""
    start = kv.lengths[0]
    positions = start + jnp.arange(tokens.shape[0])
    h, kv, _ = hidden_states(params, cfg, tokens[None], positions[None], kv)
    logits = unembed(params, cfg, h[0, n_valid - 1][None])
    token = smp.target_tokens_rows(logits, (start + n_valid)[None], seed[None], rs, sampled)[0]
    return token, jnp.any(jnp.isnan(logits)), kv.replace(lengths=kv.lengths + n_valid)
