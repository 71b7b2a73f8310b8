"""`specjax generate` streams text, reports stats, equals plain decoding, and exits 2 on bad input."""

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
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(tmp_path), "--prompt", "x"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no tokenizer files" in err and "--prompt-ids" in err and str(tmp_path) in err
    with pytest.raises(SystemExit) as e:  # the benchmark's prompts are text
        main(["bench", "--model", str(tmp_path), "--quick", "--no-hf", "--out", str(tmp_path / "bench")])
    assert e.value.code == 2 and "needs a tokenizer" in capsys.readouterr().err


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
])
def test_bad_input_exits_2(argv, match, capsys, folder):
    if "--model" not in argv:
        argv = argv[:1] + ["--model", str(folder)] + argv[1:]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert match in capsys.readouterr().err


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
    want = [model.tokenizer.decode(specjax.generate(model, model.tokenizer(t)["input_ids"], max_new_tokens=10).tokens)
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
