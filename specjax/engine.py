"""The batched speculative engine: many sequences in one paged pool, requests joining and
leaving between calls (continuous batching), speculative rounds on the device.

Host side here: a queue of requests, a row (slot) per running request, the page allocator
(`specjax.pages`), chunked prefill of joining requests interleaved with decode calls, the
step-cost fit per row count, per-request statistics. Each decode call runs R rounds of
`specjax.rounds` (drafting by prompt lookup, a draft model and/or a DFlash drafter,
choosing, verifying, committing) with no return to Python between rounds.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from . import steps
from .checkpoint import weight_bytes
from .costs import TREE_BUILD_COST, StepCosts, block_cost, build_cost, chain_cost, prior_costs, tree_cost
from .dflash import MARKOV, Drafter, fit_problems
from .drafters import DFlashCache, draft_head, draft_tree_shape, draft_tree_slots
from .errors import is_integer
from .kv import KVCache, zeros
from .lookup import MAX_NGRAM
from .results import (PREFILL_CHUNKS, GenerateResult, GenerationError, Stats, is_id_list, stop_set, token_ids,
                      validate)
from .model import Model
from .pages import SCRATCH, PageAllocator, PoolError
from .proposers import ProposerError, check_k, check_ngram, check_tree
from .qwen3 import head_weight
from .rounds import FEEDS, SOURCES, SPAN, new_state, prefill_chunk, rounds
from .sampling import RowSampling, Sampling

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STOPS = 8  # stop ids a row's device loop checks (more are still honoured: the host checks them all)
_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> {(rows, ...): StepCosts}


# ----------------------------------------------------------------------------- host side

@dataclasses.dataclass(frozen=True)
class Speculation:
    """The engine's prompt-lookup settings: k is the most drafts any row may make (a
    request asks for at most k, or 0 for plain decoding); n-gram lengths max .. min.
    adaptive=False drafts every match in full instead of choosing (fixed k). tree > 0:
    prompt lookup drafts a tree of up to that many nodes (`lookup.tree`: where earlier
    matches continue differently it branches) in place of a chain, and so does a DFlash
    drafter: the block's best tree (`drafters.block_tree`, `drafters.markov_tree`) for deterministic drafts, and
    for sampled ones a tree of fixed shape, the chain plus second children drawn without
    replacement (`drafters.sampled_tree`, verified by `tree_accept.accept_tree_rows`);
    and so does a draft model for greedy drafts: its best tree by cumulative draft
    log-probability (`drafters.draft_tree`, EAGLE-2), and for sampled ones the chain plus
    second children (`drafters.draft_sampled_tree`, verified as sampled DFlash trees are).
    One budget covers every proposer's trees; 0: chains.

    tree="auto": trees of up to SPAN - 1 nodes, but each round a row drafts, per proposer,
    the shape whose drafts have held deeper: every round that drafts both (lookup always,
    DFlash when its block runs, a draft model when it grows its tree, whose greedy chain is
    the chain's) measures how far each would have been accepted, as far as the committed
    tokens decide, and a row's mean of each (decayed) picks the shape and scales the tokens
    the chooser expects of that proposer's tree (`rounds.rounds`, "shapes"); where the
    means are equal the chain is drafted. Building a lookup trie or a DFlash block's tree
    is a step kind of its own in the fitted costs (as growing a draft model's tree is), so
    a round builds them only where the tokens the trees are expected to add pay for the
    build, and otherwise every `rounds.MEASURE_EVERY`-th round, to keep measuring how deep
    they hold; a draft model's tree is measured only in rounds that grow it. Rows with
    sampled model drafts take those chains."""

    k: int = 15
    max_ngram: int = 3
    min_ngram: int = 1
    adaptive: bool = True
    tree: int | str = 0

    def __post_init__(self) -> None:
        check_k(self.k, SPAN - 1)
        check_ngram(self.max_ngram, self.min_ngram, MAX_NGRAM)
        check_tree(self.tree, SPAN - 1)

    @property
    def nodes(self) -> int:
        """The most nodes of a row's draft tree (0: chains only)."""
        return SPAN - 1 if self.tree == "auto" else self.tree


@runtime_checkable
class HostDrafter(Protocol):
    """A proposer written in Python: asked on the host before each round of its row, it
    fills that row's drafts (the tokens it guesses follow `history`, at most `limit`).
    Its drafts are judged exactly as prompt lookup's, so output stays exact when they are
    a function of `history` (deterministic)."""

    def propose(self, history: np.ndarray, limit: int) -> Sequence[int]: ...


class Request:
    """A submitted generation: iterate it for tokens as they are committed, `result()` to
    run the engine until it is done, `cancel()` to drop it (its pages return to the pool).
    A request that fails (NaN logits, its drafter raising or returning something other than
    token ids) ends with `error` set, which `result()` and iteration raise; the other
    requests go on."""

    def __init__(self, engine: "Engine", rid: int, prompt: np.ndarray, max_new_tokens: int, sampling: Sampling,
                 seed: int, stops: frozenset[int], k: int, use: tuple[bool, bool, bool], drafter: HostDrafter | None,
                 tree: int = 0, auto: bool = False):
        self.engine, self.id, self.prompt = engine, rid, prompt
        self.max_new_tokens, self.sampling, self.seed, self.stops, self.k = max_new_tokens, sampling, seed, stops, k
        self.tree = tree  # nodes of its draft trees (0: chains)
        self.auto = auto  # each round the tree or the chain, whichever has held more
        self.use = use  # may take (lookup or host, draft-model, DFlash) drafts
        self.drafter = drafter
        self.tokens: list[int] = []
        self.stats = Stats(prompt_tokens=len(prompt))
        self.done = self.stopped = self.cancelled = False
        # why it ended before its stop or length (NaN logits, its drafter's failure): result() raises it
        self.error: Exception | None = None
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self._streamed = 0
        # engine bookkeeping
        self.slot: int | None = None
        self.pages: list[int] = []
        self.reserved = 0
        self.prefilled = 0
        self.dlen = 0  # committed tokens in the draft model's cache
        self.clen = 0  # DFlash context rows written (the rest of its taps are stashed)
        self.state = {name: counts[0] for name, counts in new_state(1, engine.spec.max_ngram).items()}

    def __repr__(self) -> str:
        return f"Request(id={self.id}, prompt={len(self.prompt)} tokens, {len(self.tokens)} generated, done={self.done})"

    @property
    def length(self) -> int:
        """Tokens of this sequence (prompt and output)."""
        return len(self.prompt) + len(self.tokens)

    def result(self) -> GenerateResult:
        while not self.done:
            self.engine.step()
        if self.error is not None:
            raise self.error
        if self.cancelled:
            raise GenerationError(f"request {self.id} was cancelled")
        return GenerateResult(list(self.tokens), self.stats, self.stopped)

    def __iter__(self) -> Iterator[int]:
        while True:
            while self._streamed < len(self.tokens):
                self._streamed += 1
                yield self.tokens[self._streamed - 1]
            if self.done:
                if self.error is not None:
                    raise self.error
                return
            self.engine.step()

    def cancel(self) -> None:
        self.engine.cancel(self)


class Engine:
    """Continuous batching over one paged KV pool (module docstring).

    `speculative`: None (plain decoding), a `Speculation` or an int k (up to k drafts per
    row, from prompt lookup and, with `draft`, a smaller model of the same vocabulary, and,
    with `dflash`, a DFlash drafter of this target; their drafts are sampled for sampled
    rows when `sample_drafts`). `max_batch` rows run
    at once; each holds up to `max_len` tokens; the pool has `num_pages` pages of
    `page_size` slots (default: every row can reach max_len), shared by the target's and
    the draft model's caches. `rounds` is R, the speculative rounds per device call
    (R / 4 while a request is joining, so its prefill chunks come sooner).
    """

    def __init__(self, model: Model, speculative: Speculation | int | None = None, *, draft: Model | None = None,
                 dflash: Drafter | None = None, sample_drafts: bool = False, max_batch: int = 8, max_len: int | None = None,
                 num_pages: int | None = None, page_size: int = 16, rounds: int = 16):
        cfg = model.config
        if speculative is None or isinstance(speculative, Speculation):
            spec = speculative
        elif is_integer(speculative):
            spec = Speculation(k=speculative)
        else:
            raise GenerationError(f"speculative must be None, an int k or a Speculation, got {speculative!r}")
        for name, value, low in (("max_batch", max_batch, 1), ("page_size", page_size, 1), ("rounds", rounds, 1)):
            if not is_integer(value) or value < low:
                raise GenerationError(f"{name} must be an integer >= {low}, got {value!r}")
        if num_pages is not None and (not is_integer(num_pages) or num_pages < 2):
            raise GenerationError(f"num_pages must be an integer >= 2 (one page is scratch), got {num_pages!r}")
        max_len = min(cfg.max_position_embeddings, 4096) if max_len is None else max_len
        if not is_integer(max_len) or not 2 <= max_len <= cfg.max_position_embeddings:
            raise GenerationError(f"max_len must be an integer in [2, max_position_embeddings = "
                                  f"{cfg.max_position_embeddings}], got {max_len!r}")
        if draft is not None:
            if not isinstance(draft, Model):
                raise ProposerError(f"draft must be a loaded model (specjax.load(folder)), got {type(draft).__name__}")
            if draft.config.vocab_size != cfg.vocab_size:
                where = f" ({draft.path})" if draft.path else ""
                raise ProposerError(f"draft model{where} has vocab_size {draft.config.vocab_size}, target has "
                                    f"{cfg.vocab_size}: they must share a vocabulary")
            if spec is None:
                raise GenerationError("a draft model needs speculative=k (or a Speculation): the most drafts per row")
        if dflash is not None:
            where = f" ({dflash.path})" if dflash.path else ""
            if not isinstance(dflash, Drafter):
                raise ProposerError(f"dflash must be a DFlash drafter (specjax.load_dflash(folder, target)), got "
                                    f"{type(dflash).__name__}")
            problems = fit_problems(dflash.config, cfg)
            if problems:
                raise ProposerError(f"DFlash drafter{where} does not fit the target: " + "; ".join(problems))
            if jnp.dtype(dflash.dtype) != jnp.dtype(model.dtype):
                raise ProposerError(f"DFlash drafter{where} is {jnp.dtype(dflash.dtype).name}, the target "
                                    f"{jnp.dtype(model.dtype).name}: load it with the target's dtype "
                                    "(specjax.load_dflash(folder, target))")
            if spec is None:
                raise GenerationError("a DFlash drafter needs speculative=k (or a Speculation): the most drafts per "
                                      "row")
        self.model, self.spec = model, spec or Speculation(k=1)
        self.k = spec.k if spec else 0
        # compiled for the widest verify width k needs (a row's own k is a traced limit), so
        # k = 4 .. 7 share one compiled call, 8 .. 15 another
        self.compiled_k = steps.bucket(self.k + 1) - 1 if self.k else 0
        self.draft, self.dflash = draft, dflash
        self.sample_drafts = bool(sample_drafts) and (draft is not None or dflash is not None)
        # the model proposers' prior extra step costs (their weight bytes over the target's)
        target_bytes = weight_bytes(model.params)
        # (kind, weight-bytes ratio (a build's: its cost per row), shape ...) per part, in subset-bit order
        self.model_costs: list[tuple] = []
        # a DFlash block is scored by the target's head, or its rows of the draft vocabulary
        self.fhead = None if dflash is None or dflash.vocab is None else draft_head(
            model.params, cfg, dflash.vocab, dflash.params.get(MARKOV))
        if draft is not None:
            self.model_costs.append(("chain", weight_bytes(draft.params) / target_bytes, 0))
        if dflash is not None:
            head = (head_weight(model.params, cfg) if self.fhead is None else self.fhead.rows).nbytes
            self.model_costs.append(("block", (weight_bytes(dflash.params) + head) / target_bytes,
                                     dflash.config.block_size))
        if draft is not None and self.spec.nodes and self.k:  # a draft-model tree's draft steps: a part of its own
            frontier, depth = draft_tree_shape(min(self.spec.nodes, self.compiled_k))
            self.model_costs.append(("tree", weight_bytes(draft.params) / target_bytes, frontier, depth))
        if self.spec.nodes and self.k:  # building a lookup trie or a DFlash block's tree
            self.model_costs.append(("build", TREE_BUILD_COST))
        self.max_batch, self.page_size, self.n_rounds = max_batch, page_size, rounds
        self.join_rounds = max(1, rounds // 4)
        self.max_len = max_len
        # slots a row may write past its length in a round: a verify step, a DFlash block, a draft model's
        # feed (as wide as the row that lags most needs) and tree
        self.margin = max(SPAN, dflash.config.block_size if dflash is not None else 0,
                          FEEDS[-1] if draft is not None else 0,
                          draft_tree_slots(min(self.spec.nodes, self.compiled_k)) if draft is not None and
                          self.spec.nodes and self.k else 0)
        self.pages_per_row = -(-(max_len + self.margin) // page_size)
        num_pages = max_batch * self.pages_per_row + 1 if num_pages is None else num_pages
        self.pages = PageAllocator(num_pages, page_size)
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, num_pages, page_size, cfg.head_dim)
        self.k_pool = zeros(shape, model.cache_dtype)
        self.v_pool = zeros(shape, model.cache_dtype)
        self.dk_pool = self.dv_pool = None
        if draft is not None:
            d = draft.config
            dshape = (d.num_hidden_layers, d.num_key_value_heads, num_pages, page_size, d.head_dim)
            self.dk_pool, self.dv_pool = zeros(dshape, draft.cache_dtype), zeros(dshape, draft.cache_dtype)
        self.fk_pool = self.fv_pool = self.ft_pool = None
        if dflash is not None:
            f = dflash.config
            fshape = (f.num_hidden_layers, f.num_key_value_heads, num_pages, page_size, f.head_dim)
            self.fk_pool, self.fv_pool = zeros(fshape, dflash.dtype), zeros(fshape, dflash.dtype)
            self.ft_pool = zeros((1, len(f.target_layer_ids), num_pages, page_size, cfg.hidden_size), model.dtype)
        self.table = np.full((max_batch, self.pages_per_row), SCRATCH, np.int32)
        self.history = np.zeros((max_batch, self.pages_per_row * page_size + SPAN), np.int32)
        self.slots: list[Request | None] = [None] * max_batch
        self.queue: deque[Request] = deque()
        # step costs are properties of the machine and the model, not of one engine
        self.costs: dict[tuple, StepCosts] = _COSTS.setdefault(model, {})
        self._next_id = 0

    # ------------------------------------------------------------------ requests
    def submit(self, ids: Sequence[int], *, max_new_tokens: int, sampling: Sampling = Sampling(), seed: int = 0,
               stop_ids: Sequence[int] | None = None, k: int | None = None, lookup: bool = True,
               draft: bool = True, dflash: bool = True, drafter: HostDrafter | None = None,
               tree: int | str | None = None) -> Request:
        """Queue a request; it joins the batch when a row and its pages are free.

        stop_ids defaults to the model's eos ids (`()` never stops early); k (at most the
        engine's) limits this request's drafts, 0 for plain decoding; lookup / draft / dflash
        say whether it may take prompt-lookup, draft-model and DFlash drafts; a `drafter` (a Python
        proposer) replaces prompt lookup for this request (one round per device call while
        it runs); tree (at most the engine's `Speculation.nodes`, default its `tree`) the nodes of
        its trees (lookup, draft-model or DFlash, whichever a round drafts), 0 for chains,
        "auto" for the engine's most nodes with the shape chosen per round."""
        ids = token_ids(ids)
        validate(self.model, ids, max_new_tokens, None, seed)
        if not isinstance(sampling, Sampling):
            raise GenerationError(f"sampling must be a specjax.Sampling, got {type(sampling).__name__}")
        k = self.k if k is None else k
        if not is_integer(k) or not 0 <= k <= self.k:
            raise GenerationError(f"k must be an integer in [0, {self.k}] (the engine's speculative k), got {k!r}")
        tree = self.spec.tree if tree is None else tree
        if tree == "auto" and self.spec.nodes == 0 or tree != "auto" and (
                not is_integer(tree) or not 0 <= tree <= self.spec.nodes):
            raise GenerationError(f"tree must be an integer in [0, {self.spec.nodes}] (the engine's most nodes, "
                                  f"Speculation.tree){' or auto' if self.spec.nodes else ''}, got {tree!r}")
        total = len(ids) + max_new_tokens
        if total > self.max_len:
            raise PoolError(f"prompt ({len(ids)}) + max_new_tokens ({max_new_tokens}) = {total} tokens exceeds the "
                            f"engine's max_len ({self.max_len})")
        need = self.pages.pages_for(total + self.margin)
        if need > self.pages.usable:
            raise PoolError(f"prompt ({len(ids)}) + max_new_tokens ({max_new_tokens}) needs {need} pages of "
                            f"{self.page_size} slots; the pool has {self.pages.usable}")
        stops = stop_set(self.model.eos_ids if stop_ids is None else stop_ids)
        if drafter is not None and not isinstance(drafter, HostDrafter):
            raise GenerationError(f"drafter must have a propose(history, limit) method, got {type(drafter).__name__}")
        if drafter is not None and k == 0:
            raise GenerationError("a drafter needs drafts to fill: k = 0 here (an engine built with "
                                  "speculative=k > 0, and a request k > 0)")
        req = Request(self, self._next_id, ids.astype(np.int32), max_new_tokens, sampling, seed, stops, k,
                      (bool(lookup) or drafter is not None, bool(draft) and self.draft is not None,
                       bool(dflash) and self.dflash is not None), drafter,
                      self.spec.nodes if tree == "auto" else tree, tree == "auto")
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
        nothing is decoding), run one device call over the decoding rows (a quarter of
        the rounds while a request is still joining or could join); returns the tokens
        each request committed (a request that failed in the step with none: its `error`)."""
        new: dict[Request, list[int]] = {}
        self._admit()
        joining = [r for r in self.slots if r is not None and r.prefilled < len(r.prompt)]
        decoding = [r for r in self.slots if r is not None and r.prefilled == len(r.prompt)]
        for req in joining:
            while req.prefilled < len(req.prompt) and not req.done:
                token = self._prefill(req, new)
                if token is not None:
                    self._emit(req, [token], new)
                if decoding:
                    break
            if decoding:
                break
        decoding = [r for r in decoding if not r.done]
        if decoding:
            short = any(r is not None and r.prefilled < len(r.prompt) for r in self.slots) or bool(
                self.queue and None in self.slots and self.pages.can_reserve(self.queue[0].reserved))
            self._decode(decoding, new, short)
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

    def _prefill(self, req: Request, new: dict[Request, list[int]]) -> int | None:
        """One chunk of req's prompt; the first token once the prompt is in."""
        m = self.model
        start = req.prefilled
        width = next((c for c in PREFILL_CHUNKS if c >= len(req.prompt)), PREFILL_CHUNKS[-1])
        part = req.prompt[start:start + width]
        self._grow(req, start + width)
        buf = np.zeros(width, np.int32)
        buf[:len(part)] = part
        t0 = time.perf_counter()
        # host arrays of this chunk's own (a call may read them after it returns; each call takes
        # its copy, its cache being donated): converting them here would compile a conversion per
        # chunk width
        table = self.table[req.slot:req.slot + 1].copy()
        kv = KVCache(self.k_pool, self.v_pool, table, np.array([start], np.int32), page_size=self.page_size)
        rs = RowSampling.of([req.sampling])
        token, bad, kv, fkv = prefill_chunk(m.params, m.config, kv, buf, np.int32(len(part)),
                                            np.uint32(req.seed), rs, sampled=not req.sampling.greedy,
                                            **self._prefill_dflash(table))
        self.k_pool, self.v_pool = kv.k, kv.v
        self._keep_dflash(fkv)
        if self.draft is not None:  # the draft model's cache gets the prompt too
            d = self.draft
            dkv = KVCache(self.dk_pool, self.dv_pool, table, np.array([start], np.int32), page_size=self.page_size)
            _, _, dkv, _ = prefill_chunk(d.params, d.config, dkv, buf, np.int32(len(part)),
                                         np.uint32(req.seed), rs, sampled=False)
            self.dk_pool, self.dv_pool = dkv.k, dkv.v
            req.dlen = start + len(part)
        req.prefilled += len(part)
        if bool(bad):
            self._fail(req, FloatingPointError(f"prefill of request {req.id} produced NaN logits (chunk at token "
                                               f"{start}); check the weights"), new)
            return None
        req.stats.prefill_s += time.perf_counter() - t0
        return int(token) if req.prefilled == len(req.prompt) else None

    def _dflash_state(self, table: np.ndarray, written: np.ndarray) -> DFlashCache:
        """The DFlash drafter's state over rows with page table `table` and `written` context rows."""
        kv = KVCache(self.fk_pool, self.fv_pool, table, np.zeros(table.shape[0], np.int32),
                     page_size=self.page_size)
        return DFlashCache(kv, self.ft_pool, np.asarray(written, np.int32))

    def _prefill_dflash(self, table: np.ndarray) -> dict[str, Any]:
        """prefill_chunk's keywords that stash the target's taps for the DFlash drafter."""
        if self.dflash is None:
            return {}
        return {"fkv": self._dflash_state(table, np.zeros(1, np.int32)), "taps": self.dflash.config.target_layer_ids}

    def _keep_dflash(self, fc: DFlashCache | None) -> None:
        """Hold the DFlash pools a compiled call returned (its inputs were donated)."""
        if fc is not None:
            self.fk_pool, self.fv_pool, self.ft_pool = fc.kv.k, fc.kv.v, fc.taps

    def row_counts(self) -> list[int]:
        """The row counts a device call may be compiled for (buckets up to max_batch)."""
        return sorted({min(b, self.max_batch) for b in ROW_BUCKETS} | {self.max_batch})

    def compile(self, samplings: Sequence[bool] = (False, True)) -> None:
        """Compile every step this engine may run (each row count, greedy and sampled
        batches, each prefill chunk width), so no request later waits on a compilation."""
        for sampled in samplings:
            for rows in self.row_counts():
                self._call(rows, [], sampled)
            rs = RowSampling.of([Sampling(1.0) if sampled else Sampling()])
            table = np.full((1, self.pages_per_row), SCRATCH, np.int32)
            for width, target in itertools.product(PREFILL_CHUNKS, (True, False) if self.draft else (True,)):
                model, pools = (self.model, (self.k_pool, self.v_pool)) if target else (
                    self.draft, (self.dk_pool, self.dv_pool))  # (the pools the last call returned: it donated them)
                kv = KVCache(*pools, table, np.zeros(1, np.int32), page_size=self.page_size)  # (as `_prefill` calls)
                _, _, kv, fkv = prefill_chunk(model.params, model.config, kv, np.zeros(width, np.int32),
                                              np.int32(1), np.uint32(0), rs, sampled=sampled and target,
                                              **(self._prefill_dflash(table) if target else {}))
                if target:
                    self.k_pool, self.v_pool = kv.k, kv.v
                else:
                    self.dk_pool, self.dv_pool = kv.k, kv.v
                self._keep_dflash(fkv)

    def _decode(self, decoding: list[Request], new: dict[Request, list[int]], short: bool = False) -> None:
        top = max(r.slot for r in decoding) + 1
        rows = min(next((b for b in ROW_BUCKETS if b >= top), top), self.max_batch)
        live = [r for r in decoding if r.slot < rows]
        given = self._host_proposals(live, new)
        live = [r for r in live if not r.done]
        if not live:
            return
        log, bad, dlen, clen, state = self._call(rows, live, any(not r.sampling.greedy for r in live), short, given)
        for r in live:
            b = r.slot
            if bad[b]:
                self._fail(r, FloatingPointError(f"target logits contain NaN in a decode step of request {r.id}; "
                                                 "check the weights"), new)
                continue
            r.dlen, r.clen = int(dlen[b]), int(clen[b])
            r.state = {name: counts[b] for name, counts in state.items()}
            for i in range(log["counts"].shape[0]):
                c, n = int(log["counts"][i, b]), int(log["drafts"][i, b])
                if c == 0:
                    continue
                r.stats.record(n, c - 1)
                r.stats.branched += bool(log["branched"][i, b])
                r.stats.tree_steps += bool(log["treed"][i, b])
                source = int(log["source"][i, b])
                r.stats.choices.append((None if source < 0 else "host" if r.drafter is not None and source == 0
                                        else SOURCES[source], n))
                # the device stops a row at the stop ids it holds (`STOPS` of them) or its budget; the host
                # at any of them, so the rounds after that are neither output nor counted
                self._emit(r, [int(x) for x in log["tokens"][i, b, :c]], new)
                if r.done:
                    break

    def _host_proposals(self, live: list[Request], new: dict[Request, list[int]]) -> dict[Request, np.ndarray]:
        """The drafts of each live request with a host drafter (asked before every round); a
        drafter that raises or returns anything but token ids fails its request alone."""
        given = {}
        for r in live:
            if r.drafter is None or not r.k:
                continue
            try:
                proposed = r.drafter.propose(self.history[r.slot, :r.length].copy(), r.k)
            except Exception as e:  # the user's code: its request fails, the engine goes on
                error = GenerationError(f"request {r.id}: its drafter's propose raised {type(e).__name__}: {e}")
                error.__cause__ = e
                self._fail(r, error, new)
                continue
            try:
                given[r] = _host_drafts(proposed, self.model.config.vocab_size, r.id)[:r.k]
            except GenerationError as e:
                self._fail(r, e, new)
        return given

    def _call(self, rows: int, live: list[Request], sampled: bool, short: bool = False,
              proposals: dict[Request, np.ndarray] | None = None) -> tuple:
        """One device call of `rounds` (a quarter of them when `short`) over `rows` rows, the
        `live` requests in their slots (the other rows idle), with `proposals`: the drafts of
        the requests with a host drafter (`_host_proposals`); returns the rounds' log
        (`rounds.rounds`), which rows met NaN logits [rows], the draft cache lengths, the
        DFlash context rows written and the acceptance state."""
        m = self.model
        size = np.zeros(rows, np.int32)
        budget = np.zeros(rows, np.int32)
        stops = np.full((rows, STOPS), -1, np.int32)
        row_k = np.zeros(rows, np.int32)
        row_tree, row_auto = np.zeros(rows, np.int32), np.zeros(rows, bool)
        seeds = np.zeros(rows, np.uint32)
        settings = [Sampling()] * rows
        state = new_state(rows, self.spec.max_ngram)
        use = np.zeros((rows, 3), bool)
        dlen = np.zeros(rows, np.int32)
        clen = np.zeros(rows, np.int32)
        # a host drafter is asked before every round; joining requests get their next prefill
        # chunk after a quarter of the rounds (one compiled call: the count is traced)
        n_rounds = 1 if proposals else self.join_rounds if short else self.n_rounds
        given = None
        if proposals:
            given = (np.zeros((rows, self.compiled_k), np.int32), np.full(rows, -1, np.int32))
            for r, found in proposals.items():
                given[0][r.slot, :len(found)] = found
                given[1][r.slot] = len(found)
        for r in live:
            b = r.slot
            size[b] = r.length
            budget[b] = min(r.max_new_tokens - len(r.tokens), n_rounds * (r.k + 1))
            self._grow(r, r.length + int(budget[b]) + self.margin)
            listed = sorted(r.stops)[:STOPS]
            stops[b, :len(listed)] = listed
            row_k[b], seeds[b], settings[b], use[b], dlen[b], clen[b] = r.k, r.seed, r.sampling, r.use, r.dlen, r.clen
            row_tree[b], row_auto[b] = r.tree, r.auto
            for name, counts in r.state.items():
                state[name][b] = counts
        idle = np.ones(rows, bool)
        idle[[r.slot for r in live]] = False
        table = self.table[:rows].copy()
        table[idle] = SCRATCH
        # engines of one target share a fit where their steps of a kind run the same work (a tree budget adds
        # compaction, sampled drafts their draws)
        key = (rows, sampled, tuple(self.model_costs), self.pages_per_row, self.compiled_k, n_rounds,
               self.spec.nodes, self.sample_drafts)
        extras = [chain_cost(ratio) if kind == "chain" else block_cost(rows, ratio, *shape) if kind == "block"
                  else tree_cost(rows, ratio, *shape) if kind == "tree" else build_cost(rows, ratio)
                  for kind, ratio, *shape in self.model_costs]
        groups = 1 << len(extras)
        # (a build costs the same at every width: `build_cost`)
        flat = sum(1 << i for i, (kind, *_) in enumerate(self.model_costs) if kind == "build")
        costs = self.costs.setdefault(key, StepCosts(prior_costs(rows, extras).reshape(-1), groups=groups, flat=flat))
        t0 = time.perf_counter()
        kv = KVCache(self.k_pool, self.v_pool, table, np.maximum(size - 1, 0), page_size=self.page_size)
        d = self.draft
        dkv = None if d is None else KVCache(self.dk_pool, self.dv_pool, table.copy(), dlen,
                                             page_size=self.page_size)
        log, bad, kv, dkv, fkv, state = rounds(
            m.params, m.config, kv, self.history[:rows], size, budget, stops, row_k, use, state,
            costs.ratios().reshape(groups, -1).astype(np.float32), seeds, RowSampling.of(settings),
            None if d is None else d.params, dkv, fhead=self.fhead, given=given,
            **({} if self.dflash is None else {"fparams": self.dflash.params, "fcfg": self.dflash.config,
                                               "fkv": self._dflash_state(table, clen)}),
            dcfg=None if d is None else d.config, k=self.compiled_k,
            limit=np.int32(n_rounds), row_tree=row_tree if self.spec.nodes else None,
            row_auto=row_auto if self.spec.nodes else None, tree=self.spec.nodes, max_ngram=self.spec.max_ngram,
            min_ngram=self.spec.min_ngram,
            n_rounds=self.n_rounds, sampled=sampled,
            sample_drafts=self.sample_drafts, adaptive=self.spec.adaptive)
        self.k_pool, self.v_pool = kv.k, kv.v
        if dkv is not None:
            self.dk_pool, self.dv_pool = dkv.k, dkv.v
            dlen = np.asarray(dkv.lengths)
        if fkv is not None:
            self._keep_dflash(fkv)
            clen = np.asarray(fkv.written)
        log, bad, state = jax.device_get((log, bad, state))
        elapsed = time.perf_counter() - t0
        if live:  # (a call without rows compiles, or confirms a compiled step: the fit's first call)
            widths = log["width"]
            costs.observe(np.bincount(widths[widths >= 0], minlength=groups * len(steps.BUCKETS)).astype(float),
                          elapsed)
        return log, bad, dlen, clen, state

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

    def _fail(self, req: Request, error: Exception, new: dict[Request, list[int]]) -> None:
        """End a request with `error` (its `result()` raises it), listed among the step's
        requests so a caller streaming them learns of it."""
        req.error = error
        new.setdefault(req, [])
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


def engine_options(speculative: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(Engine keywords, submit keywords) for a `generate` proposer argument.

    None: plain decoding; a `Speculation` as given; NgramProposer / DraftProposer /
    DFlashProposer: drafts of their fixed k each step (what they mean on their own); an
    Adaptive (at most one of each): the engine chooses among them per row and round; a
    `HostDrafter`: that object drafts for each request, up to 15 drafts a round. The
    engine's `Speculation.tree` is the largest `tree` of its proposers (one node budget
    for the lookup, draft-model and DFlash trees of a row), "auto" if any proposer's is.
    """
    from .adaptive import Adaptive
    from .proposers import DFlashProposer, DraftProposer, NgramProposer

    if speculative is None or isinstance(speculative, Speculation):
        return {"speculative": speculative}, {}
    kinds = (Adaptive, NgramProposer, DraftProposer, DFlashProposer)
    if not isinstance(speculative, kinds):
        if isinstance(speculative, HostDrafter):
            return {"speculative": Speculation(k=SPAN - 1)}, {"drafter": speculative}
        raise GenerationError(f"speculative must be None, a Speculation, an NgramProposer, DraftProposer or "
                              f"DFlashProposer, an Adaptive over them, or a HostDrafter (an object with "
                              f"propose(history, limit)); got {type(speculative).__name__}")
    adaptive = isinstance(speculative, Adaptive)
    parts = speculative.proposers if adaptive else (speculative,)
    lookups = [p for p in parts if isinstance(p, NgramProposer)]
    drafts = [p for p in parts if isinstance(p, DraftProposer)]
    blocks = [p for p in parts if isinstance(p, DFlashProposer)]
    models = drafts + blocks
    ngram = lookups[0] if lookups else NgramProposer()
    options: dict[str, Any] = {"speculative": Speculation(max(p.k for p in parts), ngram.max_ngram, ngram.min_ngram,
                                                          adaptive=adaptive,
                                                          tree=_tree(parts))}
    if drafts:
        options["draft"] = drafts[0].model
    if blocks:
        options["dflash"] = blocks[0].drafter
    if models:
        options["sample_drafts"] = models[0].sample
    return options, {"lookup": bool(lookups)}


def generate_one(model: Model, ids: np.ndarray, *, max_new_tokens: int, sampling: Sampling, stop_ids: Any,
                 seed: int, speculative: Any, max_len: int,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerateResult:
    """One prompt on an engine of one row (what `specjax.generate` runs for it)."""
    options, per_request = engine_options(speculative)
    engine = Engine(model, **options, max_batch=1, max_len=max_len)
    req = engine.submit(ids, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, stop_ids=stop_ids,
                        **per_request)
    while not req.done:
        new = engine.step().get(req)
        if new and on_tokens is not None:
            on_tokens(new)
    return req.result()


def generate_batch(model: Model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int],
                   sampling: Sampling | Sequence[Sampling] = Sampling(), stop_ids: Any = None,
                   seed: int | Sequence[int] = 0, speculative: Any = None, max_batch: int = 16) -> list[GenerateResult]:
    """`specjax.generate` for a list of prompts: one `GenerateResult` per prompt, in order,
    each the same tokens as that prompt generated alone. Each of max_new_tokens, sampling,
    stop_ids and seed is one value or a list with one per prompt; speculative as for
    `engine_options`."""
    n = len(prompts)
    if n == 0:
        raise GenerationError("prompts is an empty list")
    news = _per_prompt(max_new_tokens, n, "max_new_tokens", is_integer)
    settings = _per_prompt(sampling, n, "sampling", lambda v: isinstance(v, Sampling))
    seeds = _per_prompt(seed, n, "seed", is_integer)
    stops = _per_prompt(stop_ids, n, "stop_ids", lambda v: v is None or is_id_list(v))
    options, per_request = engine_options(speculative)
    longest = max(len(p) + (int(m) if is_integer(m) else 0) for p, m in zip(prompts, news))
    engine = Engine(model, **options, max_batch=min(n, max_batch), max_len=max_len_for(model, longest))
    reqs = []
    for i, (p, m, s, sd, st) in enumerate(zip(prompts, news, settings, seeds, stops)):
        try:
            reqs.append(engine.submit(p, max_new_tokens=m, sampling=s, seed=sd, stop_ids=st, **per_request))
        except (GenerationError, PoolError) as e:  # which prompt of the batch
            raise type(e)(f"prompts[{i}]: {e}") from None
    engine.run()
    return [r.result() for r in reqs]


def max_len_for(model: Model, longest: int) -> int:
    """An engine's max_len for sequences of up to `longest` tokens: rounded up to a multiple
    of 256 (so nearby lengths share compiled programs), at most the model's context (a longer
    request is then refused by `Engine.submit`, which names the limit)."""
    return max(2, min(-(-longest // 256) * 256, model.config.max_position_embeddings))


def _tree(parts: Sequence[Any]) -> int | str:
    """One tree setting for an engine over these proposers: "auto" where any asks for it,
    else the largest node budget."""
    return "auto" if any(p.tree == "auto" for p in parts) else max(p.tree for p in parts)


def _host_drafts(proposed: Any, vocab_size: int, request: int) -> np.ndarray:
    """A host drafter's `propose` result as int64 ids: a list (or 1-D array) of integers in
    [0, vocab_size); anything else (floats, None, text, nested lists) is refused by name,
    never cast."""
    try:
        found = np.asarray(proposed)
    except ValueError:  # ragged
        found = None
    if (found is None or found.ndim != 1 or (found.size and not np.issubdtype(found.dtype, np.integer))
            or (found.size and (found.min() < 0 or found.max() >= vocab_size))):
        raise GenerationError(f"request {request}: the drafter must return token ids in [0, {vocab_size}) "
                              f"(a list of integers), got {proposed!r:.80}")
    return found.astype(np.int64)
