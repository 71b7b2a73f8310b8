"""The DFlash drafter's Markov head (DSpark, arXiv:2607.05147): drafts chosen left to
right against a NumPy re-derivation, the training forward against the inference forward,
saving beside the public files, training that leaves the drafter as it would be without
the head, and exactness in the engine (greedy and sampled rows against their plain runs
alone; sampled drafts against the exact target law)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from conftest import hidden_states, repeating_prompt
from test_engine_dflash import block_case, block_drafts, block_logits
from specjax import Sampling, dflash, sampling as smp
from specjax.dflash import MARKOV, MARKOV_FILE, DFlashError, load_dflash, save_dflash
from specjax.drafters import draft_head
from specjax.engine import Engine, Speculation
from specjax.proposers import DFlashProposer

SETTINGS = [Sampling(), Sampling(0.8, top_k=40, top_p=0.9), Sampling(), Sampling(1.1, min_p=0.05)]


def _with_head(drafter: dflash.Drafter, rank: int, seed: int, std: float) -> dflash.Drafter:
    """The drafter with a random Markov head large enough to change its drafts."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    v = drafter.config.vocab_size
    head = {"w1": std * jax.random.normal(k1, (v, rank)), "w2": std * jax.random.normal(k2, (v, rank))}
    return dataclasses.replace(drafter, params={**drafter.params, MARKOV: head})


def _bias(drafter: dflash.Drafter, prev: int, ids: np.ndarray | None = None) -> np.ndarray:
    head = {k: np.asarray(v, np.float64) for k, v in drafter.params[MARKOV].items()}
    w2 = head["w2"] if ids is None else head["w2"][ids]
    return head["w1"][prev] @ w2.T


def _block_case(tiny, rng, vocab_size: int | None):
    """(model, drafter with a head, its context state, last [2], start [2], vocab or None)."""
    model = tiny[2]
    cfg = model.config
    drafter = _with_head(dflash.init(cfg, jax.random.key(3), num_layers=1, block_size=8, target_layer_ids=(1,),
                                     std=0.3), rank=6, seed=4, std=1.0)
    vocab = None if vocab_size is None else np.sort(rng.choice(cfg.vocab_size, vocab_size, replace=False))
    return (model, drafter, *block_case(model, drafter, rng), vocab)


def test_a_draft_vocabulary_head_without_the_markov_head_is_refused(tiny, rng):
    """A drafter with a Markov head and a draft vocabulary's head built without it: an
    error naming draft_head's markov argument, not drafts from the unbiased rows."""
    model, drafter, fc, last, start, vocab = _block_case(tiny, rng, 30)
    cfg = model.config
    head = draft_head(model.params, cfg, vocab, None)
    with pytest.raises(ValueError, match=r"draft_head\(\.\.\., markov="):
        block_drafts(drafter.params, drafter.config, fc, model.params, cfg, last, start, 7,
                     jnp.array([1, 2], jnp.uint32), smp.RowSampling.of([Sampling(), Sampling()]),
                     jnp.array([False, False]), False, head)


@pytest.mark.parametrize("vocab_size", [None, 30])
def test_markov_drafts_are_chosen_left_to_right(tiny, rng, vocab_size):
    """Greedy rows: each draft is the argmax of the block row's logits plus the head's bias
    from the draft before it (NumPy), and the head changes some draft. Sampled rows: each
    draft's q is the transform of its row's logits biased by the token actually drawn
    before it."""
    model, drafter, fc, last, start, vocab = _block_case(tiny, rng, vocab_size)
    cfg, d = model.config, drafter.config
    unary, _ = block_logits(drafter.params, d, fc.kv, model.params, cfg, last, start, k=7)
    unary = np.asarray(unary, np.float64)
    head = None if vocab is None else draft_head(model.params, cfg, vocab, drafter.params[MARKOV])
    ids = np.arange(cfg.vocab_size) if vocab is None else vocab
    if vocab is not None:  # block_logits over the whole head; a draft vocabulary scores its rows only
        unary = unary[..., vocab]
    rs = smp.RowSampling.of([Sampling(), Sampling(0.9, top_k=10)])
    seeds = jnp.array([1, 2], jnp.uint32)
    drafts, _, _, _ = block_drafts(drafter.params, d, fc, model.params, cfg, last, start, 7, seeds, rs,
                                   jnp.array([False, False]), False, head)
    drafts = np.asarray(drafts)
    for r in range(2):
        prev, want = int(last[r]), []
        for j in range(7):
            prev = int(ids[np.argmax(unary[r, j] + _bias(drafter, prev, vocab))])
            want.append(prev)
        assert drafts[r].tolist() == want
    plain = {k: v for k, v in drafter.params.items() if k != MARKOV}
    without, _, _, _ = block_drafts(plain, d, fc, model.params, cfg, last, start, 7, seeds, rs,
                                    jnp.array([False, False]), False, head)
    assert not np.array_equal(np.asarray(without), drafts)  # the head mattered

    drafts, logq, _, _ = block_drafts(drafter.params, d, fc, model.params, cfg, last, start, 7, seeds, rs,
                                      jnp.array([False, True]), True, head)
    drafts, logq = np.asarray(drafts), np.asarray(logq)
    prev = int(last[1])
    for j in range(7):
        logits = np.full(cfg.vocab_size, -np.inf, np.float32)
        logits[ids] = unary[1, j] + _bias(drafter, prev, vocab)
        one = smp.RowSampling.of([Sampling(0.9, top_k=10)])
        want = np.asarray(smp.transform_rows(jnp.asarray(logits[None]), one))[0]
        np.testing.assert_allclose(np.exp(logq[1, j]), np.exp(want), atol=1e-5)
        assert np.exp(logq[1, j, drafts[1, j]]) > 0
        prev = int(drafts[1, j])


@pytest.mark.parametrize("vocab_size", [None, 30])
def test_markov_tree_is_the_best_scored_set_of_paths(tiny, rng, vocab_size):
    """A greedy row's DFlash tree through a Markov head, by brute force in NumPy: every
    path whose each token is among the top MARKOV_BRANCH of its block row biased by the
    token before it, scored by summed log-softmax of those biased rows; the first n nodes
    laid out are the n best paths, and the nodes marked main are the row's greedy drafts."""
    from specjax import trees
    from specjax.drafters import MARKOV_BRANCH, tree_capacity

    model, drafter, fc, last, start, vocab = _block_case(tiny, rng, vocab_size)
    cfg, d = model.config, drafter.config
    k, nodes = 4, 4
    unary, _ = block_logits(drafter.params, d, fc.kv, model.params, cfg, last, start, k=k)
    unary = np.asarray(unary, np.float64)
    head = None if vocab is None else draft_head(model.params, cfg, vocab, drafter.params[MARKOV])
    ids = np.arange(cfg.vocab_size) if vocab is None else vocab
    if vocab is not None:
        unary = unary[..., vocab]
    rs = smp.RowSampling.of([Sampling(), Sampling()])
    drafts, _, _, ranked = block_drafts(drafter.params, d, fc, model.params, cfg, last, start, k,
                                        jnp.array([1, 2], jnp.uint32), rs, jnp.array([False, False]), False, head,
                                        tree_nodes=nodes)
    for r in range(2):
        paths = {}

        def grow(path, prev, score):
            if len(path) == k:
                return
            row = unary[r, len(path)] + _bias(drafter, prev, vocab)
            lp = row - row.max() - np.log(np.exp(row - row.max()).sum())
            for t in np.argsort(-lp)[:MARKOV_BRANCH]:
                paths[path + (int(ids[t]),)] = score + lp[t]
                grow(path + (int(ids[t]),), int(ids[t]), score + lp[t])

        grow((), int(last[r]), 0.0)
        best = sorted(paths, key=lambda p: -paths[p])
        for n in range(1, nodes + 1):
            one = jax.tree.map(lambda x: x[r:r + 1], ranked)
            got_drafts, parents, main, got_n = trees.arrange(one, jnp.asarray([n]), tree_capacity(k, nodes, True))
            tokens, parents = np.concatenate([[-1], np.asarray(got_drafts[0])]), np.asarray(parents[0])
            assert int(got_n[0]) == n
            got = {}
            for i in range(1, n + 1):
                path, j = [], i
                while j > 0:
                    path.append(int(tokens[j]))
                    j = int(parents[j])
                got[tuple(path[::-1])] = bool(main[0, i])
            assert set(got) == set(best[:n])
            greedy = [int(t) for t in np.asarray(drafts[r])]
            assert {p for p, m in got.items() if m} == {tuple(greedy[:j]) for j in range(1, k + 1)} & set(got)


def test_training_forward_equals_inference_forward(tiny, rng):
    """The logits a training step scores (`dflash.block_markov_logits` over `block_logits`,
    teacher-forced) equal the biased logits the engine drafts from (as log-probabilities)
    when the drafts are the sequence's own tokens: a sequence whose tokens after the anchor are the engine's
    greedy drafts."""
    from specjax.drafters import markov_drafts

    model = tiny[2]
    cfg = model.config
    drafter = _with_head(dflash.init(cfg, jax.random.key(5), num_layers=2, block_size=8, target_layer_ids=(0, 2),
                                     std=0.2), rank=5, seed=6, std=1.0)
    d = drafter.config
    n = 23
    context = rng.integers(0, cfg.vocab_size, n + 1).astype(np.int32)
    _, _, taps = hidden_states(model.params, cfg, context[None, :-1], np.arange(n)[None], taps=d.target_layer_ids)
    cache = dflash.append_context(drafter.params, d, dflash.init_cache(d, 64), taps[:, 0], n, np.arange(n))
    unary = dflash.draft_block(drafter.params, d, cache, model.params, cfg, context[-1], n, k=7)  # [7, V]
    rs = smp.RowSampling.of([Sampling(1.0)])  # q: the biased row's softmax; the row drafts its argmax
    drafts, logq, _ = markov_drafts(drafter.params[MARKOV], unary[None], jnp.asarray(context[-1:]),
                                    jnp.array([n]), jnp.array([0], jnp.uint32), rs, jnp.array([False]),
                                    True, cfg.vocab_size, None, False)
    tokens = np.concatenate([context, np.asarray(drafts[0])])  # the anchor's block is [context[-1], drafts]
    _, _, taps = hidden_states(model.params, cfg, tokens[None], np.arange(len(tokens))[None], taps=d.target_layer_ids)
    features = taps[:, 0].transpose(1, 0, 2).reshape(len(tokens), -1)
    anchors = jnp.array([n])
    block = jnp.full((1, d.block_size), d.mask_token_id, jnp.int32).at[0, 0].set(int(context[-1]))
    train = dflash.block_logits(drafter.params, d, model.params, cfg, features, block, anchors)
    train = dflash.block_markov_logits(drafter.params[MARKOV], train, jnp.asarray(tokens), anchors)
    np.testing.assert_allclose(np.asarray(jax.nn.log_softmax(train[0])), np.asarray(logq[0]), atol=1e-4, rtol=1e-4)


def test_a_drafter_saved_with_a_head_loads_with_and_without_it(tiny, tmp_path):
    model = tiny[2]
    drafter = dflash.init(model.config, jax.random.key(7), num_layers=1, block_size=4, std=0.2)
    save_dflash(drafter, tmp_path / "plain", dtype="float32")
    with_head = _with_head(drafter, rank=3, seed=8, std=0.5)
    save_dflash(with_head, tmp_path / "d", dtype="float32")
    # the public files are those of the drafter alone: any DFlash loader reads them
    weights = [(tmp_path / name / "model.safetensors").read_bytes() for name in ("d", "plain")]
    assert weights[0] == weights[1]
    assert json.loads((tmp_path / "d" / "config.json").read_text()) == json.loads(
        (tmp_path / "plain" / "config.json").read_text())
    loaded = load_dflash(tmp_path / "d", model)
    for key in ("w1", "w2"):
        np.testing.assert_array_equal(np.asarray(loaded.params[MARKOV][key]), np.asarray(with_head.params[MARKOV][key]))
    assert MARKOV not in load_dflash(tmp_path / "d", model, markov=False).params
    save_dflash(drafter, tmp_path / "d", dtype="float32")  # without one: the file goes too
    assert not (tmp_path / "d" / MARKOV_FILE).exists()


def test_bad_markov_files_are_refused(tiny, tmp_path):
    from safetensors.numpy import save_file

    model = tiny[2]
    save_dflash(dflash.init(model.config, jax.random.key(7), num_layers=1, block_size=4), tmp_path, dtype="float32")
    v = model.config.vocab_size
    w1, w2 = dflash.MARKOV_NAMES["w1"], dflash.MARKOV_NAMES["w2"]
    for tensors, why in (({w1: np.zeros((v, 4), np.float32)}, "expected tensors"),
                         ({w1: np.zeros((v, 4), np.float32), w2: np.zeros((v, 3), np.float32)}, "must both be"),
                         ({w1: np.zeros((v + 1, 4), np.float32), w2: np.zeros((v + 1, 4), np.float32)},
                          "must both be")):
        save_file(tensors, str(tmp_path / MARKOV_FILE))
        with pytest.raises(DFlashError, match=f"{MARKOV_FILE}: .*{why}"):
            load_dflash(tmp_path, model)
    drafter = dflash.init(model.config, jax.random.key(7), num_layers=1, block_size=4)
    for head, why in (({"w1": np.zeros((v, 4))}, "a Markov head is"),
                      ({"w1": np.zeros((50, 4)), "w2": np.zeros((50, 4))}, r"must both be \[101, rank\]")):
        with pytest.raises(DFlashError, match=f"its Markov head .*{why}"):  # built in memory
            specjax.DFlashProposer(dataclasses.replace(drafter, params={**drafter.params, MARKOV: head}), k=3)
    (tmp_path / MARKOV_FILE).write_bytes(b"not safetensors")
    with pytest.raises(DFlashError, match="not a readable safetensors file"):
        load_dflash(tmp_path, model)


def _bigram_head(drafter: dflash.Drafter, runs: list[list[int]], strength: float = 30.0) -> dflash.Drafter:
    """The drafter with a Markov head that proposes, after token x, a token that followed x
    in `runs`: w1 the identity (rank V), w2[y, x] = strength for each pair x -> y seen."""
    v = drafter.config.vocab_size
    w2 = np.zeros((v, v), np.float32)
    for run in runs:
        for x, y in zip(run, run[1:]):
            w2[y, x] = strength
    head = {"w1": jnp.eye(v, dtype=jnp.float32), "w2": jnp.asarray(w2)}
    return dataclasses.replace(drafter, params={**drafter.params, MARKOV: head})


@pytest.mark.parametrize("kind", ["draft vocabulary", "tree"])
def test_rows_with_markov_drafts_equal_their_plain_run_alone(cyclic_target, rng, kind):
    """Greedy and sampled rows in one batch drafting through a Markov head that knows the
    greedy runs' bigrams (so drafts get accepted, which a random drafter's never are),
    chains over a draft vocabulary or the block's best trees: each row's tokens are its
    plain run's alone; the bigrams the head knows are what made drafts right."""
    target = cyclic_target
    v = target.config.vocab_size
    prompts = [repeating_prompt(rng, v, period=6), rng.integers(0, v, 11), rng.integers(0, v, 140),
               repeating_prompt(rng, v, period=9)]
    seeds = [int(s) for s in rng.integers(0, 1 << 30, len(prompts))]
    news = [40, 25, 33, 48]
    alone = [specjax.generate(target, p, max_new_tokens=n, sampling=s, seed=sd, stop_ids=()).tokens
             for p, n, s, sd in zip(prompts, news, SETTINGS, seeds)]
    plain = dflash.init(target.config, jax.random.key(1), num_layers=1, block_size=8, target_layer_ids=(1,),
                        std=0.2)
    if kind == "draft vocabulary":
        plain = dataclasses.replace(plain, vocab=np.unique(np.concatenate([alone[0], alone[2]])).astype(np.int32))
    accepted = {}  # on the two greedy rows, whose runs' bigrams the head knows
    # against a head that knows no bigram (its w2 all 0: the block's own drafts, through the
    # same compiled steps)
    for name, drafter in (("plain", _bigram_head(plain, [])), ("head", _bigram_head(plain, [alone[0], alone[2]]))):
        proposer = DFlashProposer(drafter, k=7, tree=6 if kind == "tree" else 0)
        got = specjax.generate(target, prompts, max_new_tokens=news, sampling=SETTINGS, seed=seeds, stop_ids=(),
                               speculative=proposer)
        assert [g.tokens for g in got] == alone
        accepted[name] = got[0].stats.accepted + got[2].stats.accepted
    assert accepted["head"] > accepted["plain"], accepted


def test_sampled_markov_drafts_follow_the_target_distribution(tmp_path_factory):
    """Chi-square of tokens 2-3 against the exact target law: 3-node trees of sampled
    drafts, a chain of two (the second's q conditioned on the token drawn before it) and a
    sibling of the first drawn without replacement from the same q."""
    from test_speculative import engine_follows, sampled_draft_case

    target, _, s, ids, exact = sampled_draft_case(tmp_path_factory)
    drafter = dflash.init(target.config, jax.random.key(2), num_layers=1, block_size=4, std=0.3)
    drafter = _with_head(drafter, rank=4, seed=3, std=1.0)
    engine = Engine(target, Speculation(k=3, adaptive=False, tree=3), dflash=drafter, sample_drafts=True,
                    max_batch=12, max_len=64)
    engine_follows(engine, ids, s, exact)
