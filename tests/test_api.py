"""The public surface: every exported name resolves and says what it is, `import specjax`
stays cheap, one error base, vLLM's names, the model folder's sampling defaults, and the
deprecated names still working (with a warning)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import specjax
from specjax import checkpoint, cli, config, dflash, pages, proposers, protocol, results, sampling, sharding, workloads
from specjax.config import ConfigError, Qwen3Config
from specjax.model import Model, generation_sampling
from specjax.sampling import Sampling

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "checkpoints" / "tiny-code"
CFG = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def tiny() -> Model:
    return Model(CFG, checkpoint.unstack(checkpoint.init_params(CFG, jax.random.key(0), std=0.3)), jnp.float32)


def test_every_public_name_resolves_and_has_its_own_docstring():
    assert specjax.__all__ == sorted(specjax.__all__)
    for name in specjax.__all__:
        obj = getattr(specjax, name)
        doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else obj.__doc__
        assert doc and doc.strip(), f"specjax.{name} has no docstring"
    for name in ("save_dflash", "Drafter", "SpecjaxError", "load_dflash", "NgramProposer", "Adaptive"):
        assert name in specjax.__all__
    with pytest.raises(AttributeError):
        specjax.no_such_name


def test_import_is_cheap():
    """`import specjax` loads neither jax nor transformers (the names load on first use)."""
    code = "import sys, specjax; print(sorted(m for m in ('jax', 'transformers', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_every_bad_input_error_is_a_specjax_error():
    errors = [config.ConfigError, checkpoint.CheckpointError, dflash.DFlashError, proposers.ProposerError,
              pages.PoolError, sampling.SamplingError, protocol.RequestError, sharding.ShardingError,
              results.GenerationError, cli.UsageError, workloads.PromptError]
    for error in errors:
        assert issubclass(error, specjax.SpecjaxError) and issubclass(error, ValueError), error
    with pytest.raises(specjax.SpecjaxError, match="top_p"):
        Sampling(top_p=2.0)


def test_vllm_speculative_config_and_names(tiny):
    assert proposers.from_vllm({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
                                "prompt_lookup_min": 2}) == specjax.NgramProposer(5, 4, 2)
    # one bound given: the other takes its value, as in vLLM
    assert proposers.from_vllm({"num_speculative_tokens": 3, "prompt_lookup_min": 4}) == specjax.NgramProposer(3, 4, 4)
    assert proposers.from_vllm({"num_speculative_tokens": 3}) == specjax.NgramProposer(3)
    for bad, match in (({"method": "eagle", "num_speculative_tokens": 3}, "method"),
                       ({"num_speculative_tokens": 3, "model": "x"}, "model"), ({}, "num_speculative_tokens"),
                       # the values refused by vLLM's names (specjax's own are k, max_ngram, min_ngram)
                       ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in"),
                       ({"num_speculative_tokens": 16}, "num_speculative_tokens must be an integer in"),
                       ({"num_speculative_tokens": 2.5}, "num_speculative_tokens must be an integer in"),
                       ({"num_speculative_tokens": 3, "prompt_lookup_max": 0}, "prompt_lookup_max 0"),
                       ({"num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
                        "prompt_lookup_min 5, prompt_lookup_max 2"),
                       ({"num_speculative_tokens": 3, "prompt_lookup_max": 33}, "<= 32, got")):
        with pytest.raises(proposers.ProposerError, match=match):
            proposers.from_vllm(bad)
    assert proposers.from_vllm({"num_speculative_tokens": 15, "prompt_lookup_max": 32}) == \
        specjax.NgramProposer(15, 32, 32)
    ids = [3, 5, 7, 9, 3, 5, 7, 9, 3, 5]
    want = specjax.generate(tiny, ids, max_new_tokens=12, speculative=specjax.NgramProposer(4, 2, 1))
    for kw in (dict(num_speculative_tokens=4, prompt_lookup_max=2, prompt_lookup_min=1),
               dict(speculative={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2,
                                 "prompt_lookup_min": 1})):
        got = specjax.generate(tiny, ids, max_new_tokens=12, **kw)
        assert got.tokens == want.tokens and got.stats.ks == want.stats.ks
    stop = want.tokens[3]
    assert (specjax.generate(tiny, ids, max_new_tokens=12, stop_token_ids=[stop]).tokens
            == specjax.generate(tiny, ids, max_new_tokens=12, stop_ids=[stop]).tokens)
    with pytest.raises(results.GenerationError, match="not both"):
        specjax.generate(tiny, ids, max_new_tokens=4, stop_ids=[1], stop_token_ids=[1])
    # as in vLLM, stop_token_ids stop besides the eos ids: the shipped model ends this prompt with eos at once
    shipped = specjax.load(Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-code")
    prompt = shipped.tokenizer('if __name__ == "__main__":\n    main()\n')["input_ids"]
    assert specjax.generate(shipped, prompt, max_new_tokens=8).tokens == list(shipped.eos_ids)
    assert specjax.generate(shipped, prompt, max_new_tokens=8, stop_token_ids=[7777]).tokens == list(shipped.eos_ids)
    both = specjax.generate(shipped, [prompt, ids], max_new_tokens=8, stop_token_ids=[[7777], []])
    assert both[0].tokens == list(shipped.eos_ids) and both[1].stopped == (0 in both[1].tokens)
    with pytest.raises(results.GenerationError, match="stop_token_ids must be a list of integer token ids"):
        specjax.generate(tiny, ids, max_new_tokens=4, stop_token_ids=5)
    with pytest.raises(results.GenerationError, match="not both"):
        specjax.generate(tiny, ids, max_new_tokens=4, num_speculative_tokens=2, speculative=specjax.NgramProposer())


def test_generation_config_sampling_as_transformers_reads_it():
    qwen3 = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [1, 2]}
    assert generation_sampling(qwen3, "g.json") == Sampling(0.6, 20, 0.95, 0.0)
    # do_sample absent (transformers' default False): greedy, the other fields ignored
    assert generation_sampling({"temperature": 0.6, "top_p": 0.95}, "g.json") == Sampling()
    assert generation_sampling({"do_sample": False, "temperature": 0.6}, "g.json") == Sampling()
    # a field left out (or null) takes transformers' default: temperature 1, top_k 50
    assert generation_sampling({"do_sample": True, "top_p": None}, "g.json") == Sampling(1.0, 50, 1.0, 0.0)
    for raw, field in (({"do_sample": "yes"}, "do_sample"), ({"do_sample": True, "top_k": 2.5}, "top_k"),
                       ({"do_sample": True, "top_p": 1.5}, "top_p")):
        with pytest.raises(ConfigError, match=f"g.json.*{field}"):
            generation_sampling(raw, "g.json")


def _folder(tmp_path: Path, generation: dict | None) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    for f in SHIPPED.iterdir():
        if f.name != "generation_config.json":
            (folder / f.name).symlink_to(f)
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_load_reads_the_sampling_defaults(tmp_path):
    folder = _folder(tmp_path, {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                                "eos_token_id": 0})
    model = specjax.load(folder)
    assert model.generation_defaults == Sampling(0.6, 20, 0.95) and model.eos_ids == (0,)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": "hot"}))
    with pytest.raises(ConfigError, match="generation_config.json: field temperature"):
        specjax.load(folder)
    (folder / "generation_config.json").unlink()
    assert specjax.load(folder).generation_defaults is None


def test_generate_without_sampling_uses_the_defaults(tiny):
    ids = [3, 5, 7, 9, 11]
    chosen = Sampling(0.9, top_k=8)
    folder_sampled = Model(tiny.config, tiny.params, tiny.dtype, generation_defaults=chosen)
    want = specjax.generate(tiny, ids, max_new_tokens=10, seed=4, sampling=chosen).tokens
    assert specjax.generate(folder_sampled, ids, max_new_tokens=10, seed=4).tokens == want
    greedy = specjax.generate(tiny, ids, max_new_tokens=10).tokens
    assert specjax.generate(folder_sampled, ids, max_new_tokens=10, sampling=Sampling()).tokens == greedy
    assert specjax.generate(tiny, ids, max_new_tokens=10, seed=4).tokens == greedy  # no defaults: greedy


def test_cli_says_which_sampling_it_used(capsys, tmp_path):
    folder = _folder(tmp_path, {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95})
    base = ["generate", "--model", str(folder), "--prompt-ids", "5,6,7", "--max-new-tokens", "2", "--no-warmup",
            "--no-speculate"]
    assert cli.main(base) == 0
    err = capsys.readouterr().err
    assert "[sampling: temperature 0.6, top_k 20, top_p 0.95, min_p 0 (generation_config.json)]" in err
    assert cli.main(base + ["--temperature", "0"]) == 0
    assert "[sampling: greedy (flags --temperature, the rest from generation_config.json)]" in capsys.readouterr().err


# ------------------------------------------------------------------------------ deprecated

def test_lookup_proposer_is_adaptive_ngram_and_warns(tiny):
    with pytest.warns(DeprecationWarning, match="LookupProposer"):
        old = specjax.LookupProposer(k=7, max_ngram=2)
    assert isinstance(old, specjax.Adaptive) and old.proposers == (specjax.NgramProposer(7, 2, 1),)
    with pytest.warns(DeprecationWarning), pytest.raises(proposers.ProposerError, match="steps"):
        specjax.LookupProposer(steps=0)
    ids = [3, 5, 7, 9, 3, 5, 7, 9, 3, 5]
    new = specjax.Adaptive(specjax.NgramProposer(k=7, max_ngram=2))
    assert (specjax.generate(tiny, ids, max_new_tokens=12, speculative=old).tokens
            == specjax.generate(tiny, ids, max_new_tokens=12, speculative=new).tokens)


def test_drafter_cfg_and_save_dflash_old_order_warn(tmp_path):
    drafter = dflash.init(CFG, jax.random.key(1), num_layers=1, block_size=4, target_layer_ids=(0, 1))
    with pytest.warns(DeprecationWarning, match="Drafter.cfg"):
        assert drafter.cfg is drafter.config
    specjax.save_dflash(drafter, tmp_path / "new", dtype="float32")
    with pytest.warns(DeprecationWarning, match="save_dflash"):
        specjax.save_dflash(tmp_path / "old", drafter, dtype="float32")
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "new" / name).read_bytes() == (tmp_path / "old" / name).read_bytes()
    with pytest.raises(dflash.DFlashError, match="needs a Drafter"):
        specjax.save_dflash(tmp_path / "x", tmp_path / "y")
    target = Model(CFG, checkpoint.unstack(checkpoint.init_params(CFG, jax.random.key(0))), jnp.float32)
    assert specjax.load_dflash(tmp_path / "new", target).config == drafter.config
