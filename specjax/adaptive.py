"""Adaptive k: pick the draft length (and the proposer) per step from history.

Before each step the chooser maximises expected committed tokens per second,

    E[tokens | p, k] / (verify_cost(bucket(k + 1)) + propose_cost(p, k)),
    E[tokens | p, k] = 1 + sum_{i<=k} prod_{j<=i} alpha_p[j],

where alpha_p[j] is proposer p's acceptance of draft j given draft j was judged: decayed
counts of accepts over judgements (a window of ~20 steps) shrunk towards the estimate for
position j - 1 (position 1: a prior) by a couple of pseudo-observations, so a position not
judged yet inherits its predecessor's rate and longer drafts get tried as soon as short
ones are accepted; the costs are moving averages of the
steps' whole wall times in this process (lookups and this decision included; seeded from
CPU ratios in reference/cpu-facts.md). k is drawn from the compiled verify buckets, so nothing
compiles mid-run; k = 0 means plain steps.
A model proposer's cost starts from its own estimate (weight bytes against the target's)
and is then timed; its cost at an untimed k is scaled from the timed ones (a chain of
drafts costs per draft, a one-pass drafter the same at any k). A model proposer that is
not chosen is retried after 16 idle steps, then 32, 64, ... (probes back off, so one that
never pays costs O(log n) steps of n).

Plain steps run fused (`steps.decode`: no host round trip, no lookup, no decision between
tokens), in runs that double while plain keeps winning (1, 2, 4, .., 16 tokens) and start
again at 1 after a drafted step. Plain is priced at what a long run costs per token
(measured, else RUN_RATIO x t(1)), not at what a single step costs: priced per step, a weak
draft beats one plain step and resets the run, and the loop never reaches the long runs. So when
drafts do not pay, the loop's per-token cost approaches plain decoding's, and the lookups
it skips are at most 15 tokens of a stretch where none had paid.

Free proposers (prompt lookup: deterministic, costless) are not calibrated or probed:
they are asked every step and their drafts are scored against the tokens committed
later ("shadow" drafts), so their acceptance is known without verifying anything. Their
estimates are kept per strength of evidence (`Proposal.match`, the n-gram length
matched), so a 1-token match and a 3-token match are different arms: weak matches are
not drafted on once they prove useless, strong ones are.

Why this keeps decoding exact: the choice for a step is a function of the history only
(committed tokens, past acceptance, past timings) and is fixed before any draft of that
step exists. For a deterministic proposer each verify step commits exactly the tokens
plain decoding would, whatever k is. For sampled drafts, conditioned on the history the
step runs speculative sampling with a fixed k, whose emitted tokens follow the target
distribution; by induction over steps so does the whole output. A chooser that looked at
the current step's sampled draft values (e.g. cutting the block where the draft looks
unsure) would condition on the draws and break this: see the DSpark counterexample
(reference/dflash.md section 6.4). Conditioning on a free proposer's current match is
safe for the same reason k is: its drafts are a function of the history, not draws.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Any, Sequence

import jax
import numpy as np

from . import cpu_kernels, steps
from .proposers import Proposal, ProposerError
from .sampling import Sampling

# Verify step time t(T)/t(1), the prior until this run has measured a bucket: on CPU as
# measured on tiny-code and the S config (context 512, 2 cores, 2026-11-29), with specjax's
# CPU kernels and with XLA's ops alone; accelerators are far from compute-bound at these widths.
CPU_KERNELS_VERIFY_RATIO = {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.75, 16: 2.8}
CPU_VERIFY_RATIO = {1: 1.0, 2: 1.6, 4: 1.8, 8: 2.4, 16: 2.9}
ACCELERATOR_VERIFY_RATIO = {1: 1.0, 2: 1.02, 4: 1.04, 8: 1.08, 16: 1.15}
# A token of a fused 16-step plain run against a T = 1 step called alone (tiny-code, context
# 512, 2026-11-29: 0.75 greedy, 0.81 sampled); the prior until this process has timed one.
RUN_RATIO = 0.8


def prior_verify_ratio() -> dict[int, float]:
    if jax.default_backend() != "cpu":
        return ACCELERATOR_VERIFY_RATIO
    return CPU_KERNELS_VERIFY_RATIO if cpu_kernels.available() else CPU_VERIFY_RATIO


TIME_TABLES = ("verify_s", "run_s", "propose_s", "warm")  # KChooser fields that Adaptive shares


@dataclasses.dataclass
class KChooser:
    """Online estimates and the arg-max rule over arms; pure bookkeeping, no model.

    An arm is a proposer (or, for a free one, a proposer at one match strength).
    """

    max_ks: Sequence[int]              # per arm: the largest k it offers
    prior_accept: float = 0.6
    prior_propose_ratio: Sequence[float] = ()  # per arm: propose cost (per draft if per_draft) / t(1)
    accept_decay: float = 0.95         # weight of the past in acceptance counts (~20 judgements)
    cost_decay: float = 0.8            # and in step times
    pseudo: float = 2.0                # pseudo-observations of the prior per position
    probe_every: int = 16              # a model arm idle this many steps is tried again (doubling)
    explore: float = 0.9               # an untimed verify width is tried when this close to the best
    free: Sequence[bool] = ()          # per arm: judged by shadow drafts (see the module docstring)
    per_draft: Sequence[bool] = ()     # per arm: propose cost grows with k (else one pass, any k)
    prior_verify: dict[int, float] = dataclasses.field(default_factory=prior_verify_ratio)
    max_run: int = 1                   # the longest fused plain run a plain choice grows to
    accepts: np.ndarray = dataclasses.field(init=False)   # [arms, positions] decayed counts
    judged: np.ndarray = dataclasses.field(init=False)    # [arms, positions] decayed counts
    verify_s: dict[int, float] = dataclasses.field(default_factory=dict)
    run_s: dict[int, float] = dataclasses.field(default_factory=dict)  # plain run length -> s per token
    propose_s: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)
    steps_run: int = 0
    model_step: int = 0                # the last step a non-free arm drafted
    probe_gap: int = 0                 # idle steps before the next probe (starts at probe_every)
    warm: set = dataclasses.field(default_factory=set)  # ("verify" | "propose" | "run", key) seen once
    _accept_cache: dict = dataclasses.field(default_factory=dict, repr=False)  # arm -> acceptance()
    _rise_cache: tuple = dataclasses.field(default=(None, None), repr=False)  # (verify_s items, _rise())

    def __post_init__(self) -> None:
        self.accepts = np.zeros((len(self.max_ks), steps.BUCKETS[-1] - 1))
        self.judged = np.zeros_like(self.accepts)
        if not self.prior_propose_ratio:
            self.prior_propose_ratio = [0.0] * len(self.max_ks)
        if not self.free:
            self.free = [False] * len(self.max_ks)
        if not self.per_draft:
            self.per_draft = [True] * len(self.max_ks)
        self.probe_gap = self.probe_every

    def candidates(self, a: int) -> list[int]:
        """k values that fill a compiled bucket (T = k + 1), plus the arm's own max."""
        top = self.max_ks[a]
        return sorted({b - 1 for b in steps.BUCKETS[1:] if b - 1 <= top} | {top})

    def _unit(self) -> float:
        """Seconds of a T = 1 step: measured, or inferred from any measured bucket."""
        if 1 in self.verify_s:
            return self.verify_s[1]
        if self.verify_s:
            w, s = next(iter(self.verify_s.items()))
            return s / self.prior_verify[w]
        return 1.0

    def verify_cost(self, k: int) -> float:
        """Measured for a timed width; else the prior curve, its rise over t(1) rescaled
        to match the widths timed so far."""
        w = steps.bucket(k + 1)
        if w in self.verify_s:
            return self.verify_s[w]
        unit, rise = self._rise()
        return unit * (1 + rise * (self.prior_verify[w] - 1))

    def _rise(self) -> tuple[float, float]:
        """(t(1), median rise of the timed widths over the prior's), cached per verify_s."""
        key = tuple(self.verify_s.items())
        if self._rise_cache[0] != key:
            unit = self._unit()
            rise = [(s / unit - 1) / (self.prior_verify[v] - 1) for v, s in self.verify_s.items() if v > 1]
            self._rise_cache = (key, (unit, float(np.median(rise)) if rise else 1.0))
        return self._rise_cache[1]

    def plain_cost(self) -> float:
        """Seconds per token of plain decoding at its best, a fused run of `max_run` (runs
        grow while plain keeps winning, so that is what choosing plain leads to): measured,
        else the cheapest of the shorter runs timed and the prior ratio to t(1)."""
        if self.max_run == 1:
            return self.verify_cost(0)
        if self.max_run in self.run_s:
            return self.run_s[self.max_run]
        return min([*self.run_s.values(), RUN_RATIO * self.verify_cost(0)])

    def propose_cost(self, a: int, k: int) -> float:
        if self.free[a]:
            return 0.0  # asked every step anyway
        if (a, k) in self.propose_s:
            return self.propose_s[a, k]
        scale = (lambda k: k) if self.per_draft[a] else (lambda k: 1)
        timed = [(j, s) for (b, j), s in self.propose_s.items() if b == a]
        if timed:  # from the nearest timed k
            j, s = min(timed, key=lambda js: abs(js[0] - k))
            return s * scale(k) / scale(j)
        return self.prior_propose_ratio[a] * scale(k) * self._unit()

    def acceptance(self, a: int) -> np.ndarray:
        """Estimated P(draft j accepted | judged), j = 1 .. 15."""
        if a not in self._accept_cache:  # dropped by judge()
            out, prior = [], self.prior_accept
            for acc, jud in zip(self.accepts[a].tolist(), self.judged[a].tolist()):
                prior = (acc + self.pseudo * prior) / (jud + self.pseudo)
                out.append(prior)
            self._accept_cache[a] = np.array(out)
        return self._accept_cache[a]

    def rates(self, a: int, drafts: int | None = None) -> list[tuple[float, int]]:
        """(expected tokens per second, k) of arm a for each candidate k, when it has
        `drafts` drafts (None: as many as asked)."""
        gained = 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(self.acceptance(a)))])
        return [(gained[k if drafts is None else min(k, drafts)] / (self.verify_cost(k) + self.propose_cost(a, k)), k)
                for k in self.candidates(a)]

    def choose(self, available: dict[int, int | None] | None = None) -> tuple[int, int]:
        """(arm, k) with the best expected rate among `available` arms (arm -> drafts it
        has, None: any number; default every arm); k = 0 means plain steps.

        The first step is plain (it times t(1)). A model arm's option whose verify width is
        untimed is taken when its estimate is within `explore` of the best (each width is
        timed once, and only if it might win); a model arm left idle for `probe_gap` steps is
        tried again, with the gap doubling each time it is not then chosen on merit.
        """
        if available is None:
            available = {a: None for a in range(len(self.max_ks))}
        if 1 not in self.verify_s:
            return 0, 0
        options = [(r, -k, a, k) for a, n in available.items() for r, k in self.rates(a, n)]
        plain = 1.0 / self.plain_cost()
        best = max(options, default=(plain, 0, 0, 0))
        top = max(plain, best[0])
        untimed = [o for o in options if not self.free[o[2]] and steps.bucket(o[3] + 1) not in self.verify_s
                   and o[0] >= self.explore * top]
        if untimed:
            return max(untimed)[2:]
        if plain < best[0] and not self.free[best[2]]:
            self.probe_gap = self.probe_every  # a model arm wins: if it stops winning, retry it soon
            return best[2], best[3]
        probes = [o for o in options if not self.free[o[2]]]
        if probes and self.steps_run - self.model_step >= self.probe_gap:
            self.probe_gap = min(2 * self.probe_gap, 1 << 12)
            return max(probes)[2:]
        return (0, 0) if plain >= best[0] else (best[2], best[3])

    def update(self, a: int, k: int, n_drafts: int, accepted: int, propose_s: float, verify_s: float,
               run: int = 1) -> None:
        """Fold in one decision: n_drafts judged (of k asked), `accepted` of them kept, its
        times (a plain run of `run` steps when nothing was drafted)."""
        if n_drafts == 0:
            self._time("run", run, verify_s / run)
        if n_drafts or run == 1:
            self._time("verify", steps.bucket(n_drafts + 1), verify_s)
        if k and not self.free[a]:
            self._time("propose", (a, k), propose_s)
        self.steps_run += run if n_drafts == 0 else 1  # target steps (a plain run is `run` of them)
        if n_drafts and not self.free[a]:  # free arms are judged by their shadow drafts
            self.model_step = self.steps_run
            self.judge(a, min(accepted + 1, n_drafts), accepted)

    def judge(self, a: int, judged: int, accepted: int) -> None:
        """Fold in one judgement of arm a: drafts 1..judged looked at, the first `accepted` kept."""
        d = self.accept_decay
        self._accept_cache.pop(a, None)
        self.accepts[a] *= d
        self.judged[a] *= d
        self.accepts[a, :accepted] += 1.0
        self.judged[a, :judged] += 1.0

    def _time(self, kind: str, key: Any, value: float) -> None:
        """Fold a step time into verify_s or propose_s (moving average). The first time of
        each key is dropped: the first call of a width or draft length in a process
        includes its compilation (~0.5 s on CPU), which would make it look useless."""
        if (kind, key) not in self.warm:
            self.warm.add((kind, key))
            return
        table, d = {"verify": self.verify_s, "propose": self.propose_s, "run": self.run_s}[kind], self.cost_decay
        table[key] = value if key not in table else d * table[key] + (1 - d) * value


@dataclasses.dataclass(frozen=True, eq=False)
class Adaptive:
    """Wraps one or more proposers; each step uses the (proposer, k) the chooser picks.

    Each proposer's own k is the largest it will be asked for. Step times are properties
    of the machine and the target, not of a prompt: those measured in one generation seed
    the next with the same target, cache size and sampling (acceptance is learnt anew).
    """

    proposers: tuple
    prior_accept: float = 0.6
    accept_decay: float = 0.95

    def __init__(self, *proposers: Any, prior_accept: float = 0.6, accept_decay: float = 0.95):
        if not proposers:
            raise ProposerError("Adaptive needs at least one proposer")
        from .lookup import LookupProposer

        if any(isinstance(p, LookupProposer) for p in proposers):
            raise ProposerError("LookupProposer runs on the batched engine, with k chosen there, and cannot be "
                                "wrapped by Adaptive; give Adaptive an NgramProposer, or pass LookupProposer to "
                                "generate()")
        for p in proposers:
            if isinstance(p, Adaptive) or not (hasattr(p, "start") and hasattr(p, "k")):
                raise ProposerError(f"Adaptive chooses among proposers (NgramProposer, DraftProposer, "
                                    f"DFlashProposer), got {type(p).__name__}")
        for name, value in (("prior_accept", prior_accept), ("accept_decay", accept_decay)):
            if not 0 < value <= 1:
                raise ProposerError(f"{name} must be in (0, 1], got {value!r}")
        object.__setattr__(self, "proposers", tuple(proposers))
        object.__setattr__(self, "prior_accept", prior_accept)
        object.__setattr__(self, "accept_decay", accept_decay)
        # target -> (capacity, sampling) -> the chooser's time tables
        object.__setattr__(self, "_timings", weakref.WeakKeyDictionary())

    def start(self, target: Any, prompt: np.ndarray, capacity: int, seed: int, sampling: Sampling):
        costs = [p.cost_prior(target) if hasattr(p, "cost_prior") else (0.3, True) for p in self.proposers]
        session = _AdaptiveSession(self, [p.start(target, prompt, capacity, seed, sampling) for p in self.proposers],
                                   costs)
        if target is not None:
            shared = self._timings.setdefault(target, {}).setdefault(
                (capacity, sampling), {f: getattr(session.chooser, f) for f in TIME_TABLES})
            for field, table in shared.items():  # the same objects: this session's timings feed the next
                setattr(session.chooser, field, table)
        return session


class _AdaptiveSession:
    def __init__(self, spec: Adaptive, sessions: list, costs: list[tuple[float, bool]]):
        self.sessions = sessions
        self.arms: list[tuple[int, int | None]] = []  # (session, match strength; None: not free)
        self.graded: dict[int, bool] = {}  # free session -> arms per match strength (else one arm, 0)
        for i, (prop, session) in enumerate(zip(spec.proposers, sessions)):
            if getattr(session, "free", False):
                top = getattr(prop, "max_ngram", 0)
                self.graded[i] = bool(top)
                self.arms += [(i, m) for m in (range(getattr(prop, "min_ngram", 1), top + 1) if top else [0])]
            else:
                self.arms.append((i, None))
        self.chooser = KChooser([spec.proposers[i].k for i, _ in self.arms], spec.prior_accept,
                                [costs[i][0] for i, _ in self.arms], spec.accept_decay,
                                free=[m is not None for _, m in self.arms],
                                per_draft=[costs[i][1] for i, _ in self.arms], max_run=steps.BUCKETS[-1])
        self.max_k = [p.k for p in spec.proposers]
        taps = {tuple(getattr(s, "taps", ())) for s in sessions} - {()}
        if len(taps) > 1:
            raise ProposerError("Adaptive supports at most one proposer that needs target taps")
        self.taps = next(iter(taps), ())
        self.choices: list[tuple[int, int]] = []  # (proposer, k) per step
        self.shadows: list[tuple[int, int, np.ndarray]] = []  # (arm, first position, drafts)
        self._pending: tuple | None = None
        self.run = 1  # plain steps the next plain choice fuses: doubles while plain keeps winning

    def propose(self, history: np.ndarray, limit: int) -> Proposal:
        entered = time.perf_counter()
        free: dict[int, Proposal] = {}
        available: dict[int, int | None] = {}
        for a, (i, m) in enumerate(self.arms):
            if m is None:
                available[a] = None
                continue
            if i not in free:
                prop = self.sessions[i].propose(history, self.max_k[i])
                free[i] = dataclasses.replace(prop, match=prop.match if self.graded[i] else 0)
                if prop.n:
                    arm = self.arms.index((i, free[i].match))
                    self.shadows.append((arm, len(history), np.asarray(prop.drafts[:prop.n])))
            if free[i].n and free[i].match == m:
                available[a] = free[i].n
        timed = 1 in self.chooser.verify_s
        # history only: decided before any sampled draft exists
        a, k = self.chooser.choose(available)
        i, m = self.arms[a]
        self.choices.append((i, k))
        t0 = time.perf_counter()
        if k == 0:
            run = steps.bucket_below(min(self.run if timed else 1, limit + 1))  # the run the loop takes
            self.run = min(2 * self.run, steps.BUCKETS[-1]) if timed else 1
            self._pending = (a, 0, 0, entered, t0, t0, run)
            return Proposal(np.zeros(0, np.int32), 0, plain=run)
        self.run = 1
        if m is not None:  # already looked up
            n = min(k, limit, free[i].n)
            self._pending = (a, k, n, entered, t0, t0, 1)
            return Proposal(free[i].drafts[:n], n, match=m)
        prop = self.sessions[i].propose(history, min(k, limit))
        jax.block_until_ready(prop.drafts)
        self._pending = (a, k, prop.n, entered, t0, time.perf_counter(), 1)
        return prop

    def extend(self, features: Any, count: int) -> None:
        for s in self.sessions:
            if getattr(s, "taps", ()):
                s.extend(features, count)

    def observe(self, accepted: int, history: np.ndarray) -> None:
        a, k, n, entered, t0, t1, run = self._pending
        if k:
            self.sessions[self.arms[a][0]].observe(accepted, history)
        pending = []
        for arm, first, drafts in self.shadows:  # score what the committed tokens now decide
            known = history[first:first + len(drafts)]
            same = known == drafts[:len(known)]
            kept = len(known) if same.all() else int(np.argmin(same))
            if kept < len(known) or len(known) == len(drafts):
                self.chooser.judge(arm, min(kept + 1, len(drafts)), kept)
            else:
                pending.append((arm, first, drafts))
        self.shadows = pending
        # A step is priced by its whole wall time (lookups, this decision, the verify or
        # plain run, bookkeeping) less the model proposer's own time, priced separately.
        self.chooser.update(a, k, n, accepted, t1 - t0, time.perf_counter() - entered - (t1 - t0), run)
