"""The sampler: transformers' logits-processor semantics, position-keyed draws, frequencies."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from specjax import reductions
from specjax import sampling as smp
from specjax.sampling import Sampling, SamplingError
from conftest import assert_follows

COMBOS = list(itertools.product([0.7, 1.0, 1.5], [0, 1, 5, 40], [1.0, 0.9, 0.5], [0.0, 0.05, 0.3]))


def _hf_logprobs(logits: np.ndarray, s: Sampling) -> np.ndarray:
    x = torch.tensor(logits)
    procs = [TemperatureLogitsWarper(s.temperature)]
    if s.top_k:
        procs.append(TopKLogitsWarper(s.top_k))
    if s.top_p < 1.0:
        procs.append(TopPLogitsWarper(s.top_p))
    if s.min_p > 0.0:
        procs.append(MinPLogitsWarper(s.min_p))
    for p in procs:
        x = p(None, x)
    return torch.log_softmax(x, dim=-1).numpy()


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", COMBOS)
def test_transform_matches_transformers(rng, temperature, top_k, top_p, min_p):
    s = Sampling(temperature, top_k, top_p, min_p)
    logits = (rng.standard_normal((3, 64)) * 3).astype(np.float32)
    want = _hf_logprobs(logits, s)
    got = np.asarray(smp.transform(jnp.asarray(logits), s))
    assert np.array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    assert np.abs(got[finite] - want[finite]).max() <= 1e-5


def _wide_rows(rng, temperature: float = 1.0, v: int = 3000) -> np.ndarray:
    """Logit rows [9, v]. Three are built in tiers (the CANDIDATES largest logits, the rest of
    the WIDE_CANDIDATES largest, the others; noisy within each) whose masses at `temperature`
    put a top-p 0.5 .. 0.95 support inside the first tier, inside the first two, and past
    them, whatever the draw; six are Gaussian, from flat to peaked."""
    counts = np.array([smp.CANDIDATES, smp.WIDE_CANDIDATES - smp.CANDIDATES, v - smp.WIDE_CANDIDATES])
    masses = np.array([[0.99, 0.009, 0.001], [0.3, 0.699, 0.001], [0.05, 0.2, 0.75]])
    tiers = np.repeat(np.log(masses / counts), counts, axis=1) + 0.3 * rng.standard_normal((3, v))
    tiers = tiers[:, rng.permutation(v)] * temperature
    scales = np.array([0.1, 1.0, 2.0, 3.0, 10.0, 20.0])[:, None]
    return np.concatenate([tiers, rng.standard_normal((6, v)) * scales]).astype(np.float32)


def _top_mass(logits: np.ndarray, c: int) -> np.ndarray:
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.sort(p, axis=-1)[:, ::-1][:, :c].sum(axis=-1)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [(1.0, 0, 0.9, 0.0), (0.7, 0, 0.5, 0.0), (1.0, 0, 0.95, 0.05),
                                                           (1.3, 100, 0.9, 0.0), (1.0, 20, 0.9, 0.0)])
def test_top_p_matches_transformers_on_wide_vocabularies(rng, temperature, top_k, top_p, min_p):
    """Past the CANDIDATES largest logits: rows whose top-p support lies among them, among
    the WIDE_CANDIDATES largest only, and beyond those (checked on the data's own mass),
    against transformers."""
    s = Sampling(temperature, top_k, top_p, min_p)
    logits = _wide_rows(rng, temperature)
    if top_k == 0:
        narrow = _top_mass(logits / temperature, smp.CANDIDATES)
        wide = _top_mass(logits / temperature, smp.WIDE_CANDIDATES)
        assert (narrow > top_p + 0.01).any() and (wide < top_p - 0.01).any()
        assert ((narrow < top_p - 0.01) & (wide > top_p + 0.01)).any()
    want = _hf_logprobs(logits, s)
    got = np.asarray(smp.transform(jnp.asarray(logits), s))
    assert np.array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    assert np.abs(got[finite] - want[finite]).max() <= 1e-5


@pytest.mark.parametrize("v,peaked", [(300, True), (300, False), (1600, False)], ids=["peaked", "flat", "flat-wide"])
def test_top_p_tokens_follow_the_transformed_distribution(rng, v, peaked):
    """Top-p alone: a support inside the CANDIDATES largest logits, one inside the
    WIDE_CANDIDATES largest (both drawn over those candidates) and one wider (drawn over
    the vocabulary) all follow exp(transform)."""
    s = Sampling(temperature=1.0, top_p=0.9)
    logits = (rng.standard_normal(v) * 0.5).astype(np.float32)
    if peaked:  # ten likely tokens over a flat tail
        logits[rng.permutation(v)[:10]] += 6.0
    assert (_top_mass(logits[None], smp.CANDIDATES)[0] > 0.91) == peaked
    assert (_top_mass(logits[None], smp.WIDE_CANDIDATES)[0] > 0.91) == (v <= smp.WIDE_CANDIDATES)
    logprobs = np.asarray(smp.transform(jnp.asarray(logits), s), np.float64)
    assert np.isfinite(logprobs).sum() > 5
    n = 12000
    draws = jax.jit(lambda x, pos: smp.target_tokens(jnp.tile(x, (len(pos), 1)), pos,
                                                     jnp.uint32(int(rng.integers(1 << 30))), s))(
        jnp.asarray(logits), jnp.arange(n))
    assert_follows(np.bincount(np.asarray(draws), minlength=v), np.exp(logprobs))


def test_tiny_temperature_is_the_argmax_not_nan(rng):
    logits = jnp.asarray(rng.standard_normal((3, 200)).astype(np.float32) * 4)
    want = np.argmax(np.asarray(logits), axis=-1)
    for temperature in (1e-30, smp.MIN_TEMPERATURE):
        for top_k in (0, 20):
            s = Sampling(temperature=temperature, top_k=top_k)
            logp = np.asarray(smp.transform(logits, s))
            assert not np.isnan(logp).any()
            assert (np.argmax(logp, axis=-1) == want).all() and (logp.max(axis=-1) == 0).all()
            got = smp.target_tokens(logits, jnp.arange(3), jnp.uint32(1), s)
            assert np.asarray(got).tolist() == want.tolist()
    with pytest.raises(SamplingError, match="smallest normal"):
        Sampling(temperature=1e-44)  # subnormal: XLA would flush it to 0


def test_greedy_is_argmax_lowest_index(rng):
    logits = rng.standard_normal((4, 50)).astype(np.float32)
    logits[:, [3, 17, 40]] = 9.0  # a three-way tie for the max
    got = smp.target_tokens(jnp.asarray(logits), jnp.arange(4), jnp.uint32(0), Sampling())
    assert np.asarray(got).tolist() == [3, 3, 3, 3]


def test_same_seed_and_position_same_token(rng):
    s = Sampling(temperature=1.0)
    logits = jnp.asarray(rng.standard_normal((1, 1000)).astype(np.float32))
    step = jax.jit(lambda seed, pos: smp.target_tokens(logits, pos[None], seed, s)[0])  # one compile, 41 draws
    draw = lambda seed, pos: int(step(jnp.uint32(seed), jnp.int32(pos)))
    assert draw(5, 123) == draw(5, 123)
    # other positions / seeds give (almost surely) different tokens somewhere
    assert len({draw(5, p) for p in range(20)}) > 5
    assert len({draw(seed, 123) for seed in range(20)}) > 5


def test_empirical_frequencies_match_distribution(rng):
    s = Sampling(temperature=0.8, top_k=12, top_p=0.95)
    logits = jnp.asarray(rng.standard_normal(16).astype(np.float32) * 2)
    logprobs = smp.transform(logits, s)
    n = 20000
    draws = jax.vmap(lambda p: smp.sample(logprobs, smp.position_key(jnp.uint32(11), smp.TARGET, p)))(jnp.arange(n))
    assert_follows(np.bincount(np.asarray(draws), minlength=16), np.exp(np.asarray(logprobs, np.float64)))


@pytest.mark.parametrize("ties", [False, True], ids=["k-candidates", "ties-at-k"])
def test_target_tokens_follow_the_transformed_distribution(rng, ties):
    """target_tokens draws from exp(transform(...)) on both of its paths: Gumbel-max over
    the k candidates, and over the vocabulary when ties at the k-th logit widen the support."""
    s = Sampling(temperature=0.9, top_k=5, top_p=0.97)
    logits = rng.standard_normal(40).astype(np.float32)
    if ties:
        logits[np.argsort(logits)[-8:-4]] = np.sort(logits)[-5]  # 4 tokens tie at the 5th value
    logprobs = np.asarray(smp.transform(jnp.asarray(logits), s), np.float64)
    assert (np.isfinite(logprobs).sum() > s.top_k) == ties
    n = 12000
    draws = jax.jit(lambda pos: smp.target_tokens(jnp.tile(jnp.asarray(logits), (len(pos), 1)), pos,
                                                  jnp.uint32(int(rng.integers(1 << 30))), s))(jnp.arange(n))
    assert_follows(np.bincount(np.asarray(draws), minlength=40), np.exp(logprobs))


@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(temperature=float("nan")), dict(top_k=-2),
                                    dict(top_k=1.5), dict(top_p=0.0), dict(top_p=1.2), dict(min_p=-0.1),
                                    dict(min_p=2.0), dict(temperature="0.5"), dict(temperature=True),
                                    dict(top_p="0.5"), dict(min_p=None), dict(top_k="2"), dict(top_k=True),
                                    dict(top_k=np.bool_(True))])
def test_invalid_parameters_raise(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(SamplingError, match=name):
        Sampling(**{"temperature": 1, **kwargs})


def test_numpy_numbers_are_taken_as_python_ones():
    s = Sampling(temperature=np.float32(0.5), top_k=np.int64(2), top_p=np.float64(0.9), min_p=np.int8(0))
    assert s == Sampling(0.5, 2, 0.9, 0.0) and hash(s) == hash(Sampling(0.5, 2, 0.9, 0.0))
    assert [type(v) for v in (s.temperature, s.top_k, s.top_p, s.min_p)] == [float, int, float, float]


@pytest.mark.parametrize("s", [Sampling(temperature=0.7, top_k=6), Sampling(temperature=1.0, top_p=0.9)],
                         ids=["top-k", "top-p"])
def test_target_tokens_of_a_row_do_not_depend_on_the_other_rows(rng, s):
    """A verify step samples T rows at once; each row's token must be the one a decode
    step computing that row alone draws, also when another row ties at the k-th logit
    (top-k; no top-p, which could drop the tied tail) or needs a sort of the vocabulary
    where the others do not (top-p, rows from flat to peaked)."""
    if s.top_k:
        logits = rng.standard_normal((5, 64)).astype(np.float32) * 3
        tied = int(rng.integers(5))
        order = np.argsort(logits[tied])
        logits[tied, order[-8:-6]] = logits[tied, order[-6]]  # two more tokens tie at the 6th value
    else:
        logits = _wide_rows(rng)[rng.permutation(9)[:5]]
    positions = jnp.arange(5) + int(rng.integers(1000))
    seed = jnp.uint32(int(rng.integers(1 << 30)))
    f = jax.jit(lambda l, p: smp.target_tokens(l, p, seed, s))
    together = np.asarray(f(jnp.asarray(logits), positions))
    alone = [int(f(jnp.asarray(logits[i:i + 1]), positions[i:i + 1])[0]) for i in range(5)]
    assert list(together) == alone


def test_distributions_give_a_row_its_bits_whatever_the_rows_around_it(rng):
    """The sampled-draft rules compare p(d) / q(d) of each verify row (`transform_rows`) and
    draw from normalize(max(p - q, 0)); a row's values must be the bits it gets computed
    alone (a verify step against decode steps, a batched request against its run alone),
    whatever the number of rows N, jitted as steps are. XLA's reduce picked its summation
    order by N (the log-softmax of a [32, 2050] call differed from the rows alone)."""
    v, n = 2050, 64
    logits = (rng.standard_normal((n, v)) * rng.choice([1.0, 4.0], (n, 1))).astype(np.float32)
    draft = (rng.standard_normal((n, v)) * 2).astype(np.float32)
    settings = [Sampling(1.3, top_k=2000, top_p=0.99), Sampling(1.0, top_p=0.9, min_p=0.05), Sampling(0.7)]
    rs = smp.RowSampling.of([settings[i % 3] for i in range(n)])

    @jax.jit
    def laws(x, d, rs):
        logp, logq = smp.transform_rows(x, rs), smp.transform_rows(d, rs)
        return logp, jax.vmap(smp.residual_logprobs)(logp, logq)

    def rows(at):
        return laws(jnp.asarray(logits[at]), jnp.asarray(draft[at]), jax.tree.map(lambda a: a[at], rs))

    alone = [[np.asarray(a) for a in rows(slice(i, i + 1))] for i in range(n)]
    for size in (2, 3, 5, 8, 16, 17, 32, 64):
        together = [np.asarray(a) for a in rows(slice(0, size))]
        for i in range(size):
            for name, got, want in zip(("p", "residual"), together, alone[i]):
                np.testing.assert_array_equal(got[i], want[0], err_msg=f"{name}, N={size}, row {i}")
    x64 = np.asarray(logits[:3], np.float64) / np.array([[1.3], [1.0], [0.7]])
    got = np.concatenate([alone[i][0] for i in range(3)])
    keep = np.isfinite(got)
    assert keep[2].all() and not keep[0].all() and not keep[1].all()  # the settings each cut their own support
    for i in range(3):
        z = x64[i, keep[i]] - np.log(np.exp(x64[i, keep[i]]).sum())
        np.testing.assert_allclose(got[i, keep[i]], z, atol=2e-5, err_msg=f"row {i}")


def test_fixed_order_sums_agree_with_float64_and_keep_jaxs_infinities(rng):
    """`reductions`' sums and softmaxes against float64 NumPy on rows of odd and even
    lengths, and jax.nn's answers on rows of -inf, with +inf, with NaN; integer-valued
    sums exact."""
    assert reductions.sum_last(jnp.zeros((2, 0))).shape == (2, 1)
    for v in (1, 7, 64, 2050, 151936):
        x = (rng.standard_normal((3, v)) * 3).astype(np.float32)
        x64 = x.astype(np.float64)
        lse = np.log(np.exp(x64 - x64.max(-1, keepdims=True)).sum(-1, keepdims=True)) + x64.max(-1, keepdims=True)
        np.testing.assert_allclose(np.asarray(reductions.logsumexp_last(jnp.asarray(x))), lse, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(reductions.log_softmax_last(jnp.asarray(x))), x64 - lse, atol=2e-5)
        np.testing.assert_allclose(np.asarray(reductions.softmax_last(jnp.asarray(x))), np.exp(x64 - lse),
                                   rtol=2e-5, atol=1e-9)
        ints = rng.integers(-100, 101, (2, v))  # |any partial sum| <= 100 * 151936 < 2^24: exact in float32
        np.testing.assert_array_equal(np.asarray(reductions.sum_last(jnp.asarray(ints, jnp.float32)))[:, 0],
                                      ints.sum(-1))
    odd = np.array([[-np.inf] * 5, [0.0, np.inf, 1.0, -np.inf, 2.0], [0.0, np.nan, 1.0, 2.0, 3.0]], np.float32)
    for ours, theirs in ((reductions.logsumexp_last, lambda a: jax.nn.logsumexp(a, axis=-1, keepdims=True)),
                         (reductions.log_softmax_last, lambda a: jax.nn.log_softmax(a, axis=-1)),
                         (reductions.softmax_last, lambda a: jax.nn.softmax(a, axis=-1))):
        np.testing.assert_array_equal(np.asarray(ours(jnp.asarray(odd))), np.asarray(theirs(jnp.asarray(odd))))


def _documented_order_sum(x: np.ndarray) -> np.ndarray:
    """The sum `reductions.sum_last`'s docstring describes, in float32 NumPy: 16 equal
    chunks (2 below 16 entries) added as a pairwise tree (chunk 2j plus chunk 2j + 1, level
    by level), the result summed the same way, plus the leftover summed the same way."""
    n = x.shape[-1]
    if n <= 1:
        return x if n else np.zeros(x.shape[:-1] + (1,), x.dtype)
    ways = 16 if n >= 16 else 2
    m = n // ways
    parts = [x[..., i * m:(i + 1) * m] for i in range(ways)]
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    total = _documented_order_sum(parts[0])
    return total if ways * m == n else total + _documented_order_sum(x[..., ways * m:])


@pytest.mark.parametrize("n", [1, 2, 3, 15, 16, 17, 33, 64, 100, 128, 384, 2050, 8193])
def test_sum_last_adds_in_its_documented_order(n, rng):
    """Bitwise the float32 NumPy sum in the order the docstring gives (leading axes of
    several shapes; magnitudes spread over seven decades, so the order shows in the bits:
    checked by a plain np.sum differing on some row)."""
    for lead in ((), (5,), (2, 3)):
        x = (rng.standard_normal(lead + (n,)) * 10.0 ** rng.integers(-3, 4, lead + (n,))).astype(np.float32)
        want = _documented_order_sum(x)
        got = np.asarray(jax.jit(reductions.sum_last)(jnp.asarray(x)))
        assert got.dtype == np.float32 and got.shape == lead + (1,)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    if n >= 64:  # the order matters on these rows, so the comparison above could fail
        x = (rng.standard_normal((64, n)) * 10.0 ** rng.integers(-3, 4, (64, n))).astype(np.float32)
        assert (_documented_order_sum(x)[:, 0] != np.cumsum(x, axis=-1, dtype=np.float32)[:, -1]).any()


def test_argmax_is_numpys_on_ties_nan_and_infinities(rng):
    """smp.argmax against np.argmax (lowest index of the largest value; the first NaN where a
    row has one): ties, a row of -inf, +inf, signed zeros, NaN; rows of 1 and of 8192."""
    x = rng.integers(-3, 3, (64, 37)).astype(np.float32)  # many ties
    x[1] = -np.inf
    x[2, [5, 9]] = np.inf
    x[3] = 0.0
    x[3, ::2] = -0.0
    x[4, [7, 20]] = np.nan
    x[5, 0] = np.nan
    wide = rng.normal(size=(3, 8192)).astype(np.float32)
    wide[1, [100, 4000]] = wide[1].max() + 1  # a tie far apart
    for a in (x, wide, x[:, :1], x[0]):
        np.testing.assert_array_equal(np.asarray(jax.jit(smp.argmax)(jnp.asarray(a))), np.argmax(a, axis=-1))
