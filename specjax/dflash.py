"""DFlash drafter (block diffusion, arXiv:2602.06036; the checkpoint format of z-lab/dflash).

A drafter is a few Qwen3 layers with no embedding or head of its own. It reads the
target's residual stream at `target_layer_ids`, projects each committed position to one
context row c = hidden_norm(fc(concat features)) and, in one bidirectional pass over the
block [last, mask x (B-1)], predicts the B-1 tokens after `last`. Block tokens are
embedded with the target's table and drafts are scored with the target's head.

Runtime parameter tree (the checkpoint mapping of checkpoint.py, prefix `layers.`):

    HF name                          runtime key
    fc.weight          [D, n*D]      same (n = len(target_layer_ids))
    hidden_norm.weight [D]           same
    norm.weight        [D]           same
    layers.{i}.<name>                params["layers"][<name>] stacked [L, ...] (training) or
                                     params["layers"][i][<name>] (inference, as loaded), q/k/v
                                     and gate/up fused exactly as for the target

Single-sequence reference (`ContextCache`, `append_context`, `draft_block`): per drafter
layer the K (k_norm + RoPE at the row's absolute position) and V of every committed
context row, slot = absolute position; block rows are never kept, so drafting only reads
the cache. The engine runs the same pieces over paged pools (`specjax.drafters`).

Markov head (optional; DSpark's, Cheng et al., arXiv:2607.05147; `markov_bias`): the block
pass gives every block row its logits at once, independently of the tokens chosen at the
other rows; the head adds to row k a bias from the token chosen at row k-1, token by
token, without rerunning the layers. It is stored beside the public files (`markov_head.safetensors`), so the folder
still loads anywhere, with or without it.

Training (`block_logits`) runs many blocks of one sequence in one packed pass under
`block_mask`, recomputing context K/V from the features with the same pieces, so each
block's logits equal what `draft_block` gives with the context cut at its anchor.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from . import checkpoint, cpu_kernels
from .checkpoint import LAYERS, CheckpointError, Params
from .config import ConfigError, Qwen3Config, RopeScaling, read_json, typed
from .model import Model, reading
from .qwen3 import attend_masked, linear, mlp, rms_norm, rope, unembed

ARCHITECTURE = "DFlashDraftModel"
VOCAB_FILE = "draft_vocab.json"  # {"token_ids": [...]}: a Drafter's vocab, when it has one
MARKOV_FILE = "markov_head.safetensors"  # the optional Markov head, DeepSpec's tensor names (MARKOV_NAMES)
MARKOV = "markov"  # its runtime key: params[MARKOV] = {"w1": [V, r], "w2": [V, r]}, float32
MARKOV_NAMES = {"w1": "markov_head.markov_w1.weight", "w2": "markov_head.markov_w2.weight"}
DRAFT_LAYERS = "layers"
# Options of newer z-lab/dflash code (`dflash/model.py`) whose non-default values we do not run.
_DEFAULTS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": 0.0,
             "is_causal": False}


class DFlashError(CheckpointError):
    """A DFlash drafter that does not fit its target (or is not a DFlash v1 checkpoint)."""


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab/dflash's `build_target_layer_ids`: spread from layer 1 to layer L-3.
    It is what a checkpoint without target_layer_ids was trained with, so it is kept as is,
    even where shallow targets make it repeat or leave the layers."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


def new_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Taps for a new drafter: z-lab's spread where it gives distinct layers in range,
    else an even spread over all the target's layers."""
    if num_draft_layers < 1:
        raise ConfigError(f"a drafter needs at least one layer, got num_layers={num_draft_layers}")
    ids = default_target_layer_ids(num_target_layers, num_draft_layers)
    if ids[0] >= 0 and ids[-1] < num_target_layers and all(a < b for a, b in zip(ids, ids[1:])):
        return ids
    if num_draft_layers > num_target_layers:
        raise ConfigError(f"no default target_layer_ids for {num_draft_layers} draft layers on a "
                          f"{num_target_layers}-layer target (one distinct tap per draft layer); pass "
                          "target_layer_ids explicitly")
    last = num_target_layers - 1
    return tuple(int(round(i * last / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """Static drafter architecture; hashable so it can key compiled functions."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        _ = self.layer_config  # validates the shared Qwen3 geometry
        if not self.target_layer_ids:
            raise ConfigError("DFlash config: target_layer_ids must not be empty")
        if self.block_size < 2:
            raise ConfigError(f"DFlash config: block_size must be >= 2, got {self.block_size}")

    @property
    def layer_config(self) -> Qwen3Config:
        """The drafter layers as a Qwen3 config (for shapes and the checkpoint mapping)."""
        return Qwen3Config(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings)

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config.json") -> "DFlashConfig":
        """Parse a public DFlash config.json dict; `source` names the file in errors."""
        if raw.get("architectures") != [ARCHITECTURE]:
            raise ConfigError(f"{source}: architectures must be {[ARCHITECTURE]} (DFlash v1), "
                              f"got {raw.get('architectures')!r}")
        base = Qwen3Config.from_hf(raw, source)
        extra = raw.get("dflash_config") or {}

        def get(key: str, default: Any = None) -> Any:
            return extra.get(key, raw.get(key, default))

        for key, default in _DEFAULTS.items():
            if get(key, default) not in (default, None):
                raise ConfigError(f"{source}: {key}={get(key)!r} is not supported (only {default!r})")
        kinds = raw.get("layer_types") or ["full_attention"] * base.num_hidden_layers
        if not isinstance(kinds, list) or len(kinds) != base.num_hidden_layers:
            raise ConfigError(f"{source}: layer_types must list one entry per layer ({base.num_hidden_layers}), "
                              f"got {kinds!r}")
        if set(kinds) != {"full_attention"}:
            raise ConfigError(f"{source}: layer_types {sorted(set(map(str, kinds)))} are not supported "
                              "(only full_attention)")

        if "num_target_layers" not in raw:
            raise ConfigError(f"{source}: missing required field num_target_layers")
        n_target = typed(raw["num_target_layers"], int, "num_target_layers", source)
        if get("mask_token_id") is None:
            raise ConfigError(f"{source}: missing dflash_config.mask_token_id")
        ids = get("target_layer_ids")
        if ids is None:
            ids = default_target_layer_ids(n_target, base.num_hidden_layers)
        elif not isinstance(ids, list) or not ids:
            raise ConfigError(f"{source}: target_layer_ids must be a non-empty list of layer indices, got {ids!r}")
        return cls(
            vocab_size=base.vocab_size, hidden_size=base.hidden_size, intermediate_size=base.intermediate_size,
            num_hidden_layers=base.num_hidden_layers, num_attention_heads=base.num_attention_heads,
            num_key_value_heads=base.num_key_value_heads, head_dim=base.head_dim,
            target_layer_ids=tuple(typed(i, int, "target_layer_ids", source) for i in ids),
            num_target_layers=n_target,
            mask_token_id=typed(get("mask_token_id"), int, "mask_token_id", source),
            block_size=typed(get("block_size", 16), int, "block_size", source), rms_norm_eps=base.rms_norm_eps,
            rope_theta=base.rope_theta, rope_scaling=base.rope_scaling,
            max_position_embeddings=base.max_position_embeddings)

    @classmethod
    def from_file(cls, path: str | Path) -> "DFlashConfig":
        return cls.from_hf(read_json(path), str(path))

    def to_hf(self) -> dict[str, Any]:
        """The public config.json dict (z-lab's keys; loads back with from_hf)."""
        out = self.layer_config.to_hf()
        out.update(
            architectures=[ARCHITECTURE],
            block_size=self.block_size,
            num_target_layers=self.num_target_layers,
            dflash_config={"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            layer_types=["full_attention"] * self.num_hidden_layers,
        )
        return out


def fit_problems(cfg: DFlashConfig, target: Qwen3Config) -> list[str]:
    """Why a drafter cannot serve `target` (empty when it fits)."""
    problems = []
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {cfg.hidden_size} != target hidden_size {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} != target vocab_size {target.vocab_size}")
    if cfg.num_target_layers != target.num_hidden_layers:
        problems.append(f"num_target_layers {cfg.num_target_layers} != target num_hidden_layers "
                        f"{target.num_hidden_layers}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        problems.append(f"target_layer_ids {list(cfg.target_layer_ids)}: {bad} outside the target's layers "
                        f"[0, {target.num_hidden_layers})")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {cfg.mask_token_id} outside the target vocabulary [0, {target.vocab_size})")
    return problems


def check_fits(cfg: DFlashConfig, target: Qwen3Config, source: str) -> None:
    """Raise DFlashError naming `source` and every mismatch with the target."""
    problems = fit_problems(cfg, target)
    if problems:
        raise DFlashError(f"{source}: drafter does not fit the target: " + "; ".join(problems))


@dataclasses.dataclass(eq=False)
class Drafter:
    """A loaded (or initialised) DFlash drafter; pair it with its target in DFlashProposer.

    `vocab`: the draft vocabulary, sorted target token ids that the drafter's head scores
    (the most frequent ones, as EAGLE-3 does; `train.draft_vocab` picks them), or None for
    the whole vocabulary. Drafts are only proposals, so it changes their cost, never the
    output. Saved as draft_vocab.json next to the public files, which load without it.
    A Markov head, when the drafter has one, is `params[MARKOV]` (`markov_bias`).
    """

    params: Params
    config: DFlashConfig
    dtype: Any
    path: Path | None = None
    vocab: np.ndarray | None = None

    @property
    def cfg(self) -> DFlashConfig:
        """Deprecated name of `config` (as `Model.config`); removed in the next release."""
        warnings.warn("Drafter.cfg is deprecated; use Drafter.config", DeprecationWarning, stacklevel=2)
        return self.config


def hf_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a z-lab DFlash checkpoint with its shape (as in z-lab/Qwen3-4B-DFlash-b16)."""
    shapes = {f"{DRAFT_LAYERS}.{i}.{name}": shape for i in range(cfg.num_hidden_layers)
              for name, shape in checkpoint.layer_shapes(cfg.layer_config).items()}
    d = cfg.hidden_size
    shapes.update({"fc.weight": (d, len(cfg.target_layer_ids) * d), "hidden_norm.weight": (d,), "norm.weight": (d,)})
    return shapes


def to_hf(params: Params, cfg: DFlashConfig) -> dict[str, Any]:
    """Runtime tree -> checkpoint names (inverse of what `load_dflash` reads; the Markov
    head, which has a file of its own, is left out)."""
    tree = {(LAYERS if k == DRAFT_LAYERS else k): v for k, v in params.items() if k != MARKOV}
    return {n.removeprefix("model."): v for n, v in checkpoint.to_hf(tree, cfg.layer_config).items()}


def config_for(target_cfg: Qwen3Config, num_layers: int = 5, block_size: int = 16,
               target_layer_ids: tuple[int, ...] | None = None, mask_token_id: int | None = None) -> DFlashConfig:
    """A drafter config for `target_cfg` (its geometry, `num_layers` layers).

    target_layer_ids default to new_target_layer_ids; mask_token_id defaults to the last
    vocabulary row (for Qwen3 a padded row, like the published 151669).
    """
    ids = (new_target_layer_ids(target_cfg.num_hidden_layers, num_layers) if target_layer_ids is None
           else target_layer_ids)
    cfg = DFlashConfig(
        vocab_size=target_cfg.vocab_size, hidden_size=target_cfg.hidden_size,
        intermediate_size=target_cfg.intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=target_cfg.num_attention_heads, num_key_value_heads=target_cfg.num_key_value_heads,
        head_dim=target_cfg.head_dim, target_layer_ids=tuple(ids), num_target_layers=target_cfg.num_hidden_layers,
        mask_token_id=target_cfg.vocab_size - 1 if mask_token_id is None else mask_token_id,
        block_size=block_size, rms_norm_eps=target_cfg.rms_norm_eps, rope_theta=target_cfg.rope_theta,
        rope_scaling=target_cfg.rope_scaling, max_position_embeddings=target_cfg.max_position_embeddings)
    check_fits(cfg, target_cfg, "dflash.config_for")
    return cfg


def init_params(cfg: DFlashConfig, key: jax.Array, dtype: Any = jnp.float32, std: float = 0.02) -> Params:
    """Random drafter weights (normal(0, std) matrices, unit norms) in runtime layout."""
    k_layers, k_fc = jax.random.split(key)
    # the target's initialiser on a one-row vocabulary gives the layers in runtime layout
    layers = checkpoint.init_params(dataclasses.replace(cfg.layer_config, vocab_size=1), k_layers, dtype, std)[LAYERS]
    d = cfg.hidden_size
    return {
        "fc.weight": (std * jax.random.normal(k_fc, (d, len(cfg.target_layer_ids) * d), jnp.float32)).astype(dtype),
        "hidden_norm.weight": jnp.ones((d,), dtype),
        "norm.weight": jnp.ones((d,), dtype),
        DRAFT_LAYERS: layers,
    }


def init(target_cfg: Qwen3Config, key: jax.Array, num_layers: int = 5, block_size: int = 16,
         target_layer_ids: tuple[int, ...] | None = None, mask_token_id: int | None = None,
         dtype: Any = jnp.float32, std: float = 0.02) -> Drafter:
    """A random drafter for `target_cfg` (see config_for and init_params)."""
    cfg = config_for(target_cfg, num_layers, block_size, target_layer_ids, mask_token_id)
    return Drafter(init_params(cfg, key, dtype, std), cfg, jnp.dtype(dtype))


def load_dflash(path: str | Path, target: Model, dtype: Any = None, mesh: jax.sharding.Mesh | None = None,
                markov: bool = True) -> Drafter:
    """Load a public DFlash drafter folder for `target` (a Model); dtype defaults to the target's.
    Its Markov head (markov_head.safetensors) is loaded when present, unless `markov` is False.

    With a `jax.sharding.Mesh` (the target's, for a target loaded with `mesh=`), each weight
    is placed tensor-parallel over it as it is read, by the rule that places the target's
    (`specjax.sharding`: the layers' projections split, `fc` and the norms replicated).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a directory")
    cfg = DFlashConfig.from_file(folder / "config.json")
    check_fits(cfg, target.config, str(folder / "config.json"))
    dtype, transform, keep16 = reading(folder, dtype, target.dtype, mesh)
    params = checkpoint.layers_from_hf(checkpoint.iter_tensors(folder, hf_shapes(cfg), dtype, keep16=keep16),
                                       cfg.layer_config, DRAFT_LAYERS, transform=transform)
    vocab = None
    if (folder / VOCAB_FILE).is_file():
        raw = read_json(folder / VOCAB_FILE)
        vocab = check_vocab(raw.get("token_ids") if isinstance(raw, dict) else None, cfg.vocab_size,
                            str(folder / VOCAB_FILE))
    if markov and (folder / MARKOV_FILE).is_file():
        head = read_markov(folder / MARKOV_FILE, cfg.vocab_size)
        params[MARKOV] = head if mesh is None else jax.device_put(head, jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec()))
    return Drafter(params, cfg, dtype, folder, vocab)


def init_markov(vocab_size: int, rank: int, key: jax.Array, std: float = 0.02) -> Params:
    """A Markov head of `rank` that adds nothing yet: random w1, zero w2 (so a drafter it
    is added to drafts as before until it is trained)."""
    if rank < 1:
        raise ConfigError(f"a Markov head needs rank >= 1, got {rank}")
    return {"w1": std * jax.random.normal(key, (vocab_size, rank), jnp.float32),
            "w2": jnp.zeros((vocab_size, rank), jnp.float32)}


def markov_bias(markov: Params, prev: jax.Array) -> jax.Array:
    """The Markov head's logit bias [..., N] (float32) of block rows whose previous token is
    `prev` [...]: w1[prev] . w2 (w2's N rows: every token, or a draft vocabulary's rows as
    `drafters` passes them).

    DSpark (arXiv:2607.05147): the block pass's logits are unary, each row's independent
    of the tokens chosen at the others; a low-rank bigram term lets row k agree with the
    token actually chosen at row k-1, at the cost of an [r, N] product per row."""
    e = markov["w1"].astype(jnp.float32)[prev]  # [..., r]
    return jnp.einsum("...r,nr->...n", e, markov["w2"].astype(jnp.float32))


def read_markov(path: Path, vocab_size: int) -> Params:
    """A Markov head from its safetensors file, shapes checked (errors name the file)."""
    from safetensors.numpy import load_file

    try:
        raw = load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a bad file
        raise DFlashError(f"{path}: not a readable safetensors file ({e})") from e
    if set(raw) != set(MARKOV_NAMES.values()):
        raise DFlashError(f"{path}: expected tensors {sorted(MARKOV_NAMES.values())}, found {sorted(raw)}")
    head = {key: raw[name] for key, name in MARKOV_NAMES.items()}
    check_markov(head, vocab_size, str(path), MARKOV_NAMES)
    return {k: jnp.asarray(v, jnp.float32) for k, v in head.items()}


def check_markov(head: Any, vocab_size: int, source: str, names: dict[str, str] | None = None) -> None:
    """A Markov head's tensors w1 and w2 (named `names` in `source`) must both be [vocab_size,
    rank]; else a DFlashError naming `source`."""
    if not isinstance(head, dict) or set(head) != {"w1", "w2"}:
        raise DFlashError(f"{source}: a Markov head is {{'w1', 'w2'}}, got "
                          f"{sorted(head) if isinstance(head, dict) else type(head).__name__}")
    names = names or {"w1": "w1", "w2": "w2"}
    w1, w2 = tuple(np.shape(head["w1"])), tuple(np.shape(head["w2"]))
    if len(w1) != 2 or w1[0] != vocab_size or w2 != w1:
        raise DFlashError(f"{source}: {names['w1']} {w1} and {names['w2']} {w2} must both be "
                          f"[{vocab_size}, rank] (the target's vocabulary)")


def check_vocab(ids: Any, vocab_size: int, source: str) -> np.ndarray:
    """A draft vocabulary as sorted int32 ids, or DFlashError naming `source`."""
    if not isinstance(ids, (list, tuple, np.ndarray)) or len(ids) == 0:
        raise DFlashError(f"{source}: token_ids must be a non-empty list of token ids, got {type(ids).__name__}")
    arr = np.asarray(ids)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise DFlashError(f"{source}: token_ids must be a flat list of integers")
    if arr.min() < 0 or arr.max() >= vocab_size:
        raise DFlashError(f"{source}: token_ids must lie in [0, {vocab_size}), got {int(arr.min())} .. "
                          f"{int(arr.max())}")
    if np.any(np.diff(arr) <= 0):
        raise DFlashError(f"{source}: token_ids must be sorted and distinct")
    return arr.astype(np.int32)


def save_dflash(drafter: Drafter, path: str | Path, dtype: str | None = None) -> None:
    """Write config.json and model.safetensors in the public format (and draft_vocab.json
    when the drafter has a draft vocabulary, markov_head.safetensors when it has a Markov
    head); the argument order of `specjax.save`. dtype None: each weight as it is, in the
    narrowest type that holds them all (`checkpoint.lossless_dtype`), as `specjax.save`.

    The old order, save_dflash(path, drafter), still works for one release with a
    DeprecationWarning (told apart by the drafter's type).
    """
    if isinstance(path, Drafter) and not isinstance(drafter, Drafter):
        warnings.warn("save_dflash(path, drafter) is deprecated; use save_dflash(drafter, path), as specjax.save",
                      DeprecationWarning, stacklevel=2)
        drafter, path = path, drafter
    if not isinstance(drafter, Drafter):
        raise DFlashError(f"save_dflash(drafter, path) needs a Drafter, got {type(drafter).__name__}")
    folder = Path(path)
    raw = drafter.config.to_hf()
    tensors = to_hf(drafter.params, drafter.config)
    head = {MARKOV_NAMES[k]: np.asarray(v) for k, v in drafter.params.get(MARKOV, {}).items()}
    dtype = checkpoint.lossless_dtype(tensors | head) if dtype is None else checkpoint.save_dtype(dtype)
    raw["torch_dtype"] = checkpoint.write_tensors(folder, tensors, dtype)
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    if drafter.vocab is not None:
        (folder / VOCAB_FILE).write_text(json.dumps({"token_ids": [int(i) for i in drafter.vocab]}))
    else:
        (folder / VOCAB_FILE).unlink(missing_ok=True)
    if head:
        checkpoint.save_safetensors({k: jnp.asarray(v).astype(dtype) for k, v in head.items()}, folder / MARKOV_FILE)
    else:
        (folder / MARKOV_FILE).unlink(missing_ok=True)


# ---------------------------------------------------------------------------- forward

@struct.dataclass
class ContextCache:
    k: jax.Array       # [L, K, S, E] context keys (k_norm + RoPE), slot = absolute position
    v: jax.Array       # [L, K, S, E] context values
    length: jax.Array  # [] int32: committed context rows (positions 0 .. length-1)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


def init_cache(cfg: DFlashConfig, capacity: int, dtype: Any = jnp.float32) -> ContextCache:
    """An empty context cache of `capacity` positions."""
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, capacity, cfg.head_dim)
    return ContextCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))


def _split_qkv(cfg: DFlashConfig, qkv: jax.Array) -> list[jax.Array]:
    nh, nk, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return jnp.split(qkv, [nh * hd, (nh + nk) * hd], axis=-1)


def _layer_trees(params: Params) -> tuple[Params, ...]:
    """The drafter layers as per-layer trees, from either layout. Drafters have a handful of
    layers, so both unroll into one traced copy per layer; the loaded (unstacked) layout
    reads each layer's weights in place."""
    return checkpoint.unstack(params, DRAFT_LAYERS)[DRAFT_LAYERS]


def context_rows(params: Params, cfg: DFlashConfig, x: jax.Array, positions: jax.Array
                 ) -> list[tuple[jax.Array, jax.Array]]:
    """Per drafter layer, K (k_norm + RoPE at `positions` [R, T]) and V, each [R, T, K, E],
    of context rows c = hidden_norm(fc(x)) for concatenated target features x [R, T, n*D]."""
    nh, nk, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    r, t, _ = x.shape
    x = x.astype(params["fc.weight"].dtype)
    c = rms_norm(linear(x, params["fc.weight"]), params["hidden_norm.weight"], eps)  # [R, T, D]
    out = []
    for lp in _layer_trees(params):
        # c feeds every layer's k/v projection directly (no input_layernorm on the context)
        k, v = jnp.split(linear(c, cpu_kernels.rows_from(lp["self_attn.qkv_proj.weight"], nh * hd)), 2, axis=-1)
        k = rms_norm(k.reshape(r, t, nk, hd), lp["self_attn.k_norm.weight"], eps)
        out.append((rope(k, positions, cfg.rope_theta, cfg.rope_scaling), v.reshape(r, t, nk, hd)))
    return out


def _context_kv(params: Params, cfg: DFlashConfig, x: jax.Array, positions: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
    """`context_rows` of one sequence (x [T, n*D], positions [T]) as [L, K, T, E] each."""
    rows = context_rows(params, cfg, x[None], positions[None])
    return (jnp.stack([k[0].transpose(1, 0, 2) for k, _ in rows]),
            jnp.stack([v[0].transpose(1, 0, 2) for _, v in rows]))


def _block_pass(params: Params, cfg: DFlashConfig, x: jax.Array, q_pos: jax.Array, ctx_k: jax.Array,
                ctx_v: jax.Array, mask: jax.Array) -> jax.Array:
    """The drafter layers over block rows x [Q, D] at positions q_pos [Q]; final-normed [Q, D].

    ctx_k/ctx_v [L, K, S, E] are the context rows; mask [Q, S + Q] says which context rows
    (first S columns) and block rows (last Q) each block row sees.
    """
    nh, nk, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    q_len, dtype = x.shape[0], x.dtype
    pos = q_pos[None]  # [1, Q]
    for i, lp in enumerate(_layer_trees(params)):
        h = rms_norm(x, lp["input_layernorm.weight"], eps)
        q, bk, bv = _split_qkv(cfg, linear(h, lp["self_attn.qkv_proj.weight"]))
        q = rope(rms_norm(q.reshape(1, q_len, nh, hd), lp["self_attn.q_norm.weight"], eps), pos, cfg.rope_theta,
                 cfg.rope_scaling)
        bk = rope(rms_norm(bk.reshape(1, q_len, nk, hd), lp["self_attn.k_norm.weight"], eps), pos, cfg.rope_theta,
                  cfg.rope_scaling)
        keys = jnp.concatenate([ctx_k[i][None].astype(dtype), bk.transpose(0, 2, 1, 3)], axis=2)  # [1, K, S+Q, E]
        values = jnp.concatenate([ctx_v[i][None].astype(dtype), bv.reshape(1, q_len, nk, hd).transpose(0, 2, 1, 3)],
                                 axis=2)
        x = mlp(lp, x + linear(attend_masked(q, keys, values, mask[None])[0], lp["self_attn.o_proj.weight"]), eps)
    return rms_norm(x, params["norm.weight"], eps)


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def append_context(params: Params, cfg: DFlashConfig, cache: ContextCache, features: jax.Array,
                   count: jax.Array, positions: jax.Array) -> ContextCache:
    """Write context rows for target features [n, T, D] at absolute `positions` [T].

    Every row's K/V is written (stale rows past the committed ones are overwritten by the
    next append, which starts at length + count); the length grows by `count`.
    """
    n, t, d = features.shape
    x = features.transpose(1, 0, 2).reshape(t, n * d)  # [T, n*D] in target_layer_ids order
    k, v = _context_kv(params, cfg, x, positions)  # [L, K, T, E]
    return cache.replace(
        k=cache.k.at[:, :, positions].set(k.astype(cache.k.dtype), mode="drop"),
        v=cache.v.at[:, :, positions].set(v.astype(cache.v.dtype), mode="drop"),
        length=cache.length + count.astype(jnp.int32))


@partial(jax.jit, static_argnames=("cfg", "target_cfg", "k"))
def draft_block(params: Params, cfg: DFlashConfig, cache: ContextCache, target_params: Params,
                target_cfg: Qwen3Config, last_token: jax.Array, start: jax.Array, k: int) -> jax.Array:
    """Draft logits [k, V] (float32) for the k tokens after `last_token` (at position `start`).

    One pass over the block [last, mask x (B-1)] at positions start .. start+B-1: every block
    row sees every context row before `start` and every block row. Row j predicts the token
    at start + j; row 0 is discarded. The cache is only read.
    """
    b = cfg.block_size
    embed = target_params["model.embed_tokens.weight"]
    tokens = jnp.full((b,), cfg.mask_token_id, jnp.int32).at[0].set(last_token)
    x = cpu_kernels.rows(embed, tokens).astype(params["fc.weight"].dtype)  # [B, D]
    q_pos = start + jnp.arange(b, dtype=jnp.int32)
    seen = jnp.arange(cache.capacity) < start  # slots at or after start are stale
    mask = jnp.concatenate([jnp.broadcast_to(seen, (b, cache.capacity)), jnp.ones((b, b), bool)], axis=1)
    h = _block_pass(params, cfg, x, q_pos, cache.k, cache.v, mask)[1:k + 1]  # [k, D]
    return unembed(target_params, target_cfg, h.astype(embed.dtype))


def block_mask(anchors: jax.Array, block_size: int, context: int) -> jax.Array:
    """Training attention mask [N*B, context + N*B] of N packed blocks (anchors [N]).

    A row of block n sees the context rows strictly before anchors[n] and every row of
    block n (bidirectional), never a row of another block.
    """
    owner = jnp.repeat(jnp.arange(anchors.shape[0]), block_size)  # [N*B] block of each row
    ctx = jnp.arange(context)[None, :] < jnp.repeat(anchors, block_size)[:, None]  # [N*B, T]
    return jnp.concatenate([ctx, owner[:, None] == owner[None, :]], axis=1)


@partial(jax.jit, static_argnames=("cfg", "target_cfg"))
def block_logits(params: Params, cfg: DFlashConfig, target_params: Params, target_cfg: Qwen3Config,
                 features: jax.Array, block_ids: jax.Array, anchors: jax.Array) -> jax.Array:
    """Training forward: logits [N, B-1, V] (float32) of N blocks of one sequence in one pass.

    features [T, n*D] are the target taps of positions 0 .. T-1 (concatenated in
    target_layer_ids order); block n has tokens block_ids[n] [B] at positions
    anchors[n] .. anchors[n]+B-1 and sees only context before its anchor (block_mask), so
    its row k equals draft_block's row k with the context cut at the anchor: the
    prediction of the token at anchors[n] + k (row 0 is dropped).
    """
    n_blocks, b = block_ids.shape
    t = features.shape[0]
    embed = target_params["model.embed_tokens.weight"]
    ctx_k, ctx_v = _context_kv(params, cfg, features, jnp.arange(t, dtype=jnp.int32))  # [L, K, T, E]
    x = cpu_kernels.rows(embed, block_ids.reshape(-1)).astype(params["fc.weight"].dtype)  # [N*B, D]
    q_pos = (anchors[:, None] + jnp.arange(b, dtype=jnp.int32)).reshape(-1)  # [N*B]
    h = _block_pass(params, cfg, x, q_pos, ctx_k, ctx_v, block_mask(anchors, b, t))
    return unembed(target_params, target_cfg, h.reshape(n_blocks, b, -1)[:, 1:].astype(embed.dtype))


def block_markov_logits(markov: Params, logits: jax.Array, tokens: jax.Array, anchors: jax.Array) -> jax.Array:
    """Training: `block_logits`' [N, B-1, V] of one sequence (tokens [T]) plus the Markov
    head's bias from the true token before each row's label (teacher forcing): row k of
    block n is biased by tokens[anchors[n] + k - 1]. Where the drafts before a row are
    right this is the row's logits as `drafters.markov_drafts` drafts them."""
    prev = tokens[jnp.minimum(anchors[:, None] + jnp.arange(logits.shape[1]), tokens.shape[0] - 1)]  # [N, B-1]
    return logits.astype(jnp.float32) + markov_bias(markov, prev)
