"""Prompt lookup on the device: look up, choose k, verify and commit inside one compiled loop.

Why: a drafted step called from Python pays a host round trip (dispatch, result transfer,
the lookup and the decision in Python): on CPU that was 1-2 ms of a 4-6 ms step on
tiny-code, while a token of a fused plain run (`steps.decode`) costs 2.7-3.6 ms. Here the
n-gram lookup, the choice of k and the acceptance run on the device, `steps` at a time.

The choice of k per step maximises E[tokens] / cost(width) under an acceptance model per
n-gram length m matched with two rates: q_m that the first draft is accepted, and r_m that a
later draft is, given the ones before it were (each decayed accepted / judged, shrunk to a
prior). Two rates because copying is bursty: a lookup often starts at the wrong occurrence,
but once its first draft holds the copy tends to run on (edit prompts on tiny-code: first
draft 0.66, later ones 0.85-1.0), and one pooled rate sees ~0.8 and drafts too few.
Every lookup is scored, drafted or not (a plain step still judges the first draft against
the token it commits), so a weak match that stops paying is skipped and one that starts
paying is taken again; r_m's prior is optimistic so wide drafts get tried. cost(width) is
t(T)/t(1) of a step inside this loop, fitted to the calls' wall times (`StepCosts`);
k = 0 is a plain T = 1 step.

Exactness: the drafts and the choice are functions of committed tokens and past
acceptance only, and each step is `steps.judge` with deterministic drafts, so every step
commits exactly the tokens plain decoding would (greedy or sampled with the same keys).
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from . import steps
from .checkpoint import Params
from .config import Qwen3Config
from .kv import KVCache
from .model import Model
from .proposers import ProposerError, check_k, check_ngram
from .sampling import Sampling

STOPS = 8  # stop ids the device checks (more are still honoured: the loop checks them all)
MAX_NGRAM = 32  # find() unrolls one comparison per n: compile time grows with it


def find(history: jax.Array, size: jax.Array, k: int, max_ngram: int, min_ngram: int
         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`proposers.ngram_lookup` on the device: the k tokens after the latest earlier
    occurrence of the longest suffix of history[:size] (max_ngram .. min_ngram tokens).

    history must hold at least size + k entries. Returns (drafts [k], real drafts, n matched).
    """
    at = jnp.arange(history.shape[0])
    run = at < size - 1  # an occurrence ending at i needs a continuation at i + 1 < size
    matched = jnp.zeros_like(at)
    for back in range(max_ngram):
        shifted = jnp.roll(history, back)  # shifted[i] = history[i - back]
        run = run & (at >= back) & (shifted == history[size - 1 - back]) & (size - 1 - back >= 0)
        matched = matched + run
    score = jnp.where(matched >= min_ngram, matched * history.shape[0] + at, -1)
    end = jnp.argmax(score)
    found = score[end] >= 0
    drafts = jax.lax.dynamic_slice(history, (end + 1,), (k,))
    n = jnp.where(found, jnp.minimum(k, size - 1 - end), 0)
    return drafts, n, jnp.where(found, matched[end], 0)


def _switch(index: jax.Array, branches: list, kv: KVCache, *args):
    """lax.switch(index, branches, kv, *args) for branches returning (out, count, nan, kv),
    as a chain of while loops that run zero or one time.

    Why: XLA:CPU copies a cache that a conditional's branch updates (two pool copies per
    step, ~1 ms on tiny-code), but updates a while loop's carried buffers in place.
    """
    shapes = jax.eval_shape(branches[0], kv, *args)[:3]
    init = (jnp.int32(index), jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes), kv)

    for j, branch in enumerate(branches):
        def body(c, j=j, branch=branch):
            out, count, nan, kv = branch(c[2], *args)
            return jnp.int32(-1), (out, count, nan), kv
        init = jax.lax.while_loop(lambda c, j=j: c[0] == j, body, init)
    _, (out, count, nan), kv = init
    return out, count, nan, kv


def expected_tokens(q: jax.Array, r: jax.Array, n: jax.Array) -> jax.Array:
    """1 + q (1 + r + .. + r^(n-1)): committed tokens of a step with n drafts, the first
    accepted at rate q and each later one, given those before it, at rate r."""
    run = jnp.where(r < 1.0, (1.0 - r ** n) / (1.0 - jnp.minimum(r, 1.0 - 1e-6)), n)
    return 1.0 + q * run


@partial(jax.jit, static_argnames=("cfg", "sampling", "k", "max_ngram", "min_ngram", "n_steps"),
         donate_argnames=("kv",))
def run(params: Params, cfg: Qwen3Config, kv: KVCache, history: jax.Array, size: jax.Array,
        budget: jax.Array, stops: jax.Array, state: dict, costs: jax.Array, seed: jax.Array,
        sampling: Sampling, k: int, max_ngram: int, min_ngram: int, n_steps: int):
    """Up to `n_steps` speculative steps, stopping once `budget` tokens are committed or a
    stop id is; history[size - 1] is the token the next step feeds (the cache holds the rest).

    state: {"accepted", "judged"} [2, max_ngram + 1] decayed counts of first (row 0) and
    later (row 1) drafts per n-gram length matched; costs [widths] t(T)/t(1).
    Returns (history with the new tokens from `size`, new size, nan flag, cache, state,
    log: per step "drafts" judged, "accepted" and "width" (index into BUCKETS) [n_steps],
    -1 after the last step).
    """
    widths = tuple(w for w in steps.BUCKETS if w - 1 <= k)
    span = steps.BUCKETS[-1]

    def branch(width):
        def go(kv, last, drafts, n):
            out, count, bad, kv, _ = steps.judge(params, cfg, kv, last, drafts, n, seed, sampling, width)
            return jnp.pad(out, (0, span - width)), count, bad, kv
        return go

    def body(c):
        kv, history, size, made, i, state, bad, stopped, log = c
        drafts, found, m = find(history, size, k, max_ngram, min_ngram)
        found = jnp.minimum(found, jnp.maximum(budget - made - 1, 0))
        q, r = (state["accepted"][:, m] + PRIOR_ACCEPT * PSEUDO) / (state["judged"][:, m] + PSEUDO)
        room = jnp.array([w - 1 for w in widths])  # drafts each width can judge
        gain = expected_tokens(q, r, jnp.minimum(room, found)) / costs[:len(widths)]
        pick = jnp.where(found > 0, jnp.argmax(gain), 0)
        width_n = jnp.minimum(room[pick], found)
        out, count, nan, kv = _switch(pick, [branch(w) for w in widths], kv, history[size - 1], drafts, width_n)
        # score the lookup: drafted steps judge width_n drafts, plain ones the first
        judge_n = jnp.where(pick > 0, width_n, jnp.minimum(found, 1))
        idx = jnp.arange(k)
        judged = (idx < judge_n) & (idx < count)
        hit = judged & (drafts == out[:k])
        decay = jnp.where(m > 0, ACCEPT_DECAY, 1.0)
        later = idx > 0

        def score(counts, mask):
            per_row = jnp.stack([jnp.sum(mask & ~later), jnp.sum(mask & later)]).astype(counts.dtype)
            return counts.at[:, m].set(counts[:, m] * decay + per_row)
        state = {"accepted": score(state["accepted"], hit), "judged": score(state["judged"], judged)}
        history = jax.lax.dynamic_update_slice(history, out, (size,))
        live = jnp.arange(span) < count
        stopped = jnp.any(live[:, None] & (out[:, None] == stops[None, :]))
        log = {"drafts": log["drafts"].at[i].set(jnp.where(pick > 0, width_n, 0)),
               "accepted": log["accepted"].at[i].set(count - 1), "width": log["width"].at[i].set(pick)}
        return kv, history, size + count, made + count, i + 1, state, bad | nan, stopped, log

    def more(c):
        _, _, _, made, i, _, _, stopped, _ = c
        return (i < n_steps) & (made < budget) & ~stopped

    log = {name: jnp.full((n_steps,), -1, jnp.int32) for name in ("drafts", "accepted", "width")}
    init = (kv, history, size, jnp.int32(0), jnp.int32(0), state, jnp.bool_(False), jnp.bool_(False), log)
    kv, history, size, _, _, state, bad, _, log = jax.lax.while_loop(more, body, init)
    return history, size, bad, kv, state, log


# Prior acceptance, after any match, of the first draft and of a later one given the
# earlier (optimistic, so a match whose first draft pays gets drafted wide and r measured);
# each prior is worth PSEUDO judged drafts.
PRIOR_ACCEPT = np.array([0.5, 0.8], np.float32)
PSEUDO = 2.0
ACCEPT_DECAY = 0.95  # weight of the past per scored lookup (~20 lookups)
# t(T)/t(1) of a step inside this loop on CPU (tiny-code, context 880, 2 cores, greedy and
# sampled, 2026-11-30): higher than for steps called one by one (adaptive's priors), because
# the loop makes the T = 1 step cheaper (no dispatch or transfer) and not the wide ones.
CPU_LOOP_RATIO = {1: 1.0, 2: 1.25, 4: 1.7, 8: 2.5, 16: 4.3}


def prior_ratios() -> np.ndarray:
    """Step cost per verify width (BUCKETS) relative to T = 1, before any timing."""
    from .adaptive import ACCELERATOR_VERIFY_RATIO

    table = CPU_LOOP_RATIO if jax.default_backend() == "cpu" else ACCELERATOR_VERIFY_RATIO
    return np.array([table[w] for w in steps.BUCKETS])


@dataclasses.dataclass
class StepCosts:
    """Seconds per step of each verify width, fitted to whole calls of `run`,

        seconds(call) = sum_w steps_w * c_w   (a call's fixed overhead spreads over its steps),

    by least squares over decayed calls plus `strength` pseudo-steps per width saying
    c_w = prior_w * scale, where scale is the decayed ratio of seconds to the prior's
    prediction over all calls (one width's noise barely moves it): widths never run keep
    the prior's ratios among themselves, and one run often follows data. A call's time is
    clipped to `outlier` times the fit's prediction either way: one call slowed by the
    machine (a collection, another process) would otherwise set the cost of the widths it
    happened to run (seen on CPU: width 8 fitted at 6.5x T = 1 after one such call). The
    first call is not timed: it compiled.
    """

    prior: np.ndarray            # [W] t(T)/t(1)
    strength: float = 16.0       # pseudo-steps per width: about one call's worth
    decay: float = 0.9
    outlier: float = 1.25
    gram: np.ndarray = dataclasses.field(init=False)
    moment: np.ndarray = dataclasses.field(init=False)
    warm: bool = False
    timed: np.ndarray = dataclasses.field(init=False)  # decayed seconds, and the prior's steps

    def __post_init__(self) -> None:
        n = len(self.prior)
        self.gram, self.moment, self.timed = np.zeros((n, n)), np.zeros(n), np.zeros(2)

    def observe(self, counts: np.ndarray, seconds: float) -> None:
        """One call: steps taken per width [W] and its wall time."""
        if not self.warm:
            self.warm = True
            return
        if self.timed[0] > 0:
            predicted = float(counts @ self._per_step())
            seconds = min(max(seconds, predicted / self.outlier), predicted * self.outlier)
        self.timed = self.decay * self.timed + [seconds, float(counts @ self.prior)]
        self.gram = self.decay * self.gram + np.outer(counts, counts)
        self.moment = self.decay * self.moment + counts * seconds

    def _per_step(self) -> np.ndarray:
        """Fitted seconds per step of each width (after a timed call)."""
        scale = self.timed[0] / max(self.timed[1], 1e-9)
        gram = self.gram + self.strength * np.eye(len(self.prior))
        return np.maximum(np.linalg.solve(gram, self.moment + self.strength * self.prior * scale), 1e-9)

    def ratios(self) -> np.ndarray:
        """Fitted t(T)/t(1) per width, at least 1 and not falling with T (the prior before any timing)."""
        if self.timed[0] == 0:
            return self.prior
        per_step = self._per_step()
        return np.maximum.accumulate(np.maximum(per_step / per_step[0], 1.0))


@dataclasses.dataclass(frozen=True, eq=False)
class LookupProposer:
    """Prompt lookup with the whole speculative loop on the device, `steps` steps per call.

    The same drafts as `NgramProposer` (k at most, longest match of max_ngram .. min_ngram
    tokens); k is chosen per step on the device (module docstring), with step costs fitted
    to this process's timings (`StepCosts`, kept per target, cache size and sampling across
    generations). Deterministic, so greedy and sampled output equal plain decoding token
    for token.
    """

    k: int = 15
    max_ngram: int = 3
    min_ngram: int = 1
    steps: int = 16
    fused = True  # runs the loop's steps itself: not a proposer for Adaptive

    def __post_init__(self) -> None:
        check_k(self.k, steps.BUCKETS[-1] - 1)
        check_ngram(self.max_ngram, self.min_ngram, MAX_NGRAM)
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ProposerError(f"steps must be an integer >= 1, got {self.steps!r}")
        # target -> (capacity, sampling) -> StepCosts
        object.__setattr__(self, "_costs", weakref.WeakKeyDictionary())

    def start(self, target: Model, prompt: np.ndarray, capacity: int, seed: int, sampling: Sampling):
        costs = self._costs.setdefault(target, {}).setdefault(
            (capacity, sampling), StepCosts(prior_ratios()))
        return _LookupSession(self, capacity, costs)


class _LookupSession:
    """Runs the loop's steps itself (`fused`): the loop hands it the history and the cache."""

    fused = True

    def __init__(self, spec: LookupProposer, capacity: int, costs: StepCosts):
        self.spec, self.costs = spec, costs
        self.length = capacity + steps.BUCKETS[-1]  # room for a step's writes past the last token
        zeros = jnp.zeros((2, spec.max_ngram + 1), jnp.float32)
        self.state = {"accepted": zeros, "judged": zeros}

    def run(self, model: Model, kv: KVCache, history: np.ndarray, budget: int, stop_ids: set[int],
            seed: jax.Array, sampling: Sampling) -> tuple[list[int], list[tuple[int, int]], bool, KVCache]:
        """Steps until `budget` tokens or a stop id; returns (tokens, (drafts, accepted) per
        step, nan flag, cache)."""
        s = self.spec
        t0 = time.perf_counter()
        buf = np.zeros(self.length, np.int32)
        buf[:len(history)] = history
        stops = np.full(STOPS, -1, np.int32)
        listed = sorted(stop_ids)[:STOPS]
        stops[:len(listed)] = listed
        out, size, bad, kv, self.state, log = run(
            model.params, model.config, kv, buf, np.int32(len(history)), np.int32(budget), stops, self.state,
            np.asarray(self.costs.ratios(), np.float32), seed, sampling=sampling, k=s.k, max_ngram=s.max_ngram,
            min_ngram=s.min_ngram, n_steps=s.steps)
        out, size, bad, log = jax.device_get((out, size, bad, log))
        taken = log["width"] >= 0
        self.costs.observe(np.bincount(log["width"][taken], minlength=len(steps.BUCKETS)).astype(float),
                           time.perf_counter() - t0)
        steps_taken = [(int(n), int(a)) for n, a in zip(log["drafts"][taken], log["accepted"][taken])]
        return [int(x) for x in out[len(history):size]], steps_taken, bool(bad), kv

