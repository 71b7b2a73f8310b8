"""config.json and weight files: terse configs mean what transformers reads, and every bad
file is an error that names it (never a silent wrong model)."""

import json
from pathlib import Path

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


# RoPE scalings as config.json files write them: transformers 4's rope_scaling (with "type"
# or "rope_type"), transformers 5's rope_parameters, fields left to their defaults
SCALED = {
    "yarn-qwen3-card": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
                        "max_position_embeddings": 128},
    "yarn-legacy-type": {"rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 100}},
    "yarn-parameters-betas": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 500.0, "factor": 8.0,
                                                  "original_max_position_embeddings": 64, "beta_fast": 8,
                                                  "beta_slow": 2, "truncate": False}},
    "yarn-mscale-pair": {"rope_scaling": {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 40,
                                          "mscale": 1.0, "mscale_all_dim": 0.5}},
    "yarn-attention-factor": {"rope_scaling": {"rope_type": "yarn", "factor": 3.0, "attention_factor": 0.75,
                                               "original_max_position_embeddings": 40}},
    "yarn-implicit-factor": {"rope_parameters": {"rope_type": "yarn", "factor": None},
                             "original_max_position_embeddings": 1024, "max_position_embeddings": 4096},
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.5}, "rope_theta": 5000.0},
}


@pytest.mark.parametrize("case", sorted(SCALED))
def test_rope_scaling_gives_transformers_frequencies(tmp_path, case):
    """A scaled RoPE's inverse frequencies and cos / sin factor equal what transformers
    computes from the same config.json; saving writes a config both read back the same."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from specjax import qwen3

    def frequencies(folder):
        ref = AutoConfig.from_pretrained(folder)
        want, factor = ROPE_INIT_FUNCTIONS[ref.rope_parameters["rope_type"]](ref, None)
        return want.numpy(), factor

    (tmp_path / "config.json").write_text(json.dumps({**BASE, "head_dim": 32, **SCALED[case]}))
    ours = Qwen3Config.from_file(tmp_path / "config.json")
    assert ours.rope_scaling is not None and ours.rope_scaling.rope_type == case.split("-")[0]
    want, factor = frequencies(tmp_path)
    got, got_factor = qwen3.rope_frequencies(32, ours.rope_theta, ours.rope_scaling)
    np.testing.assert_allclose(np.asarray(got), want, rtol=3e-7)
    assert got_factor == pytest.approx(factor, rel=1e-12)
    assert not np.allclose(want, np.asarray(qwen3.rope_frequencies(32, ours.rope_theta)[0]))  # it does scale
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "config.json").write_text(json.dumps(ours.to_hf()))
    assert Qwen3Config.from_file(saved / "config.json") == ours
    np.testing.assert_allclose(frequencies(saved)[0], want, rtol=3e-7)
    assert frequencies(saved)[1] == pytest.approx(factor, rel=1e-12)


@pytest.mark.parametrize("extra, match", [
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}, "rope_parameters": {"rope_type": "default"}},
     "rope_scaling rope_type 'longrope' is not supported"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 2.0}}, "rope_parameters rope_type 'llama3'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling rope_type 'dynamic'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": "4"}}, "rope_scaling factor must be a positive number"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}},
     "original_max_position_embeddings must be a positive integer, got 0"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": "no"}}, "truncate must be true or false"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_type 'linear' needs a factor"),
    ({"rope_scaling": [1, 2]}, "rope_scaling must be an object"),
    ({"rope_theta": None, "rope_parameters": {"rope_theta": "big"}}, "rope_theta must be a positive number"),
    ({"rms_norm_eps": None}, "field rms_norm_eps must be float"),
    ({"head_dim": None}, "field head_dim must be int"),
    ({"vocab_size": "101"}, "field vocab_size must be int"),
    ({"num_hidden_layers": 2.0}, "field num_hidden_layers must be int"),
    ({"tie_word_embeddings": "yes"}, "field tie_word_embeddings must be bool"),
    ({"eos_token_id": [1, "2"]}, "eos_token_id must be an int"),
    ({"eos_token_id": -1}, r"eos_token_id must be token ids in \[0, 2\*\*31\)"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}},
     r"quantization_config \(quant_method 'fp8'\) is not supported"),
    # __post_init__'s checks, with the default a missing field took
    ({"num_attention_heads": 4}, r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(32\); "
                                 "num_key_value_heads is missing from the file, so it is transformers' default 32"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, r"multiple of num_key_value_heads \(3\)$"),
    ({"head_dim": 7}, "head_dim must be even"),
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


@pytest.mark.parametrize("text", ["[]", "{}", '{"weight_map": []}', '{"weight_map": null}',
                                  '{"weight_map": {"model.norm.weight": 3}}', "{bad"])
def test_malformed_index_is_named(tmp_path, text):
    hf_tiny(tmp_path, seed=5, max_shard_size="20KB")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(text)
    with pytest.raises(CheckpointError, match="not a valid safetensors index") as err:
        specjax.load(tmp_path)
    assert str(index) in str(err.value)


def test_float8_tensor_is_named_before_it_is_read(tmp_path):
    """An FP8 matrix (as in quantized checkpoints, here without their quantization_config)
    is refused from the file's header: numpy cannot even hold it."""
    import torch
    from safetensors.torch import load_file as load_torch, save_file as save_torch

    hf_tiny(tmp_path, seed=4)
    path = tmp_path / "model.safetensors"
    weights = load_torch(path)
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = weights[name].to(torch.float8_e4m3fn)
    save_torch(weights, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"{path}: tensor {name} has dtype F8_E4M3; specjax reads float32, "
                                              "bfloat16, float16, float64 tensors only"):
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
                                         ('{"eos_token_id": "0"}', "eos_token_id must be"),
                                         # loaded, then every request was refused over stop_ids it never passed
                                         ('{"eos_token_id": -1}', r"eos_token_id must be token ids in \[0, 2\*\*31\)"),
                                         ('{"eos_token_id": [0, 4294967296]}', "eos_token_id must be token ids")])
def test_bad_generation_config_is_named(tmp_path, text, match):
    hf_tiny(tmp_path, seed=6)
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ConfigError, match=match) as err:
        specjax.load(tmp_path)
    assert "generation_config.json" in str(err.value)


SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-code"


@pytest.mark.parametrize("file, text, named", [
    ("tokenizer.json", "{bad", "tokenizer.json"), ("tokenizer.json", "", "tokenizer.json"),
    ("tokenizer_config.json", "[]", "tokenizer_config.json"),
    ("tokenizer.json", "{}", None),  # JSON, but no tokenizer: the folder and its tokenizer files are named
])
def test_broken_tokenizer_is_named_at_load(tmp_path, file, text, named):
    """As in transformers and vLLM, a folder whose tokenizer does not load does not load,
    whether or not the caller needs text: a CheckpointError naming the file."""
    hf_tiny(tmp_path, seed=2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((SHIPPED / name).read_bytes())
    assert specjax.load(tmp_path).tokenizer is not None
    (tmp_path / file).write_text(text)
    with pytest.raises(CheckpointError) as err:
        specjax.load(tmp_path)
    where = tmp_path / named if named else f"{tmp_path} (tokenizer.json, tokenizer_config.json)"
    assert str(err.value).startswith(f"{where}: cannot load the tokenizer")


@pytest.mark.parametrize("generation, warned", [
    ({"do_sample": False, "repetition_penalty": 2.0, "no_repeat_ngram_size": 2},
     "repetition_penalty=2.0, no_repeat_ngram_size=2"),
    ({"do_sample": True, "temperature": 0.6, "presence_penalty": 1.5, "typical_p": 0.9, "bad_words_ids": [[3]]},
     "presence_penalty=1.5, bad_words_ids=[[3]], typical_p=0.9"),
    ({"max_new_tokens": 256}, None),  # a default length: serve's and the CLI's (as vLLM's), the API's caller's
    # the values that change nothing, and typical_p where nothing is sampled (transformers ignores it too)
    ({"do_sample": False, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words_ids": None,
      "num_beams": 1, "typical_p": 0.9}, None),
])
def test_generation_options_specjax_does_not_apply_are_warned(tmp_path, generation, warned):
    """generation_config.json options that transformers' generate applies and specjax does
    not implement are named in a warning at load: every generation from the folder may then
    differ from transformers' and vLLM's. Once: loading the folder again says nothing new.
    Neutral values are silent."""
    import warnings

    hf_tiny(tmp_path, seed=6)
    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps(generation))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own: each warning once per place
        specjax.load(tmp_path)
        specjax.load(tmp_path)
    ours = [str(w.message) for w in caught if str(gen) in str(w.message)]
    if warned is None:
        assert ours == []
    else:
        assert ours == [f"{gen}: {warned} not applied (specjax implements temperature, top_k, top_p and min_p only): "
                        "its output can differ from transformers' and vLLM's generate with this file"]


@pytest.mark.parametrize("generation", [
    {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [3, 4]},  # Qwen3's
    {"do_sample": False, "temperature": 0.7, "max_new_tokens": 64},  # vLLM samples at 0.7 all the same
    {"temperature": None, "top_p": 0.8, "min_p": 0.05, "repetition_penalty": 1.05, "num_beams": 1},
    {"eos_token_id": 3},
])
def test_serve_reads_request_defaults_from_generation_config_as_vllm(tmp_path, generation):
    """`request_defaults` against vLLM's reading (vllm/config/model.py,
    get_diff_sampling_param): transformers' GenerationConfig.to_diff_dict() of the file
    (with transformers 5 every field it sets), limited to temperature, top_k, top_p, min_p
    and max_new_tokens (renamed max_tokens); repetition_penalty, which vLLM also takes,
    specjax does not implement (load warns of it). No file: nothing."""
    from transformers import GenerationConfig
    from specjax.model import request_defaults

    assert request_defaults(tmp_path) == {} and request_defaults(None) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    diff = GenerationConfig.from_pretrained(tmp_path).to_diff_dict()
    want = {k: diff[k] for k in ("temperature", "top_k", "top_p", "min_p") if diff.get(k) is not None}
    if diff.get("max_new_tokens") is not None:
        want["max_tokens"] = diff["max_new_tokens"]
    assert request_defaults(tmp_path) == want


@pytest.mark.parametrize("bad, field", [({"top_p": 1.5}, "top_p"), ({"temperature": "hot"}, "temperature"),
                                        ({"max_new_tokens": 0}, "max_new_tokens"), ({"top_k": 2.5}, "top_k"),
                                        ({"min_p": True}, "min_p")])
def test_serve_refuses_bad_request_defaults_naming_file_and_field(tmp_path, bad, field):
    """A value vLLM's server would take as a request default and that no request may have
    fails at start, naming the file and field (not a 400 blaming each request); top_k -1 is
    vLLM's "off", kept as specjax's 0."""
    from specjax.model import request_defaults

    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({"top_k": -1}))
    assert request_defaults(tmp_path) == {"top_k": 0}
    gen.write_text(json.dumps({"do_sample": False, **bad}))
    with pytest.raises(ConfigError) as e:
        request_defaults(tmp_path)
    assert str(e.value).startswith(f"{gen}: ") and field in str(e.value)


def test_save_keeps_the_generation_config(tmp_path):
    """`save` writes the folder's generation_config.json back, every field kept (transformers'
    save_pretrained writes one too), so generation from the saved folder is the same; a
    model whose sampling defaults were changed writes its own (do_sample and the four
    fields, or do_sample false and none of them, so transformers and vLLM read the same);
    a model with none leaves no stale file where it is saved."""
    import dataclasses

    from transformers import GenerationConfig

    from specjax import Sampling
    from specjax.model import request_defaults

    hf_tiny(tmp_path / "src", seed=6)
    qwen3 = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [3, 4],
             "pad_token_id": 5, "max_new_tokens": 300}
    (tmp_path / "src" / "generation_config.json").write_text(json.dumps(qwen3))
    model = specjax.load(tmp_path / "src")
    specjax.save(model, tmp_path / "same")
    assert json.loads((tmp_path / "same" / "generation_config.json").read_text()) == qwen3
    again = specjax.load(tmp_path / "same")
    assert again.generation_defaults == model.generation_defaults == Sampling(0.6, 20, 0.95)
    assert again.eos_ids == (3, 4) and request_defaults(tmp_path / "same") == request_defaults(tmp_path / "src")

    specjax.save(dataclasses.replace(model, generation_defaults=Sampling()), tmp_path / "greedy")
    hf = GenerationConfig.from_pretrained(tmp_path / "greedy")
    assert not hf.do_sample and hf.pad_token_id == 5 and hf.max_new_tokens == 300
    assert specjax.load(tmp_path / "greedy").generation_defaults == Sampling()
    assert request_defaults(tmp_path / "greedy") == {"max_tokens": 300}
    chosen = Sampling(0.8, 0, 0.9, 0.05)
    specjax.save(dataclasses.replace(model, generation_defaults=chosen), tmp_path / "chosen")
    hf = GenerationConfig.from_pretrained(tmp_path / "chosen")
    assert (hf.do_sample, hf.temperature, hf.top_k, hf.top_p, hf.min_p) == (True, 0.8, 0, 0.9, 0.05)
    assert specjax.load(tmp_path / "chosen").generation_defaults == chosen

    bare = dataclasses.replace(model, path=None, generation_defaults=None,
                               config=dataclasses.replace(model.config, eos_token_id=None))
    specjax.save(bare, tmp_path / "same")  # over the folder saved first
    assert not (tmp_path / "same" / "generation_config.json").exists()
    assert specjax.load(tmp_path / "same").generation_defaults is None


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


def test_a_save_over_another_model_leaves_none_of_its_tokenizer(tmp_path):
    """Tokenizer files another model left in the folder (a chat template, added tokens) are
    removed before the model's own are written: transformers would read them and load a
    tokenizer that is neither (specjax.save and train.lm's export alike)."""
    from transformers import AutoTokenizer

    from train import lm

    shipped = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-code"
    model = specjax.load(shipped)
    for name, write in (("save", lambda out: specjax.save(model, out)),
                        ("export", lambda out: lm.export(out, model.params, model.config, shipped))):
        out = tmp_path / name
        out.mkdir()
        (out / "chat_template.jinja").write_text("{{ 'another model' }}")
        (out / "added_tokens.json").write_text(json.dumps({"<|other|>": 9000}))
        write(out)
        assert not (out / "chat_template.jinja").exists() and not (out / "added_tokens.json").exists()
        tok = AutoTokenizer.from_pretrained(str(out))
        assert len(tok) == len(model.tokenizer) and tok.chat_template is None
