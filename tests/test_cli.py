"""`specjax generate` streams text, reports stats, equals plain decoding, and exits 2 on bad input."""

import json

import pytest

from specjax.cli import main
from test_bench import _random_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    _random_model(root / "m-draft", 16, 1, 4)
    return _random_model(root / "m", 32, 2, 3)


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_streams_and_speculation_changes_nothing(folder, capsys):
    base = ["generate", "--model", str(folder), "--prompt", "def f(x):\n    return x\n" * 3, "--max-new-tokens", "12"]
    code, plain, err = _run(capsys, *base, "--no-speculate")
    assert code == 0 and plain and "12 tokens" in err and "tok/s" in err and "prefill" in err
    for flags in (["--speculate", "3"], ["--speculate", "auto"], ["--draft", str(folder.parent / "m-draft")], []):
        code, text, err = _run(capsys, *base, *flags)
        assert code == 0 and text == plain, flags
        assert "tokens/step" in err
    # a bfloat16 KV cache: the same text with and without speculation (the API test checks its tokens)
    code, bf16, _ = _run(capsys, *base, "--no-speculate", "--kv-dtype", "bfloat16")
    code2, spec, _ = _run(capsys, *base, "--speculate", "3", "--kv-dtype", "bfloat16")
    assert code == code2 == 0 and bf16 and spec == bf16


def test_prompt_ids_for_a_folder_without_tokenizer(tmp_path, capsys, rng):
    import specjax
    from conftest import hf_tiny

    hf_tiny(tmp_path, seed=int(rng.integers(1 << 30)))  # weights and config only
    ids = rng.integers(0, 101, 9).tolist()
    want = specjax.generate(specjax.load(tmp_path), ids, max_new_tokens=6).tokens
    capsys.readouterr()  # drop the rng fixture's seed line
    for flags in (["--no-speculate"], ["--speculate", "3"]):
        code, out, err = _run(capsys, "generate", "--model", str(tmp_path), "--prompt-ids", ",".join(map(str, ids)),
                              "--max-new-tokens", "6", *flags)
        assert code == 0 and out == "".join(f"{t}," for t in want)
    # without --max-new-tokens, the folder's generation_config.json max_new_tokens (as vLLM's server takes it)
    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({**(json.loads(gen.read_text()) if gen.is_file() else {}), "max_new_tokens": 4}))
    code, out, _ = _run(capsys, "generate", "--model", str(tmp_path), "--prompt-ids", ",".join(map(str, ids)),
                        "--no-speculate")
    assert code == 0 and out == "".join(f"{t}," for t in want[:4])
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(tmp_path), "--prompt", "x"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no tokenizer files" in err and "--prompt-ids" in err and str(tmp_path) in err
    for extra in ([], ["--concurrency", "1,2"]):  # the benchmark's prompts are text
        with pytest.raises(SystemExit) as e:
            main(["bench", "--model", str(tmp_path), "--quick", "--no-hf", "--out", str(tmp_path / "bench"), *extra])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"{tmp_path}: the benchmark's prompts are text" in err and "needs a tokenizer" in err


def test_broken_tokenizer_exits_2_naming_it(tmp_path, capsys):
    """A folder whose tokenizer.json is corrupt is a bad folder, even for --prompt-ids (as
    transformers and vLLM refuse it at load): exit 2 with the file named, no traceback."""
    from conftest import hf_tiny

    hf_tiny(tmp_path, num_hidden_layers=1)
    (tmp_path / "tokenizer.json").write_text("{bad\n")
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(tmp_path), "--prompt-ids", "5,6", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{tmp_path / 'tokenizer.json'}: cannot load the tokenizer" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv,match", [
    (["generate", "--model", "/nonexistent", "--prompt", "x"], "not a directory"),
    (["generate", "--prompt", "x", "--max-new-tokens", "0"], "max-new-tokens"),
    (["generate", "--prompt", "x", "--top-p", "0"], "top_p"),
    (["generate", "--prompt", "x", "--speculate", "99"], "k must be"),
    (["generate", "--prompt-file", "/nonexistent.txt"], "no such file"),
    (["generate", "--prompt", "x", "--devices", "64"], "local device(s)"),
    (["generate", "--prompt-ids", "1,x"], "comma-separated integers"),
    (["generate", "--prompt-ids", "1,99999"], "prompt token ids must be in"),
    (["generate", "--prompt", "x", "--seed", "-1"], "seed must be"),
    (["generate", "--prompt", ""], "--prompt: the prompt is empty"),
    (["generate", "--prompt", "x", "--kv-dtype", "int8"], "--kv-dtype: invalid choice"),
    # an id too large for int64 is still named as an id outside the vocabulary
    (["generate", "--prompt-ids", "1,99999999999999999999"], "prompt token ids must be in [0, "),
    (["generate", "--prompt-ids", "1,2", "--max-new-tokens", "99999"], "--prompt-ids (model "),
    (["generate", "--prompt", "x", "--max-new-tokens", "99999"], "--prompt: prompt (1) + max_new_tokens (99999) exceeds"),
    (["generate", "--prompt-ids", "1_000"], "comma-separated integers"),  # int() would read it as 1000
    (["generate", "--prompt-ids", "\u0661,\u0662"], "comma-separated integers"),  # Arabic-Indic digits 1, 2
])
def test_bad_input_exits_2(argv, match, capsys, folder):
    if "--model" not in argv:
        argv = argv[:1] + ["--model", str(folder)] + argv[1:]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--speculate", "3"], ["--tree", "4"], ["--draft", "DRAFT", "--sample-drafts"]])
@pytest.mark.parametrize("batch", [False, True])
def test_no_speculate_with_a_proposer_flag_exits_2(flags, batch, folder, tmp_path, capsys):
    """--no-speculate and a flag asking for speculation contradict each other: exit 2 naming
    both, rather than one of them silently ignored."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("import os\n")
    flags = [str(folder.parent / "m-draft") if f == "DRAFT" else f for f in flags]
    argv = ["generate", "--model", str(folder), "--prompt-file", str(prompts), "--max-new-tokens", "2",
            "--no-speculate", *flags] + (["--batch"] if batch else [])
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--no-speculate" in err and flags[0] in err


@pytest.mark.parametrize("flags,needs", [(["--draft-k", "3"], "--draft DIR"), (["--dflash-k", "3"], "--dflash DIR"),
                                         (["--sample-drafts"], "--draft DIR or --dflash DIR")])
@pytest.mark.parametrize("batch", [False, True])
def test_drafter_flags_without_their_drafter_exit_2(flags, needs, batch, folder, tmp_path, capsys):
    """--draft-k, --dflash-k and --sample-drafts tune a drafter the flags name; alone they
    would be dropped unseen (the default's siblings are not built from them), so exit 2."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("import os\n")
    argv = ["generate", "--model", str(folder), "--prompt-file", str(prompts), "--max-new-tokens", "2", *flags]
    with pytest.raises(SystemExit) as e:
        main(argv + (["--batch"] if batch else []))
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{flags[0]} tunes the drafter of {needs}" in err


def test_default_and_flag_proposers(folder):
    """Without flags on CPU: prompt lookup on the device; off CPU adaptive over lookup and the
    sibling draft model; --speculate K alone is lookup up to K; a draft model with a fixed
    k is used as given; lookup with a draft model is adaptive."""
    import jax

    import specjax
    from specjax import cli
    from specjax.adaptive import Adaptive
    from specjax.proposers import DraftProposer, NgramProposer

    target = specjax.load(folder)
    parse = lambda *flags: cli._build_parser().parse_args(["generate", "--model", str(folder), "--prompt", "x", *flags])
    default = cli._proposer(parse(), target)
    if jax.default_backend() == "cpu":
        assert isinstance(default, Adaptive) and default.proposers == (NgramProposer(k=15),)
    else:
        assert isinstance(default, Adaptive)
        assert [type(p) for p in default.proposers] == [NgramProposer, DraftProposer]  # the m-draft sibling
    fixed = cli._proposer(parse("--speculate", "5"), target)
    assert isinstance(fixed, Adaptive) and fixed.proposers == (NgramProposer(k=5),)
    both = cli._proposer(parse("--speculate", "5", "--draft", str(folder.parent / "m-draft")), target)
    assert isinstance(both, Adaptive) and [type(p) for p in both.proposers] == [NgramProposer, DraftProposer]
    draft = cli._proposer(parse("--draft", str(folder.parent / "m-draft"), "--draft-k", "3"), target)
    assert isinstance(draft, DraftProposer) and draft.k == 3


def test_batch_prints_every_result_as_generated_alone(folder, tmp_path, capsys):
    import json

    import specjax

    model = specjax.load(folder)
    texts = ["def f(x):\n    return x\n" * 2, "class A:\n    pass\n", "import os"]
    want = [_shown(model, specjax.generate(model, model.tokenizer(t)["input_ids"], max_new_tokens=10).tokens)
            for t in texts]
    lines = tmp_path / "prompts.txt"
    lines.write_text("\n".join(t.replace("\n", " ") for t in texts[1:]) + "\n")
    records = tmp_path / "prompts.jsonl"
    records.write_text("\n".join(json.dumps({"prompt": t}) for t in texts) + "\n")
    code, out, err = _run(capsys, "generate", "--model", str(folder), "--batch", "--prompt-file", str(records),
                          "--max-new-tokens", "10", "--speculate", "3")
    assert code == 0, err
    assert out == "".join(f"=== {i} ===\n{w}\n" for i, w in enumerate(want))
    assert "3 requests" in err and "tok/s aggregate" in err and "per request" in err and "tokens/step" in err
    code, out, err = _run(capsys, "generate", "--model", str(folder), "--batch", "--prompt-file", str(lines),
                          "--max-new-tokens", "4", "--no-speculate")
    assert code == 0 and out.count("=== ") == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{"text": "y"}\n')
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(folder), "--batch", "--prompt-file", str(bad)])
    assert e.value.code == 2 and f"{bad}:2" in capsys.readouterr().err


def test_prompt_files_are_utf8_with_bom_crlf_and_only_newlines_ending_lines(folder, tmp_path, capsys):
    """A BOM is dropped and CRLF read as LF (as a file saved on Windows), U+2028 and form feed
    inside a line keep it one prompt, and bytes that are not UTF-8 exit 2 naming file and line."""
    import json

    import specjax

    model = specjax.load(folder)
    tok = model.tokenizer
    gen = lambda text: _shown(model, specjax.generate(model, tok(text)["input_ids"], max_new_tokens=6).tokens)
    single = tmp_path / "one.txt"
    single.write_bytes(b"\xef\xbb\xbfdef f(x):\r\n    return x\r\n")
    code, out, err = _run(capsys, "generate", "--model", str(folder), "--prompt-file", str(single),
                          "--max-new-tokens", "6", "--no-speculate")
    assert code == 0 and out == gen("def f(x):\n    return x\n")
    lines = ["a = 1\u2028b = 2", "c\x0cd"]
    many = tmp_path / "many.txt"
    many.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode() + b"\r\n")
    records = tmp_path / "many.jsonl"
    records.write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps({"prompt": t}, ensure_ascii=False)
                                                     for t in lines).encode())
    for path in (many, records):
        code, out, err = _run(capsys, "generate", "--model", str(folder), "--batch", "--prompt-file", str(path),
                              "--max-new-tokens", "6", "--no-speculate")
        assert code == 0, err
        assert out == "".join(f"=== {i} ===\n{gen(t)}\n" for i, t in enumerate(lines)), path
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("x = 1\ny = 'caf\u00e9'\n".encode("latin-1"))
    for batch in ([], ["--batch"]):
        with pytest.raises(SystemExit) as e:
            main(["generate", "--model", str(folder), "--prompt-file", str(bad), "--max-new-tokens", "2", *batch])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"{bad}:2: not UTF-8 text (byte 0xe9)" in err and "Traceback" not in err


def test_chat_wraps_the_prompt_and_refuses_a_blank_one(folder, tmp_path, capsys):
    """--chat generates what the chat-templated ids generate; a blank prompt under --chat
    (the template's tokens alone) exits 2 as an empty prompt, as --batch refuses blank messages."""
    import json
    import shutil

    import specjax

    chat = tmp_path / "chat"
    shutil.copytree(folder, chat)
    config = json.loads((chat / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and "
                               "enable_thinking is false %}<think></think>{% endif %}{% endif %}")
    (chat / "tokenizer_config.json").write_text(json.dumps(config))
    model = specjax.load(chat)
    for kw, flags in (({}, []), ({"enable_thinking": False}, ["--chat-template-kwargs", '{"enable_thinking": false}'])):
        ids = model.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False, **kw)
        want = model.tokenizer.decode(specjax.generate(model, list(ids), max_new_tokens=6).tokens)
        code, out, err = _run(capsys, "generate", "--model", str(chat), "--chat", "--prompt", "hi",
                              "--max-new-tokens", "6", *flags)
        assert code == 0 and out == want, err
    for prompt in ("", "  \n"):
        with pytest.raises(SystemExit) as e:
            main(["generate", "--model", str(chat), "--chat", "--prompt", prompt, "--max-new-tokens", "2"])
        assert e.value.code == 2 and "--prompt: the prompt is empty" in capsys.readouterr().err
    for flags, said in ((["--chat-template-kwargs", '{"enable_thinking": false}'], "it needs --chat"),
                        (["--chat", "--chat-template-kwargs", '{"tokenize": false}'], "may not set tokenize"),
                        (["--chat", "--chat-template-kwargs", "[1]"], "must be an object"),
                        (["--chat", "--chat-template-kwargs", "{x"], "not JSON")):
        with pytest.raises(SystemExit) as e:
            main(["generate", "--model", str(chat), "--prompt", "hi", "--max-new-tokens", "2", *flags])
        assert e.value.code == 2 and said in capsys.readouterr().err, flags


def _shown(model, tokens) -> str:
    """The text a run's tokens show, as the server's completions give it: without the stop
    (eos) ids and special tokens."""
    return model.tokenizer.decode([t for t in tokens if t not in model.eos_ids], skip_special_tokens=True)


def test_generated_text_leaves_out_the_eos_token(capsys):
    """The shipped model ends this prompt's continuation with its eos token at once: the
    command prints no text for it (it printed "<|endoftext|>"), and says 1 token."""
    import specjax
    from specjax.cli import DEFAULT_MODEL

    model = specjax.load(DEFAULT_MODEL)
    prompt = 'if __name__ == "__main__":\n    main()\n'
    assert specjax.generate(model, model.tokenizer(prompt)["input_ids"], max_new_tokens=8).tokens == list(model.eos_ids[:1])
    code, text, err = _run(capsys, "generate", "--prompt", prompt, "--max-new-tokens", "8", "--no-warmup")
    assert code == 0 and text == "" and "[1 tokens" in err, (text, err)


def test_stream_ends_with_all_the_text_decode_gives(capsys):
    """The streamer holds back text ending inside a UTF-8 sequence until more tokens come; at
    the end of the run what it held (the whole last chunk) is printed, as decode shows it.
    Then on the shipped model, a sampled run cut mid-character prints what the API's tokens decode to."""
    import io

    import specjax
    from specjax.cli import DEFAULT_MODEL, _Streamer
    from specjax.sampling import Sampling

    tok = specjax.load(DEFAULT_MODEL).tokenizer
    ids = tok("abc")["input_ids"] + tok("\u00e9")["input_ids"][:1]  # the first byte of a 2-byte character
    out = io.StringIO()
    stream = _Streamer(tok, out=out)
    stream(ids)
    stream.close()
    assert out.getvalue() == tok.decode(ids) and out.getvalue().endswith("\ufffd")

    model = specjax.load(DEFAULT_MODEL)
    prompt = "s = '" + "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 " * 3 + "\u65e5\u672c\u8a9e\u306e"
    ids = model.tokenizer(prompt)["input_ids"]
    want = _shown(model, specjax.generate(model, ids, max_new_tokens=14, seed=4,
                                          sampling=Sampling(temperature=1.0)).tokens)
    code, text, err = _run(capsys, "generate", "--prompt", prompt, "--max-new-tokens", "14", "--temperature", "1",
                           "--seed", "4", "--no-warmup")
    assert code == 0 and text == want, err


@pytest.mark.parametrize("content,line,message", [
    # the engine alone would say "prompt (N) + max_new_tokens ... exceeds", not which of the lines
    ("import os\n" + "x = 1; " * 900 + "\n", 2, "+ max_new_tokens (4) exceeds the model's max_position_embeddings"),
    ('{"prompt": "import os"}\n{"prompt": "a", "prompt": "b"}\n', 2, "key 'prompt' repeated"),  # not "b" alone
    ('{"messages": [{"role": "user", "content": "a", "content": "b"}]}\n', 1, "key 'content' repeated"),
])
def test_batch_errors_name_the_line(content, line, message, folder, tmp_path, capsys):
    path = tmp_path / ("p.jsonl" if content.startswith("{") else "p.txt")
    path.write_text(content)
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(folder), "--batch", "--prompt-file", str(path), "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{path}:{line}: " in err and message in err and "Traceback" not in err
