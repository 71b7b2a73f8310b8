"""Shared fixtures: random tiny Qwen3 models built by transformers (no download)."""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

# No persistent compilation cache under test. In full runs (-n 2) workers died inside JAX's
# cache: SIGSEGV in executable.serialize() while writing an entry (both crashes of one run,
# in test_train_lm and test_engine_trees; earlier runs in other tests), SIGABRT reading one.
# Each test passes alone, and the CPU kernels run clean under AddressSanitizer; CI starts
# from an empty cache anyway. Compiled CPU kernels still go to ~/.cache/specjax/kernels.
os.environ.setdefault("SPECJAX_CACHE_DIR", "off")

# Compile for the tests' tiny models, not for speed. Compiling is most of the suite's time,
# and XLA:CPU's elemental emitters at LLVM -O0 compile an engine's steps in a third of the
# time of its defaults (5.5 s against 15.9 s of backend compile for a sampled and a greedy
# lookup engine at batch 1 and 2); the code runs about half as fast. Users get XLA's
# defaults: test_default_codegen.py runs the checks in UNDER_DEFAULTS under them, in a child
# pytest, and the fast run leaves them to it. They are the exactness checks that span every
# compiled path (lookup chains and trees, a draft model, DFlash, greedy and sampled rows at
# batch 1 and 4), transformers parity of the shipped checkpoints, and the checks whose bits
# this codegen changes (it flushes subnormal bfloat16 values to zero as it widens them).
# SPECJAX_TEST_CODEGEN=default runs the whole suite under XLA's defaults; so does a jaxlib
# that does not know these flags (probed once: XLA aborts on a flag it does not know).
FAST_COMPILE = "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=0"
UNDER_DEFAULTS = [  # a test's name, or one of its parameter sets
    "test_engine_trees.py::test_tree_rows_equal_their_plain_run_alone",
    "test_speculative.py::test_sampled_deterministic_proposers_equal_plain_sampled",
    "test_engine_dflash.py::test_rows_with_dflash_drafts_equal_their_plain_run_alone[dflash]",
    "test_qwen3_parity.py::test_shipped_checkpoints_match_transformers",
    "test_qwen3_parity.py::test_rms_norm_gives_a_row_its_bits_whatever_the_rows_around_it",
    "test_sampling.py::test_distributions_give_a_row_its_bits_whatever_the_rows_around_it",
    "test_weight_storage.py::test_int8_shipped_model_speculation_equals_plain_at_width_16_and_in_a_batch",
    "test_cpu_kernels.py::test_16_bit_panels_give_the_bits_of_the_same_weights_in_float32",
    "test_dflash_train.py::test_a_markov_head_trains_beside_a_drafter_left_as_it_would_be",
]


def _choose_codegen() -> None:
    mode = os.environ.setdefault("SPECJAX_TEST_CODEGEN", "fast")
    if mode not in ("fast", "default"):
        raise ValueError(f"SPECJAX_TEST_CODEGEN must be fast or default, got {mode!r}")
    flags = os.environ.get("XLA_FLAGS", "")
    if mode == "default" or FAST_COMPILE in flags:  # (a worker or child of a run that chose)
        return
    wanted = f"{flags} {FAST_COMPILE}".strip()
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True,
                           env={**os.environ, "XLA_FLAGS": wanted})
    if probe.returncode == 0:
        os.environ["XLA_FLAGS"] = wanted
    else:
        warnings.warn(f"this jaxlib refuses XLA_FLAGS {FAST_COMPILE!r}; the tests compile with XLA's defaults")
        os.environ["SPECJAX_TEST_CODEGEN"] = "default"


_choose_codegen()


import numpy as np
import pytest


def xla_flags(*extra: str) -> str:
    """XLA_FLAGS for a child process: this run's flags (the codegen above) plus `extra`."""
    return " ".join([os.environ.get("XLA_FLAGS", ""), *extra]).strip()


_moved: list[str] = []

# The files that take longest, longest first, start first: xdist's loadfile scheduler hands
# out files in collection order (addopts has --no-loadscope-reorder: its default order, most
# tests first, left the one-test default-codegen file, the longest, to run alone at the end).
LONGEST_FIRST = ("test_default_codegen.py", "test_engine.py", "test_engine_draft_trees.py", "test_notebooks.py",
                 "test_speculative.py", "test_engine_dflash.py", "test_dflash_train.py", "test_markov_head.py",
                 "test_sampling.py", "test_weight_storage.py", "test_readme.py", "test_bench.py")


def pytest_collection_modifyitems(config, items):
    """Start the longest files first; under the fast codegen, leave UNDER_DEFAULTS to
    test_default_codegen.py."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: the rest as collected)
    if os.environ["SPECJAX_TEST_CODEGEN"] != "fast":
        return

    def theirs(item):
        name = item.nodeid.split("/")[-1]
        return name in UNDER_DEFAULTS or name.split("[")[0] in UNDER_DEFAULTS

    moved = [item for item in items if theirs(item)]
    if moved:
        config.hook.pytest_deselected(items=moved)
        items[:] = [item for item in items if not theirs(item)]
        _moved[:] = [item.nodeid for item in moved]


def pytest_terminal_summary(terminalreporter):
    if _moved:
        terminalreporter.write_line(f"{len(_moved)} deselected: they run under XLA's default codegen, in "
                                    "test_default_codegen.py or with SPECJAX_TEST_CODEGEN=default")


MAX_MAPPINGS = 2 ** 15  # half of Linux's default vm.max_map_count (65530)
KEEP_COMPILED_BYTES = 8 * 2 ** 30


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_code():
    """Free the compiled executables when a test file ends with the worker holding more
    than MAX_MAPPINGS memory mappings or 8 GiB. Below that the next file on this worker
    reuses what earlier files compiled for the shared models (the plain runs alone that
    most engine tests compare against). XLA:CPU maps each compiled kernel's code on its
    own (a large engine test file adds 10-15k mappings): a worker that never freed them
    aborted inside a compile at vm.max_map_count. Resident memory is no measure of that:
    it stays near its peak after a clear (3.4-3.9 GiB before and after), so a limit on it
    had every later file compile from nothing."""
    yield
    import jax
    import psutil

    maps = Path("/proc/self/maps")  # (Linux, where the limit is; elsewhere memory alone decides)
    mappings = sum(1 for _ in maps.open()) if maps.exists() else 0
    if mappings > MAX_MAPPINGS or psutil.Process().memory_info().rss > KEEP_COMPILED_BYTES:
        jax.clear_caches()


def hf_tiny(folder: Path, seed: int = 0, dtype: str = "float32", max_shard_size: str | None = None,
            init: float = 0.4, **overrides):
    """Build, save and return a random transformers Qwen3ForCausalLM (f32 in memory).

    A large init range keeps greedy output from collapsing to one repeated token.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    kw = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True,
              initializer_range=init, max_position_embeddings=4096)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**kw)).eval()
    with torch.no_grad():  # random (not unit) norm weights so the parity test sees them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    save_kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.to(getattr(torch, dtype)).save_pretrained(folder, **save_kw)
    return model.float()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(transformers model, folder, specjax model) of one random tiny Qwen3, shared by tests."""
    import specjax

    folder = tmp_path_factory.mktemp("tiny")
    ref = hf_tiny(folder)
    return ref, folder, specjax.load(folder)


def hidden_states(params, cfg, tokens, positions, kv=None, **kw):
    """`qwen3.hidden_states` compiled, as the engine runs its steps: called op by op, each
    new shape compiled every primitive again (most of some test files' time)."""
    return _compiled_hidden_states()(params, cfg, tokens, positions, kv, **kw)


@functools.cache
def _compiled_hidden_states():
    import jax
    from specjax import qwen3

    return jax.jit(qwen3.hidden_states, static_argnames=("cfg", "taps"))


def assert_trees_equal(a, b) -> None:
    """Same tree structure and bit-identical leaves."""
    import jax

    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def run_crashing_at(monkeypatch, module, step: int, run) -> None:
    """Run `run()` with module.batch_at raising at `step` (a kill -9: no final save), then
    restore batch_at; the caller resumes and compares against an uninterrupted run."""
    real = module.batch_at

    def crashing(data, tc, s, *rest):
        if s == step:
            raise RuntimeError("killed")
        return real(data, tc, s, *rest)

    monkeypatch.setattr(module, "batch_at", crashing)
    with pytest.raises(RuntimeError, match="killed"):
        run()
    monkeypatch.setattr(module, "batch_at", real)


@pytest.fixture(scope="session")
def cyclic_target(tmp_path_factory):
    """A random target whose greedy output falls into cycles, so prompt-lookup drafts get
    accepted; stored in bf16, so it loads as real checkpoints do on CPU (matrices kept in
    16 bits, widened by the kernels) and the exactness tests run that path."""
    import specjax

    folder = tmp_path_factory.mktemp("cyclic")
    hf_tiny(folder, seed=3, init=0.1, dtype="bfloat16")
    return specjax.load(folder)


def lookup_reference(history: np.ndarray, k: int, max_ngram: int, min_ngram: int) -> tuple[np.ndarray, int]:
    """Prompt lookup by brute force: for n = max_ngram down to min_ngram, the k tokens after
    the latest earlier occurrence of the last n tokens; (tokens, n matched), or (empty, 0)."""
    history = np.asarray(history)
    size = len(history)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= size:
            continue
        tail = list(history[size - n:])
        starts = [i for i in range(size - n) if list(history[i:i + n]) == tail]
        if starts:
            return history[starts[-1] + n:starts[-1] + n + k], n
    return history[:0], 0


def repeating_prompt(rng, vocab: int, period: int = 9, repeats: int = 3) -> np.ndarray:
    """A random period repeated, then its first 4 tokens: something for prompt lookup to copy."""
    base = rng.integers(0, vocab, period)
    return np.concatenate([np.tile(base, repeats), base[:4]])


@pytest.fixture(scope="session")
def calm(tmp_path_factory):
    """(transformers model, specjax model) with init 0.1: logits and residuals of order 1-10,
    the scale the f32 tolerances (1e-5 simple ops, 1e-4 composites) are set for."""
    import specjax

    folder = tmp_path_factory.mktemp("calm")
    ref = hf_tiny(folder, seed=7, init=0.1)
    return ref, specjax.load(folder)


FALSE_ALARM = 1e-6
"""The chance that one frequency check fails on a correct sampler. Draws come from fresh
seeds each run and a run makes a few dozen such checks: about one spurious failure in
30 000 runs. Power stays: two cells of 0.1 trading 0.03 of the mass, at 6000 draws
(noncentrality 108), fail it with probability 0.9996 at 20 degrees of freedom (0.999999 at
1e-3), per scipy.stats.ncx2."""


def assert_follows(counts: np.ndarray, law: np.ndarray, label: str = "") -> None:
    """`counts` drawn from `law` (any shape, the same; normalised here): none where the law
    is 0, and Pearson's chi-square, cells expecting under 5 pooled into one, passes at
    FALSE_ALARM (where the law has more than one cell)."""
    from scipy import stats

    counts, law = np.ravel(counts), np.ravel(law).astype(np.float64)
    assert counts.shape == law.shape, (counts.shape, law.shape)
    assert counts[law == 0].sum() == 0, f"{label or 'counts'}: draws where the law is 0"
    want = law / law.sum() * counts.sum()
    common, rare = want >= 5, (want > 0) & (want < 5)
    observed, expected = counts[common], want[common]
    if rare.any():
        observed, expected = np.append(observed, counts[rare].sum()), np.append(expected, want[rare].sum())
    if len(expected) == 1:  # one cell: the draws' support (checked above) is the whole law
        return
    p_value = stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue
    assert p_value > FALSE_ALARM, f"{label or 'counts'}: chi-square p = {p_value:.3g}"


@pytest.fixture
def rng(request):
    """Fresh randomness per run; a failing test's output shows its seed, and
    SPECJAX_TEST_SEED=<seed> replays it."""
    seed = int(os.environ.get("SPECJAX_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)


@contextlib.contextmanager
def running(app):
    """The app on a free port of 127.0.0.1, served by uvicorn in a thread; yields its URL."""
    import uvicorn

    from specjax.server import bind

    sock = bind("127.0.0.1", 0)
    # keep-alive past any pause between a test's requests: uvicorn drops a connection idle
    # for 5 s, and a client (max_retries=0) that sends on it just then reads a reset
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=600))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
        assert not thread.is_alive()
