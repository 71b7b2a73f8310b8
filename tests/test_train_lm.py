"""The training loop learns, and an interrupted run resumes exactly where it stopped."""

import dataclasses
import json
import os
import signal

import numpy as np
import pytest

from specjax.config import Qwen3Config
from conftest import assert_trees_equal, run_crashing_at
from train import lm

CFG = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, eos_token_id=0)
TC = lm.TrainConfig(steps=6, batch=2, seq=16, lr=1e-2, warmup=2, eval_every=3, eval_batches=1,
                    save_every_minutes=0)


def _tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, n).astype(np.uint16)


def test_loss_decreases_on_a_fixed_batch():
    step = lm.make_train_step(CFG, TC)  # (the same compiled step as the resume test)
    state = lm.initial_state(CFG, TC)
    params, opt_state = state["params"], state["opt_state"]
    batch = lm.batch_at(_tokens(0, 1000), TC, 0)  # (windows, None)
    losses = []
    for _ in range(40):  # past TC.steps the schedule stays at its final 10 % of the peak
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    assert losses[0] > np.log(CFG.vocab_size) - 0.5
    assert losses[-1] < losses[0] - 1.0, losses


def test_weighted_loss_is_the_weighted_mean_of_token_cross_entropies():
    """Re-derived with a NumPy log-softmax over the model's logits."""
    from specjax import qwen3

    rng = np.random.default_rng()
    params = lm.initial_state(CFG, TC)["params"]
    windows = rng.integers(0, CFG.vocab_size, (2, 17)).astype(np.int32)
    weights = rng.uniform(0.1, 5.0, windows.shape).astype(np.float32)
    logits, _, _ = qwen3.forward(params, CFG, windows[:, :-1], np.arange(16)[None].repeat(2, 0))
    logits = np.asarray(logits, np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, windows[:, 1:, None], -1)[..., 0]
    assert np.isclose(float(lm.loss_fn(params, CFG, windows)), ce.mean(), rtol=1e-5)
    want = (ce * weights[:, 1:]).sum() / weights[:, 1:].sum()
    assert np.isclose(float(lm.loss_fn(params, CFG, windows, weights)), want, rtol=1e-5)


def test_reply_and_rename_weights_weigh_marked_tokens_and_train_them_first():
    """batch_at weighs the same windows by their tokens' marks; with a large weight a fixed
    batch's renamed targets are learned faster than with none."""
    import dataclasses

    tokens = _tokens(3, 2000)
    # The schedule spans the whole run (TC's decays to 10 % after 6 steps): over 30 random
    # markings the renamed loss then drops 0.61-1.04 more with the weights, against 0.27-0.52.
    base = dataclasses.replace(TC, steps=20)
    heavy = dataclasses.replace(base, reply_weight=3.0, rename_weight=30.0)
    plain, none = lm.batch_at(tokens, heavy, 0)
    starts = [np.flatnonzero([np.array_equal(tokens[s:s + TC.seq + 1], w) for s in range(tokens.size - TC.seq)])[0]
              for w in plain]
    marks = np.random.default_rng().choice(3, tokens.size, p=[0.8, 0.15, 0.05]).astype(np.uint8)
    marks[starts[0] + 1] = 2  # at least one renamed target
    windows, weights = lm.batch_at(tokens, heavy, 0, marks)
    assert none is None and np.array_equal(windows, plain)
    want = np.stack([np.select([marks[s:s + TC.seq + 1] == 1, marks[s:s + TC.seq + 1] == 2], [3.0, 30.0], 1.0)
                     for s in starts])
    assert np.array_equal(weights, want)

    def renamed_loss(tc):
        step = lm.make_train_step(CFG, tc)
        state = lm.initial_state(CFG, tc)
        params, opt_state = state["params"], state["opt_state"]
        for _ in range(base.steps):
            params, opt_state, _ = step(params, opt_state, (windows, weights if tc is heavy else None))
        targets = (weights[:, 1:] == 30.0).astype(np.float32)
        return float(lm.loss_fn(params, CFG, windows, np.pad(targets, ((0, 0), (1, 0)))))

    assert renamed_loss(heavy) < renamed_loss(base) - 0.3


def test_kill_and_resume_continues_identically(tmp_path, monkeypatch):
    train_tokens, heldout = _tokens(1, 4000), _tokens(2, 1000)
    full = lm.train(CFG, TC, train_tokens, heldout, tmp_path / "full", export_dir=tmp_path / "export")

    run_crashing_at(monkeypatch, lm, 4, lambda: lm.train(CFG, TC, train_tokens, heldout, tmp_path / "resumed"))

    ckpts = lm.Checkpoints(tmp_path / "resumed")
    assert ckpts.latest_step() == 4
    ckpts.close()
    resumed = lm.train(CFG, TC, train_tokens, heldout, tmp_path / "resumed")
    assert full["step"] == resumed["step"] == TC.steps
    assert_trees_equal(full["params"], resumed["params"])
    assert_trees_equal(full["opt_state"], resumed["opt_state"])

    rows = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 6]
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        assert (tmp_path / "export" / name).is_file()


def test_sigterm_inside_a_step_saves_that_step_and_resumes_identically(tmp_path, monkeypatch):
    """SIGTERM arriving while a jitted step runs (here: as it returns, having consumed the
    donated params and optimizer state) lets the step finish, saves its result under its
    own number and stops; the resumed run ends where an uninterrupted one does."""
    tc = dataclasses.replace(TC, save_every_minutes=100)  # the interrupt's save is the only one
    train_tokens, heldout = _tokens(1, 4000), _tokens(2, 1000)
    full = lm.train(CFG, tc, train_tokens, heldout, tmp_path / "full")
    real, calls = lm.make_train_step, []

    def signalled(*args):
        step = real(*args)

        def run(*xs):
            out = step(*xs)
            calls.append(1)
            if len(calls) == 3:  # the third step (index 2) has run
                os.kill(os.getpid(), signal.SIGTERM)
            return out
        return run

    monkeypatch.setattr(lm, "make_train_step", signalled)
    before = signal.getsignal(signal.SIGTERM)
    stopped = lm.train(CFG, tc, train_tokens, heldout, tmp_path / "resumed")
    assert stopped["step"] == 3 and len(calls) == 3 and signal.getsignal(signal.SIGTERM) is before
    ckpts = lm.Checkpoints(tmp_path / "resumed")
    assert ckpts.latest_step() == 3
    ckpts.close()
    monkeypatch.setattr(lm, "make_train_step", real)
    resumed = lm.train(CFG, tc, train_tokens, heldout, tmp_path / "resumed")
    assert resumed["step"] == tc.steps
    assert_trees_equal(full["params"], resumed["params"])
    assert_trees_equal(full["opt_state"], resumed["opt_state"])


def test_a_second_signal_stops_at_once_and_a_first_before_any_step_saves_nothing(tmp_path):
    tc = dataclasses.replace(TC, save_every_minutes=100)
    saved, done = [], []

    def advance(step):
        done.append(step)
        os.kill(os.getpid(), signal.SIGINT)
        if step == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return {"loss": 1.0}

    with pytest.raises(KeyboardInterrupt):  # the second signal, inside step 1
        lm.run_steps(tc, 1, advance, lambda s: None, saved.append, 1, show=False)
    assert done == [1] and saved == []

    def evaluate(step):
        os.kill(os.getpid(), signal.SIGTERM)

    assert lm.run_steps(tc, 0, advance, evaluate, saved.append, 1, show=False, evaluate_first=True) == 0
    assert done == [1] and saved == []  # stopped before step 0 ran: nothing new to save
    assert lm.run_steps(tc, 4, advance, evaluate, saved.append, 1, show=False) == 5
    assert done == [1, 4] and saved == [5]  # a signal in a step: that step, then its save


def test_a_window_longer_than_the_held_out_shard_names_the_flags():
    import dataclasses

    with pytest.raises(lm.FlagError, match=r"--batch 2 x --seq 600: the held-out shard of 1000 tokens has no batch"):
        lm.eval_windows(_tokens(2, 1000), dataclasses.replace(TC, seq=600))


def test_init_from_a_saved_model_starts_from_its_weights(tmp_path):
    """--init: a fresh run starts from the folder's weights with a new optimiser state; a
    folder of another model is refused."""
    import dataclasses

    import jax
    import pytest

    from specjax import checkpoint

    saved = checkpoint.init_params(CFG, jax.random.key(5))
    checkpoint.save(tmp_path / "model", saved, CFG, dtype="float32")
    state = lm.state_from_folder(tmp_path / "model", CFG, TC)
    assert_trees_equal(state["params"], saved)
    assert_trees_equal(state["opt_state"], lm.make_optimizer(TC).init(saved))
    with pytest.raises(lm.FlagError, match=r"--init model differs from the --config model in intermediate_size "
                                           r"64 \(the run's: 128\)$"):
        lm.state_from_folder(tmp_path / "model", dataclasses.replace(CFG, intermediate_size=128), TC)
    with pytest.raises(lm.FlagError, match=r"in max_position_embeddings .*; the run's max_position_embeddings is "
                                           rf"--seq, so pass --seq {CFG.max_position_embeddings}"):
        lm.state_from_folder(tmp_path / "model", dataclasses.replace(CFG, max_position_embeddings=16), TC)
    tuned = lm.train(CFG, TC, _tokens(1, 4000), _tokens(2, 1000), tmp_path / "run", init=tmp_path / "model")
    scratch = lm.train(CFG, TC, _tokens(1, 4000), _tokens(2, 1000), tmp_path / "run2")
    assert not np.allclose(tuned["params"]["model.norm.weight"], scratch["params"]["model.norm.weight"])


def test_stage_commands_name_a_missing_input_and_exit_2(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "meta.json").write_text('{"eos_id": 0, "heldout": {"bytes": 4, "tokens": 1}}')
    shards = ["train.target", "--data", str(tmp_path / "shards")]
    for argv, named in ((["train.target", "--data", str(tmp_path / "nope")], "nope/meta.json"),
                        ([*shards, "--reply-weight", "2"], "shards/train_marks.npy"),
                        ([*shards, "--rename-weight", "-1"], "must be >= 0"),
                        (["train.evaluate", "--model", str(tmp_path / "gone")], "gone: not a directory"),
                        (["train.evaluate", "--edits", "-1"], "--edits must be >= 0")):
        proc = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1], timeout=300)  # train/ runs from the root
        assert proc.returncode == 2, proc.stderr
        assert f"python -m {argv[0]}: error:" in proc.stderr and named in proc.stderr
        assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("flag,configs", [(f, "train") for f in ("--steps", "--batch", "--eval-every")]
                         + [(f, "data") for f in ("--prompts", "--prompt-len", "--response-len", "--gen-batch",
                                                  "--shard-size")])
def test_count_flags_refuse_zero_naming_the_flag(flag, configs, capsys):
    """A count of 0 is an argparse error naming the flag: not a crash inside the optimizer's
    schedule (train.target / train.draft's TrainConfig, train.dflash's), a division by zero
    (--shard-size) or an engine error naming an internal argument (--gen-batch)."""
    import argparse

    from train.dflash import DFlashTrainConfig
    from train.dflash_data import DataConfig

    for cls in {"train": (lm.TrainConfig, DFlashTrainConfig), "data": (DataConfig,)}[configs]:
        parser = argparse.ArgumentParser(prog="stage")
        lm.add_config_flags(parser, cls)
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([flag, "0"])
        assert exit_.value.code == 2
        assert f"argument {flag}: must be an integer of at least 1, got 0" in capsys.readouterr().err
        assert getattr(parser.parse_args([flag, "3"]), flag[2:].replace("-", "_")) == 3


@pytest.mark.parametrize("stage", ["target", "draft"])
@pytest.mark.parametrize("flags, message", [
    (["--steps", "100"], "--warmup 200 must be less than --steps 100"),  # the default warmup
    (["--steps", "5", "--warmup", "5"], "--warmup 5 must be less than --steps 5"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["--lr", "0"], "--lr must be > 0, got 0.0"),
    (["--lr", "-0.001"], "--lr must be > 0, got -0.001"),
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0, got -0.1"),
    (["--weight-decay", "inf"], "--weight-decay must be a finite number, got inf"),
    (["--clip", "0"], "--clip must be > 0, got 0.0"),
    (["--clip", "nan"], "--clip must be a finite number, got nan"),
    (["--reply-weight", "nan"], "--reply-weight must be a finite number, got nan"),
    (["--rename-weight", "-1"], "--rename-weight must be >= 0, got -1.0"),
    (["--save-every-minutes", "-5"], "--save-every-minutes must be >= 0, got -5.0"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
])
def test_bad_flag_values_are_refused_naming_the_flag_before_any_work(stage, flags, message, tmp_path, capsys):
    """python -m train.target / train.draft refuse a value out of range (or NaN / inf) with an
    argparse error naming the flag, before reading the shards (--data does not exist here),
    rather than crashing in optax's schedule (--steps <= --warmup), in the first batch
    (--seed -1) or training on silently (a negative weight decay, a NaN learning rate)."""
    import importlib

    main = importlib.import_module(f"train.{stage}").main
    with pytest.raises(SystemExit) as exit_:
        main(["--data", str(tmp_path / "no-shards"), "--ckpt-dir", str(tmp_path / "run"), *flags])
    assert exit_.value.code == 2
    assert f"python -m train.{stage}: error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("files", [(), ("tokenizer_config.json",)])
def test_evaluate_refuses_a_model_without_tokenizer_before_loading(files, tmp_path, capsys, monkeypatch):
    """python -m train.evaluate on a folder without tokenizer files: a usage error naming
    --model and the files, before the weights are loaded, not an AttributeError traceback
    after; a folder with either file gets past the check (to the loader, stubbed here)."""
    import specjax
    from conftest import hf_tiny
    from train import evaluate

    hf_tiny(tmp_path, num_hidden_layers=1)  # weights and config only
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).unlink(missing_ok=True)
    for name in files:
        (tmp_path / name).write_text("{}")

    def loaded(*args, **kwargs):
        raise SystemExit("loaded")
    monkeypatch.setattr(specjax, "load", loaded)
    with pytest.raises(SystemExit) as exit_:
        evaluate.main(["--model", str(tmp_path), "--edits", "0", "--samples", "0"])
    if files:
        assert exit_.value.code == "loaded"
    else:
        assert exit_.value.code == 2
        assert (f"python -m train.evaluate: error: --model {tmp_path}: no tokenizer files (tokenizer.json / "
                "tokenizer_config.json)") in capsys.readouterr().err


def test_evaluate_fits_a_short_context_or_names_the_part_that_cannot(tmp_path, capsys):
    """python -m train.evaluate on a model whose context (256) is shorter than its default
    held-out windows (512): the loss is over windows of the context, which the report
    says; edit prompts (300 tokens) and sample prompts (200 + 64) that cannot fit are a
    PromptError naming --edits / --samples instead of a generate error or a reply cut short
    and scored as a wrong edit; a --dtype no model computes in is an argparse error."""
    import shutil
    from pathlib import Path

    from conftest import hf_tiny
    from specjax.errors import PromptError
    from train import evaluate

    shipped = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-code"
    hf_tiny(tmp_path, vocab_size=8192, num_hidden_layers=1, max_position_embeddings=256)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(shipped / name, tmp_path / name)
    evaluate.main(["--model", str(tmp_path), "--edits", "0", "--samples", "0"])
    report = json.loads(capsys.readouterr().out)
    assert report["heldout_window_tokens"] == 256 and np.isfinite(report["heldout_nats_per_token"])
    with pytest.raises(PromptError, match=r"--edits: an edit prompt of \d+ tokens .* context \(max_position_embed"
                                          r"dings 256\); pass --edits 0"):
        evaluate.main(["--model", str(tmp_path), "--edits", "1", "--samples", "0"])
    with pytest.raises(PromptError, match=r"--samples: 200-token prompts and 64 new tokens .* pass --samples 0"):
        evaluate.main(["--model", str(tmp_path), "--edits", "0", "--samples", "1"])
    with pytest.raises(SystemExit) as exit_:
        evaluate.main(["--model", str(tmp_path), "--dtype", "float8"])
    assert exit_.value.code == 2 and "argument --dtype: invalid choice: 'float8'" in capsys.readouterr().err


def test_resuming_with_other_settings_or_model_or_init_is_refused_naming_them(tmp_path):
    """A checkpoint records its training settings: resuming under others (a learning rate,
    batch, seed or length of another run), another model config, or with --init (which
    starts a fresh run) is refused naming each, rather than mixed or ignored; bookkeeping
    settings may differ. (All of these resumed silently.)"""
    from specjax.errors import SpecjaxError

    tc = dataclasses.replace(TC, steps=2, warmup=1, save_every_minutes=100)
    train_tokens, heldout = _tokens(1, 4000), _tokens(2, 1000)
    lm.train(CFG, tc, train_tokens, heldout, tmp_path / "run")
    for changed, named in ((dict(lr=2e-2, batch=3), "--batch 2 -> 3, --lr 0.01 -> 0.02"),
                           (dict(seed=7), "--seed 0 -> 7"), (dict(steps=4), "--steps 2 -> 4")):
        with pytest.raises(SpecjaxError, match=f"other settings \\({named}\\)"):
            lm.train(CFG, dataclasses.replace(tc, **changed), train_tokens, heldout, tmp_path / "run")
    wider = dataclasses.replace(CFG, intermediate_size=96)
    with pytest.raises(SpecjaxError, match="another model config \\(intermediate_size 64 -> 96\\)"):
        lm.train(wider, tc, train_tokens, heldout, tmp_path / "run")
    with pytest.raises(SpecjaxError, match="--init .*holds a run at step 2, which resumes"):
        lm.train(CFG, tc, train_tokens, heldout, tmp_path / "run", init=tmp_path / "nowhere")
    again = dataclasses.replace(tc, eval_every=7, eval_batches=2, save_every_minutes=1)
    assert lm.train(CFG, again, train_tokens, heldout, tmp_path / "run")["step"] == 2


def test_a_short_shard_and_a_checkpoint_missing_its_state_are_named(tmp_path):
    """A training shard with no window of --seq + 1 tokens names --seq (it failed deep in
    NumPy); a latest checkpoint whose state files are gone names its folder (orbax's
    KeyError before)."""
    import shutil

    from specjax.errors import SpecjaxError

    tc = dataclasses.replace(TC, steps=2, warmup=1, save_every_minutes=100)
    with pytest.raises(SpecjaxError, match="--seq 16: the training shard has 10 tokens"):
        lm.train(CFG, tc, _tokens(1, 10), _tokens(2, 1000), tmp_path / "short")
    lm.train(CFG, tc, _tokens(1, 4000), _tokens(2, 1000), tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "orbax" / "2" / "state")
    with pytest.raises(SpecjaxError, match=r"orbax/2: the checkpoint of step 2 lacks .*remove that step's folder"):
        lm.train(CFG, tc, _tokens(1, 4000), _tokens(2, 1000), tmp_path / "run")


def test_a_stopped_run_exits_130(tmp_path, monkeypatch):
    """A run that Ctrl-C / SIGTERM stopped (saved, short of --steps) ends the stage with
    exit code 130, as a shell reports Ctrl-C, so that `train.target ... && next` does not go
    on (it exited 0); a finished run returns."""
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "meta.json").write_text('{"eos_id": 0, "heldout": {"bytes": 4, "tokens": 1}}')
    np.save(shards / "train.npy", _tokens(1, 4000))
    np.save(shards / "heldout.npy", _tokens(2, 1000))
    argv = ["--data", str(shards), "--ckpt-dir", str(tmp_path / "run"), "--steps", "4", "--warmup", "1"]
    for done, code in ((2, 130), (4, None)):
        monkeypatch.setattr(lm, "train", lambda *a, **k: {"step": done})
        if code is None:
            lm.main({"t": CFG}, "t", argv, "python -m train.target", "test")
        else:
            with pytest.raises(SystemExit) as exit_:
                lm.main({"t": CFG}, "t", argv, "python -m train.target", "test")
            assert exit_.value.code == code
