"""`specjax bench --concurrency 1,2,4,8,16`: the batched engine under concurrent requests.

For each workload, sampling and concurrency c, c requests are submitted at once to one
`Engine` (plain decoding, the default chooser, and prompt lookup with each fixed k), and
transformers' batched `generate` (left-padded, plain) runs the same prompts. Reported per
cell: aggregate tokens/s (all committed tokens over the wall time from submission to the
last token, prefill included), per-request decode tokens/s (median and p90), time to
first token and inter-token latency (medians), tokens per step. Every speculative row is
checked token for token against the plain run of the same cell. Runs of one cell are
interleaved method by method and repeated; figures are medians over repetitions.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .engine import Engine, Speculation, max_len_for
from .model import Model, load
from .sampling import Sampling
from .workloads import WORKLOADS, benchmark_prompts

SAMPLINGS = {"greedy": Sampling(), "sampled": Sampling(temperature=0.6, top_k=20, top_p=0.95)}


@dataclasses.dataclass(frozen=True)
class ConcurrencyConfig:
    model: Path
    levels: tuple[int, ...] = (1, 2, 4, 8, 16)
    workloads: tuple[str, ...] = WORKLOADS
    samplings: tuple[str, ...] = ("greedy", "sampled")
    fixed_ks: tuple[int, ...] = (2, 4, 7, 15)
    prompt_tokens: int = 512
    new_tokens: int = 128
    reps: int = 2
    hf: bool = True
    precompile: bool = True  # Engine.compile before each timed run (off: tests, where nothing is timed)
    kv_dtype: str | None = None  # the target's KV cache (`specjax.load`; None: its compute dtype)
    out: Path = Path("bench-results")


def _methods(cfg: ConcurrencyConfig) -> list[tuple[str, Speculation | None]]:
    return ([("plain", None), ("auto", Speculation(k=max(cfg.fixed_ks)))]
            + [(f"k={k}", Speculation(k=k, adaptive=False)) for k in cfg.fixed_ks])


def _engine_run(target: Model, spec: Speculation | None, prompts: list[list[int]], n: int, sampling: Sampling,
                precompile: bool = True) -> dict[str, Any]:
    engine = Engine(target, spec, max_batch=len(prompts), max_len=max_len_for(target, max(len(p) + n for p in prompts)))
    if precompile:  # every row count: requests finishing apart reach them all
        engine.compile((not sampling.greedy,))
    t0 = time.perf_counter()
    reqs = [engine.submit(p, max_new_tokens=n, sampling=sampling, seed=i, stop_ids=()) for i, p in enumerate(prompts)]
    engine.run()
    wall = time.perf_counter() - t0
    stats = [r.stats for r in reqs]
    steps = sum(s.steps for s in stats)
    return {"tokens": [r.tokens for r in reqs], "aggregate": sum(s.new_tokens for s in stats) / wall,
            "per_request": [s.tokens_per_s for s in stats], "ttft": [s.prefill_s for s in stats],
            "itl": [s.decode_s / max(s.new_tokens - 1, 1) for s in stats],
            "tokens_per_step": sum(s.new_tokens - 1 for s in stats) / steps if steps else 0.0}


def _hf_runner(cfg: ConcurrencyConfig) -> Callable | None:
    """transformers' batched generate, prompts left-padded (plain decoding)."""
    if not cfg.hf:
        return None
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_grad_enabled(False)
    ref = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).eval()

    def run(prompts: list[list[int]], n: int, sampling: Sampling) -> dict[str, Any]:
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        kw: dict[str, Any] = dict(max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0,
                                  attention_mask=mask)
        if sampling.greedy:
            kw.update(do_sample=False)
        else:
            kw.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None,
                      top_p=sampling.top_p)
        torch.manual_seed(0)
        t0 = time.perf_counter()
        ref.generate(ids, **kw)
        return {"aggregate": len(prompts) * n / (time.perf_counter() - t0)}

    return run


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _p90(values: list[float]) -> float:
    return float(np.percentile(values, 90)) if values else 0.0


def run(cfg: ConcurrencyConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the concurrency benchmark; returns (and writes) the results."""
    from .bench import _jsonable, _machine

    target = load(cfg.model, kv_dtype=cfg.kv_dtype)
    pools = benchmark_prompts(target, cfg.workloads, max(cfg.levels), cfg.prompt_tokens, cfg.new_tokens)
    hf = _hf_runner(cfg)
    methods = _methods(cfg)
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": _machine(),
                               "config": _jsonable(dataclasses.asdict(cfg)), "cells": []}
    for kind, made in pools.items():
        pool = [p.ids for p in made]
        for sname in cfg.samplings:
            sampling = SAMPLINGS[sname]
            for c in cfg.levels:
                prompts = pool[:c]
                runs: dict[str, list[dict]] = {}
                for rep in range(cfg.reps + 1):  # rep 0 compiles
                    for name, spec in methods:
                        r = _engine_run(target, spec, prompts, cfg.new_tokens, sampling, cfg.precompile)
                        if rep:
                            runs.setdefault(name, []).append(r)
                    if hf is not None and rep:
                        runs.setdefault("hf-plain", []).append(hf(prompts, cfg.new_tokens, sampling))
                cell = _summarise(kind, sname, c, runs)
                results["cells"].append(cell)
                log(_cell_line(cell))
                write(results, cfg.out)  # after every cell: a stopped run keeps what it measured
    return results


def _summarise(kind: str, sname: str, c: int, runs: dict[str, list[dict]]) -> dict[str, Any]:
    plain_tokens = runs["plain"][0]["tokens"]
    cell: dict[str, Any] = {"workload": kind, "sampling": sname, "concurrency": c, "methods": {}}
    for name, rs in runs.items():
        m = {"aggregate_tok_s": _median([r["aggregate"] for r in rs])}
        if "per_request" in rs[0]:
            per = [x for r in rs for x in r["per_request"]]
            m.update(per_request_median=_median(per), per_request_p90=_p90(per),
                     ttft_median_s=_median([x for r in rs for x in r["ttft"]]),
                     itl_median_s=_median([x for r in rs for x in r["itl"]]),
                     tokens_per_step=_median([r["tokens_per_step"] for r in rs]),
                     exact=all(r["tokens"] == plain_tokens for r in rs))
        cell["methods"][name] = m
    base = cell["methods"]["plain"]["aggregate_tok_s"]
    for m in cell["methods"].values():
        m["vs_plain"] = m["aggregate_tok_s"] / base if base else 0.0
    fixed = {n: m for n, m in cell["methods"].items() if n.startswith("k=")}
    if fixed:
        best = max(fixed, key=lambda n: fixed[n]["aggregate_tok_s"])
        cell["best_fixed"] = best
        cell["auto_vs_best_fixed"] = cell["methods"]["auto"]["aggregate_tok_s"] / fixed[best]["aggregate_tok_s"]
    return cell


def _cell_line(cell: dict[str, Any]) -> str:
    m = cell["methods"]
    text = (f"[{cell['workload']} / {cell['sampling']} / c={cell['concurrency']}] plain "
            f"{m['plain']['aggregate_tok_s']:.0f} tok/s aggregate; auto {m['auto']['vs_plain']:.2f}x")
    if "best_fixed" in cell:
        text += f", best fixed {cell['best_fixed']} {m[cell['best_fixed']]['vs_plain']:.2f}x"
    if "hf-plain" in m:
        text += f"; ours/HF plain {1 / m['hf-plain']['vs_plain']:.2f}x"
    return text + ("" if all(x.get("exact", True) for x in m.values()) else "  (NOT EXACT)")


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [f"Concurrency run of {results['date']} on {m['cpus']} CPUs ({m['backend']}, jax {m['jax']}); "
             f"{results['config']['prompt_tokens']}-token prompts, {results['config']['new_tokens']} new tokens.", "",
             "| workload | sampling | c | plain agg tok/s | per-request tok/s (median / p90) | TTFT ms | ITL ms "
             "| auto | best fixed k | auto / best fixed | auto tokens/step | ours / HF plain | exact |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cell in results["cells"]:
        m = cell["methods"]
        p, a = m["plain"], m["auto"]
        best = cell.get("best_fixed")
        best_text = f"{best} ({m[best]['vs_plain']:.2f}x)" if best else "-"
        hf = f"{1 / m['hf-plain']['vs_plain']:.2f}x" if "hf-plain" in m else "-"
        lines.append(
            f"| {cell['workload']} | {cell['sampling']} | {cell['concurrency']} | {p['aggregate_tok_s']:.0f} "
            f"| {p['per_request_median']:.0f} / {p['per_request_p90']:.0f} | {p['ttft_median_s'] * 1e3:.0f} "
            f"| {p['itl_median_s'] * 1e3:.2f} | {a['vs_plain']:.2f}x "
            f"| {best_text} "
            f"| {cell.get('auto_vs_best_fixed', 0):.2f} | {a['tokens_per_step']:.2f} | {hf} "
            f"| {'yes' if all(x.get('exact', True) for x in m.values()) else 'NO'} |")
    return "\n".join(lines) + "\n"


def write(results: dict[str, Any], out: Path) -> None:
    import json

    out.mkdir(parents=True, exist_ok=True)
    (out / "concurrency.json").write_text(json.dumps(results, indent=1))
    (out / "concurrency.md").write_text(markdown(results))
