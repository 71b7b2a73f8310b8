"""The C++ CPU attention kernel against XLA's attention (an independent formulation), on
random pools with shuffled page tables; its T-invariance; and the fallback."""

import json
import math
from fractions import Fraction

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from specjax import cpu_kernels, kv as kvlib, qwen3, runtime

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler for the CPU kernel")


def _case(rng, e: int, kv_heads: int, groups: int, rows: int = 2, pages: int = 6, page: int = 16, layers: int = 2):
    shape = (layers, kv_heads, rows * pages, page, e)
    k = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    table = jnp.asarray(rng.permutation(rows * pages).reshape(rows, pages), jnp.int32)
    return k, v, table, kvlib.row_slots(table, page)


def _view(q_pos, base, bits):
    base = q_pos[:, 0] if base is None else base
    return base, jnp.full(q_pos.shape, qwen3.ALL_BITS, jnp.int32) if bits is None else bits


def _xla(q, k, v, layer, slots, q_pos, base=None, bits=None):
    return qwen3._attend_layer(q, k, v, layer, slots, q_pos, *_view(q_pos, base, bits))


def _kernel(q, k, v, layer, slots, q_pos, base=None, bits=None):
    return cpu_kernels.paged_attention(q, k, v, layer, slots, q_pos, *_view(q_pos, base, bits),
                                       qwen3._attend_layer)


@pytest.mark.parametrize("e,kv_heads,groups,t", [(64, 2, 3, 1), (64, 2, 3, 8), (24, 2, 2, 5), (128, 1, 4, 3),
                                                 (16, 4, 1, 16)])
def test_matches_xla_attention(rng, e, kv_heads, groups, t):
    k, v, _, slots = _case(rng, e, kv_heads, groups)
    q = jnp.asarray(rng.standard_normal((2, t, kv_heads * groups, e)) * 2, jnp.float32)
    starts = rng.integers(0, 6 * 16 - t, size=2)
    q_pos = jnp.asarray(starts[:, None] + np.arange(t), jnp.int32)
    for layer in (0, 1):
        got = _kernel(q, k, v, jnp.int32(layer), slots, q_pos)
        want = _xla(q, k, v, layer, slots, q_pos)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)  # f32 composites, as the parity suite


def test_a_query_gets_the_same_bits_alone_or_with_others(rng):
    """What makes a verify step's attention equal the decode step's for the same token."""
    k, v, _, slots = _case(rng, 64, 2, 3)
    q = jnp.asarray(rng.standard_normal((2, 8, 6, 64)), jnp.float32)
    q_pos = jnp.asarray([[40 + i for i in range(8)], [70 + i for i in range(8)]], jnp.int32)
    together = np.asarray(_kernel(q, k, v, jnp.int32(1), slots, q_pos))
    for t in range(8):
        alone = _kernel(q[:1, t:t + 1], k, v, jnp.int32(1), slots[:1], q_pos[:1, t:t + 1])
        np.testing.assert_array_equal(np.asarray(alone)[0, 0], together[0, t])


def test_a_row_gets_the_same_bits_wherever_its_pages_lie(rng):
    """The same keys and values at the same positions, in pages placed elsewhere in the pool
    (a request alone or in a batch, after other requests freed pages): bitwise equal."""
    k, v, table, slots = _case(rng, 64, 2, 3)
    q = jnp.asarray(rng.standard_normal((2, 4, 6, 64)), jnp.float32)
    q_pos = jnp.asarray([[60 + i for i in range(4)], [85 + i for i in range(4)]], jnp.int32)
    before = np.asarray(_kernel(q, k, v, jnp.int32(1), slots, q_pos))
    move = rng.permutation(k.shape[2])  # new page of each old page
    inverse = np.argsort(move)
    k2, v2 = k[:, :, inverse], v[:, :, inverse]  # old page p now at move[p]
    table2 = jnp.asarray(move[np.asarray(table)], jnp.int32)
    after = np.asarray(_kernel(q, k2, v2, jnp.int32(1), kvlib.row_slots(table2, 16), q_pos))
    np.testing.assert_array_equal(before, after)


def test_unseen_slots_do_not_matter(rng):
    """Keys and values past a query's position, or in pages its row does not own, are never read."""
    k, v, table, slots = _case(rng, 32, 2, 2)
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 32)), jnp.float32)
    q_pos = jnp.asarray([[20, 21, 22], [50, 51, 52]], jnp.int32)
    before = np.asarray(_kernel(q, k, v, jnp.int32(0), slots, q_pos))
    hidden = np.ones(k.shape[2] * k.shape[3], bool)
    for b, top in enumerate(np.asarray(q_pos).max(axis=1)):
        hidden[np.asarray(slots)[b, :top + 1]] = False  # slots some row sees
    noise = rng.standard_normal(k.shape[:2] + (k.shape[2] * k.shape[3], k.shape[4])) * 100
    flat = lambda x: x.reshape(x.shape[0], x.shape[1], -1, x.shape[-1])
    k2 = jnp.where(hidden[None, None, :, None], flat(k) + noise, flat(k)).reshape(k.shape)
    v2 = jnp.where(hidden[None, None, :, None], flat(v) - noise, flat(v)).reshape(v.shape)
    after = np.asarray(_kernel(q, k2, v2, jnp.int32(0), slots, q_pos))
    assert hidden.sum() > 16
    np.testing.assert_array_equal(before, after)


def test_applies_only_where_it_can(monkeypatch):
    q = jnp.zeros((1, 1, 6, 64), jnp.float32)
    pool = jnp.zeros((2, 2, 4, 16, 64), jnp.float32)
    assert cpu_kernels.applies(q, pool) and cpu_kernels.applies(q, pool.astype(jnp.bfloat16))
    assert cpu_kernels.applies_write(pool) and cpu_kernels.applies_write(pool.astype(jnp.bfloat16))
    assert not cpu_kernels.applies(q.astype(jnp.bfloat16), pool.astype(jnp.bfloat16))
    assert not cpu_kernels.applies(q, pool.astype(jnp.float16)) and not cpu_kernels.applies_write(pool.astype(jnp.float16))
    assert not cpu_kernels.applies(jnp.zeros((1, 1, 6, 40)), jnp.zeros((2, 2, 4, 16, 40)))  # head_dim 40
    assert not cpu_kernels.applies(jnp.zeros((1, 64, 6, 64)), pool)  # a prefill chunk: XLA's GEMM
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("SPECJAX_CPU_KERNELS", "off")
    assert not cpu_kernels.available() and not cpu_kernels.applies(q, pool) and not cpu_kernels.applies_write(pool)
    with pytest.raises(RuntimeError, match="SPECJAX_CPU_KERNELS=off"):
        _kernel(q, pool, pool, jnp.int32(0), jnp.zeros((1, 64), jnp.int32), jnp.zeros((1, 1), jnp.int32))


def test_build_failure_falls_back_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(cpu_kernels, "_kernel_dir", lambda: tmp_path / "kernels")
    with pytest.warns(RuntimeWarning, match="using XLA's ops"):
        assert not cpu_kernels.available()


def _packed(w):
    return cpu_kernels.pack(jnp.asarray(w))


@pytest.mark.parametrize("m,d,n", [(1, 64, 100), (3, 384, 640), (8, 24, 33), (16, 128, 8192), (5, 20, 7), (13, 72, 130)])
def test_matmul_matches_numpy(rng, m, d, n):
    x = rng.standard_normal((m, d)).astype(np.float32)
    w = rng.standard_normal((n, d)).astype(np.float32)
    got = np.asarray(jax.jit(cpu_kernels.matmul)(x, _packed(w)))
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.astype(np.float64).T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stored", ["float32", "int8"])
def test_matmul_rows_get_the_same_bits_alone_or_together(rng, stored):
    d = 232  # int8 blocks of 32, the last partial
    x = rng.standard_normal((3, 20, d)).astype(np.float32)  # [..., D]: leading axes flattened
    w = jnp.asarray(rng.standard_normal((300, d)).astype(np.float32))
    w = cpu_kernels.pack(w) if stored == "float32" else cpu_kernels.quantize(w)
    together = np.asarray(cpu_kernels.matmul(x, w))
    assert together.shape == (3, 20, 300)
    for i in (0, 1, 2):
        for t in (0, 5, 19):
            np.testing.assert_array_equal(np.asarray(cpu_kernels.matmul(x[i, t], w)), together[i, t])
    many = np.asarray(cpu_kernels.matmul(x.reshape(60, d), w))  # more rows than a pass holds (4 to 8)
    np.testing.assert_array_equal(many, together.reshape(60, 300))
    for m in (2, 6, 7, 8, 9, 17, 49):  # one pass (7 and 8 keep accumulators on the stack), or several
        np.testing.assert_array_equal(np.asarray(cpu_kernels.matmul(x.reshape(60, d)[:m], w)), many[:m])
    want = x.reshape(60, d).astype(np.float64) @ np.asarray(w.unpack(), np.float64).T if stored == "float32" else \
        _q8_reference(x.reshape(60, d), w)
    np.testing.assert_allclose(many, want, rtol=1e-4, atol=1e-4)


def test_matmul_derivatives_are_the_dots_in_both_modes(rng):
    x = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((24, 32)), jnp.float32)  # 24 rows: the last panel padded
    loss = lambda f: lambda x, w: jnp.sum(jnp.tanh(f(x, w)))
    gx, gw = jax.grad(loss(cpu_kernels.matmul), argnums=(0, 1))(x, _packed(w))
    want = jax.grad(loss(lambda x, w: x @ w.T), argnums=(0, 1))(x, w)
    for a, b in zip((gx, gw.unpack()), want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    assert not np.asarray(gw.panels[-1, :, 24 % cpu_kernels.panel_width():]).any()  # no gradient into the padding
    dx, dw = (jnp.asarray(rng.standard_normal(a.shape), jnp.float32) for a in (x, w))
    _, got = jax.jvp(loss(cpu_kernels.matmul), (x, _packed(w)), (dx, _packed(dw)))
    _, want = jax.jvp(loss(lambda x, w: x @ w.T), (x, w), (dx, dw))
    np.testing.assert_allclose(float(got), float(want), rtol=1e-4)
    per_row = jax.vmap(jax.grad(loss(cpu_kernels.matmul), argnums=1), (0, None))(x[:, None], _packed(w))
    assert per_row.shape == (4, 24, 32)  # a batch of packed gradients unpacks
    np.testing.assert_allclose(np.asarray(per_row.unpack().sum(0)), np.asarray(gw.unpack()),
                               rtol=1e-4, atol=1e-5)


def test_packing_round_trips_and_gathers_rows(rng):
    p = cpu_kernels.panel_width()
    w = rng.standard_normal((2 * p + 9, 24)).astype(np.float32)  # the last panel padded
    packed = _packed(w)
    assert packed.shape == (2 * p + 9, 24) and packed.panels.shape == (3, 24, p)
    np.testing.assert_array_equal(np.asarray(packed.unpack()), w)
    np.testing.assert_array_equal(np.asarray(packed.panels[2, :, 8]), w[2 * p + 8])  # output n at [n // p, :, n % p]
    np.testing.assert_array_equal(np.asarray(packed.panels[1, :, 0]), w[p])
    assert not np.asarray(packed.panels[2, :, 9:]).any()
    ids = jnp.asarray([[0, 2 * p + 8], [p + 1, p]])
    np.testing.assert_array_equal(np.asarray(cpu_kernels.rows(packed, ids)), w[np.asarray(ids)])
    wild = jnp.asarray([-1, 2 * p + 9, 2 * p + 12, 3 * p - 1])  # out of range: as jnp indexing, not the padding
    np.testing.assert_array_equal(np.asarray(cpu_kernels.rows(packed, wild)), np.asarray(jnp.asarray(w)[wild]))
    tree = {"w": jnp.asarray(w), "norm": jnp.ones(24), "half": jnp.asarray(w, jnp.bfloat16),
            "wide": np.asarray(w, np.float64)}
    packed_tree = cpu_kernels.pack_tree(tree)
    assert isinstance(packed_tree["w"], cpu_kernels.Packed)
    assert not isinstance(packed_tree["norm"], cpu_kernels.Packed)  # not a weight matrix
    assert packed_tree["half"].stored == jnp.bfloat16 and packed_tree["half"].dtype == jnp.float32
    assert not isinstance(packed_tree["wide"], cpu_kernels.Packed)  # no float64 kernel
    unpacked = cpu_kernels.unpack_tree(packed_tree)
    np.testing.assert_array_equal(np.asarray(unpacked["w"]), w)
    assert unpacked["half"].dtype == jnp.float32  # a packed weight's values are float32
    np.testing.assert_array_equal(np.asarray(unpacked["half"]), np.asarray(jnp.asarray(w, jnp.bfloat16), np.float32))


def _sixteen_bit(rng, shape, dtype):
    """Random 16-bit weights including what widening must get right: zeros of both signs,
    subnormals, the largest finite values (inf and NaN are no weights and stay out)."""
    w = rng.standard_normal(shape).astype(np.float32)
    w.flat[:6] = [0.0, -0.0, 6e-8, -3e-5, 65504.0, -65504.0] if dtype == jnp.float16 else \
                 [0.0, -0.0, 1e-39, -5e-40, 3e38, -3e38]
    return jnp.asarray(w, dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("m,d,n", [(1, 64, 100), (8, 24, 33), (13, 48, 64)])
def test_16_bit_panels_give_the_bits_of_the_same_weights_in_float32(rng, dtype, m, d, n):
    """Widening is exact, so every output is bitwise the float32 kernel's on the widened
    weights, for whole and partial panels and any number of rows."""
    x = jnp.asarray(rng.standard_normal((m, d)) * 1e-3, jnp.float32)  # small x: no overflow on 3e38
    w16 = _sixteen_bit(rng, (n, d), dtype)
    widened = np.asarray(w16, np.float32)
    packed = _packed(w16)
    assert packed.stored == dtype and packed.panels.nbytes == 2 * packed.panels.size
    np.testing.assert_array_equal(np.asarray(packed.unpack()), widened)
    got = np.asarray(jax.jit(cpu_kernels.matmul)(x, packed))
    np.testing.assert_array_equal(got, np.asarray(cpu_kernels.matmul(x, _packed(widened))))
    np.testing.assert_allclose(got, np.asarray(x, np.float64) @ widened.astype(np.float64).T, rtol=1e-4, atol=1e-4)
    ids = jnp.asarray([0, 1, 2, 5, n - 1])
    np.testing.assert_array_equal(np.asarray(cpu_kernels.rows(packed, ids)), widened[np.asarray(ids)])
    head = cpu_kernels.select(packed, ids)  # a reduced head keeps the storage
    assert head.stored == dtype
    np.testing.assert_array_equal(np.asarray(head.unpack()), widened[np.asarray(ids)])


def _round32(v: Fraction) -> float:
    """v rounded to the nearest float32, ties to even (normal range)."""
    if v == 0:
        return 0.0
    e = math.floor(math.log2(abs(v)))
    e += abs(v) >= Fraction(2) ** (e + 1)  # (log2 of a huge or tiny fraction may be off by one)
    e -= abs(v) < Fraction(2) ** e
    step = Fraction(2) ** (e - 23)
    return float(round(v / step) * step)


def _fma32(a: float, b: float, c: float) -> float:
    """float32 fused multiply-add: a * b + c rounded once."""
    return _round32(Fraction(a) * Fraction(b) + Fraction(c))


def _q8_rows(x):
    """Each row of x [M, D] quantized per block of 32 columns as llama.cpp's
    quantize_row_q8_0 does, in NumPy float32: d = max |x| / 127, q = x * (1 / d) rounded to
    nearest even (np.rint); a block with a NaN or infinity gets d = NaN, q = 0, and one whose
    d would be subnormal d = 0, q = 0. Returns q
    (int64, [M, blocks, 32], zero-padded) and d [M, blocks]."""
    m, d_in = x.shape
    blocks = np.zeros((m, -(-d_in // 32) * 32), np.float32)
    blocks[:, :d_in] = x
    blocks = blocks.reshape(m, -1, 32)
    ok = np.isfinite(blocks).all(-1)
    d = np.abs(np.where(ok[..., None], blocks, 0)).max(-1) / np.float32(127)
    d = np.where(ok, np.where(d < np.finfo(np.float32).tiny, np.float32(0), d), np.float32(np.nan))
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(ok & (d != 0), np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(np.where(ok[..., None], blocks, np.float32(0)) * inv[..., None])
    return np.clip(q, -127, 127).astype(np.int64), d.astype(np.float32)


def _q8_weight(w):
    """An int8 weight's values q [N, D] and scales [N, blocks] out of its panels."""
    cols = np.asarray(cpu_kernels._columns(w.panels, w.group))
    ints = np.swapaxes(cols, 1, 2).reshape(-1, cols.shape[1])[:w.n].astype(np.int64)
    scales = np.swapaxes(np.asarray(w.scales), 1, 2).reshape(-1, w.scales.shape[1])[:w.n]
    return ints, scales


def _q8_reference(x, w):
    """x times an int8 weight as llama.cpp's q8_0 kernels compute it: exact integer dot
    products per block of 32 columns, each times the weight's and the row's scales, in
    float64."""
    q, d = _q8_rows(np.asarray(x, np.float32))
    ints, scales = _q8_weight(w)
    ints = np.pad(ints, ((0, 0), (0, q.shape[1] * 32 - ints.shape[1]))).reshape(len(ints), -1, 32)
    sums = np.einsum("mbk,nbk->mnb", q, ints)  # int64: exact
    return (sums * scales[None].astype(np.float64) * d[:, None].astype(np.float64)).sum(-1)


@pytest.mark.parametrize("m,d,n", [(1, 64, 100), (8, 40, 33), (13, 96, 64), (3, 36, 70), (2, 30, 70)])
def test_int8_weights_round_trip_within_half_a_scale_and_compute_their_values(rng, m, d, n):
    """quantize: each value within scale / 2 of the weight (scale = block max |w| / 127, a
    block of 32 columns, D = 40: a partial one; a zero block stays zero). matmul multiplies
    as llama.cpp's q8_0 kernels do: each row of x quantized per block the same way (NumPy
    re-derivation), the block's integer dot product times (weight scale x row scale, rounded
    to float32) added to the output by one float32 FMA, block after block: bitwise an exact
    re-derivation (in fractions) for a few outputs of every row. The interleaved panels
    (`q8_group`, VNNI) and plain ones (the FMA path, also what a D that is no multiple of
    the group gets: D = 30) give the same bits, and XLA's version of the arithmetic (the
    kernel's fallback) agrees within rounding."""
    w = rng.standard_normal((n, d)).astype(np.float32) * rng.uniform(0.01, 3, (n, 1)).astype(np.float32)
    w[0, :32] = 0.0
    q = cpu_kernels.quantize(jnp.asarray(w))
    p = cpu_kernels.panel_width()
    group = cpu_kernels.q8_group() if d % cpu_kernels.q8_group() == 0 else 1
    assert q.stored == jnp.int8 and q.group == group and q.shape == (n, d)
    assert q.panels.shape == (-(-n // p), d // group, p * group) and q.scales.shape == (-(-n // p), -(-d // 32), p)
    deq = np.asarray(q.unpack())
    blocks = [slice(b, min(b + 32, d)) for b in range(0, d, 32)]
    for sl in blocks:
        scale = np.abs(w[:, sl]).max(axis=1, keepdims=True) / 127
        # float32 slack: w / scale and q * scale each round at |q| <= 127 (a few 2^-24 ulps of 127
        # scales, about 3e-5 scale at most; seen: 1.0e-6), far below the full step a wrong q costs
        assert (np.abs(deq[:, sl] - w[:, sl]) <= scale * (0.5 + 2.0 ** -15) + 1e-30).all()
    assert not deq[0, :32].any()
    x = np.asarray(rng.standard_normal((m, d)), np.float32) * rng.uniform(0.01, 100, (m, 1)).astype(np.float32)
    x[0, :32] = 0.0  # a zero block of x: scale 0, adds nothing
    got = np.asarray(jax.jit(cpu_kernels.matmul)(jnp.asarray(x), q))
    # float32 sums of the block terms err by a few ulps of the terms' size, not of the result
    # (which may cancel to far less)
    slack = 4e-6 * (np.abs(x).astype(np.float64) @ np.abs(deq).astype(np.float64).T) + 1e-6
    assert (np.abs(got - _q8_reference(x, q)) <= slack).all()
    plain = cpu_kernels.Packed(cpu_kernels._columns(q.panels, q.group), n, q.scales)  # not interleaved
    np.testing.assert_array_equal(np.asarray(cpu_kernels.matmul(jnp.asarray(x), plain)), got)
    assert (np.abs(np.asarray(cpu_kernels._dense(jnp.asarray(x), q)) - got) <= slack).all()
    xq, xd = _q8_rows(x)
    ints, scales = _q8_weight(q)
    for j in (0, 1, n // 2, n - 1):
        for r in range(m):
            out = 0.0
            for b, sl in enumerate(blocks):
                part = int(np.dot(xq[r, b, :sl.stop - sl.start], ints[j, sl]))
                out = _fma32(float(part), float(np.float32(scales[j, b]) * xd[r, b]), out)
            assert got[r, j] == np.float32(out), (r, j)
    ids = jnp.asarray([0, 5, n - 1])
    np.testing.assert_array_equal(np.asarray(cpu_kernels.rows(q, ids)), deq[np.asarray(ids)])
    head = cpu_kernels.select(q, ids)
    assert head.stored == jnp.int8 and head.group == q.group
    np.testing.assert_array_equal(np.asarray(head.unpack()), deq[np.asarray(ids)])
    np.testing.assert_array_equal(np.asarray(cpu_kernels.matmul(jnp.asarray(x), head)), got[:, np.asarray(ids)])


def test_int8_weights_off_a_panel_boundary_and_empty_rows(rng):
    """`rows_from` at an output that starts no panel keeps int8 storage and arithmetic (each
    output's bits as in the whole weight), and no rows give an empty result, as for float
    weights."""
    w = cpu_kernels.quantize(jnp.asarray(rng.standard_normal((150, 64)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    tail = cpu_kernels.rows_from(w, 10)
    assert isinstance(tail, cpu_kernels.Packed) and tail.stored == jnp.int8 and tail.shape == (140, 64)
    np.testing.assert_array_equal(np.asarray(cpu_kernels.matmul(x, tail)), np.asarray(cpu_kernels.matmul(x, w))[:, 10:])
    assert cpu_kernels.matmul(jnp.zeros((0, 64)), w).shape == (0, 150)
    assert cpu_kernels.matmul(jnp.zeros((2, 0, 64)), w).shape == (2, 0, 150)


def test_int8_matmul_of_a_row_with_an_infinity_or_nan_is_nan_for_that_row_only(rng):
    """A block of x holding an infinity or a NaN has no scale: that row's outputs are NaN
    (not a finite value made by dropping the entry), the other rows' unchanged."""
    w = cpu_kernels.quantize(jnp.asarray(rng.standard_normal((40, 64)), jnp.float32))
    x = rng.standard_normal((4, 64)).astype(np.float32)
    clean = np.asarray(cpu_kernels.matmul(jnp.asarray(x), w))
    x[1, 3], x[2, 40] = np.nan, -np.inf
    got = np.asarray(cpu_kernels.matmul(jnp.asarray(x), w))
    assert np.isnan(got[1:3]).all()
    np.testing.assert_array_equal(got[[0, 3]], clean[[0, 3]])


_WIDEN_ALL = r"""
#include <cstdio>
#include "vec8.h"
int main() {  // every 16-bit pattern widened, as float32 bits on stdout
  for (unsigned hi = 0; hi < 65536; hi += 8) {
    uint16_t in[8];
    for (int j = 0; j < 8; ++j) in[j] = uint16_t(hi + j);
    const specjax::V8 f = specjax::Widen(reinterpret_cast<const specjax::FORMAT*>(in));
    std::fwrite(&f, sizeof f, 1, stdout);
  }
}
"""


@pytest.mark.parametrize("fmt", ["BF16", "F16"])
def test_widening_every_16_bit_pattern_without_f16c(tmp_path, fmt):
    """The portable widening (what machines without F16C run, e.g. ARM) against NumPy's
    conversion, for all 65536 patterns (NaNs compared as NaN)."""
    import shutil
    import subprocess

    import ml_dtypes

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "widen.cc"
    src.write_text(_WIDEN_ALL.replace("FORMAT", fmt))
    flags = ["-O2", "-std=c++17", "-ffp-contract=off", f"-I{cpu_kernels.CSRC}"]
    if subprocess.run([cxx, "-mno-f16c", "-x", "c++", "-fsyntax-only", "-"], input="", text=True,
                      capture_output=True).returncode == 0:
        flags.append("-mno-f16c")  # x86: the portable path, not the F16C instruction
    subprocess.run([cxx, *flags, str(src), "-o", str(tmp_path / "widen")], check=True, timeout=120)
    got = np.frombuffer(subprocess.run([str(tmp_path / "widen")], capture_output=True, check=True).stdout, np.float32)
    patterns = np.arange(65536, dtype=np.uint16).view(ml_dtypes.bfloat16 if fmt == "BF16" else np.float16)
    want = patterns.astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_a_prefill_chunk_gets_each_rows_decode_bits(rng):
    x = rng.standard_normal((1, 133, 48)).astype(np.float32)  # a prefill chunk: many passes of rows
    w = _packed(rng.standard_normal((40, 48)).astype(np.float32))
    chunk = np.asarray(cpu_kernels.matmul(x, w))
    np.testing.assert_allclose(chunk, x @ np.asarray(w.unpack()).T, rtol=1e-5, atol=1e-5)
    for t in (0, 9, 132):
        np.testing.assert_array_equal(np.asarray(cpu_kernels.matmul(x[:, t], w)), chunk[:, t])
    half = jnp.asarray(x, jnp.bfloat16)  # the kernel is float32 only: XLA's dot
    assert "specjax_matmul" not in jax.jit(cpu_kernels.matmul).lower(half, w).as_text()
    assert "specjax_matmul" in jax.jit(cpu_kernels.matmul).lower(x, w).as_text()


def test_under_vmap_matmul_and_attention_agree_with_xla(rng):
    """Mapped rows join the kernel's rows (matmul) or take XLA's path (attention, one pool each)."""
    x = jnp.asarray(rng.standard_normal((3, 4, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((40, 64)), jnp.float32)
    np.testing.assert_allclose(np.asarray(jax.vmap(cpu_kernels.matmul, (0, None))(x, _packed(w))),
                               np.asarray(x @ w.T), rtol=1e-4, atol=1e-4)
    x_many = jnp.asarray(rng.standard_normal((5, 4, 64)), jnp.float32)  # 20 mapped rows: one call
    np.testing.assert_allclose(np.asarray(jax.vmap(cpu_kernels.matmul, (0, None))(x_many, _packed(w))),
                               np.asarray(x_many @ w.T), rtol=1e-4, atol=1e-4)
    ws = jnp.asarray(rng.standard_normal((3, 40, 64)), jnp.float32)  # a weight per element
    got = jax.vmap(lambda x, w: cpu_kernels.matmul(x, _packed(w)))(x, ws)
    np.testing.assert_allclose(np.asarray(got), np.einsum("bmd,bnd->bmn", x, ws), rtol=1e-4, atol=1e-4)
    cases = [_case(np.random.default_rng(i), 32, 2, 2) for i in range(3)]
    k, v, slots = (jnp.stack([c[i] for c in cases]) for i in (0, 1, 3))
    q = jnp.asarray(rng.standard_normal((3, 2, 2, 4, 32)), jnp.float32)
    q_pos = jnp.asarray(np.tile([[30, 31], [60, 61]], (3, 1, 1)), jnp.int32)
    got = jax.vmap(_kernel, (0, 0, 0, None, 0, 0))(q, k, v, jnp.int32(1), slots, q_pos)
    want = jax.vmap(_xla, (0, 0, 0, None, 0, 0))(q, k, v, jnp.int32(1), slots, q_pos)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def _numpy_write(pool, layer, new, table, start):
    """The stores kv_write must make, re-derived: token t of row b at position start[b] + t."""
    pool = np.array(pool)
    z = pool.shape[3]
    for b in range(new.shape[0]):
        for t in range(new.shape[1]):
            pos = start[b] + t
            if pos < table.shape[1] * z:
                pool[layer, :, table[b, pos // z], pos % z] = new[b, t]
    return pool


def test_kv_write_stores_each_token_at_its_page_in_place(rng):
    k, v, table, _ = _case(rng, 32, 2, 1, rows=2, pages=3, page=8, layers=3)
    new_k, new_v = (rng.standard_normal((2, 6, 2, 32)).astype(np.float32) for _ in range(2))
    start = np.asarray([5, 20], np.int32)  # row 0 crosses a page; row 1 runs past its 24 slots
    want_k, want_v = (_numpy_write(p, 1, n, np.asarray(table), start) for p, n in ((k, new_k), (v, new_v)))
    write = jax.jit(lambda kp, vp, *a: kvlib.write_layer(kp, vp, *a, page_size=8), donate_argnums=(0, 1))
    assert cpu_kernels.applies_write(k)
    got_k, got_v = write(k, v, jnp.int32(1), new_k, new_v, table, start)
    np.testing.assert_array_equal(np.asarray(got_k), want_k)
    np.testing.assert_array_equal(np.asarray(got_v), want_v)
    hlo = write.lower(want_k, want_v, jnp.int32(1), new_k, new_v, table, start).compile().as_text()
    assert "specjax_kv_write" in hlo and " copy(" not in hlo  # the pools are updated where they are


@pytest.mark.parametrize("t,tree", [(1, False), (8, False), (7, True)])
def test_bfloat16_pools_give_the_bits_of_their_values_in_float32(rng, t, tree):
    """Pools kept in bfloat16 are widened exactly: the attention equals, bitwise, that over
    float32 pools holding the same values (a chain step, and a tree step's ancestor bits),
    and agrees with XLA's attention over the bfloat16 pools."""
    k, v, _, slots = _case(rng, 64, 2, 3)
    k16, v16 = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((2, t, 6, 64)) * 2, jnp.float32)
    q_pos = jnp.asarray(np.array([[40], [70]]) + np.arange(t), jnp.int32)
    base = bits = None
    if tree:
        base, bits = q_pos[:, 0], jnp.asarray(np.stack([_tree_bits(rng, t) for _ in range(2)]))
    got = np.asarray(_kernel(q, k16, v16, jnp.int32(1), slots, q_pos, base, bits))
    wide = np.asarray(_kernel(q, k16.astype(jnp.float32), v16.astype(jnp.float32), jnp.int32(1), slots, q_pos,
                              base, bits))
    np.testing.assert_array_equal(got, wide)
    want = np.asarray(_xla(q, k16, v16, 1, slots, q_pos, base, bits)).reshape(got.shape)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_kv_write_into_bfloat16_pools_rounds_to_nearest_even(rng):
    """Keys and values stored into bfloat16 pools are ml_dtypes' rounding of each float32
    (halfway cases to even, infinities, signed zeros, NaN kept a NaN), by the kernel and by
    XLA's path (under vmap) alike."""
    k, v, table, _ = _case(rng, 32, 2, 1, rows=2, pages=3, page=8, layers=2)
    k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    new = rng.standard_normal((2, 6, 2, 32)).astype(np.float32)
    bits = new.view(np.uint32)
    bits[0, 0, 0, :8] = (bits[0, 0, 0, :8] & 0xFFFF0000) | 0x8000  # exactly halfway: to the even neighbour
    bits[0, 0, 1, :4] = [0x7F800000, 0xFF800000, 0x80000000, 0x7F7FFFFF]  # inf, -inf, -0, largest float
    bits[0, 0, 1, 4] = 0x7FC00001  # a NaN
    start = np.asarray([5, 20], np.int32)
    want = _numpy_write(np.asarray(k).astype(np.float32), 1, new.astype(jnp.bfloat16).astype(np.float32),
                        np.asarray(table), start)
    write = jax.jit(lambda kp, vp, *a: kvlib.write_layer(kp, vp, *a, page_size=8))
    got_k, got_v = write(k, v, jnp.int32(1), new, -new, table, start)
    assert got_k.dtype == jnp.bfloat16 and "specjax_kv_write_bf16" in write.lower(
        k, v, jnp.int32(1), new, -new, table, start).compile().as_text()
    np.testing.assert_array_equal(np.asarray(got_k).astype(np.float32), want)  # (NaN where want is NaN)
    xla_k, _ = jax.vmap(lambda kp, vp, n: kvlib.write_layer(kp, vp, jnp.int32(1), n, n, table, start, page_size=8))(
        k[None], v[None], new[None])
    np.testing.assert_array_equal(np.asarray(xla_k[0]).astype(np.float32), want)


@pytest.mark.parametrize("pool_dtype", [jnp.float32, jnp.bfloat16])
def test_kv_write_takes_bfloat16_entries_through_the_kernel(rng, pool_dtype):
    """Entries that are already bfloat16 (read back from a bfloat16 pool by tree
    compaction, or a bfloat16 model's) are stored by the kernel as their exact values."""
    k, v, table, _ = _case(rng, 32, 2, 1, rows=2, pages=3, page=8, layers=2)
    k, v = k.astype(pool_dtype), v.astype(pool_dtype)
    new = jnp.asarray(rng.standard_normal((2, 6, 2, 32)), jnp.bfloat16)
    start = np.asarray([5, 20], np.int32)
    write = jax.jit(lambda kp, vp, *a: kvlib.write_layer(kp, vp, *a, page_size=8))
    assert "specjax_kv_write" in write.lower(k, v, jnp.int32(1), new, new, table, start).compile().as_text()
    got_k, got_v = write(k, v, jnp.int32(1), new, new, table, start)
    want = _numpy_write(np.asarray(k).astype(np.float32), 1, np.asarray(new).astype(np.float32), np.asarray(table),
                        start)
    assert got_k.dtype == pool_dtype
    np.testing.assert_array_equal(np.asarray(got_k).astype(np.float32), want)


def test_kv_write_under_vmap_takes_xla_path(rng):
    cases = [_case(np.random.default_rng(i), 16, 1, 1, rows=1, pages=2, page=4, layers=2) for i in range(3)]
    k, v, table = (jnp.stack([c[i] for c in cases]) for i in (0, 1, 2))
    new = jnp.asarray(rng.standard_normal((3, 1, 3, 1, 16)), jnp.float32)
    start = jnp.asarray([[0], [3], [6]], jnp.int32)
    got_k, got_v = jax.vmap(lambda kp, vp, n, t, s: kvlib.write_layer(kp, vp, jnp.int32(0), n, -n, t, s, page_size=4))(
        k, v, new, table, start)
    for i in range(3):
        args = (0, np.asarray(new[i]), np.asarray(table[i]), np.asarray(start[i]))
        np.testing.assert_array_equal(np.asarray(got_k[i]), _numpy_write(k[i], *args))
        np.testing.assert_array_equal(np.asarray(got_v[i]), _numpy_write(v[i], 0, -args[1], *args[2:]))


def _tree_bits(rng, t: int) -> np.ndarray:
    """Ancestor-or-self bits of a random tree of t nodes in parent-first order."""
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
    bits = np.zeros(t, np.int64)
    for i in range(t):
        bits[i] = (1 << i) | (bits[parent[i]] if i else 0)
    return bits.astype(np.uint32).view(np.int32)


@pytest.mark.parametrize("t", [2, 7, 16])
def test_tree_masks_match_a_brute_force_mask(rng, t):
    """A tree step: query i sees the prefix before the step's base and, of the step's own
    positions, only those its bits name. Against attention over an explicit mask built
    position by position here (and XLA's path)."""
    k, v, table, slots = _case(rng, 32, 2, 2)
    q = jnp.asarray(rng.standard_normal((2, t, 4, 32)), jnp.float32)
    base = rng.integers(0, 6 * 16 - t, size=2)
    q_pos = jnp.asarray(base[:, None] + np.arange(t), jnp.int32)
    bits = np.stack([_tree_bits(rng, t) for _ in range(2)])
    got = _kernel(q, k, v, jnp.int32(1), slots, q_pos, jnp.asarray(base, jnp.int32), jnp.asarray(bits))
    mask = np.zeros((2, t, slots.shape[1]), bool)
    for b in range(2):
        for i in range(t):
            mask[b, i, :base[b]] = True
            for j in range(t):
                mask[b, i, base[b] + j] = bool((int(bits[b, i]) >> j) & 1)
    keys = jnp.take(kvlib.layer_slots(k, 1), slots, axis=1).transpose(1, 0, 2, 3)
    values = jnp.take(kvlib.layer_slots(v, 1), slots, axis=1).transpose(1, 0, 2, 3)
    want = qwen3.attend_masked(q, keys, values, jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
    xla = _xla(q, k, v, 1, slots, q_pos, jnp.asarray(base, jnp.int32), jnp.asarray(bits))
    np.testing.assert_allclose(np.asarray(xla), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_a_library_built_for_other_instruction_sets_is_rebuilt_not_loaded(monkeypatch, tmp_path):
    """A kernel cache shared by two CPUs: the library is keyed by the CPU's flags, and one
    recorded as using an instruction set this CPU lacks is rebuilt (here: a stand-in
    compiler that records what it 'built for')."""
    monkeypatch.setattr(cpu_kernels, "_kernel_dir", lambda: tmp_path)
    built = []

    def compile_for(isa):
        def fake(cxx, out):
            built.append(isa)
            out.write_text("lib")
            out.with_suffix(".json").write_text(json.dumps({"isa": isa}))
        return fake

    monkeypatch.setenv("SPECJAX_CPU_FLAGS", "sse2 avx avx2 fma")
    monkeypatch.setattr(cpu_kernels, "_compile", compile_for(["avx", "avx2", "fma"]))
    lib = cpu_kernels._build()
    assert built == [["avx", "avx2", "fma"]] and cpu_kernels._build() == lib and len(built) == 1  # cached
    lib.with_suffix(".json").write_text(json.dumps({"isa": ["avx512f"]}))  # planted by another machine
    assert cpu_kernels._build() == lib and len(built) == 2  # rebuilt
    lib.with_suffix(".json").unlink()  # no record: not trusted either
    assert cpu_kernels._build() == lib and len(built) == 3
    monkeypatch.setenv("SPECJAX_CPU_FLAGS", "sse2 avx avx2 fma avx512f")
    other = cpu_kernels._build()
    assert other != lib and len(built) == 4  # another CPU: another key
    monkeypatch.setenv("SPECJAX_CPU_FLAGS", "sse2")  # the compiler targets more than the CPU says it has
    with pytest.raises(RuntimeError, match="avx, avx2, fma"):
        cpu_kernels._build()


def test_the_real_build_records_what_the_compiler_targets():
    lib = cpu_kernels._build()  # already built by the module's first kernel call
    isa = json.loads(lib.with_suffix(".json").read_text())["isa"]
    assert set(isa) <= runtime.cpu_flags()
    if runtime.platform.machine() == "x86_64":
        assert {"sse4_2"} <= set(isa)  # any x86-64 CPU this decade; -march=native must say so


def _same_top_k(x, k):
    want_v, want_i = jax.lax.top_k(jnp.asarray(x), k)
    got_v, got_i = jax.jit(lambda x: cpu_kernels.top_k(x, k))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(got_v).view(np.uint32), np.asarray(want_v).view(np.uint32))


@pytest.mark.parametrize("v,k", [(8192, 64), (8192, 1024), (1000, 7), (37, 37), (37, 1), (9, 5), (100, 99)])
def test_top_k_equals_xla(rng, v, k):
    """The top-k kernel gives lax.top_k's values and indices: random rows (logits-like and
    heavy-tailed), rows of few distinct values (ties: the lower index first), leading dims."""
    _same_top_k(rng.standard_normal((3, v)).astype(np.float32) * 4, k)
    _same_top_k(rng.standard_cauchy((2, 2, v)).astype(np.float32), k)
    _same_top_k(rng.integers(-2, 2, (4, v)).astype(np.float32), k)


def test_top_k_orders_special_values_as_xla(rng):
    """XLA's total order: -NaN < -inf < -0 < +0 < +inf < +NaN, then the lower index; blocks
    of -inf or -NaN (the least possible threshold) included."""
    neg_nan = np.array([0xFFFFFFFF, 0xFFC00000], np.uint32).view(np.float32)
    pool = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, *neg_nan], np.float32)
    for _ in range(20):
        x = rng.choice(pool, size=(3, 23))
        for k in (1, 5, 23):
            _same_top_k(x, k)
    _same_top_k(np.full((2, 16), neg_nan[0]), 4)
    _same_top_k(np.concatenate([np.full(8, -np.inf, np.float32), rng.standard_normal(8).astype(np.float32)])[None], 3)


def test_top_k_under_vmap_and_fallbacks(rng):
    x = jnp.asarray(rng.standard_normal((4, 3, 50)), jnp.float32)
    got = jax.vmap(lambda r: cpu_kernels.top_k(r, 6))(x)
    want = jax.lax.top_k(x, 6)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    ints = jnp.asarray(rng.integers(0, 9, (2, 30)), jnp.int32)  # not float32: XLA's TopK
    np.testing.assert_array_equal(np.asarray(cpu_kernels.top_k(ints, 4)[1]), np.asarray(jax.lax.top_k(ints, 4)[1]))
