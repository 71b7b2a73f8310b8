"""DFlash in the engine's device round: its paged context and block pass against the
single-sequence drafter, rows against their plain runs alone, sampled drafts against the
exact target law."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import Sampling, dflash, drafters, sampling as smp
from specjax.dflash import MARKOV, DFlashError, load_dflash, save_dflash
from specjax.drafters import DFlashCache, draft_head
from specjax.engine import Engine, Speculation
from specjax.kv import KVCache
from specjax.proposers import DFlashProposer, ProposerError
from specjax.results import GenerationError
from conftest import hf_tiny, hidden_states, repeating_prompt

SETTINGS = [Sampling(), Sampling(0.8, top_k=40, top_p=0.9), Sampling(), Sampling(1.1, min_p=0.05)]

# the round's pieces compiled, as the engine runs them (as `conftest.hidden_states`)
stash = jax.jit(drafters.stash)
catch_up = jax.jit(drafters.catch_up, static_argnames=("fcfg",))
write_context = jax.jit(drafters.write_context, static_argnames=("fcfg",))
block_logits = jax.jit(drafters.block_logits, static_argnames=("fcfg", "cfg", "k"))
block_drafts = jax.jit(drafters.block_drafts, static_argnames=("fcfg", "cfg", "k", "sample_drafts", "tree_nodes"))


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """(target, drafter): an 8-layer target and a 1-layer drafter, so that by the cost
    model's prior a block pass is cheap next to a verify step and the chooser takes it."""
    folder = tmp_path_factory.mktemp("deep")
    hf_tiny(folder, seed=5, num_hidden_layers=8, init=0.1)
    target = specjax.load(folder)
    drafter = dflash.init(target.config, jax.random.key(1), num_layers=1, block_size=8, target_layer_ids=(3,),
                          std=0.2)
    return target, drafter


@pytest.fixture(scope="module")
def shallow(tmp_path_factory):
    """(target, drafter) as `deep` with a 3-layer target, for engines whose k is fixed (no
    cost model to satisfy): each compiled round holds 3 layer copies per verify width, not 8."""
    folder = tmp_path_factory.mktemp("shallow")
    hf_tiny(folder, seed=5, init=0.1)
    target = specjax.load(folder)
    drafter = dflash.init(target.config, jax.random.key(1), num_layers=1, block_size=8, target_layer_ids=(1,),
                          std=0.2)
    return target, drafter


def test_paged_context_and_block_equal_the_single_sequence_drafter(tiny, rng):
    """Two rows of different lengths whose pages lie shuffled in one pool: the target's
    taps stashed a chunk at a time (as prefill and verify steps do), the context caught up
    (90 rows: two catch-up steps) and one block pass give the logits of `draft_block` over a
    contiguous context cache built by `append_context` (tested against NumPy in
    test_dflash)."""
    model = tiny[2]
    cfg = model.config
    drafter = dflash.init(cfg, jax.random.key(0), num_layers=2, block_size=16, target_layer_ids=(0, 2), std=0.2)
    d = drafter.config
    lengths = [37, 90]
    page, per_row = 16, 8
    order = rng.permutation(np.arange(1, 2 * per_row + 1))
    table = order.reshape(2, per_row).astype(np.int32)
    shape = (d.num_hidden_layers, d.num_key_value_heads, 2 * per_row + 1, page, d.head_dim)
    kv = KVCache(jnp.zeros(shape), jnp.zeros(shape), jnp.asarray(table), jnp.zeros(2, jnp.int32), page_size=page)
    fc = DFlashCache(kv, jnp.zeros((1, 2, 2 * per_row + 1, page, cfg.hidden_size)), jnp.zeros(2, jnp.int32))
    rows = [rng.integers(0, cfg.vocab_size, n + 1).astype(np.int32) for n in lengths]
    for b, ids in enumerate(rows):  # each row's committed tokens, stashed in chunks of 16
        _, _, taps = hidden_states(model.params, cfg, ids[None, :-1], np.arange(len(ids) - 1)[None],
                                   taps=d.target_layer_ids)
        one = fc.replace(kv=fc.kv.replace(page_table=fc.kv.page_table[b:b + 1]))
        for at in range(0, lengths[b], 16):
            one = stash(one, taps[:, :, at:at + 16], jnp.array([at]))
        fc = fc.replace(taps=one.taps)
    fc = catch_up(drafter.params, d, fc, jnp.array(lengths))
    assert fc.written.tolist() == lengths
    last = jnp.array([ids[-1] for ids in rows])
    got, _ = block_logits(drafter.params, d, fc.kv, model.params, cfg, last, jnp.array(lengths), k=15)
    for b, ids in enumerate(rows):
        n = lengths[b]
        _, _, taps = hidden_states(model.params, cfg, ids[None, :-1], np.arange(n)[None], taps=d.target_layer_ids)
        cache = dflash.append_context(drafter.params, d, dflash.init_cache(d, 256), taps[:, 0], n, np.arange(n))
        want = dflash.draft_block(drafter.params, d, cache, model.params, cfg, ids[-1], n, k=15)
        np.testing.assert_allclose(np.asarray(got[b]), np.asarray(want), atol=1e-4, rtol=1e-4)


def _prompts(rng, vocab):
    return [repeating_prompt(rng, vocab, period=6), rng.integers(0, vocab, 11), rng.integers(0, vocab, 140),
            repeating_prompt(rng, vocab, period=9)]


def test_context_rows_after_rejected_drafts_are_those_of_the_committed_tokens(shallow, rng):
    """Mid-generation, after rounds whose drafts were partly rejected: the context rows the
    engine has written for a row (positions below its count) equal `append_context` over
    a fresh forward of its committed tokens."""
    target, drafter = shallow
    d = drafter.config
    engine = Engine(target, Speculation(k=7, adaptive=False), dflash=drafter, max_batch=2, max_len=256, rounds=4)
    reqs = [engine.submit(p, max_new_tokens=120, stop_ids=(), lookup=False)
            for p in (rng.integers(0, 101, 70), rng.integers(0, 101, 9))]
    for _ in range(3):
        engine.step()
    assert any(r.stats.accepted < r.stats.drafted for r in reqs)  # drafts were rejected
    for r in reqs:
        assert not r.done and r.clen > len(r.prompt)
        ids = np.concatenate([r.prompt, r.tokens]).astype(np.int32)[:r.clen]
        _, _, taps = hidden_states(target.params, target.config, ids[None], np.arange(r.clen)[None],
                                   taps=d.target_layer_ids)
        want = dflash.append_context(drafter.params, d, dflash.init_cache(d, 256), taps[:, 0], r.clen,
                                     np.arange(r.clen))
        slots = np.asarray(engine.table[r.slot])[:, None] * engine.page_size + np.arange(engine.page_size)
        slots = slots.reshape(-1)[:r.clen]
        for pool, ref in ((engine.fk_pool, want.k), (engine.fv_pool, want.v)):
            got = np.asarray(pool).reshape(d.num_hidden_layers, d.num_key_value_heads, -1, d.head_dim)[:, :, slots]
            np.testing.assert_allclose(got, np.asarray(ref)[:, :, :r.clen], atol=1e-5, rtol=1e-5)


def _some_vocab(rng, vocab_size: int, size: int) -> np.ndarray:
    return np.sort(rng.choice(vocab_size, size, replace=False)).astype(np.int32)


def block_case(model, drafter, rng) -> tuple[DFlashCache, jax.Array, jax.Array]:
    """(the drafter's state with 20 and 13 random context rows written for two rows, last
    tokens [2], block starts [2]): a block pass to draft from."""
    d, cfg = drafter.config, model.config
    page = 16
    shape = (d.num_hidden_layers, d.num_key_value_heads, 9, page, d.head_dim)
    table = jnp.arange(1, 9, dtype=jnp.int32).reshape(2, 4)
    fkv = KVCache(jnp.zeros(shape), jnp.zeros(shape), table, jnp.zeros(2, jnp.int32), page_size=page)
    taps = jnp.asarray(rng.normal(size=(len(d.target_layer_ids), 2, 20, cfg.hidden_size)), jnp.float32)
    fkv = write_context(drafter.params, d, fkv, taps, jnp.zeros(2, jnp.int32))
    start = jnp.array([20, 13])
    fc = DFlashCache(fkv, jnp.zeros((1, 1, 9, page, cfg.hidden_size)), start)  # context written up to start
    return fc, jnp.array([4, 9]), start


def test_draft_vocabulary_drafts_are_the_full_heads_argmax_within_it(tiny, rng):
    """Block drafts scored on a draft vocabulary's head rows: only its tokens, each the
    argmax of the full head's logits restricted to it (NumPy), greedy and sampled."""
    model = tiny[2]
    cfg = model.config
    drafter = dflash.init(cfg, jax.random.key(3), num_layers=1, block_size=8, target_layer_ids=(1,), std=0.3)
    d = drafter.config
    vocab = _some_vocab(rng, cfg.vocab_size, 30)
    fc, last, start = block_case(model, drafter, rng)
    full, _ = block_logits(drafter.params, d, fc.kv, model.params, cfg, last, start, k=7)
    head = draft_head(model.params, cfg, vocab, drafter.params.get(MARKOV))
    rs = smp.RowSampling.of([Sampling(), Sampling(0.9, top_k=10)])
    for sample in (False, True):
        drafts, logq, _, _ = block_drafts(drafter.params, d, fc, model.params, cfg, last, start, 7,
                                       jnp.array([1, 2], jnp.uint32), rs, jnp.array([False, sample]), sample, head)
        drafts = np.asarray(drafts)
        assert np.isin(drafts, vocab).all()
        want = vocab[np.argmax(np.asarray(full)[..., vocab], axis=-1)]
        np.testing.assert_array_equal(drafts[0], want[0])
        if sample:  # q lives on the vocabulary only
            q = np.exp(np.asarray(logq))
            outside = np.setdiff1d(np.arange(cfg.vocab_size), vocab)
            assert q[..., outside].max() == 0 and np.allclose(q.sum(-1), 1, atol=1e-5)
        else:
            np.testing.assert_array_equal(drafts[1], want[1])


def test_draft_vocabulary_saves_loads_and_is_checked(tiny, tmp_path, rng):
    model = tiny[2]
    drafter = dflash.init(model.config, jax.random.key(4), num_layers=1, block_size=4, std=0.2)
    vocab = _some_vocab(rng, model.config.vocab_size, 40)
    save_dflash(dataclasses.replace(drafter, vocab=vocab), tmp_path / "d", dtype="float32")
    np.testing.assert_array_equal(load_dflash(tmp_path / "d", model).vocab, vocab)
    save_dflash(drafter, tmp_path / "d", dtype="float32")  # without one: the file goes too
    assert load_dflash(tmp_path / "d", model).vocab is None
    for bad, why in (([3, 3, 5], "sorted and distinct"), ([1, 500], r"lie in \[0, 101\)"), ([], "non-empty"),
                     ([[1, 2]], "flat list")):
        (tmp_path / "d" / dflash.VOCAB_FILE).write_text(json.dumps({"token_ids": bad}))
        with pytest.raises(DFlashError, match=f"draft_vocab.json: token_ids must .*{why}"):
            load_dflash(tmp_path / "d", model)
        with pytest.raises(DFlashError, match=f"draft vocabulary .*: token_ids must .*{why}"):  # built in memory
            specjax.DFlashProposer(dataclasses.replace(drafter, vocab=bad), k=3)


@pytest.mark.parametrize("kind", ["dflash", "adaptive", "draft vocabulary", "tree"])
def test_rows_with_dflash_drafts_equal_their_plain_run_alone(deep, shallow, rng, kind):
    """Greedy and sampled rows in one batch with DFlash alone (fixed k, with the whole
    vocabulary or a draft vocabulary), or DFlash chosen per round against prompt lookup
    (half the requests may not use lookup; one row, where by the CPU cost prior a block
    pays: at 4 rows a width-8 step costs 3.4 one-token steps and plain decoding wins):
    each row's tokens are its plain run's alone. The fixed-k kinds run on `shallow`."""
    target, drafter = deep if kind == "adaptive" else shallow
    if kind == "draft vocabulary":
        drafter = dataclasses.replace(drafter, vocab=_some_vocab(rng, target.config.vocab_size, 50))
    prompts = _prompts(rng, target.config.vocab_size)
    seeds = [int(s) for s in rng.integers(0, 1 << 30, len(prompts))]
    news = [40, 25, 33, 48]
    solo = Engine(target, None, max_batch=1, max_len=256)  # (one pool for every prompt: one set of programs)
    alone = [solo.submit(p, max_new_tokens=n, sampling=s, seed=sd, stop_ids=()).result().tokens
             for p, n, s, sd in zip(prompts, news, SETTINGS, seeds)]
    if kind == "adaptive":
        # (a max_len of its own: step costs measured by other tests' engines do not apply)
        engine = Engine(target, Speculation(k=7), dflash=drafter, max_batch=1, max_len=320)
        got = [engine.submit(p, max_new_tokens=n, sampling=s, seed=sd, stop_ids=(), lookup=i % 2 == 1)
               for i, (p, n, s, sd) in enumerate(zip(prompts, news, SETTINGS, seeds))]
        engine.run()
    else:  # "tree": the block's best 6-node tree in place of its chain (DDTree)
        proposer = DFlashProposer(drafter, k=7, tree=6 if kind == "tree" else 0)
        got = specjax.generate(target, prompts, max_new_tokens=news, sampling=SETTINGS, seed=seeds, stop_ids=(),
                               speculative=proposer)
    assert [g.tokens for g in got] == alone
    sources = {p for g in got for p, _ in g.stats.choices}
    assert "dflash" in sources
    if kind == "adaptive":
        assert "lookup" in sources
    else:  # one prompt alone on the engine, too
        one = specjax.generate(target, prompts[1], max_new_tokens=news[1], sampling=SETTINGS[1], seed=seeds[1],
                               stop_ids=(), speculative=proposer)
        assert one.tokens == alone[1]


def test_rows_that_may_not_take_dflash_drafts_never_get_them(shallow, rng):
    target, drafter = shallow
    prompts = _prompts(rng, target.config.vocab_size)
    engine = Engine(target, Speculation(k=7, adaptive=False), dflash=drafter, max_batch=4, max_len=256)
    reqs = [engine.submit(p, max_new_tokens=20, stop_ids=(), dflash=i % 2 == 0) for i, p in enumerate(prompts)]
    engine.run()
    for i, r in enumerate(reqs):
        sources = {p for p, _ in r.stats.choices} - {None}
        assert sources <= ({"dflash"} if i % 2 == 0 else {"lookup"})
        assert r.tokens == specjax.generate(target, prompts[i], max_new_tokens=20, stop_ids=()).tokens


@pytest.mark.parametrize("vocab", [None, np.arange(0, 24, 2)])
def test_sampled_dflash_drafts_follow_the_target_distribution(tmp_path_factory, vocab):
    """Chi-square of tokens 2-3 (2 sampled DFlash drafts per step, batches of 12 rows, the
    whole vocabulary or half of it as draft vocabulary) against the exact target law."""
    from test_speculative import engine_follows, sampled_draft_case

    target, _, s, ids, exact = sampled_draft_case(tmp_path_factory)
    drafter = dflash.init(target.config, jax.random.key(2), num_layers=1, block_size=4, std=0.3)
    drafter = dataclasses.replace(drafter, vocab=vocab)
    engine = Engine(target, Speculation(k=2, adaptive=False), dflash=drafter, sample_drafts=True, max_batch=12,
                    max_len=64)
    engine_follows(engine, ids, s, exact)


def test_bad_drafters_are_refused(tiny, deep):
    target, drafter = deep
    with pytest.raises(ProposerError, match="does not fit the target"):
        Engine(tiny[2], 7, dflash=drafter)
    with pytest.raises(ProposerError, match="is bfloat16, the target float32"):
        Engine(target, 7, dflash=dataclasses.replace(drafter, dtype=jnp.bfloat16))
    with pytest.raises(GenerationError, match="needs speculative=k"):
        Engine(target, None, dflash=drafter)
