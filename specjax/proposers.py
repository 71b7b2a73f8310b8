"""Proposers: the settings of each way specjax drafts (k, sampling, the drafting model).

Each is a frozen description, validated when made; `specjax.generate` runs it on
`specjax.Engine`, which drafts inside its compiled round (`specjax.rounds`,
`specjax.drafters`): `NgramProposer` prompt lookup, `DraftProposer` a smaller model of
the target's vocabulary, `DFlashProposer` a DFlash drafter. Each drafts exactly k tokens a
step on its own; inside `Adaptive` (`specjax.adaptive`) k is the most the engine may choose
per step. `from_vllm` reads vLLM's names for prompt lookup.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import dflash as dflashlib
from . import steps
from .model import Model
from .errors import SpecjaxError, is_integer
from .lookup import MAX_NGRAM


class ProposerError(SpecjaxError):
    """A proposer that cannot serve this target or these settings."""


def check_k(k: int, largest: int) -> None:
    if not is_integer(k) or not 1 <= k <= largest:
        raise ProposerError(f"k must be an integer in [1, {largest}], got {k!r}")


def check_ngram(max_ngram: int, min_ngram: int, largest: int | None = None) -> None:
    """1 <= min_ngram <= max_ngram (<= largest, where the lookup unrolls one compare per n)."""
    if not (is_integer(max_ngram) and is_integer(min_ngram)) or not 1 <= min_ngram <= max_ngram:
        raise ProposerError(f"need integers 1 <= min_ngram <= max_ngram, got {min_ngram!r}, {max_ngram!r}")
    if largest is not None and max_ngram > largest:
        raise ProposerError(f"max_ngram must be at most {largest} for the on-device lookup, got {max_ngram}")


def check_tree(tree: int | str, largest: int = steps.BUCKETS[-1] - 1) -> None:
    """tree: nodes of a draft tree in [0, largest] (0: chains), or "auto" (trees of up to
    `steps.BUCKETS[-1] - 1` nodes where they pay, chosen per row and round)."""
    if tree != "auto" and (not is_integer(tree) or not 0 <= tree <= largest):
        raise ProposerError(f"tree must be an integer in [0, {largest}] (nodes of a draft tree; 0: chains) or "
                            f"'auto', got {tree!r}")


@dataclasses.dataclass(frozen=True)
class NgramProposer:
    """Prompt lookup (vLLM's "ngram" method, transformers' prompt_lookup_num_tokens): the
    drafts are the tokens after the latest earlier occurrence of the longest suffix
    (max_ngram .. min_ngram tokens) of the committed context.

    k: alone, the drafts of every step (fewer only where the match has fewer tokens after
    it); inside `Adaptive`, the most the engine may choose per step. max_ngram is at most
    32 (the on-device search unrolls one compare per length; checked when generation starts).
    vLLM's names for these are num_speculative_tokens, prompt_lookup_max, prompt_lookup_min
    (`from_vllm`). tree > 0: a tree of up to that many nodes (at most as many as the chain
    would have drafts) where earlier matches continue differently (`specjax.lookup.tree`),
    verified in one step; 0: chains; "auto": the tree or the chain each round, whichever
    has held more (`specjax.Speculation`).
    """

    k: int = 4
    max_ngram: int = 3
    min_ngram: int = 1
    tree: int | str = 0

    def __post_init__(self) -> None:
        check_k(self.k, steps.BUCKETS[-1] - 1)
        check_ngram(self.max_ngram, self.min_ngram)  # the engine's Speculation bounds max_ngram
        check_tree(self.tree)


@dataclasses.dataclass(frozen=True, eq=False)
class DraftProposer:
    """A smaller Qwen3 with the target's vocabulary proposes k tokens, chained on the device
    (inside `Adaptive`: at most k).

    With sample=True (and non-greedy sampling) drafts are sampled from the draft's own
    transformed distribution q and verified by the general acceptance rule; otherwise
    drafts are the draft model's greedy tokens (a deterministic proposer). The engine
    checks that the vocabularies match.

    tree > 0: greedy drafts form a tree of up to that many nodes (at most as many as the
    chain would have drafts) instead of a chain, verified in one step: the draft model's
    best nodes by cumulative log-probability (EAGLE-2, `specjax.drafters.draft_tree`:
    each depth one draft step over a frontier of the min(4, tree) best nodes, each
    expanded by its top tokens, then the best `tree` of all nodes kept), so where the
    draft is unsure the tree holds its runners-up. Output is still exactly plain
    decoding's (greedy and sampled targets: the drafts are deterministic). Sampled drafts
    (sample=True) form a tree of fixed shape instead: the chain's own draws plus second
    children drawn without replacement from the q of the chain's steps
    (`specjax.drafters.draft_sampled_tree`), accepted by recursive rejection sampling
    (`specjax.tree_accept`), so the output follows the target's distribution. 0: chains;
    "auto": the tree or the chain each round, whichever has held more
    (`specjax.Speculation`; sampled drafts then stay chains).
    """

    model: Model
    k: int = 4
    sample: bool = False
    tree: int | str = 0

    def __post_init__(self) -> None:
        if not isinstance(self.model, Model):
            raise ProposerError(f"DraftProposer needs a loaded model (specjax.load(folder)), "
                                f"got {type(self.model).__name__}")
        check_k(self.k, steps.BUCKETS[-1] - 1)
        check_tree(self.tree)


@dataclasses.dataclass(frozen=True, eq=False)
class DFlashProposer:
    """A DFlash drafter proposes k tokens in one bidirectional pass over [last, mask x (B-1)]
    (inside `Adaptive`: at most k).

    k defaults to the largest the drafter and the verify buckets allow, min(B - 1, 15).
    With sample=True (and non-greedy sampling) each draft is drawn independently from its
    own row's transformed q. Known weakness (z-lab/dflash pull request #169): rows are
    not conditioned on each other's samples, so sampled blocks are less coherent and are
    accepted less often than argmax drafts, which stay exact through sample-and-match.
    The engine checks that the drafter fits the target. tree > 0: a tree of up to that
    many nodes instead of a chain: the block's best tree (DDTree,
    `specjax.drafters.block_tree`; through a Markov head, whose rows condition on the
    token before, `specjax.drafters.markov_tree`) for argmax drafts; for sampled drafts the chain plus
    second children drawn without replacement from the same block rows
    (`specjax.drafters.sampled_tree`), accepted by recursive rejection sampling
    (`specjax.tree_accept`), so the output still follows the target's distribution;
    0: chains; "auto": the tree or the chain each round, whichever has held more
    (`specjax.Speculation`; sampled drafts then stay chains).
    """

    drafter: dflashlib.Drafter
    k: int | None = None
    sample: bool = False
    tree: int | str = 0

    def __post_init__(self) -> None:
        if not isinstance(self.drafter, dflashlib.Drafter):
            raise ProposerError(f"DFlashProposer needs a drafter (specjax.load_dflash(folder, target)), "
                                f"got {type(self.drafter).__name__}")
        # what load_dflash checks of a folder, for a drafter built or changed in memory
        d = self.drafter
        where = str(d.path) if d.path else "the DFlash drafter"
        if d.vocab is not None:
            dflashlib.check_vocab(d.vocab, d.config.vocab_size, f"{where}: its draft vocabulary (Drafter.vocab)")
        if dflashlib.MARKOV in d.params:
            dflashlib.check_markov(d.params[dflashlib.MARKOV], d.config.vocab_size,
                                   f"{where}: its Markov head (params[{dflashlib.MARKOV!r}])")
        largest = min(self.drafter.config.block_size - 1, steps.BUCKETS[-1] - 1)
        if self.k is None:
            object.__setattr__(self, "k", largest)
        check_k(self.k, steps.BUCKETS[-1] - 1)
        check_tree(self.tree)
        if self.k > self.drafter.config.block_size - 1:
            where = f" ({self.drafter.path})" if self.drafter.path else ""
            raise ProposerError(f"k={self.k} exceeds block_size - 1 = {self.drafter.config.block_size - 1} "
                                f"of the DFlash drafter{where}")


VLLM_NGRAM_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


def from_vllm(config: dict[str, Any]) -> NgramProposer:
    """The NgramProposer of a vLLM `speculative_config` for prompt lookup: {"method": "ngram",
    "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}.

    As in vLLM, where one n-gram bound is given the other takes its value; with neither,
    NgramProposer's (3 and 1). Other methods and keys, and values the engine cannot run
    (prompt_lookup_max above specjax.lookup.MAX_NGRAM included), are a ProposerError
    naming them by vLLM's names.
    """
    if not isinstance(config, dict):
        raise ProposerError(f"a vLLM speculative_config is a dict, got {type(config).__name__}")
    unknown = sorted(set(config) - set(VLLM_NGRAM_KEYS))
    if unknown:
        raise ProposerError(f"speculative_config keys {unknown} are not supported (only {list(VLLM_NGRAM_KEYS)}; "
                            "pass a DraftProposer or DFlashProposer for model drafts)")
    if config.get("method", "ngram") != "ngram":
        raise ProposerError(f"speculative_config method {config['method']!r} is not supported here (only 'ngram')")
    if config.get("num_speculative_tokens") is None:
        raise ProposerError("speculative_config needs num_speculative_tokens (the drafts per step)")
    k, hi, lo = config["num_speculative_tokens"], config.get("prompt_lookup_max"), config.get("prompt_lookup_min")
    if hi is None and lo is None:
        hi, lo = NgramProposer.max_ngram, NgramProposer.min_ngram
    hi, lo = hi if hi is not None else lo, lo if lo is not None else hi
    largest = steps.BUCKETS[-1] - 1
    if not is_integer(k) or not 1 <= k <= largest:
        raise ProposerError(f"speculative_config num_speculative_tokens must be an integer in [1, {largest}], "
                            f"got {k!r}")
    if not (is_integer(hi) and is_integer(lo)) or not 1 <= lo <= hi <= MAX_NGRAM:
        raise ProposerError(f"speculative_config needs integers 1 <= prompt_lookup_min <= prompt_lookup_max <= "
                            f"{MAX_NGRAM}, got prompt_lookup_min {lo!r}, prompt_lookup_max {hi!r}")
    return NgramProposer(k, hi, lo)
