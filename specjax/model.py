"""A loaded model: config, parameter tree, compute dtype and (optionally) its tokenizer;
`load`, `save` and `shard` (tensor-parallel placement, `specjax.sharding`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from . import checkpoint
from .checkpoint import CheckpointError, Params
from .config import ConfigError, Qwen3Config, parse_eos, read_json
from .runtime import enable_compilation_cache
from .sharding import AXIS, make_mesh, placer, shard_params


@dataclasses.dataclass(eq=False)
class Model:
    """What `specjax.load` returns; `generate` takes it."""

    config: Qwen3Config
    params: Params
    dtype: Any
    tokenizer: Any = None
    path: Path | None = None

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Stop ids from generation_config.json / config.json (empty if none)."""
        return self.config.eos_ids


def default_dtype() -> Any:
    """float32 on CPU (XLA:CPU bf16 dots are ~20x slower), bfloat16 on accelerators."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def _load_tokenizer(folder: Path) -> Any:
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(folder))


def _generation_eos(folder: Path, cfg: Qwen3Config) -> Qwen3Config:
    """Prefer generation_config.json's eos_token_id, as transformers' generate does."""
    gen = folder / "generation_config.json"
    if gen.is_file():
        raw = read_json(gen)
        if not isinstance(raw, dict):
            raise ConfigError(f"{gen}: expected a JSON object, got {type(raw).__name__}")
        eos = parse_eos(raw.get("eos_token_id"), str(gen))
        if eos is not None:
            return dataclasses.replace(cfg, eos_token_id=eos)
    return cfg


def load(path: str | Path, dtype: Any = None, mesh: jax.sharding.Mesh | None = None) -> Model:
    """Load a local Hugging Face Qwen3 folder (weights sharded or not, any float dtype).

    With a `jax.sharding.Mesh`, each weight is placed tensor-parallel over it as it is read
    (`specjax.sharding`), so a model larger than one device's memory loads; the result is
    what `specjax.shard` makes of the whole model.
    """
    enable_compilation_cache()
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a directory")
    cfg = _generation_eos(folder, Qwen3Config.from_file(folder / "config.json"))
    dtype = jnp.dtype(dtype) if dtype is not None else default_dtype()
    if mesh is None:
        transform = checkpoint.packed
    else:
        transform = placer(mesh)
    params = checkpoint.load_params(folder, cfg, dtype, transform)
    return Model(cfg, params, dtype, _load_tokenizer(folder), folder)


def save(model: Model, path: str | Path, dtype: str = "bfloat16", max_shard_bytes: int | None = None) -> None:
    """Write the model (and its tokenizer) as a Hugging Face folder."""
    checkpoint.save(path, model.params, model.config, dtype, max_shard_bytes)
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(path))


def shard(model: Model, mesh: jax.sharding.Mesh | None = None, axis: str = AXIS) -> Model:
    """The model with its weights split tensor-parallel over `mesh` (default: every local
    device); generate, the proposers and the bench take it as they take any model."""
    mesh = mesh if mesh is not None else make_mesh(axis=axis)
    return dataclasses.replace(model, params=shard_params(model.params, mesh, axis))
