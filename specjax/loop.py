"""`specjax.generate`: one prompt, or a list of prompts, on `specjax.Engine`.

One prompt runs on an engine of one row, a list of prompts on one engine with a row per
prompt (`engine.generate_one`, `engine.generate_batch`); every proposer runs inside the
engine's compiled round (`specjax.rounds`), a Python one (`HostDrafter`) as the request's
drafter.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import engine
from .model import Model
from .results import GenerateResult, GenerationError, token_ids, validate
from .sampling import Sampling


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
    max_new_tokens, sampling, stop_ids and seed may be a list with one value per prompt).
    speculative: None, LookupProposer (k chosen per step), NgramProposer, DraftProposer or
    DFlashProposer (their fixed k), Adaptive (the engine's per-step choice among at most one
    of each), a `Speculation`, or a `HostDrafter` (any object with propose(history, limit):
    its drafts, up to 15 a step).

    With `speculative` the output is the same as without it: token for token for greedy
    decoding and deterministic proposers (bitwise-equal steps: float32 on CPU; see the
    README), in distribution for sampled drafts.
    `capacity` (one prompt) bounds the tokens its row holds; `on_tokens` receives each
    step's newly committed tokens (for streaming).
    """
    if is_batch(ids):
        if capacity is not None or on_tokens is not None:
            raise GenerationError("capacity and on_tokens apply to one prompt; a batch sizes its own pool "
                                  "(use specjax.Engine to stream a batch)")
        return engine.generate_batch(model, ids, max_new_tokens=max_new_tokens, sampling=sampling,
                                     stop_ids=stop_ids, seed=seed, speculative=speculative)
    ids = token_ids(ids)
    capacity = validate(model, ids, max_new_tokens, capacity, seed)
    if not isinstance(sampling, Sampling):
        raise GenerationError(f"sampling must be a specjax.Sampling, got {type(sampling).__name__}")
    return engine.generate_one(model, ids, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                               seed=seed, speculative=speculative, on_tokens=on_tokens,
                               max_len=min(capacity, model.config.max_position_embeddings))
