"""Adaptive k: pick the draft length (and the proposer) per step from history.

Before each step the chooser maximises expected committed tokens per second,

    E[tokens | p, k] / (verify_cost(bucket(k + 1)) + propose_cost(p, k)),
    E[tokens | p, k] = 1 + sum_{i<=k} prod_{j<=i} alpha_p[j],

where alpha_p[j] is proposer p's acceptance of draft j given draft j was judged: decayed
counts of accepts over judgements (a window of ~20 steps) shrunk towards the estimate for
position j - 1 (position 1: a prior) by a couple of pseudo-observations, so a position not
judged yet inherits its predecessor's rate and longer drafts get tried as soon as short
ones are accepted; the costs are moving averages of the
step times measured in this run (seeded from CPU ratios in reference/cpu-facts.md). k is
drawn from the compiled verify buckets, so nothing compiles mid-run; k = 0 is a plain step.
The first few steps time each candidate once (a calibration inside the run).

Why this keeps decoding exact: the choice for a step is a function of the history only
(committed tokens, past acceptance, past timings) and is fixed before any draft of that
step exists. For a deterministic proposer each verify step commits exactly the tokens
plain decoding would, whatever k is. For sampled drafts, conditioned on the history the
step runs speculative sampling with a fixed k, whose emitted tokens follow the target
distribution; by induction over steps so does the whole output. A chooser that looked at
the current step's sampled draft values (e.g. cutting the block where the draft looks
unsure) would condition on the draws and break this: see the DSpark counterexample
(reference/dflash.md section 6.4).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import numpy as np

from . import steps
from .proposers import Proposal, ProposerError
from .sampling import Sampling

# Verify step time t(T)/t(1) on 2 CPU cores (reference/cpu-facts.md section 8), the prior
# until this run has measured a bucket.
PRIOR_VERIFY_RATIO = {1: 1.0, 2: 1.2, 4: 1.5, 8: 1.9, 16: 2.4}


@dataclasses.dataclass
class KChooser:
    """Online estimates and the arg-max rule; pure bookkeeping, no model."""

    max_ks: Sequence[int]              # per proposer: the largest k it offers
    prior_accept: float = 0.6
    prior_propose_ratio: Sequence[float] = ()  # per proposer: propose cost per draft / t(1)
    accept_decay: float = 0.95         # weight of the past in acceptance counts (~20 steps)
    cost_decay: float = 0.8            # and in step times
    pseudo: float = 2.0                # pseudo-observations of the prior per position
    probe_every: int = 16              # after this many plain steps in a row, try k > 0 again
    accepts: np.ndarray = dataclasses.field(init=False)   # [proposers, positions] decayed counts
    judged: np.ndarray = dataclasses.field(init=False)    # [proposers, positions] decayed counts
    verify_s: dict[int, float] = dataclasses.field(default_factory=dict)
    propose_s: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)
    plain_streak: int = 0

    def __post_init__(self) -> None:
        self.accepts = np.zeros((len(self.max_ks), steps.BUCKETS[-1] - 1))
        self.judged = np.zeros_like(self.accepts)
        if not self.prior_propose_ratio:
            self.prior_propose_ratio = [0.0] * len(self.max_ks)

    def candidates(self, p: int) -> list[int]:
        """k values that fill a compiled bucket (T = k + 1), plus the proposer's own max."""
        top = self.max_ks[p]
        return sorted({b - 1 for b in steps.BUCKETS[1:] if b - 1 <= top} | {top})

    def _unit(self) -> float:
        """Seconds of a T = 1 step: measured, or inferred from any measured bucket."""
        if 1 in self.verify_s:
            return self.verify_s[1]
        if self.verify_s:
            w, s = next(iter(self.verify_s.items()))
            return s / PRIOR_VERIFY_RATIO[w]
        return 1.0

    def verify_cost(self, k: int) -> float:
        w = steps.bucket(k + 1)
        return self.verify_s.get(w, PRIOR_VERIFY_RATIO[w] * self._unit())

    def propose_cost(self, p: int, k: int) -> float:
        return self.propose_s.get((p, k), self.prior_propose_ratio[p] * k * self._unit())

    def acceptance(self, p: int) -> np.ndarray:
        """Estimated P(draft j accepted | judged), j = 1 .. 15."""
        out = np.empty(self.accepts.shape[1])
        prior = self.prior_accept
        for j in range(len(out)):
            prior = out[j] = (self.accepts[p, j] + self.pseudo * prior) / (self.judged[p, j] + self.pseudo)
        return out

    def expected_tokens(self, p: int, k: int) -> float:
        return 1.0 + float(np.sum(np.cumprod(self.acceptance(p)[:k])))

    def rate(self, p: int, k: int) -> float:
        if k == 0:
            return 1.0 / self.verify_cost(0)
        return self.expected_tokens(p, k) / (self.verify_cost(k) + self.propose_cost(p, k))

    def choose(self) -> tuple[int, int]:
        """(proposer, k) with the best expected rate; k = 0 means a plain step.

        The first steps calibrate: each candidate not yet timed runs once.
        """
        for p in range(len(self.max_ks)):
            for k in [0] + self.candidates(p):
                if steps.bucket(k + 1) not in self.verify_s or (k and (p, k) not in self.propose_s):
                    return p, k
        options = [(self.rate(p, k), -k, p, k) for p in range(len(self.max_ks)) for k in self.candidates(p)]
        best = max(options)
        if self.rate(0, 0) >= best[0] and self.plain_streak < self.probe_every:
            return 0, 0
        return best[2], best[3]

    def update(self, p: int, k: int, n_drafts: int, accepted: int, propose_s: float, verify_s: float) -> None:
        """Fold in one step: n_drafts judged (of k asked), `accepted` of them kept, its times."""
        width = steps.bucket(n_drafts + 1)
        self._ema(self.verify_s, width, verify_s)
        if k:
            self._ema(self.propose_s, (p, k), propose_s)
        self.plain_streak = self.plain_streak + 1 if n_drafts == 0 else 0
        judged = min(accepted + 1, n_drafts)
        outcome = (np.arange(judged) < accepted).astype(float)
        d = self.accept_decay
        self.accepts[p] *= d
        self.judged[p] *= d
        self.accepts[p, :judged] += outcome
        self.judged[p, :judged] += 1.0

    def _ema(self, table: dict, key: Any, value: float) -> None:
        d = self.cost_decay
        table[key] = value if key not in table else d * table[key] + (1 - d) * value


@dataclasses.dataclass(frozen=True, eq=False)
class Adaptive:
    """Wraps one or more proposers; each step uses the (proposer, k) the chooser picks.

    Each proposer's own k is the largest it will be asked for.
    """

    proposers: tuple
    prior_accept: float = 0.6
    accept_decay: float = 0.95

    def __init__(self, *proposers: Any, prior_accept: float = 0.6, accept_decay: float = 0.95):
        if not proposers:
            raise ProposerError("Adaptive needs at least one proposer")
        object.__setattr__(self, "proposers", tuple(proposers))
        object.__setattr__(self, "prior_accept", prior_accept)
        object.__setattr__(self, "accept_decay", accept_decay)

    def start(self, target: Any, prompt: np.ndarray, capacity: int, seed: int, sampling: Sampling):
        return _AdaptiveSession(self, [p.start(target, prompt, capacity, seed, sampling) for p in self.proposers])


def _propose_ratio(proposer: Any) -> float:
    """Prior cost of one draft relative to a target step: ~0 for lookup, ~0.3 for models."""
    return 0.0 if type(proposer).__name__ == "NgramProposer" else 0.3


class _AdaptiveSession:
    def __init__(self, spec: Adaptive, sessions: list):
        self.sessions = sessions
        self.chooser = KChooser([p.k for p in spec.proposers], spec.prior_accept,
                                [_propose_ratio(p) for p in spec.proposers], spec.accept_decay)
        taps = {tuple(getattr(s, "taps", ())) for s in sessions} - {()}
        if len(taps) > 1:
            raise ProposerError("Adaptive supports at most one proposer that needs target taps")
        self.taps = next(iter(taps), ())
        self.choices: list[tuple[int, int]] = []
        self._pending: tuple | None = None

    def propose(self, history: np.ndarray, limit: int) -> Proposal:
        p, k = self.chooser.choose()  # history only: decided before any draft exists
        self.choices.append((p, k))
        t0 = time.perf_counter()
        if k == 0:
            self._pending = (p, 0, 0, t0, t0)
            return Proposal(np.zeros(0, np.int32), 0)
        prop = self.sessions[p].propose(history, min(k, limit))
        jax.block_until_ready(prop.drafts)
        self._pending = (p, k, prop.n, t0, time.perf_counter())
        return prop

    def extend(self, features: Any, count: int) -> None:
        for s in self.sessions:
            if getattr(s, "taps", ()):
                s.extend(features, count)

    def observe(self, accepted: int, history: np.ndarray) -> None:
        p, k, n, t0, t1 = self._pending
        self.chooser.update(p, k, n, accepted, t1 - t0, time.perf_counter() - t1)
        if k:
            self.sessions[p].observe(accepted, history)
