"""A loaded model: config, parameter tree, compute dtype and (optionally) its tokenizer;
`load`, `save` and `shard` (tensor-parallel placement, `specjax.sharding`)."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from . import checkpoint, cpu_kernels
from .checkpoint import CheckpointError, Params
from .config import ConfigError, Qwen3Config, parse_eos, read_json, typed
from .errors import SpecjaxError
from .runtime import enable_compilation_cache
from .sampling import Sampling, SamplingError
from .sharding import AXIS, make_mesh, mesh_axis, placer, shard_params


class DtypeError(SpecjaxError):
    """A compute dtype or KV-cache dtype that specjax does not run."""


@dataclasses.dataclass(eq=False)
class Model:
    """What `specjax.load` returns; `generate` takes it.

    `generation_defaults`: the sampling of the folder's generation_config.json, which
    `generate` and the CLI use when the caller gives none (None: the folder has no such
    file, and generation is greedy). `kv_dtype`: what engines keep its keys and values in
    (None: the compute dtype; `cache_dtype`).
    """

    config: Qwen3Config
    params: Params
    dtype: Any
    tokenizer: Any = None
    path: Path | None = None
    generation_defaults: Sampling | None = None
    kv_dtype: Any = None

    def __post_init__(self) -> None:
        if self.kv_dtype is not None:
            self.kv_dtype = checked_dtype(self.kv_dtype, "kv_dtype", KV_DTYPES)

    @property
    def cache_dtype(self) -> Any:
        """The dtype of this model's KV pools in an engine: `kv_dtype`, else the compute dtype."""
        return self.dtype if self.kv_dtype is None else self.kv_dtype

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Stop ids from generation_config.json / config.json (empty if none)."""
        return self.config.eos_ids


# What a KV cache may hold: on CPU the attention kernel reads float32 and bfloat16 pools
# (widening bfloat16 exactly in registers); XLA's path reads any of them.
KV_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# What a model may compute in: float32, bfloat16 and float16, and "int8" (matrices
# quantized at load, `checkpoint.loading`, times activations quantized per row; the rest in
# float32). Others would load and then fail or
# mislead: integer types in the first step, float8 with NaN logits, float64 narrowed to
# float32 by JAX unless x64 is on.
COMPUTE_DTYPES = (*KV_DTYPES, jnp.dtype(jnp.int8))


def checked_dtype(value: Any, parameter: str, allowed: tuple[Any, ...]) -> Any:
    """`value` as one of the `allowed` dtypes, else a DtypeError naming `parameter`."""
    try:
        kind = jnp.dtype(value)
    except (TypeError, ValueError):  # not a dtype at all ("foo", 5)
        kind = None
    if kind is None or kind not in allowed:
        shown = repr(value) if kind is None else kind.name
        raise DtypeError(f"{parameter} {shown}: expected one of {', '.join(d.name for d in allowed)}")
    return kind


def default_dtype() -> Any:
    """float32 on CPU (XLA:CPU bf16 dots are ~20x slower), bfloat16 on accelerators."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # a folder with either has a tokenizer
# the JSON files transformers reads for one, searched for the culprit when it fails
TOKENIZER_JSON = (*TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json")
# every file transformers may read a tokenizer from: a save replacing one removes them all first,
# so none of another model's (a chat template, added tokens) stays behind to take effect
TOKENIZER_ALL = (*TOKENIZER_JSON, "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt",
                 "tokenizer.model")


def remove_tokenizer(folder: Path) -> None:
    """Delete the tokenizer files (TOKENIZER_ALL) in `folder`, before another is written there."""
    for name in TOKENIZER_ALL:
        (Path(folder) / name).unlink(missing_ok=True)


def _load_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer; None without tokenizer files. One that transformers cannot
    build is a CheckpointError naming the file: the folder is broken, as transformers' and
    vLLM's loads say, even for a caller that passes token ids."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # transformers raises whatever its parsers do: JSONDecodeError, KeyError, TypeError, ...
        raise CheckpointError(f"{_broken_tokenizer_file(folder)}: cannot load the tokenizer "
                              f"({type(e).__name__}: {e})") from e


def _broken_tokenizer_file(folder: Path) -> str:
    """The first of the folder's tokenizer JSON files that is not a JSON object, else the
    folder and the tokenizer files it has (what a failure to build one names)."""
    present = [folder / name for name in TOKENIZER_JSON if (folder / name).is_file()]
    for path in present:
        try:
            if isinstance(json.loads(path.read_text()), dict):
                continue
        except ValueError:  # not JSON, or not UTF-8
            pass
        return str(path)
    return f"{folder} ({', '.join(path.name for path in present)})"


# transformers' GenerationConfig values for sampling fields a generation_config.json leaves
# out or sets to null (transformers 5.x; 4.x agree)
HF_SAMPLING_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": 0.0}


def generation_sampling(raw: dict[str, Any], source: str) -> Sampling:
    """The sampling a generation_config.json dict asks for, as transformers reads it:
    greedy unless do_sample is true (absent means false: transformers then ignores
    temperature, top_k, top_p and min_p, with a warning); a field left out takes
    transformers' default (HF_SAMPLING_DEFAULTS). A bad field is a ConfigError naming
    `source` and the field."""
    if not typed(raw.get("do_sample", False), bool, "do_sample", source):
        return Sampling()
    kinds = {"temperature": float, "top_k": int, "top_p": float, "min_p": float}
    values = {key: typed(HF_SAMPLING_DEFAULTS[key] if raw.get(key) is None else raw[key], kind, key, source)
              for key, kind in kinds.items()}
    try:
        return Sampling(**values)
    except SamplingError as e:
        raise ConfigError(f"{source}: {e}") from None


# generation_config.json fields that change what transformers' (or vLLM's) generate does
# with the file and that specjax does not implement, each with the value that changes
# nothing (null, unset, and an empty list do not either). SAMPLED_ONLY act only when
# do_sample is true.
UNAPPLIED: dict[str, Any] = {
    "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "no_repeat_ngram_size": 0,
    "bad_words_ids": None, "sequence_bias": None, "suppress_tokens": None, "begin_suppress_tokens": None,
    "forced_bos_token_id": None, "forced_eos_token_id": None, "min_length": 0, "min_new_tokens": 0,
    "exponential_decay_length_penalty": None, "num_beams": 1, "penalty_alpha": 0.0, "guidance_scale": 1.0,
    "watermarking_config": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None,
}
SAMPLED_ONLY = frozenset({"typical_p", "epsilon_cutoff", "eta_cutoff", "top_h"})


def _warn_unapplied(raw: dict[str, Any], source: str) -> None:
    """Warn (once per file: Python's default warning filter) about the generation_config.json
    fields in UNAPPLIED that `raw` sets to a value that changes the output: specjax's
    generation from this folder then differs from transformers' and vLLM's."""
    sampled = raw.get("do_sample") is True
    fields = [f"{key}={raw[key]!r}" for key, neutral in UNAPPLIED.items()
              if raw.get(key) not in (None, neutral, [], {}) and (sampled or key not in SAMPLED_ONLY)]
    if fields:
        warnings.warn(f"{source}: {', '.join(fields)} not applied (specjax implements temperature, top_k, top_p "
                      "and min_p only): its output can differ from transformers' and vLLM's generate with this "
                      "file", stacklevel=2)


def _generation_config(folder: Path, cfg: Qwen3Config) -> tuple[Qwen3Config, Sampling | None]:
    """generation_config.json's eos_token_id (preferred, as transformers' generate does)
    and its sampling defaults; (cfg, None) without the file. Decoding options it sets that
    specjax does not implement are warned about (`_warn_unapplied`)."""
    gen = folder / "generation_config.json"
    if not gen.is_file():
        return cfg, None
    raw = read_json(gen)
    if not isinstance(raw, dict):
        raise ConfigError(f"{gen}: expected a JSON object, got {type(raw).__name__}")
    eos = parse_eos(raw.get("eos_token_id"), str(gen))
    if eos is not None:
        cfg = dataclasses.replace(cfg, eos_token_id=eos)
    defaults = generation_sampling(raw, str(gen))
    _warn_unapplied(raw, str(gen))
    return cfg, defaults


# generation_config.json fields vLLM's OpenAI server takes as request defaults
# (vllm/config/model.py, ModelConfig.get_diff_sampling_param, with --generation-config auto,
# its default), each where the file sets it, whatever do_sample says; max_new_tokens is
# the default max_tokens (`specjax serve`'s for chat, `specjax generate`'s
# --max-new-tokens). (repetition_penalty too: specjax has none, and load warns.)
SERVER_DEFAULTS: dict[str, type] = {"temperature": float, "top_k": int, "top_p": float, "min_p": float,
                                    "max_new_tokens": int}


def request_defaults(folder: Path | None) -> dict[str, Any]:
    """The request defaults `specjax serve` (and the CLI's length) take from `folder`'s
    generation_config.json, as vLLM's server reads it (SERVER_DEFAULTS): {field: value}
    for each field the file sets (null is unset), max_new_tokens under vLLM's name
    max_tokens, top_k -1 (vLLM's "off") as 0; {} without a folder or file. A bad value is a
    ConfigError naming file and field."""
    gen = None if folder is None else Path(folder) / "generation_config.json"
    if gen is None or not gen.is_file():
        return {}
    raw = read_json(gen)
    if not isinstance(raw, dict):
        raise ConfigError(f"{gen}: expected a JSON object, got {type(raw).__name__}")
    values = {key: typed(raw[key], kind, key, str(gen)) for key, kind in SERVER_DEFAULTS.items()
              if raw.get(key) is not None}
    if values.get("top_k") == -1:
        values["top_k"] = 0
    try:
        Sampling(**{k: v for k, v in values.items() if k != "max_new_tokens"})
    except SamplingError as e:
        raise ConfigError(f"{gen}: {e}") from None
    if "max_new_tokens" in values:
        if values["max_new_tokens"] < 1:
            raise ConfigError(f"{gen}: field max_new_tokens must be >= 1, got {values['max_new_tokens']!r}")
        values["max_tokens"] = values.pop("max_new_tokens")
    return values


def reading(folder: Path, dtype: Any, default: Any, mesh: jax.sharding.Mesh | None
            ) -> tuple[Any, checkpoint.Transform | None, bool]:
    """How `load` / `load_dflash` read a folder for `dtype` (None: `default`): the compute
    dtype, the transform for each tensor and whether 16-bit matrices stay in 16 bits
    (`checkpoint.loading`); over a mesh each tensor is placed as it is read."""
    requested, dtype = dtype is not None, checked_dtype(dtype if dtype is not None else default, "dtype",
                                                        COMPUTE_DTYPES)
    if mesh is None:
        return checkpoint.loading(dtype, requested)
    if dtype == jnp.int8:
        raise CheckpointError(f"{folder}: int8 weights run on the CPU kernels of one device, not over a mesh")
    return dtype, placer(mesh, mesh_axis(mesh)), False


def load(path: str | Path, dtype: Any = None, mesh: jax.sharding.Mesh | None = None, kv_dtype: Any = None
         ) -> Model:
    """Load a local Hugging Face Qwen3 folder (weights sharded or not, stored in float32,
    bfloat16, float16 or float64), with its tokenizer and generation_config.json (eos ids,
    sampling defaults) when present. A tokenizer that does not load is an error (a
    CheckpointError naming the file), even for callers that pass token ids.

    `dtype` is the compute dtype (default: float32 on CPU, bfloat16 on accelerators; one of
    `COMPUTE_DTYPES`, else a DtypeError). On
    CPU with the default, matrices stored in bfloat16 or float16 stay in 16 bits in memory
    and the kernels widen them to float32 in registers (`cpu_kernels.Packed`): half the
    memory and the bytes a step reads, and bitwise the logits of ``dtype="float32"``,
    which widens them at load. ``dtype="int8"`` quantizes the matrices at load
    (`cpu_kernels.quantize`: a scale per 32 columns, llama.cpp's q8_0) and multiplies them
    as llama.cpp multiplies q8_0 weights, by activations quantized the same way per row
    (`cpu_kernels.q8_matmul`): a quarter of float32's bytes, and a different model.

    `kv_dtype` is what an engine keeps the model's keys and values in (default: the compute
    dtype; float32, bfloat16 or float16). ``kv_dtype="bfloat16"`` on CPU halves the cache's
    memory and the bytes attention reads; each key and value is rounded to bfloat16 as it
    is stored, so it too is a different model (its greedy and sampled output still equal
    its own plain decoding's).

    With a `jax.sharding.Mesh`, each weight is placed tensor-parallel over it as it is read
    (`specjax.sharding`), so a model larger than one device's memory loads; the result is
    what `specjax.shard` makes of the whole model.
    """
    enable_compilation_cache()
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a directory")
    dtype, transform, keep16 = reading(folder, dtype, default_dtype(), mesh)
    if kv_dtype is not None:  # checked (again by Model) before minutes of reading weights
        kv_dtype = checked_dtype(kv_dtype, "kv_dtype", KV_DTYPES)
    cfg, defaults = _generation_config(folder, Qwen3Config.from_file(folder / "config.json"))
    tokenizer = _load_tokenizer(folder)  # before the weights too: a broken file fails fast
    params = checkpoint.load_params(folder, cfg, dtype, transform, keep16)
    return Model(cfg, params, dtype, tokenizer, folder, defaults, kv_dtype)


def save(model: Model, path: str | Path, dtype: str | None = None, max_shard_bytes: int | None = None) -> None:
    """Write the model as a Hugging Face folder: weights, config.json, its tokenizer and
    its generation_config.json (`generation_file`), so that `load` gives back the same
    model and generation.

    dtype: None writes every weight as it is, in the narrowest type that holds them all
    exactly (`checkpoint.lossless_dtype`: a bfloat16 checkpoint stays bfloat16, a float32
    one float32, as transformers' save_pretrained keeps a model's dtype); "bfloat16",
    "float16" or "float32" rounds to that type."""
    generation = generation_file(model)  # read before the save: `path` may be the folder it came from
    checkpoint.save(path, model.params, model.config, dtype, max_shard_bytes)
    if model.tokenizer is not None:
        if model.path is None or Path(model.path).resolve() != Path(path).resolve():
            remove_tokenizer(Path(path))
        model.tokenizer.save_pretrained(str(path))
    gen = Path(path) / "generation_config.json"
    if generation:
        gen.write_text(json.dumps(generation, indent=2))
    else:
        gen.unlink(missing_ok=True)


def generation_file(model: Model) -> dict[str, Any]:
    """The generation_config.json `save` writes for `model`: the one of the folder it was
    loaded from (every field kept), with its eos ids and, where `generation_defaults`
    differs from what that file asks for, its sampling (do_sample and the four fields, all
    set for a sampled default, removed for greedy, so that transformers' and vLLM's readings
    agree); {} where there is nothing to write."""
    source = None if model.path is None else Path(model.path) / "generation_config.json"
    raw = read_json(source) if source is not None and source.is_file() else {}
    if model.config.eos_token_id is not None:
        eos = model.config.eos_token_id
        raw["eos_token_id"] = list(eos) if isinstance(eos, tuple) else eos
    asked = generation_sampling(raw, str(source)) if source is not None and source.is_file() else None
    if model.generation_defaults != asked:
        wanted = model.generation_defaults
        for key in ("do_sample", *HF_SAMPLING_DEFAULTS):
            raw.pop(key, None)
        if wanted is not None and not wanted.greedy:
            raw |= {"do_sample": True, "temperature": wanted.temperature, "top_k": wanted.top_k,
                    "top_p": wanted.top_p, "min_p": wanted.min_p}
        elif wanted is not None:
            raw["do_sample"] = False
    return raw


def shard(model: Model, mesh: jax.sharding.Mesh | None = None, axis: str = AXIS) -> Model:
    """The model with its weights split tensor-parallel over `mesh` (default: every local
    device); generate, the proposers and the bench take it as they take any model."""
    quantized = any(isinstance(w, cpu_kernels.Packed) and w.scales is not None for w in jax.tree.leaves(
        model.params, is_leaf=lambda w: isinstance(w, cpu_kernels.Packed)))
    if quantized:  # placing would widen every weight back to float32, silently
        raise CheckpointError(f"{model.path or 'the model'}: int8 weights run on the CPU kernels of one device, "
                              "not over a mesh")
    mesh = mesh if mesh is not None else make_mesh(axis=axis)
    return dataclasses.replace(model, params=shard_params(model.params, mesh, axis))
