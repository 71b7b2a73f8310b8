"""`specjax bench --quick` on a random tiny model: schema, outputs, and stats that agree with generate."""

import dataclasses
import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

import specjax
from specjax import bench, checkpoint
from specjax.config import Qwen3Config
from specjax.workloads import workload

SHIPPED_TOKENIZER = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-code"


def _random_model(folder: Path, hidden: int, layers: int, seed: int) -> Path:
    cfg = Qwen3Config(vocab_size=8192, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=0,
                      max_position_embeddings=2048)
    checkpoint.save(folder, checkpoint.init_params(cfg, jax.random.key(seed), std=0.3), cfg)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED_TOKENIZER / name, folder)
    return folder


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target = _random_model(root / "t", 32, 2, 1)
    draft = _random_model(root / "t-draft", 16, 1, 2)
    cfg = bench.BenchConfig.quick(model=target, draft=draft, new_tokens=12, prompt_tokens=160, ngram_ks=(3,),
                                  draft_ks=(2,), workloads=("edit",), samplings=("greedy",), profile_ts=(1, 2),
                                  s_profile=False, trees=("lookup",), out=root / "out", kv_dtype="bfloat16")
    return cfg, bench.run(cfg, log=lambda s: None)


def test_outputs_written(results):
    cfg, _ = results
    data = json.loads((cfg.out / "results.json").read_text())
    assert {"date", "machine", "config", "cells", "profile"} <= set(data)
    table = (cfg.out / "results.md").read_text()
    assert "| edit | greedy |" in table and "| edit | greedy | lookup | chosen |" in table
    assert "KV cache bfloat16." in table and data["config"]["kv_dtype"] == "bfloat16"
    for png in ("speedup_vs_k.png", "acceptance_by_position.png"):
        assert (cfg.out / png).stat().st_size > 1000


def test_every_field_present(results):
    _, res = results
    for cell in res["cells"]:
        rows = cell["rows"]
        assert {"plain:0", "lookup:0", "lookup-tree:0", "lookup-auto:0", "adaptive:0", "hf-plain:0", "hf-lookup:0",
                "hf-assisted:0"} <= set(rows)
        assert {"ngram:3", "draft:2"} <= set(rows)
        for key, row in rows.items():
            assert {"median", "min", "max"} <= set(row["tok_s"]) and row["tok_s"]["median"] > 0
            assert {"median", "min", "max"} <= set(row["speedup"]) and "rss_mb" in row
            if row["method"] in ("ngram", "draft", "lookup", "lookup-tree", "lookup-auto", "adaptive"):
                assert {"tokens_per_step", "accept_hist", "acceptance_by_position", "verify_tokens_per_token",
                        "time_split", "tree_share", "branched_share"} <= set(row)
                assert set(row["time_split"]) == {"propose_s", "verify_s", "host_s"}
            # ours are exact; transformers' greedy is the same model, so the same tokens too
            assert row["same_tokens_as_plain"], key
        assert set(cell["best_k"]) >= {"ngram", "draft", "lookup", "lookup-tree", "lookup-auto", "adaptive", "hf-plain"}
        assert "draft-tree" not in cell["best_k"]  # trees were asked of lookup only
    assert "s_profile" not in res and "gpu_profile" not in res  # off here; the 4B shape only off CPU
    p = res["profile"]
    assert set(p["ratio_to_T1"]) == {1, 2} and p["ratio_to_T1"][1] == 1.0
    assert p["floor_ms"] > 0 and p["decode_over_floor"] > 0 and p["run_over_floor"] > 0


def test_stats_agree_with_generate(results):
    """Tokens per step and histograms in the results are what generate reports for the same run
    (the target loaded as the bench loads it: its KV cache in bfloat16)."""
    cfg, res = results
    target = specjax.load(cfg.model, kv_dtype=cfg.kv_dtype)
    draft = specjax.load(cfg.draft, target.dtype)
    prompt = workload(target.tokenizer, "edit", 1, cfg.prompt_tokens)[0]
    cell = next(c for c in res["cells"] if c["sampling"] == "greedy")
    for key, prop in [("ngram:3", specjax.NgramProposer(k=3)), ("draft:2", specjax.DraftProposer(draft, k=2))]:
        out = specjax.generate(target, prompt.ids, max_new_tokens=cfg.new_tokens, speculative=prop, seed=1)
        row = cell["rows"][key]
        assert row["tokens_per_step"] == out.stats.tokens_per_step
        assert row["accept_hist"] == out.stats.accept_hist
        assert row["verify_tokens_per_token"] == out.stats.verify_tokens_per_token


def test_tree_shares_pool_the_runs():
    """A row's tree_share is its runs' tree steps over their steps, branched_share their
    branched steps over their tree steps (runs pooled, not averaged)."""
    from specjax.results import Stats

    def run(steps, tree_steps, branched):
        s = Stats(new_tokens=steps + 1, steps=steps, tree_steps=tree_steps, branched=branched, verify_s=0.1)
        return {"tokens": [1], "tok_s": 1.0, "decode_s": 0.1, "stats": s.summary()}

    plain = {"tokens": [1], "tok_s": 1.0, "decode_s": 0.1, "stats": Stats(new_tokens=2, steps=1).summary()}
    cell = bench._summarise("edit", "greedy", {"plain:0": [plain, plain],
                                               "lookup-tree:0": [run(10, 4, 1), run(30, 6, 4)]})
    row = cell["rows"]["lookup-tree:0"]
    assert row["tree_share"] == 10 / 40 and row["branched_share"] == 5 / 10


def test_tokens_per_step_pools_the_runs():
    """tokens_per_step is the runs' committed tokens after the first over their steps, and
    verify_tokens_per_token their verified tokens over those tokens (pooled: two prompts at
    4 and at 2 tokens a step do not give the median of a few runs of each)."""
    from specjax.results import Stats

    def run(new_tokens, steps, verify_tokens):
        s = Stats(new_tokens=new_tokens, steps=steps, verify_tokens=verify_tokens, verify_s=0.1)
        return {"tokens": [1], "tok_s": 1.0, "decode_s": 0.1, "stats": s.summary()}

    plain = {"tokens": [1], "tok_s": 1.0, "decode_s": 0.1, "stats": Stats(new_tokens=2, steps=1).summary()}
    cell = bench._summarise("edit", "greedy", {"plain:0": [plain] * 3,
                                               "ngram:4": [run(41, 10, 50), run(41, 20, 60), run(81, 40, 120)]})
    row = cell["rows"]["ngram:4"]
    assert row["tokens_per_step"] == 160 / 70 and row["verify_tokens_per_token"] == 230 / 160


def test_trees_are_timed_against_their_chain_run_by_run():
    """A tree or auto row's over_chain pairs each of its runs with the chain row's run of the
    same repetition (the chain's decode time over its own); other rows have none."""
    from specjax.results import Stats

    def run(decode_s):
        stats = Stats(new_tokens=2, steps=1, verify_s=decode_s).summary()
        return {"tokens": [1], "tok_s": 1.0, "decode_s": decode_s, "stats": stats}

    runs = {"plain:0": [run(1.0), run(1.0), run(1.0)], "dflash:7": [run(0.2), run(0.4), run(0.3)],
            "dflash-tree:7": [run(0.1), run(0.5), run(0.2)], "dflash-auto:7": [run(0.2), run(0.4), run(0.3)],
            "lookup:0": [run(0.5), run(0.5), run(0.5)], "lookup-auto:0": [run(0.25), run(1.0), run(0.5)]}
    rows = bench._summarise("edit", "greedy", runs)["rows"]
    assert rows["dflash-tree:7"]["over_chain"] == pytest.approx({"median": 1.5, "min": 0.8, "max": 2.0})
    assert rows["dflash-auto:7"]["over_chain"] == pytest.approx({"median": 1.0, "min": 1.0, "max": 1.0})
    assert rows["lookup-auto:0"]["over_chain"] == pytest.approx({"median": 1.0, "min": 0.5, "max": 2.0})
    assert not any("over_chain" in rows[key] for key in ("plain:0", "dflash:7", "lookup:0"))


def test_random_model_profile_runs_on_any_backend():
    """The path `bench` takes on a GPU (a Qwen3-4B-shaped random model), here at a toy shape."""
    shape = dict(bench.QWEN3_4B_SHAPE, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = bench.random_model(shape, "float32")
    prof = bench.step_profile(model, (1, 2), context=64, rounds=2)
    assert prof["weight_bytes"] == sum(x.nbytes for x in jax.tree.leaves(model.params))
    assert prof["ratio_to_T1"][1] == 1.0 and prof["floor_ms"] > 0 and prof["run_ms_per_token"] > 0


def test_method_rows_fit_the_proposers(tmp_path):
    """DFlash k values past the drafter's block are left out (its largest is always in);
    the lookup row and the adaptive row (over every proposer) are always there."""
    from specjax import dflash

    target_dir = _random_model(tmp_path / "t", 32, 2, 1)
    target = specjax.load(target_dir)
    dflash.save_dflash(dflash.init(target.config, jax.random.key(0), num_layers=1, block_size=4), tmp_path / "d")
    cfg = bench.BenchConfig(model=target_dir, dflash=tmp_path / "d", dflash_ks=(2, 7, 15), ngram_ks=(3,))
    names = [(name, k) for name, k, _ in bench._methods(cfg, target)]
    assert names == [("plain", 0), ("ngram", 3), ("lookup", 0), ("lookup-tree", 0), ("lookup-auto", 0), ("dflash", 2),
                     ("dflash", 3), ("dflash-tree", 3), ("dflash-auto", 3), ("adaptive", 0)]
    rows = {name: prop for name, _, prop in bench._methods(cfg, target)}
    assert rows["dflash-tree"].tree == 3 and rows["dflash-auto"].tree == "auto" and rows["dflash"].tree == 0
    assert [p.tree for p in rows["lookup-auto"].proposers] == ["auto"]
    chains_only = bench.BenchConfig(model=target_dir, dflash=tmp_path / "d", dflash_ks=(2,), ngram_ks=(3,), trees=())
    assert [name for name, _, _ in bench._methods(chains_only, target)] == ["plain", "ngram", "lookup", "dflash", "dflash",
                                                                          "adaptive"]
    with pytest.raises(ValueError, match="trees: 'ngram'"):
        bench._methods(dataclasses.replace(cfg, trees=("ngram",)), target)


def test_a_drafter_with_a_markov_head_gets_a_row_without_it_and_a_table(tmp_path):
    """A drafter with a Markov head: a "dflash-unary" row at its largest k drafts with the
    same layers and no head; the table reads both rows; the drafter pass is profiled."""
    from specjax import dflash

    target_dir = _random_model(tmp_path / "t", 32, 2, 1)
    target = specjax.load(target_dir)
    drafter = dflash.init(target.config, jax.random.key(0), num_layers=1, block_size=4)
    head = dflash.init_markov(target.config.vocab_size, 4, jax.random.key(1))
    dflash.save_dflash(dataclasses.replace(drafter, params={**drafter.params, dflash.MARKOV: head}), tmp_path / "d")
    cfg = bench.BenchConfig(model=target_dir, dflash=tmp_path / "d", dflash_ks=(3,), ngram_ks=(3,), trees=())
    rows = {(name, k): prop for name, k, prop in bench._methods(cfg, target)}
    assert dflash.MARKOV in rows[("dflash", 3)].drafter.params
    unary = rows[("dflash-unary", 3)].drafter
    assert dflash.MARKOV not in unary.params and unary.params["fc.weight"] is rows[("dflash", 3)].drafter.params[
        "fc.weight"]

    def row(tps, speed, by_position):
        return {"tokens_per_step": tps, "speedup": {"median": speed}, "acceptance_by_position": by_position}

    cell = {"workload": "edit", "sampling": "greedy", "best_k": {"dflash": 3, "dflash-unary": 3},
            "rows": {"dflash:3": row(2.5, 1.2, [0.9, 0.8, 0.7]), "dflash-unary:3": row(2.0, 1.0, [0.8, 0.5, 0.4])}}
    table = bench.markov_markdown({"cells": [cell]})
    assert "| edit | greedy | 3 | 2.50 / 1.20x / 0.90 0.80 0.70 | 2.00 / 1.00x / 0.80 0.50 0.40 |" in table
    assert bench.markov_markdown({"cells": [{**cell, "best_k": {"dflash": 3}}]}) == ""
    prof = bench.block_profile(target, specjax.load_dflash(tmp_path / "d", target), context=40, rounds=2)
    assert prof["markov"] and prof["k"] == 3 and prof["pass_over_decode"] > 0 and prof["draft_vocab"] is None


def test_tree_table_reads_the_rows_it_names():
    """The tree table's cells come from the chain, tree and auto rows of each proposer."""
    def row(tps, speed, **kw):
        return {"tokens_per_step": tps, "speedup": {"median": speed}, "verify_tokens_per_token": 1.5,
                "tree_share": 0.0, "branched_share": 0.0, **kw}

    over = lambda lo, mid, hi: {"over_chain": {"min": lo, "median": mid, "max": hi}}
    cell = {"workload": "novel", "sampling": "greedy", "best_k": {"dflash-tree": 7, "lookup": 0, "dflash": 4},
            "rows": {"dflash:7": row(1.5, 0.8), "dflash:4": row(1.4, 0.9),
                     "dflash-tree:7": row(1.9, 1.1, branched_share=0.25, verify_tokens_per_token=2.5,
                                          **over(1.2, 1.375, 1.5)),
                     "dflash-auto:7": row(1.8, 1.05, tree_share=0.5, **over(0.9, 1.3125, 1.4))}}
    table = bench.tree_markdown({"cells": [cell]})
    assert ("| novel | greedy | dflash | 7 | 1.50 / 0.80x | 1.90 / 1.10x / 1.38x (1.20-1.50) | "
            "1.80 / 1.05x / 1.31x (0.90-1.40) | 25% | 2.50 | 50% |") in table
    assert bench.tree_markdown({"cells": [{**cell, "best_k": {"dflash": 4}}]}) == ""


def test_novel_prompts_give_prompt_lookup_nothing_to_copy():
    from transformers import AutoTokenizer

    from conftest import lookup_reference

    tok = AutoTokenizer.from_pretrained(SHIPPED_TOKENIZER)
    prompts = workload(tok, "novel", 3, 400, seed=5)
    assert prompts == workload(tok, "novel", 3, 400, seed=5) and prompts != workload(tok, "novel", 3, 400, seed=6)
    for p in prompts:
        assert len(p.ids) == 400 and not set(p.ids) & set(tok.all_special_ids)
        assert min(p.ids) >= 0 and max(p.ids) < len(tok)
        found, n = lookup_reference(np.asarray(p.ids, np.int32), 7, 3, 2)  # no repeated bigram to copy from
        assert n == 0


def test_concurrency_run_writes_every_cell_and_stays_exact(tmp_path):
    """`specjax bench --concurrency` on a random model: one cell per workload, sampling and
    level, every method present, speculative rows equal to the plain run of their cell.

    Run in a fresh process: in full suites (-n 2) the worker running it died inside XLA
    (SIGSEGV / SIGABRT while JAX's persistent cache wrote or read an engine call's
    executable), though it passes alone; the cause is not found."""
    import subprocess
    import sys

    target = _random_model(tmp_path / "t", 32, 2, 3)
    script = (f"from pathlib import Path; from specjax import bench_batch; "
              f"bench_batch.run(bench_batch.ConcurrencyConfig(model=Path({str(target)!r}), levels=(1, 3), "
              f"workloads=('edit',), samplings=('greedy',), fixed_ks=(4,), prompt_tokens=96, new_tokens=10, "
              f"reps=1, precompile=False, "
              f"hf=False, out=Path({str(tmp_path / 'out')!r})), log=lambda s: None)")
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).resolve().parents[1], timeout=500)
    res = json.loads((tmp_path / "out" / "concurrency.json").read_text())
    cells = {(c["sampling"], c["concurrency"]): c for c in res["cells"]}
    assert set(cells) == {("greedy", 1), ("greedy", 3)}
    for cell in cells.values():
        assert set(cell["methods"]) == {"plain", "auto", "k=4"}
        assert all(m.get("exact", True) for m in cell["methods"].values())
        assert cell["methods"]["plain"]["aggregate_tok_s"] > 0 and cell["best_fixed"] == "k=4"
    written = json.loads((tmp_path / "out" / "concurrency.json").read_text())
    assert len(written["cells"]) == 2
    assert (tmp_path / "out" / "concurrency.md").read_text().count("\n| edit |") == 2
    assert f"on {os.cpu_count()} CPUs (cpu, jax {jax.__version__})" in (tmp_path / "out" / "concurrency.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "1,2,1"], "argument --concurrency: concurrency levels must differ, got '1,2,1'"),
    (["--concurrency", "2", "--prompts", "3"], "--concurrency does not use --prompts"),
    (["--concurrency", "2", "--draft", "d", "--no-profile"], "--concurrency does not use --draft, --no-profile"),
    (["--concurrency", "2", "--trees"], "--concurrency does not use --trees"),
    (["--concurrency", "2", "--llamacpp", "src"], "--concurrency does not use --llamacpp"),
    (["--out", "{file}"], "--out {file}: exists and is not a folder"),
    (["--concurrency", "2", "--out", "{file}"], "--out {file}: exists and is not a folder"),
    (["--trees", "lookup", "draft"], "--trees draft: there is no draft model"),
    (["--trees", "dflash"], "--trees dflash: there is no dflash model"),
])
def test_bench_flags_that_cannot_apply_exit_2_before_loading(argv, message, tmp_path, capsys):
    """Flags the run would ignore (single-request ones under --concurrency, a tree proposer
    without its model), repeated levels and an --out that is a file are usage errors naming
    the flag, raised before the model is loaded (--model does not exist here): not silently
    ignored, repeated, or a traceback after the whole run."""
    from specjax.cli import main

    (tmp_path / "a-file").write_text("not a folder\n")
    argv = [a.format(file=tmp_path / "a-file") for a in argv]
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--model", str(tmp_path / "no-model"), "--no-hf", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message.format(file=tmp_path / "a-file") in err and "Traceback" not in err
    assert "not a directory" not in err  # refused before the model was looked at
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.parametrize("mode", [[], ["--concurrency", "1"]])
def test_bench_prompts_past_the_context_are_refused_by_their_flags_before_timing(mode, tmp_path, capsys):
    """Prompts of --prompt-tokens that leave no room for --new-tokens in the model's context are
    refused naming both flags, for every workload before any is timed (or compiled)."""
    from specjax.cli import main

    target = _random_model(tmp_path / "t", 32, 1, 1)  # a 2048-token context
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--model", str(target), "--quick", "--no-hf", *(["--no-profile"] if not mode else mode),
              "--workloads", "novel", "--prompt-tokens", "2040", "--new-tokens", "9", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert ("--prompt-tokens 2040 / --new-tokens 9 (novel workload): prompt (2040) + max_new_tokens (9) exceeds "
            "the model's max_position_embeddings (2048)") in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind,length,message", [
    ("complete", 100000, "no held-out file is long enough for completion prompts of 100000 tokens"),
    ("edit", 30, "could only build 0 of 1 edit prompts of 30 tokens")])
def test_bench_prompts_the_workload_cannot_build_are_refused_by_their_flag(kind, length, message, tmp_path, capsys):
    """A --prompt-tokens no held-out file is long enough for, or too short to hold an edit
    instruction, is refused naming the flag (not a traceback from inside the workload)."""
    from specjax.cli import main

    target = _random_model(tmp_path / "t", 32, 1, 1)
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--model", str(target), "--quick", "--no-hf", "--no-profile", "--workloads", kind,
              "--prompt-tokens", str(length), "--new-tokens", "9", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert f"--prompt-tokens {length} / --new-tokens 9 ({kind} workload): {message}" in err
    assert not (tmp_path / "out").exists()


def test_completion_windows_fit_in_files_of_any_length(monkeypatch):
    """A held-out file exactly prompt_tokens + 64 tokens long has no start to draw a window
    from: it is passed over (no empty random range), and a file one token longer gives the
    window at its first token."""
    from specjax import workloads

    class Chars:  # one id per character
        def __call__(self, text):
            return {"input_ids": [ord(c) for c in text]}

        def decode(self, ids):
            return "".join(map(chr, ids))

    exact = "abcd\n" * 13 + "abcd"  # 69 characters: 5 + 64
    monkeypatch.setattr(workloads, "_heldout", lambda: [("exact.py", exact)])
    with pytest.raises(workloads.PromptError, match="could only build 0 of 1 completion prompts of 5 tokens"):
        workloads.completion_prompts(Chars(), 1, 5)
    monkeypatch.setattr(workloads, "_heldout", lambda: [("longer.py", "x" + exact)])
    assert [p.ids for p in workloads.completion_prompts(Chars(), 1, 5)] == [[ord(c) for c in "xabcd"]]
