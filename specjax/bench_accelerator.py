"""`python -m specjax.bench_accelerator --out DIR`: the checks and timings a GPU run owes.

One script for a short lease of an accelerator (it installs nothing and writes as it goes,
so a run cut short still leaves what it measured in DIR/accelerator.json):

1. the machine: devices, copy bandwidth, a bf16 matrix product's rate;
2. exactness on the shipped model (and its draft model and DFlash drafter), bf16 and
   float32: each proposer on an engine of 8 rows, 4 greedy and 4 sampled prompts together
   and one of each alone, against plain decoding on the same geometry, counting the rows
   that differ and where (one engine per proposer: its compiled programs serve every run,
   which is what a short lease can afford; on GPU the verify and decode steps are
   different programs, so bitwise equality is not promised: README, "Token for token");
3. a Qwen3-4B-shaped model (random bf16 weights): the step profile against the weight-bytes
   floor, then the engine at batch 1 and 8, plain and with every proposer (prompt lookup,
   a Qwen3-0.6B-shaped draft model, a 5-layer DFlash drafter; all random), per-call
   tokens/s and per-step times. Random weights accept almost nothing: these rows time the
   rounds, not the speed-up a trained drafter brings.

Stages run in the order rates, profile, engine-b1, exact-bf16, engine-b8, exact-f32;
`--skip` leaves some out. `--small` swaps in tiny random shapes for the Qwen3-4B-shaped
stages (a CPU smoke run of the same code).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .bench import QWEN3_4B_SHAPE, measure_bandwidth, random_model, step_profile
from .model import Model
from .sampling import Sampling

QWEN3_06B_SHAPE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
SMALL_TARGET = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
SMALL_DRAFT = dict(SMALL_TARGET, num_hidden_layers=2)
SAMPLED = Sampling(temperature=0.6, top_k=20, top_p=0.95)


def _machine() -> dict[str, Any]:
    import jax
    info: dict[str, Any] = {"jax": jax.__version__, "backend": jax.default_backend(),
                            "devices": [str(d) for d in jax.devices()]}
    try:
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
        info["nvidia_smi"] = re.sub(r" \(UUID: [^)]*\)", "", smi).strip()  # the model, not the card's serial
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def matmul_tflops(n: int, reps: int = 10) -> float:
    """bf16 n x n x n matrix products per second, in TFLOP/s (median of reps after a warm-up)."""
    import jax
    import jax.numpy as jnp
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x: x @ x)
    jax.block_until_ready(f(a))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(a))
        times.append(time.perf_counter() - t)
    return 2 * n ** 3 / statistics.median(times) / 1e12


def _run(target: Model, prompts: list[list[int]], spec: Any, sampling: Sampling, n: int) -> dict[str, Any]:
    """One greedy or sampled generate call over `prompts` (one prompt: batch 1), timed."""
    from .loop import generate
    ids: Any = prompts if len(prompts) > 1 else prompts[0]
    t0 = time.perf_counter()
    out = generate(target, ids, max_new_tokens=n, sampling=sampling, stop_ids=(), seed=list(range(len(prompts)))
                   if len(prompts) > 1 else 0, speculative=spec)
    wall = time.perf_counter() - t0
    outs = out if isinstance(out, list) else [out]
    # decoding: from the last row's first token (every prompt prefilled) to the end
    decode = wall - max(o.stats.prefill_s for o in outs)
    return {"wall_s": wall, "decode_s": decode,
            "ms_per_step": 1e3 * decode / max(max(o.stats.steps for o in outs), 1),
            "tokens_per_step": statistics.mean(o.stats.tokens_per_step for o in outs),
            "new_tokens": sum(o.stats.new_tokens for o in outs)}


def _methods(draft: Model, drafter: Any) -> list[tuple[str, Any]]:
    """The proposer settings every exactness check runs."""
    from .adaptive import Adaptive
    from .proposers import DFlashProposer, DraftProposer, NgramProposer
    return [("lookup k=7", NgramProposer(k=7)),
            ("lookup auto", Adaptive(NgramProposer(k=15))),
            ("lookup tree 8", NgramProposer(k=15, tree=8)),
            ("draft k=4", DraftProposer(draft, k=4)),
            ("draft tree 8", DraftProposer(draft, k=7, tree=8)),
            ("dflash k=7", DFlashProposer(drafter, k=7)),
            ("dflash tree 8", DFlashProposer(drafter, k=7, tree=8)),
            ("lookup+dflash", Adaptive(NgramProposer(k=15), DFlashProposer(drafter, k=7)))]


def _differences(ref: list[list[int]], got: list[list[int]]) -> dict[str, Any]:
    """Rows that differ from plain decoding and the first index where each does."""
    first = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), min(len(r), len(g)))
             for r, g in zip(ref, got) if r != g]
    return {"rows": len(ref), "rows_differing": len(first), "first_difference": first}


def _engine_runs(target: Model, spec: Any, prompts: list[list[int]], n: int) -> dict[str, Any]:
    """One engine of len(prompts) rows for `spec`: the prompts together (the first half
    greedy, the rest sampled, seed = index), then the first and the middle prompt each
    alone on it (greedy, sampled), then the batch again, timed. The engine compiles a
    program per row count and greedy / sampled batch as the runs reach them; the alone
    runs and the timed batch reuse them."""
    from .engine import Engine, engine_options, max_len_for
    options, per_request = engine_options(spec)
    engine = Engine(target, **options, max_batch=len(prompts),
                    max_len=max_len_for(target, max(len(p) + n for p in prompts)))
    half = len(prompts) // 2
    samplings = [Sampling()] * half + [SAMPLED] * (len(prompts) - half)

    def run(which: list[int]) -> tuple[list[Any], float]:
        t0 = time.perf_counter()
        reqs = [engine.submit(prompts[i], max_new_tokens=n, sampling=samplings[i], seed=i, stop_ids=(),
                              **per_request) for i in which]
        engine.run()
        return [r.result() for r in reqs], time.perf_counter() - t0

    t0 = time.perf_counter()
    run(list(range(len(prompts))))
    first = time.perf_counter() - t0
    alone = [run([i])[0][0].tokens for i in (0, half)]
    outs, wall = run(list(range(len(prompts))))
    return {"batch": [o.tokens for o in outs], "alone": alone, "first_call_s": first, "wall_s": wall,
            "tokens_per_step": statistics.mean(o.stats.tokens_per_step for o in outs)}


def exactness(target: Model, draft: Model, drafter: Any, prompts: list[list[int]], n: int,
              log: Callable[[str], None], clock: "Clock") -> list[dict[str, Any]]:
    """Every proposer against plain decoding on the same engine geometry: the batch (half
    greedy, half sampled) and two prompts alone (`_engine_runs`)."""
    rows: list[dict[str, Any]] = []
    if clock.out(rows, "plain", log):
        return rows
    plain = _engine_runs(target, None, prompts, n)
    half = len(prompts) // 2
    for name, spec in _methods(draft, drafter):
        if clock.out(rows, name, log):
            continue
        r = _engine_runs(target, spec, prompts, n)
        checks = {"greedy rows of the batch": _differences(plain["batch"][:half], r["batch"][:half]),
                  "sampled rows of the batch": _differences(plain["batch"][half:], r["batch"][half:]),
                  "a greedy and a sampled prompt alone": _differences(plain["alone"], r["alone"])}
        row = {"method": name, "batch": len(prompts), "checks": checks, "tokens_per_step": r["tokens_per_step"],
               "speedup": plain["wall_s"] / r["wall_s"], "first_call_s": r["first_call_s"]}
        rows.append(row)
        log(f"  {name}: " + ", ".join(f"{label} {d['rows_differing']}/{d['rows']}" for label, d in checks.items())
            + f" differ from plain; {row['tokens_per_step']:.2f} tokens/step, {row['speedup']:.2f}x plain "
            "(the batch, prefill included)")
    return rows


def engine_timings(target: Model, draft: Model, drafter: Any, prompts: list[list[int]], n: int,
                   log: Callable[[str], None], clock: "Clock", batches: tuple[int, ...] = (1, 8)
                   ) -> list[dict[str, Any]]:
    """Greedy generate at each batch size: plain and each chain proposer, warm calls."""
    from .proposers import DFlashProposer, DraftProposer, NgramProposer
    methods = [("plain", None), ("lookup k=7", NgramProposer(k=7)), ("dflash k=7", DFlashProposer(drafter, k=7)),
               ("draft k=4", DraftProposer(draft, k=4))]
    rows: list[dict[str, Any]] = []
    for batch in (prompts[:b] for b in batches):
        for name, spec in methods:
            if clock.out(rows, f"batch {len(batch)} {name}", log):
                continue
            t0 = time.perf_counter()
            _run(target, batch, spec, Sampling(), n)
            first = time.perf_counter() - t0
            r = _run(target, batch, spec, Sampling(), n)
            row = {"batch": len(batch), "method": name, "first_call_s": first, "wall_s": r["wall_s"],
                   "decode_s": r["decode_s"], "tok_s": r["new_tokens"] / r["wall_s"],
                   "decode_tok_s": (r["new_tokens"] - len(batch)) / r["decode_s"],
                   "ms_per_step": r["ms_per_step"], "tokens_per_step": r["tokens_per_step"]}
            rows.append(row)
            log(f"  batch {len(batch)} {name}: {row['tok_s']:.0f} tok/s with prefill, {row['decode_tok_s']:.0f} "
                f"decoding, {row['ms_per_step']:.2f} ms/step, "
                f"{row['tokens_per_step']:.2f} tokens/step (first call {first:.1f} s)")
    return rows


class Clock:
    """The run's deadline: work units past it are recorded as skipped, not started."""

    def __init__(self, budget_s: float, unit_s: float):
        self.end, self.unit_s = time.perf_counter() + budget_s, unit_s

    def out(self, rows: list[dict[str, Any]], what: str, log: Callable[[str], None]) -> bool:
        if time.perf_counter() + self.unit_s < self.end:
            return False
        rows.append({"skipped": what})
        log(f"  skipped (out of time): {what}")
        return True


def _shipped(dtype: str) -> tuple[Model, Model, Any, list[list[int]]]:
    from .dflash import load_dflash
    from .model import load
    from .workloads import workload
    root = Path(__file__).resolve().parent.parent / "checkpoints"
    target = load(root / "tiny-code", dtype=dtype)
    draft = load(root / "tiny-code-draft", dtype=dtype)
    drafter = load_dflash(root / "tiny-code-dflash", target)
    prompts = [p.ids for kind in ("edit", "complete") for p in workload(target.tokenizer, kind, 4, 256)]
    return target, draft, drafter, prompts


def _random(small: bool) -> tuple[Model, Model, Any, list[list[int]]]:
    import jax
    from . import dflash
    target = random_model(SMALL_TARGET if small else QWEN3_4B_SHAPE, "bfloat16")
    draft = random_model(SMALL_DRAFT if small else QWEN3_06B_SHAPE, "bfloat16")
    drafter = dflash.init(target.config, jax.random.key(1), num_layers=2 if small else 5, dtype="bfloat16")
    rng = np.random.default_rng(0)
    # half of each prompt repeats, so prompt lookup finds matches to draft from
    half = [rng.integers(0, target.config.vocab_size, 128).tolist() for _ in range(8)]
    return target, draft, drafter, [h + h for h in half]


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' results as one (a lease is short, so a run may --skip what an earlier
    one measured): each stage from the last run that has it, and in row stages each row a
    later run measured replaces the same row skipped earlier."""
    out: dict[str, Any] = {"machine": runs[0]["machine"], "stage_s": {}}
    for run in runs:
        for name, value in run.items():
            if name in ("machine", "stage_s"):
                continue
            out["stage_s"][name] = out["stage_s"].get(name, 0.0) + run["stage_s"].get(name, 0.0)
            if isinstance(value, list) and isinstance(out.get(name), list):
                done = {_row_key(r) for r in value if "skipped" not in r}
                value = [r for r in out[name] if "skipped" not in r and _row_key(r) not in done] + \
                    [r for r in value if "skipped" not in r] + [r for r in value if "skipped" in r]
            out[name] = value
    return out


def _row_key(row: dict[str, Any]) -> tuple:
    return row["batch"], row["method"]


def _cell(d: dict[str, Any]) -> str:
    where = f" (at {', '.join(map(str, d['first_difference']))})" if d["first_difference"] else ""
    return f"{d['rows_differing']} of {d['rows']}{where}"


def markdown(results: dict[str, Any]) -> str:
    """The results as tables."""
    m = results["machine"]
    lines = [f"# specjax on {m.get('nvidia_smi') or m['devices']}", "",
             f"jax {m['jax']} ({m['backend']}). Stage times (s): "
             + ", ".join(f"{k} {v:.0f}" for k, v in results["stage_s"].items()), ""]
    if "copy_gb_s" in results.get("rates", {}):
        r = results["rates"]
        lines += [f"Copy bandwidth {r['copy_gb_s']:.0f} GB/s; bf16 matrix product {r['bf16_tflops']:.0f} TFLOP/s.", ""]
    p = results.get("profile", {})
    if "ms" in p:
        lines += ["## Qwen3-4B shape, bf16, random weights: one verify step at the end of a "
                  f"{p['context']}-token cache", "",
                  "| T | ms (median) | over T=1 |", "| --- | --- | --- |"]
        lines += [f"| {t} | {v['median']:.2f} | {p['ratio_to_T1'][t]:.2f} |" for t, v in p["ms"].items()]
        lines += ["", f"Weights {p['weight_bytes'] / 1e9:.2f} GB; bandwidth measured with the steps "
                  f"{p['bandwidth_GBps']:.0f} GB/s; decode step alone {p['decode_ms']:.2f} ms, a token of a "
                  f"fused 16-round engine call {p['run_ms_per_token']:.2f} ms.", ""]
    engine = [r for k in ("engine-b1", "engine-b8") for r in results.get(k, []) if isinstance(r, dict)]
    if engine:
        lines += ["## The engine on the Qwen3-4B shape (greedy, random weights: drafts are rejected)", "",
                  "| batch | method | tok/s with prefill | tok/s decoding | ms/step | tokens/step | first call s |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['batch']} | {r['method']} | {r['tok_s']:.0f} | {r['decode_tok_s']:.0f} | "
                  f"{r['ms_per_step']:.2f} | {r['tokens_per_step']:.2f} | {r['first_call_s']:.0f} |"
                  for r in engine if "skipped" not in r]
        lines.append("")
    for key in sorted(k for k in results if k.startswith("exact-")):
        rows = [r for r in results[key] if isinstance(r, dict) and "skipped" not in r]
        if not rows:
            continue
        lines += [f"## Exactness on the shipped models ({key[6:]}): speculative against plain decoding", "",
                  "Rows whose tokens differ from plain decoding's (where each first differs).", "",
                  "| method | engine rows | " + " | ".join(rows[0]["checks"]) + " | tokens/step | speed over plain |",
                  "| --- | --- | " + "--- | " * len(rows[0]["checks"]) + "--- | --- |"]
        lines += [f"| {r['method']} | {r['batch']} | " + " | ".join(_cell(d) for d in r["checks"].values())
                  + f" | {r['tokens_per_step']:.2f} | {r['speedup']:.2f}x |" for r in rows]
        lines.append("")
    skipped = [f"{k} {r['skipped']}" for k, v in results.items() if isinstance(v, list) for r in v
               if isinstance(r, dict) and "skipped" in r]
    errors = [f"{k}: {v['error']}" for k, v in results.items() if isinstance(v, dict) and "error" in v]
    if skipped or errors:
        lines += ["Not measured: " + "; ".join(errors + [f"{s} (out of time)" for s in skipped]) + ".", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--report", type=Path, nargs="+", metavar="JSON",
                    help="instead: merge these runs' accelerator.json into DIR/accelerator.{json,md}")
    ap.add_argument("--small", action="store_true", help="tiny random shapes in place of Qwen3-4B's")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting work after this many seconds")
    ap.add_argument("--unit-s", type=float, default=20.0, help="the time one unit of work is allowed to need")
    ap.add_argument("--skip", nargs="*", default=(), help="stages to leave out")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report:
        merged = merge([json.loads(f.read_text()) for f in args.report])
        (args.out / "accelerator.json").write_text(json.dumps(merged, indent=1))
        (args.out / "accelerator.md").write_text(markdown(merged))
        return
    clock = Clock(args.budget_s, args.unit_s)
    results: dict[str, Any] = {"machine": _machine(), "stage_s": {}}
    path = args.out / "accelerator.json"

    def log(line: str) -> None:
        print(line, flush=True)

    def stage(name: str, fn: Callable[[], Any]) -> None:
        if name in args.skip:
            return
        log(f"[{name}]")
        t0 = time.perf_counter()
        if clock.out(skipped := [], "the whole stage", log):
            results[name] = skipped
        else:
            try:
                results[name] = fn()
            except Exception as e:  # a failed stage is a result too; the next stages still run
                results[name] = {"error": f"{type(e).__name__}: {e}"}
                log(f"  FAILED: {results[name]['error']}")
        results["stage_s"][name] = time.perf_counter() - t0
        path.write_text(json.dumps(results, indent=1, default=str))
        (args.out / "accelerator.md").write_text(markdown(results))

    log(json.dumps(results["machine"]))
    n = args.new_tokens
    stage("rates", lambda: {"copy_gb_s": measure_bandwidth(),
                            "bf16_tflops": matmul_tflops(512 if args.small else 8192)})
    big: list[Any] = []

    def profile() -> dict[str, Any]:
        big.extend(_random(args.small))
        return step_profile(big[0], (1, 4, 8, 16), context=1024, rounds=5)
    stage("profile", profile)
    stage("engine-b1", lambda: engine_timings(*(big or _random(args.small)), n, log, clock, (1,)))
    big.clear()  # the Qwen3-4B-shaped models leave the device before the shipped ones load
    stage("exact-bf16", lambda: exactness(*_shipped("bfloat16"), n, log, clock))
    stage("engine-b8", lambda: engine_timings(*_random(args.small), n, log, clock, (8,)))
    stage("exact-f32", lambda: exactness(*_shipped("float32"), n, log, clock))
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
