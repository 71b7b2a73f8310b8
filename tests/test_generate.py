"""Plain generation: greedy equals transformers' generate; bad input is a clear error."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import specjax
from specjax.checkpoint import CheckpointError
from specjax.config import ConfigError
from specjax.engine import Engine
from specjax.errors import SpecjaxError
from specjax.model import DtypeError
from specjax.results import GenerationError
from conftest import hf_tiny


def test_greedy_equals_transformers_generate(tiny, rng):
    ref, _, model = tiny
    for length in (1, 9, 150):
        ids = rng.integers(0, model.config.vocab_size, length)
        with torch.no_grad():
            want = ref.generate(torch.tensor(ids[None]), attention_mask=torch.ones(1, length, dtype=torch.long),
                                max_new_tokens=64, min_new_tokens=64, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, length:].tolist()
        got = specjax.generate(model, ids, max_new_tokens=64, stop_ids=())
        assert got.tokens == want
        assert got.stats.new_tokens == 64 and got.stats.steps == 63


def test_stop_id_and_max_new_tokens(tiny, rng):
    _, _, model = tiny
    ids = rng.integers(0, model.config.vocab_size, 12)
    full = specjax.generate(model, ids, max_new_tokens=30).tokens
    stop = full[10]
    first = full.index(stop)
    res = specjax.generate(model, ids, max_new_tokens=30, stop_ids=[stop])
    assert res.tokens == full[:first + 1] and res.stopped
    assert specjax.generate(model, ids, max_new_tokens=7).tokens == full[:7]


def test_stops_at_the_models_eos_unless_told_not_to(tiny, rng):
    _, _, model = tiny
    ids = rng.integers(0, model.config.vocab_size, 12)
    full = specjax.generate(model, ids, max_new_tokens=30, stop_ids=()).tokens
    eos = full[12]
    with_eos = dataclasses.replace(model, config=dataclasses.replace(model.config, eos_token_id=(eos,)))
    res = specjax.generate(with_eos, ids, max_new_tokens=30)
    assert res.tokens == full[:full.index(eos) + 1] and res.stopped
    assert specjax.generate(with_eos, ids, max_new_tokens=30, stop_ids=()).tokens == full


def test_missing_weights_file(tmp_path):
    hf_tiny(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        specjax.load(tmp_path)


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        specjax.load(tmp_path / "nope")
    with pytest.raises(ConfigError, match="config.json"):
        specjax.load(tmp_path)


def test_wrong_tensor_shape_names_the_tensor(tmp_path):
    hf_tiny(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 80
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.(down|gate|up)_proj\.weight"):
        specjax.load(tmp_path)


def test_unknown_model_type(tmp_path):
    hf_tiny(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="model_type"):
        specjax.load(tmp_path)


def test_prompt_longer_than_capacity(tiny):
    _, _, model = tiny
    with pytest.raises(GenerationError, match="capacity"):
        specjax.generate(model, [1] * 300, max_new_tokens=10, capacity=256)
    with pytest.raises(GenerationError, match="max_position_embeddings"):
        specjax.generate(model, [1] * 4000, max_new_tokens=200)


@pytest.mark.parametrize("ids,match", [([], "non-empty"), ([5, 101], r"\[0, 101\)"), ([-1], r"\[0, 101\)"),
                                       ("hello", "got text"), ([1.5, 2.0], "must be integers"),
                                       ([1, [2, 3]], r"or, for a batch, a list of such lists; got \[1, \[2, 3\]\]"),
                                       ([[1, 2], "ab"], "for a batch, a list of such lists"),
                                       (None, "must be token ids")])
def test_bad_prompt(tiny, ids, match):
    """One prompt (or what is neither a prompt nor a batch of them): a GenerationError, never
    NumPy's ragged-array ValueError."""
    with pytest.raises(GenerationError, match=match):
        specjax.generate(tiny[2], ids, max_new_tokens=3)


@pytest.mark.parametrize("bad,match", [([], "non-empty"), ([5, 101], r"\[0, 101\)"), ([2, [3]], "must be token ids"),
                                       ([7] * 5000, "exceeds the model's max_position_embeddings")])
def test_bad_prompt_of_a_batch_is_named_by_its_index(tiny, bad, match):
    with pytest.raises(SpecjaxError, match=rf"^prompts\[2\]: .*{match}"):
        specjax.generate(tiny[2], [[1, 2], [3], bad], max_new_tokens=3)


@pytest.mark.parametrize("seed", [-1, 2 ** 32, 1.0, True])
def test_bad_seed(tiny, seed):
    with pytest.raises(GenerationError, match="seed must be an integer"):
        specjax.generate(tiny[2], [1, 2], max_new_tokens=2, seed=seed)


def test_bad_max_new_tokens(tiny):
    with pytest.raises(GenerationError, match="max_new_tokens"):
        specjax.generate(tiny[2], [1, 2], max_new_tokens=0)


def test_numpy_integers_are_integers(tiny):
    want = specjax.generate(tiny[2], [1, 2], max_new_tokens=4, capacity=256, seed=3).tokens
    got = specjax.generate(tiny[2], [1, 2], max_new_tokens=np.int64(4), capacity=np.int32(256), seed=np.uint8(3))
    assert got.tokens == want
    for bad in (True, 4.0, "4"):
        with pytest.raises(GenerationError, match="max_new_tokens must be an integer"):
            specjax.generate(tiny[2], [1, 2], max_new_tokens=bad)
    with pytest.raises(GenerationError, match="capacity must be an integer"):
        specjax.generate(tiny[2], [1, 2], max_new_tokens=4, capacity="256")
    batch = specjax.generate(tiny[2], [[1, 2], [3]], max_new_tokens=np.int64(4), seed=np.uint8(3))
    assert batch[0].tokens == want
    engine = Engine(tiny[2], np.int64(3), max_batch=np.int32(2), max_len=np.int64(64), rounds=np.int8(4))
    req = engine.submit([1, 2], max_new_tokens=4, seed=3, k=np.int64(2))
    assert req.result().tokens == want


@pytest.mark.parametrize("stop_ids", [7, np.int64(7), "7", ["a"], [7.0], [True], [[7]], np.array([[7]]),
                                      np.array([7.0]), [-1], [2 ** 31], np.array([2 ** 40])], ids=repr)
def test_bad_stop_ids_one_prompt_or_many(tiny, stop_ids):
    """One check for both paths: each refuses what is not a list of integer ids."""
    with pytest.raises(GenerationError, match="stop_ids must be"):
        specjax.generate(tiny[2], [5, 6, 7], max_new_tokens=8, stop_ids=stop_ids)
    with pytest.raises(GenerationError, match="stop_ids must be"):
        specjax.generate(tiny[2], [[5, 6, 7], [5, 6]], max_new_tokens=8, stop_ids=stop_ids)


def test_stop_ids_of_every_integer_kind(tiny, rng):
    model = tiny[2]
    ids = rng.integers(0, model.config.vocab_size, 12)
    full = specjax.generate(model, ids, max_new_tokens=20, stop_ids=()).tokens
    want = full[:full.index(full[5]) + 1]
    for stops in ([full[5]], (np.int64(full[5]),), {full[5]}, np.array([full[5]], np.int32)):
        assert specjax.generate(model, ids, max_new_tokens=20, stop_ids=stops).tokens == want
        assert specjax.generate(model, [ids], max_new_tokens=20, stop_ids=stops)[0].tokens == want
    assert specjax.generate(model, ids, max_new_tokens=20, stop_ids=np.array([])).tokens == full


@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype="int32"), "dtype int32: expected one of float32, bfloat16, float16, int8"),
    (dict(dtype="uint8"), "dtype uint8"), (dict(dtype="float8_e4m3fn"), "dtype float8_e4m3fn"),
    (dict(dtype="float64"), "dtype float64"), (dict(dtype="foo"), "dtype 'foo'"), (dict(dtype=5), "dtype 5"),
    (dict(kv_dtype="int8"), "kv_dtype int8: expected one of float32, bfloat16, float16$"),
    (dict(kv_dtype="foo"), "kv_dtype 'foo'"), (dict(kv_dtype="float64"), "kv_dtype float64"),
])
def test_unsupported_dtypes_are_refused_by_name(tiny, kwargs, match):
    with pytest.raises(DtypeError, match=match):
        specjax.load(tiny[1], **kwargs)


def test_every_supported_dtype_generates(tiny):
    """float16 compute and a float16 cache, accepted beside float32, bfloat16 and int8, run
    (a different model: only a full run is asked of it)."""
    model = specjax.load(tiny[1], dtype="float16", kv_dtype="float16")
    assert model.dtype == jnp.float16 and model.cache_dtype == jnp.float16
    assert len(specjax.generate(model, [5, 6, 7], max_new_tokens=6, stop_ids=()).tokens) == 6


class _Oracle:
    """A Python drafter that knows the plain run: it proposes the tokens plain decoding
    emits next (junk where told to), so each step's drafts are right or wrong by design."""

    def __init__(self, prompt_len, truth, wrong_every=0):
        self.prompt_len, self.truth, self.wrong_every, self.calls = prompt_len, truth, wrong_every, 0

    def propose(self, history, limit):
        self.calls += 1
        done = len(history) - self.prompt_len
        out = list(self.truth[done:done + limit])
        if self.wrong_every and self.calls % self.wrong_every == 0 and out:
            out[0] = (out[0] + 1) % 101
        return out


def test_host_drafter_runs_as_the_requests_drafter(tiny, rng):
    """An object with propose(history, limit) drafts on the engine: right drafts are all
    accepted (fewer steps), wrong ones are rejected, and the tokens are plain decoding's."""
    model = tiny[2]
    ids = rng.integers(0, model.config.vocab_size, 20)
    plain = specjax.generate(model, ids, max_new_tokens=40, stop_ids=())
    right = specjax.generate(model, ids, max_new_tokens=40, stop_ids=(), speculative=_Oracle(20, plain.tokens))
    assert right.tokens == plain.tokens
    assert right.stats.drafted > 0 and right.stats.accepted == right.stats.drafted
    assert right.stats.steps < plain.stats.steps and {p for p, _ in right.stats.choices} <= {"host", None}
    mixed = specjax.generate(model, ids, max_new_tokens=40, stop_ids=(),
                             speculative=_Oracle(20, plain.tokens, wrong_every=2))
    assert mixed.tokens == plain.tokens and 0 < mixed.stats.accepted < mixed.stats.drafted
    batch = specjax.generate(model, [ids, ids[:9]], max_new_tokens=[40, 12], stop_ids=(),
                             speculative=_Oracle(20, plain.tokens))
    assert batch[0].tokens == plain.tokens
    assert batch[1].tokens == specjax.generate(model, ids[:9], max_new_tokens=12, stop_ids=()).tokens


def test_unknown_speculative_names_what_is_accepted(tiny):
    for bad in ("ngram", 3.5, object()):
        with pytest.raises(GenerationError, match="NgramProposer, DraftProposer or DFlashProposer, an Adaptive over "
                                                  "them, or a HostDrafter"):
            specjax.generate(tiny[2], [1, 2, 3], max_new_tokens=3, speculative=bad)
