"""`Adaptive`: speculation over several proposers, the choice left to the engine.

`Adaptive(NgramProposer(...), DraftProposer(...), DFlashProposer(...))` (at most one of
each kind) declares which proposers a generation may draft with; `specjax.Engine` runs them
all inside its device round and chooses, per row and round, the proposer and the number of
drafts with the best expected committed tokens per second (`specjax.rounds`). Each
proposer's own k is the most it is asked for. The choice is a function of committed tokens
and past acceptance only, so the output stays exact.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .proposers import DFlashProposer, DraftProposer, NgramProposer, ProposerError


@dataclasses.dataclass(frozen=True, eq=False)
class Adaptive:
    """The proposers the engine chooses among (module docstring)."""

    proposers: tuple

    def __init__(self, *proposers: Any):
        if not proposers:
            raise ProposerError("Adaptive needs at least one proposer")
        from .lookup import LookupProposer

        if any(isinstance(p, LookupProposer) for p in proposers):
            raise ProposerError("LookupProposer runs on the batched engine, with k chosen there, and cannot be "
                                "wrapped by Adaptive; give Adaptive an NgramProposer, or pass LookupProposer to "
                                "generate()")
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
