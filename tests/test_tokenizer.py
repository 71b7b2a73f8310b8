"""The byte-level BPE tokenizer round-trips source exactly and loads in transformers."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from train import corpus
from train.tokenizer import EOS, MASK, save_tokenizer, train_tokenizer

SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-code"
ODD_TEXT = "x\t= 'héllo wörld ✓ 🐍'\r\n\x0c\n    \n\n  \ttrailing   \n# Rename `a` to `b`.\n"


@pytest.fixture(scope="module")
def heldout_texts() -> list[str]:
    return corpus.read_sources(corpus.split(corpus.stdlib_files())[1])[0] + [ODD_TEXT]


@pytest.fixture(scope="module")
def small_tokenizer_dir(tmp_path_factory) -> Path:
    train_files = corpus.split(corpus.stdlib_files())[0][:30]
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer(corpus.read_sources(train_files)[0], vocab_size=512), out)
    return out


@pytest.mark.parametrize("which", ["small", "shipped"])
def test_round_trip_and_special_tokens(which, small_tokenizer_dir, heldout_texts):
    tok = AutoTokenizer.from_pretrained(small_tokenizer_dir if which == "small" else SHIPPED)
    assert len(tok) == (512 if which == "small" else 8192)
    assert (tok.convert_tokens_to_ids(EOS), tok.convert_tokens_to_ids(MASK)) == (0, 1)
    assert (tok.eos_token_id, tok.pad_token_id, tok.mask_token_id) == (0, 0, 1)
    for text in heldout_texts:
        ids = tok(text)["input_ids"]
        assert 0 not in ids and 1 not in ids  # no special tokens added or produced
        assert tok.decode(ids) == text
