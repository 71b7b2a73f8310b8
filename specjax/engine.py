"""The batched speculative engine: many sequences in one paged pool, requests joining and
leaving between calls (continuous batching), speculative rounds on the device.

A call of the compiled `rounds` runs up to R rounds over the running rows with no return
to Python between them. One round, for every row at once:
1. draft: prompt lookup on the row's own history (the tokens after the latest earlier
   occurrence of its longest suffix of max_ngram .. min_ngram tokens);
2. choose: one verify width W for the step and each row's drafts, min(W - 1, found), so
   that the batch's expected committed tokens per second is largest. A row's expected
   tokens come from its own acceptance (first and later drafts per n-gram length, decayed
   counts) and the cost of a step from the measured time of a step of this many rows at
   each width (`StepCosts`), so speculation narrows as the batch fills;
3. verify and commit: every row's [last, d1 .. d_{W-1}] scored in one target step; each
   row keeps its drafts up to the first that differs from the target's own
   position-keyed token, plus that token;
4. score the lookups (drafted or not) into each row's acceptance counts.
Every choice is a function of committed tokens and past acceptance only, and each token is
the one plain decoding draws at its position, so every row's output is, token for token,
what the row generates alone (and what plain decoding generates), greedy or sampled.

Host side (`Engine`): a queue of requests, a slot per running row, the page allocator
(`specjax.pages`), chunked prefill of joining requests interleaved with decode calls,
per-request statistics.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import sampling as smp
from . import steps
from .checkpoint import Params
from .config import Qwen3Config
from .kv import KVCache
from .lookup import (ACCEPT_DECAY, MAX_NGRAM, PRIOR_ACCEPT, PSEUDO, STOPS, StepCosts, _switch,
                     expected_tokens, find)
from .loop import PREFILL_CHUNK, GenerateResult, GenerationError, Stats
from .model import Model
from .pages import SCRATCH, PageAllocator, PoolError
from .proposers import check_k, check_ngram
from .qwen3 import hidden_states, unembed
from .sampling import RowSampling, Sampling

SPAN = steps.BUCKETS[-1]  # widest verify step: tokens a row commits per round at most
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Cost of one step over N tokens (rows x width) relative to one token, before any timing:
# CPU, tiny-code with the CPU kernels inside a device loop (2 cores, 2026-11-30), and on
# accelerators a step that stays bandwidth-bound (adaptive.ACCELERATOR_VERIFY_RATIO);
# linear past the last point.
CPU_TOKENS_COST = ((1, 1.0), (2, 1.25), (4, 1.7), (8, 2.5), (16, 4.3))
ACCELERATOR_TOKENS_COST = ((1, 1.0), (2, 1.02), (4, 1.04), (8, 1.08), (16, 1.15))


def tokens_cost(n: int) -> float:
    """Prior cost of a step over n tokens, relative to a one-token step."""
    table = CPU_TOKENS_COST if jax.default_backend() == "cpu" else ACCELERATOR_TOKENS_COST
    xs, ys = zip(*table)
    if n <= xs[-1]:
        return float(np.interp(n, xs, ys))
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return ys[-1] + slope * (n - xs[-1])


def prior_width_costs(rows: int) -> np.ndarray:
    """t(rows x W) / t(rows x 1) for each verify width W in steps.BUCKETS."""
    return np.array([tokens_cost(rows * w) / tokens_cost(rows) for w in steps.BUCKETS])


# --------------------------------------------------------------------------- device side

def _verify_rows(params: Params, cfg: Qwen3Config, kv: KVCache, last: jax.Array, drafts: jax.Array,
                 n: jax.Array, live: jax.Array, seeds: jax.Array, rs: RowSampling, width: int,
                 sampled: bool):
    """Score [last, d1 .. d_{W-1}] for every row [R] and commit each row's accepted prefix.

    Returns (tokens [R, SPAN]: t_1 .. t_W, count [R] = accepted + 1 (0 for rows not live),
    nan flag over live rows, cache)."""
    rows = last.shape[0]
    start = kv.lengths
    tokens = jnp.concatenate([last[:, None], drafts[:, :width - 1]], axis=1).astype(jnp.int32)
    positions = start[:, None] + jnp.arange(width)
    h, kv, _ = hidden_states(params, cfg, tokens, positions, kv)
    logits = unembed(params, cfg, h)  # [R, W, V]
    flat = smp.target_tokens_rows(logits.reshape(rows * width, -1), (positions + 1).reshape(-1),
                                  jnp.repeat(seeds, width), rs.repeat(width), sampled)
    out = flat.reshape(rows, width)
    ok = (tokens[:, 1:] == out[:, :-1]) & (jnp.arange(width - 1) < n[:, None])
    count = jnp.where(live, jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1) + 1, 0)
    bad = jnp.any(jnp.isnan(logits).any(axis=(1, 2)) & live)
    return jnp.pad(out, ((0, 0), (0, SPAN - width))), count, bad, kv


@partial(jax.jit, static_argnames=("cfg", "k", "max_ngram", "min_ngram", "n_rounds", "sampled"),
         donate_argnames=("kv",))
def rounds(params: Params, cfg: Qwen3Config, kv: KVCache, history: jax.Array, size: jax.Array,
           budget: jax.Array, stops: jax.Array, row_k: jax.Array, state: dict, costs: jax.Array,
           seeds: jax.Array, rs: RowSampling, *, k: int, max_ngram: int, min_ngram: int, n_rounds: int,
           sampled: bool):
    """Up to `n_rounds` speculative rounds over R rows (module docstring).

    history [R, H]: each row's committed tokens (prompt and output), size [R] of them, the
    last being the one the next step feeds (the cache holds the others); budget [R]: tokens
    a row may commit in this call (0: the row is idle); stops [R, STOPS] (-1 padded);
    row_k [R]: a row's most drafts (0: plain decoding); state {"accepted", "judged"}
    [R, 2, max_ngram + 1]: decayed counts of first / later drafts per n-gram length;
    costs [widths]: t(W) / t(1) of a step of R rows; seeds [R]; rs: per-row sampling.
    Returns (tokens [n_rounds, R, SPAN], counts [n_rounds, R], drafts judged
    [n_rounds, R], nan flag, cache, state).
    """
    rows = history.shape[0]
    widths = tuple(w for w in steps.BUCKETS if w - 1 <= k)
    room = jnp.array([w - 1 for w in widths])
    at = jnp.arange(rows)

    def branch(width):
        def go(kv, last, drafts, n, live):
            return _verify_rows(params, cfg, kv, last, drafts, n, live, seeds, rs, width, sampled)
        return go

    def body(c):
        kv, history, size, made, i, state, bad, stopped, log = c
        live = (made < budget) & ~stopped
        if k:
            drafts, found, m = jax.vmap(lambda h, s: find(h, s, k, max_ngram, min_ngram))(history, size)
        else:
            drafts, found, m = (jnp.zeros((rows, 1), jnp.int32), jnp.zeros(rows, jnp.int32),
                                jnp.zeros(rows, jnp.int32))
        found = jnp.where(live, jnp.minimum(found, jnp.minimum(row_k, jnp.maximum(budget - made - 1, 0))), 0)
        rates = (state["accepted"][at, :, m] + PRIOR_ACCEPT * PSEUDO) / (state["judged"][at, :, m] + PSEUDO)
        n_w = jnp.minimum(room[None, :], found[:, None])  # [R, widths]
        gain = jnp.sum(expected_tokens(rates[:, :1], rates[:, 1:], n_w) * live[:, None], axis=0)
        pick = jnp.where(jnp.any(found > 0), jnp.argmax(gain / costs[:len(widths)]), 0)
        n = jnp.where(pick > 0, room[pick], 0)
        n = jnp.minimum(n, found)
        last = jnp.take_along_axis(history, jnp.maximum(size - 1, 0)[:, None], axis=1)[:, 0]
        out, count, nan, kv = _switch(pick, [branch(w) for w in widths], kv, last, drafts, n, live)
        if k:  # score every lookup: drafted rows judge n drafts, the others their first
            judge_n = jnp.where(pick > 0, n, jnp.minimum(found, 1))
            idx = jnp.arange(k)
            judged = (idx < judge_n[:, None]) & (idx < count[:, None])
            hit = judged & (drafts == out[:, :k])
            decay = jnp.where(m > 0, ACCEPT_DECAY, 1.0)[:, None]
            later = idx > 0

            def score(counts, mask):
                per = jnp.stack([jnp.sum(mask & ~later, axis=1), jnp.sum(mask & later, axis=1)], axis=1)
                return counts.at[at, :, m].set(counts[at, :, m] * decay + per.astype(counts.dtype))
            state = {"accepted": score(state["accepted"], hit), "judged": score(state["judged"], judged)}
        history = jax.vmap(lambda h, o, s: jax.lax.dynamic_update_slice(h, o, (s,)))(history, out, size)
        committed = jnp.arange(SPAN)[None, :] < count[:, None]
        stopped = stopped | jnp.any(committed[:, :, None] & (out[:, :, None] == stops[:, None, :]), axis=(1, 2))
        kv = kv.replace(lengths=kv.lengths + count)
        log = {"tokens": log["tokens"].at[i].set(out), "counts": log["counts"].at[i].set(count),
               "drafts": log["drafts"].at[i].set(jnp.where(count > 0, n, 0))}
        return kv, history, size + count, made + count, i + 1, state, bad | nan, stopped, log

    def more(c):
        _, _, _, made, i, _, _, stopped, _ = c
        return (i < n_rounds) & jnp.any((made < budget) & ~stopped)

    log = {"tokens": jnp.zeros((n_rounds, rows, SPAN), jnp.int32),
           "counts": jnp.zeros((n_rounds, rows), jnp.int32), "drafts": jnp.zeros((n_rounds, rows), jnp.int32)}
    init = (kv, history, size, jnp.zeros(rows, jnp.int32), jnp.int32(0), state, jnp.bool_(False),
            jnp.zeros(rows, bool), log)
    kv, _, _, _, _, state, bad, _, log = jax.lax.while_loop(more, body, init)
    return log["tokens"], log["counts"], log["drafts"], bad, kv, state


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


# ----------------------------------------------------------------------------- host side

@dataclasses.dataclass(frozen=True)
class Speculation:
    """The engine's prompt-lookup settings: k is the most drafts any row may make (a
    request asks for at most k, or 0 for plain decoding); n-gram lengths max .. min."""

    k: int = 15
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        check_k(self.k, SPAN - 1)
        check_ngram(self.max_ngram, self.min_ngram, MAX_NGRAM)


class Request:
    """A submitted generation: iterate it for tokens as they are committed, `result()` to
    run the engine until it is done, `cancel()` to drop it (its pages return to the pool)."""

    def __init__(self, engine: "Engine", rid: int, prompt: np.ndarray, max_new_tokens: int, sampling: Sampling,
                 seed: int, stops: frozenset[int], k: int):
        self.engine, self.id, self.prompt = engine, rid, prompt
        self.max_new_tokens, self.sampling, self.seed, self.stops, self.k = max_new_tokens, sampling, seed, stops, k
        self.tokens: list[int] = []
        self.stats = Stats(prompt_tokens=len(prompt))
        self.done = self.stopped = self.cancelled = False
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self._streamed = 0
        # engine bookkeeping
        self.slot: int | None = None
        self.pages: list[int] = []
        self.reserved = 0
        self.prefilled = 0
        self.state = {"accepted": np.zeros((2, engine.spec.max_ngram + 1), np.float32),
                      "judged": np.zeros((2, engine.spec.max_ngram + 1), np.float32)}

    def __repr__(self) -> str:
        return f"Request(id={self.id}, prompt={len(self.prompt)} tokens, {len(self.tokens)} generated, done={self.done})"

    @property
    def length(self) -> int:
        """Tokens of this sequence (prompt and output)."""
        return len(self.prompt) + len(self.tokens)

    def result(self) -> GenerateResult:
        while not self.done:
            self.engine.step()
        if self.cancelled:
            raise GenerationError(f"request {self.id} was cancelled")
        return GenerateResult(list(self.tokens), self.stats, self.stopped)

    def __iter__(self) -> Iterator[int]:
        while True:
            while self._streamed < len(self.tokens):
                self._streamed += 1
                yield self.tokens[self._streamed - 1]
            if self.done:
                return
            self.engine.step()

    def cancel(self) -> None:
        self.engine.cancel(self)


class Engine:
    """Continuous batching over one paged KV pool (module docstring).

    `speculative`: None (plain decoding), a `Speculation` or an int k (prompt lookup with
    up to k drafts per row). `max_batch` rows run at once; each holds up to `max_len`
    tokens; the pool has `num_pages` pages of `page_size` slots (default: every row can
    reach max_len). `rounds` is R, the speculative rounds per device call.
    """

    def __init__(self, model: Model, speculative: Speculation | int | None = None, *, max_batch: int = 8,
                 max_len: int | None = None, num_pages: int | None = None, page_size: int = 16,
                 rounds: int = 16):
        cfg = model.config
        if speculative is None or isinstance(speculative, Speculation):
            spec = speculative
        elif isinstance(speculative, int) and not isinstance(speculative, bool):
            spec = Speculation(k=speculative)
        else:
            raise GenerationError(f"speculative must be None, an int k or a Speculation, got {speculative!r}")
        for name, value, low in (("max_batch", max_batch, 1), ("page_size", page_size, 1), ("rounds", rounds, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise GenerationError(f"{name} must be an integer >= {low}, got {value!r}")
        max_len = min(cfg.max_position_embeddings, 4096) if max_len is None else max_len
        if isinstance(max_len, bool) or not isinstance(max_len, int) or not 2 <= max_len <= cfg.max_position_embeddings:
            raise GenerationError(f"max_len must be an integer in [2, max_position_embeddings = "
                                  f"{cfg.max_position_embeddings}], got {max_len!r}")
        self.model, self.spec = model, spec or Speculation(k=1)
        self.k = spec.k if spec else 0
        self.max_batch, self.page_size, self.n_rounds = max_batch, page_size, rounds
        self.max_len = max_len
        self.pages_per_row = -(-(max_len + SPAN) // page_size)
        num_pages = max_batch * self.pages_per_row + 1 if num_pages is None else num_pages
        self.pages = PageAllocator(num_pages, page_size)
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, num_pages, page_size, cfg.head_dim)
        self.k_pool = jnp.zeros(shape, model.dtype)
        self.v_pool = jnp.zeros(shape, model.dtype)
        self.table = np.full((max_batch, self.pages_per_row), SCRATCH, np.int32)
        self.history = np.zeros((max_batch, self.pages_per_row * page_size + SPAN), np.int32)
        self.slots: list[Request | None] = [None] * max_batch
        self.queue: deque[Request] = deque()
        self.costs: dict[tuple[int, bool], StepCosts] = {}
        self._next_id = 0

    # ------------------------------------------------------------------ requests
    def submit(self, ids: Sequence[int], *, max_new_tokens: int, sampling: Sampling = Sampling(), seed: int = 0,
               stop_ids: Sequence[int] | None = None, k: int | None = None) -> Request:
        """Queue a request; it joins the batch when a row and its pages are free.

        stop_ids defaults to the model's eos ids (`()` never stops early); k (at most the
        engine's) limits this request's drafts, 0 for plain decoding."""
        from .loop import _token_ids, _validate

        ids = _token_ids(ids)
        _validate(self.model, ids, max_new_tokens, None, seed)
        if not isinstance(sampling, Sampling):
            raise GenerationError(f"sampling must be a specjax.Sampling, got {type(sampling).__name__}")
        k = self.k if k is None else k
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.k:
            raise GenerationError(f"k must be an integer in [0, {self.k}] (the engine's speculative k), got {k!r}")
        total = len(ids) + max_new_tokens
        if total > self.max_len:
            raise PoolError(f"prompt ({len(ids)}) + max_new_tokens ({max_new_tokens}) = {total} tokens exceeds the "
                            f"engine's max_len ({self.max_len})")
        need = self.pages.pages_for(total + SPAN)
        if need > self.pages.usable:
            raise PoolError(f"prompt ({len(ids)}) + max_new_tokens ({max_new_tokens}) needs {need} pages of "
                            f"{self.page_size} slots; the pool has {self.pages.usable}")
        stops = frozenset(int(s) for s in (self.model.eos_ids if stop_ids is None else stop_ids))
        req = Request(self, self._next_id, ids.astype(np.int32), max_new_tokens, sampling, seed, stops, k)
        req.reserved = need
        self._next_id += 1
        self.queue.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """Drop a queued or running request; its pages return to the pool."""
        if req.done:
            return
        if req in self.queue:
            self.queue.remove(req)
        req.cancelled = True
        self._finish(req)

    @property
    def running(self) -> list[Request]:
        return [r for r in self.slots if r is not None]

    def has_work(self) -> bool:
        return bool(self.queue) or any(r is not None for r in self.slots)

    def run(self) -> None:
        """Step until every submitted request is done."""
        while self.has_work():
            self.step()

    # ------------------------------------------------------------------ one step
    def step(self) -> dict[Request, list[int]]:
        """Admit what fits, prefill one chunk of a joining request (all of them while
        nothing is decoding), run one device call over the decoding rows; returns the
        tokens each request committed."""
        new: dict[Request, list[int]] = {}
        self._admit()
        joining = [r for r in self.slots if r is not None and r.prefilled < len(r.prompt)]
        decoding = [r for r in self.slots if r is not None and r.prefilled == len(r.prompt)]
        for req in joining:
            while req.prefilled < len(req.prompt):
                token = self._prefill(req)
                if token is not None:
                    self._emit(req, [token], new)
                if decoding:
                    break
            if decoding:
                break
        decoding = [r for r in decoding if not r.done]
        if decoding:
            self._decode(decoding, new)
        return new

    def _admit(self) -> None:
        while self.queue and None in self.slots and self.pages.can_reserve(self.queue[0].reserved):
            req = self.queue.popleft()
            self.pages.reserve(req.reserved)
            req.slot = self.slots.index(None)
            self.slots[req.slot] = req
            self.table[req.slot] = SCRATCH
            self.history[req.slot] = 0
            self.history[req.slot, :len(req.prompt)] = req.prompt

    def _grow(self, req: Request, tokens: int) -> None:
        """Own the pages for this sequence's first `tokens` slots (within its reservation)."""
        want = min(self.pages.pages_for(tokens), self.pages_per_row)
        extra = min(want - len(req.pages), req.reserved)
        if extra > 0:
            got = self.pages.take(extra)
            req.reserved -= extra
            self.table[req.slot, len(req.pages):len(req.pages) + extra] = got
            req.pages += got

    def _kv(self, rows: slice, lengths: np.ndarray) -> KVCache:
        return KVCache(self.k_pool, self.v_pool, jnp.asarray(self.table[rows]), jnp.asarray(lengths, jnp.int32),
                       page_size=self.page_size)

    def _prefill(self, req: Request) -> int | None:
        """One chunk of req's prompt; the first token once the prompt is in."""
        m = self.model
        start = req.prefilled
        part = req.prompt[start:start + PREFILL_CHUNK]
        self._grow(req, start + PREFILL_CHUNK)
        buf = np.zeros(PREFILL_CHUNK, np.int32)
        buf[:len(part)] = part
        t0 = time.perf_counter()
        kv = self._kv(slice(req.slot, req.slot + 1), np.array([start]))
        token, bad, kv = prefill_chunk(m.params, m.config, kv, jnp.asarray(buf), jnp.int32(len(part)),
                                       jnp.uint32(req.seed), RowSampling.of([req.sampling]),
                                       sampled=not req.sampling.greedy)
        self.k_pool, self.v_pool = kv.k, kv.v
        req.prefilled += len(part)
        if bool(bad):
            self._finish(req)
            raise FloatingPointError(f"prefill of request {req.id} produced NaN logits (chunk at token {start}); "
                                     "check the weights")
        req.stats.prefill_s += time.perf_counter() - t0
        return int(token) if req.prefilled == len(req.prompt) else None

    def _decode(self, decoding: list[Request], new: dict[Request, list[int]]) -> None:
        m = self.model
        top = max(r.slot for r in decoding) + 1
        rows = min(next((b for b in ROW_BUCKETS if b >= top), top), self.max_batch)
        size = np.zeros(rows, np.int32)
        budget = np.zeros(rows, np.int32)
        stops = np.full((rows, STOPS), -1, np.int32)
        row_k = np.zeros(rows, np.int32)
        seeds = np.zeros(rows, np.uint32)
        settings = [Sampling()] * rows
        zeros = np.zeros((rows, 2, self.spec.max_ngram + 1), np.float32)
        state = {"accepted": zeros.copy(), "judged": zeros.copy()}
        live = [r for r in decoding if r.slot < rows]
        for r in live:
            b = r.slot
            size[b] = r.length
            budget[b] = min(r.max_new_tokens - len(r.tokens), self.n_rounds * (r.k + 1))
            self._grow(r, r.length + int(budget[b]) + SPAN)
            listed = sorted(r.stops)[:STOPS]
            stops[b, :len(listed)] = listed
            row_k[b], seeds[b], settings[b] = r.k, r.seed, r.sampling
            state["accepted"][b], state["judged"][b] = r.state["accepted"], r.state["judged"]
        idle = np.ones(rows, bool)
        idle[[r.slot for r in live]] = False
        table = self.table[:rows].copy()
        table[idle] = SCRATCH
        sampled = any(not s.greedy for s in settings)
        costs = self.costs.setdefault((rows, sampled), StepCosts(prior_width_costs(rows)))
        t0 = time.perf_counter()
        kv = KVCache(self.k_pool, self.v_pool, jnp.asarray(table), jnp.asarray(np.maximum(size - 1, 0)),
                     page_size=self.page_size)
        tokens, counts, drafts, bad, kv, state = rounds(
            m.params, m.config, kv, jnp.asarray(self.history[:rows]), jnp.asarray(size), jnp.asarray(budget),
            jnp.asarray(stops), jnp.asarray(row_k), state, jnp.asarray(costs.ratios(), jnp.float32),
            jnp.asarray(seeds), RowSampling.of(settings), k=self.k, max_ngram=self.spec.max_ngram,
            min_ngram=self.spec.min_ngram, n_rounds=self.n_rounds, sampled=sampled)
        self.k_pool, self.v_pool = kv.k, kv.v
        tokens, counts, drafts, bad, state = jax.device_get((tokens, counts, drafts, bad, state))
        elapsed = time.perf_counter() - t0
        if bad:
            for r in live:
                self._finish(r)
            raise FloatingPointError("target logits contain NaN in a decode step of requests "
                                     f"{[r.id for r in live]}; check the weights")
        widths = [steps.bucket(int(d) + 1) for d in drafts.max(axis=1)[counts.max(axis=1) > 0]]
        costs.observe(np.array([widths.count(w) for w in steps.BUCKETS], float), elapsed)
        for r in live:
            b = r.slot
            r.state = {"accepted": state["accepted"][b], "judged": state["judged"][b]}
            committed: list[int] = []
            for i in range(self.n_rounds):
                c = int(counts[i, b])
                if c == 0:
                    continue
                r.stats.record(int(drafts[i, b]), c - 1)
                committed += [int(x) for x in tokens[i, b, :c]]
            self._emit(r, committed, new)

    def _emit(self, req: Request, tokens: list[int], new: dict[Request, list[int]]) -> None:
        """Append committed tokens up to a stop id or max_new_tokens."""
        if req.first_token_at is None and tokens:
            req.first_token_at = time.perf_counter()
            req.stats.prefill_s = req.first_token_at - req.submitted
        taken = []
        for tok in tokens:
            taken.append(tok)
            if tok in req.stops or len(req.tokens) + len(taken) == req.max_new_tokens:
                req.stopped = tok in req.stops
                req.done = True
                break
        self.history[req.slot, req.length:req.length + len(taken)] = taken
        req.tokens += taken
        new[req] = new.get(req, []) + taken
        if req.done:
            self._finish(req)

    def _finish(self, req: Request) -> None:
        """Return a request's pages and reservation and free its row."""
        req.done = True
        req.stats.new_tokens = len(req.tokens)
        if req.first_token_at is not None:
            req.stats.verify_s = time.perf_counter() - req.first_token_at
            req.stats.host_s = req.stats.propose_s = 0.0
        if req.slot is not None:
            self.pages.release(req.pages, unreserve=req.reserved)
            self.table[req.slot] = SCRATCH
            self.slots[req.slot] = None
            req.pages, req.reserved, req.slot = [], 0, None


# ------------------------------------------------------------------------ batched generate

def _per_prompt(value: Any, n: int, name: str, is_one) -> list:
    """One value for every prompt, or a list with one per prompt."""
    if is_one(value):
        return [value] * n
    if isinstance(value, (list, tuple)) and len(value) == n:
        return list(value)
    raise GenerationError(f"{name} must be one value or a list with one per prompt ({n}), got {value!r}")


def speculation_of(speculative: Any) -> Speculation | None:
    """The engine's settings for a `generate` proposer argument (None: plain decoding)."""
    from .lookup import LookupProposer
    from .proposers import NgramProposer

    if speculative is None or isinstance(speculative, Speculation):
        return speculative
    if isinstance(speculative, (LookupProposer, NgramProposer)):
        return Speculation(speculative.k, speculative.max_ngram, speculative.min_ngram)
    raise GenerationError(f"a batch of prompts runs on the batched engine, which drafts by prompt lookup "
                          f"(LookupProposer, NgramProposer) or not at all; got {type(speculative).__name__}")


def generate_batch(model: Model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int],
                   sampling: Sampling | Sequence[Sampling] = Sampling(), stop_ids: Any = None,
                   seed: int | Sequence[int] = 0, speculative: Any = None, max_batch: int = 16) -> list[GenerateResult]:
    """`specjax.generate` for a list of prompts: one `GenerateResult` per prompt, in order,
    each the same tokens as that prompt generated alone. Each of max_new_tokens, sampling,
    stop_ids and seed is one value or a list with one per prompt."""
    n = len(prompts)
    if n == 0:
        raise GenerationError("prompts is an empty list")
    news = _per_prompt(max_new_tokens, n, "max_new_tokens", lambda v: isinstance(v, int))
    settings = _per_prompt(sampling, n, "sampling", lambda v: isinstance(v, Sampling))
    seeds = _per_prompt(seed, n, "seed", lambda v: isinstance(v, (int, np.integer)))
    one_stop_list = lambda v: v is None or (isinstance(v, (list, tuple, np.ndarray)) and
                                            all(isinstance(s, (int, np.integer)) for s in v))
    stops = _per_prompt(stop_ids, n, "stop_ids", one_stop_list)
    spec = speculation_of(speculative)
    longest = max(len(p) + (m if isinstance(m, int) else 0) for p, m in zip(prompts, news))
    cap = model.config.max_position_embeddings
    max_len = max(2, min(-(-longest // 256) * 256, cap))  # longer than cap: submit names it
    engine = Engine(model, spec, max_batch=min(n, max_batch), max_len=max_len)
    reqs = [engine.submit(p, max_new_tokens=m, sampling=s, seed=sd, stop_ids=st)
            for p, m, s, sd, st in zip(prompts, news, settings, seeds, stops)]
    engine.run()
    return [r.result() for r in reqs]
