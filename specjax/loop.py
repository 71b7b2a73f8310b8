"""`specjax.generate`: one prompt, or a list of prompts, on `specjax.Engine`.

One prompt runs on an engine of one row, a list of prompts on one engine with a row per
prompt (`engine.generate_one`, `engine.generate_batch`); every proposer runs inside the
engine's compiled round (`specjax.rounds`), a Python one (`HostDrafter`) as the request's
drafter.

vLLM's and transformers' names are accepted, with their meaning: `stop_token_ids` (stop
ids besides the eos ids, where stop_ids replaces them), and prompt lookup by
`num_speculative_tokens` (with `prompt_lookup_min` / `prompt_lookup_max`) or a vLLM
`speculative_config` dict as `speculative`. With no `sampling`, the model folder's
generation_config.json decides, as in transformers and vLLM (`Model.generation_defaults`).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import engine
from .model import Model
from .proposers import from_vllm
from .results import GenerateResult, GenerationError, is_id_list, token_ids, validate
from .sampling import Sampling


def is_batch(ids: Any) -> bool:
    """A list of prompts (each a list or array of ids) or a 2-D array, not one prompt."""
    if isinstance(ids, np.ndarray):
        return ids.ndim == 2
    return isinstance(ids, (list, tuple)) and len(ids) > 0 and all(
        isinstance(p, (list, tuple, np.ndarray)) for p in ids)


def _speculative(speculative: Any, num_speculative_tokens: int | None, prompt_lookup_min: int | None,
                 prompt_lookup_max: int | None) -> Any:
    """The proposer `generate` runs: `speculative` as given, a vLLM speculative_config dict
    read by `proposers.from_vllm`, or prompt lookup from vLLM's keyword names."""
    named = {"num_speculative_tokens": num_speculative_tokens, "prompt_lookup_min": prompt_lookup_min,
             "prompt_lookup_max": prompt_lookup_max}
    given = {key: value for key, value in named.items() if value is not None}
    if given:
        if speculative is not None:
            raise GenerationError(f"give speculative= or {sorted(given)}, not both")
        return from_vllm({"method": "ngram", **given})
    return from_vllm(speculative) if isinstance(speculative, dict) else speculative


def generate(model: Model, ids: Any, *, max_new_tokens: Any, sampling: Any = None,
             stop_ids: Any = None, seed: Any = 0, speculative: Any = None,
             capacity: int | None = None, on_tokens: Callable[[list[int]], None] | None = None,
             stop_token_ids: Any = None, num_speculative_tokens: int | None = None,
             prompt_lookup_min: int | None = None, prompt_lookup_max: int | None = None
             ) -> GenerateResult | list[GenerateResult]:
    """Generate up to max_new_tokens after `ids`; stops after emitting any id in stop_ids
    (default: the model's eos ids, as transformers' generate; `()` never stops early).

    `ids` is one prompt (a list of token ids: returns one `GenerateResult`) or a list of
    prompts (returns a list, one per prompt, run together by `specjax.Engine`; then each of
    max_new_tokens, sampling, stop_ids and seed may be a list with one value per prompt).
    speculative: None, NgramProposer, DraftProposer or DFlashProposer (k drafts every step),
    Adaptive (the engine's per-step choice among at most one of each, each up to its k; e.g.
    `Adaptive(NgramProposer(k=15))`, prompt lookup with k chosen per step), a `Speculation`,
    or a `HostDrafter` (any object with propose(history, limit): its drafts, up to 15 a step).

    With `speculative` the output is the same as without it: token for token for greedy
    decoding and deterministic proposers (bitwise-equal steps: float32 on CPU; see the
    README), in distribution for sampled drafts.
    `capacity` (one prompt) bounds the tokens its row holds; `on_tokens` receives each
    step's newly committed tokens (for streaming).

    sampling: a `Sampling` (or, for a list of prompts, a list of them); None takes the model
    folder's generation_config.json (`model.generation_defaults`; greedy without one, or with
    do_sample false or absent). stop_token_ids (vLLM's name) stop generation besides the
    eos ids, as in vLLM (stop_ids replaces them).
    num_speculative_tokens=k (vLLM's name; with prompt_lookup_min / prompt_lookup_max) is
    prompt lookup of k drafts a step, `NgramProposer(k, max, min)`, as is a vLLM
    speculative_config dict `{"method": "ngram", "num_speculative_tokens": k, ...}` given
    as `speculative`.
    """
    if stop_token_ids is not None:
        if stop_ids is not None:
            raise GenerationError("give stop_ids (every stop id: the eos ids by default) or stop_token_ids "
                                  "(added to the eos ids, as vLLM's), not both")
        stop_ids = _with_eos(model, stop_token_ids)
    speculative = _speculative(speculative, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)
    if sampling is None:
        sampling = model.generation_defaults or Sampling()
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


def _with_eos(model: Model, extra: Any) -> list[int] | list[list[int]]:
    """vLLM's stop_token_ids as stop_ids: the model's eos ids and `extra` (one list of ids,
    or for a batch one list per prompt)."""
    if is_id_list(extra):
        return sorted({*model.eos_ids, *extra})
    if isinstance(extra, (list, tuple)) and extra and all(is_id_list(e) for e in extra):
        return [sorted({*model.eos_ids, *e}) for e in extra]
    raise GenerationError(f"stop_token_ids must be a list of integer token ids (for a batch, one such list per "
                          f"prompt), got {extra!r:.80}")
