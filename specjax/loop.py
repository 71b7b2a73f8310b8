"""The generation loop (plain or speculative) and its statistics."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import kv as kvlib
from . import steps
from .model import Model
from .sampling import Sampling

PREFILL_CHUNK = 128
PLAIN_RUN = steps.BUCKETS[-1]  # plain decode steps fused into one call when nothing is drafted
MIN_CAPACITY = 256
CAPACITY_STEP = 256


class GenerationError(ValueError):
    """Bad generate() input: empty or out-of-vocabulary prompt, length beyond capacity."""


@dataclasses.dataclass
class Stats:
    """What a generation did; speculative fields stay zero for plain decoding."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0                 # verify (or decode) steps after prefill
    verify_tokens: int = 0         # tokens scored by verify steps (last + real drafts)
    drafted: int = 0               # real drafts proposed
    accepted: int = 0              # drafts accepted
    accept_hist: list[int] = dataclasses.field(default_factory=list)  # [a] steps that accepted a drafts
    reached: list[int] = dataclasses.field(default_factory=list)      # [i] steps whose draft i was judged
    accepted_at: list[int] = dataclasses.field(default_factory=list)  # [i] steps that accepted draft i
    ks: list[int] = dataclasses.field(default_factory=list)           # drafts judged per step
    accepts: list[int] = dataclasses.field(default_factory=list)      # drafts accepted per step
    choices: list = dataclasses.field(default_factory=list)           # Adaptive: (proposer, k) per step
    prefill_s: float = 0.0
    propose_s: float = 0.0
    verify_s: float = 0.0
    host_s: float = 0.0

    @property
    def decode_s(self) -> float:
        return self.propose_s + self.verify_s + self.host_s

    @property
    def tokens_per_step(self) -> float:
        """Committed tokens per verify step (1.0 for plain decoding)."""
        return (self.new_tokens - 1) / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: tokens after the first over the time after prefill."""
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """P(draft i accepted | draft i was judged), i = 1 .. k."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached)]

    @property
    def verify_tokens_per_token(self) -> float:
        return self.verify_tokens / max(self.new_tokens - 1, 1)

    def record(self, n_drafts: int, accepted: int) -> None:
        grow = max(n_drafts + 1 - len(self.accept_hist), 0)
        self.accept_hist += [0] * grow
        self.reached += [0] * max(n_drafts - len(self.reached), 0)
        self.accepted_at += [0] * max(n_drafts - len(self.accepted_at), 0)
        self.accept_hist[accepted] += 1
        for i in range(min(accepted + 1, n_drafts)):
            self.reached[i] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1
        self.steps += 1
        self.verify_tokens += n_drafts + 1
        self.drafted += n_drafts
        self.accepted += accepted
        self.ks.append(n_drafts)
        self.accepts.append(accepted)

    def summary(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for per_step in ("ks", "accepts", "choices"):
            d.pop(per_step)
        d.update(decode_s=self.decode_s, tokens_per_step=self.tokens_per_step, tokens_per_s=self.tokens_per_s,
                 acceptance_by_position=self.acceptance_by_position,
                 verify_tokens_per_token=self.verify_tokens_per_token)
        return d


@dataclasses.dataclass
class GenerateResult:
    tokens: list[int]
    stats: Stats
    stopped: bool = False  # a stop id ended generation (it is the last token)


def capacity_for(total: int) -> int:
    """Static cache size for `total` tokens plus verify and prefill-padding slack.

    Rounded up to a multiple of CAPACITY_STEP: attention spans the whole capacity, so
    finer steps cost less per token; each distinct capacity compiles once (and is kept by
    the persistent compilation cache).
    """
    need = max(total + steps.BUCKETS[-1] + PREFILL_CHUNK, MIN_CAPACITY)
    return -(-need // CAPACITY_STEP) * CAPACITY_STEP


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


def _token_ids(ids: Any) -> np.ndarray:
    """The prompt as int64 ids; text or non-integer values are refused, never cast."""
    if isinstance(ids, (str, bytes)):
        raise GenerationError("prompt must be token ids, got text; tokenize it first "
                              "(e.g. model.tokenizer(text)['input_ids'])")
    arr = np.asarray(ids)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise GenerationError(f"prompt token ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64)


def _validate(model: Model, ids: np.ndarray, max_new_tokens: int, capacity: int | None, seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2 ** 32:
        raise GenerationError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    if ids.ndim != 1 or len(ids) == 0:
        raise GenerationError(f"prompt must be a non-empty 1-D list of token ids, got shape {ids.shape}")
    if ids.min() < 0 or ids.max() >= model.config.vocab_size:
        raise GenerationError(f"prompt token ids must be in [0, {model.config.vocab_size}), "
                              f"got min {ids.min()} max {ids.max()}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    total = len(ids) + max_new_tokens
    if total > model.config.max_position_embeddings:
        raise GenerationError(f"prompt ({len(ids)}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                              f"max_position_embeddings ({model.config.max_position_embeddings})")
    if capacity is None:
        return capacity_for(total)
    need = total + steps.BUCKETS[-1]
    if capacity < need or capacity % 16:
        raise GenerationError(f"capacity {capacity} is too small (or not a multiple of 16) for a prompt of "
                              f"{len(ids)} tokens plus {max_new_tokens} new tokens (needs >= {need})")
    return capacity


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
    max_new_tokens, sampling, stop_ids and seed may be a list with one value per prompt,
    and speculative is None or prompt lookup).

    With `speculative` (a proposer) the output is the same as without it: token for token
    for greedy decoding and deterministic proposers (bitwise-equal steps: float32 on CPU;
    see the README), in distribution for sampled drafts.
    `on_tokens` receives each step's newly committed tokens (for streaming).
    """
    if is_batch(ids):
        if capacity is not None or on_tokens is not None:
            raise GenerationError("capacity and on_tokens apply to one prompt; a batch sizes its own pool "
                                  "(use specjax.Engine to stream a batch)")
        from .engine import generate_batch
        return generate_batch(model, ids, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                              seed=seed, speculative=speculative)
    ids = _token_ids(ids)
    capacity = _validate(model, ids, max_new_tokens, capacity, seed)
    stops = set(int(s) for s in (model.eos_ids if stop_ids is None else stop_ids))
    seed_arr = jnp.uint32(seed)
    stats = Stats(prompt_tokens=len(ids))
    history = np.zeros(len(ids) + max_new_tokens + steps.BUCKETS[-1], np.int32)
    history[:len(ids)] = ids
    size = len(ids)
    out: list[int] = []

    t0 = time.perf_counter()
    session = speculative.start(model, ids.astype(np.int32), capacity, seed, sampling) if speculative else None
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
        fused = getattr(session, "fused", False)
        prop = session.propose(history[:size], remaining - 1) if session and not fused and remaining > 1 else None
        n = prop.n if prop is not None else 0
        if fused:  # the session runs its steps on the device
            t2 = time.perf_counter()
            res, taken, bad, kv = session.run(model, kv, history[:size], remaining, stops, seed_arr, sampling)
            count = len(res)
            for n, accepted in taken:
                stats.record(n, accepted)
        elif n == 0:  # plain steps, fused into one call
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
        if session is not None and not fused and not done:
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
