"""Sampled DFlash drafts as trees in the engine: a tree whose shape only the node budget
fixes (`drafters.sampled_tree`), verified by recursive rejection sampling without
replacement (`tree_accept.accept_tree_rows`). The committed tokens follow the target's
exact law (chi-square against an enumeration by forwards of the target), trees do branch,
and greedy rows in the same batch keep their plain tokens."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import Sampling, dflash, qwen3, sampling as smp
from specjax.drafters import sampled_tree, sampled_tree_shape
from specjax.engine import Engine, Speculation
from specjax.tree_accept import check_children, children_without_replacement
from conftest import assert_follows, hf_tiny

V = 8  # a tiny vocabulary: the law of two tokens is 64 cells
PROMPT = np.array([3, 5, 1, 2], np.int32)
SAMPLED = Sampling(1.0)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(target, drafter) over 8 tokens: a 2-layer target whose next-token laws are spread
    (no token above 0.3 after PROMPT) and a random 1-layer drafter with blocks of 4."""
    folder = tmp_path_factory.mktemp("sampled_trees")
    hf_tiny(folder, seed=11, vocab_size=V, init=0.15, num_hidden_layers=2)
    target = specjax.load(folder)
    drafter = dflash.init(target.config, jax.random.key(2), num_layers=1, block_size=4, target_layer_ids=(1,),
                          std=0.3)
    return target, drafter


WIDTH = 20  # tokens of every reference forward: one compiled shape [V * V, WIDTH]


def _forward(model):
    """Logits [V * V, WIDTH, V] of a batch of token rows (causal: padding after a row's
    last real token does not reach it), compiled once."""
    return jax.jit(lambda seqs: qwen3.forward(model.params, model.config, seqs,
                                              jnp.broadcast_to(jnp.arange(WIDTH), seqs.shape))[0])


def _pair_law(forward, ids, s):
    """Exact target law of generated tokens 2 and 3 (summed over the 1st), by one forward
    of every continuation [ids, a, b]."""
    n = len(ids)
    seqs = np.zeros((V * V, WIDTH), np.int32)
    seqs[:, :n + 2] = [list(ids) + [a, b] for a, b in itertools.product(range(V), range(V))]
    logits = forward(jnp.asarray(seqs))[:, n - 1:n + 2]  # rows decide tokens 1, 2, 3
    p = np.exp(np.asarray(smp.transform(logits, s), np.float64))
    return np.einsum("a,ab,abc->bc", p[0, 0], p[::V, 1], p[:, 2].reshape(V, V, V))


def _greedy_alone(forward, prompts, n):
    """Plain greedy decoding by full forwards (no cache): each step the argmax (lowest id
    on ties) after each prompt's tokens so far, all prompts in one padded batch."""
    rows = np.arange(len(prompts))
    seqs = np.zeros((V * V, WIDTH), np.int32)
    for i, p in enumerate(prompts):
        seqs[i, :len(p)] = p
    sizes = np.array([len(p) for p in prompts])
    for _ in range(n):
        logits = np.asarray(forward(jnp.asarray(seqs)))
        seqs[rows, sizes] = np.argmax(logits[rows, sizes - 1], axis=-1)
        sizes += 1
    return [seqs[i, len(p):len(p) + n].tolist() for i, p in enumerate(prompts)]


def test_shape_is_the_budgets_alone_and_first_children_are_the_chains_draws():
    """`sampled_tree`: the same parents for any drawn tokens at one budget (the spine,
    then second children at depths 1 ..); a second child q cannot give (-1) is left out;
    and the second children come from draws without replacement whose first is the
    chain's own sampled token (`smp.sample` with the same key)."""
    width = 7
    nodes = jnp.array([0, 1, 2, 3, 6, 7, 7])
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.integers(0, V, (7, width)), jnp.int32)
    b = jnp.asarray(rng.integers(0, V, (7, width)), jnp.int32)
    second = (a + 1) % V
    tok_a, par_a, main_a, n_a, dep_a = sampled_tree(a, second, nodes, width)
    _, par_b, main_b, n_b, _ = sampled_tree(b, (b + 3) % V, nodes, width)
    np.testing.assert_array_equal(par_a, par_b)
    np.testing.assert_array_equal(main_a, main_b)
    np.testing.assert_array_equal(n_a, nodes)
    spine, seconds = map(np.asarray, sampled_tree_shape(nodes))
    assert spine.tolist() == [0, 1, 1, 2, 4, 5, 5] and seconds.tolist() == [0, 0, 1, 1, 2, 2, 2]
    # 7 nodes: spine 1-5 (node j at depth j), then seconds under the root and node 1
    assert np.asarray(par_a[5]).tolist() == [-1, 0, 1, 2, 3, 4, 0, 1]
    assert np.asarray(dep_a[5]).tolist() == [0, 1, 2, 3, 4, 5, 1, 2]
    assert np.asarray(tok_a[5, 5:]).tolist() == [int(second[5, 0]), int(second[5, 1])]
    check_children(np.concatenate([np.zeros((7, 1), np.int32), np.asarray(tok_a)], 1), np.asarray(par_a),
                   np.asarray(n_a))
    # row 6: block row 0 has one token only, so its second child is left out and node 1's moves up
    gap = np.asarray(second).copy()
    gap[6, 0] = -1
    tok, par, main, n, _ = sampled_tree(a, jnp.asarray(gap), nodes, width)
    assert int(n[6]) == 6 and np.asarray(par[6, :7]).tolist() == [-1, 0, 1, 2, 3, 4, 1]
    assert int(tok[6, 5]) == gap[6, 1] and not bool(main[6, 6])

    logq = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(64, V)) * 2, jnp.float32))
    keys = jax.vmap(lambda s, p: smp.position_key(s, smp.DRAFT, p))(jnp.arange(64, dtype=jnp.uint32),
                                                                    jnp.arange(64) + 9)
    pairs = jax.vmap(lambda lq, k: children_without_replacement(lq, k, 2))(logq, keys)
    np.testing.assert_array_equal(pairs[:, 0], jax.vmap(smp.sample)(logq, keys))
    assert (pairs[:, 0] != pairs[:, 1]).all()


def test_sampled_trees_follow_the_target_law_and_greedy_rows_their_plain_run(small):
    """One engine (DFlash alone, k = 3, trees of 3 nodes: the chain's 2 draws and a second
    child at depth 1), batches of 48 mixing sampled tree rows, sampled chain rows (tree=0)
    and greedy rows (the block's greedy tree): the sampled rows' generated tokens 2-3
    follow the exact target law (chi-square, both kinds), trees branch (a second child
    was accepted), chains never do, and the greedy rows are their plain decoding. (At
    this size the chi-square of token 2 caught the sampled trees' q taken one block row
    too deep, p ~ 2e-5.)"""
    target, drafter = small
    forward = _forward(target)
    law = _pair_law(forward, PROMPT, SAMPLED)
    rng = np.random.default_rng(3)
    greedy_prompts = [rng.integers(0, V, n).astype(np.int32) for n in (5, 9, 3)]
    greedy_want = _greedy_alone(forward, greedy_prompts, 10)
    batch, calls = 48, 32
    engine = Engine(target, Speculation(k=3, adaptive=False, tree=3), dflash=drafter, sample_drafts=True,
                    max_batch=batch, max_len=32)
    counts = {"tree": np.zeros((V, V), np.int64), "chain": np.zeros((V, V), np.int64)}
    branched = {"tree": 0, "chain": 0}
    accepted = drafted = 0
    for call in range(calls):
        reqs = []
        for j in range(batch):
            seed = call * batch + j
            if j < len(greedy_prompts) and call < 2:  # greedy rows, with greedy block trees
                reqs.append(("greedy", j, engine.submit(greedy_prompts[j], max_new_tokens=10, seed=seed,
                                                        stop_ids=(), lookup=False)))
            else:
                kind = "chain" if j % 4 == 0 else "tree"
                reqs.append((kind, None, engine.submit(PROMPT, max_new_tokens=5, sampling=SAMPLED, seed=seed,
                                                       stop_ids=(), lookup=False, tree=0 if kind == "chain" else 3)))
        engine.run()
        for kind, j, r in reqs:
            assert {p for p, _ in r.stats.choices} <= {"dflash", None}
            if kind == "greedy":
                assert r.tokens == greedy_want[j]
                continue
            counts[kind][r.tokens[1], r.tokens[2]] += 1
            branched[kind] += r.stats.branched
            if kind == "tree":
                accepted, drafted = accepted + r.stats.accepted, drafted + r.stats.drafted
    assert branched["chain"] == 0 and branched["tree"] > 0
    assert 0 < accepted < drafted  # both the accept and the rejection paths ran
    for kind in ("tree", "chain"):  # the pair, and token 2 alone (where a second child acts, more power)
        assert_follows(counts[kind], law, kind)
        assert_follows(counts[kind].sum(axis=1), law.sum(axis=1), kind)
