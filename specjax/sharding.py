"""Tensor-parallel placement of a target's weights over a device mesh (JAX SPMD).

`specjax.shard(model)` (`specjax.model`, with `load(path, mesh=)`) places each weight with a `NamedSharding` in the Megatron pattern: the
fused q/k/v and gate/up projections split by output rows, the o and down projections by
input columns (their products are summed across devices), the embedding (and the
untied head) by vocabulary rows, norms replicated. Nothing else changes: the compiled
steps are the same functions, and XLA's SPMD partitioner derives the collectives and the
placement of everything the steps create (KV pools, logits, drafter state), so every
proposer runs unchanged on a sharded target.

Exactness holds within one placement (speculative == plain, the tests check it); against
an unsharded run the cross-device sums change float rounding, so logits agree to float32
tolerance, not bit for bit. The fused q/k/v rows are split as one block, not per head, so
XLA reshards them for attention; a head-aligned layout would avoid that exchange.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import cpu_kernels
from .checkpoint import LAYERS, Params, Transform
from .errors import SpecjaxError

AXIS = "tp"

# weight name suffix -> the dimension split across the mesh axis (weights not named: replicated)
SPLIT_DIM = {
    "self_attn.qkv_proj.weight": 0, "self_attn.qkv_proj.bias": 0, "mlp.gate_up_proj.weight": 0,
    "self_attn.o_proj.weight": 1, "mlp.down_proj.weight": 1,
    "model.embed_tokens.weight": 0, "lm_head.weight": 0,
}


class ShardingError(SpecjaxError):
    """A weight that cannot be split evenly over the requested devices."""


def make_mesh(devices: Sequence[jax.Device] | None = None, axis: str = AXIS) -> Mesh:
    """A one-axis mesh over `devices` (default: all local devices)."""
    return Mesh(np.array(list(devices if devices is not None else jax.local_devices())), (axis,))


def mesh_axis(mesh: Mesh) -> str:
    """The axis that `load(..., mesh=)` splits weights over: AXIS where the mesh has it,
    else the mesh's only axis; a mesh of several axes, none of them AXIS, is refused by
    name (which one is tensor-parallel is not for specjax to guess)."""
    names = tuple(mesh.axis_names)
    if AXIS in names:
        return AXIS
    if len(names) == 1:
        return names[0]
    raise ShardingError(f"mesh axes {names}: none is named {AXIS!r}, the axis specjax splits weights over; "
                        f"name the tensor-parallel one {AXIS!r} or pass a one-axis mesh (specjax.make_mesh)")


def spec_for(name: str, shape: tuple[int, ...], n_devices: int, axis: str = AXIS) -> PartitionSpec:
    """The PartitionSpec of weight `name` (an HF name, or a layer's name within the layer)."""
    dim = next((d for suffix, d in SPLIT_DIM.items() if name.endswith(suffix)), None)
    if dim is None:
        return PartitionSpec()
    if shape[dim] % n_devices:
        raise ShardingError(f"weight {name!r} {tuple(shape)}: dimension {dim} ({shape[dim]}) does not split "
                            f"evenly over {n_devices} devices")
    return PartitionSpec(*([None] * dim), axis)


def placer(mesh: Mesh, axis: str = AXIS) -> Transform:
    """A loading transform (`checkpoint.layers_from_hf`) that places a weight, or every
    weight of a layer, over `mesh` by spec_for (in the HF layout: XLA's dots then)."""
    n = mesh.shape[axis]

    def put(name: str, leaf: Any) -> jax.Array:
        leaf = cpu_kernels.unpack_tree(leaf)
        return jax.device_put(leaf, NamedSharding(mesh, spec_for(name, leaf.shape, n, axis)))

    def place(name: str, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: put(f"{name}.{k}", w) for k, w in value.items()}
        return put(name, value)

    return place


def shard_params(params: Params, mesh: Mesh, axis: str = AXIS) -> Params:
    """The parameter tree (inference layout) placed over `mesh` by spec_for."""
    place = placer(mesh, axis)
    out: Params = {}
    for key, value in params.items():
        if key == LAYERS:
            if not isinstance(value, tuple):
                raise ShardingError("shard_params needs the inference layout (checkpoint.unstack)")
            out[key] = tuple(place(f"{LAYERS}.{i}", layer) for i, layer in enumerate(value))
        else:
            out[key] = place(key, value)
    return out

