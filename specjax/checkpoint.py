"""Safetensors checkpoints in Hugging Face layout <-> specjax parameter trees.

Runtime layout (one documented mapping, applied at load and reversed at save):

    HF name                                   runtime key
    model.embed_tokens.weight       [V, D]    same
    model.norm.weight               [D]       same
    lm_head.weight                  [V, D]    same (absent when embeddings are tied)
    model.layers.{i}.<name>                   params["model.layers"][<name>] stacked on a
                                              leading layer axis [L, ...] for lax.scan
    self_attn.{q,k,v}_proj.weight             self_attn.qkv_proj.weight [L, (H + 2K) * hd, D]
    self_attn.{q,k,v}_proj.bias               self_attn.qkv_proj.bias   [L, (H + 2K) * hd]
    mlp.{gate,up}_proj.weight                 mlp.gate_up_proj.weight   [L, 2F, D]

Fusing q/k/v and gate/up makes one matmul of each per layer per step. Weights keep the
HF [out, in] orientation.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from . import cpu_kernels
from .config import Qwen3Config
from .errors import SpecjaxError

Params = dict[str, Any]
Transform = Callable[[str, Any], Any]  # (name, layer tree or tensor) -> what the loaded tree holds
LAYERS = "model.layers"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(SpecjaxError):
    """A checkpoint folder or tensor that does not match what the config says."""


def layer_shapes(cfg: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """The tensors of one decoder layer (names after `model.layers.{i}.`), with shapes."""
    d, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = {
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (q, d),
        "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d),
        "self_attn.o_proj.weight": (d, q),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (cfg.intermediate_size, d),
        "mlp.up_proj.weight": (cfg.intermediate_size, d),
        "mlp.down_proj.weight": (d, cfg.intermediate_size),
    }
    if cfg.attention_bias:
        shapes.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                       "self_attn.v_proj.bias": (kv,), "self_attn.o_proj.bias": (d,)})
    return shapes


def hf_shapes(cfg: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor name a HF Qwen3 checkpoint of this config holds, with its shape."""
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size), "model.norm.weight": (cfg.hidden_size,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    per_layer = layer_shapes(cfg)
    for i in range(cfg.num_hidden_layers):
        for name, shape in per_layer.items():
            shapes[f"{LAYERS}.{i}.{name}"] = shape
    return shapes


_FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def _fuse(layer: dict[str, Any]) -> dict[str, Any]:
    """One layer's HF tensors with q/k/v and gate/up concatenated on the output axis."""
    for fused, parts in _FUSED.items():
        if parts[0] in layer:
            layer[fused] = jnp.concatenate([layer.pop(p) for p in parts], axis=0)
    return layer


def layers_from_hf(items: Iterable[tuple[str, Any]], cfg: Qwen3Config, prefix: str = LAYERS,
                   transform: Transform | None = None) -> Params:
    """HF (name, array) pairs to the inference layout: `params[prefix]` a tuple of fused
    per-layer trees (see `unstack`), the other tensors by name.

    Each layer is fused and passed through `transform` (packing for the CPU kernel, placing
    over a device mesh) as soon as its last tensor arrives, as `transform(f"{prefix}.{i}",
    layer)`; the other tensors as `transform(name, array)`. A checkpoint read in order is
    then held at most once plus one layer: a model whose weights fill most of memory loads.
    """
    transform = transform or (lambda _, x: x)
    per_layer = len(layer_shapes(cfg))
    pending: dict[int, dict[str, Any]] = {}
    layers: list[Any] = [None] * cfg.num_hidden_layers
    top: Params = {}
    for name, value in items:
        if not name.startswith(prefix + "."):
            top[name] = value
            continue
        i, sub = name[len(prefix) + 1:].split(".", 1)
        layer = pending.setdefault(int(i), {})
        layer[sub] = value
        if len(layer) == per_layer:
            layers[int(i)] = transform(f"{prefix}.{i}", _fuse(pending.pop(int(i))))
    if pending:  # callers pass whole checkpoints (iter_tensors checks presence); never a partial layer
        raise CheckpointError(f"{prefix}: layer(s) {sorted(pending)} lack tensors "
                              f"{sorted(set(layer_shapes(cfg)) - set(next(iter(pending.values()))))[:5]}")
    return {**{k: transform(k, v) for k, v in top.items()}, prefix: tuple(layers)}


def from_hf(tensors: dict[str, Any], cfg: Qwen3Config) -> Params:
    """HF flat name -> array dict to the training tree (layers stacked, projections fused)."""
    return stack(layers_from_hf(tensors.items(), cfg))


def weight_bytes(params: Params) -> int:
    """Bytes of every array in the tree (what one full forward pass reads)."""
    return sum(x.nbytes for x in jax.tree.leaves(params))


def unstack(params: Params, key: str = LAYERS) -> Params:
    """Inference layout: the layers (`params[key]`) as a tuple of per-layer trees.

    Each layer's weights are then separate buffers that a jitted step's dots read in
    place; a stacked [L, ...] array is sliced per layer inside the step, and XLA:CPU copies
    each slice before its dot (S config decode: 12.5 -> 6.5 ms without the cache).
    The stacked layout stays the stored training one (optimizer state, orbax checkpoints).
    """
    layers = params[key]
    if isinstance(layers, tuple):
        return params
    n = len(next(iter(layers.values())))
    return {**params, key: tuple({k: v[i] for k, v in layers.items()} for i in range(n))}


def stack(params: Params, key: str = LAYERS) -> Params:
    """Training layout (inverse of `unstack`, packed weights unpacked; stacked trees pass through)."""
    params = cpu_kernels.unpack_tree(params)
    layers = params[key]
    if not isinstance(layers, tuple):
        return params
    return {**params, key: {k: jnp.stack([lp[k] for lp in layers]) for k in layers[0]}}


def to_hf(params: Params, cfg: Qwen3Config) -> dict[str, Any]:
    """Runtime tree (either layout) back to HF flat names (inverse of `from_hf`)."""
    params = stack(params)
    hd = cfg.head_dim
    splits = {
        "self_attn.qkv_proj": [cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd,
                               cfg.num_key_value_heads * hd],
        "mlp.gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size],
    }
    out = {k: v for k, v in params.items() if k != LAYERS}
    for sub, value in params[LAYERS].items():
        module, kind = sub.rsplit(".", 1)
        if sub in _FUSED:
            pieces = np.split(np.asarray(value), np.cumsum(splits[module])[:-1], axis=1)
            items = zip(_FUSED[sub], pieces)
        else:
            items = [(sub, np.asarray(value))]
        for name, arr in items:
            for i in range(cfg.num_hidden_layers):
                out[f"{LAYERS}.{i}.{name}"] = arr[i]
    return out


def init_params(cfg: Qwen3Config, key: jax.Array, dtype: Any = jnp.float32, std: float = 0.02) -> Params:
    """Random weights (normal(0, std) matrices, unit norms, zero biases) in runtime layout."""
    shapes = hf_shapes(cfg)
    keys = jax.random.split(key, len(shapes))
    tensors = {}
    for k, (name, shape) in zip(keys, sorted(shapes.items())):
        if name.endswith("norm.weight"):
            tensors[name] = jnp.ones(shape, dtype)
        elif name.endswith(".bias"):
            tensors[name] = jnp.zeros(shape, dtype)
        else:
            tensors[name] = (std * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
    return from_hf(tensors, cfg)


def _weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> file, from model.safetensors or a sharded index."""
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.is_file():
        files = {name: folder / f for name, f in _weight_map(index).items()}
        for f in set(files.values()):
            if not f.is_file():
                raise CheckpointError(f"{index}: lists shard {f.name}, which is missing")
        return files
    if single.is_file():
        with _open(single) as f:
            return {name: single for name in f.keys()}
    raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def _weight_map(index: Path) -> dict[str, str]:
    """A safetensors index's weight_map (tensor name -> shard file name); anything but a
    JSON object whose weight_map maps strings to strings is a CheckpointError naming it."""
    try:
        raw = json.loads(index.read_text())
    except ValueError as e:  # not JSON, or not UTF-8
        raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: not a valid safetensors index (expected a JSON object whose weight_map maps "
                              f"tensor names to file names, got {json.dumps(raw)[:80]})")
    return weight_map


@contextlib.contextmanager
def _open(path: Path) -> Iterator[Any]:
    """safe_open whose failures (a truncated or corrupt file, a tensor it cannot read) are a
    CheckpointError naming the file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="flax") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: cannot read safetensors ({e})") from e


SIXTEEN_BIT = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# the tensor dtypes read (safetensors header names -> names): float8 and integer tensors are
# the codes of a quantized checkpoint, or not weights at all
READ_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def iter_tensors(folder: str | Path, expected: dict[str, tuple[int, ...]], dtype: Any,
                 optional: Iterable[str] = (), keep16: bool = False) -> Iterator[tuple[str, jax.Array]]:
    """The named tensors of a safetensors folder as (name, array) in `dtype`, one at a time
    in file order; presence is checked before the first is read, shape and dtype (one of
    READ_DTYPES) from the file's header before each is.
    Tensors named in `optional` are read when present. With `keep16`, matrices stored in
    bfloat16 or float16 stay as stored (for the CPU kernel, which widens them exactly)."""
    folder = Path(folder)
    files = _weight_files(folder)
    optional = set(optional)
    names = [n for n in files if not n.endswith(_IGNORED_SUFFIXES) and n not in optional]
    missing = sorted(set(expected) - set(files))
    unexpected = sorted(set(names) - set(expected))
    if missing:
        raise CheckpointError(f"{folder}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        raise CheckpointError(f"{folder}: unexpected tensor(s) {unexpected[:5]} for this config")
    by_file: dict[Path, list[str]] = {}
    for name in [*expected, *sorted(optional & set(files))]:
        by_file.setdefault(files[name], []).append(name)
    for path, file_names in by_file.items():
        with _open(path) as f:
            for name in file_names:
                if name not in f.keys():
                    raise CheckpointError(f"{path}: does not hold tensor {name}, which the index places there")
                header = f.get_slice(name)  # shape and dtype from the header, before the data is read
                if name in expected and tuple(header.get_shape()) != tuple(expected[name]):
                    raise CheckpointError(f"{path}: tensor {name} has shape {tuple(header.get_shape())}, expected "
                                          f"{tuple(expected[name])}")
                if header.get_dtype() not in READ_DTYPES:
                    raise CheckpointError(f"{path}: tensor {name} has dtype {header.get_dtype()}; specjax reads "
                                          f"{', '.join(READ_DTYPES.values())} tensors only (no quantized checkpoints)")
                t = f.get_tensor(name)
                yield name, t if keep16 and t.ndim == 2 and jnp.dtype(t.dtype) in SIXTEEN_BIT else t.astype(dtype)


def _drop_tied_head(items: Iterable[tuple[str, Any]], folder: Path) -> Iterator[tuple[str, Any]]:
    """`items` without lm_head.weight, which must equal the embedding: with tied embeddings
    a different head would be silently unused, so it is an error rather than a guess."""
    embed = head = None
    for name, value in items:
        if name == "lm_head.weight":
            head = value
            continue
        if name == "model.embed_tokens.weight":
            embed = value
        yield name, value
    if head is not None and not (head.shape == embed.shape and bool(jnp.array_equal(head, embed))):
        raise CheckpointError(f"{folder}: lm_head.weight differs from model.embed_tokens.weight, but config.json "
                              "says tie_word_embeddings=true (set it to false to use the stored head)")


def packed(_: str, value: Any) -> Any:
    """The loading transform for float32 compute on a single device: weights packed where
    the CPU kernel runs (`cpu_kernels.pack_tree`)."""
    return cpu_kernels.pack_tree(value)


def quantized(_: str, value: Any) -> Any:
    """The loading transform for int8 weights: matrices quantized (`cpu_kernels.quantize_tree`)."""
    return cpu_kernels.quantize_tree(value)


def loading(dtype: Any, requested: bool) -> tuple[Any, Transform | None, bool]:
    """How a checkpoint is read onto a single device for `dtype` (`requested`: the caller
    named it): the compute dtype, the transform for each tensor, and whether 16-bit
    matrices stay in 16 bits. They do for float32 compute where the CPU kernels run,
    unless float32 was asked for. "int8" computes in float32 with int8 matrices."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.int8:
        return jnp.dtype(jnp.float32), quantized, False
    if dtype != jnp.float32:
        return dtype, None, False
    return dtype, packed, not requested and cpu_kernels.runs()


def load_params(folder: str | Path, cfg: Qwen3Config, dtype: Any, transform: Transform | None = None,
                keep16: bool = False) -> Params:
    """A HF Qwen3 folder's weights in `dtype` (16-bit matrices as stored with `keep16`, see
    `iter_tensors`), in the inference layout (`checkpoint.stack` gives the training one),
    each layer passed through `transform` as it is read (see `layers_from_hf`)."""
    folder = Path(folder)
    optional = ["lm_head.weight"] if cfg.tie_word_embeddings else []
    items = iter_tensors(folder, hf_shapes(cfg), dtype, optional, keep16)
    if cfg.tie_word_embeddings:
        items = _drop_tied_head(items, folder)
    return layers_from_hf(items, cfg, transform=transform)


SAVE_DTYPES = ("float32", "bfloat16", "float16")  # what `load` reads back


def save_dtype(dtype: Any) -> str:
    """The name of a dtype weights may be saved in (SAVE_DTYPES); anything else (int8,
    which would truncate the weights, float64, which safetensors.flax writes as float32, a
    misspelling) is a CheckpointError, raised before anything is written."""
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in SAVE_DTYPES:
        raise CheckpointError(f"dtype must be one of {', '.join(SAVE_DTYPES)} (what specjax.load reads back), "
                              f"got {dtype!r}")
    return name


def _remove_weights(folder: Path) -> None:
    """Delete the weight files a previous save left in `folder` (model.safetensors, or an
    index and the shards it lists), so that a save over it never leaves two sets of
    weights, of which `_weight_files` would read the index's."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            listed = set(_weight_map(index).values())
        except CheckpointError:  # not an index we wrote: only the index itself goes
            listed = set()
        for name in listed:
            shard = folder / name
            if shard.parent == folder and shard.suffix == ".safetensors":
                shard.unlink(missing_ok=True)
        index.unlink()
    (folder / "model.safetensors").unlink(missing_ok=True)


def lossless_dtype(tensors: dict[str, Any]) -> str:
    """The narrowest dtype a save may write `tensors` in without changing a value:
    bfloat16, else float16, where every value is one, else float32 (a 16-bit checkpoint
    loaded and saved again is written in its own type; a float32 one keeps its bits)."""
    for name in ("bfloat16", "float16"):
        kind = jnp.dtype(name)
        if all(np.asarray(t).dtype == kind or np.array_equal(np.asarray(t).astype(kind).astype(np.float32),
                                                             np.asarray(t, np.float32))
               for t in tensors.values()):
            return name
    return "float32"


def save_safetensors(tensors: dict[str, Any], path: Path) -> None:
    """safetensors' save_file, the file then given the permissions any new file gets here
    (safetensors 0.8 writes it private, 0600: a model saved into a shared folder could not
    be read by the others who may read its config and tokenizer)."""
    from safetensors.flax import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def write_tensors(folder: str | Path, tensors: dict[str, Any], dtype: str | None = None,
                  max_shard_bytes: int | None = None) -> str:
    """Write a flat name -> array dict as model.safetensors, or shards plus an index, in
    place of any weights a previous save left in the folder; dtype None: `lossless_dtype`.
    Returns the dtype written."""
    dtype = lossless_dtype(tensors) if dtype is None else save_dtype(dtype)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {k: jnp.asarray(v).astype(dtype) for k, v in sorted(tensors.items())}
    _remove_weights(folder)
    if max_shard_bytes is None:
        save_safetensors(arrays, folder / "model.safetensors")
        return dtype
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, arr in arrays.items():
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(shard, folder / fname)
        weight_map.update({name: fname for name in shard})
    total = sum(a.nbytes for a in arrays.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return dtype


def save(folder: str | Path, params: Params, cfg: Qwen3Config, dtype: str | None = None,
         max_shard_bytes: int | None = None) -> None:
    """Write weights and config.json in HF layout (loads in transformers and specjax); the
    config last, so a save that fails leaves no config describing weights it did not write.
    dtype None: `lossless_dtype`."""
    folder = Path(folder)
    hf_cfg = cfg.to_hf()
    hf_cfg["torch_dtype"] = write_tensors(folder, to_hf(params, cfg), dtype, max_shard_bytes)
    (folder / "config.json").write_text(json.dumps(hf_cfg, indent=2))
