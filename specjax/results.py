"""What generation returns (tokens, statistics) and the checks of its arguments."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from . import steps
from .config import Qwen3Config
from .model import Model
from .errors import SpecjaxError, is_integer

# Widths a prompt's chunks are padded to (one compiled prefill each): a prompt that fits in
# one goes in the narrowest that holds it, a longer one in chunks of the widest, so a prompt
# compiles one prefill and a short one pays for its own tokens, not the widest chunk's
# (tiny-code, a 5-token prompt: 6.3 ms at width 16 against 25 ms at 128 on 2 cores).
PREFILL_CHUNKS = (16, 32, 64, 128)
PREFILL_CHUNK = PREFILL_CHUNKS[-1]
MIN_CAPACITY = 256
CAPACITY_STEP = 256


class GenerationError(SpecjaxError):
    """Bad generate() input: empty or out-of-vocabulary prompt, length beyond capacity."""


@dataclasses.dataclass
class Stats:
    """What a generation did; speculative fields stay zero for plain decoding."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0                 # verify (or decode) steps after prefill
    verify_tokens: int = 0         # tokens scored by verify steps (last + real drafts)
    drafted: int = 0               # real drafts proposed
    accepted: int = 0              # drafts accepted
    accept_hist: list[int] = dataclasses.field(default_factory=list)  # [a] steps that accepted a drafts
    reached: list[int] = dataclasses.field(default_factory=list)      # [i] steps whose draft i was judged
    accepted_at: list[int] = dataclasses.field(default_factory=list)  # [i] steps that accepted draft i
    ks: list[int] = dataclasses.field(default_factory=list)           # drafts judged per step
    accepts: list[int] = dataclasses.field(default_factory=list)      # drafts accepted per step
    choices: list = dataclasses.field(default_factory=list)           # (proposer, drafts) per step
    branched: int = 0              # steps whose accepted path left a draft tree's first continuation
    tree_steps: int = 0            # steps that verified a draft tree (the rest verified chains)
    prefill_s: float = 0.0
    propose_s: float = 0.0
    verify_s: float = 0.0
    host_s: float = 0.0

    @property
    def decode_s(self) -> float:
        return self.propose_s + self.verify_s + self.host_s

    @property
    def tokens_per_step(self) -> float:
        """Committed tokens per verify step (1.0 for plain decoding)."""
        return (self.new_tokens - 1) / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: tokens after the first over the time after prefill."""
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """P(draft i accepted | draft i was judged), i = 1 .. k."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached)]

    @property
    def verify_tokens_per_token(self) -> float:
        return self.verify_tokens / max(self.new_tokens - 1, 1)

    def record(self, n_drafts: int, accepted: int) -> None:
        grow = max(n_drafts + 1 - len(self.accept_hist), 0)
        self.accept_hist += [0] * grow
        self.reached += [0] * max(n_drafts - len(self.reached), 0)
        self.accepted_at += [0] * max(n_drafts - len(self.accepted_at), 0)
        self.accept_hist[accepted] += 1
        for i in range(min(accepted + 1, n_drafts)):
            self.reached[i] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1
        self.steps += 1
        self.verify_tokens += n_drafts + 1
        self.drafted += n_drafts
        self.accepted += accepted
        self.ks.append(n_drafts)
        self.accepts.append(accepted)

    def summary(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for per_step in ("ks", "accepts", "choices"):
            d.pop(per_step)
        d.update(decode_s=self.decode_s, tokens_per_step=self.tokens_per_step, tokens_per_s=self.tokens_per_s,
                 acceptance_by_position=self.acceptance_by_position,
                 verify_tokens_per_token=self.verify_tokens_per_token)
        return d


@dataclasses.dataclass
class GenerateResult:
    tokens: list[int]
    stats: Stats
    stopped: bool = False  # a stop id ended generation (it is the last token)


def capacity_for(total: int) -> int:
    """Static cache size for `total` tokens plus verify and prefill-padding slack.

    Rounded up to a multiple of CAPACITY_STEP: attention spans the whole capacity, so
    finer steps cost less per token; each distinct capacity compiles once (and is kept by
    the persistent compilation cache).
    """
    need = max(int(total) + steps.BUCKETS[-1] + PREFILL_CHUNK, MIN_CAPACITY)  # int: a NumPy total too
    return -(-need // CAPACITY_STEP) * CAPACITY_STEP


def token_ids(ids: Any) -> np.ndarray:
    """The prompt as int64 ids; text or non-integer values are refused, never cast."""
    if isinstance(ids, (str, bytes)):
        raise GenerationError("prompt must be token ids, got text; tokenize it first "
                              "(e.g. model.tokenizer(text)['input_ids'])")
    try:
        arr = np.asarray(ids)
    except ValueError:  # ragged: ids mixed with lists or strings
        arr = None
    if arr is None or arr.dtype == object:
        raise GenerationError(f"prompt must be token ids (a list of integers) or, for a batch, a list of such "
                              f"lists; got {ids!r:.80}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise GenerationError(f"prompt token ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64)


def is_id_list(value: Any) -> bool:
    """A list, tuple, set or 1-D array of integer token ids (one id alone is not one)."""
    if isinstance(value, np.ndarray):
        return value.ndim == 1 and (value.size == 0 or np.issubdtype(value.dtype, np.integer))
    return isinstance(value, (list, tuple, set, frozenset)) and all(is_integer(s) for s in value)


def stop_set(stop_ids: Any) -> frozenset[int]:
    """A request's stop ids as the set its row stops at; anything but a collection of
    integer ids (`is_id_list`) in [0, 2**31) (the engine holds them as int32; an id past the
    vocabulary is allowed and never met) is a GenerationError."""
    if not is_id_list(stop_ids):
        raise GenerationError(f"stop_ids must be a list of integer token ids (() never stops early), got "
                              f"{stop_ids!r:.80}")
    stops = frozenset(int(s) for s in stop_ids)
    if stops and not (min(stops) >= 0 and max(stops) < 2 ** 31):
        raise GenerationError(f"stop_ids must be token ids in [0, 2**31), got {sorted(stops)!r:.80}")
    return stops


def check_prompt(config: Qwen3Config, ids: np.ndarray, max_new_tokens: int) -> None:
    """A GenerationError unless `ids` (from `token_ids`) is a prompt the model can take with
    `max_new_tokens` after it: non-empty, 1-D, in the vocabulary, within the context."""
    if ids.ndim != 1 or len(ids) == 0:
        raise GenerationError(f"prompt must be a non-empty 1-D list of token ids, got shape {ids.shape}")
    if ids.min() < 0 or ids.max() >= config.vocab_size:
        raise GenerationError(f"prompt token ids must be in [0, {config.vocab_size}), "
                              f"got min {ids.min()} max {ids.max()}")
    if not is_integer(max_new_tokens) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if len(ids) + max_new_tokens > config.max_position_embeddings:
        raise GenerationError(f"prompt ({len(ids)}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                              f"max_position_embeddings ({config.max_position_embeddings})")


def validate(model: Model, ids: np.ndarray, max_new_tokens: int, capacity: int | None, seed: int) -> int:
    """Check a request's prompt and max_new_tokens (`check_prompt`) and seed (and `capacity`,
    when given) against the model; the capacity its row needs (`capacity_for`, or the one
    given)."""
    if not is_integer(seed) or not 0 <= seed < 2 ** 32:
        raise GenerationError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    check_prompt(model.config, ids, max_new_tokens)
    total = len(ids) + max_new_tokens
    if capacity is None:
        return capacity_for(total)
    if not is_integer(capacity):
        raise GenerationError(f"capacity must be an integer, got {capacity!r}")
    need = total + steps.BUCKETS[-1]
    if capacity < need or capacity % 16:
        raise GenerationError(f"capacity {capacity} is too small (or not a multiple of 16) for a prompt of "
                              f"{len(ids)} tokens plus {max_new_tokens} new tokens (needs >= {need})")
    return int(capacity)


