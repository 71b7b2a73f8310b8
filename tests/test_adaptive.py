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
        assert len({k for k in spec.stats.ks}) > 1  # k really changed along the way


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

    def propose(self, history, limit):
        n = min(self.k, limit)
        return Proposal(((history[-1] + self.salt + np.arange(n)) % 101).astype(np.int32), n)

    def observe(self, accepted, history):
        pass


def test_choice_uses_history_only(rng):
    session = Adaptive(_Scripted(7, salt=1)).start(None, None, 0, 0, Sampling())
    history = rng.integers(0, 101, 30).astype(np.int32)
    for step in range(12):  # some shared history in which drafts are mostly accepted
        prop = session.propose(history, 15)
        session.observe(int(rng.integers(prop.n // 2, prop.n + 1)), history)
    twin = copy.deepcopy(session)
    twin.sessions[0].salt = 50  # this step's drafts differ
    a, b = session.propose(history, 15), twin.propose(history, 15)
    assert not np.array_equal(a.drafts, b.drafts)
    assert session.choices[-1] == twin.choices[-1]
