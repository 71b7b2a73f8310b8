"""Qwen3 model configuration read from (and written to) a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from .errors import SpecjaxError


class ConfigError(SpecjaxError):
    """A config.json that specjax cannot run exactly."""


def read_json(path: str | Path) -> dict[str, Any]:
    """A config file's dict; a missing or malformed file is a ConfigError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e


# transformers' Qwen3Config defaults (5.x; 4.5x agree) for fields a config.json may omit.
HF_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 32, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 10_000.0,
    "tie_word_embeddings": False, "attention_bias": False, "max_position_embeddings": 32768,
}


def typed(value: Any, kind: type, key: str, source: str) -> Any:
    """A config field's value checked to be `kind` (bool is not an int; an int is a float),
    or a ConfigError naming the file and field."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ConfigError(f"{source}: field {key} must be {kind.__name__}, got {value!r}")
    return value


def parse_eos(eos: Any, source: str) -> int | tuple[int, ...] | None:
    """An eos_token_id field (int, list of ints or null) as stored on Qwen3Config; an id
    outside [0, 2**31) (which no token has, and every request would then be refused over)
    is a ConfigError naming `source`."""
    if isinstance(eos, list) and all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
        ids: int | tuple[int, ...] | None = tuple(eos)
    elif eos is None or (isinstance(eos, int) and not isinstance(eos, bool)):
        ids = eos
    else:
        raise ConfigError(f"{source}: eos_token_id must be an int, a list of ints or null, got {eos!r}")
    if any(not 0 <= e < 2**31 for e in ((ids,) if isinstance(ids, int) else ids or ())):
        raise ConfigError(f"{source}: eos_token_id must be token ids in [0, 2**31), got {eos!r}")
    return ids


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling of config.json (`rope_scaling`, or `rope_parameters` in transformers
    5), as transformers computes it (`transformers.modeling_rope_utils`): "linear" divides
    every frequency by `factor`; "yarn" (Peng et al. 2023, arXiv:2309.00071; what Qwen3's
    model cards add for contexts past 32k) divides the low frequencies by `factor`, keeps
    the high ones, ramps between the dimensions that turn `beta_fast` and `beta_slow`
    times over `original_max_position_embeddings` positions, and scales cos and sin by
    `attention_factor`. Both are fixed at load (unlike "dynamic", which changes with the
    sequence length and is refused)."""

    rope_type: str  # "linear" or "yarn"
    factor: float
    original_max_position_embeddings: int = 0  # yarn
    attention_factor: float = 1.0              # yarn: cos and sin are scaled by it
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True                      # yarn: the ramp's ends rounded outwards

    def to_hf(self) -> dict[str, Any]:
        """The rope dict's scaling keys (transformers reads them back to the same frequencies)."""
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        return {"rope_type": "yarn", "factor": self.factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "attention_factor": self.attention_factor, "beta_fast": self.beta_fast, "beta_slow": self.beta_slow,
                "truncate": self.truncate}


ROPE_TYPES = ("default", "linear", "yarn")


def _number(value: Any, name: str, default: float | None = None, positive: bool = True) -> float | None:
    """A numeric config field `name` as a float: `default` when missing or null, else a
    finite number (and positive unless `positive` is False), else a ConfigError."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            positive and value <= 0):
        raise ConfigError(f"{name} must be a {'positive ' if positive else ''}number, got {value!r}")
    return float(value)


def _rope(raw: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """The RoPE base and scaling. As in transformers, the rope dict in use is `rope_scaling`
    when set, else `rope_parameters`; its rope_theta wins over the top-level one. Types
    other than default, linear and yarn are refused (dynamic, llama3, longrope: specjax
    does not run them)."""
    dicts = {key: raw.get(key) for key in ("rope_scaling", "rope_parameters") if raw.get(key) is not None}
    for key, rope in dicts.items():
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}: {key} must be an object or null, got {rope!r}")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in (None, *ROPE_TYPES):
            raise ConfigError(f"{source}: {key} rope_type {kind!r} is not supported (only {', '.join(ROPE_TYPES)})")
    key, in_use = next(((key, rope) for key, rope in dicts.items() if rope), ("rope_parameters", {}))
    theta = _number(in_use.get("rope_theta", raw.get("rope_theta")), f"{source}: rope_theta", HF_DEFAULTS["rope_theta"])
    kind = in_use.get("rope_type", in_use.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    where = f"{source}: {key}"
    if kind == "linear":
        if in_use.get("factor") is None:
            raise ConfigError(f"{where} rope_type 'linear' needs a factor")
        return theta, RopeScaling("linear", _number(in_use["factor"], f"{where} factor"))
    # yarn, with transformers' defaults: the pretraining length is the top-level
    # original_max_position_embeddings or max_position_embeddings, the factor their ratio
    # to max_position_embeddings, the attention factor 0.1 ln(factor) + 1 (or DeepSeek's
    # ratio of two such terms with mscale and mscale_all_dim)
    max_pos = typed(raw.get("max_position_embeddings", HF_DEFAULTS["max_position_embeddings"]), int,
                    "max_position_embeddings", source)
    original = in_use.get("original_max_position_embeddings", raw.get("original_max_position_embeddings", max_pos))
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise ConfigError(f"{where} original_max_position_embeddings must be a positive integer, got {original!r}")
    field = lambda name, default=None, positive=True: _number(  # noqa: E731
        in_use.get(name), f"{where} {name}", default, positive)
    factor = field("factor", max_pos / original)
    mscale = lambda m: 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0  # noqa: E731
    attention = field("attention_factor")
    if attention is None:
        m, m_all = (field(name, 0.0, positive=False) for name in ("mscale", "mscale_all_dim"))
        attention = mscale(m) / mscale(m_all) if m and m_all else mscale(1.0)
    truncate = in_use.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"{where} truncate must be true or false, got {truncate!r}")
    # transformers treats 0 / null betas as their defaults (`or 32`, `or 1`)
    beta_fast = field("beta_fast", 0.0, positive=False) or 32.0
    beta_slow = field("beta_slow", 0.0, positive=False) or 1.0
    return theta, RopeScaling("yarn", factor, original, attention, beta_fast, beta_slow, truncate)


def _defaults_named(message: str, raw: dict[str, Any]) -> str:
    """For each field `message` names that the file `raw` leaves out: a note of the
    transformers default it took (a wrong value the file does not show)."""
    return "".join(f"; {key} is missing from the file, so it is transformers' default {HF_DEFAULTS[key]!r}"
                   for key in HF_DEFAULTS if key not in raw and key in message)


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """Static architecture of a Qwen3 decoder; hashable so it can key compiled steps."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    max_position_embeddings: int = 40960
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"config field {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config.json") -> "Qwen3Config":
        """Build from a parsed HF config dict; `source` names the file in errors.

        A field the file leaves out takes transformers' Qwen3Config default (HF_DEFAULTS), so
        a terse config means here what it means to the reference implementation.
        """
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        if raw.get("model_type") != "qwen3":
            raise ConfigError(f"{source}: model_type must be 'qwen3', got {raw.get('model_type')!r}")
        if raw.get("use_sliding_window"):
            raise ConfigError(f"{source}: use_sliding_window=true is not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: hidden_act {raw.get('hidden_act')!r} is not supported (only 'silu')")
        quant = raw.get("quantization_config")
        if quant:  # FP8, GPTQ, AWQ, ...: the tensors hold codes and scales, not the weights
            method = quant.get("quant_method") if isinstance(quant, dict) else quant
            raise ConfigError(f"{source}: quantization_config (quant_method {method!r}) is not supported: specjax "
                              "loads unquantized float checkpoints (load(dtype='int8') quantizes one itself)")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in raw]
        if missing:
            raise ConfigError(f"{source}: missing required field(s) {missing}")

        def get(key: str, kind: type) -> Any:
            return typed(raw.get(key, HF_DEFAULTS.get(key)), kind, key, source)

        heads = get("num_attention_heads", int)
        # null KV heads means one per query head, as in transformers
        kv_heads = heads if raw.get("num_key_value_heads", 0) is None else get("num_key_value_heads", int)
        theta, scaling = _rope(raw, source)
        fields = dict(
            vocab_size=get("vocab_size", int),
            hidden_size=get("hidden_size", int),
            intermediate_size=get("intermediate_size", int),
            num_hidden_layers=get("num_hidden_layers", int),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=get("head_dim", int),
            rms_norm_eps=get("rms_norm_eps", float),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=get("tie_word_embeddings", bool),
            attention_bias=get("attention_bias", bool),
            max_position_embeddings=get("max_position_embeddings", int),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=parse_eos(raw.get("eos_token_id"), source),
        )
        try:
            return cls(**fields)
        except ConfigError as e:  # the checks of __post_init__, which knows no file
            raise ConfigError(f"{source}: {e}{_defaults_named(str(e), raw)}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "Qwen3Config":
        return cls.from_hf(read_json(path), str(path))

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dict (transformers 4.x and 5.x both read it)."""
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                **({} if self.rope_scaling is None else self.rope_scaling.to_hf())},
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf(),
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "max_position_embeddings": self.max_position_embeddings,
            "use_sliding_window": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "torch_dtype": "bfloat16",
        }
