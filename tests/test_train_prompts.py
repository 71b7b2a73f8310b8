"""Training a DFlash drafter on the user's own prompts (train.prompts, python -m train.dflash
--prompt-file): a random tiny Qwen3 whose tokenizer has no mask token, chat prompts in
JSONL, end to end to an exported drafter whose speculative output is plain decoding's;
and each bad input a clear error naming its file, line or flag."""

import json

import numpy as np
import pytest

import specjax
from conftest import hf_tiny
from train import dflash as trainer
from train import prompts
from train.prompts import PromptError

WORDS = [f"w{i}" for i in range(50)]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Qwen3 folder: 101 embedding rows, a word-level tokenizer of 57 tokens with a
    chat template and no mask token, eos <|im_end|>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("chat-target")
    vocab = {t: i for i, t in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]", "user",
                                         "assistant", "system"] + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", unk_token="[UNK]",
                                  pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(root)
    hf_tiny(root, seed=4, eos_token_id=vocab["<|im_end|>"])
    return root


@pytest.fixture(scope="module")
def target(folder):
    return specjax.load(folder)


def _chat_lines(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [json.dumps({"messages": [{"role": "user", "content": " ".join(rng.choice(WORDS, int(rng.integers(3, 9))))}]})
            for _ in range(n)]


# ------------------------------------------------------------------- end to end

def test_chat_prompts_train_an_exact_drafter(folder, target, tmp_path):
    lines = _chat_lines(19)
    lines.insert(7, lines[2])  # 20 lines, one a duplicate
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("\n".join(lines) + "\n")
    out, run = tmp_path / "drafter", tmp_path / "run"
    trainer.main(["--target", str(folder), "--prompt-file", str(prompt_file), "--out", str(out), "--run", str(run),
                  "--heldout-share", "0.2", "--prompt-len", "24", "--response-len", "16", "--gen-batch", "8",
                  "--shard-size", "8", "--layers", "1", "--block-size", "4", "--target-layer-ids", "0,2",
                  "--steps", "4", "--batch", "4", "--anchors", "4", "--log-every", "2", "--eval-every", "100",
                  "--eval-tokens", "12", "--save-every-minutes", "100"])

    tok = target.tokenizer
    assert tok.mask_token_id is None and len(tok) == 57
    raw = json.loads((out / "config.json").read_text())
    assert raw["dflash_config"]["mask_token_id"] == 57  # right after the tokenizer's tokens, as z-lab's 151669

    # the data: each distinct prompt once, through transformers' chat template, held-out ones not trained on
    templated = [tuple(tok.apply_chat_template(json.loads(line)["messages"], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)) for line in lines]
    seqs = np.concatenate([np.load(f) for f in sorted((run / "data").glob("seqs-*.npy"))])
    stored = np.load(run / "data" / "prompts.npy")
    trained = {tuple(int(i) for i in row[row >= 0]) for row in stored}
    assert len(stored) == len(trained) == 15 and trained < set(templated)  # 19 distinct: 4 held out
    for row, seq in zip(stored[:2], seqs[:2]):
        ids = row[row >= 0]
        reply = specjax.generate(target, ids, max_new_tokens=16).tokens
        np.testing.assert_array_equal(seq[:len(ids) + len(reply)], np.concatenate([ids, reply]))

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    taus = [r for r in rows if "tau" in r]
    assert [r["step"] for r in taus] == [0, 4] and set(taus[-1]["by_kind"]) == {"heldout"}
    assert [r["step"] for r in rows if "train_loss" in r] == [2, 4]

    drafter = specjax.load_dflash(out, target)
    assert drafter.config.mask_token_id == 57 and drafter.config.block_size == 4
    held = next(iter(set(templated) - trained))
    plain = specjax.generate(target, list(held), max_new_tokens=12)
    fast = specjax.generate(target, list(held), max_new_tokens=12, speculative=specjax.DFlashProposer(drafter))
    assert fast.tokens == plain.tokens


# ---------------------------------------------------------------- prompt sources

def test_plain_lines_dirs_and_chat_flag(target, tmp_path):
    tok = target.tokenizer
    text = tmp_path / "prompts.txt"
    text.write_text("w1 w2\n\nw3\n")
    assert [(p.where, p.ids) for p in prompts.read_prompt_file(text, tok)] == [
        (f"{text}:1", tuple(tok("w1 w2")["input_ids"])), (f"{text}:3", tuple(tok("w3")["input_ids"]))]
    chat = prompts.read_prompt_file(text, tok, chat=True)
    assert chat[1].ids == tuple(tok.apply_chat_template([{"role": "user", "content": "w3"}],
                                                        add_generation_prompt=True, tokenize=True, return_dict=False))
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "w4 w5"}\n')
    assert prompts.read_prompt_file(jsonl, tok)[0].ids == tuple(tok("w4 w5")["input_ids"])
    # the chat template's own variables (--chat-template-kwargs) reach it, as apply_chat_template's keywords
    import copy
    greeter = copy.deepcopy(tok)
    greeter.chat_template = TEMPLATE + "{% if greeting is defined %} {{ greeting }}{% endif %}"
    said = prompts.read_prompt_file(text, greeter, chat=True, template_kwargs={"greeting": "w9"})
    assert said[1].ids == tuple(greeter.apply_chat_template([{"role": "user", "content": "w3"}], greeting="w9",
                                                            add_generation_prompt=True, tokenize=True,
                                                            return_dict=False))
    assert said[1].ids != chat[1].ids
    d = tmp_path / "dir"
    d.mkdir()
    (d / "b.txt").write_text("w7\nw8")
    (d / "a.txt").write_text("w6")
    (d / ".hidden").write_text("w9")
    (d / "sub" / "deep").mkdir(parents=True)  # subfolders are read too, hidden ones (.git) are not
    (d / "sub" / "deep" / "c.txt").write_text("w1")
    (d / ".git").mkdir()
    (d / ".git" / "HEAD").write_text("w2")
    assert [p.where for p in prompts.read_prompt_dir(d, tok)] == [str(d / "a.txt"), str(d / "b.txt"),
                                                                  str(d / "sub" / "deep" / "c.txt")]


def test_dedupe_and_split():
    ps = [prompts.Prompt(f"f:{i}", (i % 7,)) for i in range(10)]
    unique = prompts.dedupe(ps)
    assert [p.where for p in unique] == [f"f:{i}" for i in range(7)]
    train, held = prompts.split(unique, 0.3, seed=1)
    assert len(held) == 2 and sorted(train + held, key=lambda p: p.where) == unique
    assert prompts.split(unique, 0.3, seed=1) == (train, held)  # seeded
    assert len(prompts.split(unique[:2], 0.01, seed=0)[1]) == 1  # at least one held out


@pytest.mark.parametrize("content, line, message", [
    ('{"prompt": "w1"}\n{"prompt": "w2"\n', 2, "not a JSON object"),
    ('{"prompt": "w1"}\n{"prompt": "w2", "id": 3}\n', 2, "unknown key 'id'"),
    ('{"prompt": "w1"}\n\n{"prompt": "  "}\n', 3, "the prompt is empty"),
    ('{"messages": [{"role": "user"}]}\n', 1, '"messages" must be'),
    ('[1, 2]\n', 1, "not a JSON object"),
])
def test_bad_jsonl_lines_name_file_and_line(target, tmp_path, content, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(PromptError, match=f"{path}:{line}: .*{message}"):
        prompts.read_prompt_file(path, target.tokenizer)


def test_empty_sources_and_long_prompts_are_errors(target, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(PromptError, match=f"{empty}: no prompts"):
        prompts.read_prompt_file(empty, target.tokenizer)
    with pytest.raises(PromptError, match="no such file"):
        prompts.read_prompt_file(tmp_path / "missing.jsonl", target.tokenizer)
    d = tmp_path / "dir"
    d.mkdir()
    with pytest.raises(PromptError, match=f"{d}: no prompt files"):
        prompts.read_prompt_dir(d, target.tokenizer)
    (d / "blank.txt").write_text("\n")
    with pytest.raises(PromptError, match=f"{d / 'blank.txt'}: the prompt is empty"):
        prompts.read_prompt_dir(d, target.tokenizer)
    with pytest.raises(PromptError, match="f:2: the prompt has 5 tokens, more than --prompt-len 4"):
        prompts.pad([prompts.Prompt("f:1", (1, 2)), prompts.Prompt("f:2", (1, 2, 3, 4, 5))], 4)


def test_cli_reports_a_bad_line_and_exits_2(folder, tmp_path, capsys, monkeypatch):
    from train import run

    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "w1"}\n{"text": "w2"}\n')
    argv = ["--target", str(folder), "--prompt-file", str(path), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_:
        run(lambda: trainer.main(argv), "python -m train.dflash")
    assert exit_.value.code == 2
    assert f"{path}:2: unknown key 'text'" in capsys.readouterr().err


@pytest.mark.parametrize("bad, message", [
    ("out-is-a-file", "--out {out}: exists and is not a folder"),
    ("data-is-a-file", "--data {out}: exists and is not a folder"),
    ("negative-lr", "--lr must be > 0, got -0.001"),
])
def test_cli_refuses_bad_paths_and_settings_before_generating(folder, tmp_path, capsys, bad, message):
    from train import run

    path = tmp_path / "p.txt"
    path.write_text("w1 w2\nw3\n")
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder\n")
    argv = ["--target", str(folder), "--prompt-file", str(path), "--out", str(tmp_path / "out"),
            "--data", str(tmp_path / "data")]
    argv += {"out-is-a-file": ["--out", str(a_file)], "data-is-a-file": ["--data", str(a_file)],
             "negative-lr": ["--lr", "-0.001"]}[bad]
    with pytest.raises(SystemExit) as exit_:
        run(lambda: trainer.main(argv), "python -m train.dflash")
    assert exit_.value.code == 2
    assert message.format(out=a_file) in capsys.readouterr().err
    assert not (tmp_path / "data").exists()  # refused before any data is made


# ------------------------------------------------------------------- mask token

def test_mask_token_id(target):
    tok = target.tokenizer
    assert trainer.mask_token_id(tok, 101) == len(tok) == 57
    assert trainer.mask_token_id(tok, 101, given=100) == 100
    with pytest.raises(specjax.SpecjaxError, match=r"--mask-token-id 101 is outside the target's embedding of 101 rows"):
        trainer.mask_token_id(tok, 101, given=101)
    with pytest.raises(specjax.SpecjaxError, match=r"new <\|MASK\|> id 57 .* outside the target's embedding of 57 rows"):
        trainer.mask_token_id(tok, 57)


def test_the_tokenizers_own_mask_token_is_kept():
    class WithMask:  # what a tokenizer with a mask token answers
        mask_token, mask_token_id = "<|mask|>", 3

        def __len__(self):
            return 50

    assert trainer.mask_token_id(WithMask(), 101) == 3
    with pytest.raises(specjax.SpecjaxError, match=r"mask token '<\|mask\|>' \(id 3\) is outside .* of 3 rows"):
        trainer.mask_token_id(WithMask(), 3)


def test_a_held_out_prompt_longer_than_prompt_len_is_refused_before_the_data(folder, tmp_path, capsys):
    """Held-out prompts are checked against --prompt-len as the training ones are, naming
    the file and line, before any reply is generated (they were evaluated, or failed at the
    first evaluation naming neither)."""
    from train import run

    lines = ["w1 w2", "w3", "w4 w5", "w6"]
    _, held = prompts.split([prompts.Prompt(str(i), (i,)) for i in range(4)], 0.25, 0)
    long = int(held[0].where)
    lines[long] = "w1 w2 w3 w4 w5 w6 w7"
    path = tmp_path / "p.txt"
    path.write_text("\n".join(lines) + "\n")
    argv = ["--target", str(folder), "--prompt-file", str(path), "--out", str(tmp_path / "out"),
            "--data", str(tmp_path / "data"), "--heldout-share", "0.25", "--prompt-len", "4"]
    with pytest.raises(SystemExit) as exit_:
        run(lambda: trainer.main(argv), "python -m train.dflash")
    assert exit_.value.code == 2
    assert f"{path}:{long + 1}: the prompt has 7 tokens, more than --prompt-len 4" in capsys.readouterr().err
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").glob("seqs-*.npy"))
