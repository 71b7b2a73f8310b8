"""Lookup trees in the engine: every row's output equals its request run alone without
speculation (greedy and sampled, batch 1 and more, budgets 2 to 15, stops and
max_new_tokens inside an accepted path), and trees do branch."""

from __future__ import annotations

import numpy as np
import pytest

from specjax import Sampling
from specjax import sampling as smp
from specjax import steps
from specjax.costs import prior_width_costs
from specjax.engine import Engine, Speculation
from specjax.kv import KVCache
from specjax.proposers import ProposerError
from specjax.results import GenerationError
from specjax.rounds import MEASURE_EVERY, new_state, rounds


def _branchy_prompt(rng, vocab: int) -> np.ndarray:
    """Phrases that recur with different continuations (a lookup of the last tokens finds
    several earlier matches that part ways), then one phrase's head."""
    heads = [rng.integers(0, vocab, 3) for _ in range(2)]
    tails = [rng.integers(0, vocab, 4) for _ in range(3)]
    parts = [np.concatenate([heads[int(rng.integers(0, 2))], tails[int(rng.integers(0, 3))]]) for _ in range(8)]
    return np.concatenate(parts + [heads[0]]).astype(np.int32)


def _alone(model, prompts, news, settings, seeds, stops):
    solo = Engine(model, None, max_batch=1, max_len=256)
    return [solo.submit(p, max_new_tokens=n, sampling=s, seed=sd, stop_ids=st).result().tokens
            for p, n, s, sd, st in zip(prompts, news, settings, seeds, stops)]


def test_tree_rows_equal_their_plain_run_alone(cyclic_target, rng):
    """Trees of 2, 5 and 15 nodes and "auto" (one engine, per-request budgets), greedy and
    sampled, a stop id inside what a path may accept, at batch 4 and batch 1."""
    model = cyclic_target
    v = model.config.vocab_size
    prompts = [_branchy_prompt(rng, v) for _ in range(4)]
    news = [40, 23, 31, 12]
    budgets = [2, 5, 15, "auto"]
    settings = [Sampling(), Sampling(0.8), Sampling(), Sampling(1.0, top_k=20)]
    seeds = [int(s) for s in rng.integers(0, 2 ** 31, 4)]
    full = _alone(model, prompts, news, settings, seeds, [()] * 4)
    stops = [(), (full[1][9],), (), ()]
    want = _alone(model, prompts, news, settings, seeds, stops)
    engine = Engine(model, Speculation(k=15, tree=15), max_batch=4, max_len=256)
    reqs = [engine.submit(p, max_new_tokens=n, sampling=s, seed=sd, stop_ids=st, tree=t)
            for p, n, s, sd, st, t in zip(prompts, news, settings, seeds, stops, budgets)]
    engine.run()
    assert [r.tokens for r in reqs] == want
    assert sum(r.stats.drafted for r in reqs) > 0
    one = Engine(model, Speculation(k=15, tree=5), max_batch=1, max_len=256)
    assert one.submit(prompts[1], max_new_tokens=news[1], sampling=settings[1], seed=seeds[1],
                      stop_ids=stops[1]).result().tokens == want[1]


def test_trees_branch_and_chains_stay_chains(cyclic_target):
    """Over branchy prompts some accepted path leaves the first continuation; requests
    with tree=0 on the same engine never branch; both equal their runs alone. (Fixed
    prompts: whether a tree branches depends on what the random target generates.)"""
    model = cyclic_target
    v = model.config.vocab_size
    rng = np.random.default_rng(1)
    prompts = [_branchy_prompt(rng, v) for _ in range(6)]
    want = _alone(model, prompts, [48] * 6, [Sampling()] * 6, [0] * 6, [()] * 6)
    engine = Engine(model, Speculation(k=15, tree=15), max_batch=4, max_len=256)  # (two requests wait, then join)
    reqs = [engine.submit(p, max_new_tokens=48, stop_ids=(), tree=15 if i < 3 else 0) for i, p in enumerate(prompts)]
    engine.run()
    assert [r.tokens for r in reqs] == want
    assert sum(r.stats.branched for r in reqs[:3]) > 0
    assert sum(r.stats.branched for r in reqs[3:]) == 0


def test_auto_rows_draft_the_shape_that_has_held_more(cyclic_target, monkeypatch):
    """tree="auto": a row whose trees have held deeper than its chains drafts trees, one
    whose chains have held deeper drafts chains; a row with a node budget drafts trees
    whatever has held more; all equal their runs alone. A fresh auto row measures both.
    The step costs stay the priors (a fresh model object, no timing fitted): fitted to a
    loaded machine's wall times, a tree build could cost so much that the fresh row never
    built one, and this is a test of the choice, not of the fit."""
    import dataclasses

    from specjax.costs import StepCosts

    monkeypatch.setattr(StepCosts, "observe", lambda self, counts, seconds: None)
    model = dataclasses.replace(cyclic_target)  # the engine's fitted costs are kept per model object
    rng = np.random.default_rng(2)
    prompts = [_branchy_prompt(rng, model.config.vocab_size) for _ in range(5)]
    want = _alone(model, prompts, [12] * 5, [Sampling()] * 5, [0] * 5, [()] * 5)
    engine = Engine(model, Speculation(k=15, tree="auto"), max_batch=4, max_len=256)  # (the fresh row joins later)
    reqs = [engine.submit(p, max_new_tokens=12, stop_ids=(), tree=t)
            for p, t in zip(prompts, ["auto", "auto", 15, 0, "auto"])]
    deep, shallow = np.array([2500.0, 500.0]), np.array([500.0, 500.0])  # (summed depth, rounds): 5 and 1
    for r, (chain, tree) in zip(reqs[:3], [(shallow, deep), (deep, shallow), (deep, shallow)]):
        r.state["shapes"][0] = [chain, tree]  # prompt lookup's chains and trees
    engine.run()
    assert [r.tokens for r in reqs] == want
    drafting = [sum(k > 0 for k in r.stats.ks) for r in reqs]
    assert min(drafting[:3]) > 0
    assert [r.stats.tree_steps for r in reqs[:4]] == [drafting[0], 0, drafting[2], 0]
    assert np.all(reqs[4].state["shapes"][0, :, 1] > 0)  # its chains and its trees were both judged


def _built_rounds(model, prompts, shapes, auto, build_cost, n_rounds=8):
    """One device call of `n_rounds` rounds over lookup rows with a tree budget of 15, each
    row's (chain, tree) depth sums and rounds set to `shapes`, and a tree build that costs
    `build_cost` one-token steps, drafts trusted; returns, per round that drafted, whether
    it built trees."""
    rows, cfg = len(prompts), model.config
    h = np.zeros((rows, 512), np.int32)
    size = np.array([len(p) for p in prompts], np.int32)
    for b, p in enumerate(prompts):
        h[b, :len(p)] = p
    pages = 512 // 16
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, rows * pages + 1, 16, cfg.head_dim)
    kv = KVCache(np.zeros(shape, np.float32), np.zeros(shape, np.float32),
                 1 + np.arange(rows * pages, dtype=np.int32).reshape(rows, pages), size - 1, page_size=16)
    state = new_state(rows, 3)
    state["accepted"][:], state["judged"][:] = 400.0, 400.0  # drafts trusted: every round drafts
    state["shapes"][:, 0] = shapes  # prompt lookup's chains and trees
    plain = prior_width_costs(1)
    costs = np.stack([plain, plain + build_cost]).astype(np.float32)  # (step kinds: without, with a build)
    log, *_ = rounds(model.params, cfg, kv, h, size, np.full(rows, 16 * n_rounds, np.int32),
                     np.full((rows, 8), -1, np.int32), np.full(rows, 15, np.int32), np.ones((rows, 3), bool), state,
                     costs, np.arange(rows, dtype=np.uint32), smp.RowSampling.of([Sampling()] * rows),
                     row_tree=np.full(rows, 15, np.int32), row_auto=np.asarray(auto), k=15, max_ngram=3,
                     min_ngram=1, n_rounds=n_rounds, sampled=False, tree=15)
    width = np.asarray(log["width"])
    drafted = (width >= 0) & (width % len(steps.BUCKETS) > 0)
    return {i: bool(width[i] // len(steps.BUCKETS)) for i in np.flatnonzero(drafted)}


def test_auto_rows_pay_for_a_tree_only_where_it_is_worth_its_build(cyclic_target):
    """tree="auto": the tree (lookup's trie) is built in a round only where some row drafts
    it: an auto row whose trees held no deeper than its chains, or whose build costs more
    than its extra depth gains, has it built only every MEASURE_EVERY-th round (to keep its
    depth measured); one whose trees held deeper and whose build is cheap, every round; a
    row with a fixed node budget, every round whatever it costs."""
    rng = np.random.default_rng(3)
    v = cyclic_target.config.vocab_size
    # (every token occurs in the prompt, so a lookup always finds a match)
    prompts = [np.concatenate([rng.permutation(v), _branchy_prompt(rng, v)]).astype(np.int32) for _ in range(2)]
    deep, shallow = [2500.0, 500.0], [500.0, 500.0]  # (summed depth, rounds): 5 and 1
    due = {}
    for name, shapes, auto, cost in [("tie", [shallow, shallow], True, 0.0), ("dear", [shallow, deep], True, 50.0),
                                     ("cheap", [shallow, deep], True, 0.01), ("fixed", [shallow, shallow], False, 50.0)]:
        built = _built_rounds(cyclic_target, prompts, shapes, [auto] * 2, cost)
        assert len(built) == 2 * MEASURE_EVERY, name
        due[name] = built
    for name in ("tie", "dear"):
        assert due[name] == {i: i % MEASURE_EVERY == 0 for i in due[name]}, name
    for name in ("cheap", "fixed"):
        assert all(due[name].values()), name


def test_bad_tree_settings_are_refused(cyclic_target):
    with pytest.raises(ProposerError, match="tree must be an integer in"):
        Speculation(k=7, tree=16)
    engine = Engine(cyclic_target, Speculation(k=7, tree=4), max_batch=1, max_len=64)
    with pytest.raises(GenerationError, match=r"tree must be an integer in \[0, 4\]"):
        engine.submit([1, 2, 3], max_new_tokens=4, tree=5)
    with pytest.raises(ProposerError, match="or 'auto', got 'yes'"):
        Speculation(k=7, tree="yes")
    chains = Engine(cyclic_target, Speculation(k=7), max_batch=1, max_len=64)
    with pytest.raises(GenerationError, match=r"tree must be an integer in \[0, 0\].*got 'auto'"):
        chains.submit([1, 2, 3], max_new_tokens=4, tree="auto")
