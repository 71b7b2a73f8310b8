"""llama.cpp in `specjax bench --llamacpp DIR`: the checkpoint converted to GGUF by llama.cpp's
own converter (in the source tree DIR), llama.cpp's plain and prompt-lookup decoding timed
on the token ids specjax's rows get, and a check that its greedy tokens on the f32 file
equal specjax's.

llama.cpp runs through llama-cpp-python (`llama_cpp`), an optional dependency best built
natively (README.md, "llama.cpp in the benchmark"); it is imported only when asked for.
Its rows are timed as specjax's are: tokens after the first over the time after prefill.
Both engines use the same threads: specjax's kernels split their work over XLA:CPU's
intra-op pool (`csrc/parallel.h`), one thread per CPU the process may run on, and
llama.cpp is given that many (`threads`).
"""

from __future__ import annotations

import hashlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from .errors import SpecjaxError

GGUF_TYPES = ("f32", "bf16", "f16", "q8_0")  # the converter's --outtype values the bench takes
README = 'README.md, section "llama.cpp in the benchmark"'
CONVERTER = "convert_hf_to_gguf.py"
TAIL_LINES = 25  # of a failed conversion's output, in the error


class LlamacppError(SpecjaxError):
    """`bench --llamacpp` cannot run: llama_cpp missing, no converter, a failed conversion."""


def require() -> Any:
    """The `llama_cpp` module, or a LlamacppError saying how to build it."""
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # noqa: F401 (checked here)
    except ImportError as e:
        raise LlamacppError(f"--llamacpp needs llama-cpp-python, and `import llama_cpp` failed ({e}); build it "
                            f"natively as {README} says") from None
    return llama_cpp


def converter(source: Path) -> Path:
    """llama.cpp's convert_hf_to_gguf.py in the source tree `source` (a checkout, or the
    vendor/llama.cpp folder of llama-cpp-python's sdist)."""
    hint = (f"give the root of a llama.cpp source tree, which holds {CONVERTER} and gguf-py/ (a checkout, or "
            f"vendor/llama.cpp in llama-cpp-python's unpacked sdist; {README})")
    if not source.is_dir():
        raise LlamacppError(f"--llamacpp {source}: not a directory; {hint}")
    script = source / CONVERTER
    if not script.is_file():
        raise LlamacppError(f"--llamacpp {source}: no {CONVERTER} there; {hint}")
    return script


def threads() -> int:
    """The threads both engines run on: the CPUs this process may use (XLA:CPU's intra-op
    pool, which specjax's kernels use, has one thread per CPU)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_cache() -> Path:
    """Where converted files are kept: beside specjax's other caches (~/.cache/specjax, or
    the folder holding $SPECJAX_CACHE_DIR), in gguf/."""
    env = os.environ.get("SPECJAX_CACHE_DIR")
    base = Path(env).parent if env and env != "off" else Path.home() / ".cache" / "specjax"
    return base / "gguf"


def checkpoint_digest(folder: Path) -> str:
    """A digest of the names and contents of the folder's files (hidden ones left out): a
    converted file's cache key, with its type."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0")
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def convert(source: Path, model: Path, gguf_type: str, cache: Path, log: Callable[[str], None] = print) -> Path:
    """The GGUF file of `model` in `gguf_type`, converted by the converter in `source`
    (`specjax.llamacpp_convert`, in a subprocess) unless `cache` has it for this content."""
    if gguf_type not in GGUF_TYPES:
        raise LlamacppError(f"GGUF type {gguf_type!r}: choose from {', '.join(GGUF_TYPES)}")
    script = converter(source)
    path = cache / f"{model.name}-{checkpoint_digest(model)}-{gguf_type}.gguf"
    if path.is_file():
        log(f"llama.cpp: {gguf_type} GGUF of {model} cached at {path}")
        return path
    cache.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + f".{os.getpid()}.part")
    log(f"llama.cpp: converting {model} to {gguf_type} GGUF with {script} ...")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "specjax.llamacpp_convert", str(source), str(model), gguf_type,
                           str(partial)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        tail = "\n".join(done.stdout.splitlines()[-TAIL_LINES:])
        raise LlamacppError(f"--llamacpp {source}: {CONVERTER} failed on {model} (--outtype {gguf_type}, exit "
                            f"{done.returncode}); the end of its output:\n{tail}")
    os.replace(partial, path)  # whole or not at all: a stopped conversion leaves no file a rerun would take
    log(f"llama.cpp: wrote {path} ({path.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - start:.0f} s")
    return path


def key(gguf_type: str, k: int) -> str:
    """The bench's row key of llama.cpp's plain decoding (k = 0) or prompt lookup of k drafts."""
    return f"llamacpp-plain@{gguf_type}:0" if k == 0 else f"llamacpp-lookup@{gguf_type}:{k}"


def partner(row: str, tags: dict[str, str | None]) -> str | None:
    """The specjax row a llama.cpp row (`key`) is timed next to, so that the two share the
    machine's state of the moment: plain decoding on the same weights next to llama.cpp's
    plain decoding, prompt lookup next to its lookup. `tags`: each GGUF type's tag of
    specjax's rows on those weights (`summarise`). None for a type specjax has no weights
    for, and for a row that is not llama.cpp's."""
    name, _, k = row.partition(":")
    method, _, gguf_type = name.partition("@")
    if method not in ("llamacpp-plain", "llamacpp-lookup") or tags.get(gguf_type) is None:
        return None
    return f"{method.removeprefix('llamacpp-')}{tags[gguf_type]}:0"


def cache_type(gguf_type: str) -> str:
    """The KV cache llama.cpp runs a file of this type with: f32 for the f32 file, as
    specjax's f32 rows keep theirs (llama.cpp's default f16 cache would round keys and
    values, and the greedy check compares tokens exactly); llama.cpp's default, f16, for
    the others."""
    return "f32" if gguf_type == "f32" else "f16"


class Runner:
    """llama.cpp's greedy decoding of one GGUF file, plain or with its prompt lookup
    (`llama_cpp.llama_speculative.LlamaPromptLookupDecoding`, n-grams of up to 2 tokens,
    its default), given token ids, with the KV cache `cache_type` names."""

    def __init__(self, path: Path, gguf_type: str, n_ctx: int, n_threads: int):
        llama_cpp = require()
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self._prompt_lookup = LlamaPromptLookupDecoding
        f32 = cache_type(gguf_type) == "f32"
        cache = dict(type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32) if f32 else {}
        common = dict(n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads, verbose=False, **cache)
        self.plain = llama_cpp.Llama(str(path), **common)
        # logits_all: the lookup loop samples at every drafted position. llama-cpp-python
        # turns it on itself when given a draft model, but sizes its logits buffer by the
        # argument, n_batch rows, which a prompt longer than n_batch overruns.
        self.lookup = llama_cpp.Llama(str(path), logits_all=True, draft_model=LlamaPromptLookupDecoding(), **common)

    def run(self, ids: list[int], n: int, k: int) -> dict[str, Any]:
        """n greedy tokens after `ids`, plain (k = 0) or with prompt lookup of k drafts:
        tokens, decode tok/s and seconds (after the first token, as specjax's rows)."""
        llm = self.plain
        if k:
            llm = self.lookup
            llm.draft_model = self._prompt_lookup(num_pred_tokens=k)
        llm.reset()  # a full prefill: generate() would otherwise reuse the cache of an equal prompt prefix
        tokens: list[int] = []
        first = end = time.perf_counter()
        stream = llm.generate(ids, temp=0.0, repeat_penalty=1.0)  # temp 0: llama.cpp's greedy sampler alone
        for token in stream:
            end = time.perf_counter()
            if not tokens:
                first = end
            tokens.append(int(token))
            if len(tokens) == n:
                break
        stream.close()
        decode_s = end - first
        return {"tokens": tokens, "tok_s": (n - 1) / decode_s if decode_s > 0 else 0.0, "decode_s": decode_s,
                "stats": {"new_tokens": len(tokens)}}


# ---------------------------------------------------------------- the comparison

def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (a length counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _paired(base: list[dict], runs: list[dict]) -> float:
    """Median over rounds of base's decode time over runs': runs' speed relative to base."""
    ratios = [b["decode_s"] / r["decode_s"] for b, r in zip(base, runs) if r["decode_s"] > 0]
    return statistics.median(ratios) if ratios else 0.0


def _median_tok_s(runs: list[dict]) -> float:
    return statistics.median(r["tok_s"] for r in runs)


def _best(runs: dict[str, list[dict]], keys: list[str]) -> str | None:
    return max(keys, key=lambda k: _median_tok_s(runs[k]), default=None)


def _weights_tag(row: str) -> str:
    """'lookup@f32:0' -> '@f32'; '' for a row on the loaded model's weights."""
    name = row.partition(":")[0]
    return "@" + name.partition("@")[2] if "@" in name else ""


def summarise(workload: str, runs: dict[str, list[dict]], ours: dict[str, str | None]) -> dict[str, Any]:
    """A greedy cell's comparison. `ours` maps each GGUF type to the tag of specjax's rows
    on the same weights ("" for the loaded model's own, "@f32" for `plain@f32`, ...; None
    where specjax has no such weights). Per type: llama.cpp's plain and best lookup row,
    specjax's plain, lookup and best speculative row, each with its tok/s and its speed
    against llama.cpp's plain decoding on those weights. Then the f32 greedy check, and the
    goals' ratios: specjax plain over llama.cpp plain per type, and specjax's fastest
    speculative row over llama.cpp's (on any weights)."""
    rows, plain_ratio, weights = [], {}, {}
    for t, tag in ours.items():
        base = runs[key(t, 0)]
        lookups = [k for k in runs if k.startswith(f"llamacpp-lookup@{t}:")]
        entries = [("llama.cpp", key(t, 0)), ("llama.cpp", _best(runs, lookups))]
        weights.update({k: t for k in lookups})
        reference = None
        if tag is not None:
            reference = runs[f"plain{tag}:0"]
            spec = [k for k in runs if not k.startswith(("hf-", "llamacpp-", "plain")) and _weights_tag(k) == tag]
            weights.update({k: t for k in spec})
            entries += [("specjax", f"plain{tag}:0"), ("specjax", f"lookup{tag}:0")]
            best = _best(runs, spec)
            if best != f"lookup{tag}:0":
                entries.append(("specjax", best))
            plain_ratio[t] = _paired(base, reference)
        for engine, row in entries:
            if row is None:
                continue
            name, k = row.split(":")
            rows.append({"engine": engine, "weights": t, "method": name.partition("@")[0].removeprefix("llamacpp-"),
                         "k": int(k), "key": row, "tok_s": _median_tok_s(runs[row]),
                         "vs_llamacpp_plain": _paired(base, runs[row]),
                         "same_tokens_as_specjax_plain": None if reference is None else all(
                             r["tokens"] == p["tokens"] for r, p in zip(runs[row], reference)),
                         "same_tokens_as_llamacpp_plain": all(
                             r["tokens"] == p["tokens"] for r, p in zip(runs[row], base))})
    out: dict[str, Any] = {"workload": workload, "rows": rows, "plain_ratio": plain_ratio}
    best_ours = _best(runs, [k for k in weights if not k.startswith("llamacpp-")])
    best_llama = _best(runs, [k for k in weights if k.startswith("llamacpp-")])
    if best_ours and best_llama:
        out["speculative"] = {"specjax": best_ours, "specjax_weights": weights[best_ours], "llamacpp": best_llama,
                              "llamacpp_weights": weights[best_llama],
                              "ratio": _paired(runs[best_llama], runs[best_ours])}
    if ours.get("f32") is not None:
        out["check"] = check(runs[key("f32", 0)], runs[f"plain{ours['f32']}:0"])
    return out


def check(llama: list[dict], ours: list[dict]) -> dict[str, Any]:
    """llama.cpp's greedy tokens on the f32 file against specjax's plain f32 decoding, run
    by run: passed, the runs compared, and each mismatch's run, first differing position
    and the two tokens there."""
    mismatches = []
    for i, (a, b) in enumerate(zip(ours, llama)):
        pos = first_difference(a["tokens"], b["tokens"])
        if pos is not None:
            at = lambda ts: ts[pos] if pos < len(ts) else None
            mismatches.append({"run": i, "position": pos, "specjax": at(a["tokens"]), "llamacpp": at(b["tokens"])})
    return {"passed": not mismatches and len(ours) == len(llama) > 0, "runs": len(ours),
            "tokens": len(ours[0]["tokens"]) if ours else 0, "mismatches": mismatches}


# ---------------------------------------------------------------- the table

def markdown(results: dict[str, Any]) -> str:
    """The results' llama.cpp section: a row per engine, weights and method of each greedy
    cell, the f32 greedy check and the goals."""
    info = results["llamacpp"]
    cells = [c for c in results["cells"] if "llamacpp" in c]
    lines = ["", "### llama.cpp in the same run", "",
             f"llama.cpp through llama-cpp-python {info['version']} on GGUF files made by llama.cpp's converter "
             f"from this checkpoint, {_threads(info)}; greedy, the same token ids to "
             "both, decode tok/s after prefill (medians over runs). Each llama.cpp row runs beside specjax's row of "
             "its kind on its weights, after it in odd runs and before it in even ones. `vs llama.cpp plain` is "
             "the median of per-run speed ratios against llama.cpp's plain decoding on the same weights. "
             "specjax's q8_0 row is its int8 weights (`load(dtype=\"int8\")`: llama.cpp's q8_0 blocks, and activations quantized to q8_0 blocks as llama.cpp's are, with float32 scales). "
             + _caches(info["caches"]), "",
             "| workload | weights | engine | method | tok/s | vs llama.cpp plain | tokens = specjax plain |",
             "|---|---|---|---|---|---|---|"]
    yes = {True: "yes", False: "no", None: "–"}
    for c in cells:
        for r in c["llamacpp"]["rows"]:
            method = r["method"] + (f" (k={r['k']})" if r["k"] else "")
            lines.append(f"| {c['workload']} | {r['weights']} | {r['engine']} | {method} | {r['tok_s']:.0f} | "
                         f"{r['vs_llamacpp_plain']:.2f}x | {yes[r['same_tokens_as_specjax_plain']]} |")
    lines.append("")
    checks = [(c["workload"], c["llamacpp"]["check"]) for c in cells if "check" in c["llamacpp"]]
    if not checks:
        lines.append("f32 greedy check: not run (no f32 file in `--llamacpp-types`).")
    elif all(ch["passed"] for _, ch in checks):
        runs = sum(ch["runs"] for _, ch in checks)
        lines.append(f"f32 greedy check: **passed**: llama.cpp's greedy tokens on the f32 file equal specjax's in "
                     f"{runs} of {runs} timed runs ({checks[0][1]['tokens']} tokens each).")
    else:
        bad = [f"{w} run {m['run']} first differs at token {m['position']} (specjax {m['specjax']}, llama.cpp "
               f"{m['llamacpp']})" for w, ch in checks for m in ch["mismatches"]]
        bad += [f"{w}: nothing compared" for w, ch in checks if not ch["runs"]]
        lines.append("f32 greedy check: **FAILED**: " + "; ".join(bad) + ".")
    lines.append("")
    met = lambda ok: "met" if ok else "not met"
    for c in cells:
        lc = c["llamacpp"]
        plain = ", ".join(f"{t} {r:.2f}x ({met(r >= 1.0)})" for t, r in lc["plain_ratio"].items())
        line = f"Goals, {c['workload']}: specjax plain over llama.cpp plain on the same weights: {plain or '–'}"
        if "speculative" in lc:
            s = lc["speculative"]
            goal = f"; {met(s['ratio'] >= 1.5)} (goal 1.5x)" if c["workload"] == "edit" else ""
            line += (f"; specjax's fastest speculative row ({_label(s['specjax'], s['specjax_weights'])}) over "
                     f"llama.cpp's ({_label(s['llamacpp'], s['llamacpp_weights'])}): {s['ratio']:.2f}x{goal}")
        lines.append(line + ".")
    return "\n".join(lines) + "\n"


def _caches(caches: dict[str, dict[str, str | None]]) -> str:
    """The sentence naming each engine's KV cache dtype for each weight type."""
    each = lambda engine: ", ".join(f"{c[engine]} with {t} weights" for t, c in caches.items() if c[engine])
    return f"KV caches: llama.cpp {each('llamacpp')}; specjax {each('specjax')} (`--kv-dtype`)."


def _threads(info: dict[str, Any]) -> str:
    if info["threads"] == info["specjax_threads"]:
        return f"{info['threads']} threads for both engines"
    n = info["threads"]
    return f"llama.cpp on {n} thread{'s' * (n != 1)} (`--llamacpp-threads`), specjax on {info['specjax_threads']}"


def _label(row: str, weights: str) -> str:
    """('dflash:7', 'bf16') -> 'dflash k=7 on bf16'."""
    name, k = row.split(":")
    return name.partition("@")[0].removeprefix("llamacpp-") + (f" k={k}" if k != "0" else "") + f" on {weights}"
