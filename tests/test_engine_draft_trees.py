"""Draft-model trees (EAGLE-2 style, `drafters.draft_tree`) in the engine: the expansion
equals a best-first re-derivation from plain forwards of the draft model; rows drafting
trees equal their request run alone without speculation (greedy and sampled, budgets 2 to
15, a stop id and max_new_tokens inside an accepted path, batch 4 and batch 1); trees
branch where the draft is unsure while chain rows never do; and after every call the draft
cache holds exactly the committed tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import Sampling, qwen3
from specjax import kv as kvlib
from specjax.drafters import draft_tree, draft_tree_shape
from specjax.engine import Engine, Speculation, engine_options
from specjax.proposers import DraftProposer, NgramProposer, ProposerError
from specjax.rounds import new_state, rounds
from specjax.sampling import RowSampling
from specjax.steps import BUCKETS
from conftest import assert_follows, hf_tiny

NOISE = 0.3  # the draft: the target's weights plus this much of each tensor's spread in noise


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target, draft): a random target that falls into cycles and a draft made of its
    weights with noise, so it agrees with the target often but not always."""
    import torch

    root = tmp_path_factory.mktemp("draft-trees")
    hf_tiny(root / "t", seed=3, init=0.1)
    noisy = hf_tiny(root / "d", seed=3, init=0.1)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(NOISE * p.std() * torch.randn_like(p))
    noisy.save_pretrained(root / "d")
    return specjax.load(root / "t"), specjax.load(root / "d")


@pytest.fixture(scope="module")
def engine(pair):
    """Four rows, every one drafting k = 15 from the draft model each round (no chooser),
    a tree budget of up to 15; short calls, so requests span several of them."""
    target, draft = pair
    return Engine(target, Speculation(k=15, tree=15, adaptive=False), draft=draft, max_batch=4, max_len=256,
                  rounds=4)


def _alone(model, prompts, news, settings, seeds, stops):
    solo = Engine(model, None, max_batch=1, max_len=256)
    return [solo.submit(p, max_new_tokens=n, sampling=s, seed=sd, stop_ids=st).result().tokens
            for p, n, s, sd, st in zip(prompts, news, settings, seeds, stops)]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max()
    return x - np.log(np.exp(x).sum())


def _reference_tree(next_lp, nodes: int) -> tuple[set, list[int]]:
    """EAGLE-2's expansion by brute force, from next_lp(path) (the draft's log-softmax after
    the prompt and path): depth 1 the root's top K, then each depth the frontier's (the K
    best of the newest depth by cumulative log-prob) top K children each; the best `nodes`
    of every candidate. Returns the kept nodes as token paths and the greedy chain."""
    width, depth = draft_tree_shape(nodes)
    top = lambda lp: [int(t) for t in np.argsort(-lp, kind="stable")[:width]]  # noqa: E731
    lp = next_lp(())
    cands = [((t,), lp[t]) for t in top(lp)]
    newest = list(cands)
    for _ in range(depth - 1):
        frontier = sorted(newest, key=lambda c: -c[1])[:width]
        newest = []
        for path, s in frontier:
            lp = next_lp(path)
            newest += [(path + (t,), s + lp[t]) for t in top(lp)]
        cands += newest
    greedy = []
    for _ in range(depth):
        greedy.append(int(np.argmax(next_lp(tuple(greedy)))))
    return {path for path, _ in sorted(cands, key=lambda c: -c[1])[:nodes]}, greedy


def _paths(ranked: dict, r: int) -> list[tuple[int, ...]]:
    """Row r's ranked nodes as token paths from the root (each parent ranked before its child)."""
    at = {int(t): i for i, t in enumerate(np.asarray(ranked["trie"][r]))}
    token, parent = np.asarray(ranked["token"][r]), np.asarray(ranked["parent"][r])
    paths = []
    for i in range(len(token)):
        up = int(parent[i])
        assert up == 0 or at[up] < i, "a node ranked above its parent"
        paths.append((paths[at[up]] if up else ()) + (int(token[i]),))
    return paths


WIDTH = 24  # tokens of every reference forward (prompt and path, padded): one compiled shape


def test_expansion_matches_a_best_first_rederivation(pair):
    """The tree of 15 nodes (frontier 4, depth 9: the whole 32-slot ancestor window) after
    two prompts (one batch, cached prompt, tree attention) equals the best-first expansion
    computed from plain causal forwards of the draft over each node's path; its greedy
    chain is the draft's own greedy continuation."""
    _, draft = pair
    params, cfg = draft.params, draft.config
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n) for n in (9, 5)]
    sizes = np.array([len(p) for p in prompts], np.int32)
    # causal, so the padding after a sequence's last token does not reach its logits there
    forward = jax.jit(lambda t: qwen3.forward(params, cfg, t, jnp.arange(WIDTH)[None])[0][0])
    for nodes in (15,):
        kv = kvlib.init(cfg, 2, 128, jnp.float32)
        tokens = np.zeros((2, 16), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
        h, kv, _ = qwen3.hidden_states(params, cfg, jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(16), (2, 16)), kv)
        logits = qwen3.unembed(params, cfg, h[np.arange(2), sizes - 1])
        ranked, greedy, greedy_n, _, _ = jax.jit(draft_tree, static_argnames=("dcfg", "nodes"))(
            params, dcfg=cfg, dkv=kv, logits=logits, size=jnp.asarray(sizes), nodes=nodes, levels=jnp.int32(99))
        for r, p in enumerate(prompts):
            def next_lp(path, p=p):
                seq = list(p) + list(path)
                padded = np.zeros((1, WIDTH), np.int32)
                padded[0, :len(seq)] = seq
                return _log_softmax(np.asarray(forward(jnp.asarray(padded)))[len(seq) - 1])
            want, chain = _reference_tree(next_lp, nodes)
            got = _paths(ranked, r)
            assert len(got) == nodes and set(got) == want
            n = int(greedy_n[r])
            assert n >= 1 and list(np.asarray(greedy[r, :n])) == chain[:n]
            main = [path for path, m in zip(got, np.asarray(ranked["main"][r])) if m]
            assert main == [tuple(chain[:len(x)]) for x in main]  # "main" nodes lie on the greedy chain


SPAN_LAG = 16  # a draft cache fed every round lags the committed tokens by at most a round's worth
CHECKED = 80  # tokens a draft-cache check covers (one compiled prefill)


def _fresh_keys(draft):
    """keys(ids [1, CHECKED]): the draft's last-layer keys [K, CHECKED, E] of a fresh prefill."""
    cfg = draft.config

    def keys(ids):
        kv = kvlib.init(cfg, 1, CHECKED, jnp.float32)
        _, kv, _ = qwen3.hidden_states(draft.params, cfg, ids, jnp.arange(CHECKED)[None], kv)
        return kvlib.layer_slots(kv.k, cfg.num_hidden_layers - 1)
    return jax.jit(keys)


def _cache_holds_committed(engine, req, keys, lag: int = SPAN_LAG) -> None:
    """The draft cache's keys of req's row at its dlen positions equal those of a fresh
    prefill of its committed tokens (the last layer's: they depend on every earlier one),
    and, for a row that drafts (k > 0), it lags them by at most `lag`. A row that never
    drafts is fed only beside rows that do: once they are gone, it may lag any amount."""
    n = req.dlen
    assert n <= req.length <= CHECKED
    assert req.k == 0 or req.length - lag <= n, (req.length, n)
    slots = np.asarray(kvlib.row_slots(jnp.asarray(engine.table[req.slot:req.slot + 1]), engine.page_size))[0, :n]
    got = np.asarray(kvlib.layer_slots(engine.dk_pool, engine.draft.config.num_hidden_layers - 1))[:, slots]
    ids = np.zeros((1, CHECKED), np.int32)
    ids[0, :n] = engine.history[req.slot, :n]
    np.testing.assert_allclose(got, np.asarray(keys(jnp.asarray(ids)))[:, :n], atol=2e-4, rtol=2e-4)


def test_tree_rows_equal_their_plain_run_alone(pair, engine, rng):
    """Budgets 2, 5 and 15, greedy and sampled rows in one batch, a stop id inside what a
    path may accept, max_new_tokens ending mid-path; after every call the draft cache
    holds exactly the committed tokens; then batch 1. (The last row decodes plainly, one
    token a round, and longest: the batch keeps its 4 rows, one compile.)"""
    target, draft = pair
    v = target.config.vocab_size
    prompts = [rng.integers(0, v, int(n)) for n in rng.integers(6, 20, 4)]
    news = [23, 31, 12, 31]
    budgets = [2, 5, 15, 0]
    settings = [Sampling(), Sampling(0.8), Sampling(1.0, top_k=20), Sampling()]
    seeds = [int(s) for s in rng.integers(0, 2 ** 31, 4)]
    full = _alone(target, prompts, news, settings, seeds, [()] * 4)
    stop = next((x for i, x in enumerate(full[1]) if i >= 8 and x not in full[1][:i]), None)  # first seen late
    stops = [(), () if stop is None else (stop,), (), ()]
    want = _alone(target, prompts, news, settings, seeds, stops)
    reqs = [engine.submit(p, max_new_tokens=n, sampling=s, seed=sd, stop_ids=st, tree=t, lookup=False,
                          k=15 if t else 0)
            for p, n, s, sd, st, t in zip(prompts, news, settings, seeds, stops, budgets)]
    keys = _fresh_keys(draft)
    while engine.has_work():  # no row drafts a chain here: the draft cache after tree rounds alone
        engine.step()
        for r in engine.running:
            _cache_holds_committed(engine, r, keys)
    assert [r.tokens for r in reqs] == want
    assert all(r.stats.drafted > 0 for r in reqs[:3])
    one = Engine(target, Speculation(k=7, tree=5, adaptive=False), draft=draft, max_batch=1, max_len=256)
    req = one.submit(prompts[0], max_new_tokens=news[0], sampling=settings[0], seed=seeds[0], stop_ids=(), lookup=False)
    assert req.result().tokens == want[0]


def test_trees_branch_chains_do_not_and_the_draft_cache_holds_committed_tokens(pair, engine):
    """Tree rows' accepted paths leave the draft's greedy chain somewhere and a chain row
    (tree=0, same engine) never does; all equal their runs alone; after every call each
    running row's draft cache holds exactly its committed tokens. (Fixed prompts: whether a
    tree branches depends on what the random models generate. A sampled row and the plain
    last row: the batch compiled for the test above.)"""
    target, draft = pair
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, target.config.vocab_size, 12) for _ in range(4)]
    news, settings, budgets = [48, 48, 48, 56], [Sampling(), Sampling(0.8), Sampling(), Sampling()], [15, 15, 0, 0]
    want = _alone(target, prompts, news, settings, [5] * 4, [()] * 4)
    reqs = [engine.submit(p, max_new_tokens=n, sampling=s, seed=5, stop_ids=(), lookup=False, tree=t,
                          k=0 if i == 3 else 15)
            for i, (p, n, s, t) in enumerate(zip(prompts, news, settings, budgets))]
    keys, checked = _fresh_keys(draft), 0
    while engine.has_work():
        engine.step()
        for r in engine.running:
            _cache_holds_committed(engine, r, keys)
            checked += 1
    assert checked > 4
    assert [r.tokens for r in reqs] == want
    assert sum(r.stats.branched for r in reqs[:2]) > 0
    assert reqs[2].stats.drafted > 0 and reqs[2].stats.branched == 0


def test_one_tree_budget_covers_the_draft_model(pair):
    """DraftProposer(tree=) is checked and sets the engine's budget as the other proposers' do."""
    from specjax.adaptive import Adaptive

    _, draft = pair
    with pytest.raises(ProposerError, match="tree must be an integer in"):
        DraftProposer(draft, k=4, tree=16)
    options, _ = engine_options(Adaptive(NgramProposer(k=7, tree=3), DraftProposer(draft, k=7, tree=9)))
    assert options["speculative"].tree == 9
    assert engine_options(DraftProposer(draft, k=5, tree=4))[0]["speculative"].tree == 4


@pytest.mark.parametrize("k, tree", [(3, 1), (1, 5), (1, "auto")])
def test_trees_of_one_node_equal_the_plain_run(pair, rng, k, tree):
    """A draft-model tree of one node (tree=1, or k=1 whatever the budget) is the root's
    best child, grown with no draft step: greedy and sampled rows equal their plain runs."""
    target, draft = pair
    v = target.config.vocab_size
    prompts = [rng.integers(0, v, n).astype(np.int32) for n in (5, 30)]
    settings = [Sampling(), Sampling(0.8)]
    want = _alone(target, prompts, [30, 30], settings, [1, 2], [(), ()])
    options, per_request = engine_options(DraftProposer(draft, k=k, tree=tree))
    engine = Engine(target, **options, max_batch=2, max_len=128)
    reqs = [engine.submit(p, max_new_tokens=30, sampling=s, seed=sd, **per_request)
            for p, s, sd in zip(prompts, settings, [1, 2])]
    engine.run()
    assert [r.tokens for r in reqs] == want
    assert sum(r.stats.drafted for r in reqs) > 0
    if tree != "auto":  # every round of a fixed budget verifies its one-node tree
        assert sum(r.stats.tree_steps for r in reqs) > 0


def test_sampled_draft_trees_equal_their_run_alone_branch_and_keep_the_draft_cache(pair, rng):
    """Sampled draft-model drafts (sample_drafts) as trees (`drafters.draft_sampled_tree`):
    tree rows (budgets 5 and 15, one with a stop id inside what a path may accept) and a
    sampled chain row (tree=0) in a batch of 4 equal the same requests run alone on an
    engine of one row (the drafts are position-keyed draws, so the batch changes nothing);
    after every call the draft cache holds exactly the committed tokens; tree rows'
    accepted paths leave the spine somewhere, the chain row's never."""
    target, draft = pair
    v = target.config.vocab_size
    prompts = [rng.integers(0, v, int(n)) for n in rng.integers(6, 20, 4)]
    news, budgets = [40, 33, 40, 40], [15, 5, 15, 0]
    settings = [Sampling(1.0), Sampling(0.8), Sampling(1.0, top_k=20), Sampling(1.0)]
    seeds = [int(s) for s in rng.integers(0, 2 ** 31, 4)]
    spec = Speculation(k=15, tree=15, adaptive=False)

    def submit(engine, i, stops):
        return engine.submit(prompts[i], max_new_tokens=news[i], sampling=settings[i], seed=seeds[i],
                             stop_ids=stops, tree=budgets[i], lookup=False)
    solo = Engine(target, spec, draft=draft, sample_drafts=True, max_batch=1, max_len=256, rounds=4)
    free = submit(solo, 1, ()).result().tokens
    stop = next((x for i, x in enumerate(free) if i >= 8 and x not in free[:i]), None)
    stops = [(), () if stop is None else (stop,), (), ()]
    alone = [submit(solo, i, stops[i]) for i in range(4)]
    want = [r.result().tokens for r in alone]
    batch = Engine(target, spec, draft=draft, sample_drafts=True, max_batch=4, max_len=256, rounds=4)
    reqs = [submit(batch, i, stops[i]) for i in range(4)]
    keys = _fresh_keys(draft)
    while batch.has_work():
        batch.step()
        for r in batch.running:
            _cache_holds_committed(batch, r, keys)
    assert [r.tokens for r in reqs] == want
    assert stop is None or want[1][-1] == stop
    assert all(r.stats.drafted > 0 for r in reqs)
    assert sum(r.stats.branched for r in alone[:3] + reqs[:3]) > 0
    assert alone[3].stats.branched == reqs[3].stats.branched == 0


def test_sampled_draft_tree_rule_follows_the_target_law():
    """`drafters.draft_sampled_tree` + `tree_accept.accept_tree_rows` on Markov models over
    8 tokens (target and draft laws depend on the last token, so q differs per node):
    chains drawn as `drafters.chain` draws them, trees of 6 nodes (spine 4, second children
    under the root and node 1), over 20000 seeds; the first two committed tokens (the
    second drawn from the target after the first where only one was committed) follow the
    exact law p(a) p(b | a) (chi-square)."""
    from specjax import sampling as smp
    from specjax.drafters import draft_sampled_tree
    from specjax import trees
    from specjax.tree_accept import accept_tree_rows

    v, rows, nodes, size = 8, 20000, 6, 7
    rng = np.random.default_rng(4)
    p_logits = jnp.asarray(rng.normal(size=(v, v)) * 1.5, jnp.float32)  # target logits after each token
    q_logits = jnp.asarray(rng.normal(size=(v, v)) * 1.5, jnp.float32)  # the draft's
    root = 3
    rs = smp.RowSampling.of([Sampling(1.0)] * rows)
    seeds = jnp.arange(rows, dtype=jnp.uint32)
    sizes = jnp.full((rows,), size, jnp.int32)

    @jax.jit
    def run(p_logits, q_logits, seeds, sizes):
        last, drafts, logqs = jnp.full((rows,), root), [], []
        for d in range(nodes):  # the chain: draft d at position size + d, from q after the previous token
            lq = smp.transform_rows(q_logits[last], rs)
            keys = jax.vmap(lambda s: smp.position_key(s, smp.DRAFT, size + d))(seeds)
            last = jax.vmap(smp.sample)(lq, keys)
            drafts.append(last)
            logqs.append(lq)
        drafts, logq = jnp.stack(drafts, 1), jnp.stack(logqs, 1)
        tokens, parents, _, n = draft_sampled_tree(drafts, logq, sizes, seeds, jnp.full((rows,), nodes), nodes)
        tokens = jnp.concatenate([jnp.full((rows, 1), root, jnp.int32), tokens], axis=1)
        depth = trees.depths(parents)
        lq_nodes = jnp.pad(logq, ((0, 0), (0, 1), (0, 0)))  # node i's children's q: the chain's at i
        path, accepted, out = accept_tree_rows(p_logits[tokens], tokens, parents, n, lq_nodes, size + depth,
                                               seeds, rs)
        return tokens, parents, out, accepted
    tokens, parents, out, accepted = map(np.asarray, run(p_logits, q_logits, seeds, sizes))
    assert (parents[0, 1:] == [0, 1, 2, 3, 0, 1]).all()
    p = np.exp(np.asarray(p_logits, np.float64))
    p /= p.sum(axis=1, keepdims=True)
    law = p[root][:, None] * p
    second = np.where(accepted >= 1, out[:, 1], [rng.choice(v, p=p[a]) for a in out[:, 0]])
    counts = np.zeros((v, v))
    np.add.at(counts, (out[:, 0], second), 1)
    assert 0 < (accepted >= 1).mean() < 1
    assert_follows(counts.sum(1), law.sum(1), "token 1")
    assert_follows(counts, law, "tokens 1-2")


def _grow_round(pair, costs, auto: list[bool], adaptive: bool) -> tuple[list[bool], int]:
    """One round of the engine's device call (k = 3, a node budget of 3, draft-model drafts
    only) over two rows of 12 committed tokens at the given step costs [plain, chain, tree,
    both] x widths 1, 2, 4 (and 0.2 more where the round also builds a lookup trie, which
    these rows do not draft); returns which rows verified a tree and the step kind run."""
    target, draft = pair
    rows, pages = 2, 4
    history = np.zeros((rows, 64), np.int32)
    history[:, :12] = np.random.default_rng(5).integers(1, target.config.vocab_size, (rows, 12))
    size = np.full(rows, 12, np.int32)
    table = 1 + np.arange(rows * pages, dtype=np.int32).reshape(rows, pages)

    def cache(cfg, lengths):
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, rows * pages + 1, 16, cfg.head_dim)
        return kvlib.KVCache(jnp.zeros(shape), jnp.zeros(shape), jnp.asarray(table), jnp.asarray(lengths), page_size=16)

    log, *_ = rounds(target.params, target.config, cache(target.config, size - 1), jnp.asarray(history),
                     jnp.asarray(size), jnp.full(rows, 8, jnp.int32), jnp.full((rows, 8), -1, jnp.int32),
                     jnp.full(rows, 3, jnp.int32), jnp.asarray([[False, True, False]] * rows),
                     new_state(rows, 3), jnp.asarray(np.concatenate([costs, costs + 0.2]), jnp.float32),
                     jnp.arange(rows, dtype=jnp.uint32),
                     RowSampling.of([Sampling()] * rows), draft.params, cache(draft.config, np.zeros(rows, np.int32)),
                     row_tree=jnp.full(rows, 3, jnp.int32), row_auto=jnp.asarray(auto), dcfg=draft.config, k=3,
                     max_ngram=3, min_ngram=1, n_rounds=1, sampled=False, adaptive=adaptive, tree=3)
    return np.asarray(log["treed"])[0].tolist(), int(np.asarray(log["width"])[0]) // len(BUCKETS)


def test_a_tree_grows_where_its_draft_steps_pay(pair):
    """A draft-model tree's draft steps are a step kind of their own: at a tree round's cost
    equal to a chain round's, auto rows (whose tree's prior depth beats the chain's) grow
    trees; at a much higher one they draft chains, in the chooser's rounds and in fixed-k
    ones; a row with a node budget takes the draft model only as its tree."""
    plain = np.array([1.0, 1.1, 1.2])
    chain = plain + 0.05 * np.array([0, 0, 2])
    cheap = np.stack([plain, chain, chain, chain + 0.3])
    dear = np.stack([plain, chain, chain + 5.0, chain + 5.0])
    for adaptive in (True, False):
        assert _grow_round(pair, cheap, [True, True], adaptive) == ([True, True], 2)
        assert _grow_round(pair, dear, [True, True], adaptive) == ([False, False], 1)
        assert _grow_round(pair, cheap, [False, False], adaptive) == ([True, True], 2)
    assert _grow_round(pair, dear, [False, True], True) == ([False, False], 1)  # the budget row: a plain step
    assert _grow_round(pair, dear, [False, True], False) == ([True, False], 3)  # fixed k: both kinds run


def test_tree_kept_is_the_longest_fed_path_the_round_committed():
    """`drafters.tree_kept` against paths followed node by node: random fed frontiers (3
    depths of 3 slots, tokens from 4 so paths collide, some depths not fed) and committed
    tokens that follow a fed path for a while; kept is the deepest fed node whose path from
    the root is a prefix of the accepted drafts (never the newest token), and each kept
    depth's slot that node's ancestor's."""
    from specjax.drafters import tree_kept

    rng = np.random.default_rng(0)
    rows, levels, width = 64, 3, 3
    tokens = rng.integers(0, 4, (rows, levels, width)).astype(np.int32)
    up = np.full((rows, levels, width), -1, np.int32)
    up[:, 1:] = rng.integers(0, width, (rows, levels - 1, width))
    for r in range(rows):
        tokens[r, 1:][:, 0] = np.where(rng.random(levels - 1) < 0.1, -1, tokens[r, 1:][:, 0])
        for d in range(1, levels):
            if rng.random() < 0.15:
                tokens[r, d:] = -1
        for d in range(levels):  # siblings (same parent slot) are distinct tokens
            for j in range(width):
                same = [i for i in range(j) if up[r, d, i] == up[r, d, j] and tokens[r, d, i] == tokens[r, d, j]]
                if same and tokens[r, d, j] >= 0:
                    tokens[r, d, j] = 4 + j
    out = rng.integers(0, 4, (rows, 8)).astype(np.int32)
    for r in range(rows):  # follow a random fed path for a random number of depths
        lane, depth = rng.integers(0, width), rng.integers(0, levels + 1)
        path = []
        for d in range(levels - 1, -1, -1):
            path.append((d, lane))
            lane = up[r, d, lane] if d else lane
        path = path[::-1]
        for d, lane in path[:depth]:
            out[r, d] = tokens[r, d, lane] if tokens[r, d, lane] >= 0 else out[r, d]
    count = rng.integers(1, 6, rows).astype(np.int32)
    kept, slots = tree_kept((jnp.asarray(tokens), jnp.asarray(up)), jnp.asarray(out), jnp.asarray(count))
    for r in range(rows):
        want, want_slots = 0, list(range(levels))
        for d in range(levels):
            for j in range(width):
                chain, at = [], (d, j)
                while True:  # the node's path from the root, following parent slots
                    chain.append(at)
                    if at[0] == 0:
                        break
                    at = (at[0] - 1, int(up[r, at[0], at[1]]))
                chain = chain[::-1]
                toks = [int(tokens[r, dd, jj]) for dd, jj in chain]
                if -1 not in toks and d + 1 <= count[r] - 1 and toks == out[r, :d + 1].tolist() and d + 1 > want:
                    want, want_slots = d + 1, [dd * width + jj for dd, jj in chain] + list(range(d + 1, levels))
        assert int(kept[r]) == want, r
        assert np.asarray(slots[r]).tolist() == want_slots, r
