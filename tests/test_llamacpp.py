"""`specjax bench --llamacpp`: llama.cpp's greedy tokens on the f32 GGUF file equal specjax's
and transformers'; the bench writes llama.cpp's rows, the greedy check and the table; the
comparison's ratios and check are what the runs say; and a user's mistakes (llama_cpp
missing, no converter, a failing converter) end in an error naming the flag and the file.

Tests that run llama.cpp need llama-cpp-python (README.md, "llama.cpp in the benchmark")
and a llama.cpp source tree for the converter, given as $SPECJAX_LLAMACPP_SOURCE (e.g. the
vendor/llama.cpp folder of llama-cpp-python's unpacked sdist); without them they are
skipped, and the rest run everywhere.
"""

import json
import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from specjax import bench, llamacpp
from specjax.cli import main

SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-code"


def _fake_source(root: Path, body: str) -> Path:
    """A llama.cpp tree whose convert_hf_to_gguf.py is `body`."""
    root.mkdir()
    (root / "convert_hf_to_gguf.py").write_text(textwrap.dedent(body))
    return root


def _checkpoint(root: Path) -> Path:
    """A folder standing in for a checkpoint (the fake converters never read it)."""
    root.mkdir()
    (root / "config.json").write_text("{}")
    return root


def _bench_argv(tmp_path: Path, source: Path) -> list[str]:
    return ["bench", "--model", str(SHIPPED), "--quick", "--no-hf", "--workloads", "edit", "--llamacpp", str(source),
            "--out", str(tmp_path / "out")]


# ---------------------------------------------------------------- everywhere

def test_missing_llama_cpp_says_how_to_build_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    source = _fake_source(tmp_path / "llama.cpp", "")
    with pytest.raises(SystemExit) as e:
        main(_bench_argv(tmp_path, source))
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "--llamacpp needs llama-cpp-python" in err and 'README.md, section "llama.cpp in the benchmark"' in err
    assert not (tmp_path / "out").exists()


def test_a_tree_without_the_converter_is_named(tmp_path, capsys):
    for source, says in ((tmp_path / "nowhere", "not a directory"), (tmp_path, "no convert_hf_to_gguf.py there")):
        with pytest.raises(SystemExit) as e:
            main(_bench_argv(tmp_path, source))
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"--llamacpp {source}: {says}" in err and "gguf-py" in err


def test_llamacpp_flags_need_llamacpp(capsys):
    for argv in (["--llamacpp-types", "f32"], ["--gguf-cache", "/tmp/x"], ["--llamacpp-threads", "1"],
                 ["--concurrency", "1", "--llamacpp", "/x"]):
        with pytest.raises(SystemExit) as e:
            main(["bench", "--no-hf", *argv])
        assert e.value.code == 2 and "--llamacpp" in capsys.readouterr().err


def test_a_failing_converter_shows_the_end_of_its_output(tmp_path):
    source = _fake_source(tmp_path / "llama.cpp", """
        import sys
        for i in range(60):
            print(f"converter line {i}", file=sys.stderr)
        sys.exit(3)
    """)
    model = _checkpoint(tmp_path / "m")
    with pytest.raises(llamacpp.LlamacppError) as e:
        llamacpp.convert(source, model, "q8_0", tmp_path / "cache", log=lambda s: None)
    text = str(e.value)
    assert f"--llamacpp {source}: convert_hf_to_gguf.py failed on {model} (--outtype q8_0, exit 3)" in text
    assert "converter line 59" in text and "converter line 10\n" not in text  # the tail only
    assert not list((tmp_path / "cache").iterdir())  # nothing a rerun would take for a converted file


FAKE_CONVERTER = """
    import sys
    from pathlib import Path

    class TextModel:
        def get_vocab_base_pre(self, tokenizer):
            raise NotImplementedError("BPE pre-tokenizer was not recognized")

    def main():
        args = sys.argv[1:]
        out = Path(args[args.index("--outfile") + 1])
        out.write_text(" ".join([args[0], args[args.index("--outtype") + 1], TextModel().get_vocab_base_pre(None)]))
        with (Path(__file__).parent / "calls").open("a") as f:
            f.write("call\\n")
"""


def test_conversions_are_cached_by_content_and_type(tmp_path):
    """The wrapper runs the tree's converter with the checkpoint, type and an unknown
    pre-tokenizer as gpt-2; a second request is served from the cache, a changed checkpoint
    or another type converts again."""
    source = _fake_source(tmp_path / "llama.cpp", FAKE_CONVERTER)
    model = _checkpoint(tmp_path / "m")
    logs: list[str] = []
    path = llamacpp.convert(source, model, "f32", tmp_path / "cache", log=logs.append)
    assert path.read_text() == f"{model} f32 gpt-2" and path.parent == tmp_path / "cache"
    assert llamacpp.convert(source, model, "f32", tmp_path / "cache", log=logs.append) == path
    assert "cached" in logs[-1] and (source / "calls").read_text().count("call") == 1
    assert llamacpp.convert(source, model, "bf16", tmp_path / "cache", log=logs.append) != path
    (model / "config.json").write_text('{"changed": true}')
    assert llamacpp.convert(source, model, "f32", tmp_path / "cache", log=logs.append) != path
    assert (source / "calls").read_text().count("call") == 3
    with pytest.raises(llamacpp.LlamacppError, match="choose from"):
        llamacpp.convert(source, model, "q4_0", tmp_path / "cache")


def _run(tokens: list[int], decode_s: float) -> dict:
    return {"tokens": tokens, "decode_s": decode_s, "tok_s": (len(tokens) - 1) / decode_s}


def test_the_comparison_reports_what_the_runs_say():
    """Ratios are medians of per-run ratios against llama.cpp's plain decoding on the same
    weights; a greedy mismatch on f32 fails the check at its first differing token."""
    same, other = [1, 2, 3, 4], [1, 2, 9, 4]
    runs = {"plain:0": [_run(same, 1.0), _run(same, 1.2)], "lookup:0": [_run(same, 0.5), _run(same, 0.6)],
            "ngram:3": [_run(same, 0.25), _run(same, 0.3)],  # the fastest row of ours
            "plain@f32:0": [_run(same, 2.0), _run(same, 2.0)], "lookup@f32:0": [_run(same, 1.0), _run(same, 1.0)],
            llamacpp.key("f32", 0): [_run(same, 2.0), _run(other, 4.0)],
            llamacpp.key("f32", 4): [_run(same, 1.0), _run(other, 2.0)],
            llamacpp.key("bf16", 0): [_run(same, 1.5), _run(same, 1.8)],
            llamacpp.key("bf16", 2): [_run(same, 1.0), _run(same, 1.2)],
            llamacpp.key("bf16", 7): [_run(same, 0.75), _run(same, 0.9)],
            llamacpp.key("f16", 0): [_run(same, 1.6), _run(same, 1.9)],  # no specjax weights of this type
            llamacpp.key("f16", 2): [_run(same, 1.1), _run(same, 1.3)]}
    cell = llamacpp.summarise("edit", runs, {"f32": "@f32", "bf16": "", "f16": None})
    assert cell["plain_ratio"] == pytest.approx({"f32": 1.5, "bf16": 1.5})  # medians of (1, 2) and of (1.5, 1.5)
    rows = {(r["engine"], r["weights"], r["key"]): r for r in cell["rows"]}
    assert set(rows) == {("llama.cpp", "f32", "llamacpp-plain@f32:0"), ("llama.cpp", "f32", "llamacpp-lookup@f32:4"),
                         ("specjax", "f32", "plain@f32:0"), ("specjax", "f32", "lookup@f32:0"),
                         ("llama.cpp", "bf16", "llamacpp-plain@bf16:0"), ("llama.cpp", "bf16", "llamacpp-lookup@bf16:7"),
                         ("specjax", "bf16", "plain:0"), ("specjax", "bf16", "lookup:0"), ("specjax", "bf16", "ngram:3"),
                         ("llama.cpp", "f16", "llamacpp-plain@f16:0"), ("llama.cpp", "f16", "llamacpp-lookup@f16:2")}
    assert rows[("specjax", "bf16", "ngram:3")]["vs_llamacpp_plain"] == pytest.approx(6.0)
    assert rows[("specjax", "bf16", "ngram:3")]["tok_s"] == pytest.approx(11.0)  # median of 3 / 0.25 and 3 / 0.3
    assert rows[("llama.cpp", "f16", "llamacpp-lookup@f16:2")]["same_tokens_as_specjax_plain"] is None
    assert rows[("llama.cpp", "f32", "llamacpp-lookup@f32:4")]["same_tokens_as_specjax_plain"] is False
    assert rows[("llama.cpp", "f32", "llamacpp-lookup@f32:4")]["same_tokens_as_llamacpp_plain"] is True
    assert cell["speculative"] == {"specjax": "ngram:3", "specjax_weights": "bf16", "llamacpp": "llamacpp-lookup@bf16:7",
                                   "llamacpp_weights": "bf16", "ratio": pytest.approx(3.0)}
    assert cell["check"] == {"passed": False, "runs": 2, "tokens": 4,
                             "mismatches": [{"run": 1, "position": 2, "specjax": 3, "llamacpp": 9}]}
    caches = {"f32": {"llamacpp": "f32", "specjax": "f32"}, "bf16": {"llamacpp": "f16", "specjax": "bf16"},
              "f16": {"llamacpp": "f16", "specjax": None}}
    results = {"llamacpp": {"version": "0", "threads": 1, "specjax_threads": 2, "caches": caches},
               "cells": [{"workload": "edit", "llamacpp": cell}]}
    table = llamacpp.markdown(results)
    assert "llama.cpp on 1 thread (`--llamacpp-threads`), specjax on 2;" in table
    assert ("KV caches: llama.cpp f32 with f32 weights, f16 with bf16 weights, f16 with f16 weights; specjax f32 "
            "with f32 weights, bf16 with bf16 weights (`--kv-dtype`).") in table
    assert "| edit | bf16 | specjax | ngram (k=3) | 11 | 6.00x | yes |" in table
    assert "| edit | f16 | llama.cpp | lookup (k=2) | 3 | 1.46x | – |" in table
    assert "f32 greedy check: **FAILED**: edit run 1 first differs at token 2 (specjax 3, llama.cpp 9)" in table
    assert "3.00x; met (goal 1.5x)" in table and "f32 1.50x (met)" in table
    assert llamacpp.first_difference([1, 2], [1, 2, 3]) == 2 and llamacpp.first_difference([5], [5]) is None


def test_llamacpp_rows_run_next_to_the_specjax_row_they_are_compared_with():
    """Each llama.cpp row runs beside specjax's row on the same weights (plain by plain,
    lookup by lookup): after it on odd reps, before it on even ones; a type specjax has no
    weights for keeps its rows at the end, and the other rows keep their order."""
    tags = {"f32": "@f32", "bf16": "", "f16": None}
    lp, ll = llamacpp.key("bf16", 0), llamacpp.key("bf16", 7)
    fp, fl = llamacpp.key("f32", 0), llamacpp.key("f32", 4)
    hp = llamacpp.key("f16", 0)
    keys = ["plain:0", "ngram:3", "lookup:0", "lookup-tree:7", "plain@f32:0", "lookup@f32:0", fp, fl, lp, ll, hp]
    partners = {key: p for key in keys if (p := llamacpp.partner(key, tags)) is not None}
    assert partners == {lp: "plain:0", ll: "lookup:0", fp: "plain@f32:0", fl: "lookup@f32:0"}
    assert bench.run_order(keys, partners, 1) == ["plain:0", lp, "ngram:3", "lookup:0", ll, "lookup-tree:7",
                                                  "plain@f32:0", fp, "lookup@f32:0", fl, hp]
    assert bench.run_order(keys, partners, 2) == [lp, "plain:0", "ngram:3", ll, "lookup:0", "lookup-tree:7",
                                                  fp, "plain@f32:0", fl, "lookup@f32:0", hp]
    # a sampled cell runs no llama.cpp rows; one without specjax's row keeps its llama.cpp row
    assert bench.run_order(keys[:4], {}, 2) == keys[:4]
    assert bench.run_order(["plain:0", fp], {fp: "plain@f32:0"}, 2) == ["plain:0", fp]


# ---------------------------------------------------------------- with llama.cpp

@pytest.fixture(scope="module")
def source() -> Path:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (README: llama.cpp in the benchmark)")
    path = os.environ.get("SPECJAX_LLAMACPP_SOURCE")
    if not path:
        pytest.skip("set SPECJAX_LLAMACPP_SOURCE to a llama.cpp source tree (its converter) to run llama.cpp")
    return Path(path)


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    """(transformers model, folder): a random Qwen3 stored in bf16, with the shipped tokenizer
    (whose vocabulary, 8192, it has), which the converter reads."""
    from conftest import hf_tiny

    folder = tmp_path_factory.mktemp("tiny-bf16")
    ref = hf_tiny(folder, seed=5, dtype="bfloat16", vocab_size=8192, max_position_embeddings=1024, eos_token_id=0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED / name, folder)
    return ref, folder


@pytest.fixture(scope="module")
def bench_run(source, tiny_bf16, tmp_path_factory):
    """The bench on the bf16 model with f32 (specjax's rows widened at load, as for q8_0 its
    rows quantized at load) and bf16 (the loaded model's own weights) files; no step profile
    (test_bench's subject)."""
    root = tmp_path_factory.mktemp("lcbench")
    cfg = bench.BenchConfig(model=tiny_bf16[1], workloads=("edit",), samplings=("greedy",), prompts=1, reps=1,
                            prompt_tokens=160, new_tokens=12, ngram_ks=(3,), hf=False, profile=False,
                            llamacpp=source, gguf_types=("f32", "bf16"), llamacpp_ks=(3,), gguf_cache=root / "gguf",
                            out=root / "out")
    return cfg, bench.run(cfg, log=lambda s: None)


def test_a_16_bit_cache_leaves_the_f32_rows_exact(source, tiny_bf16, tmp_path):
    """With --kv-dtype bfloat16 specjax's rows on 16-bit weights keep 16-bit caches, as
    llama.cpp's do (its default f16), while both engines' f32 rows keep f32 caches: the
    greedy check still compares like with like, and passes."""
    cfg = bench.BenchConfig(model=tiny_bf16[1], workloads=("edit",), samplings=("greedy",), prompts=1, reps=1,
                            prompt_tokens=160, new_tokens=12, ngram_ks=(3,), hf=False, profile=False,
                            llamacpp=source, gguf_types=("f32", "bf16"), llamacpp_ks=(3,), gguf_cache=tmp_path / "gguf",
                            out=tmp_path / "out", kv_dtype="bfloat16")
    res = bench.run(cfg, log=lambda s: None)
    assert res["llamacpp"]["caches"] == {"f32": {"llamacpp": "f32", "specjax": "f32"},
                                         "bf16": {"llamacpp": "f16", "specjax": "bf16"}}
    assert res["llamacpp"]["check_passed"]


def test_without_an_f32_file_the_greedy_check_is_not_run_rather_than_failed(source, tiny_bf16, tmp_path):
    """With no f32 file there is nothing to compare: the log, results.json and the table
    all say the check did not run (the log and results.json used to say it failed)."""
    cfg = bench.BenchConfig(model=tiny_bf16[1], workloads=("edit",), samplings=("greedy",), prompts=1, reps=1,
                            prompt_tokens=160, new_tokens=8, ngram_ks=(3,), hf=False, profile=False,
                            llamacpp=source, gguf_types=("bf16",), llamacpp_ks=(3,), gguf_cache=tmp_path / "gguf",
                            out=tmp_path / "out")
    lines = []
    res = bench.run(cfg, log=lines.append)
    assert res["llamacpp"]["check_passed"] is None
    assert json.loads((cfg.out / "results.json").read_text())["llamacpp"]["check_passed"] is None
    assert "llama.cpp f32 greedy check: not run (no f32 file in --llamacpp-types)" in lines
    assert "f32 greedy check: not run" in (cfg.out / "results.md").read_text()


def test_greedy_tokens_on_f32_equal_specjax_and_transformers(bench_run, tiny_bf16):
    """The f32 file (the converter's, from the bench's cache) decoded greedily by llama.cpp
    gives transformers' greedy tokens and specjax's, on a prompt of the shipped tokenizer."""
    import torch

    import specjax

    cfg, res = bench_run
    ref, folder = tiny_bf16
    target = specjax.load(folder, "float32")
    ids = target.tokenizer("def add(a, b):\n    return a + b\n\nclass Stack:\n")["input_ids"]
    n = 16
    want = ref.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                        eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert specjax.generate(target, ids, max_new_tokens=n, stop_ids=()).tokens == want
    runner = llamacpp.Runner(Path(res["llamacpp"]["files"]["f32"]["path"]), "f32", 256, llamacpp.threads())
    assert runner.run(ids, n, k=0)["tokens"] == want
    assert len(set(want)) > 3  # not one repeated token, which would match by chance


def test_bench_writes_llamacpp_rows_check_and_table(bench_run):
    cfg, res = bench_run
    data = json.loads((cfg.out / "results.json").read_text())
    info = data["llamacpp"]
    assert info["check_passed"] and info["threads"] == info["specjax_threads"] == llamacpp.threads()
    assert set(info["files"]) == {"f32", "bf16"} and all(f["bytes"] > 0 for f in info["files"].values())
    cell = data["cells"][0]
    for key in ("plain@f32:0", "lookup@f32:0", *(llamacpp.key(t, k) for t in ("f32", "bf16") for k in (0, 3))):
        assert cell["rows"][key]["tok_s"]["median"] > 0, key
    lc = cell["llamacpp"]
    assert lc["check"]["passed"] and lc["check"]["runs"] == 1 and lc["check"]["tokens"] == cfg.new_tokens
    got = {(r["engine"], r["weights"], r["method"]) for r in lc["rows"]}
    for t in ("f32", "bf16"):
        assert {("llama.cpp", t, "plain"), ("llama.cpp", t, "lookup"), ("specjax", t, "plain"),
                ("specjax", t, "lookup")} <= got
    assert {r["key"] for r in lc["rows"] if r["engine"] == "specjax" and r["weights"] == "bf16"} >= {"plain:0", "lookup:0"}
    assert set(lc["plain_ratio"]) == {"f32", "bf16"} and lc["speculative"]["ratio"] > 0
    assert cell["rows"]["plain@f32:0"]["same_tokens_as_plain"]  # f32 widened at load: the bf16 kernels' bits
    table = (cfg.out / "results.md").read_text()
    assert "### llama.cpp in the same run" in table and "| edit | bf16 | llama.cpp | lookup (k=3) |" in table
    assert "f32 greedy check: **passed**" in table and "Goals, edit:" in table
