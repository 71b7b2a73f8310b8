"""The exactness contract of speculative decoding (README.md, first section): greedy and sampled."""

import dataclasses
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import qwen3
from specjax import sampling as smp
from specjax.proposers import DraftProposer, NgramProposer, ProposerError
from specjax.sampling import Sampling
from conftest import assert_follows, hf_tiny, repeating_prompt

SAMPLED = Sampling(temperature=0.8, top_k=40, top_p=0.9)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    folder = tmp_path_factory.mktemp("draft")
    hf_tiny(folder, seed=5, num_hidden_layers=1, hidden_size=32, intermediate_size=48, head_dim=16)
    return specjax.load(folder)


@pytest.mark.parametrize("k", [1, 2, 7, 15])  # (k=2 drafts fewer than its compiled width)
def test_ngram_greedy_equals_plain(cyclic_target, tiny, rng, k):
    for model in (cyclic_target, tiny[2]):
        ids = repeating_prompt(rng, model.config.vocab_size)
        plain = specjax.generate(model, ids, max_new_tokens=48)
        spec = specjax.generate(model, ids, max_new_tokens=48, speculative=NgramProposer(k=k))
        assert spec.tokens == plain.tokens
        if model is cyclic_target:
            assert spec.stats.accepted > 0 and spec.stats.steps < plain.stats.steps


@pytest.mark.parametrize("k", [1, 3, 8])
def test_draft_model_greedy_equals_plain(tiny, small_draft, rng, k):
    model = tiny[2]
    ids = repeating_prompt(rng, model.config.vocab_size)
    plain = specjax.generate(model, ids, max_new_tokens=40)
    spec = specjax.generate(model, ids, max_new_tokens=40, speculative=DraftProposer(small_draft, k=k))
    assert spec.tokens == plain.tokens
    selfdraft = specjax.generate(model, ids, max_new_tokens=40, speculative=DraftProposer(model, k=k))
    assert selfdraft.tokens == plain.tokens
    # the target drafting for itself: every draft accepted, every step emits k + 1 (bar the tail)
    assert selfdraft.stats.accepted == selfdraft.stats.drafted
    assert selfdraft.stats.steps == -(-39 // (k + 1))


def test_stop_and_max_new_tokens_inside_an_accepted_block(tiny, rng):
    model = tiny[2]
    ids = rng.integers(0, model.config.vocab_size, 10)
    plain = specjax.generate(model, ids, max_new_tokens=40).tokens
    prop = DraftProposer(model, k=8)  # all drafts accepted: blocks of 9 after the first token
    for cut in (5, 6, 13):  # positions strictly inside a block
        res = specjax.generate(model, ids, max_new_tokens=cut, speculative=prop)
        assert res.tokens == plain[:cut]
        stop = plain[cut - 1]
        res = specjax.generate(model, ids, max_new_tokens=40, stop_ids=[stop], speculative=prop)
        assert res.tokens == plain[:plain.index(stop) + 1] and res.stopped


def test_sampled_deterministic_proposers_equal_plain_sampled(cyclic_target, tiny, small_draft, rng):
    for model, prop in [(cyclic_target, NgramProposer(k=4)), (tiny[2], DraftProposer(small_draft, k=3)),
                        (tiny[2], DraftProposer(tiny[2], k=5))]:
        ids = repeating_prompt(rng, model.config.vocab_size)
        seed = int(rng.integers(1 << 31))
        plain = specjax.generate(model, ids, max_new_tokens=40, sampling=SAMPLED, seed=seed)
        spec = specjax.generate(model, ids, max_new_tokens=40, sampling=SAMPLED, seed=seed, speculative=prop)
        assert spec.tokens == plain.tokens
    assert spec.stats.accepted > 0


def test_a_bfloat16_kv_cache_keeps_speculative_equal_to_plain(cyclic_target, tiny, small_draft, rng):
    """kv_dtype="bfloat16" (keys and values rounded as stored, `test_cpu_kernels`): a batch
    of speculative rows (one greedy, one sampled; both sampled for the draft model) equals
    each prompt's plain decoding with the same cache, for lookup trees (whose accepted
    paths are compacted through the bfloat16 pools) and a draft model's drafts; and the
    pools are bfloat16."""
    for model, prop, samplings in [(cyclic_target, NgramProposer(k=7, tree=6), [specjax.Sampling(), SAMPLED]),
                                   (tiny[2], DraftProposer(small_draft, k=3), [SAMPLED, SAMPLED])]:
        model = dataclasses.replace(model, kv_dtype="bfloat16")
        prompts = [repeating_prompt(rng, model.config.vocab_size) for _ in range(2)]
        plain = [specjax.generate(model, ids, max_new_tokens=32, sampling=s, seed=7).tokens
                 for ids, s in zip(prompts, samplings)]
        both = specjax.generate(model, prompts, max_new_tokens=32, sampling=samplings, seed=7, speculative=prop)
        assert [r.tokens for r in both] == plain
        if isinstance(prop, NgramProposer):  # the greedy row on a repeating prompt takes drafts
            assert both[0].stats.accepted > 0
    assert specjax.Engine(model, max_batch=1, max_len=64).k_pool.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="kv_dtype int8"):
        dataclasses.replace(model, kv_dtype="int8")


def _case_distributions(rng):
    """(name, p, q) pairs over a small vocabulary covering the edge cases of the rule."""
    v = 12
    lp = lambda x: np.asarray(smp.transform(jnp.asarray(x, jnp.float32), Sampling(temperature=1.0)))
    a, b = rng.standard_normal(v) * 2, rng.standard_normal(v) * 2
    p_zero = a.copy()
    p_zero[[0, 5]] = -np.inf
    q_zero = b.copy()
    q_zero[[1, 2, 7]] = -np.inf
    tie = np.zeros(v)
    tie[[3, 4]] = 5.0
    tiny_q = b.copy()
    tiny_q[[0, 3]] = -300.0  # q(x) = exp(-300 - ...) underflows in linear float32
    return [
        ("random", lp(a), lp(b)),
        ("p-zero", lp(p_zero), lp(b)),
        ("q-zero", lp(a), lp(q_zero)),
        ("ties", lp(tie), lp(tie[::-1])),
        ("equal", lp(a), lp(a)),
        ("q-underflow", lp(a), lp(tiny_q)),
        ("top-k/top-p", np.asarray(smp.transform(jnp.asarray(a, jnp.float32), Sampling(1.0, top_k=4))),
         np.asarray(smp.transform(jnp.asarray(b, jnp.float32), Sampling(1.0, top_p=0.6)))),
        ("disjoint-support", np.asarray(smp.transform(jnp.asarray(a, jnp.float32), Sampling(1.0, top_k=2))),
         np.asarray(smp.transform(jnp.asarray(-a, jnp.float32), Sampling(1.0, top_k=2)))),
    ]


def test_acceptance_rule_enumeration(rng):
    """P(emit x) = q(x) min(1, p/q)(x) + P(reject) r(x) equals p(x), by enumeration."""
    for name, logp, logq in _case_distributions(rng):
        p, q = np.exp(logp.astype(np.float64)), np.exp(logq.astype(np.float64))
        acc = np.array([float(smp.accept_probability(jnp.asarray(logp), jnp.asarray(logq), d)) if q[d] > 0 else 0.0
                        for d in range(len(p))])
        reject = 1.0 - np.sum(q * acc)
        r = np.exp(np.asarray(smp.residual_logprobs(jnp.asarray(logp), jnp.asarray(logq)), np.float64))
        emitted = q * acc + reject * r
        assert np.abs(emitted - p).max() <= 1e-6, name


def _exact_pair_distribution(model, ids, s):
    """Target probabilities of the 2nd and 3rd generated tokens, summed over the 1st."""
    v = model.config.vocab_size
    n = len(ids)
    seqs = np.array([list(ids) + [a, b] for a, b in itertools.product(range(v), range(v))])
    logits, _, _ = qwen3.forward(model.params, model.config, seqs, np.broadcast_to(np.arange(n + 2), seqs.shape))
    logp = np.asarray(smp.transform(logits[:, n - 1:], s), np.float64)  # rows decide tokens 1, 2, 3
    p1 = np.exp(logp[0, 0])  # [a]
    p2 = np.exp(logp[::v, 1])  # [a, b]
    p3 = np.exp(logp[:, 2]).reshape(v, v, v)  # [a, b, c]
    return np.einsum("a,ab,abc->bc", p1, p2, p3)


def sampled_draft_case(tmp_path_factory):
    """(target, draft, sampling, prompt, exact law of tokens 2-3) on a vocabulary of 24:
    the case every chi-square of sampled drafts uses."""
    folders = [tmp_path_factory.mktemp(n) for n in ("t32", "d32")]
    hf_tiny(folders[0], seed=11, vocab_size=24, init=0.3)
    hf_tiny(folders[1], seed=12, vocab_size=24, num_hidden_layers=1, init=0.3)
    target, draft = specjax.load(folders[0]), specjax.load(folders[1])
    s = Sampling(temperature=1.0, top_k=12)
    ids = np.array([3, 7, 1, 9])
    return target, draft, s, ids, _exact_pair_distribution(target, ids, s)


def engine_follows(engine, ids, s: Sampling, exact: np.ndarray, calls: int = 200, rows: int = 12) -> None:
    """`calls` engine runs of `rows` requests of `ids` (4 new tokens, seeds all different,
    no prompt lookup): their tokens 2-3 follow `exact`, and drafts were both accepted and
    rejected."""
    counts = np.zeros_like(exact)
    accepted = 0
    for call in range(calls):
        reqs = [engine.submit(ids, max_new_tokens=4, sampling=s, seed=call * rows + j, stop_ids=(), lookup=False)
                for j in range(rows)]
        engine.run()
        for r in reqs:
            counts[r.tokens[1], r.tokens[2]] += 1
            accepted += r.stats.accepted
    assert 0 < accepted < 2 * calls * rows  # both the accept and the residual paths ran
    assert_follows(counts, exact)


def test_sampled_drafts_follow_target_distribution(tmp_path_factory):
    """Chi-square of tokens 2-3 (one speculative step, 2 sampled drafts) against the exact target law."""
    target, draft, s, ids, exact = sampled_draft_case(tmp_path_factory)
    prop = DraftProposer(draft, k=2, sample=True)
    n = 2500
    counts = np.zeros_like(exact)
    accepted = 0
    for seed in range(n):
        res = specjax.generate(target, ids, max_new_tokens=4, sampling=s, seed=seed, speculative=prop)
        counts[res.tokens[1], res.tokens[2]] += 1
        accepted += res.stats.accepted
    assert 0 < accepted < 2 * n  # both the accept and the residual paths ran
    assert_follows(counts, exact)


def test_proposer_errors(tiny, tmp_path):
    hf_tiny(tmp_path, vocab_size=77)
    other = specjax.load(tmp_path)
    with pytest.raises(ProposerError, match="vocab_size 77"):
        specjax.generate(tiny[2], [1, 2, 3], max_new_tokens=5, speculative=DraftProposer(other, k=2))
    for bad in (0, 16, 2.5):
        with pytest.raises(ProposerError, match="k must be"):
            NgramProposer(k=bad)
    with pytest.raises(ProposerError, match="needs a loaded model"):
        DraftProposer(str(tmp_path), k=3)
    with pytest.raises(ProposerError, match="need integers"):
        NgramProposer(max_ngram=2.5)
