"""Adaptive: what it accepts, and exactness while the engine chooses among its proposers."""

import numpy as np
import pytest

import specjax
from specjax.adaptive import Adaptive
from specjax.proposers import DraftProposer, NgramProposer, ProposerError
from specjax.sampling import Sampling


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
        # drafts were verified (which proposer and how many depend on measured step times,
        # so they are not asserted here; tests/test_engine.py checks the choice itself)
        assert spec.stats.drafted > 0


def test_what_adaptive_takes(tiny):
    model = tiny[2]
    assert Adaptive(NgramProposer(), DraftProposer(model)).proposers[0] == NgramProposer()
    with pytest.raises(ProposerError, match="at least one proposer"):
        Adaptive()
    for bad in (object(), Adaptive(NgramProposer())):
        with pytest.raises(ProposerError, match="chooses among proposers"):
            Adaptive(NgramProposer(), bad)
    with pytest.raises(ProposerError, match="at most one DraftProposer"):
        Adaptive(DraftProposer(model), DraftProposer(model, k=2))
    with pytest.raises(ProposerError, match="at most one NgramProposer"):
        Adaptive(NgramProposer(k=2), NgramProposer(k=7))
