"""The engine's cost model: what a step of R rows costs at each verify width, before any
timing (priors) and as fitted online to the device calls' wall times (`StepCosts`)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from . import steps

# Cost of one step over N tokens (rows x width) relative to one token, before any timing.
# CPU: tiny-code with the CPU kernels, 16 steps inside one compiled loop, context 512, 2
# cores, 2026-12-01 (ms per step, rows x W: 1x1 1.55, 1x16 4.84, 8x1 3.11, 8x8 14.8, 16x16
# 55.1; N = rows x W of about the same cost whatever the split). Accelerators: a step that
# stays bandwidth-bound. Linear past the last point.
CPU_TOKENS_COST = ((1, 1.0), (2, 1.06), (4, 1.6), (8, 1.95), (16, 3.2), (32, 5.5), (64, 9.8), (128, 18.5),
                   (256, 35.5))
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


def chain_cost(draft_ratio: float) -> np.ndarray:
    """Prior extra cost per width of a draft model's W - 1 drafts: the feed of the
    committed tokens its cache lacks and a chain of W - 2 steps, each `draft_ratio` (its
    weight bytes over the target's) of a target step (a round without drafts feeds it
    only to catch up: `rounds.rounds`)."""
    return np.array([max(w - 1, 0) * draft_ratio for w in steps.BUCKETS])


def block_cost(rows: int, ratio: float, block_size: int) -> np.ndarray:
    """Prior extra cost (any width) of one DFlash block pass: block_size tokens per row
    through a model `ratio` the target's weight bytes (its layers and the target's head)."""
    return np.full(len(steps.BUCKETS), ratio * tokens_cost(rows * block_size) / tokens_cost(rows))


def tree_cost(rows: int, ratio: float, frontier: int, depth: int) -> np.ndarray:
    """Prior extra cost per width W of growing a draft model's best tree (`drafters.draft_tree`)
    of W - 1 nodes at most, `depth` deep at most: a draft step of `frontier` tokens per row
    for each depth past the first, each `ratio` (the draft's weight bytes over the target's)
    of a target step of as many tokens."""
    step = ratio * tokens_cost(rows * frontier) / tokens_cost(rows)
    return np.array([max(min(w - 1, depth) - 1, 0) * step for w in steps.BUCKETS])


# Extra cost of a round that builds a lookup trie or a DFlash block's best tree (`rounds.rounds`, its
# build bit), relative to a one-token step of one row, before any timing: on tiny-code with its DFlash drafter
# (context 512, 2026-12-06) the block's tree took 0.2-0.3 ms beside a 1.55 ms one-token step. Each row builds
# its own.
TREE_BUILD_COST = 0.15


def build_cost(rows: int, per_row: float = TREE_BUILD_COST) -> np.ndarray:
    """Prior extra cost (any width) of building the rows' lookup tries or DFlash trees,
    `per_row` of a one-token step each."""
    return np.full(len(steps.BUCKETS), per_row * rows / tokens_cost(rows))


def prior_costs(rows: int, extras: list[np.ndarray]) -> np.ndarray:
    """[2^M, widths] prior step costs of rows x W tokens, for each subset of the M step
    parts beyond the target's verify (bit i: extras[i], that part's extra cost per width,
    is paid)."""
    plain = prior_width_costs(rows)
    return np.stack([plain + sum((e for i, e in enumerate(extras) if subset >> i & 1), np.zeros_like(plain))
                     for subset in range(1 << len(extras))])


@dataclasses.dataclass
class StepCosts:
    """Seconds per step of each verify width, fitted to whole device calls (`rounds.rounds`),

        seconds(call) = sum_w steps_w * c_w   (a call's fixed overhead spreads over its steps),

    by least squares over decayed calls plus `strength` pseudo-steps per width saying
    c_w = prior_w * scale, where scale is the decayed ratio of seconds to the prior's
    prediction over all calls (one width's noise barely moves it): widths never run keep
    the prior's ratios among themselves, and one run often follows data. A part whose
    group bit is in `flat` costs the same at every width (building trees): it is one
    constant added to the kinds without it, not a cost per kind, so a kind it joins is
    known once either is, and a few calls fix it. A call's time is
    clipped to `outlier` times the fit's prediction either way: one call slowed by the
    machine (a collection, another process) would otherwise set the cost of the widths it
    happened to run (seen on CPU: width 8 fitted at 6.5x T = 1 after one such call). The
    first call is not timed: it compiled.
    """

    prior: np.ndarray            # [W] t(T)/t(1)
    strength: float = 16.0       # pseudo-steps per width: about one call's worth
    groups: int = 1              # kinds of step (e.g. with and without a draft chain), each W / groups widths
    flat: int = 0                # group bits whose part costs one constant at every width
    decay: float = 0.9
    outlier: float = 1.25
    gram: np.ndarray = dataclasses.field(init=False)
    moment: np.ndarray = dataclasses.field(init=False)
    warm: bool = False
    timed: np.ndarray = dataclasses.field(init=False)  # decayed seconds, and the prior's steps
    basis: np.ndarray = dataclasses.field(init=False)  # [kinds, parameters]: a kind's cost, a sum of parameters
    start: np.ndarray = dataclasses.field(init=False)  # the prior, in parameters

    def __post_init__(self) -> None:
        widths = len(self.prior) // self.groups
        prior = self.prior.reshape(self.groups, widths)
        bits = [1 << b for b in range(self.groups.bit_length()) if self.flat >> b & 1]
        base = [g for g in range(self.groups) if not g & self.flat]  # groups fitted per width
        self.basis = np.zeros((len(self.prior), len(base) * widths + len(bits)))
        for g in range(self.groups):
            row = g * widths + np.arange(widths)
            self.basis[row, base.index(g & ~self.flat) * widths + np.arange(widths)] = 1.0
            for j, bit in enumerate(bits):
                self.basis[row, len(base) * widths + j] = float(g & bit > 0)
        self.start = np.concatenate([prior[base].reshape(-1)] + [[np.mean(prior[bit] - prior[0])] for bit in bits])
        n = self.basis.shape[1]
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
        steps = counts @ self.basis  # steps paying each parameter
        self.gram = self.decay * self.gram + np.outer(steps, steps)
        self.moment = self.decay * self.moment + steps * seconds

    def _per_step(self) -> np.ndarray:
        """Fitted seconds per step of each kind (after a timed call)."""
        scale = self.timed[0] / max(self.timed[1], 1e-9)
        gram = self.gram + self.strength * np.eye(len(self.start))
        fitted = np.linalg.solve(gram, self.moment + self.strength * self.start * scale)
        return self.basis @ np.maximum(fitted, 1e-9)

    def ratios(self) -> np.ndarray:
        """Fitted t(T)/t(1) per width, at least 1 and not falling with T within each group
        (the prior before any timing)."""
        if self.timed[0] == 0:
            return self.prior
        per_step = self._per_step()
        grouped = np.maximum(per_step / per_step[0], 1.0).reshape(self.groups, -1)
        return np.maximum.accumulate(grouped, axis=1).reshape(-1)
