"""DFlash drafter training (train.dflash): the block mask, training forward == inference
forward, labels and loss weights, resumable data, and a short run that learns and resumes."""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from conftest import assert_trees_equal, hf_tiny, run_crashing_at
from specjax.cpu_kernels import unpack_tree
from specjax import dflash, qwen3
from specjax.dflash import append_context, block_logits, block_mask, draft_block, init_cache
from train import dflash as trainer
from train import dflash_data
from train.dflash_data import DataConfig, generate_data, reply_lengths

B = 8  # block size of the test drafters
TC = trainer.DFlashTrainConfig(steps=80, batch=4, anchors=8, lr=2e-2, warmup_ratio=0.1, eval_every=80,
                               eval_tokens=32, save_every_minutes=100)
DC = DataConfig(prompts=8, prompt_len=16, response_len=48, edit_share=0.0, shard_size=3)

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"


@pytest.fixture(scope="module")
def cyclic(tmp_path_factory):
    """(target, successor table) of a tiny Qwen3 whose greedy reply to anything is the
    walk x -> succ[x] along one cycle over tokens 1..100: layers write nothing to the
    residual stream and the untied head row succ[x] is x's embedding. What it says is
    learnable in a few dozen steps, which makes the training run deterministic and robust."""
    import torch

    folder = tmp_path_factory.mktemp("cyclic")
    ref = hf_tiny(folder, seed=1, tie_word_embeddings=False, eos_token_id=0)
    order = torch.randperm(100, generator=torch.Generator().manual_seed(0)) + 1
    succ = torch.zeros(101, dtype=torch.long)
    succ[order] = torch.roll(order, -1)
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        ref.model.norm.weight.fill_(1.0)
        ref.model.embed_tokens.weight.mul_(0.1)  # logits of order 1: a calm start for the drafter
        head = torch.zeros_like(ref.lm_head.weight)
        head[succ[1:]] = ref.model.embed_tokens.weight[1:]
        ref.lm_head.weight.copy_(head)
    ref.save_pretrained(folder)
    return specjax.load(folder), succ.numpy()


@pytest.fixture(scope="module")
def data(cyclic, tmp_path_factory):
    target, _ = cyclic
    shard = np.random.default_rng(0).integers(1, 101, 1000).astype(np.uint16)
    return generate_data(target, DC, tmp_path_factory.mktemp("data"), shard)


def _cfg(target):
    return dflash.config_for(target.config, num_layers=2, block_size=B, target_layer_ids=(0, 2), mask_token_id=100)


@pytest.fixture(scope="module")
def packed(tiny):
    """A random drafter for the random tiny target and one packed training example."""
    target = tiny[2]
    cfg = _cfg(target)
    params = dflash.init_params(cfg, jax.random.key(1), std=0.2)
    tokens = np.random.default_rng(2).integers(0, 101, 24).astype(np.int32)
    _, _, taps = qwen3.hidden_states(target.params, target.config, tokens[None], np.arange(24)[None],
                                     taps=cfg.target_layer_ids)  # [n, 1, T, D]
    anchors = np.array([9, 3, 14], np.int32)  # overlapping blocks, not sorted
    ids = trainer.block_tokens(jnp.asarray(tokens), anchors, B, cfg.mask_token_id)
    return target, cfg, params, tokens, np.asarray(taps[:, 0]), anchors, np.asarray(ids)


def _features(taps):
    return taps.transpose(1, 0, 2).reshape(taps.shape[1], -1)  # [n, T, D] -> [T, n*D]


# ------------------------------------------------------------------------ block mask

def test_block_mask_structure():
    anchors, t = np.array([5, 2, 9]), 12
    mask = np.asarray(block_mask(jnp.asarray(anchors), 4, t))
    assert mask.shape == (12, t + 12)
    for row in range(12):
        n = row // 4
        np.testing.assert_array_equal(mask[row, :t], np.arange(t) < anchors[n])  # strictly before the anchor
        np.testing.assert_array_equal(mask[row, t:], np.arange(12) // 4 == n)    # own block only, both ways


def test_blocks_see_only_earlier_context_and_themselves(packed):
    target, cfg, params, _, taps, anchors, ids = packed
    feats = _features(taps)
    rng = np.random.default_rng(3)

    def logits(f, i, a):
        return np.asarray(block_logits(params, cfg, target.params, target.config, f, i, a))

    base = logits(feats, ids, anchors)
    for n, a in enumerate(anchors):
        later = feats.copy()
        later[a:] = 5 * rng.standard_normal(later[a:].shape)  # the anchor's own features and after
        others = ids.copy()
        others[np.arange(len(anchors)) != n] = rng.integers(0, 101, (len(anchors) - 1, B))
        moved = anchors.copy()
        moved[np.arange(len(anchors)) != n] = rng.integers(0, 16, len(anchors) - 1)
        got = logits(later, others, moved)
        np.testing.assert_allclose(got[n], base[n], atol=1e-5, rtol=0)
        earlier = feats.copy()
        earlier[a - 1] += 1.0
        assert np.abs(logits(earlier, ids, anchors)[n] - base[n]).max() > 1e-3  # the context does matter


def test_training_forward_equals_inference(packed):
    """Each packed block == draft_block after append_context of the features before its anchor."""
    target, cfg, params, tokens, taps, anchors, ids = packed
    got = np.asarray(block_logits(params, cfg, target.params, target.config, _features(taps), ids, anchors))
    assert got.shape == (3, B - 1, 101)
    for n, a in enumerate(anchors):
        cache = append_context(params, cfg, init_cache(cfg, 64), taps[:, :a], np.int32(a), np.arange(a))
        want = draft_block(params, cfg, cache, target.params, target.config, tokens[a], np.int32(a), k=B - 1)
        assert np.abs(got[n] - np.asarray(want)).max() <= 1e-4


# ------------------------------------------------------------------ labels and loss

def test_default_gamma():
    assert [trainer.default_gamma(b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]
    assert trainer.default_gamma(12) == pytest.approx(5 + 2 / 3) and trainer.default_gamma(4) == 4.0


def test_labels_and_weights_by_hand():
    tokens = jnp.arange(12) + 10  # the token at position p is 10 + p
    anchors, valid = jnp.array([2, 6, 3]), jnp.array([True, True, False])
    np.testing.assert_array_equal(trainer.block_tokens(tokens, anchors, 4, 99),
                                  [[12, 99, 99, 99], [16, 99, 99, 99], [13, 99, 99, 99]])
    labels, weights = trainer.block_targets(tokens, anchors, valid, jnp.int32(9), 4, 2.0)
    np.testing.assert_array_equal(labels[:2], [[13, 14, 15], [17, 18, 19]])  # row k -> token at anchor + k
    e = np.exp(-np.arange(3) / 2.0)
    np.testing.assert_allclose(weights, [e, [e[0], e[1], 0.0], [0, 0, 0]], rtol=1e-6)  # position 9 >= length 9

    v = 20
    logits = np.zeros((3, 3, v), np.float32)
    right = [[True, True, False], [True, False, True], [True, True, True]]
    for n in range(3):
        for k in range(3):
            logits[n, k, int(labels[n, k]) if right[n][k] else 0] = 8.0
    loss, tau = trainer.block_loss(jnp.asarray(logits), labels, weights, valid)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, np.asarray(labels)[..., None], -1)[..., 0]
    w = np.asarray(weights)
    assert float(loss) == pytest.approx((w * ce).sum() / w.sum(), rel=1e-5)
    assert float(tau) == pytest.approx(1 + (2 + 1) / 2)  # leading right rows of the two valid blocks


def test_anchors_lie_in_the_reply():
    rng = np.random.default_rng(0)
    anchors, valid = trainer.sample_anchors(np.array([20, 12, 11]), np.array([10, 10, 10]), 4, rng)
    a = anchors[0]
    assert valid[0].all() and np.all(np.diff(a) > 0) and a.min() >= 10 and a.max() <= 18
    assert valid[1].tolist() == [True, False, False, False] and anchors[1, 0] == 10
    assert not valid[2].any()  # a reply of one token has no anchor with a token after it


# ------------------------------------------------------------------------------ data

def test_reply_lengths():
    seqs = np.array([[5, 0, 7, 8, 0, 0], [5, 6, 7, 8, 9, 1], [0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(reply_lengths(seqs, 2, (0,)), [5, 6, 3])
    np.testing.assert_array_equal(reply_lengths(seqs, np.array([1, 2, 5]), (0,)), [2, 6, 6])  # per-row starts
    # replies of at most 2 tokens: rows 0 and 2 end at their eos; row 1's reply [6, 7] reached the limit and
    # ends there, whatever follows (after a cut reply, eos padding the target never said)
    np.testing.assert_array_equal(reply_lengths(seqs, np.array([1, 1, 2]), (0,), limit=2), [2, 3, 3])


def test_data_are_the_targets_replies_and_resume(cyclic, data, tmp_path, monkeypatch):
    target, succ = cyclic
    assert data.tokens.shape == (DC.prompts, DC.prompt_len + DC.response_len) and (data.starts == DC.prompt_len).all()
    for row in data.tokens:
        np.testing.assert_array_equal(row[DC.prompt_len:], succ[row[DC.prompt_len - 1:-1]])  # the greedy walk
    shard = np.random.default_rng(0).integers(1, 101, 1000).astype(np.uint16)
    real, calls = dflash_data.sequences, []

    def killed_on_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(dflash_data, "sequences", killed_on_second)
    with pytest.raises(KeyboardInterrupt):
        generate_data(target, DC, tmp_path, shard)
    assert sorted(p.name for p in tmp_path.glob("seqs-*.npy")) == ["seqs-00000.npy"]
    again = generate_data(target, DC, tmp_path)  # prompts.npy is there: no shard needed
    assert len(calls) == 2 + 2  # the killed call, then one call per remaining shard
    np.testing.assert_array_equal(again.tokens, data.tokens)
    with pytest.raises(specjax.SpecjaxError, match="another plan, prompts or target .*: response_len differ"):
        generate_data(target, dataclasses.replace(DC, response_len=40), tmp_path)  # a one-line CLI error
    retrained = dataclasses.replace(target, params={**target.params, "model.embed_tokens.weight":
                                                    1.5 * unpack_tree(target.params["model.embed_tokens.weight"])})
    with pytest.raises(ValueError, match="another plan, prompts or target"):
        generate_data(retrained, DC, tmp_path)
    (tmp_path / "meta.json").unlink()  # what the folder was made for is lost: its data are not taken for another
    with pytest.raises(specjax.SpecjaxError, match="holds prompts or sequences but no meta.json"):
        generate_data(target, dataclasses.replace(DC, data_seed=5), tmp_path)
    # lengths past the target's context are refused by flag before anything is written
    longer = dataclasses.replace(DC, prompt_len=4000, response_len=200)
    with pytest.raises(specjax.SpecjaxError, match="--prompt-len 4000 \\+ --response-len 200 exceeds"):
        generate_data(target, longer, tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()


@pytest.mark.parametrize("sampling", [specjax.Sampling(), specjax.Sampling(temperature=0.8, top_k=20, top_p=0.9)],
                         ids=["greedy", "sampled"])
def test_batched_replies_are_what_generate_says(cyclic, rng, sampling):
    """Rows of different prompt lengths decoded together on the engine == one
    specjax.generate per row, each reply after its own prompt and padded with eos."""
    target, _ = cyclic
    prompts = rng.integers(1, 101, (3, 11)).astype(np.int32)
    prompts[1, 7:] = -1  # a shorter prompt
    seeds = rng.integers(0, 2**20, 3)
    got = dflash_data.sequences(specjax.Engine(target, max_batch=2, max_len=31), prompts, 20, sampling, seeds)
    for row, seed, out in zip(prompts, seeds, got):
        ids = row[row >= 0]
        ref = specjax.generate(target, ids, max_new_tokens=20, sampling=sampling, seed=int(seed)).tokens
        want = np.concatenate([ids, ref, np.full(31 - len(ids) - len(ref), target.eos_ids[0])])
        np.testing.assert_array_equal(out, want)


# ---------------------------------------------------------------------------- training

def test_short_run_lowers_loss_and_raises_tau(cyclic, data, tmp_path):
    target, _ = cyclic
    cfg = _cfg(target)
    prompts = [("train", row[:DC.prompt_len]) for row in data.tokens[:4]]
    out = trainer.train(target, cfg, TC, data, tmp_path / "run", tmp_path / "out", prompts)
    assert out["step"] == TC.steps
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "tau" in r]
    assert [r["step"] for r in evals] == [0, TC.steps]
    before, after = evals
    assert before["tau"] < 1.5 and after["tau"] > before["tau"] + 1.5, (before, after)
    assert len(after["acceptance_by_position"]) == B - 1 and after["by_kind"]["train"]["tau"] == after["tau"]

    batch = {k: v[0] for k, v in trainer.batch_at(data, TC, 0).items()}  # accum 1: one micro-batch
    loss_fn = jax.jit(trainer.loss_fn, static_argnums=(1, 3, 4))
    gamma = trainer.default_gamma(B)
    first = loss_fn(trainer.initial_state(cfg, TC)["params"], cfg, target.params, target.config, gamma, batch)
    last = loss_fn(out["params"], cfg, target.params, target.config, gamma, batch)
    assert float(last[0]) < float(first[0]) - 1.0 and float(last[1]) > float(first[1])

    exported = specjax.load_dflash(tmp_path / "out", target)  # written when tau improved
    assert exported.config == cfg
    assert trainer.evaluate_tau(target, exported, prompts, TC.eval_tokens)["tau"] > before["tau"] + 1.0


def test_kill_and_resume_continues_identically(cyclic, data, tmp_path, monkeypatch):
    target, _ = cyclic
    cfg = _cfg(target)
    tc = trainer.DFlashTrainConfig(steps=6, batch=2, anchors=4, lr=1e-2, log_every=2, save_every_minutes=0)
    full = trainer.train(target, cfg, tc, data, tmp_path / "full")

    run_crashing_at(monkeypatch, trainer, 4, lambda: trainer.train(target, cfg, tc, data, tmp_path / "resumed"))
    resumed = trainer.train(target, cfg, tc, data, tmp_path / "resumed")
    assert full["step"] == resumed["step"] == tc.steps
    assert_trees_equal(full["params"], resumed["params"])
    assert_trees_equal(full["opt_state"], resumed["opt_state"])
    for run in ("full", "resumed"):
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [2, 4, 6] and all("train_loss" in r for r in rows)


def test_warmup_leaves_a_step_to_decay_and_a_one_step_run_trains(cyclic, data, tmp_path):
    """The warmup is round(warmup_ratio * steps), at least 1 but at most steps - 1, so that
    optax's cosine decay has a step: --steps 1 (and --warmup-ratio 1) train instead of failing
    in the schedule."""
    for steps, ratio, warmup in ((1, 0.04, 0), (2, 0.04, 1), (100, 0.04, 4), (10, 1.0, 9), (10, 0.0, 1)):
        assert trainer.DFlashTrainConfig(steps=steps, warmup_ratio=ratio).warmup == warmup
    target, _ = cyclic
    tc = trainer.DFlashTrainConfig(steps=1, batch=2, anchors=4, save_every_minutes=100)
    assert trainer.train(target, _cfg(target), tc, data, tmp_path / "run")["step"] == 1


@pytest.mark.parametrize("flags, message", [
    (["--lr", "0"], "--lr must be > 0, got 0.0"),
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--weight-decay", "-0.01"], "--weight-decay must be >= 0, got -0.01"),
    (["--clip", "0"], "--clip must be > 0, got 0.0"),
    (["--clip", "inf"], "--clip must be a finite number, got inf"),
    (["--warmup-ratio", "-0.1"], "--warmup-ratio must be in [0, 1], got -0.1"),
    (["--warmup-ratio", "1.5"], "--warmup-ratio must be in [0, 1], got 1.5"),
    (["--gamma", "-1"], "--gamma must be >= 0, got -1.0"),
    (["--gamma", "nan"], "--gamma must be a finite number, got nan"),
    (["--markov-rank", "-2"], "--markov-rank must be >= 0, got -2"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--edit-share", "1.5"], "--edit-share must be in [0, 1], got 1.5"),
    (["--data-seed", "-1"], "--data-seed must be >= 0, got -1"),
    # the sampling flags of the generated replies, by specjax.Sampling's own rules
    (["--temperature", "-1"], "--temperature: temperature must be a finite number >= 0"),
    (["--temperature", "nan"], "--temperature must be a finite number, got nan"),
    (["--top-k", "-1"], "--top-k: top_k must be an integer >= 0"),
    (["--top-p", "0"], "--top-p: top_p must be in (0, 1], got 0.0"),
    (["--sample", "--top-p", "1.5"], "--top-p: top_p must be in (0, 1], got 1.5"),
    (["--min-p", "2"], "--min-p: min_p must be in [0, 1], got 2.0"),
    # the drafter's shape, evaluation prompts and devices (RunFlags)
    (["--layers", "0"], "--layers must be > 0, got 0"),
    (["--block-size", "1"], "--block-size must be >= 2 (the anchor and at least one draft), got 1"),
    (["--eval-prompts", "0"], "--eval-prompts must be > 0, got 0"),
    (["--eval-prompt-len", "-3"], "--eval-prompt-len must be > 0, got -3"),
    (["--devices", "0"], "--devices must be > 0, got 0"),
    (["--tp", "0"], "--tp must be > 0, got 0"),
    (["--mask-token-id", "-1"], "--mask-token-id must be >= 0, got -1"),
    (["--prompt-file", "p.txt", "--heldout-share", "0"], "--heldout-share must be in (0, 1), got 0.0"),
    (["--prompt-file", "p.txt", "--heldout-share", "1"], "--heldout-share must be in (0, 1), got 1.0"),
    (["--prompt-file", "p.txt", "--heldout-share", "nan"], "--heldout-share must be a finite number, got nan"),
    # flags of the other prompt source
    (["--heldout-share", "0.2"], "--heldout-share applies to the user's prompts (--prompt-file / --prompt-dir)"),
    (["--chat"], "--chat applies to the user's prompts"),
    (["--prompt-dir", "d", "--eval-prompts", "2"], "--eval-prompts applies to corpus prompts, not to --prompt-file"),
    (["--prompt-file", "p.txt", "--eval-prompt-len", "64"], "--eval-prompt-len applies to corpus prompts"),
])
def test_bad_flag_values_are_refused_naming_the_flag_before_loading(flags, message, tmp_path, capsys):
    """python -m train.dflash refuses a value out of range (or NaN / inf) with an argparse error
    naming the flag before it loads the target (--target does not exist here), let alone
    generates data or compiles: not an error of specjax.Sampling naming its own argument after
    the target loads, nor a run that trains on (a negative --gamma or --warmup-ratio)."""
    with pytest.raises(SystemExit) as exit_:
        trainer.main(["--target", str(tmp_path / "no-target"), "--out", str(tmp_path / "out"),
                      "--run", str(tmp_path / "run"), *flags])
    assert exit_.value.code == 2
    assert f"python -m train.dflash: error: {message}" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_resuming_with_other_settings_is_refused_naming_the_flags(cyclic, data, tmp_path):
    """A checkpoint records its training settings; resuming it under others (a learning rate,
    batch or Markov head of another run) is refused, naming each flag, rather than mixed."""
    target, _ = cyclic
    tc = trainer.DFlashTrainConfig(steps=2, batch=2, anchors=4, lr=1e-2, save_every_minutes=100)
    trainer.train(target, _cfg(target), tc, data, tmp_path / "run")
    for changed, named in ((dict(lr=2e-2, batch=4), "--batch 2 -> 4, --lr 0.01 -> 0.02"),
                           (dict(markov_rank=2), "--markov-rank 0 -> 2"),
                           (dict(steps=3), "--steps 2 -> 3")):
        with pytest.raises(specjax.SpecjaxError, match=f"other settings \\({named}\\)"):
            trainer.train(target, _cfg(target), dataclasses.replace(tc, **changed), data, tmp_path / "run")
    again = dataclasses.replace(tc, eval_every=7, log_every=3)  # bookkeeping may differ
    assert trainer.train(target, _cfg(target), again, data, tmp_path / "run")["step"] == 2
    # another drafter config names the fields; --init, which starts a fresh run, is refused rather than ignored
    wider = dflash.config_for(target.config, num_layers=2, block_size=2 * B, target_layer_ids=(0, 2),
                              mask_token_id=100)
    with pytest.raises(specjax.SpecjaxError, match=f"another drafter config \\(block_size {B} -> {2 * B}\\)"):
        trainer.train(target, wider, tc, data, tmp_path / "run")
    with pytest.raises(specjax.SpecjaxError, match="--init .*holds a run at step 2, which resumes"):
        trainer.train(target, _cfg(target), tc, data, tmp_path / "run", init=tmp_path / "elsewhere")


def test_bfloat16_compute_keeps_float32_master_state(cyclic, data, tmp_path):
    """--precision bfloat16: the losses of the same steps are the float32 run's within bf16
    rounding (and not equal to them: the forward did run in bf16), while the weights it
    updates and the AdamW moments stay float32."""
    target, _ = cyclic
    cfg = _cfg(target)
    tc = trainer.DFlashTrainConfig(steps=2, batch=2, anchors=4, lr=1e-2, log_every=1, save_every_minutes=100)
    out, losses = {}, {}
    for dtype in (jnp.float32, jnp.bfloat16):
        name = jnp.dtype(dtype).name
        out[name] = trainer.train(target, cfg, tc, data, tmp_path / name, compute=dtype)
        losses[name] = np.array([json.loads(line)["train_loss"]
                                 for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()])
    rel = np.abs(losses["bfloat16"] / losses["float32"] - 1)
    assert len(rel) == 2 and (rel > 0).all() and (rel < 2e-2).all(), (losses, rel)
    floats = [x for x in jax.tree.leaves((out["bfloat16"]["params"], out["bfloat16"]["opt_state"]))
              if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(x.dtype == jnp.float32 for x in floats)
    start = trainer.initial_state(cfg, tc)["params"]  # warmup: step 0 has lr 0, step 1 moves the weights
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(out["bfloat16"]["params"]),
                                                         jax.tree.leaves(start)))


def test_precision_auto_is_bfloat16_off_cpu():
    assert trainer.compute_dtype("auto", "cpu") == jnp.float32
    assert trainer.compute_dtype("auto", "gpu") == trainer.compute_dtype("auto", "tpu") == jnp.bfloat16
    assert trainer.compute_dtype("bfloat16", "cpu") == jnp.bfloat16
    assert trainer.compute_dtype("float32", "tpu") == jnp.float32
    with pytest.raises(ValueError, match="expected one of auto, float32, bfloat16"):
        trainer.compute_dtype("float16", "gpu")


def test_init_starts_from_a_saved_drafter(cyclic, data, tmp_path):
    """--init: a fresh run's step-0 weights are the saved drafter's (stacked for training),
    at its block size or another (no weight depends on it); a drafter of another shape is
    refused."""
    target, _ = cyclic
    cfg = _cfg(target)
    saved = dflash.Drafter(dflash.init_params(cfg, jax.random.key(5), std=0.2), cfg, jnp.float32)
    dflash.save_dflash(saved, tmp_path / "saved", dtype="float32")
    tc = trainer.DFlashTrainConfig(steps=2, batch=2, anchors=4, lr=0.0, save_every_minutes=0)  # lr 0: no move
    for block, run in ((cfg.block_size, "run"), (4, "run4")):
        asked = dataclasses.replace(cfg, block_size=block)
        out = trainer.train(target, asked, tc, data, tmp_path / run, init=tmp_path / "saved")
        assert_trees_equal(out["params"], saved.params)
    deeper = dataclasses.replace(cfg, num_hidden_layers=3)
    differs = "the drafter differs from the one asked for \\(.*num_hidden_layers 2 -> 3"
    with pytest.raises(specjax.SpecjaxError, match=differs):
        trainer.train(target, deeper, tc, data, tmp_path / "run2", init=tmp_path / "saved")


def test_a_markov_head_trains_beside_a_drafter_left_as_it_would_be(cyclic, data, tmp_path):
    """--markov-rank: the drafter's weights after the run are bitwise those of the same run
    without a head (the head's loss reads the block logits with their gradient stopped,
    and it has an optimizer of its own); the head learns the target's walk, a bigram,
    faster than the block pass; the export carries it and loads with or without it; --init
    from a drafter with a head of another rank is refused."""
    target, _ = cyclic
    cfg = _cfg(target)
    runs = {}
    for rank in (0, 16):  # (only the run with a head evaluates and exports)
        tc = dataclasses.replace(TC, steps=30, eval_every=30, markov_rank=rank, log_every=10)
        runs[rank] = trainer.train(target, cfg, tc, data, tmp_path / f"run{rank}", tmp_path / f"out{rank}",
                                   [("train", data.tokens[0, :DC.prompt_len])] if rank else ())
    head = runs[16]["params"].pop(dflash.MARKOV)
    assert_trees_equal(runs[0]["params"], runs[16]["params"])
    assert head["w1"].shape == (cfg.vocab_size, 16) and float(jnp.abs(head["w2"]).max()) > 0
    rows = [json.loads(line) for line in (tmp_path / "run16" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "markov_loss" in r][-1]
    assert last["markov_loss"] < last["train_loss"] - 0.5, last
    assert dflash.MARKOV in specjax.load_dflash(tmp_path / "out16", target).params
    assert dflash.MARKOV not in specjax.load_dflash(tmp_path / "out16", target, markov=False).params
    with pytest.raises(ValueError, match="Markov head has rank 16, --markov-rank asks for 8"):
        trainer.train(target, cfg, dataclasses.replace(tc, markov_rank=8), data, tmp_path / "run8",
                      init=tmp_path / "out16")


def test_draft_vocabulary_is_the_most_frequent_tokens(rng):
    """train.draft_vocab against collections.Counter over the same token stream."""
    from collections import Counter

    from train.draft_vocab import coverage, most_frequent, token_counts

    class Chars:  # a tokenizer of one id per character
        def __call__(self, text):
            return {"input_ids": [ord(c) - 97 for c in text]}

    docs = ["".join(rng.choice(list("abcdefghij"), int(rng.integers(5, 40)), p=np.arange(10, 0, -1) / 55))
            for _ in range(50)]
    counts = token_counts(Chars(), docs, 26, 10 ** 6, "test")
    want = Counter(c for d in docs for c in d)
    assert {chr(97 + i): int(n) for i, n in enumerate(counts) if n} == dict(want)
    top = [ord(c) - 97 for c, _ in sorted(want.items(), key=lambda kv: (-kv[1], kv[0]))[:4]]
    ids = most_frequent(counts, 4, always=(25,))
    assert ids.tolist() == sorted(top + [25])
    assert coverage(counts, ids) == sum(want[chr(97 + i)] for i in top) / sum(want.values())


@pytest.mark.parametrize("flags,message", [
    (["--chars", "0"], "--chars: must be an integer of at least 1"),  # counted nothing, wrote ids 0 .. size - 1
    (["--chars", "-5"], "--chars: must be an integer of at least 1"),  # sliced doc[:-5]
    (["--size", "0"], "--size: must be an integer of at least 1"),
    (["--size", "9000"], "--size 9000: more than the drafter's vocabulary of 8192 tokens"),
])
def test_draft_vocab_flags_out_of_range_are_refused_before_counting(flags, message, tmp_path, monkeypatch, capsys):
    from train import draft_vocab

    shutil.copytree(CHECKPOINTS / "tiny-code-dflash", tmp_path / "d")
    before = (tmp_path / "d" / "draft_vocab.json").read_bytes()
    monkeypatch.setattr(draft_vocab, "token_counts", lambda *a: pytest.fail("counted"))
    with pytest.raises(SystemExit) as e:
        draft_vocab.main(["--drafter", str(tmp_path / "d"), "--target", str(CHECKPOINTS / "tiny-code"),
                          *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert (tmp_path / "d" / "draft_vocab.json").read_bytes() == before


def test_eval_prompts_no_held_out_file_can_give_are_refused_before_the_data(tmp_path, capsys):
    """Corpus mode builds its held-out evaluation prompts before it generates the training
    data: an --eval-prompt-len longer than every held-out file is refused naming the flags,
    not after the data (a long job) was generated."""
    shards = tmp_path / "shards"
    shards.mkdir()
    np.save(shards / "train.npy", np.arange(4096, dtype=np.int32) % 100)
    with pytest.raises(SystemExit) as exit_:
        trainer.main(["--target", str(Path(__file__).parents[1] / "checkpoints" / "tiny-code"),
                      "--shards", str(shards), "--out", str(tmp_path / "out"), "--run", str(tmp_path / "run"),
                      "--eval-prompts", "1", "--eval-prompt-len", "100000"])
    assert exit_.value.code == 2
    assert ("python -m train.dflash: error: --eval-prompts 1 / --eval-prompt-len 100000: no held-out file is long "
            "enough for completion prompts of 100000 tokens") in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists()


def test_out_may_not_be_the_target_or_another_model(tmp_path, capsys):
    """--out receives exports that replace its weights and config.json: the --target folder
    itself, or a folder holding another model, is refused before anything is written (the
    target's files were replaced by the drafter's)."""
    import shutil

    target = tmp_path / "target"
    shutil.copytree(CHECKPOINTS / "tiny-code", target)
    other = tmp_path / "other"
    shutil.copytree(CHECKPOINTS / "tiny-code-draft", other)
    before = {f: f.read_bytes() for f in [*target.iterdir(), *other.iterdir()]}
    for out, said in ((target, "is the --target folder"), (other, "holds a model that is not a DFlash drafter")):
        with pytest.raises(SystemExit) as exit_:
            trainer.main(["--target", str(target), "--out", str(out), "--run", str(tmp_path / "run"),
                          "--shards", str(tmp_path / "none")])
        assert exit_.value.code == 2 and said in capsys.readouterr().err
    assert {f: f.read_bytes() for f in [*target.iterdir(), *other.iterdir()]} == before
    assert not (tmp_path / "run").exists()


def test_an_interrupted_stage_exits_130(tmp_path, monkeypatch, capsys):
    """Ctrl-C / SIGTERM while the data are generated, or a training loop stopped by one
    (saved, short of --steps), ends the stage with exit code 130 as a shell reports Ctrl-C,
    so that `python -m train.dflash ... && next-stage` does not go on; they exited 0."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\nclass A:\nimport os\n")
    argv = ["--target", str(CHECKPOINTS / "tiny-code"), "--out", str(tmp_path / "out"), "--run", str(tmp_path / "run"),
            "--prompt-file", str(prompts), "--steps", "5"]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "generate_data", interrupted)
    with pytest.raises(SystemExit) as exit_:
        trainer.main(argv)
    assert exit_.value.code == 130 and "interrupted: finished shards are kept" in capsys.readouterr().err
    monkeypatch.setattr(trainer, "generate_data", lambda *a, **k: None)
    for done, code in ((2, 130), (5, None)):
        monkeypatch.setattr(trainer, "train", lambda *a, **k: {"step": done})
        if code is None:
            trainer.main(argv)
        else:
            with pytest.raises(SystemExit) as exit_:
                trainer.main(argv)
            assert exit_.value.code == code


def test_a_reply_cut_at_response_len_has_no_eos_label(cyclic, tmp_path):
    """The user's prompts are shorter than --prompt-len, so each row is padded with eos
    after its reply; the cyclic target never says eos, so every reply is cut at
    response_len and its valid length ends there: the padding eos is no label (it was: the
    drafter learned an eos the target never said)."""
    from train import prompts as user_prompts

    target, succ = cyclic
    rows = [user_prompts.Prompt("p", tuple(int(t) for t in np.arange(1, n + 1))) for n in (3, 7, 12)]
    dc = dataclasses.replace(DC, prompt_len=16, response_len=8)
    data = generate_data(target, dc, tmp_path, prompts=user_prompts.pad(rows, dc.prompt_len))
    np.testing.assert_array_equal(data.starts, [3, 7, 12])
    np.testing.assert_array_equal(data.lengths, data.starts + dc.response_len)
    for row, start in zip(data.tokens, data.starts):
        np.testing.assert_array_equal(row[start:start + 8], succ[row[start - 1:start + 7]])  # the walk, no eos
        assert (row[start + 8:] == 0).all()  # then the eos padding, past the valid length
