"""Qwen3 decoder as pure functions over the runtime parameter tree (see checkpoint.py).

Shape letters are those of kv.py. With `kv=None` attention is causal over the given tokens
only (training, parity tests; each row's positions must increase along T); with a KVCache
the tokens' keys and values are written at their absolute positions first and every query
attends to all slots at or before its own position (with a cache, each row's T positions
must be contiguous). Numerics follow transformers' Qwen3: norms, softmax and logits in
float32. Layers run under `lax.scan` in the stacked layout and as a Python loop in the
unstacked (inference) one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from . import cpu_kernels
from . import kv as kvlib
from .checkpoint import LAYERS, Params
from .config import Qwen3Config, RopeScaling
from .reductions import sum_last


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, scaled by `weight` in the input dtype (as HF does);
    the mean of squares in a fixed order (`sum_last`), so a verify step's rows get the
    decode steps' bits."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(sum_last(x32 * x32) / x32.shape[-1] + eps)
    return weight * y.astype(x.dtype)


def linear(x: jax.Array, w: jax.Array | cpu_kernels.Packed, b: jax.Array | None = None) -> jax.Array:
    """x [..., in] times a HF-oriented weight [out, in] (or one packed for the CPU kernel)."""
    if isinstance(w, cpu_kernels.Packed):
        y = cpu_kernels.matmul(x, w)
    else:
        y = jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))
    return y if b is None else y + b


def mlp(lp: Params, x: jax.Array, eps: float) -> jax.Array:
    """The residual stream after a decoder layer's SwiGLU MLP (post-attention norm included)."""
    h = rms_norm(x, lp["post_attention_layernorm.weight"], eps)
    gate, up = jnp.split(linear(h, lp["mlp.gate_up_proj.weight"]), 2, axis=-1)
    return x + linear(jax.nn.silu(gate) * up, lp["mlp.down_proj.weight"])


def rope_frequencies(e: int, theta: float, scaling: RopeScaling | None = None) -> tuple[jax.Array, float]:
    """The inverse frequencies [E/2] (float32) of a rotary embedding over E dimensions, and
    the factor cos and sin are scaled by (`config.RopeScaling`: transformers' formulas,
    float32 in the same order)."""
    exponents = jnp.arange(0, e, 2, dtype=jnp.float32) / e
    if scaling is None:
        return 1.0 / (theta ** exponents), 1.0
    if scaling.rope_type == "linear":
        return 1.0 / (theta ** exponents) / scaling.factor, 1.0
    # yarn: dimension d turns original / (2 pi theta^(d/E)) times over the pretraining
    # length; the ramp runs from the dimension turning beta_fast times to that turning
    # beta_slow times (indices into the E/2 frequencies, clipped to [0, E - 1] as
    # transformers clips them)
    turning = lambda rotations: (e * math.log(scaling.original_max_position_embeddings  # noqa: E731
                                              / (rotations * 2 * math.pi))) / (2 * math.log(theta))
    low, high = turning(scaling.beta_fast), turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, e - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(e // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # the share of each frequency left unscaled (extrapolated)
    pos_freqs = theta ** exponents
    inv_freq = 1.0 / (scaling.factor * pos_freqs) * (1 - kept) + 1.0 / pos_freqs * kept
    return inv_freq, scaling.attention_factor


RopeTables = tuple[jax.Array, jax.Array]  # cos and sin [B, T, 1, E], float32 (`rope_tables`)


def _computed_once(make: Callable[[], Any], x: jax.Array) -> Any:
    """make()'s arrays, computed once for all of their users. XLA:CPU fuses an elementwise
    producer into each consumer, which recomputes it for every element the consumer makes:
    RoPE's cos and sin for every element of every layer's queries and keys, a few per cent
    of a tiny-code verify step. It also drops optimization barriers before fusing, so on CPU
    the arrays are made by a conditional, whose branches are never fused into their users;
    the predicate (on x, an input of make) takes either branch, both the same. make should
    take traced inputs only: constants folded outside a branch may not be folded inside it.
    Elsewhere fusion is left alone (a GPU's conditional waits for its predicate on the host)."""
    if jax.default_backend() != "cpu":
        return make()
    return jax.lax.cond(jnp.any(x < 0), make, make)


def rope_tables(positions: jax.Array, e: int, theta: float, scaling: RopeScaling | None = None) -> RopeTables:
    """cos and sin (float32, times the scaling's attention factor) of a rotary embedding over
    E dimensions at positions [B, T]: what `rotate` turns vectors by."""
    inv_freq, attention = rope_frequencies(e, theta, scaling)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, E/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = _computed_once(lambda: (jnp.cos(emb), jnp.sin(emb)), emb)
    if attention != 1.0:
        cos, sin = cos * attention, sin * attention
    return cos, sin


def rotate(x: jax.Array, tables: RopeTables) -> jax.Array:
    """x [B, T, N, E] turned by `rope_tables` (rotate-half convention, in x's dtype)."""
    cos, sin = (t.astype(x.dtype) for t in tables)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def rope(x: jax.Array, positions: jax.Array, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """Rotary embedding (rotate-half convention) of x [B, T, N, E] at positions [B, T],
    with a config's RoPE scaling if it has one."""
    return rotate(x, rope_tables(positions, x.shape[-1], theta, scaling))


def attend(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """Grouped-query attention; q [B, T, H, E], k/v [B, K, S, E]; key j is seen iff k_pos <= q_pos."""
    return attend_masked(q, k, v, k_pos[:, None, :] <= q_pos[:, :, None])


CAUSAL_BLOCK = 256


def attend_causal(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                  block: int = CAUSAL_BLOCK) -> jax.Array:
    """`attend` of T tokens over themselves (positions [B, T] increasing along T), by blocks
    of `block` queries that score only the keys up to their block's end.

    The keys past a block are masked for all its queries anyway (positions increase), so
    this is the same softmax minus exactly-zero terms; it skips ~(1 - 1/n)/2 of the scores
    for n blocks, and their [B, K, T*G, T] float32 buffers, which training keeps for the
    backward pass (docs/performance.md, "Loading and training").
    """
    starts = range(0, q.shape[1], block)
    return jnp.concatenate([attend(q[:, s:s + block], k[:, :, :s + block], v[:, :, :s + block],
                                   positions[:, s:s + block], positions[:, :s + block])
                            for s in starts], axis=1)


def attend_masked(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention under an explicit mask [B, T, S] (True: query t sees key s).

    Queries are laid out [B, K, T*G, E] so both products are plain batched matmuls, the
    form XLA:CPU runs fastest (faster than an einsum over [T, K, G, E]).
    """
    b, t, h, e = q.shape
    kh = k.shape[1]
    g = h // kh
    qg = q.reshape(b, t, kh, g, e).transpose(0, 2, 1, 3, 4).reshape(b, kh, t * g, e)
    scores = jax.lax.dot_general(qg, k, (((3,), (3,)), ((0, 1), (0, 1))),
                                 preferred_element_type=jnp.float32) * (e ** -0.5)  # [B, K, T*G, S]
    scores = jnp.where(jnp.repeat(mask, g, axis=1)[:, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jax.lax.dot_general(probs, v, (((3,), (2,)), ((0, 1), (0, 1))))  # [B, K, T*G, E]
    return out.reshape(b, kh, t, g, e).transpose(0, 2, 1, 3, 4).reshape(b, t, h * e)


ALL_BITS = -1  # `visible` bits of a step whose queries see every position up to their limit


def visible(n: int, limit: jax.Array, base: jax.Array, bits: jax.Array) -> jax.Array:
    """[B, T, n]: whether query t of row b sees position j: j <= limit[b, t], and for the 32
    positions base[b] + i only where bit i of bits[b, t] is set. A tree step writes its
    nodes at base + node index, and a node's bits are its ancestors and itself, so it sees
    the committed prefix and its own path (what the CPU attention kernel computes too)."""
    j = jnp.arange(n)[None, None, :]
    d = j - base[:, None, None]
    own = (jnp.right_shift(bits[:, :, None].astype(jnp.uint32), jnp.clip(d, 0, 31).astype(jnp.uint32)) & 1) > 0
    return (j <= limit[:, :, None]) & ((d < 0) | (d >= 32) | own)


def _attend_layer(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array,
                  slots: jax.Array, limit: jax.Array, base: jax.Array, bits: jax.Array) -> jax.Array:
    """XLA's attention of q [B, T, H, E] over one layer of the pools: each row gathers its
    own positions (slots [B, N], `kv.row_slots`), so its cost follows its own length, not
    the pool's or the batch's; which positions a query sees: `visible`."""
    n = slots.shape[1]
    k = jnp.take(kvlib.layer_slots(k_pool, layer), slots, axis=1).transpose(1, 0, 2, 3)  # [B, K, N, E]
    v = jnp.take(kvlib.layer_slots(v_pool, layer), slots, axis=1).transpose(1, 0, 2, 3)
    return attend_masked(q, k.astype(q.dtype), v.astype(q.dtype), visible(n, limit, base, bits))


def _layer(cfg: Qwen3Config, lp: Params, x: jax.Array, positions: jax.Array, tables: RopeTables,
           cache: tuple | None, layer: jax.Array, sees: jax.Array | None = None,
           ancestors: jax.Array | None = None, at: jax.Array | None = None,
           base: jax.Array | None = None) -> tuple[jax.Array, tuple | None]:
    """One decoder layer (`tables`: RoPE's at `positions`); returns the new residual stream
    and the updated pools. With a cache, the step's tokens are written from slot at [B] on
    (default positions[:, 0]) and query t attends to the positions up to sees[:, t]
    (default: its own), of the 32 from base [B] on (default: at) only those in
    ancestors[:, t] (`visible`; default: all)."""
    b, t, _ = x.shape
    hd, nh, nk = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    h = rms_norm(x, lp["input_layernorm.weight"], cfg.rms_norm_eps)
    qkv = linear(h, lp["self_attn.qkv_proj.weight"], lp.get("self_attn.qkv_proj.bias"))
    q, k, v = jnp.split(qkv, [nh * hd, (nh + nk) * hd], axis=-1)
    q = rotate(rms_norm(q.reshape(b, t, nh, hd), lp["self_attn.q_norm.weight"], cfg.rms_norm_eps), tables)
    k = rotate(rms_norm(k.reshape(b, t, nk, hd), lp["self_attn.k_norm.weight"], cfg.rms_norm_eps), tables)
    v = v.reshape(b, t, nk, hd)
    if cache is None:
        attn = attend_causal(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), positions)
    else:
        k_pool, v_pool, page_table, page_size, slots = cache
        at = positions[:, 0] if at is None else at
        k_pool, v_pool = kvlib.write_layer(k_pool, v_pool, layer, k, v, page_table, at, page_size)
        limit = positions if sees is None else sees
        bits = jnp.full(positions.shape, ALL_BITS, jnp.int32) if ancestors is None else ancestors
        view = (slots, limit, at if base is None else base, bits)
        if cpu_kernels.applies(q, k_pool):
            attn = cpu_kernels.paged_attention(q, k_pool, v_pool, layer, *view, _attend_layer)
        else:
            attn = _attend_layer(q, k_pool, v_pool, layer, *view)
        cache = (k_pool, v_pool, page_table, page_size, slots)
    x = x + linear(attn, lp["self_attn.o_proj.weight"], lp.get("self_attn.o_proj.bias"))
    return mlp(lp, x, cfg.rms_norm_eps), cache


def hidden_states(params: Params, cfg: Qwen3Config, tokens: jax.Array, positions: jax.Array,
                  kv: kvlib.KVCache | None = None, taps: tuple[int, ...] = (), sees: jax.Array | None = None,
                  ancestors: jax.Array | None = None, at: jax.Array | None = None, base: jax.Array | None = None
                  ) -> tuple[jax.Array, kvlib.KVCache | None, jax.Array | None]:
    """Final-normed hidden states [B, T, D], the updated cache, and taps [n, B, T, D].

    taps[i] is the residual stream after layer taps[i] (transformers' hidden_states[id + 1];
    for the last layer that is the final-normed state, as in transformers). The cache's
    lengths are not changed here: the caller decides how many tokens it commits. `sees`
    [B, T] (with a cache) lets query t attend to every position up to sees[:, t] instead of
    its own (a DFlash block: every block row sees the whole block). A tree step (with a
    cache) writes node i at position positions[:, 0] + i, takes positions (RoPE) = that
    start + the node's depth, sees = start + i, and ancestors [B, T] int32: bit j set when
    node j is node t's ancestor or itself (`trees.ancestor_bits`). A step over part of a
    tree (a draft model's tree, one depth a step: `drafters.draft_tree`) writes its tokens
    from slot `at` [B] on instead of positions[:, 0], and bit j of ancestors is slot
    base [B] + j (default: at).
    """
    x = cpu_kernels.rows(params["model.embed_tokens.weight"], tokens)
    cache = None if kv is None else (kv.k, kv.v, kv.page_table, kv.page_size)
    tables = rope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # once for every layer

    def body(carry, xs):
        x, pools = carry
        lp, layer = xs
        c = None if pools is None else (*pools, kv.page_table, kv.page_size, slots)
        x, c = _layer(cfg, lp, x, positions, tables, c, layer, sees, ancestors, at, base)
        return (x, None if c is None else c[:2]), (x if taps else None)

    pools = None if cache is None else cache[:2]
    slots = None if kv is None else kvlib.row_slots(kv.page_table, kv.page_size)
    if isinstance(params[LAYERS], tuple):  # inference layout: one traced copy per layer
        per_layer = []
        for i, lp in enumerate(params[LAYERS]):
            (x, pools), out = body((x, pools), (lp, jnp.int32(i)))
            per_layer.append(out)
    else:  # training layout: one layer body under scan
        layer_ids = jnp.arange(cfg.num_hidden_layers)
        (x, pools), per_layer = jax.lax.scan(body, (x, pools), (params[LAYERS], layer_ids))
    h = rms_norm(x, params["model.norm.weight"], cfg.rms_norm_eps)
    tapped = None
    if taps:
        last = cfg.num_hidden_layers - 1
        tapped = jnp.stack([h if i == last else per_layer[i] for i in taps])
    if kv is not None:
        kv = kv.replace(k=pools[0], v=pools[1])
    return h, kv, tapped


def head_weight(params: Params, cfg: Qwen3Config) -> jax.Array | cpu_kernels.Packed:
    """The output projection [V, D]: the embedding table when tied."""
    return params["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]


def unembed(params: Params, cfg: Qwen3Config, h: jax.Array) -> jax.Array:
    """Logits in float32 from final hidden states."""
    return project(head_weight(params, cfg), h)


def project(w: jax.Array | cpu_kernels.Packed, h: jax.Array) -> jax.Array:
    """Logits in float32 of hidden states h [..., D] against a head weight w [V, D]."""
    if isinstance(w, cpu_kernels.Packed):
        return cpu_kernels.matmul(h, w)
    return jax.lax.dot_general(h, w, (((h.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def forward(params: Params, cfg: Qwen3Config, tokens: jax.Array, positions: jax.Array,
            kv: kvlib.KVCache | None = None, taps: tuple[int, ...] = ()
            ) -> tuple[jax.Array, kvlib.KVCache | None, Any]:
    """Logits [B, T, V] (float32), the updated cache and the requested taps."""
    h, kv, tapped = hidden_states(params, cfg, tokens, positions, kv, taps)
    return unembed(params, cfg, h), kv, tapped
