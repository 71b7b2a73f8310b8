"""DFlash drafter: public checkpoint format, forward parity with a NumPy re-derivation of
z-lab/dflash's drafter forward (`dflash/model.py`), the context cache, and speculative exactness."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.cpu_kernels import pack_tree, unpack_tree
from specjax import checkpoint, dflash
from specjax.config import ConfigError
from specjax.dflash import append_context, draft_block, init_cache, load_dflash, save_dflash
from specjax.proposers import DFlashProposer, ProposerError
from specjax.sampling import Sampling

SAMPLED = Sampling(temperature=0.8, top_k=40, top_p=0.9)
# scaled-down z-lab config (z-lab/Qwen3-4B-DFlash-b16's config.json) for the tiny target of conftest (D 64, 3 layers, V 101);
# the drafter's own head geometry differs from the target's on purpose
HANDMADE = {
    "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "model_type": "qwen3", "block_size": 8, "dflash_config": {"mask_token_id": 100, "target_layer_ids": [0, 2]},
    "num_target_layers": 3, "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 80,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "rope_scaling": None, "max_position_embeddings": 4096,
    "layer_types": ["full_attention"] * 2, "sliding_window": None, "use_sliding_window": False,
    "max_window_layers": 2, "attention_bias": False, "attention_dropout": 0.0, "vocab_size": 101,
    "tie_word_embeddings": True, "dtype": "bfloat16", "initializer_range": 0.02, "use_cache": True,
}


def _handmade_tensors(raw, rng):
    """Random weights named and shaped as in z-lab's published checkpoints, rounded to bf16 as published."""
    d, f, e = raw["hidden_size"], raw["intermediate_size"], raw["head_dim"]
    q, kv = raw["num_attention_heads"] * e, raw["num_key_value_heads"] * e
    shapes = {"fc.weight": (d, len(raw["dflash_config"]["target_layer_ids"]) * d),
              "hidden_norm.weight": (d,), "norm.weight": (d,)}
    for i in range(raw["num_hidden_layers"]):
        shapes.update({f"layers.{i}.{n}": s for n, s in {
            "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
            "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
            "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
            "self_attn.q_norm.weight": (e,), "self_attn.k_norm.weight": (e,),
            "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f)}.items()})
    out = {}
    for name, shape in shapes.items():
        x = 1 + 0.2 * rng.standard_normal(shape) if name.endswith("norm.weight") else 0.15 * rng.standard_normal(shape)
        out[name] = x.astype(jnp.bfloat16)
    return out


def _write(folder, raw, tensors):
    from safetensors.numpy import save_file
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def handmade(tmp_path_factory):
    """(folder, HF tensors as float64) of a drafter written by hand in the public format."""
    tensors = _handmade_tensors(HANDMADE, np.random.default_rng(0))
    folder = _write(tmp_path_factory.mktemp("dflash_hand"), HANDMADE, tensors)
    return folder, {k: v.astype(np.float64) for k, v in tensors.items()}


@pytest.fixture(scope="module")
def drafter16(tiny):
    """A random block-16 drafter for the tiny target, tapping its first and last layer."""
    return dflash.init(tiny[2].config, jax.random.key(0), num_layers=2, target_layer_ids=(0, 2), std=0.2)


# --------------------------------------------------------------- NumPy re-derivation (2.2)

def _np_rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _np_frequencies(raw):
    """(inverse frequencies [E/2], cos / sin factor) of a config's RoPE: NumPy for plain
    RoPE, transformers' own functions for a scaled one."""
    e, theta = raw["head_dim"], raw["rope_theta"]
    if not raw.get("rope_scaling"):
        return theta ** (-np.arange(0, e, 2) / e), 1.0
    from transformers import Qwen3Config as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ref = HFConfig(head_dim=e, rope_theta=theta, rope_scaling=dict(raw["rope_scaling"]),
                   max_position_embeddings=raw["max_position_embeddings"])
    inv_freq, factor = ROPE_INIT_FUNCTIONS[ref.rope_parameters["rope_type"]](ref, None)
    return inv_freq.double().numpy(), factor


def _np_rope(x, pos, frequencies):
    """x [T, N, E] rotated (rotate-half) at positions [T] (`_np_frequencies`)."""
    inv_freq, factor = frequencies
    freqs = pos[:, None] * inv_freq
    cos, sin = [factor * np.concatenate([g(freqs)] * 2, axis=-1)[:, None] for g in (np.cos, np.sin)]
    x1, x2 = np.split(x, 2, axis=-1)
    return x * cos + np.concatenate([-x2, x1], axis=-1) * sin


def _np_block_logits(t, raw, features, last, embed):
    """Logits [B-1, V] of the block after context features [n, C, D] (positions 0 .. C-1),
    recomputing K/V of the whole context: no cache."""
    eps, rotary, b = raw["rms_norm_eps"], _np_frequencies(raw), raw["block_size"]
    nh, nk, e = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    n, c_len, d = features.shape
    c = _np_rms(features.transpose(1, 0, 2).reshape(c_len, n * d) @ t["fc.weight"].T, t["hidden_norm.weight"], eps)
    x = embed[[last] + [raw["dflash_config"]["mask_token_id"]] * (b - 1)]
    q_pos = c_len + np.arange(b)
    k_pos = np.arange(c_len + b)
    for i in range(raw["num_hidden_layers"]):
        w = {k[len(f"layers.{i}."):]: v for k, v in t.items() if k.startswith(f"layers.{i}.")}
        u = _np_rms(x, w["input_layernorm.weight"], eps)
        q = _np_rope(_np_rms((u @ w["self_attn.q_proj.weight"].T).reshape(b, nh, e), w["self_attn.q_norm.weight"], eps),
                     q_pos, rotary)
        both = np.concatenate([c, u])  # context rows are not layer-normed
        k = _np_rope(_np_rms((both @ w["self_attn.k_proj.weight"].T).reshape(-1, nk, e),
                             w["self_attn.k_norm.weight"], eps), k_pos, rotary)
        v = (both @ w["self_attn.v_proj.weight"].T).reshape(-1, nk, e)
        out = np.zeros((b, nh, e))
        for h in range(nh):
            s = q[:, h] @ k[:, h * nk // nh].T / np.sqrt(e)  # no mask
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            out[:, h] = (p / p.sum(axis=-1, keepdims=True)) @ v[:, h * nk // nh]
        x = x + out.reshape(b, nh * e) @ w["self_attn.o_proj.weight"].T
        m = _np_rms(x, w["post_attention_layernorm.weight"], eps)
        gate, up = m @ w["mlp.gate_proj.weight"].T, m @ w["mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w["mlp.down_proj.weight"].T
    return _np_rms(x, t["norm.weight"], eps)[1:] @ embed.T  # tied target head


# --------------------------------------------------------------------------- format

def test_default_target_layer_ids():
    assert dflash.default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert dflash.default_target_layer_ids(24, 1) == (12,)
    assert dflash.default_target_layer_ids(64, 2) == (1, 61)
    raw = {**HANDMADE, "dflash_config": {"mask_token_id": 100}}
    assert dflash.DFlashConfig.from_hf(raw).target_layer_ids == (1, 0)


def test_new_drafter_taps_are_distinct_target_layers():
    for layers in range(1, 41):
        for n in range(1, 7):
            zlab = dflash.default_target_layer_ids(layers, n)
            if n > layers:
                with pytest.raises(ConfigError, match="pass target_layer_ids"):
                    dflash.new_target_layer_ids(layers, n)
                continue
            ids = dflash.new_target_layer_ids(layers, n)
            assert len(ids) == n and 0 <= ids[0] and ids[-1] < layers
            assert all(a < b for a, b in zip(ids, ids[1:])), (layers, n, ids)
            if len(set(zlab)) == n and min(zlab) >= 0 and max(zlab) < layers and list(zlab) == sorted(zlab):
                assert ids == zlab  # z-lab's choice wherever it is a valid one


@pytest.mark.parametrize("change, match", [
    ({"block_size": None}, "field block_size must be int"),
    ({"block_size": 8.5}, "field block_size must be int"),
    ({"dflash_config": {"mask_token_id": 100, "target_layer_ids": "0,2"}}, "target_layer_ids must be a non-empty"),
    ({"dflash_config": {"mask_token_id": 100, "target_layer_ids": []}}, "target_layer_ids must be a non-empty"),
    ({"dflash_config": {"mask_token_id": 100, "target_layer_ids": [0, 1.5]}}, "field target_layer_ids must be int"),
    ({"layer_types": ["full_attention"] * 3}, "one entry per layer"),
    ({"num_target_layers": "3"}, "field num_target_layers must be int"),
])
def test_malformed_drafter_config_is_named(tmp_path, change, match):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**HANDMADE, **change}))
    with pytest.raises(ConfigError, match=match) as err:
        dflash.DFlashConfig.from_file(path)
    assert str(path) in str(err.value)


def test_a_drafter_needs_a_layer(tiny):
    with pytest.raises(ConfigError, match="at least one layer"):
        dflash.init(tiny[2].config, jax.random.key(0), num_layers=0)


def test_handmade_folder_loads(tiny, handmade):
    folder, t = handmade
    d = load_dflash(folder, tiny[2])
    cfg = d.config
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids, cfg.num_target_layers) == (8, 100, (0, 2), 3)
    assert d.dtype == jnp.float32 and d.path == folder
    params = unpack_tree(d.params)  # packed for the CPU kernel where it runs
    qkv = np.asarray(params["layers"][1]["self_attn.qkv_proj.weight"])  # loaded in the per-layer layout
    want = np.concatenate([t[f"layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    np.testing.assert_array_equal(qkv, want)
    np.testing.assert_array_equal(np.asarray(params["fc.weight"]), t["fc.weight"])
    back = dflash.to_hf(d.params, cfg)
    assert sorted(back) == sorted(t) and all(np.array_equal(np.asarray(back[n]), t[n]) for n in t)


def test_save_load_roundtrip(tiny, drafter16, tmp_path, rng):
    target = tiny[2]
    save_dflash(drafter16, tmp_path / "f32", dtype="float32")
    back = load_dflash(tmp_path / "f32", target)
    assert back.config == drafter16.config
    def same(loaded, want):  # loaded per layer; init stacks them
        stacked = checkpoint.stack(loaded, dflash.DRAFT_LAYERS)
        return jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), stacked, want))

    assert same(back.params, drafter16.params)
    feats = rng.standard_normal((2, 16, 64)).astype(np.float32)
    logits = []
    as_loaded = dataclasses.replace(drafter16, params=pack_tree(checkpoint.unstack(drafter16.params, dflash.DRAFT_LAYERS)))
    for d in (as_loaded, back):
        c = append_context(d.params, d.config, init_cache(d.config, 256), feats, 11, np.arange(16))
        logits.append(np.asarray(draft_block(d.params, d.config, c, target.params, target.config, 7, 11, k=7)))
    np.testing.assert_array_equal(*logits)

    save_dflash(drafter16, tmp_path / "bf16", dtype="bfloat16")  # the published dtype
    raw = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == 16
    assert raw["dflash_config"] == {"mask_token_id": 100, "target_layer_ids": [0, 2]}
    from safetensors import safe_open
    with safe_open(tmp_path / "bf16" / "model.safetensors", framework="numpy") as f:
        assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"BF16"}
        assert sorted(f.keys()) == sorted(dflash.hf_shapes(drafter16.config))
    half = load_dflash(tmp_path / "bf16", target)
    rounded = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), drafter16.params)
    assert same(half.params, rounded)
    # by default each weight as it is: float32 values stay float32, bfloat16 ones are written back bitwise
    save_dflash(drafter16, tmp_path / "default")
    save_dflash(half, tmp_path / "again")
    for folder, kind in (("default", "F32"), ("again", "BF16")):
        with safe_open(tmp_path / folder / "model.safetensors", framework="numpy") as f:
            assert {f.get_slice(n).get_dtype() for n in f.keys()} == {kind}
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (tmp_path / "bf16" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("change, match", [
    ({"hidden_size": 32}, "hidden_size 32 != target hidden_size 64"),
    ({"vocab_size": 120}, "vocab_size 120 != target vocab_size 101"),
    ({"num_target_layers": 4}, "num_target_layers 4 != target num_hidden_layers 3"),
    ({"dflash_config": {"mask_token_id": 100, "target_layer_ids": [0, 3]}}, r"target_layer_ids \[0, 3\]: \[3\]"),
    ({"dflash_config": {"mask_token_id": 101, "target_layer_ids": [0, 2]}}, "mask_token_id 101 outside"),
    ({"dflash_config": {"mask_token_id": 100, "target_layer_ids": [0, 1, 2]}}, r"fc.weight has shape \(64, 128\)"),
    ({"architectures": ["DFlash2DraftModel"]}, "architectures"),
    ({"dflash_config": {"mask_token_id": 100, "target_layer_ids": [0, 2], "output_multiplier": 0.2}},
     "output_multiplier"),
    ({"layer_types": ["sliding_attention"] * 2}, "layer_types"),
])
def test_mismatch_errors_name_the_parameter(tiny, handmade, tmp_path, change, match):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**HANDMADE, **change}))
    (folder / "model.safetensors").symlink_to(handmade[0] / "model.safetensors")
    with pytest.raises(ValueError, match=match) as e:
        load_dflash(folder, tiny[2])
    assert str(folder) in str(e.value)


def test_proposer_errors(tiny, handmade, drafter16):
    drafter = load_dflash(handmade[0], tiny[2])
    assert DFlashProposer(drafter).k == 7 and DFlashProposer(drafter16).k == 15
    with pytest.raises(ProposerError, match="block_size - 1 = 7"):
        DFlashProposer(drafter, k=8)
    for bad in (0, 16, 2.5):
        with pytest.raises(ProposerError, match="k must be"):
            DFlashProposer(drafter16, k=bad)
    target = tiny[2]
    other = dataclasses.replace(target, config=dataclasses.replace(target.config, vocab_size=77))
    with pytest.raises(ProposerError, match="vocab_size 101 != target vocab_size 77"):
        specjax.generate(other, [1, 2], max_new_tokens=4, speculative=DFlashProposer(drafter16))


# -------------------------------------------------------------------------- forward

@pytest.mark.parametrize("rope", ["default", "yarn"])
def test_forward_matches_numpy_through_appends(tiny, handmade, rng, tmp_path, rope):
    """Cached context (several appends, stale rows past each count) == full recompute; with
    a YaRN RoPE (pretraining length 8, so its ramp spans the frequencies) too."""
    ref, _, target = tiny
    folder, t = handmade
    raw = HANDMADE
    if rope == "yarn":
        raw = {**HANDMADE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}}
        folder = _write(tmp_path, raw, _handmade_tensors(HANDMADE, np.random.default_rng(0)))  # the fixture's weights
    d = load_dflash(folder, target)
    assert (d.config.rope_scaling is None) == (rope == "default")
    embed = ref.model.embed_tokens.weight.detach().numpy().astype(np.float64)
    feats = rng.standard_normal((2, 13, 64)) * 3
    cache = init_cache(d.config, 32)
    length = 0
    for width, count in [(0, 0), (8, 5), (4, 2), (8, 6)]:
        if width:
            stale = 10 * rng.standard_normal((2, width - count, 64))
            chunk = np.concatenate([feats[:, length:length + count], stale], axis=1).astype(np.float32)
            cache = append_context(d.params, d.config, cache, chunk, count, length + np.arange(width))
            length += count
        assert int(cache.length) == length
        last = int(rng.integers(101))
        want = _np_block_logits(t, raw, feats[:, :length], last, embed)
        got = np.asarray(draft_block(d.params, d.config, cache, target.params, target.config, last, length, k=7))
        assert got.shape == (7, 101) and np.abs(got - want).max() <= 1e-4
    short = draft_block(d.params, d.config, cache, target.params, target.config, last, length, k=3)
    assert np.abs(np.asarray(short) - want[:3]).max() <= 1e-4


# ------------------------------------------------------------------------ exactness

def test_greedy_equals_plain(tiny, drafter16, rng):
    model = tiny[2]
    ids = rng.integers(0, model.config.vocab_size, 20)
    plain = specjax.generate(model, ids, max_new_tokens=40)
    for k in (1, 4, 7, 15):
        spec = specjax.generate(model, ids, max_new_tokens=40, speculative=DFlashProposer(drafter16, k=k))
        assert spec.tokens == plain.tokens, k
        assert spec.stats.drafted > 0


def test_sampled(tiny, drafter16, rng):
    model = tiny[2]
    v = model.config.vocab_size
    ids = rng.integers(0, v, 20)
    seed = int(rng.integers(1 << 31))
    plain = specjax.generate(model, ids, max_new_tokens=30, sampling=SAMPLED, seed=seed)
    spec = specjax.generate(model, ids, max_new_tokens=30, sampling=SAMPLED, seed=seed,
                            speculative=DFlashProposer(drafter16, k=3))
    assert spec.tokens == plain.tokens  # greedy drafts: sample-and-match is token-exact
    res = specjax.generate(model, ids, max_new_tokens=30, sampling=SAMPLED, seed=seed,
                           speculative=DFlashProposer(drafter16, k=3, sample=True))
    assert len(res.tokens) == 30 and all(0 <= x < v for x in res.tokens) and res.stats.drafted > 0
