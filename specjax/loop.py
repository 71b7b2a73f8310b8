"""`specjax.generate`, and the host-side loop for the proposers not yet in the batched
engine's device round (DFlash, and `Adaptive`'s per-step choice among proposers).

Plain decoding, prompt lookup and the draft model run on `specjax.Engine` (one row for one
prompt, many for a list of prompts); this loop drives a proposer session step by step from
Python: propose, verify, observe.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from . import engine
from . import kv as kvlib
from . import steps
from .model import Model
from .results import PREFILL_CHUNK, GenerateResult, GenerationError, Stats, token_ids, validate
from .sampling import Sampling

PLAIN_RUN = steps.BUCKETS[-1]  # plain decode steps fused into one call when nothing is drafted


def run_prefill(model: Model, kv: kvlib.KVCache, tokens: np.ndarray, seed: jax.Array, sampling: Sampling,
                taps: tuple[int, ...] = ()) -> tuple[jax.Array, kvlib.KVCache, list]:
    """Append `tokens` to the cache in fixed chunks; returns (token after them, cache, taps per chunk)."""
    chunk = min(PREFILL_CHUNK, kv.capacity)
    tapped = []
    token = None
    for i in range(0, len(tokens), chunk):
        part = tokens[i:i + chunk]
        buf = np.zeros(chunk, np.int32)
        buf[:len(part)] = part
        token, bad, kv, t = steps.prefill(model.params, model.config, kv, jnp.asarray(buf),
                                          jnp.int32(len(part)), seed, sampling=sampling, taps=taps)
        tapped.append((t, len(part)))
        if bool(bad):
            raise FloatingPointError(f"prefill produced NaN logits (chunk at token {i}); check the weights")
    return token, kv, tapped


def is_batch(ids: Any) -> bool:
    """A list of prompts (each a list or array of ids) or a 2-D array, not one prompt."""
    if isinstance(ids, np.ndarray):
        return ids.ndim == 2
    return isinstance(ids, (list, tuple)) and len(ids) > 0 and all(
        isinstance(p, (list, tuple, np.ndarray)) for p in ids)


def generate(model: Model, ids: Any, *, max_new_tokens: Any, sampling: Any = Sampling(),
             stop_ids: Any = None, seed: Any = 0, speculative: Any = None,
             capacity: int | None = None, on_tokens: Callable[[list[int]], None] | None = None
             ) -> GenerateResult | list[GenerateResult]:
    """Generate up to max_new_tokens after `ids`; stops after emitting any id in stop_ids
    (default: the model's eos ids, as transformers' generate; `()` never stops early).

    `ids` is one prompt (a list of token ids: returns one `GenerateResult`) or a list of
    prompts (returns a list, one per prompt, run together by `specjax.Engine`; then each of
    max_new_tokens, sampling, stop_ids and seed may be a list with one value per prompt).
    speculative: None, LookupProposer (k chosen per step), NgramProposer or DraftProposer
    (their fixed k), Adaptive (per-step choice among proposers) or DFlashProposer; a
    batch takes any of them but DFlash.

    With `speculative` (a proposer) the output is the same as without it: token for token
    for greedy decoding and deterministic proposers (bitwise-equal steps: float32 on CPU;
    see the README), in distribution for sampled drafts.
    `on_tokens` receives each step's newly committed tokens (for streaming).
    """
    if is_batch(ids):
        if capacity is not None or on_tokens is not None:
            raise GenerationError("capacity and on_tokens apply to one prompt; a batch sizes its own pool "
                                  "(use specjax.Engine to stream a batch)")
        return engine.generate_batch(model, ids, max_new_tokens=max_new_tokens, sampling=sampling,
                                     stop_ids=stop_ids, seed=seed, speculative=speculative)
    ids = token_ids(ids)
    capacity = validate(model, ids, max_new_tokens, capacity, seed)
    if engine.runs_on_engine(speculative):
        if not isinstance(sampling, Sampling):
            raise GenerationError(f"sampling must be a specjax.Sampling, got {type(sampling).__name__}")
        return engine.generate_one(model, ids, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                                   seed=seed, speculative=speculative, on_tokens=on_tokens,
                                   max_len=min(capacity, model.config.max_position_embeddings))
    stops = set(int(s) for s in (model.eos_ids if stop_ids is None else stop_ids))
    seed_arr = jnp.uint32(seed)
    stats = Stats(prompt_tokens=len(ids))
    history = np.zeros(len(ids) + max_new_tokens + steps.BUCKETS[-1], np.int32)
    history[:len(ids)] = ids
    size = len(ids)
    out: list[int] = []

    t0 = time.perf_counter()
    session = speculative.start(model, ids.astype(np.int32), capacity, seed, sampling)
    taps = getattr(session, "taps", ())
    kv = kvlib.init(model.config, 1, capacity, model.dtype)
    token, kv, tapped = run_prefill(model, kv, ids.astype(np.int32), seed_arr, sampling, taps)
    for features, n_valid in tapped if taps else ():
        session.extend(features, n_valid)

    def emit(new: list[int]) -> bool:
        """Append committed tokens up to a stop id or max_new_tokens; True when done."""
        nonlocal size
        taken = 0
        done = False
        for tok in new:
            out.append(tok)
            history[size] = tok
            size += 1
            taken += 1
            if tok in stops or len(out) == max_new_tokens:
                done = True
                break
        if on_tokens:
            on_tokens(new[:taken])
        return done

    done = emit([int(token)])
    stats.prefill_s = time.perf_counter() - t0
    while not done:
        t1 = time.perf_counter()
        remaining = max_new_tokens - len(out)
        prop = session.propose(history[:size], remaining - 1) if remaining > 1 else None
        n = prop.n if prop is not None else 0
        if n == 0:  # plain steps, fused into one call
            run = steps.bucket_below(min(prop.plain if prop is not None else PLAIN_RUN, remaining))
            t2 = time.perf_counter()
            res, bad, kv, features = steps.decode(model.params, model.config, kv, np.int32(history[size - 1]),
                                                  seed_arr, sampling=sampling, n=run, taps=taps)
            res, bad = jax.device_get((res, bad))
            count, accepted = run, 0
            for _ in range(run):
                stats.record(0, 0)
        else:
            width = steps.bucket(n + 1)
            drafts = prop.drafts
            if isinstance(drafts, np.ndarray):  # host drafts: pad to the verify width, one compile per width
                drafts = np.pad(drafts[:width - 1], (0, width - 1 - min(len(drafts), width - 1)))
            else:
                jax.block_until_ready(drafts)
            t2 = time.perf_counter()
            res, count, bad, kv, features = steps.verify(
                model.params, model.config, kv, np.int32(history[size - 1]), drafts,
                np.int32(n), seed_arr, sampling=sampling, width=width, logq=prop.logq, taps=taps)
            res, count, bad = jax.device_get((res, count, bad))
            accepted = int(count) - 1
            stats.record(n, accepted)
        t3 = time.perf_counter()
        if bad:
            raise FloatingPointError(f"target logits contain NaN in the step(s) from position {size - 1}; "
                                     "check the weights")
        done = emit([int(x) for x in res[:count]])
        if not done:
            if taps:
                session.extend(features, int(count))
            session.observe(accepted, history[:size])
        t4 = time.perf_counter()
        stats.propose_s += t2 - t1
        stats.verify_s += t3 - t2
        stats.host_s += t4 - t3
    stats.new_tokens = len(out)
    stats.choices = list(getattr(session, "choices", ()))
    return GenerateResult(out, stats, stopped=bool(out) and out[-1] in stops)
