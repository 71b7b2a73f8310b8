"""Full-sequence logits of specjax's Qwen3 against transformers on random tiny configs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import specjax
from specjax import qwen3
from conftest import hf_tiny

CASES = {
    "gqa2-tied-headdim": dict(),
    "gqa3-untied-theta": dict(num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                              tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
    "mha-headdim-eq": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16),
    "attention-bias": dict(attention_bias=True, num_key_value_heads=1),
    # scaled RoPE (a short pretraining length, so YaRN's ramp falls inside the 12 frequencies)
    "rope-yarn": dict(head_dim=24, max_position_embeddings=64, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}),
    "rope-linear": dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0}),
}


def _compare(ref, model, rng, batch=2, length=19):
    ids = rng.integers(0, model.config.vocab_size, (batch, length))
    with torch.no_grad():
        expected = ref(torch.tensor(ids)).logits.numpy()
    pos = np.broadcast_to(np.arange(length), ids.shape)
    logits, _, _ = qwen3.forward(model.params, model.config, ids, pos)
    assert np.abs(np.asarray(logits) - expected).max() <= 1e-4


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, rng, case):
    ref = hf_tiny(tmp_path, seed=int(rng.integers(1 << 30)), **CASES[case])
    _compare(ref, specjax.load(tmp_path), rng)


def test_logits_match_transformers_across_causal_blocks(tmp_path, rng):
    """Without a cache, attention runs in blocks of queries (qwen3.attend_causal): a
    sequence spanning three blocks, the last one ragged, still matches transformers."""
    ref = hf_tiny(tmp_path, seed=int(rng.integers(1 << 30)), **CASES["gqa3-untied-theta"])
    _compare(ref, specjax.load(tmp_path), rng, batch=1, length=2 * qwen3.CAUSAL_BLOCK + 37)


@pytest.mark.parametrize("block", [1, 5, 16, 64])
def test_blocked_causal_attention_is_causal_softmax_attention(rng, block):
    """attend_causal against a NumPy causal softmax attention (GQA: 6 query heads over 2)."""
    b, t, h, kh, e = 2, 37, 6, 2, 8
    q = rng.standard_normal((b, t, h, e)).astype(np.float32)
    k, v = rng.standard_normal((2, b, kh, t, e)).astype(np.float32)
    causal = jax.jit(qwen3.attend_causal, static_argnums=4)  # eager, block 1 compiled each of 37 shapes
    got = np.asarray(causal(q, k, v, np.broadcast_to(np.arange(t), (b, t)), block))
    kq = np.repeat(k, h // kh, axis=1).astype(np.float64)  # query head i reads kv head i // 3
    vq = np.repeat(v, h // kh, axis=1).astype(np.float64)
    scores = np.einsum("bthe,bhse->bhts", q, kq) / np.sqrt(e)
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.einsum("bhts,bhse->bthe", probs, vq).reshape(b, t, h * e)
    assert np.abs(got - want).max() <= 1e-5


def test_sharded_checkpoint(tmp_path, rng):
    ref = hf_tiny(tmp_path, seed=int(rng.integers(1 << 30)), max_shard_size="20KB", tie_word_embeddings=False)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 3
    _compare(ref, specjax.load(tmp_path), rng)


def test_bf16_on_disk(tmp_path, rng):
    hf_tiny(tmp_path, seed=int(rng.integers(1 << 30)), dtype="bfloat16")
    from transformers import Qwen3ForCausalLM
    ref = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model = specjax.load(tmp_path)
    assert model.dtype == np.float32
    _compare(ref, model, rng)


def test_save_round_trips_to_transformers(tmp_path, rng, tiny):
    ref, _, model = tiny
    specjax.save(model, tmp_path, dtype="float32", max_shard_bytes=30_000)
    from transformers import Qwen3ForCausalLM
    reloaded = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    _compare(reloaded, model, rng)
    _compare(ref, specjax.load(tmp_path), rng)


def test_a_save_over_another_replaces_its_weights_and_a_bad_dtype_writes_nothing(tmp_path, rng, tiny):
    """Saving model b where model a was saved (sharded over single and single over sharded)
    leaves b's weights alone: transformers and specjax both read b back. A dtype load cannot
    read back is refused before any file changes."""
    import dataclasses

    from transformers import Qwen3ForCausalLM

    from specjax.cpu_kernels import unpack_tree
    from specjax.errors import SpecjaxError

    _, _, a = tiny
    embed = unpack_tree(a.params["model.embed_tokens.weight"])
    b = dataclasses.replace(a, params={**a.params, "model.embed_tokens.weight": 1.5 * embed})
    for first, second in (({"max_shard_bytes": 30_000}, {}), ({}, {"max_shard_bytes": 30_000})):
        folder = tmp_path / f"over-{len(first)}"
        specjax.save(a, folder, dtype="float32", **first)
        specjax.save(b, folder, dtype="float32", **second)
        _compare(Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), b, rng)
        _compare(Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), specjax.load(folder), rng)
    before = {f.name: f.read_bytes() for f in folder.iterdir()}
    for dtype in ("int8", "float64", "bogus"):
        with pytest.raises(SpecjaxError, match=f"dtype must be one of float32, bfloat16, float16 .* got '{dtype}'"):
            specjax.save(b, folder, dtype=dtype)
    assert {f.name: f.read_bytes() for f in folder.iterdir()} == before


def test_taps_are_transformers_hidden_states(rng, calm):
    ref, model = calm
    ids = rng.integers(0, model.config.vocab_size, (1, 11))
    with torch.no_grad():
        hs = ref(torch.tensor(ids), output_hidden_states=True).hidden_states
    taps = (0, 2, 1)
    _, _, tapped = qwen3.forward(model.params, model.config, ids, np.arange(11)[None], taps=taps)
    for got, layer in zip(np.asarray(tapped), taps):
        assert np.abs(got - hs[layer + 1].numpy()).max() <= 1e-4


@pytest.mark.parametrize("name", ["tiny-code", "tiny-code-draft"])
def test_shipped_checkpoints_match_transformers(name, rng):
    """The models in checkpoints/ load in transformers and in specjax with the same f32 logits."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    folder = Path(__file__).resolve().parents[1] / "checkpoints" / name
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    _compare(ref, specjax.load(folder, dtype="float32"), rng, batch=2, length=40)


def test_shipped_dflash_drafter_fits_the_target():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "checkpoints"
    target = specjax.load(root / "tiny-code")
    drafter = specjax.load_dflash(root / "tiny-code-dflash", target)
    assert drafter.config.mask_token_id == target.tokenizer.mask_token_id
    ids = target.tokenizer("def add(a, b):\n    return a + b\n\n" * 3)["input_ids"]
    plain = specjax.generate(target, ids, max_new_tokens=24)
    spec = specjax.generate(target, ids, max_new_tokens=24, speculative=specjax.DFlashProposer(drafter))
    assert spec.tokens == plain.tokens


def test_yarn_model_decodes_as_transformers_and_speculates_exactly(tmp_path, rng):
    """Through the engine (prefill, paged cache, decode and verify steps at positions past
    the pretraining length the YaRN ramp is set by): greedy tokens equal transformers'
    generate, and so do prompt lookup's and the model drafting for itself (every draft
    accepted, so verify merges blocks of k + 1 past that length)."""
    ref = hf_tiny(tmp_path, seed=int(rng.integers(1 << 30)), **CASES["rope-yarn"])
    model = specjax.load(tmp_path)
    ids = np.tile(rng.integers(0, model.config.vocab_size, 6), 4)  # repeats: lookup has drafts
    with torch.no_grad():
        want = ref.generate(torch.tensor(ids[None]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            max_new_tokens=36, min_new_tokens=36, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(ids):].tolist()
    plain = specjax.generate(model, ids, max_new_tokens=36, stop_ids=())
    assert plain.tokens == want
    lookup = specjax.generate(model, ids, max_new_tokens=36, stop_ids=(), speculative=specjax.NgramProposer(k=4))
    assert lookup.tokens == want
    selfdraft = specjax.generate(model, ids, max_new_tokens=36, stop_ids=(),
                                 speculative=specjax.DraftProposer(model, k=4))
    assert selfdraft.tokens == want and selfdraft.stats.accepted == selfdraft.stats.drafted > 0


@pytest.mark.parametrize("heads,dim", [(16, 128), (6, 64), (1, 384), (3, 30)])
def test_rms_norm_gives_a_row_its_bits_whatever_the_rows_around_it(rng, heads, dim):
    """A verify step's rows must be bitwise its decode steps' (the exactness contract), so the
    norm of a row may not depend on how many rows share the call: each row of [1, T, H, E]
    for T up to 16 against the same row normalized alone, jitted as steps are (Qwen3-0.6B's
    per-head q_norm shape first; XLA's reduce gave rows of 2 or more other bits there), and
    close to the float64 RMSNorm."""
    weight = jnp.asarray(1 + 0.2 * rng.standard_normal(dim), jnp.float32)
    norm = jax.jit(lambda x: qwen3.rms_norm(x, weight, 1e-6))
    x = (rng.standard_normal((1, 16, heads, dim)) * 3).astype(np.float32)
    alone = [np.asarray(norm(jnp.asarray(x[:, t:t + 1]))) for t in range(16)]
    for t_rows in (2, 3, 8, 12, 16):
        together = np.asarray(norm(jnp.asarray(x[:, :t_rows])))
        for t in range(t_rows):
            np.testing.assert_array_equal(together[:, t:t + 1], alone[t], err_msg=f"T={t_rows}, row {t}")
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * np.asarray(weight, np.float64)
    np.testing.assert_allclose(np.concatenate(alone, axis=1), want, rtol=1e-5, atol=1e-6)
