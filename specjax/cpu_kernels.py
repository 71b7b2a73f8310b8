"""Small C++ kernels (XLA FFI) for the steps of decoding on CPU, where XLA:CPU is far from
the memory-bandwidth floor (docs/performance.md, sections 2 and 3):

- `paged_attention`: attention of a step's few queries over the paged KV pool, read in
  place. XLA copies each layer's pool slab and runs YNNPACK batched matmuls at 1-3 GB/s:
  about half of the shipped model's decode step.
- `matmul`: x [M, D] times a weight [N, D] (decode, verify, drafting, prefill chunks), the
  weight stored as panels of 64 or 16 outputs (`panel_width`; `Packed`, made at load by
  `pack_tree`) in float32, bfloat16 or float16. XLA switches to a packed GEMM from two
  rows on that costs ~2x a one-row GEMV, so a verify step of 8 tokens cost 2x a decode
  step; the kernel streams the weight once for all rows. A step is bound by reading the
  weights, so a 16-bit checkpoint is kept in 16 bits and widened in registers: half the
  bytes, and (widening being exact) bitwise the results of the same weights stored as
  float32.
- `kv_write`: a layer's new keys and values into the pools, in place (results alias the
  pools). XLA's per-token `dynamic_update_slice` loop costs ~3 us a token and pool.
- `top_k`: `lax.top_k`'s values and indices for the samplers and tree ranking; XLA's TopK
  sorts a row partially (~17 us for 8192 logits), the kernel sorts only the entries that
  can be among the k largest.

The first two compute every output in a fixed order whatever the batch, so a token's logits in a
verify step are bitwise those of the decode step that would have produced it.

The sources (`csrc/*.cc`) are compiled on first use with the machine's C++ compiler
(`$CXX`, else `c++`) against the FFI headers jaxlib ships, and cached under
``~/.cache/specjax/kernels`` (or next to ``$SPECJAX_CACHE_DIR``) by a hash of the sources,
flags, jax version and the CPU's model and instruction sets (`runtime.host_key`); each
library records the instruction sets it uses, checked against the CPU before it is
loaded. Where that is not possible (no compiler, not a CPU backend, 16-bit compute) or
``SPECJAX_CPU_KERNELS=off``, callers use XLA's own ops; :func:`available` says which, and
why, once.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import math
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import runtime

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("paged_attention.cc", "matmul.cc", "kv_write.cc", "top_k.cc")
TARGETS = {"specjax_paged_attention": "SpecjaxPagedAttention", "specjax_paged_attention_bf16": "SpecjaxPagedAttentionBf16",
           "specjax_matmul": "SpecjaxMatmul", "specjax_matmul_q8": "SpecjaxMatmulQ8",
           "specjax_kv_write": "SpecjaxKvWrite", "specjax_kv_write_bf16": "SpecjaxKvWriteBf16",
           "specjax_top_k": "SpecjaxTopK"}
# -ffp-contract=off: whether a multiply-add is fused was decided per template instance,
# which made a row's result depend on how many rows shared the call.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-w")
# Head sizes the kernel is instantiated for (E / 8 vectors of eight floats).
HEAD_DIMS = (16, 24, 32, 48, 64, 96, 128)
# The attention kernel's work grows with the query rows of a sequence (T * G); past this
# XLA's batched GEMM (prefill chunks) is the better tool.
MAX_ROWS = 64
# What the matmul kernel reads a weight's panels as; it computes in float32 either way.
PANEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Input columns per scale of an int8 weight (`quantize`; llama.cpp's q8_0 block).
Q8_BLOCK = 32
# What the attention and kv_write kernels keep a KV pool in (suffix of their FFI targets).
POOL_DTYPES = {jnp.dtype(jnp.float32): "", jnp.dtype(jnp.bfloat16): "_bf16"}

_state: dict[str, object] = {}


def _kernel_dir() -> Path:
    env = os.environ.get("SPECJAX_CACHE_DIR")
    base = Path(env).parent if env and env != "off" else Path.home() / ".cache" / "specjax"
    return base / "kernels"


def _build() -> Path:
    """The compiled library for these sources, compiler flags, jax version and this
    machine's CPU (built once: -march=native code may not run on another CPU). A cached
    library recorded as using an instruction set this CPU lacks is rebuilt, not loaded
    (a home folder shared by machines with different CPUs); if the compiler itself targets
    one (a CPU that reports less than it has), that is an error rather than a SIGILL."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set $CXX)")
    files = sorted(CSRC.glob("*.h")) + [CSRC / name for name in SOURCES]
    digest = hashlib.sha256(repr((cxx, FLAGS, jax.__version__, runtime.host_key())).encode())
    for f in files:
        digest.update(f.read_bytes())
    lib = _kernel_dir() / f"specjax-kernels-{digest.hexdigest()[:16]}.so"
    if lib.is_file() and not _unsupported(lib):
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        _compile(cxx, out)
        missing = _unsupported(out)
        if missing:
            raise RuntimeError(f"{cxx} {' '.join(FLAGS)} builds code using {', '.join(missing)}, which this "
                               "CPU does not report having")
        os.replace(out.with_suffix(".json"), lib.with_suffix(".json"))
        os.replace(out, lib)  # atomic, and last: concurrent builders agree on one file
    return lib


# Instruction sets -march=native may use, as (compiler macro, /proc/cpuinfo flag).
ISA = {"__SSE4_2__": "sse4_2", "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c",
       "__BMI2__": "bmi2", "__AVX512F__": "avx512f", "__AVX512VL__": "avx512vl", "__AVX512BW__": "avx512bw",
       "__AVX512DQ__": "avx512dq", "__AVX512VNNI__": "avx512_vnni", "__AVX512BF16__": "avx512_bf16",
       "__ARM_FEATURE_SVE": "sve", "__ARM_FEATURE_SVE2": "sve2", "__ARM_FEATURE_DOTPROD": "asimddp"}


def _compile(cxx: str, out: Path) -> None:
    """The kernels compiled to `out`, with `out`.json recording the instruction sets used
    (the /proc/cpuinfo names of the compiler's predefined ISA macros under FLAGS)."""
    sources = [str(CSRC / n) for n in SOURCES]
    proc = subprocess.run([cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", *sources, "-o", str(out)],
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"compiling {CSRC} failed:\n{proc.stderr[-2000:]}")
    macros = subprocess.run([cxx, *FLAGS, "-dM", "-E", "-x", "c++", os.devnull], capture_output=True, text=True)
    defined = {line.split()[1] for line in macros.stdout.splitlines() if line.startswith("#define ")}
    out.with_suffix(".json").write_text(json.dumps({"isa": sorted(f for m, f in ISA.items() if m in defined)}))


def _unsupported(lib: Path) -> list[str]:
    """The instruction sets the library at `lib` was built to use that this CPU lacks
    (nothing when the CPU's flags are unknown); a library with no record counts as unsafe."""
    try:
        isa = json.loads(lib.with_suffix(".json").read_text())["isa"]
    except (OSError, ValueError, KeyError, TypeError):
        return ["(no record of its instruction sets)"]
    host = runtime.cpu_flags()
    return [flag for flag in isa if host and flag not in host]


def available() -> bool:
    """Whether the kernels are compiled and registered with XLA's CPU backend (tried once)."""
    if "ok" not in _state:
        if os.environ.get("SPECJAX_CPU_KERNELS", "").lower() in ("off", "0", "false"):
            _state.update(ok=False, why="SPECJAX_CPU_KERNELS=off")
        else:
            try:
                lib = ctypes.cdll.LoadLibrary(str(_build()))
                for target, symbol in TARGETS.items():
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
                _state.update(ok=True, why="", panel=int(lib.SpecjaxPanelWidth()), q8=int(lib.SpecjaxQ8Group()))
            except (OSError, RuntimeError, AttributeError) as err:
                _state.update(ok=False, why=str(err))
                warnings.warn(f"specjax: CPU kernels unavailable, using XLA's ops: {err}",
                              RuntimeWarning, stacklevel=2)
    return bool(_state["ok"])


def _on_cpu(*arrays: jax.Array) -> bool:
    return all(a.dtype == jnp.float32 for a in arrays) and runs()


def runs() -> bool:
    """Whether the kernels run here (the CPU backend, compiled and registered): then weights
    are packed at load, and a 16-bit checkpoint can stay in 16 bits."""
    return jax.default_backend() == "cpu" and available()


def _packable(w: Any) -> bool:
    return w.ndim == 2 and jnp.dtype(w.dtype) in PANEL_DTYPES and runs()


def applies(q: jax.Array, pool: jax.Array) -> bool:
    """Whether a step with queries q [B, T, H, E] over `pool` should use the attention kernel
    (it works row by row, so the limit is on one row's queries)."""
    rows = q.shape[1] * (q.shape[2] // pool.shape[1])
    return rows <= MAX_ROWS and q.shape[3] in HEAD_DIMS and pool.dtype in POOL_DTYPES and _on_cpu(q)


def applies_write(pool: jax.Array) -> bool:
    """Whether new keys and values (of any float dtype) should go into `pool` through
    `kv_write`."""
    return pool.dtype in POOL_DTYPES and runs()


def kv_write(k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array, k: jax.Array, v: jax.Array,
             page_table: jax.Array, start: jax.Array, fallback: Callable[..., jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Both pools [L, K, P, Z, E] with layer `layer`'s entries k, v [B, T, K, E] stored at
    positions start[b] + t (through `page_table` [B, Pr]; past Pr * Z dropped), in place.
    The entries are widened to float32 first (exact: 16-bit entries read back from a pool
    by tree compaction, or a 16-bit model's); a bfloat16 pool stores each rounded to
    nearest even (XLA's convert).

    `fallback(pool, layer, new, page_table, start)` (XLA ops, one pool) runs under `jax.vmap`."""
    _require()
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)

    @jax.custom_batching.custom_vmap
    def call(*args):
        out = (jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype), jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype))
        return tuple(jax.ffi.ffi_call("specjax_kv_write" + POOL_DTYPES[k_pool.dtype], out,
                                      input_output_aliases={0: 0, 1: 1})(*args))

    @call.def_vmap
    def _(axis_size, in_batched, kp, vp, layer, k, v, table, start):
        args = [kp, vp, layer, k, v, table, start]
        kp, vp, layer, k, v, table, start = [a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
                                             for a, batched in zip(args, in_batched)]
        write = jax.vmap(fallback)
        return (write(kp, layer, k, table, start), write(vp, layer, v, table, start)), (True, True)

    return call(k_pool, v_pool, jnp.asarray(layer, jnp.int32), k, v, page_table.astype(jnp.int32),
                start.astype(jnp.int32))


def paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array,
                    slots: jax.Array, q_pos: jax.Array, base: jax.Array, bits: jax.Array,
                    fallback: Callable[..., jax.Array]) -> jax.Array:
    """Attention of q [B, T, H, E] over layer `layer` of the pools [L, K, P, Z, E]; slots
    [B, N] is the pool slot of each position of a row (`kv.row_slots`). Query t of row b
    sees the positions up to q_pos[b, t], except that of base[b] + j (j < 32) it sees only
    those with bit j of bits[b, t] set (`qwen3.visible`): [B, T, H*E]. The pools are float32
    or bfloat16 (`POOL_DTYPES`), widened exactly as they are read.

    `fallback` (same arguments and result, in XLA ops) runs under `jax.vmap` (one pool per
    mapped element, e.g. batched reply generation for drafter training)."""
    _require()
    b, t, h, e = q.shape

    @jax.custom_batching.custom_vmap
    def call(*args):
        return jax.ffi.ffi_call("specjax_paged_attention" + POOL_DTYPES[k_pool.dtype],
                                jax.ShapeDtypeStruct(q.shape, jnp.float32))(*args)

    @call.def_vmap
    def _(axis_size, in_batched, *args):
        args = [a if batched else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, batched in zip(args, in_batched)]
        return jax.vmap(lambda *a: fallback(*a).reshape(*a[0].shape))(*args), True

    out = call(q, k_pool, v_pool, jnp.asarray(layer, jnp.int32), slots.astype(jnp.int32), q_pos.astype(jnp.int32),
               base.astype(jnp.int32), bits.astype(jnp.int32))
    return out.reshape(b, t, h * e)


def panel_width() -> int:
    """Outputs per panel of a packed weight (`Packed`): 64 where the kernels are built with
    AVX-512 (a decode step reads a panel's columns as one stream), 16 otherwise (a line of
    two eight-float vectors per panel); csrc/matmul.cc."""
    _require()
    return int(_state["panel"])


def q8_group() -> int:
    """Columns per output an int8 weight's panels interleave (`Packed`): 4 where the kernels
    are built with AVX512-VNNI (one `vpdpbusd` lane multiplies four), 1 otherwise;
    csrc/matmul.cc."""
    _require()
    return int(_state["q8"])


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(x, k)` over the last axis, the same values and indices (XLA's total
    order on floats, the lower index first among equal values): by the `top_k` kernel for
    float32 on CPU (`csrc/top_k.cc`: 17 -> ~3.5 us for a row of 8192), XLA's TopK
    otherwise."""
    if x.dtype != jnp.float32 or x.ndim == 0 or not 1 <= k <= x.shape[-1] or not runs():
        return jax.lax.top_k(x, k)

    @jax.custom_batching.custom_vmap
    def call(x):
        flat = x.reshape(-1, x.shape[-1])
        out = [jax.ShapeDtypeStruct((flat.shape[0], k), dtype) for dtype in (jnp.float32, jnp.int32)]
        values, indices = jax.ffi.ffi_call("specjax_top_k", out)(flat, k=np.int64(k))
        return values.reshape(*x.shape[:-1], k), indices.reshape(*x.shape[:-1], k)

    @call.def_vmap
    def _(axis_size, in_batched, x):  # a batch is more rows
        return top_k(x, k), (True, True)

    return call(x)


def _require() -> None:
    if not available():
        raise RuntimeError(f"the CPU kernels are unavailable: {_state['why']}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Packed:
    """A float32 weight [N, D] (HF orientation) stored for `matmul` as panels
    [ceil(N/P), D, P] in float32, bfloat16 or float16, P = `panel_width()`: output n is
    panels[n // P, :, n % P], the last panel zero-padded. `pack_tree` makes them at load
    where the kernel runs; `unpack_tree` gives the HF layout back. Whatever the panels
    hold, the weight's values are float32 (`dtype`): what `matmul` computes with, `rows`
    and `unpack` return.

    An int8 weight (`quantize`) has int8 panels, whose columns may be interleaved by
    `group` (`q8_group`): [ceil(N/P), D / group, P * group], output n's columns k .. k +
    group - 1 side by side; and `scales` [ceil(N/P), ceil(D/32), P]. Its value at (n, k)
    is q * scale of (n, k // 32) (`unpack` and `rows` give it in float32). `matmul`
    multiplies it as llama.cpp multiplies q8_0 weights: x quantized per row and block of
    32 columns, integer dot products per block, each scaled by both scales."""

    panels: jax.Array
    n: int = dataclasses.field(metadata={"static": True})
    scales: jax.Array | None = None

    @property
    def group(self) -> int:
        """Columns per output side by side in the panels (1 but for some int8 weights)."""
        return 1 if self.scales is None else self.panels.shape[-1] // self.scales.shape[-1]

    @property
    def width(self) -> int:
        """Outputs per panel."""
        return self.panels.shape[-1] // self.group

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.panels.shape[:-3], self.n, self.panels.shape[-2] * self.group)

    @property
    def dtype(self) -> Any:
        return jnp.dtype(jnp.float32)

    @property
    def stored(self) -> Any:
        """The panels' dtype: what a step reads from memory."""
        return self.panels.dtype

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def unpack(self) -> jax.Array:
        panels = _columns(self.panels, self.group)
        *batch, _, d, _ = panels.shape  # batch: e.g. per-example gradients under vmap
        values = panels.astype(self.dtype)
        if self.scales is not None:
            values = values * jnp.repeat(self.scales, Q8_BLOCK, axis=-2)[..., :d, :]
        return jnp.swapaxes(values, -1, -2).reshape(*batch, -1, d)[..., :self.n, :]


def _panels(rows: jax.Array) -> jax.Array:
    """[N, C] as [ceil(N/P), C, P] for P = `panel_width()`: row n at [n // P, :, n % P],
    zero-padded."""
    n, c = rows.shape
    width = panel_width()
    padded = jnp.pad(jnp.asarray(rows), ((0, -n % width), (0, 0)))
    return jnp.swapaxes(padded.reshape(-1, width, c), 1, 2)


def _interleave(panels: jax.Array, group: int) -> jax.Array:
    """Panels [..., D, P] as [..., D / group, P * group]: each output's columns k .. k +
    group - 1 side by side (the layout of `vpdpbusd`'s lanes)."""
    *batch, d, width = panels.shape
    return jnp.swapaxes(panels.reshape(*batch, d // group, group, width), -1, -2).reshape(
        *batch, d // group, width * group)


def _columns(panels: jax.Array, group: int) -> jax.Array:
    """`_interleave` undone: [..., D / group, P * group] as [..., D, P]."""
    *batch, dg, wide = panels.shape
    return jnp.swapaxes(panels.reshape(*batch, dg, wide // group, group), -1, -2).reshape(
        *batch, dg * group, wide // group)


def pack(w: jax.Array) -> Packed:
    """The weight [N, D] as panels (see `Packed`) of its own dtype (float32, bfloat16 or float16)."""
    if jnp.dtype(w.dtype) not in PANEL_DTYPES:
        raise ValueError(f"pack: weights are float32, bfloat16 or float16, got {jnp.dtype(w.dtype).name}")
    return Packed(_panels(w), w.shape[0])


def quantize(w: jax.Array) -> Packed:
    """The weight [N, D] in int8 with a float32 scale per output and block of 32 input
    columns (llama.cpp's q8_0 scheme): scale = max |w| over the block / 127 and q =
    round(w / scale), so each value is within scale / 2 of w. A different model from w.
    The panels interleave `q8_group()` columns where D is a multiple of it."""
    n, d = w.shape
    w = jnp.asarray(w, jnp.float32)
    blocks = jnp.pad(w, ((0, 0), (0, -d % Q8_BLOCK))).reshape(n, -1, Q8_BLOCK)
    scale = jnp.max(jnp.abs(blocks), axis=-1) / 127  # [N, ceil(D/32)]
    safe = jnp.where(scale > 0, scale, 1.0)[..., None]
    q = jnp.clip(jnp.round(blocks / safe), -127, 127).astype(jnp.int8).reshape(n, -1)[:, :d]
    return _q8(q, scale)


def _q8(q: jax.Array, scale: jax.Array) -> Packed:
    """int8 values [N, D] and their scales [N, ceil(D/32)] as a packed weight."""
    group = q8_group() if q.shape[1] % q8_group() == 0 else 1
    return Packed(_interleave(_panels(q), group), q.shape[0], _panels(scale))


def quantize_tree(params: Any) -> Any:
    """`params` with every 2-D weight in int8 (`quantize`); the CPU kernels must run."""
    if not runs():
        raise RuntimeError(f"int8 weights need the CPU kernels: {_state.get('why') or 'not on the CPU backend'}")
    return jax.tree.map(lambda w: quantize(w) if w.ndim == 2 else w, params)


def pack_tree(params: Any) -> Any:
    """`params` with every 2-D weight (float32, bfloat16 or float16) packed for `matmul`
    where the kernel runs; unchanged elsewhere. Loading does this once (a copy per weight).
    Packed weights compute in float32: a tree for 16-bit compute is not packed."""
    return jax.tree.map(lambda w: pack(w) if _packable(w) else w, params)


def unpack_tree(params: Any) -> Any:
    """`params` with every `Packed` weight back in the HF layout [N, D], in float32 (saving,
    sharding, training)."""
    return jax.tree.map(lambda w: w.unpack() if isinstance(w, Packed) else w, params,
                        is_leaf=lambda w: isinstance(w, Packed))


def rows(w: jax.Array | Packed, ids: jax.Array) -> jax.Array:
    """Rows `ids` of a weight [N, D], packed or not (embedding lookups): [*ids.shape, D].
    Out-of-range ids behave as jnp indexing does (negative ones wrap, the rest clamp), never
    as the panels' zero padding."""
    if isinstance(w, Packed):
        at = _gather_ids(w, ids)
        if w.group == 1:
            values = w.panels[at].astype(w.dtype)
        else:  # [P, D / G, P * G] viewed as [P, D / G, P, G]: an output's G-column groups
            *batch, dg, _ = w.panels.shape
            grouped = w.panels.reshape(*batch, dg, w.width, w.group)[at]
            values = grouped.reshape(*grouped.shape[:-2], dg * w.group).astype(w.dtype)
        if w.scales is not None:
            values = values * jnp.repeat(w.scales[at], Q8_BLOCK, axis=-1)[..., :values.shape[-1]]
        return values
    return w[ids]


def _gather_ids(w: Packed, ids: jax.Array) -> tuple[jax.Array, slice, jax.Array]:
    ids = jnp.asarray(ids)
    ids = jnp.clip(jnp.where(ids < 0, ids + w.n, ids), 0, w.n - 1)
    return ids // w.width, slice(None), ids % w.width


def select(w: jax.Array | Packed, ids: jax.Array) -> jax.Array | Packed:
    """The weight of outputs `ids` only (a head over a reduced vocabulary), stored as `w`
    is: packed in its panels' dtype, or a plain array."""
    if isinstance(w, Packed):
        at = _gather_ids(w, ids)
        if w.scales is None:
            return Packed(_panels(w.panels[at]), len(ids))
        return _q8(_columns(w.panels, w.group)[at], w.scales[at])
    return w[ids]


def rows_from(w: jax.Array | Packed, start: int) -> jax.Array | Packed:
    """The weight [N, D] without its first `start` output rows, packed or not (stored as
    `w` is)."""
    if not isinstance(w, Packed):
        return w[start:]
    width = w.width
    if start % width == 0:
        return Packed(w.panels[start // width:], w.n - start,
                      None if w.scales is None else w.scales[start // width:])
    return select(w, jnp.arange(start, w.n))


def _dense(x: jax.Array, w: Packed) -> jax.Array:
    """XLA's dot over the unpacked weight (where the kernel does not apply, and tangents);
    for an int8 weight, the kernel's arithmetic (`q8_matmul`)."""
    if w.scales is not None:
        d = w.shape[-1]
        return q8_matmul(x, _columns(w.panels, w.group)[..., :d, :], w.scales)[..., :w.n]
    return x @ w.unpack().T


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., D] quantized per block of 32 columns as the matmul kernel quantizes the rows
    it multiplies by an int8 weight (llama.cpp's q8_0 activations): scale d = max |x| /
    127 over the block (0 where that is below the smallest normal float), q = round(x *
    (1 / d)) to nearest even; a block with an infinity or NaN gets d = NaN and q = 0.
    Returns q [..., ceil(D/32) * 32] (float32, zero-padded) and d [..., ceil(D/32)]."""
    d_in = x.shape[-1]
    x = jnp.asarray(x, jnp.float32)
    blocks = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -d_in % Q8_BLOCK)]).reshape(
        *x.shape[:-1], -(-d_in // Q8_BLOCK), Q8_BLOCK)
    finite = jnp.all(jnp.isfinite(blocks), axis=-1)
    amax = jnp.max(jnp.where(jnp.isfinite(blocks), jnp.abs(blocks), 0), axis=-1)
    d = amax / 127
    d = jnp.where(finite, jnp.where(d < jnp.finfo(jnp.float32).tiny, 0.0, d), jnp.nan)
    inv = jnp.where(finite & (d != 0), 1 / jnp.where(d != 0, d, 1), 0)
    q = jnp.clip(jnp.round(jnp.where(finite[..., None], blocks, 0) * inv[..., None]), -127, 127)
    return q.reshape(*x.shape[:-1], blocks.shape[-2] * Q8_BLOCK), d


def q8_matmul(x: jax.Array, panels: jax.Array, scales: jax.Array) -> jax.Array:
    """x [..., D] times int8 panels [P, D, W] (columns not interleaved) with `scales` [P,
    ceil(D/32), W], in XLA ops: the kernel's arithmetic (the rows quantized by
    `quantize_rows`, exact integer block sums, each times the two scales), with the blocks
    summed in XLA's order."""
    q, d = quantize_rows(x)
    n_blocks = -(-x.shape[-1] // Q8_BLOCK)
    w = jnp.pad(panels, ((0, 0), (0, n_blocks * Q8_BLOCK - panels.shape[1]), (0, 0))).astype(jnp.float32)
    w = jnp.transpose(w.reshape(w.shape[0], n_blocks, Q8_BLOCK, w.shape[-1]), (1, 2, 0, 3)).reshape(
        n_blocks, Q8_BLOCK, -1)  # [blocks, 32, N]
    sums = jnp.einsum("...bk,bkn->...bn", q.reshape(*x.shape[:-1], n_blocks, Q8_BLOCK), w,
                      precision=jax.lax.Precision.HIGHEST)  # integers below 2^24: exact
    scale = jnp.swapaxes(scales, 0, 1).reshape(n_blocks, -1)
    return jnp.sum(sums * (scale * d[..., None]), axis=-2)


def _kernel(x: jax.Array, n: int, *weight: jax.Array) -> jax.Array:
    """The FFI call for x [M, D] and a packed weight's arrays (panels, or int8 panels and
    their scales); under vmap the mapped rows are just more rows."""
    target = "specjax_matmul_q8" if len(weight) == 2 else "specjax_matmul"

    @jax.custom_batching.custom_vmap
    def call(x, *weight):
        return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))(x, *weight)

    @call.def_vmap
    def _(axis_size, in_batched, x, *weight):
        x_batched, *w_batched = in_batched
        if any(w_batched):  # one weight per mapped element: XLA
            x = x if x_batched else jnp.broadcast_to(x, (axis_size, *x.shape))
            weight = [w if b else jnp.broadcast_to(w, (axis_size, *w.shape)) for w, b in zip(weight, w_batched)]
            return jax.vmap(lambda x, *w: _dense(x, Packed(w[0], n, *w[1:])))(x, *weight), True
        if not x_batched:
            return call(x, *weight), False
        flat = x.reshape(-1, x.shape[-1])
        return call(flat, *weight).reshape(axis_size, x.shape[1], n), True

    return call(x, *weight)


@partial(jax.custom_jvp, nondiff_argnums=(2,))
def _matmul(x: jax.Array, panels: jax.Array, n: int) -> jax.Array:
    return _kernel(x, n, panels)


@_matmul.defjvp
def _matmul_jvp(n, primals, tangents):
    """Differentiable like the XLA dot it replaces, in both modes: the tangent is XLA's dot
    (linear, so JAX transposes it for gradients; the FFI call has no transpose)."""
    x, panels = primals
    dx, dpanels = tangents
    return _kernel(x, n, panels), _dense(dx, Packed(panels, n)) + _dense(x, Packed(dpanels, n))


def matmul(x: jax.Array, w: Packed) -> jax.Array:
    """x [..., D] times a packed weight: [..., N]. The kernel where it runs (float32 x on
    CPU), for any number of rows, so a prefill chunk's rows get a decode step's bits; XLA's
    dot over the unpacked weight otherwise. An int8 weight is for inference: the kernel
    has no derivative rule for it."""
    if not (math.prod(x.shape[:-1]) >= 1 and x.dtype == jnp.float32 and runs()):
        return _dense(x, w)
    _require()
    flat = x.reshape(-1, x.shape[-1])
    y = _matmul(flat, w.panels, w.n) if w.scales is None else _kernel(flat, w.n, w.panels, w.scales)
    return y.reshape(*x.shape[:-1], w.n)
