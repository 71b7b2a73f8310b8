"""Distribution transforms, position-keyed randomness and the speculative acceptance rules.

Randomness is a function of (seed, stream, absolute position): the numbers that decide
the token at position n come from fold_in(fold_in(key(seed), stream), n), never from a
key split per step. Plain and speculative decoding therefore draw the same numbers for
the same token, which is what makes "sample t from p, accept draft d iff t == d" emit
exactly plain decoding's tokens for any deterministic proposer.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from . import cpu_kernels, threefry
from .errors import SpecjaxError, is_integer, is_real
from .reductions import log_softmax_last, logsumexp_last, softmax_last, sum_last

# Counter streams: separate so that draft sampling, acceptance and residual draws are
# independent of each other and of the target's own samples at the same position.
TARGET, DRAFT, ACCEPT, RESIDUAL = 0, 1, 2, 3


class SamplingError(SpecjaxError):
    """Invalid sampling parameters."""


MIN_TEMPERATURE = float(jnp.finfo(jnp.float32).tiny)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Decoding distribution: temperature 0 is greedy (argmax, lowest id wins ties).

    Otherwise the distribution is transformers' logits-processor chain: temperature,
    then top-k, top-p and min-p (each disabled at its default).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        for name, kind in (("temperature", float), ("top_k", int), ("top_p", float), ("min_p", float)):
            value = getattr(self, name)
            if not (is_integer(value) if kind is int else is_real(value)):
                raise SamplingError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
            object.__setattr__(self, name, kind(value))  # a NumPy scalar kept as Python's (the dataclass is frozen)
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise SamplingError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:  # XLA flushes subnormals: t would act as 0
            raise SamplingError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:.3g} (float32's smallest "
                                f"normal number), got {self.temperature!r}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise SamplingError(f"min_p must be in [0, 1], got {self.min_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (int32): the lowest index of the largest value, or of
    the first NaN where a row has one.

    As two plain reductions (the maximum, then the lowest index holding it): XLA:CPU runs
    argmax's paired (value, index) reduction one element at a time, 0.31 ms for [8, 8192]
    floats against 0.037 ms so (jitted alone, 300 calls), a tenth of a verify step of
    width 8 on the shipped model."""
    top = jnp.max(x, axis=-1, keepdims=True)
    hit = (x == top) | jnp.isnan(x)  # a row with a NaN has top NaN: its first NaN, as jnp.argmax
    return jnp.min(jnp.where(hit, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)


def _tempered(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """Logits [N, V] divided by each row's temperature [N], shifted so each row's largest
    is 0 first: the same distribution, but a tiny temperature sends the others to -inf
    instead of making every logit +-inf (NaN after the softmax)."""
    x = logits.astype(jnp.float32)
    top = jnp.max(x, axis=-1, keepdims=True)
    return (x - jnp.where(jnp.isfinite(top), top, 0.0)) / temperature[:, None]


def transform(logits: jax.Array, s: Sampling) -> jax.Array:
    """Log-probabilities [..., V] (float32) of the sampling distribution s; -inf outside it:
    `transform_rows` with s on every row, the transform the engine applies."""
    flat = logits.reshape(-1, logits.shape[-1])
    return _transform_rows(flat, RowSampling.every(s, flat.shape[0])).reshape(logits.shape)


def position_key(seed: jax.Array, stream: int, position: jax.Array) -> jax.Array:
    """The key of (seed, stream, absolute position) (jax.random's, by `specjax.threefry`)."""
    return threefry.fold_in(threefry.fold_in(threefry.key(seed), stream), position)


def sample(logprobs: jax.Array, key: jax.Array) -> jax.Array:
    """One token from a [V] log-distribution by Gumbel-max (exact; -inf never chosen)."""
    return argmax(logprobs + threefry.gumbel(key, logprobs.shape))


def target_tokens(logits: jax.Array, positions: jax.Array, seed: jax.Array, s: Sampling) -> jax.Array:
    """The target's token [T] after each of T logit rows; row i decides position positions[i].

    The same draw as the batched engine's (`target_tokens_rows` with this setting on every
    row), so one prompt and a batch of prompts sample the same tokens."""
    n = logits.shape[0]
    return _target_tokens_rows(logits, positions, jnp.full((n,), seed, jnp.uint32), RowSampling.every(s, n),
                               not s.greedy)


def accept_probability(logp: jax.Array, logq: jax.Array, d: jax.Array) -> jax.Array:
    """min(1, p(d) / q(d)) computed in log space (no underflow when q(d) is tiny)."""
    return jnp.exp(jnp.minimum(0.0, logp[d] - logq[d]))


def residual_logprobs(logp: jax.Array, logq: jax.Array) -> jax.Array:
    """log normalize(max(p - q, 0)); falls back to p when p == q leaves no mass."""
    r = jnp.maximum(jnp.exp(logp) - jnp.exp(logq), 0.0)
    total = sum_last(r)[..., 0]
    return jnp.where(total > 0, jnp.log(r) - jnp.log(jnp.where(total > 0, total, 1.0)), logp)


def accept_sampled(logits: jax.Array, drafts: jax.Array, logq: jax.Array, n_drafts: jax.Array,
                   positions: jax.Array, seed: jax.Array, s: Sampling) -> tuple[jax.Array, jax.Array]:
    """Speculative sampling over T = k + 1 target rows for k sampled drafts (one sequence).

    Draft i (at positions[i]) is accepted with probability min(1, p_i(d)/q_i(d)); the
    first rejection is replaced by a sample from normalize(max(p_i - q_i, 0)); if all
    n_drafts are accepted the bonus comes from p. The emitted tokens follow p exactly
    (Leviathan et al. 2023, Chen et al. 2023). `accept_rows` with one row. Returns
    (tokens [T], accepted count).
    """
    rs = RowSampling.every(s, 1)
    tokens, accepted = accept_rows(logits[None], drafts[None], logq[None], jnp.reshape(n_drafts, (1,)),
                                   positions[None], jnp.reshape(seed, (1,)).astype(jnp.uint32), rs)
    return tokens[0], accepted[0]


# ---------------------------------------------------------------------------------------
# Per-row sampling for batched steps: the settings are traced arrays, one value per row,
# so rows with different settings share one compiled step and new values compile nothing.

CANDIDATES = 64  # top-k of at most this many runs on the k largest logits, not a sort of V
WIDE_CANDIDATES = 1024  # then, for rows whose support is wider, this many (XLA:CPU sorts V slowly)


@struct.dataclass
class RowSampling:
    """`Sampling` as arrays [N] (one row each): temperature 0 is greedy, top_k 0, top_p 1
    and min_p 0 are off."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array

    @classmethod
    def of(cls, settings: "list[Sampling]") -> "RowSampling":
        """Host arrays for one row per setting (already validated by `Sampling`)."""
        return cls(np.array([s.temperature for s in settings], np.float32),
                   np.array([s.top_k for s in settings], np.int32),
                   np.array([s.top_p for s in settings], np.float32),
                   np.array([s.min_p for s in settings], np.float32))

    @classmethod
    def every(cls, s: "Sampling", n: int) -> "RowSampling":
        """One setting on n rows, as device arrays (inside a trace)."""
        return cls(jnp.full((n,), s.temperature, jnp.float32), jnp.full((n,), s.top_k, jnp.int32),
                   jnp.full((n,), s.top_p, jnp.float32), jnp.full((n,), s.min_p, jnp.float32))

    def repeat(self, n: int) -> "RowSampling":
        """Each row's values n times in a row ([N] -> [N * n]: the T tokens of a verify row)."""
        return jax.tree.map(lambda x: jnp.repeat(x, n), self)


def _top_p_min_p_rows(x: jax.Array, top_p: jax.Array, min_p: jax.Array, tail: jax.Array | None = None,
                      log_z: jax.Array | None = None) -> jax.Array:
    """transformers' TopP then MinP warpers on logits x [N, ...] with per-row values [N]
    (-inf for dropped entries; both are no-ops at their defaults). With `tail` and `log_z`
    [N] (rows where x holds the largest logits of a wider row only) the cumulative mass
    TopP compares starts at `tail`, the mass of the row's other entries, and x's
    probabilities are exp(x - log_z): the sums the wider row's own sort would form."""
    order = jnp.argsort(x, axis=-1)
    sorted_x = jnp.take_along_axis(x, order, axis=-1)
    cum = jnp.cumsum(softmax_last(sorted_x), axis=-1)
    if tail is not None:
        cum = jnp.where(jnp.isfinite(log_z)[:, None], tail[:, None] + jnp.cumsum(jnp.exp(sorted_x - log_z[:, None]),
                                                                                 axis=-1), cum)
    drop_sorted = (cum <= 1.0 - top_p[:, None]).at[..., -1].set(False)
    drop = jnp.put_along_axis(drop_sorted, order, drop_sorted, axis=-1, inplace=False)  # unsort: a scatter, not a sort
    x = jnp.where(drop & (top_p[:, None] < 1.0), -jnp.inf, x)
    probs = softmax_last(x)
    return jnp.where(probs < min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True), -jnp.inf, x)


def _min_p_rows(x: jax.Array, min_p: jax.Array) -> jax.Array:
    probs = softmax_last(x)
    return jnp.where(probs < min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True), -jnp.inf, x)


def _candidates(x: jax.Array, rs: RowSampling, top_k: jax.Array, c: int):
    """The rows whose support lies among their c largest tempered logits x [N, V], and
    that support there: (candidate ids [N, c], their kept logits [N, c] (-inf where
    dropped), fits [N]). A row fits with top-k of at most c (ties at the k-th value
    included, no more than c of them), or with top-p and no top-k when the mass outside
    its c largest is at most 1 - top_p (TopP drops all of it; no ties at the c-th value
    straddle the cut): top-p and min-p then run on the c largest alone."""
    vals, idx = cpu_kernels.top_k(x, c)
    vals = jax.lax.optimization_barrier(vals)
    kth = jnp.take_along_axis(vals, jnp.clip(top_k - 1, 0, c - 1)[:, None], axis=-1)  # [N, 1]
    by_k = (top_k > 0) & (top_k <= c) & (jnp.sum(x >= kth, axis=-1) <= c)
    log_z = logsumexp_last(x)[:, 0]
    outside = x < vals[:, -1:]
    tail = sum_last(jnp.where(outside, jnp.exp(x - log_z[:, None]), 0.0))[:, 0]
    by_p = (top_k == 0) & (rs.top_p < 1.0) & (jnp.sum(~outside, axis=-1) <= c) & (tail <= 1.0 - rs.top_p)
    kept = _top_p_min_p_rows(jnp.where(by_k[:, None] & (vals < kth), -jnp.inf, vals), rs.top_p, rs.min_p,
                             jnp.where(by_p, tail, 0.0), jnp.where(by_p, log_z, -jnp.inf))
    return idx, kept, by_k | by_p


def _tiers(x: jax.Array, rs: RowSampling, top_k: jax.Array):
    """Each row's cheapest exact path to its support: [(ids, kept, fits)] for its CANDIDATES
    largest logits, then (under a conditional that runs only when some row needs it) its
    WIDE_CANDIDATES largest for the rows the first tier does not hold (`_candidates`), and
    `full` [N]: the sampled rows with top-k or top-p that neither holds (a sort of V)."""
    n, v = x.shape
    first = _candidates(x, rs, top_k, min(CANDIDATES, v))
    missed = (rs.temperature > 0) & ((top_k > 0) | (rs.top_p < 1.0)) & ~first[2]
    c = min(WIDE_CANDIDATES, v)

    def wide(_):
        idx, kept, fits = _candidates(x, rs, top_k, c)
        return idx, kept, fits & missed

    second = jax.lax.cond(jnp.any(missed), wide, lambda _: (jnp.zeros((n, c), jnp.int32),
                                                            jnp.full((n, c), -jnp.inf, x.dtype),
                                                            jnp.zeros(n, bool)), None)
    return [first, second], missed & ~second[2]


def support_rows(logits: jax.Array, rs: RowSampling) -> jax.Array:
    """Tempered logits [N, V] of each row's sampling distribution, -inf outside its support;
    a greedy row is 0 at its argmax (lowest id on ties) and -inf elsewhere.

    Supports follow transformers' chain (temperature, top-k keeping ties at the k-th value,
    top-p, min-p), by the cheapest path that gives the row's own answer:
    - no top-k and no top-p: min-p over the whole vocabulary (no sort);
    - top-k of at most CANDIDATES (ties included), or top-p alone where the CANDIDATES
      largest logits hold its whole support (`_candidates`): top-p and min-p on those;
      else the same on the WIDE_CANDIDATES largest (`_tiers`);
    - otherwise (a larger top-k, a flatter top-p, more ties than CANDIDATES): a sort of V,
      under a conditional that runs only when some row needs it.
    A row's path depends on its own logits and settings only, never on the other rows.
    """
    n, v = logits.shape
    temp = jnp.where(rs.temperature > 0, rs.temperature, 1.0)
    x = _tempered(logits, temp)
    top_k = jnp.where((rs.top_k > 0) & (rs.top_k < v), rs.top_k, 0)
    plain = _min_p_rows(x, rs.min_p)

    tiers, full = _tiers(x, rs, top_k)

    def whole_vocabulary(_):
        desc = -jnp.sort(-x, axis=-1)
        kth_v = jnp.take_along_axis(desc, jnp.clip(top_k - 1, 0, v - 1)[:, None], axis=-1)
        y = jnp.where((top_k[:, None] > 0) & (x < kth_v), -jnp.inf, x)
        return _top_p_min_p_rows(y, rs.top_p, rs.min_p)

    sorted_rows = jax.lax.cond(jnp.any(full), whole_vocabulary, lambda _: plain, None)
    y = plain
    for idx, kept, fits in reversed(tiers):
        y = jnp.where(fits[:, None], jnp.full_like(x, -jnp.inf).at[jnp.arange(n)[:, None], idx].set(kept), y)
    y = jnp.where(full[:, None], sorted_rows, y)
    greedy = jnp.where(jnp.arange(v) == argmax(logits)[:, None], 0.0, -jnp.inf)
    return jnp.where((rs.temperature > 0)[:, None], y, greedy)


def transform_rows(logits: jax.Array, rs: RowSampling) -> jax.Array:
    """Log-probabilities [N, V] of each row's sampling distribution (-inf outside it);
    a row's the same bits whatever the other rows (`reductions`)."""
    return log_softmax_last(support_rows(logits, rs))


_transform_rows = jax.jit(transform_rows)  # settings are traced: one compile per shape, whatever s is


def sample_rows(logits: jax.Array, keys: jax.Array, rs: RowSampling) -> jax.Array:
    """One token per row of logits [N, V] under per-row settings; greedy rows take the argmax.

    A sampled row draws by Gumbel-max over its support (as `support_rows` defines it), by
    the cheapest of the same paths: a row whose support lies among its CANDIDATES (or
    WIDE_CANDIDATES) largest logits (`_tiers`) adds noise `gumbel(fold_in(key, token))` to
    those only (so both tiers draw the same token from the same support);
    any other row adds `gumbel(key, [V])[token]` over the vocabulary. Which path serves a
    row, and so its token, depends only on its own logits, key and settings, never on the
    other rows."""
    n, v = logits.shape
    greedy = argmax(logits)
    temp = jnp.where(rs.temperature > 0, rs.temperature, 1.0)
    x = _tempered(logits, temp)
    top_k = jnp.where((rs.top_k > 0) & (rs.top_k < v), rs.top_k, 0)
    sampled = rs.temperature > 0

    def draw(idx, kept):
        noise = threefry.gumbel(threefry.fold_in(keys[:, None], idx))  # [N, C]: gumbel(fold_in(key, token))
        pick = argmax(kept + noise)
        return jnp.take_along_axis(idx, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)

    tiers, full = _tiers(x, rs, top_k)
    (idx, kept, fits), (wide_idx, wide_kept, wide_fits) = tiers
    candidates = jnp.where(fits, draw(idx, kept),
                           jax.lax.cond(jnp.any(wide_fits), lambda _: draw(wide_idx, wide_kept),
                                        lambda _: greedy, None))
    fits = fits | wide_fits
    plain = sampled & (top_k == 0) & (rs.top_p >= 1.0)

    def vocabulary(_):  # one draw of noise over V serves both whole-vocabulary paths
        noise = threefry.gumbel(keys, (v,))
        by_min_p = argmax(_min_p_rows(x, rs.min_p) + noise)

        def by_sort(_):
            desc = -jnp.sort(-x, axis=-1)
            kth_v = jnp.take_along_axis(desc, jnp.clip(top_k - 1, 0, v - 1)[:, None], axis=-1)
            y = jnp.where((top_k[:, None] > 0) & (x < kth_v), -jnp.inf, x)
            return argmax(_top_p_min_p_rows(y, rs.top_p, rs.min_p) + noise)

        return by_min_p, jax.lax.cond(jnp.any(full), by_sort, lambda _: greedy, None)

    by_min_p, by_sort = jax.lax.cond(jnp.any(plain | full), vocabulary, lambda _: (greedy, greedy), None)
    return jnp.where(full, by_sort, jnp.where(plain, by_min_p, jnp.where(fits & sampled, candidates, greedy)))


def target_tokens_rows(logits: jax.Array, positions: jax.Array, seeds: jax.Array, rs: RowSampling,
                       sampled: bool) -> jax.Array:
    """The target's token after each logit row [N, V]; row i decides absolute position
    positions[i] with seeds[i] and setting i. `sampled` (static) is False when every row is
    greedy: then no noise is drawn at all."""
    if not sampled:
        return argmax(logits)
    keys = jax.vmap(lambda s, p: position_key(s, TARGET, p))(seeds, positions)
    return sample_rows(logits, keys, rs)


_target_tokens_rows = jax.jit(target_tokens_rows, static_argnames="sampled")  # one compile per shape


def accept_rows(logits: jax.Array | None, drafts: jax.Array, logq: jax.Array, n: jax.Array, positions: jax.Array,
                seeds: jax.Array, rs: RowSampling, own: jax.Array | None = None,
                logp: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """`accept_sampled` for R rows with their own settings: logits [R, W, V], sampled
    drafts [R, W-1] (first n [R] real) with their draft log-probs logq [R, W-1, V],
    positions [R, W] (absolute position each target row decides), seeds [R].

    Draft i is accepted with probability min(1, p_i(d)/q_i(d)); the first rejection is
    replaced by a draw from normalize(max(p_i - q_i, 0)); after n acceptances the bonus is
    the target's own position-keyed token. `own` [R, W]: those tokens (`target_tokens_rows`
    at these positions) and `logp` [R, W, V] (`transform_rows` of the logits, which are then
    not read) where the caller has them already. Returns (tokens [R, W], accepted [R])."""
    r, w, v = logq.shape[0], drafts.shape[1] + 1, logq.shape[2]
    flat = rs.repeat(w)
    if logp is None:
        logp = transform_rows(logits.reshape(r * w, v), flat).reshape(r, w, v)
    if own is None:
        own = target_tokens_rows(logits.reshape(r * w, v), positions.reshape(-1), jnp.repeat(seeds, w), flat,
                                 True).reshape(r, w)

    def one(logp, logq, drafts, n, positions, seed, own):
        k = w - 1
        ratio = jax.vmap(accept_probability)(logp[:k], logq, drafts)
        u = threefry.uniform(position_key(seed, ACCEPT, positions[:k]))
        ok = (u < ratio) & (jnp.arange(k) < n)
        accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))
        at = jnp.minimum(accepted, k - 1)
        residual = sample(residual_logprobs(logp[at], logq[at]), position_key(seed, RESIDUAL, positions[accepted]))
        fix = jnp.where(accepted < n, residual, own[accepted])
        padded = jnp.concatenate([drafts, jnp.zeros((1,), drafts.dtype)])
        return jnp.where(jnp.arange(w) < accepted, padded, fix).astype(jnp.int32), accepted

    return jax.vmap(one)(logp, logq, drafts.astype(jnp.int32), n, positions, seeds, own)
