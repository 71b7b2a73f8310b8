"""Prompt lookup (specjax.lookup): the device search makes a brute-force lookup's drafts, the
output equals plain decoding, the acceptance model and the step-cost fit behave as
documented."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import costs as costs_lib, lookup
from specjax.proposers import ProposerError
from specjax.sampling import Sampling
from conftest import lookup_reference, repeating_prompt

SAMPLED = Sampling(temperature=0.8, top_k=40, top_p=0.9)


def test_find_equals_brute_force_lookup(rng):
    size_max = 40
    for k, hi, lo in [(1, 1, 1), (3, 2, 1), (7, 3, 1), (5, 4, 2)]:
        find = jax.jit(lambda h, n: lookup.find(h, n, k, hi, lo))
        for _ in range(60):
            size = int(rng.integers(1, size_max))
            history = rng.integers(0, int(rng.integers(2, 6)), size).astype(np.int32)
            padded = rng.integers(0, 6, size_max + k).astype(np.int32)  # garbage past size
            padded[:size] = history
            drafts, n, matched = find(padded, np.int32(size))
            want, want_n = lookup_reference(history, k, hi, lo)
            assert int(n) == len(want) and int(matched) == want_n
            np.testing.assert_array_equal(np.asarray(drafts)[:int(n)], want)


def test_top_k_ints_is_a_stable_descending_sort(rng):
    """The k largest of each row with ties by the lower index: the first k of NumPy's
    stable sort of -x, values and indices, for rows with many ties and negative values,
    short rows (ranked pairwise) and long ones (rounds of argmax)."""
    top = jax.jit(lookup.top_k_ints, static_argnums=1)
    long = lookup.PAIRWISE_TOP_K + 1
    for shape, k in [((7,), 7), ((40,), 4), ((3, 60), 15), ((2, lookup.PAIRWISE_TOP_K), 9), ((long,), 5),
                     ((2, 1152), 4)]:
        x = rng.integers(-1, 5, shape).astype(np.int32)
        values, indices = top(x, k)
        order = np.argsort(-x, axis=-1, kind="stable")[..., :k]
        np.testing.assert_array_equal(np.asarray(indices), order)
        np.testing.assert_array_equal(np.asarray(values), np.take_along_axis(x, order, axis=-1))


def test_greedy_and_sampled_equal_plain(cyclic_target, tiny, rng):
    prop = specjax.Adaptive(specjax.NgramProposer(k=15))  # prompt lookup, k chosen per step (any of 0 .. 15)
    for model in (cyclic_target, tiny[2]):
        ids = repeating_prompt(rng, model.config.vocab_size)
        for sampling in (Sampling(), SAMPLED):
            seed = int(rng.integers(1 << 31))
            plain = specjax.generate(model, ids, max_new_tokens=50, sampling=sampling, seed=seed)
            spec = specjax.generate(model, ids, max_new_tokens=50, sampling=sampling, seed=seed, speculative=prop)
            assert spec.tokens == plain.tokens
            s = spec.stats
            assert s.steps == len(s.ks) and sum(s.ks) == s.drafted and sum(s.accepts) == s.accepted
            assert s.new_tokens - 1 <= s.steps + s.accepted  # the last step may run past max_new_tokens
            if model is cyclic_target and sampling.greedy:
                assert s.accepted > 0 and s.steps < plain.stats.steps


def test_stop_ids_and_max_new_tokens(cyclic_target, rng):
    ids = repeating_prompt(rng, cyclic_target.config.vocab_size)
    plain = specjax.generate(cyclic_target, ids, max_new_tokens=60).tokens
    prop = specjax.Adaptive(specjax.NgramProposer(k=7))
    for cut in (1, 2, 9, 23):
        assert specjax.generate(cyclic_target, ids, max_new_tokens=cut, speculative=prop).tokens == plain[:cut]
    for stop in set(plain[5:20]):
        res = specjax.generate(cyclic_target, ids, max_new_tokens=60, stop_ids=[stop], speculative=prop)
        assert res.tokens == plain[:plain.index(stop) + 1] and res.stopped


def test_expected_tokens_equals_enumeration(rng):
    """1 + accepted drafts, averaged over every outcome of n drafts (the first accepted at
    rate q, each later one given the earlier at rate r), including r = 1."""
    for _ in range(30):
        q, r = rng.uniform(0, 1, 2)
        r = 1.0 if rng.uniform() < 0.2 else r
        n = int(rng.integers(0, 16))
        probs = [1 - q] + [q * r ** (a - 1) * (1 - r) for a in range(1, n)] + [q * r ** (n - 1)] if n else [1.0]
        want = sum((a + 1) * pa for a, pa in enumerate(probs))
        got = float(lookup.expected_tokens(jnp.float32(q), jnp.float32(r), jnp.int32(n)))
        assert got == pytest.approx(want, rel=1e-4)


def test_a_bursty_record_drafts_wider_than_its_pooled_rate_would():
    """Costs of the CPU loop, first draft right 0.6 of the time and later ones 0.95: the
    two-rate model drafts 7 (E = 4.6 tokens for 2.5 steps' cost), while one rate pooled
    from the same record (~0.8) would draft 3."""
    costs = jnp.asarray([1.0, 1.25, 1.7, 2.5, 4.3], jnp.float32)
    room = jnp.asarray([0, 1, 3, 7, 15])
    pick = lambda q, r: int(jnp.argmax(lookup.expected_tokens(jnp.float32(q), jnp.float32(r), room) / costs))
    assert pick(0.6, 0.95) == 3 and pick(0.8, 0.8) == 2


def test_step_costs_fit_calls_and_keep_the_prior_for_widths_never_run(rng):
    """Calls mixing widths 1, 2 and 4 with known per-step times: the fit finds their
    ratios, widths 8 and 16 keep the prior's ratio to each other, and the first (compiling)
    call is ignored. Calls of 64 steps, so the data outweigh the prior's pseudo-steps (at
    16 steps a call the ridge's pull to the prior passes 6 % for about one design in 100)."""
    true = np.array([1.0, 1.6, 2.2, 3.0, 5.0]) * 1e-3   # seconds per step
    prior = np.array([1.0, 1.1, 1.5, 3.0, 5.0])        # wrong for widths 2 and 4
    costs = costs_lib.StepCosts(prior)
    costs.observe(np.array([16.0, 0, 0, 0, 0]), 30.0)  # compiled: not timed
    for _ in range(40):
        counts = np.zeros(5)
        counts[:3] = rng.multinomial(64, rng.dirichlet(np.ones(3)))
        costs.observe(counts, counts @ true + rng.normal(0, 2e-5))
    got = costs.ratios()
    np.testing.assert_allclose(got[:3], true[:3] / true[0], rtol=0.06)
    assert got[4] / got[3] == pytest.approx(prior[4] / prior[3], rel=0.02)
    assert (np.diff(got) >= 0).all() and costs_lib.StepCosts(prior).ratios() is prior


def test_a_flat_part_is_one_constant_at_every_width(rng):
    """A step part that costs the same at every width (building trees, group bit 1 in
    `flat`): calls where it ran only at widths 1 and 2 still price it at widths 4 and 8, as
    the width's cost plus the constant the calls measured."""
    true = np.array([1.0, 1.2, 1.6, 2.4, 4.0]) * 1e-3   # seconds per step without the part
    built = 0.4e-3                                       # the part's seconds per step
    prior = np.array([1.0, 1.1, 1.5, 3.0, 5.0])
    costs = costs_lib.StepCosts(np.concatenate([prior, prior + 0.15]), groups=2, flat=1)
    costs.observe(np.array([16.0] + [0] * 9), 30.0)  # compiled: not timed
    for _ in range(40):
        counts = np.zeros(10)
        built_steps = rng.integers(4, 33)  # (a fixed number a call would not tell the part from the widths)
        counts[:4] = rng.multinomial(64 - built_steps, rng.dirichlet(np.ones(4)))
        counts[5:7] = rng.multinomial(built_steps, rng.dirichlet(np.ones(2)))
        costs.observe(counts, counts @ np.concatenate([true, true + built]) + rng.normal(0, 2e-5))
    got = costs.ratios().reshape(2, 5)
    np.testing.assert_allclose(got[0, :4], true[:4] / true[0], rtol=0.06)
    np.testing.assert_allclose(got[1, :4], (true[:4] + built) / true[0], rtol=0.06)


def test_one_slow_call_does_not_set_a_widths_cost(rng):
    """Calls at the prior's costs, then one four times slower that ran only width 8: the
    fitted ratios stay near the prior's instead of following that call."""
    per_step = np.array([1.0, 1.25, 1.7, 2.5, 4.3]) * 3e-3
    costs = costs_lib.StepCosts(per_step / per_step[0])
    costs.observe(np.array([16.0, 0, 0, 0, 0]), 30.0)  # compiled: not timed
    for _ in range(6):
        counts = rng.multinomial(16, np.full(5, 0.2)).astype(float)
        costs.observe(counts, counts @ per_step)
    slow = np.array([8.0, 0, 0, 8.0, 0])
    costs.observe(slow, 4 * slow @ per_step)
    got = costs.ratios() / (per_step / per_step[0])
    assert 0.6 < got[3] < 1.25 and np.abs(got - 1).max() < 0.45  # unclipped: width 8 up to 2.1x


def test_bad_options(cyclic_target):
    for bad in (0, 16):
        with pytest.raises(ProposerError, match="k must be"):
            specjax.NgramProposer(k=bad)
    with pytest.raises(ProposerError, match="min_ngram"):
        specjax.NgramProposer(max_ngram=1, min_ngram=2)
    for kw in (dict(max_ngram=2.5), dict(max_ngram="3"), dict(min_ngram=None)):
        with pytest.raises(ProposerError, match="need integers"):
            specjax.NgramProposer(**kw)
    # the on-device search's bound, checked when generation starts (before anything compiles)
    for spec in (specjax.NgramProposer(max_ngram=33), specjax.Adaptive(specjax.NgramProposer(max_ngram=33))):
        with pytest.raises(ProposerError, match="at most 32"):
            specjax.generate(cyclic_target, [1, 2, 3], max_new_tokens=2, speculative=spec)
    assert specjax.NgramProposer(k=np.int64(3)).k == 3
