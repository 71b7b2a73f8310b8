"""The draft model's cache in an engine that chooses among proposers (`rounds.rounds`): fed
only in rounds where some row expects the most tokens per second from the draft model, or
where a row lags a round's worth behind (then caught up whole); whatever it lags, it holds
exactly the committed tokens up to its length, and every row equals its request run alone."""

from __future__ import annotations

import numpy as np
import pytest

from specjax import Sampling
from specjax.costs import StepCosts
from specjax.engine import Engine, Speculation
from specjax.rounds import SPAN
from test_engine_draft_trees import CHECKED, _alone, _cache_holds_committed, _fresh_keys, pair  # noqa: F401

DEAR = 50.0  # a draft-model round's cost, in plain steps, where the draft never pays


def _run(pair, monkeypatch, dear: bool):
    """Two rows (a prompt that repeats, so lookup pays, and a random one; greedy and
    sampled) on an engine choosing between lookup and the draft model, the draft model's
    rounds priced at DEAR (or as fitted); checks the cache after every round and returns
    (requests, what they generate alone, the largest lag seen)."""
    target, draft = pair
    if dear:  # the fitted costs with the draft-model kinds (the upper half) made dear
        fitted = StepCosts.ratios
        monkeypatch.setattr(StepCosts, "ratios", lambda self: np.concatenate(
            [(r := fitted(self))[:len(r) // 2], r[len(r) // 2:] + DEAR]))
    rng = np.random.default_rng(7)
    v = target.config.vocab_size
    base = rng.integers(0, v, 5)
    prompts = [np.concatenate([base] * 3), rng.integers(0, v, 9)]
    news, settings, seeds = [CHECKED - 16, CHECKED - 10], [Sampling(), Sampling(0.8)], [3, 4]
    want = _alone(target, prompts, news, settings, seeds, [()] * 2)
    engine = Engine(target, Speculation(k=15), draft=draft, max_batch=2, max_len=256, rounds=1)  # checked each round
    reqs = [engine.submit(p, max_new_tokens=n, sampling=s, seed=sd, stop_ids=())
            for p, n, s, sd in zip(prompts, news, settings, seeds)]
    keys, lag = _fresh_keys(draft), 0
    while engine.has_work():
        engine.step()
        for r in engine.running:
            _cache_holds_committed(engine, r, keys, lag=2 * SPAN - 1)
            lag = max(lag, r.length - r.dlen)
    return reqs, want, lag


@pytest.mark.parametrize("dear", [True, False], ids=["draft never pays", "as measured"])
def test_a_lagging_draft_cache_holds_the_committed_tokens(pair, monkeypatch, dear):
    """Where the draft model never pays it drafts nothing and is fed only to catch up, so
    its cache falls a round's worth behind (at least SPAN tokens) before each feed, never
    2 * SPAN; as measured, whatever the chooser picks, the cache holds the committed tokens.
    Either way each row equals its run alone."""
    reqs, want, lag = _run(pair, monkeypatch, dear)
    assert [r.tokens for r in reqs] == want
    if dear:
        assert all(source != "draft" for r in reqs for source, _ in r.stats.choices)
        assert SPAN <= lag < 2 * SPAN
