"""config.json and weight files: terse configs mean what transformers reads, and every bad
file is an error that names it (never a silent wrong model)."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import specjax
from specjax.cpu_kernels import unpack_tree
from specjax.checkpoint import CheckpointError
from specjax.config import ConfigError, Qwen3Config
from conftest import hf_tiny

BASE = {"model_type": "qwen3", "vocab_size": 101, "hidden_size": 256, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 32}  # 32: transformers' default KV heads divide it

TERSE = {
    "bare": {},
    "kv-heads-null": {"num_key_value_heads": None, "head_dim": 16},
    "theta-top-level": {"rope_theta": 5000.0, "num_key_value_heads": 4},
    "theta-in-rope-parameters": {"rope_parameters": {"rope_type": "default", "rope_theta": 2500.0}},
    "both-thetas": {"rope_theta": 7.0, "rope_parameters": {"rope_type": "default", "rope_theta": 3000.0}},
    "rope-scaling-default": {"rope_scaling": {"rope_type": "default", "rope_theta": 4000.0}, "rope_theta": 9.0},
    "tied-eps-maxpos": {"tie_word_embeddings": True, "rms_norm_eps": 1e-5, "max_position_embeddings": 77},
}


@pytest.mark.parametrize("case", sorted(TERSE))
def test_terse_config_reads_as_transformers_reads_it(tmp_path, case):
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps({**BASE, **TERSE[case]}))
    ref = AutoConfig.from_pretrained(tmp_path)
    ours = Qwen3Config.from_file(tmp_path / "config.json")
    ref_theta = (getattr(ref, "rope_parameters", None) or {}).get("rope_theta", getattr(ref, "rope_theta", None))
    assert (ours.num_key_value_heads, ours.head_dim, ours.rms_norm_eps, ours.rope_theta, ours.tie_word_embeddings,
            ours.attention_bias, ours.max_position_embeddings) == (
        ref.num_key_value_heads, ref.head_dim, ref.rms_norm_eps, float(ref_theta), ref.tie_word_embeddings,
        ref.attention_bias, ref.max_position_embeddings)


@pytest.mark.parametrize("extra, match", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": {"rope_type": "default"}},
     "rope_scaling rope_type 'yarn'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters rope_type 'linear'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling rope_type 'dynamic'"),
    ({"rope_scaling": [1, 2]}, "rope_scaling must be an object"),
    ({"rope_theta": None, "rope_parameters": {"rope_theta": "big"}}, "rope_theta must be a positive number"),
    ({"rms_norm_eps": None}, "field rms_norm_eps must be float"),
    ({"head_dim": None}, "field head_dim must be int"),
    ({"vocab_size": "101"}, "field vocab_size must be int"),
    ({"num_hidden_layers": 2.0}, "field num_hidden_layers must be int"),
    ({"tie_word_embeddings": "yes"}, "field tie_word_embeddings must be bool"),
    ({"eos_token_id": [1, "2"]}, "eos_token_id must be an int"),
])
def test_unsupported_or_mistyped_fields_are_named(tmp_path, extra, match):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**BASE, **extra}))
    with pytest.raises(ConfigError, match=match) as err:
        Qwen3Config.from_file(path)
    assert str(path) in str(err.value)


def test_config_that_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        Qwen3Config.from_file(tmp_path / "config.json")


def test_tied_config_with_a_different_stored_head(tmp_path, rng):
    hf_tiny(tmp_path, seed=3)  # tied: transformers stores no lm_head.weight
    weights = load_file(tmp_path / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    save_file({**weights, "lm_head.weight": embed.copy()}, tmp_path / "model.safetensors")
    np.testing.assert_array_equal(np.asarray(unpack_tree(specjax.load(tmp_path).params)["model.embed_tokens.weight"]), embed)
    other = embed + rng.normal(0, 0.1, embed.shape).astype(embed.dtype)
    save_file({**weights, "lm_head.weight": other}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="lm_head.weight differs .* tie_word_embeddings=true"):
        specjax.load(tmp_path)


def test_truncated_weights_file_is_named(tmp_path):
    hf_tiny(tmp_path, seed=4)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="model.safetensors: cannot read safetensors"):
        specjax.load(tmp_path)


def test_index_pointing_at_the_wrong_shard(tmp_path):
    hf_tiny(tmp_path, seed=5, max_shard_size="20KB")
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    wrong = next(s for s in shards if s != index["weight_map"]["model.embed_tokens.weight"])
    index["weight_map"]["model.embed_tokens.weight"] = wrong
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"{wrong}: does not hold tensor model.embed_tokens.weight"):
        specjax.load(tmp_path)


@pytest.mark.parametrize("text, match", [("{not json", "not valid JSON"), ("[0]", "expected a JSON object"),
                                         ('{"eos_token_id": "0"}', "eos_token_id must be")])
def test_bad_generation_config_is_named(tmp_path, text, match):
    hf_tiny(tmp_path, seed=6)
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ConfigError, match=match) as err:
        specjax.load(tmp_path)
    assert "generation_config.json" in str(err.value)


@pytest.mark.parametrize("attention_bias", [False, True])
def test_layers_are_fused_and_finished_as_they_arrive(rng, attention_bias):
    """Streaming load: each layer is handed to `transform` as soon as its last tensor is
    read (nothing read ahead), fused as concatenating the HF projections would; any order
    of arrival gives the same tree."""
    from specjax import checkpoint

    cfg = Qwen3Config(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=attention_bias,
                      tie_word_embeddings=False)
    shapes = checkpoint.hf_shapes(cfg)
    tensors = {n: rng.normal(size=s).astype(np.float32) for n, s in shapes.items()}
    layer_names = [n for n in shapes if n.startswith("model.layers.0.")]
    top = len(shapes) - cfg.num_hidden_layers * len(layer_names)
    pulled, finished = [0], []

    def stream(names):
        for n in names:
            pulled[0] += 1
            yield n, tensors[n]

    def transform(name, x):
        if isinstance(x, dict):
            finished.append((name, pulled[0]))
        return x

    params = checkpoint.layers_from_hf(stream(shapes), cfg, transform=transform)
    assert finished == [(f"model.layers.{i}", top + (i + 1) * len(layer_names)) for i in range(cfg.num_hidden_layers)]
    for i, layer in enumerate(params["model.layers"]):
        hf = {n.split(".", 3)[3]: tensors[n] for n in shapes if n.startswith(f"model.layers.{i}.")}
        expect = {k: v for k, v in hf.items() if not k.startswith(("self_attn.q_proj", "self_attn.k_proj",
                                                                   "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"))}
        expect["self_attn.qkv_proj.weight"] = np.concatenate([hf[f"self_attn.{p}_proj.weight"] for p in "qkv"])
        expect["mlp.gate_up_proj.weight"] = np.concatenate([hf["mlp.gate_proj.weight"], hf["mlp.up_proj.weight"]])
        if attention_bias:
            expect["self_attn.qkv_proj.bias"] = np.concatenate([hf[f"self_attn.{p}_proj.bias"] for p in "qkv"])
        assert layer.keys() == expect.keys()
        for k in expect:
            np.testing.assert_array_equal(np.asarray(layer[k]), expect[k])
    for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        np.testing.assert_array_equal(np.asarray(params[n]), tensors[n])
    shuffled = list(shapes)
    rng.shuffle(shuffled)
    again = checkpoint.layers_from_hf(stream(shuffled), cfg)
    for a, b in zip(params["model.layers"], again["model.layers"]):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
