"""`Adaptive`: speculation over several proposers, the choice left to the engine.

`Adaptive(NgramProposer(...), DraftProposer(...), DFlashProposer(...))` (at most one of
each kind) declares which proposers a generation may draft with; `specjax.Engine` runs them
all inside its device round and chooses, per row and round, the proposer and the number of
drafts with the best expected committed tokens per second (`specjax.rounds`). The choice
is a function of committed tokens and past acceptance only, so the output stays exact.

What k means: a proposer given alone to `generate` drafts exactly k tokens a step (fewer
only where it has no more, e.g. the context ends); inside `Adaptive` its k is the most the
engine may choose, any number from 0 to k per row and round. So prompt lookup with k chosen
per step is `Adaptive(NgramProposer(k=15))` (what the deprecated `LookupProposer()` made).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from .errors import is_integer
from .proposers import DFlashProposer, DraftProposer, NgramProposer, ProposerError


@dataclasses.dataclass(frozen=True, eq=False)
class Adaptive:
    """The proposers the engine chooses among, each one's k the most it may be asked for
    (module docstring)."""

    proposers: tuple

    def __init__(self, *proposers: Any):
        if not proposers:
            raise ProposerError("Adaptive needs at least one proposer")
        kinds = (NgramProposer, DraftProposer, DFlashProposer)
        for p in proposers:
            if not isinstance(p, kinds):
                raise ProposerError(f"Adaptive chooses among proposers (NgramProposer, DraftProposer, "
                                    f"DFlashProposer), got {type(p).__name__}")
        for kind in kinds:
            if sum(isinstance(p, kind) for p in proposers) > 1:
                raise ProposerError(f"Adaptive takes at most one {kind.__name__} (the engine drafts by one n-gram "
                                    "lookup, one draft model and one DFlash drafter)")
        models = [p for p in proposers if isinstance(p, (DraftProposer, DFlashProposer))]
        if len({p.sample for p in models}) > 1:
            raise ProposerError("the DraftProposer and the DFlashProposer must agree on sample (the engine samples "
                                "every model's drafts for sampled rows, or none)")
        object.__setattr__(self, "proposers", tuple(proposers))


def LookupProposer(k: int = 15, max_ngram: int = 3, min_ngram: int = 1, steps: int = 16) -> Adaptive:
    """Deprecated (removed in the next release): prompt lookup with k chosen per step, which
    is `Adaptive(NgramProposer(k, max_ngram, min_ngram))`; this returns exactly that.

    `steps` (rounds per device call) is checked but no longer applies: the engine runs its
    own (16, `Engine(rounds=)`); the output does not depend on it.
    """
    warnings.warn("LookupProposer is deprecated; use Adaptive(NgramProposer(k=...)) (the engine chooses each "
                  "step's k up to k) or NgramProposer(k=...) alone (k drafts every step)", DeprecationWarning,
                  stacklevel=2)
    if not is_integer(steps) or steps < 1:
        raise ProposerError(f"steps must be an integer >= 1, got {steps!r}")
    return Adaptive(NgramProposer(k, max_ngram, min_ngram))
