"""Adaptive k: exactness under a changing k, convergence of the chooser, history-only inputs."""

import copy

import numpy as np
import pytest

import specjax
from specjax.adaptive import Adaptive, KChooser
from specjax.proposers import DraftProposer, NgramProposer, Proposal
from specjax.sampling import Sampling
from specjax import steps


def test_adaptive_output_equals_plain(tiny, rng):
    model = tiny[2]
    base = rng.integers(0, model.config.vocab_size, 7)
    ids = np.concatenate([base, base, base, base[:3]])
    prop = Adaptive(NgramProposer(k=15), DraftProposer(model, k=7))
    for sampling in (Sampling(), Sampling(temperature=0.8, top_k=40, top_p=0.9)):
        seed = int(rng.integers(1 << 31))
        plain = specjax.generate(model, ids, max_new_tokens=48, sampling=sampling, seed=seed)
        spec = specjax.generate(model, ids, max_new_tokens=48, sampling=sampling, seed=seed, speculative=prop)
        assert spec.tokens == plain.tokens
        assert len(set(spec.stats.choices)) > 1  # the (proposer, k) really changed along the way


def _simulate(alpha, verify, propose_per_draft, steps_n, seed):
    """Drive a KChooser with a synthetic proposer of known acceptance and known costs."""
    rng = np.random.default_rng(seed)
    chooser = KChooser([15], prior_propose_ratio=[0.1])
    picks = []
    for _ in range(steps_n):
        p, k = chooser.choose()
        picks.append(k)
        accepted = 0
        while accepted < k and rng.random() < alpha[accepted]:
            accepted += 1
        chooser.update(p, k, k, accepted, propose_per_draft * k, verify[steps.bucket(k + 1)])
    return chooser, picks


def _analytic_best(alpha, verify, propose_per_draft, candidates):
    rate = {0: 1.0 / verify[1]}
    for k in candidates:
        expected = 1 + np.sum(np.cumprod(alpha[:k]))
        rate[k] = expected / (verify[steps.bucket(k + 1)] + propose_per_draft * k)
    return max(rate, key=rate.get)


VERIFY = {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.6, 16: 2.2}


@pytest.mark.parametrize("alpha_value,propose,expect", [(0.95, 0.0, 15), (0.85, 0.02, 7), (0.3, 0.0, 1), (0.05, 0.2, 0)])
def test_chooser_converges_to_analytic_best(alpha_value, propose, expect, rng):
    alpha = np.full(15, alpha_value)
    best = _analytic_best(alpha, VERIFY, propose, [1, 3, 7, 15])
    assert best == expect  # the scenario is what it says
    chooser, picks = _simulate(alpha, VERIFY, propose, 600, int(rng.integers(1 << 31)))
    late = picks[300:]
    assert max(set(late), key=late.count) == best
    assert late.count(best) / len(late) > 0.75


class _Scripted:
    """A deterministic fake proposer whose drafts come from a function of (history, salt)."""

    def __init__(self, k, salt):
        self.k, self.salt = k, salt

    def start(self, target, prompt, capacity, seed, sampling):
        return self

    def cost_prior(self, target):
        return 0.0, True  # cheap enough to be tried from the start

    def propose(self, history, limit):
        n = min(self.k, limit)
        return Proposal(((history[-1] + self.salt + np.arange(n)) % 101).astype(np.int32), n)

    def observe(self, accepted, history):
        pass


def test_choice_uses_history_only(rng):
    session = Adaptive(_Scripted(7, salt=1)).start(None, None, 0, 0, Sampling())
    session.chooser.verify_s = dict(VERIFY)  # fixed costs: no timing noise
    session.chooser._time = lambda *args: None
    history = rng.integers(0, 101, 30).astype(np.int32)
    for step in range(12):  # some shared history in which drafts are mostly accepted
        prop = session.propose(history, 15)
        session.observe(int(rng.integers(prop.n // 2, prop.n + 1)), history)
    twin = copy.deepcopy(session)
    twin.sessions[0].salt = 50  # this step's drafts differ
    a, b = session.propose(history, 15), twin.propose(history, 15)
    assert not np.array_equal(a.drafts, b.drafts)
    assert session.choices[-1] == twin.choices[-1]


class _Lookup:
    """A free (deterministic, costless) fake proposer: after an even last token it 'matches
    3 tokens' and drafts the true continuation, after an odd one it 'matches 1' and drafts junk."""

    free = True
    min_ngram, max_ngram = 1, 3

    def __init__(self, k):
        self.k = k

    def start(self, target, prompt, capacity, seed, sampling):
        return self

    def propose(self, history, limit):
        n = min(self.k, limit)
        if history[-1] % 2:
            return Proposal(np.full(n, 100, np.int32), n, match=1)
        return Proposal(_truth(history, n), n, match=3)

    def observe(self, accepted, history):
        pass


def _truth(history, n):
    """The synthetic target: each token is a function of the previous one."""
    out, last = [], int(history[-1])
    for _ in range(n):
        last = (7 * last + 3) % 97
        out.append(last)
    return np.array(out, np.int32)


def test_free_proposer_is_judged_by_shadow_drafts_and_weak_matches_are_skipped(rng):
    session = Adaptive(_Lookup(15)).start(None, None, 0, 0, Sampling())
    chooser = session.chooser
    chooser.verify_s = {1: 1.0, 2: 1.6, 4: 1.8, 8: 2.4, 16: 2.9}  # fixed costs: no timing noise
    chooser._time = lambda *args: None
    history = rng.integers(0, 97, 20).astype(np.int32)
    picks = []  # (match strength offered, k chosen)
    for _ in range(80):
        prop = session.propose(history, 15)
        offered = 1 if history[-1] % 2 else 3
        truth = _truth(history, max(prop.n, 1))
        accepted = int(np.cumprod(prop.drafts[:prop.n] == truth[:prop.n]).sum()) if prop.n else 0
        history = np.concatenate([history, truth[:accepted + 1]])
        session.observe(accepted, history)
        picks.append((offered, prop.n))
    late = picks[20:]
    assert min(sum(m == 1 for m, _ in late), sum(m == 3 for m, _ in late)) >= 10  # both kinds occur
    assert all(n == 0 for m, n in late if m == 1)          # junk after a weak match: plain steps
    assert all(n == 15 for m, n in late if m == 3)         # the true continuation: drafted in full
    weak, strong = chooser.acceptance(session.arms.index((0, 1))), chooser.acceptance(session.arms.index((0, 3)))
    assert weak[0] < 0.1 and strong[14] > 0.9  # learnt from shadows, including the never-verified weak arm


def test_probes_of_a_useless_proposer_back_off():
    """A model proposer whose drafts are never accepted costs O(log n) steps of n: once
    its widths are timed it is retried after 16 idle steps, then 32, 64, ..."""
    chooser = KChooser([7], prior_propose_ratio=[0.3])
    tried = []
    for step in range(2000):
        p, k = chooser.choose()
        if k:
            tried.append(step)
        chooser.update(p, k, k, 0, 0.3 * k, VERIFY[steps.bucket(k + 1)])
    calibration = len(chooser.candidates(0))  # at most each width once
    assert calibration <= len(tried) <= calibration + 7  # probes near 16, 48, 112, 240, 496, 1008, 2032
    gaps = np.diff(tried[calibration:])
    assert np.all(gaps[1:] >= 2 * gaps[:-1] - 1)


def test_propose_cost_scales_from_the_timed_k():
    """A chain of drafts costs per draft; a one-pass drafter the same at any k."""
    chooser = KChooser([7, 7], prior_propose_ratio=[0.3, 0.5], per_draft=[True, False])
    chooser.verify_s[1] = 0.01
    chooser.warm.add(("verify", 1))
    assert chooser.propose_cost(0, 3) == pytest.approx(0.3 * 3 * 0.01)  # priors before any timing
    assert chooser.propose_cost(1, 3) == pytest.approx(0.5 * 0.01)
    for _ in range(2):  # the first time of each is dropped (compilation)
        chooser.update(0, 7, 7, 0, 0.014, 0.02)
        chooser.update(1, 7, 7, 0, 0.009, 0.02)
    assert chooser.propose_cost(0, 1) == pytest.approx(0.002) and chooser.propose_cost(1, 1) == pytest.approx(0.009)


def test_plain_runs_double_while_plain_wins_and_restart_after_a_draft():
    session = Adaptive(NgramProposer(7, max_ngram=3)).start(None, None, 0, 0, Sampling())
    session.chooser.verify_s = {1: 1.0, 2: 1.6, 4: 1.8, 8: 2.4, 16: 2.9}  # fixed costs: no timing noise
    session.chooser.run_s = {16: 0.9}
    session.chooser._time = lambda *args: None
    history = np.arange(40, dtype=np.int32)  # all distinct: the lookup never matches

    def step(limit=1000, drafted=False):
        nonlocal history
        prop = session.propose(history, limit)
        assert (prop.n > 0) == drafted
        fresh = np.arange(1000 + len(history), 1000 + len(history) + (1 if drafted else prop.plain))
        # all drafts accepted, then a token never seen before (so the next lookup finds nothing)
        history = np.concatenate([history, prop.drafts[:prop.n], fresh]).astype(np.int32)
        session.observe(prop.n, history)
        return prop.plain

    assert [step() for _ in range(6)] == [1, 2, 4, 8, 16, 16]
    assert step(limit=4) == 4  # never past the tokens still wanted (limit + 1 = 5), as a compiled run length
    history = np.concatenate([history, history[10:14], history[10:13]])  # ends in a repeated 3-gram
    step(drafted=True)
    assert [step() for _ in range(3)] == [1, 2, 4]


def test_step_times_carry_over_to_the_next_generation_with_the_same_target(tiny, rng):
    model = tiny[2]
    prop = Adaptive(NgramProposer(4))
    ids = rng.integers(0, model.config.vocab_size, 30)
    first = prop.start(model, ids, 256, 0, Sampling())
    first.chooser.update(0, 0, 0, 0, 0.0, 0.004)  # the first time of a width is dropped (compilation)
    first.chooser.update(0, 0, 0, 0, 0.0, 0.004)
    assert first.chooser.verify_s == {1: 0.004}
    again = prop.start(model, ids, 256, 1, Sampling())
    assert again.chooser.verify_s == {1: 0.004}
    assert not again.chooser.judged.any()  # acceptance is learnt anew
    assert prop.start(model, ids, 512, 0, Sampling()).chooser.verify_s == {}  # another cache size
    assert Adaptive(NgramProposer(4)).start(model, ids, 256, 0, Sampling()).chooser.verify_s == {}
