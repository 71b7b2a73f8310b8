"""How a model's matrices are held on CPU. A 16-bit checkpoint kept in 16 bits: bitwise
the logits of the same checkpoint widened to float32 at load (the reference), in every kind
of step, at half the memory. int8 (quantized at load): a different model, whose speculative
output equals its own plain output."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import specjax
from specjax import checkpoint, cpu_kernels, dflash, qwen3, steps
from specjax import kv as kvlib

from conftest import hf_tiny

pytestmark = pytest.mark.skipif(not cpu_kernels.runs(), reason="the CPU kernels do not run here")

SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-code"
# Whole panels (every output count a multiple of 64, so of 16) and ragged ones (vocab 101, MLP 90).
CONFIGS = {
    "whole panels": dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    "ragged panels": dict(vocab_size=101, hidden_size=48, intermediate_size=90, num_attention_heads=3,
                          num_key_value_heads=1, head_dim=24),
}


@pytest.fixture(scope="module", params=[("whole panels", "bfloat16"), ("ragged panels", "bfloat16"),
                                        ("ragged panels", "float16")], ids=lambda p: f"{p[0]}-{p[1]}")
def pair(request, tmp_path_factory):
    """(folder, model kept in 16 bits, the same checkpoint widened to float32 at load)."""
    name, dtype = request.param
    folder = tmp_path_factory.mktemp("w16")
    hf_tiny(folder, seed=5, dtype=dtype, init=0.1, num_hidden_layers=2, **CONFIGS[name])
    return folder, specjax.load(folder), specjax.load(folder, dtype="float32"), dtype


def test_matrices_stay_in_16_bits_and_memory_halves(pair):
    _, m16, m32, dtype = pair
    leaves16 = jax.tree.leaves(m16.params, is_leaf=lambda x: isinstance(x, cpu_kernels.Packed))
    matrices = [w for w in leaves16 if isinstance(w, cpu_kernels.Packed)]
    assert matrices and all(w.stored == jnp.dtype(dtype) for w in matrices)
    assert all(w.dtype == jnp.float32 for w in leaves16)  # norms widened; packed weights compute in f32
    assert m16.dtype == m32.dtype == jnp.float32
    vectors = sum(w.nbytes for w in leaves16 if not isinstance(w, cpu_kernels.Packed))
    assert checkpoint.weight_bytes(m16.params) - vectors == (checkpoint.weight_bytes(m32.params) - vectors) // 2


_forward = jax.jit(qwen3.forward, static_argnames="cfg")  # as the engine's steps run it: compiled


def _steps(model, ids, rng):
    """Logits of a padded prefill chunk, a decode step and a verify step at every bucket."""
    v = model.config.vocab_size
    cache = kvlib.init(model.config, 1, 128, page_size=8)
    out = []
    padded = np.concatenate([ids, rng.integers(0, v, 3)])  # 3 padding tokens, never committed
    for tokens, commit in [(padded, len(ids))] + [(rng.integers(0, v, t), t) for t in steps.BUCKETS]:
        start = int(cache.lengths[0])
        logits, cache, _ = _forward(model.params, model.config, jnp.asarray(tokens)[None],
                                    (start + np.arange(len(tokens)))[None], cache)
        cache = cache.replace(lengths=cache.lengths + commit)
        out.append(np.asarray(logits))
    return out


def test_every_step_gets_the_float32_bits(pair):
    _, m16, m32, _ = pair
    ids = np.random.default_rng(0).integers(0, m16.config.vocab_size, 21)
    got = _steps(m16, ids, np.random.default_rng(1))
    want = _steps(m32, ids, np.random.default_rng(1))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_drafting_gets_the_float32_bits(pair, tmp_path):
    """A DFlash drafter stored in 16 bits, loaded along with its target both ways."""
    folder, m16, m32, dtype = pair
    drafter = dflash.init(m32.config, jax.random.key(2), num_layers=1, block_size=4, target_layer_ids=(0, 1), std=0.2)
    dflash.save_dflash(drafter, tmp_path / "d", dtype=dtype)
    d16, d32 = dflash.load_dflash(tmp_path / "d", m16), dflash.load_dflash(tmp_path / "d", m32, dtype="float32")
    assert d16.params["fc.weight"].stored == jnp.dtype(dtype) and d32.params["fc.weight"].stored == jnp.float32
    rng = np.random.default_rng(3)
    d = m16.config.hidden_size
    features = jnp.asarray(rng.standard_normal((12, 2 * d)), jnp.float32)
    blocks = jnp.asarray(rng.integers(0, m16.config.vocab_size, (2, 4)), jnp.int32)
    anchors = jnp.asarray([3, 8], jnp.int32)
    got = dflash.block_logits(d16.params, d16.config, m16.params, m16.config, features, blocks, anchors)
    want = dflash.block_logits(d32.params, d32.config, m32.params, m32.config, features, blocks, anchors)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_speculative_output_equals_plain_in_16_bits(pair):
    _, m16, _, _ = pair
    rng = np.random.default_rng(4)
    base = rng.integers(0, m16.config.vocab_size, 7)
    prompt = np.concatenate([base, base, base[:3]]).tolist()
    plain = specjax.generate(m16, prompt, max_new_tokens=24).tokens
    spec = specjax.generate(m16, prompt, max_new_tokens=24, num_speculative_tokens=4)
    assert spec.stats.drafted > 0 and spec.tokens == plain


def test_save_writes_the_checkpoint_back_bitwise(pair, tmp_path):
    """By default (dtype None) and in the checkpoint's own type, from the model kept in 16
    bits and from the one widened to float32 at load: the same file as transformers wrote."""
    folder, m16, m32, dtype = pair
    before = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}
    if m16.config.tie_word_embeddings:
        before.pop("lm_head.weight", None)
    for model, kw in ((m16, {}), (m32, {}), (m16, {"dtype": dtype})):
        again = tmp_path / f"again-{len(kw)}-{model is m16}"
        specjax.save(model, again, **kw)
        after = {k: v for f in again.glob("*.safetensors") for k, v in load_file(f).items()}
        assert sorted(before) == sorted(after)
        for name, value in before.items():
            assert after[name].dtype == value.dtype, name
            np.testing.assert_array_equal(after[name].view(np.uint16), value.view(np.uint16), err_msg=name)
        assert json.loads((again / "config.json").read_text())["torch_dtype"] == dtype


def test_a_float32_checkpoint_saves_back_in_float32_and_a_16_bit_request_rounds(tmp_path):
    """A float32 checkpoint saved with the default dtype keeps every bit (transformers'
    save_pretrained keeps a model's dtype too); asking for bfloat16 rounds each weight to
    nearest even, as torch does."""
    import torch

    folder = tmp_path / "f32"
    hf_tiny(folder, seed=8, num_hidden_layers=1)
    model = specjax.load(folder)
    specjax.save(model, tmp_path / "default")
    specjax.save(model, tmp_path / "rounded", dtype="bfloat16")
    source = load_file(folder / "model.safetensors")
    for name, want in source.items():
        got = load_file(tmp_path / "default" / "model.safetensors").get(name)
        if got is None:  # a tied head is written once
            continue
        assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32)), name
        rounded = load_file(tmp_path / "rounded" / "model.safetensors")[name]
        torch_rounded = torch.from_numpy(want).to(torch.bfloat16).view(torch.int16).numpy()
        np.testing.assert_array_equal(rounded.view(np.int16), torch_rounded, err_msg=name)
    assert json.loads((tmp_path / "default" / "config.json").read_text())["torch_dtype"] == "float32"
    # readable as any new file is here (safetensors writes its files 0600), as config.json is
    import os
    for name in ("model.safetensors", "config.json"):
        mode = (tmp_path / "default" / name).stat().st_mode & 0o777
        mask = os.umask(0)
        os.umask(mask)
        assert mode == 0o666 & ~mask, (name, oct(mode))


def test_float32_on_request_and_16_bit_compute_are_not_packed_16(tmp_path):
    folder = tmp_path / "m"
    hf_tiny(folder, dtype="bfloat16", num_hidden_layers=1)
    wide = specjax.load(folder, dtype="float32")
    assert all(w.stored == jnp.float32 for w in jax.tree.leaves(
        wide.params, is_leaf=lambda x: isinstance(x, cpu_kernels.Packed)) if isinstance(w, cpu_kernels.Packed))
    half = specjax.load(folder, dtype="bfloat16")  # bf16 compute: XLA's ops, nothing packed
    leaves = jax.tree.leaves(half.params, is_leaf=lambda x: isinstance(x, cpu_kernels.Packed))
    assert not any(isinstance(w, cpu_kernels.Packed) for w in leaves)
    assert all(w.dtype == jnp.bfloat16 for w in leaves)


def test_int8_is_its_own_model_and_speculation_keeps_it(pair):
    folder, m16, _, _ = pair
    m8 = specjax.load(folder, dtype="int8")
    leaves = jax.tree.leaves(m8.params, is_leaf=lambda x: isinstance(x, cpu_kernels.Packed))
    assert m8.dtype == jnp.float32 and all(w.stored == jnp.int8 for w in leaves if isinstance(w, cpu_kernels.Packed))
    assert checkpoint.weight_bytes(m8.params) < 0.6 * checkpoint.weight_bytes(m16.params)
    rng = np.random.default_rng(6)
    base = rng.integers(0, m8.config.vocab_size, 7)
    prompt = np.concatenate([base, base, base[:3]]).tolist()
    settings = [specjax.Sampling(), specjax.Sampling(temperature=0.8, top_k=20)]  # one batch, a row each
    spec = specjax.generate(m8, [prompt, prompt], max_new_tokens=24, sampling=settings, seed=2,
                            num_speculative_tokens=4)
    for s, got in zip(settings, spec):
        plain = specjax.generate(m8, prompt, max_new_tokens=24, sampling=s, seed=2).tokens
        assert got.stats.drafted > 0 and got.tokens == plain


def test_int8_shipped_model_speculation_equals_plain_at_width_16_and_in_a_batch():
    """The shipped model in int8 on a code prompt: prompt lookup verifying 16 tokens a step,
    and a batch of two rows, give plain decoding's tokens. Activations are quantized before
    each matmul, so a last-bit difference in a verify row (XLA's norms once gave one from 12
    rows on) becomes a different rounding and then a different token."""
    from transformers import AutoTokenizer
    m = specjax.load(SHIPPED, dtype="int8")
    ids = AutoTokenizer.from_pretrained(SHIPPED)("def fibonacci(n):\n    if n < 2:\n        return n\n"
                                                 "    return fibonacci(")["input_ids"]
    plain = specjax.generate(m, ids, max_new_tokens=40).tokens
    assert specjax.generate(m, ids, max_new_tokens=40, speculative=specjax.NgramProposer(k=15)).tokens == plain
    pair = specjax.generate(m, [ids, ids[:10]], max_new_tokens=40, speculative=specjax.NgramProposer(k=5))
    assert pair[0].tokens == plain
    assert pair[1].tokens == specjax.generate(m, ids[:10], max_new_tokens=40).tokens


def test_int8_over_a_mesh_is_refused(tmp_path):
    folder = tmp_path / "m"
    hf_tiny(folder, num_hidden_layers=1)
    with pytest.raises(checkpoint.CheckpointError, match="int8 weights run on the CPU kernels"):
        specjax.load(folder, dtype="int8", mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",)))
    with pytest.raises(checkpoint.CheckpointError, match="int8 weights run on the CPU kernels"):  # not widened
        specjax.shard(specjax.load(folder, dtype="int8"))
