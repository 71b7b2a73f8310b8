"""`specjax bench`: speedup of each proposer and k, side by side with transformers.

Every figure is measured in one process with interleaved runs: for each prompt and
repetition all methods run back to back, and speedups are medians of per-round ratios
against our plain decoding in the same round (the machine is shared and noisy). Warm-up
runs (compilation) are excluded. Decode throughput counts tokens after the first over the
time after prefill, for us and for transformers alike.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import llamacpp
from .adaptive import Adaptive
from .checkpoint import weight_bytes
from .dflash import MARKOV
from .loop import generate
from .model import Model, load
from .proposers import DraftProposer, NgramProposer
from .sampling import Sampling
from .workloads import WORKLOADS, benchmark_prompts

TREE_PROPOSERS = ("lookup", "draft", "dflash")  # the proposers that draft trees
SAMPLINGS = {"greedy": Sampling(), "sampled": Sampling(temperature=0.6, top_k=20, top_p=0.95)}


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    model: Path
    draft: Path | None = None
    dflash: Path | None = None
    workloads: tuple[str, ...] = WORKLOADS
    samplings: tuple[str, ...] = ("greedy", "sampled")
    prompts: int = 2
    prompt_tokens: int = 880
    new_tokens: int = 128
    reps: int = 3
    ngram_ks: tuple[int, ...] = (2, 4, 7, 15)
    draft_ks: tuple[int, ...] = (1, 2, 3, 4, 7)
    dflash_ks: tuple[int, ...] = (4, 7, 15)
    # proposers that also get a tree row (a node budget as wide as their chain's drafts) and
    # an "auto" row (the tree or the chain each round, whichever has held deeper)
    trees: tuple[str, ...] = TREE_PROPOSERS
    profile_ts: tuple[int, ...] = tuple(range(1, 17))
    hf: bool = True
    profile: bool = True  # time the step profiles after the cells (this model's; the S config's with s_profile)
    s_profile: bool = True  # also time the S config's steps, bf16 / f32 / int8 matrices (CPU; ~3 min)
    out: Path = Path("bench-results")
    # llama.cpp in the same run (`specjax.llamacpp`): its source tree (the converter), the
    # GGUF types to convert to, its prompt-lookup draft lengths, the converted files' cache
    # (default `llamacpp.default_cache()`)
    llamacpp: Path | None = None
    gguf_types: tuple[str, ...] = ("f32", "bf16", "q8_0")
    llamacpp_ks: tuple[int, ...] = (2, 4, 7, 10, 15)
    gguf_cache: Path | None = None
    llamacpp_threads: int | None = None  # default: as many as specjax's kernels use (`llamacpp.threads`)
    kv_dtype: str | None = None  # specjax's KV caches (`specjax.load`; None: the compute dtype)

    @classmethod
    def quick(cls, **kw) -> "BenchConfig":
        """One prompt, one repetition, fewer k: about ten minutes on two CPU cores."""
        base = dict(prompts=1, reps=1, ngram_ks=(2, 7), draft_ks=(2, 4), dflash_ks=(7, 15), new_tokens=96,
                    profile_ts=(1, 2, 4, 8, 16), llamacpp_ks=(4, 10))
        base.update(kw)
        return cls(**base)


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else {}


def _rss_mb() -> float:
    import psutil
    return psutil.Process().memory_info().rss / 2**20


# ---------------------------------------------------------------- our methods

def _methods(cfg: BenchConfig, target: Model) -> list[tuple[str, int, Any]]:
    """(method, k, proposer) rows; plain first. A proposer named in cfg.trees also gets
    "<name>-tree" (trees of as many nodes as its chain has drafts) and "<name>-auto" rows
    (the chooser's pick of tree or chain per round) at the k of its largest chain."""
    for name in cfg.trees:
        if name not in TREE_PROPOSERS:
            raise ValueError(f"trees: {name!r} is not one of {', '.join(TREE_PROPOSERS)}")

    def shapes(name: str, k: int, make: Callable[[int | str], Any]) -> list[tuple[str, int, Any]]:
        if name not in cfg.trees:
            return []
        return [(f"{name}-tree", k, make(k)), (f"{name}-auto", k, make("auto"))]

    rows: list[tuple[str, int, Any]] = [("plain", 0, None)]
    rows += [("ngram", k, NgramProposer(k=k)) for k in cfg.ngram_ks]
    top = max(cfg.ngram_ks)
    rows.append(("lookup", 0, Adaptive(NgramProposer(k=top))))  # what `specjax generate` runs on CPU
    rows += [(m, 0, p) for m, _, p in shapes("lookup", top, lambda t: Adaptive(NgramProposer(k=top, tree=t)))]
    pool = [NgramProposer(k=top)]
    if cfg.draft is not None:
        draft = load(cfg.draft, target.dtype)
        rows += [("draft", k, DraftProposer(draft, k=k)) for k in cfg.draft_ks]
        top_d = max(cfg.draft_ks)
        rows += shapes("draft", top_d, lambda t: DraftProposer(draft, k=top_d, tree=t))  # EAGLE-2's best tree
        pool.append(DraftProposer(draft, k=top_d))
    if cfg.dflash is not None:
        from .dflash import load_dflash
        from .proposers import DFlashProposer
        drafter = load_dflash(cfg.dflash, target)
        # k up to the drafter's block (its default, the largest k, is always measured)
        ks = sorted({k for k in cfg.dflash_ks if k < drafter.config.block_size} | {DFlashProposer(drafter).k})
        rows += [("dflash", k, DFlashProposer(drafter, k=k)) for k in ks]
        # the block's best tree (DDTree, `specjax.drafters.block_tree`)
        rows += shapes("dflash", ks[-1], lambda t: DFlashProposer(drafter, k=ks[-1], tree=t))
        if MARKOV in drafter.params:  # the same drafter without its Markov head, at the largest k
            unary = dataclasses.replace(drafter, params={n: w for n, w in drafter.params.items() if n != MARKOV})
            rows.append(("dflash-unary", ks[-1], DFlashProposer(unary, k=ks[-1])))
        pool.append(DFlashProposer(drafter, k=ks[-1]))
    rows.append(("adaptive", 0, Adaptive(*pool)))
    return rows


def run_order(keys: list[str], partners: dict[str, str], rep: int) -> list[str]:
    """The order in which one rep runs a cell's rows `keys`: each row of `partners` (a
    llama.cpp row -> the specjax row it is compared with, `llamacpp.partner`) right after
    that row on odd reps and right before it on even ones, so that the machine's drift
    between the two cancels over the reps instead of favouring one engine; the others as
    listed. A partner that is not in `keys` leaves its rows where they are."""
    with_partner = {key for key, p in partners.items() if p in keys}
    order = []
    for key in keys:
        if key in with_partner:
            continue
        group = [key] + [row for row in keys if row in with_partner and partners[row] == key]
        order += group if rep % 2 else group[1:] + group[:1]
    return order


def _greedy_row(row: Callable[[list[int], int], dict[str, Any]], ids: list[int], seed: int, n: int
                ) -> dict[str, Any]:
    """A greedy-only row (`_llamacpp`'s run(ids, n)) called as the cell's rows are."""
    return row(ids, n)


def _ours(target: Model, proposer: Any, ids: list[int], n: int, sampling: Sampling, seed: int) -> dict[str, Any]:
    res = generate(target, ids, max_new_tokens=n, sampling=sampling, seed=seed, speculative=proposer, stop_ids=())
    s = res.stats
    return {"tokens": res.tokens, "tok_s": s.tokens_per_s, "decode_s": s.decode_s, "stats": s.summary()}


# ---------------------------------------------------------------- llama.cpp

GGUF_NAMES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def _matrix_storage(model: Model) -> str:
    """The GGUF name of what the loaded model's matrices are stored in (f32, bf16, f16)."""
    import jax
    from .cpu_kernels import Packed

    leaves = jax.tree.leaves(model.params, is_leaf=lambda x: isinstance(x, Packed))
    stored = next(x.stored if isinstance(x, Packed) else x.dtype for x in leaves if isinstance(x, Packed) or x.ndim == 2)
    return GGUF_NAMES[np.dtype(stored).name]


Row = Callable[[list[int], int], dict[str, Any]]


def _llamacpp(cfg: BenchConfig, target: Model, llama_cpp: Any, log: Callable[[str], None]
              ) -> tuple[list[tuple[str, Row]], dict[str, str | None], dict[str, Any]]:
    """The greedy rows `--llamacpp` adds to a cell, as (row key, run(ids, n)): llama.cpp's
    plain decoding and prompt lookup (each k) on each GGUF type, and specjax's plain
    decoding and lookup on the same weights where the loaded model's are others (f32
    widened at load, int8 quantized at load for q8_0). Also each type's tag of specjax's
    rows ("" for the loaded model's own, None where specjax has no such weights: a 16-bit
    type the checkpoint is not stored in) and the run's llama.cpp facts. `llama_cpp`: the
    llama-cpp-python module (`llamacpp.require`)."""
    cache = cfg.gguf_cache or llamacpp.default_cache()
    files = {t: llamacpp.convert(cfg.llamacpp, cfg.model, t, cache, log) for t in cfg.gguf_types}
    n_threads = cfg.llamacpp_threads or llamacpp.threads()
    # room for the prompt, the new tokens and a last step's drafts, within the model's context
    n_ctx = min(cfg.prompt_tokens + cfg.new_tokens + max(cfg.llamacpp_ks, default=0) + 1,
                target.config.max_position_embeddings)
    own = _matrix_storage(target)
    greedy = dict(sampling=SAMPLINGS["greedy"], seed=0)
    rows: list[tuple[str, Row]] = []
    tags: dict[str, str | None] = {}
    caches: dict[str, dict[str, str | None]] = {}  # each type's KV cache dtype in each engine
    for t in cfg.gguf_types:
        tags[t] = "" if t == own else f"@{t}" if t in ("f32", "q8_0") else None
        model = target
        if tags[t]:
            # the f32 rows keep float32 keys and values whatever --kv-dtype says: the greedy check
            # compares their tokens with llama.cpp's on the f32 file, whose cache is f32
            model = load(cfg.model, "float32" if t == "f32" else "int8", kv_dtype=None if t == "f32" else cfg.kv_dtype)
            lookup = Adaptive(NgramProposer(k=max(cfg.ngram_ks)))  # as the `lookup` row
            rows += [(f"plain@{t}:0", functools.partial(_ours, model, None, **greedy)),
                     (f"lookup@{t}:0", functools.partial(_ours, model, lookup, **greedy))]
        caches[t] = {"llamacpp": llamacpp.cache_type(t),
                     "specjax": None if tags[t] is None else GGUF_NAMES[np.dtype(model.cache_dtype).name]}
        runner = llamacpp.Runner(files[t], t, n_ctx, n_threads)
        rows += [(llamacpp.key(t, k), functools.partial(runner.run, k=k)) for k in (0, *cfg.llamacpp_ks)]
    info = {"version": llama_cpp.__version__, "source": str(cfg.llamacpp), "threads": n_threads,
            "specjax_threads": llamacpp.threads(), "n_ctx": n_ctx, "caches": caches,
            "files": {t: {"path": str(p), "bytes": p.stat().st_size} for t, p in files.items()}}
    log(f"llama.cpp: llama-cpp-python {info['version']}, {n_threads} threads (specjax's: {info['specjax_threads']}), types "
        + ", ".join(cfg.gguf_types))
    return rows, tags, info


# ---------------------------------------------------------------- transformers

class _FirstStep:
    """A StoppingCriteria that records when generation got past prefill (and at what length)."""

    def __init__(self):
        self.t, self.length = None, None

    def __call__(self, input_ids, scores, **kwargs):
        import torch
        if self.t is None:
            self.t, self.length = time.perf_counter(), input_ids.shape[1]
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _hf_runner(cfg: BenchConfig) -> Callable | None:
    if not cfg.hf:
        return None
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteriaList

    torch.set_grad_enabled(False)
    ref = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).eval()
    assistant = AutoModelForCausalLM.from_pretrained(cfg.draft, dtype=torch.float32).eval() if cfg.draft else None

    def run(method: str, ids: list[int], n: int, sampling: Sampling, seed: int) -> dict[str, Any]:
        torch.manual_seed(seed)
        x = torch.tensor([ids])
        kw: dict[str, Any] = dict(max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0,
                                  attention_mask=torch.ones_like(x))
        if sampling.greedy:
            kw.update(do_sample=False)
        else:
            kw.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None,
                      top_p=sampling.top_p)
        if method == "hf-lookup":
            kw["prompt_lookup_num_tokens"] = 10
        elif method == "hf-assisted":
            kw["assistant_model"] = assistant
        first = _FirstStep()
        t0 = time.perf_counter()
        out = ref.generate(x, stopping_criteria=StoppingCriteriaList([first]), **kw)
        t1 = time.perf_counter()
        new = out.shape[1] - len(ids)
        decoded = out.shape[1] - first.length
        return {"tokens": out[0, len(ids):].tolist(), "tok_s": decoded / (t1 - first.t) if decoded else 0.0,
                "decode_s": t1 - first.t, "stats": {"new_tokens": new, "total_s": t1 - t0}}

    run.methods = ["hf-plain", "hf-lookup"] + (["hf-assisted"] if assistant is not None else [])
    return run


# ---------------------------------------------------------------- step-cost profile

# Qwen3-4B's published shape (tied embeddings, 36 layers); weights are random for timing.
# The S config (docs/performance.md): 29.4M parameters, 117.5 MB in f32, a size whose f32
# decode llama.cpp runs at about the weight-bytes floor on a 2-core CPU.
S_SHAPE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
               num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True)
QWEN3_4B_SHAPE = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)


# The S config's step profiles on CPU: (results key, matrix storage).
PROFILES = (("s_profile", "bfloat16"), ("s_profile_f32", "float32"), ("s_profile_int8", "int8"))
PROFILE_NAMES = {"s_profile": "the S config (random weights, bf16 matrices)",
                 "s_profile_f32": "the S config (random weights, f32)",
                 "s_profile_int8": "the S config (random weights, int8 matrices)"}


def random_model(shape: dict, dtype: str, stored: str | None = None) -> Model:
    """A random-weight model of a given shape computing in `dtype`, for step timings only;
    its matrices stored in `stored` (default `dtype`; for float32 compute on CPU, bfloat16
    as `load` keeps a bf16 checkpoint, or "int8" as `load(dtype="int8")` quantizes)."""
    import jax
    from . import checkpoint, cpu_kernels
    from .config import Qwen3Config

    cfg = Qwen3Config(**shape)
    params = checkpoint.unstack(checkpoint.init_params(cfg, jax.random.key(0), dtype=dtype))
    if stored == "int8":
        params = cpu_kernels.quantize_tree(params)
    elif stored is not None:
        params = jax.tree.map(lambda w: w.astype(stored) if w.ndim == 2 else w, params)
    if jax.numpy.dtype(dtype) == jax.numpy.float32:
        params = cpu_kernels.pack_tree(params)
    return Model(cfg, params, jax.numpy.dtype(dtype))


def measure_bandwidth(nbytes: int | None = None, reps: int = 5) -> float:
    """Memory bandwidth in GB/s from a large copy (bytes read + written), median of reps:
    NumPy on the CPU (a jitted copy there mostly measures page faults of its new output),
    a jitted on-device copy on an accelerator. nbytes defaults to 256 MiB on the CPU and
    2 GiB on an accelerator (on an H200 a 256 MiB copy read 1.4 TB/s, a third of the
    4.3 TB/s that copies of gigabytes reach: its 0.1 ms is near a call's dispatch time)."""
    import jax
    import jax.numpy as jnp

    on_cpu = jax.default_backend() == "cpu"
    nbytes = nbytes or (256 if on_cpu else 2048) * 2**20
    if on_cpu:
        src, dst = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
        copy = lambda: np.copyto(dst, src)
    else:
        x = jnp.ones(nbytes // 4, jnp.float32)
        f = jax.jit(lambda a: a * 1.0001)
        copy = lambda: f(x).block_until_ready()
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        copy()
        times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times[1:]) / 1e9


def step_profile(model: Model, ts: tuple[int, ...], context: int = 512, rounds: int = 11) -> dict[str, Any]:
    """Verify-step time for each T (round-robin, median of per-round ratios to T=1), and
    against the weight-bytes / bandwidth floor (median of per-round ratios, the bandwidth
    measured in each round): the T=1 step called alone (dispatch and result included) and
    a token of plain decoding as `generate` runs it (one engine call of 16 plain rounds).

    The step timed for each T is the target's forward over T new tokens at the end of a
    `context`-token cache (`qwen3.hidden_states` + `qwen3.unembed` + the argmax, one jitted
    call, the cache donated), the model work of the engine's verify step for one row; the
    cache is filled with `rounds.prefill_chunk`, as the engine prefills."""
    import jax
    from .engine import Engine

    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size, context).astype(np.int32)
    kv, cap = _prefilled(model, ids)
    tokens = rng.integers(0, model.config.vocab_size, 16).astype(np.int32)

    def once(t: int) -> float:
        nonlocal kv
        start = time.perf_counter()
        out, kv = _profiled_step()(model.params, model.config, kv, tokens[:t])
        jax.block_until_ready(out)
        return time.perf_counter() - start

    engine = Engine(model, None, max_batch=1, max_len=min(cap, model.config.max_position_embeddings))
    run = 16  # the engine's rounds per call

    def fused() -> float:  # plain decoding as generate runs it: one engine call of `run` rounds, per token
        req = engine.submit(ids, max_new_tokens=run + 1, stop_ids=())
        engine.step()  # the prompt and the first token
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        assert req.done and len(req.tokens) == run + 1
        return elapsed / run

    for t in ts:  # compile
        once(t)
        once(t)
    fused()
    # The bandwidth is measured in every round, next to the steps it prices: on a shared
    # machine it moves by a quarter within a minute, and a floor from another moment
    # would put that noise into the ratio.
    times: dict[int, list[float]] = {t: [] for t in ts}
    runs, bws = [], []
    for _ in range(rounds):
        bws.append(measure_bandwidth(reps=2))
        once(ts[0])  # untimed: the copy evicted the caches, which would have charged the first T timed
        for t in ts:
            times[t].append(once(t))
        runs.append(fused())
    base = times[ts[0]]
    ratios = {t: statistics.median([a / b for a, b in zip(times[t], base)]) for t in ts}
    nbytes = weight_bytes(model.params)
    bw = statistics.median(bws)
    floor_s = nbytes / (bw * 1e9)
    t1, run_s = statistics.median(base), statistics.median(runs)
    over = lambda xs: statistics.median(x * b * 1e9 / nbytes for x, b in zip(xs, bws))
    return {"context": context, "ms": {t: _spread([x * 1e3 for x in v]) for t, v in times.items()},
            "ratio_to_T1": ratios, "weight_bytes": nbytes, "bandwidth_GBps": bw,
            "floor_ms": floor_s * 1e3, "decode_ms": t1 * 1e3, "decode_over_floor": over(base),
            "run_ms_per_token": run_s * 1e3, "run_over_floor": over(runs)}


def _prefilled(model: Model, ids: np.ndarray) -> tuple[Any, int]:
    """(a one-row cache holding `ids`, filled by `rounds.prefill_chunk` as the engine
    prefills; its capacity)."""
    import jax.numpy as jnp
    from . import kv as kvlib
    from .results import PREFILL_CHUNK
    from .rounds import prefill_chunk
    from .sampling import RowSampling

    context = len(ids)
    cap = 1024 if context + 32 <= 1024 - 128 else 2 * (context + 160)
    kv = kvlib.init(model.config, 1, cap, model.cache_dtype)
    for start in range(0, context, PREFILL_CHUNK):
        part = np.zeros(PREFILL_CHUNK, np.int32)
        part[:min(PREFILL_CHUNK, context - start)] = ids[start:start + PREFILL_CHUNK]
        _, _, kv, _ = prefill_chunk(model.params, model.config, kv, jnp.asarray(part),
                                    jnp.int32(min(PREFILL_CHUNK, context - start)), jnp.uint32(0),
                                    RowSampling.of([Sampling()]), sampled=False)
    return kv, cap


def block_profile(model: Model, drafter: Any, context: int = 512, behind: int = 3, rounds: int = 21
                  ) -> dict[str, Any]:
    """A DFlash drafter pass against a plain decode step of its target (one row, round-robin,
    median of per-round ratios): the pass the engine's round runs (`drafters.block_drafts`,
    greedy, its draft vocabulary and Markov head if it has them) after `behind` committed
    tokens' context rows are caught up (a round that committed that many), next to the
    one-token step `step_profile` times, both at the end of a `context`-token cache."""
    import jax
    import jax.numpy as jnp
    from .drafters import DFlashCache, block_drafts, draft_head
    from .kv import KVCache
    from .sampling import RowSampling

    f, cfg = drafter.config, model.config
    rng = np.random.default_rng(0)
    kv, cap = _prefilled(model, rng.integers(0, cfg.vocab_size, context).astype(np.int32))
    page = kv.page_size
    pages = cap // page + 1
    fshape = (f.num_hidden_layers, f.num_key_value_heads, pages, page, f.head_dim)
    table = jnp.arange(1, pages, dtype=jnp.int32)[None]
    taps = jnp.asarray(rng.normal(size=(1, len(f.target_layer_ids), pages, page, cfg.hidden_size)), model.dtype)
    fc = DFlashCache(KVCache(jnp.zeros(fshape, drafter.dtype), jnp.zeros(fshape, drafter.dtype), table,
                             jnp.zeros(1, jnp.int32), page_size=page), taps, jnp.zeros(1, jnp.int32))
    head = None if drafter.vocab is None else draft_head(model.params, cfg, drafter.vocab,
                                                             drafter.params.get(MARKOV))
    k = f.block_size - 1
    start, last = jnp.array([context], jnp.int32), jnp.array([1], jnp.int32)

    @functools.partial(jax.jit, donate_argnames=("fc",))
    def draft(fc):
        drafts, _, fc, _ = block_drafts(drafter.params, f, fc, model.params, cfg, last, start, k,
                                        jnp.zeros(1, jnp.uint32), RowSampling.of([Sampling()]),
                                        jnp.zeros(1, bool), False, head)
        return drafts, fc

    _, fc = draft(fc.replace(written=jnp.zeros(1, jnp.int32)))  # every context row written once
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, 1), jnp.int32)

    def timed(fn):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        return time.perf_counter() - t0

    def one_pass():
        nonlocal fc
        out, fc = draft(fc.replace(written=jnp.array([context - behind], jnp.int32)))  # (fc is donated)
        return out

    def one_step():
        nonlocal kv
        out, kv = _profiled_step()(model.params, cfg, kv, tokens)
        return out

    for _ in range(2):  # compile and warm
        timed(one_pass), timed(one_step)
    passes, steps = [], []
    for _ in range(rounds):
        passes.append(timed(one_pass))
        steps.append(timed(one_step))
    return {"context": context, "k": k, "draft_vocab": None if drafter.vocab is None else len(drafter.vocab),
            "markov": MARKOV in drafter.params, "pass_ms": _spread([x * 1e3 for x in passes]),
            "decode_ms": _spread([x * 1e3 for x in steps]),
            "pass_over_decode": statistics.median(a / b for a, b in zip(passes, steps))}


@functools.cache
def _profiled_step() -> Callable:
    """The jitted step `step_profile` times (made on first use: importing the bench
    compiles nothing): the target's forward over T tokens after the cache's committed ones
    and their greedy tokens; the cache's length is left as it is (a step whose drafts are
    all rejected), so every call scores the same positions."""
    import jax
    import jax.numpy as jnp
    from . import qwen3
    from . import sampling as smp

    @functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("kv",))
    def step(params: Any, cfg: Any, kv: Any, tokens: Any) -> tuple[Any, Any]:
        positions = kv.lengths[:1, None] + jnp.arange(tokens.shape[0])
        h, kv, _ = qwen3.hidden_states(params, cfg, tokens[None], positions, kv)
        return smp.argmax(qwen3.unembed(params, cfg, h[0])), kv

    return step


# ---------------------------------------------------------------- the run

def run(cfg: BenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark; returns (and writes) the results."""
    llama_cpp = None
    if cfg.llamacpp is not None:  # the cheap checks first, before any model is loaded
        llamacpp.converter(cfg.llamacpp)
        llama_cpp = llamacpp.require()
    target = load(cfg.model, kv_dtype=cfg.kv_dtype)
    workloads = benchmark_prompts(target, cfg.workloads, cfg.prompts, cfg.prompt_tokens, cfg.new_tokens)
    lc_rows, lc_tags, lc_info = _llamacpp(cfg, target, llama_cpp, log) if llama_cpp is not None else ([], {}, {})
    methods = _methods(cfg, target)
    hf = _hf_runner(cfg)
    hf_methods = hf.methods if hf else []
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": _machine(), "config": _jsonable(dataclasses.asdict(cfg)),
        "cells": [],
    }
    for kind, prompts in workloads.items():
        for sname in cfg.samplings:
            sampling = SAMPLINGS[sname]
            log(f"[{kind} / {sname}] {len(prompts)} prompt(s) of ~{cfg.prompt_tokens} tokens, {cfg.new_tokens} new")
            # each row: (ids, seed) -> its run (llama.cpp's rows and specjax's on their weights: greedy cells)
            rows: dict[str, Callable[[list[int], int], dict[str, Any]]] = {
                f"{name}:{k}": functools.partial(_ours, target, prop, n=cfg.new_tokens, sampling=sampling)
                for name, k, prop in methods}
            rows.update({f"{name}:0": functools.partial(hf, name, n=cfg.new_tokens, sampling=sampling)
                         for name in hf_methods})
            lc = dict(lc_rows) if sname == "greedy" else {}
            rows.update({key: functools.partial(_greedy_row, row, n=cfg.new_tokens) for key, row in lc.items()})
            partners = {key: p for key in lc if (p := llamacpp.partner(key, lc_tags)) is not None}
            runs: dict[str, list[dict]] = {}
            for pi, prompt in enumerate(prompts):
                for rep in range(cfg.reps + 1):  # rep 0 is the warm-up
                    for key in run_order(list(rows), partners, rep):
                        r = rows[key](prompt.ids, seed=1000 * pi + rep)
                        if not key.startswith("hf-"):
                            r["rss_mb"] = _rss_mb()
                        if rep:
                            runs.setdefault(key, []).append(r)
            cell = _summarise(kind, sname, runs)
            if lc_rows and sname == "greedy":
                cell["llamacpp"] = llamacpp.summarise(kind, runs, lc_tags)
            results["cells"].append(cell)
            log(_cell_line(cell))
    if lc_rows:
        checks = [c["llamacpp"]["check"] for c in results["cells"] if "check" in c.get("llamacpp", {})]
        passed = all(ch["passed"] for ch in checks) if checks else None  # None: no f32 file, nothing checked
        results["llamacpp"] = {**lc_info, "check_passed": passed}
        log("llama.cpp f32 greedy check: " + {None: "not run (no f32 file in --llamacpp-types)", True: "passed",
                                              False: "FAILED"}[passed])
    if cfg.profile:
        _profiles(cfg, target, results, log)
    write(results, cfg.out)
    return results


def _profiles(cfg: BenchConfig, target: Model, results: dict[str, Any], log: Callable[[str], None]) -> None:
    """The step profiles, into `results`: the model's; on CPU the S config's (bf16, f32 and
    int8 matrices) unless cfg.s_profile is off; elsewhere a Qwen3-4B-shaped model's."""
    results["profile"] = step_profile(target, cfg.profile_ts)
    log(f"step profile: {_against_floor(results['profile'])}; ratios "
        + ", ".join(f"T={t}: {r:.2f}" for t, r in results["profile"]["ratio_to_T1"].items()))
    if cfg.dflash is not None:
        from .dflash import load_dflash
        results["block_profile"] = block_profile(target, load_dflash(cfg.dflash, target))
        log(_block_line(results["block_profile"]))
    import jax
    on_cpu = jax.default_backend() == "cpu"
    if on_cpu and cfg.s_profile:  # the S config's decode against the floor, 16- and 32-bit weights
        for key, stored in PROFILES:
            results[key] = step_profile(random_model(S_SHAPE, "float32", stored), cfg.profile_ts)
            log(f"{PROFILE_NAMES[key]}: {_against_floor(results[key])}; ratios "
                + ", ".join(f"T={t}: {r:.2f}" for t, r in results[key]["ratio_to_T1"].items()))
    if not on_cpu:  # absolute step times of a real-sized model against the floor
        results["gpu_profile"] = step_profile(random_model(QWEN3_4B_SHAPE, "bfloat16"), cfg.profile_ts, context=1024)
        log(f"Qwen3-4B shape, bf16: {_against_floor(results['gpu_profile'])}")


def _block_line(p: dict[str, Any]) -> str:
    vocab = "the whole vocabulary" if p["draft_vocab"] is None else f"a {p['draft_vocab']}-token draft vocabulary"
    return (f"DFlash drafter pass (k = {p['k']}, {vocab}, {'with' if p['markov'] else 'no'} Markov head, "
            f"context {p['context']}): {p['pass_ms']['median']:.2f} ms = {p['pass_over_decode']:.2f}x a decode "
            f"step ({p['decode_ms']['median']:.2f} ms)")


def _against_floor(p: dict[str, Any]) -> str:
    return (f"decode step alone {p['decode_ms']:.2f} ms = {p['decode_over_floor']:.2f}x the floor, "
            f"in a fused run {p['run_ms_per_token']:.2f} ms/token = {p['run_over_floor']:.2f}x")


def _summarise(kind: str, sname: str, runs: dict[str, list[dict]]) -> dict[str, Any]:
    """Per method: tok/s spread, paired speedup vs our plain, and the speculative stats."""
    plain = runs["plain:0"]
    rows = {}
    for key, rs in runs.items():
        name, k = key.split(":")
        speed = [p["decode_s"] / r["decode_s"] for p, r in zip(plain, rs) if r["decode_s"] > 0]
        row = {"method": name, "k": int(k), "tok_s": _spread([r["tok_s"] for r in rs]), "speedup": _spread(speed),
               "rss_mb": max(r.get("rss_mb", 0.0) for r in rs)}
        if not name.startswith(("hf-", "llamacpp-", "plain")):  # speculative rows of ours
            stats = [r["stats"] for r in rs]
            row.update(
                # pooled over the runs (prompts of other lengths and acceptance: a median of
                # per-run values jumps between the prompts' clusters)
                tokens_per_step=_share(sum(s["new_tokens"] - 1 for s in stats), sum(s["steps"] for s in stats)),
                accept_hist=_sum_lists([s["accept_hist"] for s in stats]),
                acceptance_by_position=_ratio_lists([s["accepted_at"] for s in stats], [s["reached"] for s in stats]),
                verify_tokens_per_token=_share(sum(s["verify_tokens"] for s in stats),
                                               sum(max(s["new_tokens"] - 1, 1) for s in stats)),
                tree_share=_share(sum(s["tree_steps"] for s in stats), sum(s["steps"] for s in stats)),
                branched_share=_share(sum(s["branched"] for s in stats), sum(s["tree_steps"] for s in stats)),
                time_split={part: statistics.median(s[part] / s["decode_s"] for s in stats if s["decode_s"])
                            for part in ("propose_s", "verify_s", "host_s")})
        row["same_tokens_as_plain"] = all(r["tokens"] == p["tokens"] for p, r in zip(plain, rs))
        chain = _chain_of(name, k)
        if chain in runs:  # a tree or auto row: its speed over the chain's, run by run (adjacent runs)
            row["over_chain"] = _spread([c["decode_s"] / r["decode_s"] for c, r in zip(runs[chain], rs)
                                         if r["decode_s"] > 0])
        rows[key] = row
    best = {}
    for method in {r["method"] for r in rows.values()}:
        cands = [r for r in rows.values() if r["method"] == method]
        best[method] = max(cands, key=lambda r: r["speedup"].get("median", 0.0))["k"]
    ours_plain = rows["plain:0"]["tok_s"]["median"]
    hf_ratio = {r["method"]: ours_plain / r["tok_s"]["median"] for r in rows.values()
                if r["method"].startswith("hf-") and r["tok_s"]["median"]}
    return {"workload": kind, "sampling": sname, "rows": rows, "best_k": best,
            "our_plain_over_hf": hf_ratio}


def _chain_of(method: str, k: str) -> str | None:
    """The chain row a tree or auto row ("<proposer>-tree" / "-auto") is compared with: the
    proposer's row at the same k (prompt lookup's own row, whose k the chooser picks); None
    for other rows."""
    proposer, dash, shape = method.rpartition("-")
    if not dash or shape not in ("tree", "auto") or proposer not in TREE_PROPOSERS:
        return None
    return "lookup:0" if proposer == "lookup" else f"{proposer}:{k}"


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def _sum_lists(lists: list[list[int]]) -> list[int]:
    n = max((len(x) for x in lists), default=0)
    return [sum(x[i] for x in lists if i < len(x)) for i in range(n)]


def _ratio_lists(num: list[list[int]], den: list[list[int]]) -> list[float]:
    a, b = _sum_lists(num), _sum_lists(den)
    return [x / y if y else 0.0 for x, y in zip(a, b)]


def _cell_line(cell: dict[str, Any]) -> str:
    parts = []
    for method, k in sorted(cell["best_k"].items()):
        row = cell["rows"][f"{method}:{k}"]
        parts.append(f"{method}{'@' + str(k) if k else ''} {row['tok_s']['median']:.0f} tok/s "
                     f"({row['speedup']['median']:.2f}x)")
    return "  " + "; ".join(parts)


def _machine() -> dict[str, Any]:
    import os
    import jax
    return {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
            "backend": jax.default_backend(), "jax": jax.__version__, "python": platform.python_version()}


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


# ---------------------------------------------------------------- outputs

def markdown(results: dict[str, Any]) -> str:
    """The results table: speedup at the best k of each method, per workload and sampling."""
    adaptive = ("lookup", "adaptive")  # k chosen per step
    methods = [m for m in ("ngram", "draft", "dflash") + adaptive
               if any(m in c["best_k"] for c in results["cells"])]
    head = ["workload", "sampling", "plain tok/s"] + [m if m in adaptive else f"{m} (best k)" for m in methods]
    if "dflash" in methods:
        head.append("dflash tokens/step")
    head += ["ours / HF plain", "HF lookup", "HF assisted"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in results["cells"]:
        rows = c["rows"]
        cols = [c["workload"], c["sampling"], f"{rows['plain:0']['tok_s']['median']:.0f}"]
        for m in methods:
            k = c["best_k"].get(m)
            label = "" if m in adaptive else f" (k={k})"
            cols.append(f"{rows[f'{m}:{k}']['speedup']['median']:.2f}x{label}" if k is not None else "–")
        if "dflash" in methods:
            k = c["best_k"].get("dflash")
            cols.append(f"{rows[f'dflash:{k}']['tokens_per_step']:.2f}" if k is not None else "–")
        for hf in ("hf-plain", "hf-lookup", "hf-assisted"):
            key = f"{hf}:0"
            if key not in rows:
                cols.append("–")
            elif hf == "hf-plain":
                cols.append(f"{c['our_plain_over_hf'][hf]:.2f}x")
            else:
                cols.append(f"{rows[key]['speedup']['median']:.2f}x")
        lines.append("| " + " | ".join(cols) + " |")
    m = results["machine"]
    lines.append("")
    lines.append(f"Speedups are medians of per-round ratios against our plain decoding; HF columns are "
                 f"transformers on the same checkpoint and prompts, also relative to our plain decoding; "
                 f"tokens per step are the runs' tokens over their steps. "
                 f"{results['date']}, {m['cpus']} CPUs, {m['backend']}, jax {m['jax']}"
                 + (f"; KV cache {kv}." if (kv := results["config"].get("kv_dtype")) else "."))
    for key, name in (("profile", "this model (as loaded)"), *PROFILE_NAMES.items()):
        p = results.get(key)
        if p:
            lines.append("")
            lines.append(f"{name[0].upper() + name[1:]}: verify step t(T)/t(1) at context {p['context']}: "
                         + ", ".join(f"T={t}: {r:.2f}" for t, r in p["ratio_to_T1"].items())
                         + f". Floor {p['floor_ms']:.2f} ms ({p['weight_bytes'] / 1e6:.0f} MB of weights at "
                         f"{p['bandwidth_GBps']:.1f} GB/s); {_against_floor(p)}.")
    if "block_profile" in results:
        lines += ["", _block_line(results["block_profile"]) + "."]
    text = "\n".join(lines) + "\n" + tree_markdown(results) + markov_markdown(results)
    return text + llamacpp.markdown(results) if "llamacpp" in results else text


def tree_markdown(results: dict[str, Any]) -> str:
    """Trees against chains: per cell and proposer, the chain at its largest k, trees of as
    many nodes, and the chooser's pick of either per round ("" where no tree rows ran)."""
    lines = []
    for c in results["cells"]:
        rows = c["rows"]
        for name in TREE_PROPOSERS:
            k = c["best_k"].get(f"{name}-tree")
            if k is None:
                continue
            cols = [c["workload"], c["sampling"], name, str(k) if k else "chosen"]
            chain = rows[_chain_of(f"{name}-tree", str(k))]
            cols.append(f"{chain['tokens_per_step']:.2f} / {chain['speedup']['median']:.2f}x")
            for key in (f"{name}-tree:{k}", f"{name}-auto:{k}"):
                r, o = rows[key], rows[key]["over_chain"]
                cols.append(f"{r['tokens_per_step']:.2f} / {r['speedup']['median']:.2f}x / {o['median']:.2f}x "
                            f"({o['min']:.2f}-{o['max']:.2f})")
            tree, auto = rows[f"{name}-tree:{k}"], rows[f"{name}-auto:{k}"]
            cols += [f"{tree['branched_share']:.0%}", f"{tree['verify_tokens_per_token']:.2f}",
                     f"{auto['tree_share']:.0%}"]
            lines.append("| " + " | ".join(cols) + " |")
    if not lines:
        return ""
    head = ["workload", "sampling", "proposer", "k", "chain tok/step / speedup",
            "tree: tok/step / speedup / over the chain", "auto: the same", "tree: non-first branch taken",
            "tree: verified per token", "auto: steps on a tree"]
    return ("\nTrees against chains at the same verify width (a tree has at most as many nodes as the chain "
            "has drafts; \"auto\" drafts, per row and round, the tree where it has held deeper and is worth its "
            "build, else the chain). \"Over the chain\" "
            "is the median of per-run ratios of the chain's decode time to the tree's (each run next to the "
            "chain's on the same prompt), with their range:\n\n"
            + "| " + " | ".join(head) + " |\n" + "|" + "---|" * len(head) + "\n" + "\n".join(lines) + "\n")


def markov_markdown(results: dict[str, Any]) -> str:
    """DFlash with its Markov head against the same drafter without it, per cell at the
    largest k: tokens per step, speed over plain and acceptance by draft position ("" where
    the drafter has no head)."""
    lines = []
    for c in results["cells"]:
        k = c["best_k"].get("dflash-unary")
        if k is None:
            continue
        cols = [c["workload"], c["sampling"], str(k)]
        for key in (f"dflash:{k}", f"dflash-unary:{k}"):
            r = c["rows"][key]
            by_position = " ".join(f"{a:.2f}" for a in r["acceptance_by_position"][:4])
            cols.append(f"{r['tokens_per_step']:.2f} / {r['speedup']['median']:.2f}x / {by_position}")
        lines.append("| " + " | ".join(cols) + " |")
    if not lines:
        return ""
    head = ["workload", "sampling", "k", "with the Markov head: tok/step / speedup / acceptance by position 1-4",
            "without it"]
    return ("\nDFlash with and without its Markov head (the same drafter's layers):\n\n"
            + "| " + " | ".join(head) + " |\n" + "|" + "---|" * len(head) + "\n" + "\n".join(lines) + "\n")


def plots(results: dict[str, Any], out: Path) -> list[Path]:
    """speedup_vs_k.png and acceptance_by_position.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = results["cells"]
    fig, axes = plt.subplots(1, len(cells), figsize=(4 * len(cells), 3.2), squeeze=False)
    for ax, c in zip(axes[0], cells):
        for method in ("ngram", "draft", "dflash"):
            pts = sorted((r["k"], r["speedup"]["median"]) for r in c["rows"].values() if r["method"] == method)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=method)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(f"{c['workload']} / {c['sampling']}", fontsize=9)
        ax.set_xlabel("k")
    axes[0][0].set_ylabel("speedup vs plain")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    paths = [out / "speedup_vs_k.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(cells), figsize=(4 * len(cells), 3.2), squeeze=False)
    for ax, c in zip(axes[0], cells):
        for method in ("ngram", "draft", "dflash"):
            k = c["best_k"].get(method)
            if k:
                acc = c["rows"][f"{method}:{k}"]["acceptance_by_position"]
                ax.plot(range(1, len(acc) + 1), acc, marker=".", label=f"{method} k={k}")
        ax.set_ylim(0, 1)
        ax.set_title(f"{c['workload']} / {c['sampling']}", fontsize=9)
        ax.set_xlabel("draft position")
    axes[0][0].set_ylabel("P(accept | reached)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "acceptance_by_position.png")
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def write(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(_jsonable(results), indent=1))
    (out / "results.md").write_text(markdown(results))
    plots(results, out)
