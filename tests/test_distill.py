"""Distillation shards: every generated sequence lands in train or held-out, cut after its reply's eos."""

import json
from pathlib import Path

import numpy as np
import pytest

from specjax.config import Qwen3Config
from specjax.errors import SpecjaxError
from train import distill

TOKENIZER = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-code"


def _split(tokens, eos):
    """Documents of a packed shard (each ends with eos)."""
    ends = np.flatnonzero(tokens == eos)
    return [tokens[a + 1:b + 1] for a, b in zip(np.concatenate([[-1], ends[:-1]]), ends)]


def test_shards_hold_prompt_and_reply_through_eos(tmp_path, rng):
    eos, prompt_len, reply_len, n = 0, 5, 7, 45
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, eos_token_id=eos)
    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.json").write_text(json.dumps({"prompt_len": prompt_len, "response_len": reply_len,
                                                "target": {"config": cfg.to_hf()}}))
    seqs = rng.integers(1, 64, (n, prompt_len + reply_len)).astype(np.int32)
    stops = rng.integers(0, reply_len + 3, n)  # >= reply_len: the reply never stopped
    expected = []
    for row, stop in zip(seqs, stops):
        if stop < reply_len:
            row[prompt_len + stop:] = eos  # a stopped reply is padded with eos
        expected.append(np.append(row[:prompt_len + stop], eos) if stop < reply_len else np.append(row, eos))
    np.save(data / "seqs-00000.npy", seqs[:30])
    np.save(data / "seqs-00001.npy", seqs[30:])
    meta = distill.build(data, tmp_path / "out", TOKENIZER)
    train = _split(np.load(tmp_path / "out" / "train.npy").astype(np.int64), eos)
    heldout = _split(np.load(tmp_path / "out" / "heldout.npy").astype(np.int64), eos)
    held = [i for i in range(n) if i % distill.HELDOUT_EVERY == 0]
    assert len(heldout) == len(held) == meta["heldout"]["documents"] and len(train) == n - len(held)
    for doc, i in zip(heldout, held):
        np.testing.assert_array_equal(doc, expected[i])
    for doc, i in zip(train, [i for i in range(n) if i not in held]):
        np.testing.assert_array_equal(doc, expected[i])


def _one_shard(tmp_path, vocab_size: int, eos: int, row: list[int]):
    """A data folder of one sequence (2 prompt tokens, a reply of up to 3) for a small target."""
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, eos_token_id=eos)
    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.json").write_text(json.dumps({"prompt_len": 2, "response_len": 3, "target": {"config": cfg.to_hf()}}))
    np.save(data / "seqs-00000.npy", np.array([row], np.int32))
    return data


def test_a_vocabulary_past_uint16_is_refused_not_wrapped(tmp_path):
    """A target of Qwen3's 151936 tokens: its ids would wrap in the uint16 shards (100000
    became 34464), so the build refuses before writing anything."""
    data = _one_shard(tmp_path, 151936, 151645, [10, 20, 100000, 151000, 151645])
    with pytest.raises(SpecjaxError, match="151936 tokens does not fit uint16 shards"):
        distill.build(data, tmp_path / "out", TOKENIZER)
    assert not (tmp_path / "out").exists()


def test_fewer_than_two_sequences_are_refused(tmp_path):
    """The first sequence (every 20th) is held out: one sequence leaves the training part
    empty, refused naming the folder (a NumPy error before)."""
    data = _one_shard(tmp_path, 64, 0, [10, 20, 30, 40, 0])
    with pytest.raises(SpecjaxError, match=f"{data}: 1 sequence\\(s\\); a train and a held-out part need at least 2"):
        distill.build(data, tmp_path / "out", TOKENIZER)
