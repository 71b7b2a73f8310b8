"""Proposers: cheap guesses of the next k tokens behind one small interface.

A proposer is a reusable description (k, options); `start` binds it to one generation and
returns a session that `generate` drives:

    session.propose(history, limit) -> Proposal   drafts for the tokens after history[-1]
    session.observe(accepted, history)             what the target kept (history updated)

A session that needs target hidden states (DFlash) sets `taps` (layer ids); the loop then
calls `session.extend(features [n, T, D], count)` with the taps of every chunk or verify
step the target cached, of which the first `count` rows are committed tokens.

`history` is a NumPy int32 array of every committed token (prompt and output); its last
entry is the one the next verify step feeds.

On their own, NgramProposer and DraftProposer run on the batched engine
(`specjax.engine`), which drafts on the device; these sessions serve `Adaptive`'s host-side
choice (with DFlash, which has not joined the engine's round yet).

A session with ``free = True`` is deterministic and costs nothing to ask (prompt lookup):
`Adaptive` asks it every step and scores its drafts against the tokens committed later,
so it learns that proposer's acceptance without verifying anything. Other proposers may
tell `Adaptive` their cost before it is timed: `cost_prior(target)` -> (cost relative to a
target decode step, whether that is per draft).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from . import dflash as dflashlib
from . import kv as kvlib
from . import steps
from .checkpoint import weight_bytes
from .model import Model
from .qwen3 import head_weight
from .sampling import Sampling


class ProposerError(ValueError):
    """A proposer that cannot serve this target or these settings."""


@dataclasses.dataclass
class Proposal:
    drafts: Any                # [k] int32 (NumPy or device array); first n real
    n: int                     # real drafts (0 means: plain decode step)
    logq: Any = None           # [k, V] draft log-probs when drafts were sampled
    match: int = 0             # how strong the evidence is (prompt lookup: n-gram length matched)
    plain: int = 1             # when n == 0: plain steps to take before asking again


class Session(Protocol):
    def propose(self, history: np.ndarray, limit: int) -> Proposal: ...
    def observe(self, accepted: int, history: np.ndarray) -> None: ...


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check_k(k: int, largest: int) -> None:
    if not _is_int(k) or not 1 <= k <= largest:
        raise ProposerError(f"k must be an integer in [1, {largest}], got {k!r}")


def check_ngram(max_ngram: int, min_ngram: int, largest: int | None = None) -> None:
    """1 <= min_ngram <= max_ngram (<= largest, where the lookup unrolls one compare per n)."""
    if not (_is_int(max_ngram) and _is_int(min_ngram)) or not 1 <= min_ngram <= max_ngram:
        raise ProposerError(f"need integers 1 <= min_ngram <= max_ngram, got {min_ngram!r}, {max_ngram!r}")
    if largest is not None and max_ngram > largest:
        raise ProposerError(f"max_ngram must be at most {largest} for the on-device lookup, got {max_ngram}")


def ngram_lookup(history: np.ndarray, k: int, max_ngram: int, min_ngram: int) -> tuple[np.ndarray, int]:
    """Prompt lookup: the tokens after the latest earlier occurrence of the last n tokens.

    Tries n = max_ngram down to min_ngram; returns up to k tokens and the n matched
    (empty and 0 if no match).
    """
    size = len(history)
    # candidate starts: earlier positions whose token equals the last one (a continuation
    # needs i + 1 < size), checked backwards for the longest n; one vector compare per n
    ends = np.flatnonzero(history[:size - 1] == history[size - 1])
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        cand = ends[ends >= n - 1]
        ok = np.ones(len(cand), bool)
        for back in range(1, n):
            ok &= history[cand - back] == history[size - 1 - back]
        if ok.any():
            start = cand[ok][-1] + 1
            return history[start:start + k], n
    return history[:0], 0


@dataclasses.dataclass(frozen=True)
class NgramProposer:
    """Prompt-lookup drafts (n-gram match against the committed context); free to run."""

    k: int = 4
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        check_k(self.k, steps.BUCKETS[-1] - 1)
        check_ngram(self.max_ngram, self.min_ngram)

    def start(self, target: Model, prompt: np.ndarray, capacity: int, seed: int, sampling: Sampling) -> Session:
        return _NgramSession(self)


@dataclasses.dataclass
class _NgramSession:
    spec: NgramProposer
    free = True

    def propose(self, history: np.ndarray, limit: int) -> Proposal:
        s = self.spec
        found, n = ngram_lookup(history, min(s.k, limit), s.max_ngram, s.min_ngram)
        return Proposal(found.astype(np.int32), len(found), match=n if len(found) else 0)

    def observe(self, accepted: int, history: np.ndarray) -> None:
        pass


@dataclasses.dataclass(frozen=True, eq=False)
class DraftProposer:
    """A smaller Qwen3 with the target's vocabulary proposes k tokens, chained on the device.

    With sample=True (and non-greedy sampling) drafts are sampled from the draft's own
    transformed distribution q and verified by the general acceptance rule; otherwise
    drafts are the draft model's greedy tokens (a deterministic proposer).
    """

    model: Model
    k: int = 4
    sample: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model, Model):
            raise ProposerError(f"DraftProposer needs a loaded model (specjax.load(folder)), "
                                f"got {type(self.model).__name__}")
        check_k(self.k, steps.BUCKETS[-1] - 1)

    def cost_prior(self, target: Model) -> tuple[float, bool]:
        """Each draft is a decode step of the draft model: its weight bytes over the target's."""
        return weight_bytes(self.model.params) / weight_bytes(target.params), True

    def start(self, target: Model, prompt: np.ndarray, capacity: int, seed: int, sampling: Sampling) -> Session:
        if self.model.config.vocab_size != target.config.vocab_size:
            where = f" ({self.model.path})" if self.model.path else ""
            raise ProposerError(
                f"draft model{where} has vocab_size {self.model.config.vocab_size}, "
                f"target has {target.config.vocab_size}: they must share a vocabulary")
        return _DraftSession(self, capacity, seed, sampling)


class _DraftSession:
    """Draft cache convention: holds `length` committed tokens; the rest are fed next call.

    Normally the rest is the newest token, or two when all k drafts were accepted (d_k was
    never fed). A session skipped for some steps (adaptive k chose another proposer) first
    appends the tokens it missed with the chunked prefill.
    """

    def __init__(self, spec: DraftProposer, capacity: int, seed: int, sampling: Sampling):
        m = spec.model
        self.spec, self.seed, self.sampling = spec, jnp.uint32(seed), sampling
        self.sample = spec.sample and not sampling.greedy
        self.kv = kvlib.init(m.config, 1, capacity, m.dtype)
        self.length = 0  # committed tokens whose K/V are valid in the draft cache
        self.fed = self.k = 0  # tokens fed and drafts made by the last proposal

    def propose(self, history: np.ndarray, limit: int) -> Proposal:
        from .loop import run_prefill

        m = self.spec.model
        if len(history) - self.length > 2:  # catch up on tokens this cache never saw
            behind = history[self.length:len(history) - 2]
            _, self.kv, _ = run_prefill(m, self.kv.replace(lengths=jnp.array([self.length], jnp.int32)),
                                        behind, self.seed, Sampling())
            self.length += len(behind)
        feed = history[self.length:]
        self.k = steps.draft_length(limit, self.spec.k)
        padded = np.zeros(2, np.int32)
        padded[:len(feed)] = feed
        drafts, logq, self.kv = steps.draft(
            m.params, m.config, self.kv, jnp.asarray(padded), jnp.int32(len(feed)), jnp.int32(self.length),
            self.seed, k=self.k, sampling=self.sampling, sample=self.sample)
        self.fed = len(feed)
        return Proposal(drafts, min(self.k, limit), logq)

    def observe(self, accepted: int, history: np.ndarray) -> None:
        # K/V written: the fed tokens and d_1 .. d_{k-1}; the committed ones among them are
        # the fed tokens plus the accepted drafts, except d_k (never fed).
        self.length += self.fed + min(accepted, self.k - 1)


@dataclasses.dataclass(frozen=True, eq=False)
class DFlashProposer:
    """A DFlash drafter proposes k tokens in one bidirectional pass over [last, mask x (B-1)].

    k defaults to the largest the drafter and the verify buckets allow, min(B - 1, 15).
    With sample=True (and non-greedy sampling) each draft is drawn independently from its
    own row's transformed q. Known weakness (dflash.md section 4, z-lab PR #169): rows are
    not conditioned on each other's samples, so sampled blocks are less coherent and are
    accepted less often than argmax drafts, which stay exact through sample-and-match.
    """

    drafter: dflashlib.Drafter
    k: int | None = None
    sample: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.drafter, dflashlib.Drafter):
            raise ProposerError(f"DFlashProposer needs a drafter (specjax.load_dflash(folder, target)), "
                                f"got {type(self.drafter).__name__}")
        largest = min(self.drafter.cfg.block_size - 1, steps.BUCKETS[-1] - 1)
        if self.k is None:
            object.__setattr__(self, "k", largest)
        check_k(self.k, steps.BUCKETS[-1] - 1)
        if self.k > self.drafter.cfg.block_size - 1:
            where = f" ({self.drafter.path})" if self.drafter.path else ""
            raise ProposerError(f"k={self.k} exceeds block_size - 1 = {self.drafter.cfg.block_size - 1} "
                                f"of the DFlash drafter{where}")

    def cost_prior(self, target: Model) -> tuple[float, bool]:
        """One pass of B rows through the drafter and the target's head, whatever k: its
        weight bytes over the target's, times the prior cost of B rows against one."""
        from .adaptive import prior_verify_ratio

        head = head_weight(target.params, target.config).nbytes
        ratio = (weight_bytes(self.drafter.params) + head) / weight_bytes(target.params)
        return ratio * prior_verify_ratio()[steps.bucket(self.drafter.cfg.block_size)], False

    def start(self, target: Model, prompt: np.ndarray, capacity: int, seed: int, sampling: Sampling) -> Session:
        problems = dflashlib.fit_problems(self.drafter.cfg, target.config)
        if problems:
            where = f" ({self.drafter.path})" if self.drafter.path else ""
            raise ProposerError(f"DFlash drafter{where} does not fit the target: " + "; ".join(problems))
        return _DFlashSession(self, target, capacity, seed, sampling)


CATCH_UP_WIDTHS = (16, 128)  # compiled widths of the DFlash context catch-up


class _DFlashSession:
    """Context cache convention: rows for every committed token but the newest (as the target's).

    Taps are stashed as they arrive and turned into context rows only when a block is
    drafted, so a session that `Adaptive` leaves idle costs one small copy per step.
    """

    def __init__(self, spec: DFlashProposer, target: Model, capacity: int, seed: int, sampling: Sampling):
        d = spec.drafter
        self.spec, self.target, self.seed = spec, target, jnp.uint32(seed)
        # drafts are sampled from this distribution, or None: argmax (compiled once for any sampling)
        self.draft_sampling = sampling if spec.sample and not sampling.greedy else None
        self.taps = d.cfg.target_layer_ids
        self.cache = dflashlib.init_cache(d.cfg, capacity, d.dtype)
        self.stash = dflashlib.init_stash(d.cfg, capacity, target.dtype)
        self.length = 0  # context rows in the cache (host copy of cache.length)
        self.rows = 0    # committed rows stashed (the cache catches up to it before drafting)

    def extend(self, features: jax.Array, count: int) -> None:
        """Stash the first `count` rows of target taps [n, T, D] (device work, no host wait)."""
        self.stash = dflashlib.stash_features(self.stash, features, np.int32(self.rows))
        self.rows += count

    def _catch_up(self) -> None:
        d = self.spec.drafter
        while self.length < self.rows:
            n = min(self.rows - self.length, CATCH_UP_WIDTHS[-1])
            width = steps.bucket(n, CATCH_UP_WIDTHS)
            self.cache = dflashlib.append_stashed(d.params, d.cfg, self.cache, self.stash, np.int32(n), width)
            self.length += n

    def propose(self, history: np.ndarray, limit: int) -> Proposal:
        if len(history) - 1 != self.rows:  # cannot happen in the loop; guards a misuse of the session
            raise ProposerError(f"DFlash context holds {self.rows} rows but {len(history) - 1} tokens "
                                "are committed before the last one; extend() was not called with every step")
        self._catch_up()
        d = self.spec.drafter
        # always the full k (one compiled shape: the pass costs the same for any k, and a
        # new k mid-run would compile); rows past `limit` are never judged
        drafts, logq = dflashlib.draft_tokens(
            d.params, d.cfg, self.cache, self.target.params, self.target.config, np.int32(history[-1]),
            np.int32(self.length), self.seed, k=self.spec.k, sampling=self.draft_sampling)
        return Proposal(drafts, min(self.spec.k, limit), logq)

    def observe(self, accepted: int, history: np.ndarray) -> None:
        """Nothing to do: the committed context arrives through extend()."""
