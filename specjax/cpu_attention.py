"""Decode / verify attention on CPU as a small C++ kernel (XLA FFI) that reads the paged
pool in place; XLA's own form (`qwen3.attend_pool`) stays the path everywhere else.

Why: on XLA:CPU the attention of a step with few query rows costs a copy of each layer's
pool slab plus YNNPACK batched matmuls running at 1-3 GB/s: about half of the shipped
model's decode step (docs/performance.md, fourth pass). The kernel reads only the slots a
row can see, once per KV head for all its queries.

The source (`csrc/paged_attention.cc`) is compiled on first use with the machine's C++
compiler (`$CXX`, else `c++`) against the FFI headers jaxlib ships, and cached by content
hash under ``~/.cache/specjax/kernels`` (or next to ``$SPECJAX_CACHE_DIR``). Where that is not
possible (no compiler, not a CPU backend, not float32) or ``SPECJAX_CPU_KERNELS=off``,
callers fall back to XLA; :func:`available` says which, and why, once.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

from .runtime import cache_dir

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cc"
TARGET = "specjax_paged_attention"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
# Head sizes the kernel is instantiated for (E / 8 vectors of eight floats).
HEAD_DIMS = (16, 24, 32, 48, 64, 96, 128)
# The kernel's work grows with the query rows of a call (B * T * G); past this XLA's
# batched GEMM (prefill chunks) is the better tool.
MAX_ROWS = 64

_state: dict[str, object] = {}


def _kernel_dir() -> Path:
    env = os.environ.get("SPECJAX_CACHE_DIR")
    base = Path(env).parent if env and env != "off" else Path.home() / ".cache" / "specjax"
    return base / "kernels"


def _build() -> Path:
    """The compiled library for this source, compiler flags and jax version (built once)."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set $CXX)")
    include = jax.ffi.include_dir()
    key = hashlib.sha256(SOURCE.read_bytes() + repr((cxx, FLAGS, jax.__version__)).encode()).hexdigest()[:16]
    lib = _kernel_dir() / f"paged_attention-{key}.so"
    if lib.is_file():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        proc = subprocess.run([cxx, *FLAGS, f"-I{include}", str(SOURCE), "-o", str(out)],
                              capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"compiling {SOURCE} failed:\n{proc.stderr[-2000:]}")
        os.replace(out, lib)  # atomic: concurrent builders agree on one file
    return lib


def available() -> bool:
    """Whether the kernel is compiled and registered with XLA's CPU backend (tried once)."""
    if "ok" not in _state:
        if os.environ.get("SPECJAX_CPU_KERNELS", "").lower() in ("off", "0", "false"):
            _state.update(ok=False, why="SPECJAX_CPU_KERNELS=off")
        else:
            try:
                lib = ctypes.cdll.LoadLibrary(str(_build()))
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.SpecjaxPagedAttention), platform="cpu")
                _state.update(ok=True, why="")
            except (OSError, RuntimeError, AttributeError) as err:
                _state.update(ok=False, why=str(err))
                warnings.warn(f"specjax: CPU attention kernel unavailable, using XLA's attention: {err}",
                              RuntimeWarning, stacklevel=2)
    return bool(_state["ok"])


def applies(q: jax.Array, pool: jax.Array) -> bool:
    """Whether a step with queries q [B, T, H, E] over `pool` should use the kernel."""
    rows = q.shape[0] * q.shape[1] * (q.shape[2] // pool.shape[1])
    return (rows <= MAX_ROWS and q.shape[3] in HEAD_DIMS and q.dtype == jnp.float32
            and pool.dtype == jnp.float32 and jax.default_backend() == "cpu" and available())


def paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array,
                    slot_pos: jax.Array, q_pos: jax.Array) -> jax.Array:
    """Attention of q [B, T, H, E] at positions q_pos [B, T] over layer `layer` of the pools
    [L, K, P, Z, E], slot s visible iff slot_pos [B, P*Z] <= the query's position: [B, T, H*E]."""
    if not available():
        raise RuntimeError(f"the CPU attention kernel is unavailable: {_state['why']}")
    b, t, h, e = q.shape
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(q, k_pool, v_pool, jnp.asarray(layer, jnp.int32), slot_pos.astype(jnp.int32),
               q_pos.astype(jnp.int32))
    return out.reshape(b, t, h * e)
