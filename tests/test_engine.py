"""The batched engine: every row equals its request run alone, requests join and leave,
the pool is shared and returned, sampling settings are traced, the chooser adapts."""

import jax
import numpy as np
import pytest

import specjax
from specjax import Sampling, sampling as smp
from specjax.costs import prior_width_costs
from specjax.engine import Engine, Speculation
from specjax.rounds import new_state, rounds
from specjax.kv import KVCache
from specjax.results import GenerationError
from specjax.pages import PoolError
from conftest import assert_follows, hf_tiny, repeating_prompt

SETTINGS = [Sampling(), Sampling(0.8), Sampling(0.7, top_k=20), Sampling(1.0, top_p=0.9),
            Sampling(0.9, top_k=80), Sampling(1.2, top_k=30, top_p=0.8, min_p=0.05)]


def _prompts(rng, vocab):
    """Prompts of different lengths, some that repeat (lookup drafts get accepted), one longer
    than a prefill chunk."""
    return [repeating_prompt(rng, vocab, period=5), repeating_prompt(rng, vocab, period=9, repeats=4),
            rng.integers(0, vocab, 3), rng.integers(0, vocab, 150), repeating_prompt(rng, vocab, period=7),
            rng.integers(0, vocab, 20)]


def test_greedy_rows_equal_plain_generate_alone(cyclic_target, rng):
    """Against the single-sequence loop (itself checked against transformers): different
    prompt lengths, max_new_tokens and stop ids in one batch, rows finishing apart."""
    model = cyclic_target
    prompts = _prompts(rng, model.config.vocab_size)
    news = [40, 17, 33, 25, 64, 9]
    full = [specjax.generate(model, p, max_new_tokens=n, stop_ids=()).tokens for p, n in zip(prompts, news)]
    stops = [[], [full[1][6]], [], [full[3][2], full[3][20]], [], []]
    alone = [specjax.generate(model, p, max_new_tokens=n, stop_ids=s) for p, n, s in zip(prompts, news, stops)]
    for spec in (None, specjax.Adaptive(specjax.NgramProposer(k=7))):
        got = specjax.generate(model, prompts, max_new_tokens=news, stop_ids=stops, speculative=spec)
        assert [g.tokens for g in got] == [a.tokens for a in alone]
        assert [g.stopped for g in got] == [a.stopped for a in alone]
    assert max(g.stats.tokens_per_step for g in got) > 1.2  # lookup drafts were taken somewhere


def test_sampled_rows_equal_their_plain_run_alone(cyclic_target, rng):
    """Deterministic drafts and position-keyed randomness: with any settings in the batch,
    a row's sampled tokens are those of its request alone without speculation."""
    model = cyclic_target
    prompts = _prompts(rng, model.config.vocab_size)
    seeds = [int(s) for s in rng.integers(0, 2 ** 31, len(prompts))]
    solo = Engine(model, None, max_batch=1, max_len=256)
    alone = [solo.submit(p, max_new_tokens=30, sampling=s, seed=sd, stop_ids=()).result().tokens
             for p, s, sd in zip(prompts, SETTINGS, seeds)]
    got = specjax.generate(model, prompts, max_new_tokens=30, sampling=SETTINGS, seed=seeds, stop_ids=(),
                           speculative=specjax.Adaptive(specjax.NgramProposer(k=7)))
    assert [g.tokens for g in got] == alone
    # the same requests in another order (other neighbours, other rows, other pages; the same
    # compiled steps)
    order = rng.permutation(len(prompts))
    again = specjax.generate(model, [prompts[i] for i in order], max_new_tokens=30,
                             sampling=[SETTINGS[i] for i in order], seed=[seeds[i] for i in order], stop_ids=(),
                             speculative=specjax.Adaptive(specjax.NgramProposer(k=7)))
    assert [g.tokens for g in again] == [alone[i] for i in order]


def _enumerated(logits: np.ndarray, s: Sampling) -> np.ndarray:
    """transformers' sampling distribution re-derived in NumPy: temperature, top-k (ties at
    the k-th kept), top-p (ascending sort, drop cumulative <= 1 - p, keep the largest),
    min-p."""
    x = logits / s.temperature
    if s.top_k:
        x = np.where(x < np.sort(x)[::-1][s.top_k - 1], -np.inf, x)
    if s.top_p < 1:
        order = np.argsort(x, kind="stable")
        p = np.exp(x[order] - x.max())
        cum = np.cumsum(p / p.sum())
        drop = cum <= 1 - s.top_p
        drop[-1] = False
        x = x.copy()
        x[order[drop]] = -np.inf
    p = np.exp(x - x.max())
    p /= p.sum()
    if s.min_p:
        p = np.where(p < s.min_p * p.max(), 0.0, p)
        p /= p.sum()
    return p


@jax.jit
def _draw_rows(logits, positions, rs):
    """Every row's sampled token at its position, seed 0 (settings traced: one program for all)."""
    return smp.target_tokens_rows(logits, positions, np.zeros(logits.shape[0], np.uint32), rs, True)


@pytest.mark.parametrize("s", SETTINGS[1:], ids=str)
def test_row_sampling_follows_the_distribution(rng, s):
    """Chi-square of many draws (one key per position) against the enumerated distribution,
    over a vocabulary larger than the top-k fast path's candidates; other rows' settings in
    the same call do not change a row's tokens."""
    v = 150
    logits = rng.standard_normal(v).astype(np.float32) * 2
    logits[7] = logits[8] = logits.max() + 0.5  # a tie at the top
    n = 6000
    rows = smp.RowSampling.of([s] * n)
    tokens = np.asarray(_draw_rows(np.repeat(logits[None], n, 0), np.arange(n), rows))
    want = _enumerated(logits.astype(np.float64), s)
    assert_follows(np.bincount(tokens, minlength=v), want)
    mixed = smp.RowSampling.of([s if i % 2 else SETTINGS[(i // 2) % len(SETTINGS)] for i in range(n)])
    other = np.asarray(_draw_rows(np.repeat(logits[None], n, 0), np.arange(n), mixed))
    np.testing.assert_array_equal(other[1::2], tokens[1::2])


def test_a_requests_first_token_is_the_prefills_draw(tiny, rng):
    """The token after the prompt, against transformers' logits there: a greedy request's is
    their argmax, a sampled request's follows their transformed law (chi-square over seeds),
    for a prompt in one narrow chunk and one in a chunk of 64."""
    import torch

    ref, _, model = tiny
    engine = Engine(model, None, max_batch=8, max_len=128)
    s, draws = Sampling(0.8, top_k=30), 600
    for n in (5, 40):
        while True:  # a prompt whose argmax no rounding can move
            prompt = rng.integers(0, model.config.vocab_size, n)
            with torch.no_grad():
                logits = ref(torch.tensor(prompt[None])).logits[0, -1].double().numpy()
            top = np.sort(logits)[::-1]
            if top[0] - top[1] > 1e-3:
                break
        assert engine.submit(prompt, max_new_tokens=1, stop_ids=()).result().tokens == [int(np.argmax(logits))]
        first = int(rng.integers(1 << 30))
        reqs = [engine.submit(prompt, max_new_tokens=1, sampling=s, seed=first + i, stop_ids=()) for i in range(draws)]
        engine.run()
        counts = np.bincount([r.tokens[0] for r in reqs], minlength=model.config.vocab_size)
        assert_follows(counts, _enumerated(logits, s), f"prompt of {n}")


def test_requests_join_while_others_run_and_stream(cyclic_target, rng):
    model = cyclic_target
    prompts = _prompts(rng, model.config.vocab_size)[:4]
    alone = [specjax.generate(model, p, max_new_tokens=36, stop_ids=()).tokens for p in prompts]
    engine = Engine(model, 7, max_batch=4, max_len=256, rounds=2)
    first = [engine.submit(p, max_new_tokens=36, stop_ids=()) for p in prompts[:2]]
    engine.step()
    engine.step()
    assert all(0 < len(r.tokens) < 36 for r in first)
    late = [engine.submit(p, max_new_tokens=36, stop_ids=()) for p in prompts[2:]]
    streamed = list(late[1])  # drives the engine; every request advances
    assert streamed == alone[3]
    assert [r.result().tokens for r in first + late] == alone


def test_pool_exhaustion_queues_and_cancel_returns_pages(cyclic_target, rng):
    model = cyclic_target
    prompts = [rng.integers(0, model.config.vocab_size, n) for n in (30, 45, 12, 60, 25)]
    alone = [specjax.generate(model, p, max_new_tokens=40, stop_ids=()).tokens for p in prompts]
    # each request needs ceil((prompt + 40 + 16) / 16) = 6-8 pages; 17 usable pages hold two
    engine = Engine(model, 7, max_batch=4, max_len=128, num_pages=18)
    reqs = [engine.submit(p, max_new_tokens=40, stop_ids=()) for p in prompts]
    engine.step()
    assert len(engine.running) == 2 and len(engine.queue) == 3
    assert [r.result().tokens for r in reqs] == alone
    assert engine.pages.free_count == engine.pages.usable and engine.pages.reserved == 0
    with pytest.raises(PoolError, match=r"needs 19 pages of 16 slots; the pool has 17"):
        Engine(model, None, max_len=512, num_pages=18).submit(prompts[0], max_new_tokens=250)
    with pytest.raises(PoolError, match="max_len"):
        engine.submit(prompts[0], max_new_tokens=120)
    running = engine.submit(prompts[3], max_new_tokens=40, stop_ids=())
    queued = engine.submit(prompts[1], max_new_tokens=40, stop_ids=())
    engine.step()
    assert engine.pages.free_count < engine.pages.usable
    running.cancel()
    queued.cancel()
    assert running.done and queued.done and not engine.has_work()
    assert engine.pages.free_count == engine.pages.usable and engine.pages.reserved == 0
    with pytest.raises(GenerationError, match="cancelled"):
        running.result()


def test_new_sampling_values_compile_nothing(cyclic_target, rng):
    model = cyclic_target
    prompts = _prompts(rng, model.config.vocab_size)  # six rows, as the test above: its compiled call
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **kw: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)

    def run(settings):
        return specjax.generate(model, prompts, max_new_tokens=20, sampling=settings, seed=list(range(1, 7)),
                                stop_ids=(), speculative=specjax.Adaptive(specjax.NgramProposer(k=7)))

    run([Sampling(0.7, top_p=0.9), Sampling(1.0, top_k=10), Sampling()] * 2)
    before = len(compiles)
    # (each row keeps its mode: a prompt width's prefill compiles once for greedy, once for sampled)
    run([Sampling(0.3, top_k=40, min_p=0.1), Sampling(1.4, top_p=0.5), Sampling()] * 2)
    assert len(compiles) == before


def _chooser_call(model, history_rows, state_value, costs, row_k=7):
    """One round of the engine's device call over rows with the given acceptance counts;
    returns the drafts each row made."""
    rows = len(history_rows)
    cfg = model.config
    h = np.zeros((rows, 256), np.int32)
    size = np.zeros(rows, np.int32)
    for b, ids in enumerate(history_rows):
        h[b, :len(ids)] = ids
        size[b] = len(ids)
    pages = 256 // 16
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, rows * pages + 1, 16, cfg.head_dim)
    kv = KVCache(np.zeros(shape, np.float32), np.zeros(shape, np.float32),
                 1 + np.arange(rows * pages, dtype=np.int32).reshape(rows, pages), size - 1, page_size=16)
    accepted, judged = state_value
    fresh = new_state(rows, 3)
    state = {**fresh, "accepted": np.full_like(fresh["accepted"], accepted),
             "judged": np.full_like(fresh["judged"], judged)}
    log, _, _, _, _, _ = rounds(
        model.params, cfg, kv, h, size, np.full(rows, 16, np.int32), np.full((rows, 8), -1, np.int32),
        np.full(rows, row_k, np.int32), np.ones((rows, 3), bool), state, np.asarray(costs, np.float32)[None],
        np.arange(rows, dtype=np.uint32),
        smp.RowSampling.of([Sampling()] * rows), k=7, max_ngram=3, min_ngram=1, n_rounds=1, sampled=False)
    return np.asarray(log["drafts"])[0], np.asarray(log["counts"])[0]


def test_chooser_adapts_to_acceptance_and_cost(cyclic_target, rng):
    """Properties of the choice, at 4 rows whose histories all hold a 3-token match of 7+
    tokens: long rejection -> no drafts; full acceptance and cheap verify -> the widest
    step; the same acceptance with steeply rising step costs -> fewer drafts."""
    model = cyclic_target
    rows = [repeating_prompt(rng, model.config.vocab_size, period=9) for _ in range(4)]
    one_row, eight_rows = prior_width_costs(1)[:4], prior_width_costs(8)[:4]  # widths 1, 2, 4, 8
    assert np.all(eight_rows[1:] > one_row[1:])  # wider steps cost relatively more in a fuller batch
    rejected, _ = _chooser_call(model, rows, (0.0, 400.0), one_row)
    assert rejected.tolist() == [0, 0, 0, 0]
    trusted, counts = _chooser_call(model, rows, (400.0, 400.0), np.ones(4))
    assert trusted.tolist() == [7, 7, 7, 7] and counts.min() >= 1
    alone, _ = _chooser_call(model, rows, (360.0, 400.0), one_row)
    full, _ = _chooser_call(model, rows, (360.0, 400.0), eight_rows)
    assert 0 < full.max() < alone.max()


def test_choice_ignores_the_draft_values(cyclic_target, rng):
    """History only: two rows whose lookups find matches of the same length but different
    continuations (different draft values) get the same number of drafts."""
    model = cyclic_target
    v = model.config.vocab_size
    base = repeating_prompt(rng, v, period=9)
    other = base.copy()
    other[22:27] = (other[22:27] + 1 + rng.integers(0, v - 1, 5)) % v  # what the latest match continues with
    for value in ((0.0, 400.0), (400.0, 400.0), (300.0, 400.0)):
        a, _ = _chooser_call(model, [base, base], value, np.array([1.0, 1.3, 1.9, 3.0]))
        b, _ = _chooser_call(model, [base, other], value, np.array([1.0, 1.3, 1.9, 3.0]))
        assert a.tolist() == b.tolist()


def test_engines_share_a_cost_fit_only_where_their_steps_run_the_same_work(cyclic_target, rng):
    """Engines of one target keep fitted step costs across generations, but a chain
    engine's fit never takes a tree engine's timings (nor one tree budget's another's):
    their steps of a kind run different programs."""
    prompt = repeating_prompt(rng, cyclic_target.config.vocab_size)
    fits = {}
    for tree in (0, 15, 4, 0):
        engine = Engine(cyclic_target, Speculation(k=15, tree=tree), max_batch=1, max_len=256)
        before = {key: fit.timed.copy() for key, fit in engine.costs.items()}
        for _ in range(3):  # (the first call of a fit is not timed: it compiled)
            engine.submit(prompt, max_new_tokens=40, stop_ids=()).result()
        moved = {key for key, fit in engine.costs.items() if key not in before or
                 not np.array_equal(fit.timed, before[key])}
        assert len(moved) >= 1, tree
        fits.setdefault(tree, set()).update(moved)
    assert not fits[0] & fits[15] and not fits[0] & fits[4] and not fits[15] & fits[4]


def test_bad_requests_name_the_parameter(cyclic_target):
    model = cyclic_target
    engine = Engine(model, 4, max_batch=2, max_len=128)
    with pytest.raises(GenerationError, match=r"k must be an integer in \[0, 4\]"):
        engine.submit([1, 2, 3], max_new_tokens=5, k=5)
    with pytest.raises(GenerationError, match="sampling must be a specjax.Sampling"):
        engine.submit([1, 2, 3], max_new_tokens=5, sampling=0.7)
    with pytest.raises(GenerationError, match="max_new_tokens must be one value or a list with one per prompt"):
        specjax.generate(model, [[1, 2], [3]], max_new_tokens=[4])
    with pytest.raises(GenerationError, match="prompt token ids must be in"):
        specjax.generate(model, [[1, 2], [3, 1000]], max_new_tokens=4)
    with pytest.raises(GenerationError, match="or a HostDrafter"):
        specjax.generate(model, [[1, 2], [3]], max_new_tokens=4, speculative="ngram")
    with pytest.raises(GenerationError, match="max_len"):
        Engine(model, None, max_len=10 ** 6)
    with pytest.raises(specjax.proposers.ProposerError, match="k must be"):
        Speculation(k=16)


@pytest.fixture(scope="module")
def with_draft(cyclic_target, tmp_path_factory):
    """A target that falls into cycles (the one the lookup tests use, so its plain runs share
    their compiled steps) and a 1-layer draft model with its vocabulary."""
    from conftest import hf_tiny

    folder = tmp_path_factory.mktemp("engine-draft")
    hf_tiny(folder, seed=5, init=0.1, num_hidden_layers=1)
    return cyclic_target, specjax.load(folder)


def test_draft_model_rows_equal_alone(with_draft, rng):
    """Draft-model drafts, with and without lookup beside them: with the target itself as
    the draft (always right) drafting in full, greedy rows equal plain generation alone and
    sampled rows with the model's greedy drafts their plain sampled run alone; with a weak
    draft under the chooser, greedy rows again equal plain generation."""
    target, weak = with_draft
    prompts = _prompts(rng, target.config.vocab_size)[:4]
    news = [30, 12, 41, 25]
    greedy = [specjax.generate(target, p, max_new_tokens=n, stop_ids=()).tokens for p, n in zip(prompts, news)]
    solo = Engine(target, None, max_batch=1, max_len=256)
    sampled = [solo.submit(p, max_new_tokens=n, sampling=s, seed=7, stop_ids=()).result().tokens
               for p, n, s in zip(prompts, news, SETTINGS[1:])]
    engine = Engine(target, Speculation(k=7, adaptive=False), draft=target, max_batch=4, max_len=256)
    reqs = [engine.submit(p, max_new_tokens=n, stop_ids=(), lookup=i % 2 == 0) for i, (p, n) in enumerate(zip(prompts, news))]
    assert [r.result().tokens for r in reqs] == greedy
    assert min(r.stats.tokens_per_step for r in reqs) > 5  # the chain ran and was accepted
    reqs = [engine.submit(p, max_new_tokens=n, sampling=s, seed=7, stop_ids=())
            for p, n, s in zip(prompts, news, SETTINGS[1:])]
    assert [r.result().tokens for r in reqs] == sampled
    engine = Engine(target, 7, draft=weak, max_batch=4, max_len=256)
    reqs = [engine.submit(p, max_new_tokens=n, stop_ids=(), lookup=i % 2 == 1) for i, (p, n) in enumerate(zip(prompts, news))]
    assert [r.result().tokens for r in reqs] == greedy


def test_sampled_drafts_at_batch_follow_the_target_distribution(tmp_path_factory):
    """Chi-square of tokens 2-3 of one request (2 sampled drafts per step) against the
    exact target law, from rows of batches whose other rows (prompts, settings, proposers)
    change from call to call."""
    from test_speculative import sampled_draft_case

    target, draft, s, ids, exact = sampled_draft_case(tmp_path_factory)
    engine = Engine(target, Speculation(k=2, adaptive=False), draft=draft, sample_drafts=True, max_batch=16,
                    max_len=64)
    rng = np.random.default_rng(0)
    counts = np.zeros_like(exact)
    accepted = 0
    calls = 200
    for call in range(calls):
        ours = [engine.submit(ids, max_new_tokens=4, sampling=s, seed=call * 16 + j, stop_ids=(), lookup=False)
                for j in range(12)]
        for j in range(4):  # neighbours that differ every call
            engine.submit(rng.integers(0, 24, int(rng.integers(2, 9))), max_new_tokens=int(rng.integers(1, 7)),
                          sampling=SETTINGS[int(rng.integers(0, len(SETTINGS)))], seed=int(rng.integers(1 << 30)),
                          stop_ids=(), lookup=bool(j % 2))
        engine.run()
        for r in ours:
            counts[r.tokens[1], r.tokens[2]] += 1
            accepted += r.stats.accepted
    n = calls * 12
    assert 0 < accepted < 2 * n  # both the accept and the residual paths ran
    assert_follows(counts, exact)


class _Oracle:
    """A Python proposer that knows the plain continuation of one prompt (right every time)
    or, with `wrong`, shifts every token (wrong every time)."""

    def __init__(self, prompt, continuation, vocab, wrong=False):
        self.full = np.concatenate([prompt, continuation]).astype(np.int64)
        self.vocab, self.wrong = vocab, wrong

    def propose(self, history, limit):
        nxt = self.full[len(history):len(history) + limit]
        return (nxt + 1) % self.vocab if self.wrong else nxt


class _Constant:
    """A host drafter proposing the same value whatever the history."""

    def __init__(self, value):
        self.value = value

    def propose(self, history, limit):
        return self.value


def test_host_drafters_fill_the_drafts_array(cyclic_target, rng):
    """Rows whose drafts come from Python (an oracle, a proposer always wrong) next to rows
    with prompt lookup: every row equals its plain run alone; the oracle's drafts are taken."""
    model = cyclic_target
    v = model.config.vocab_size
    prompts = _prompts(rng, v)[:4]
    alone = [specjax.generate(model, p, max_new_tokens=30, stop_ids=()).tokens for p in prompts]
    engine = Engine(model, 7, max_batch=4, max_len=256)
    reqs = [engine.submit(prompts[0], max_new_tokens=30, stop_ids=(), drafter=_Oracle(prompts[0], alone[0], v)),
            engine.submit(prompts[1], max_new_tokens=30, stop_ids=(), drafter=_Oracle(prompts[1], alone[1], v, True)),
            engine.submit(prompts[2], max_new_tokens=30, stop_ids=()),
            engine.submit(prompts[3], max_new_tokens=30, stop_ids=(), k=0)]
    assert [r.result().tokens for r in reqs] == alone
    oracle, wrong = reqs[0].stats, reqs[1].stats
    assert oracle.tokens_per_step > 1.5 and oracle.accepted == oracle.drafted and wrong.accepted == 0
    bad = engine.submit(prompts[0], max_new_tokens=5, stop_ids=(), drafter=_Oracle(prompts[0], [v + 3] * 40, v + 10))
    with pytest.raises(GenerationError, match=r"drafter must return token ids in \[0, 101\)"):
        bad.result()
    for junk in ([1.5, 2.7], None, "ab", [[1, 2]], [1, [2]], [True]):  # refused by name, never cast
        bad = engine.submit(prompts[0], max_new_tokens=5, stop_ids=(), drafter=_Constant(junk))
        with pytest.raises(GenerationError, match=r"drafter must return token ids in \[0, 101\)"):
            bad.result()
    with pytest.raises(GenerationError, match="drafter must have a propose"):
        engine.submit(prompts[0], max_new_tokens=5, drafter=object())


def test_a_drafter_that_fails_ends_its_request_alone(cyclic_target, rng):
    """A host drafter that raises, or returns something other than token ids, fails its
    own request (result() raises, naming it); the request beside it goes on and equals its
    run alone."""
    model = cyclic_target
    prompts = _prompts(rng, model.config.vocab_size)[:2]
    alone = specjax.generate(model, prompts[0], max_new_tokens=20, stop_ids=()).tokens

    class Raising:
        def propose(self, history, limit):
            raise RuntimeError("drafter bug")

    for drafter, message in ((Raising(), "propose raised RuntimeError: drafter bug"),
                             (_Constant([1.5]), "must return token ids")):
        engine = Engine(model, 7, max_batch=2, rounds=4)
        good = engine.submit(prompts[0], max_new_tokens=20, stop_ids=())
        bad = engine.submit(prompts[1], max_new_tokens=20, stop_ids=(), drafter=drafter)
        assert good.result().tokens == alone
        assert bad.done and bad.error is not None
        with pytest.raises(GenerationError, match=f"request {bad.id}: .*{message}"):
            bad.result()
        with pytest.raises(GenerationError, match=message):
            list(bad)


def test_a_drafter_without_drafts_to_fill_and_a_fractional_pool_are_refused(cyclic_target):
    with pytest.raises(GenerationError, match="a drafter needs drafts to fill"):  # it would never be asked
        Engine(cyclic_target).submit([1, 2, 3], max_new_tokens=5, drafter=_Constant([1]))
    with pytest.raises(GenerationError, match="num_pages must be an integer >= 2"):
        Engine(cyclic_target, 3, num_pages=64.0)


def test_a_request_that_meets_nan_logits_fails_alone(tmp_path):
    """NaN logits (a NaN embedding row fed to the target) fail the request whose step met
    them: in its prefill, or in a decode step where its drafter proposed that token; its
    result() raises FloatingPointError, and the request beside it is the same as alone."""
    from safetensors.numpy import load_file, save_file

    hf_tiny(tmp_path, seed=5, tie_word_embeddings=False)
    weights = load_file(tmp_path / "model.safetensors")
    poison = 7
    weights["model.embed_tokens.weight"][poison] = np.nan
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = specjax.load(tmp_path)
    healthy = [3, 14, 15, 92, 65, 35, 89, 79]
    alone = specjax.generate(model, healthy, max_new_tokens=16, stop_ids=()).tokens  # never feeds the poison
    assert poison not in alone
    for bad_prompt, drafter, where in (([5, poison, 9], None, "prefill"), ([5, 6, 9], _Constant([poison]), "decode")):
        engine = Engine(model, Speculation(k=3, adaptive=False), max_batch=2, rounds=4)  # drafts always verified
        good = engine.submit(healthy, max_new_tokens=16, stop_ids=(), k=0)
        bad = engine.submit(bad_prompt, max_new_tokens=16, stop_ids=(), drafter=drafter)
        assert good.result().tokens == alone
        with pytest.raises(FloatingPointError, match=f"{where}.* request {bad.id}|{where} of request {bad.id}"):
            bad.result()


def test_stop_ids_past_those_the_device_holds_end_output_and_stats_alike(cyclic_target, rng):
    """The device holds a row's 8 smallest stop ids; one past them stops the request on
    the host, and neither its tokens nor its stats (steps, drafts, accepted) count the
    rounds the device ran after it: the same as with that stop id alone."""
    model = cyclic_target
    v = model.config.vocab_size
    prompt = _prompts(rng, v)[0]
    plain = specjax.generate(model, prompt, max_new_tokens=60, stop_ids=()).tokens
    absent = [t for t in range(v) if t not in plain]
    hit = next(t for t in plain[8:] if sum(a < t for a in absent) >= 8)  # 8 smaller stop ids never met
    stops = [a for a in absent if a < hit][:12] + [hit]
    runs = {}
    for ids in ([hit], stops):
        engine = Engine(model, Speculation(k=7, adaptive=False), max_batch=1, rounds=16)
        runs[len(ids)] = engine.submit(prompt, max_new_tokens=60, stop_ids=ids).result()
    one, many = runs[1], runs[len(stops)]
    assert many.tokens == one.tokens == plain[:plain.index(hit) + 1] and many.stopped
    assert (many.stats.steps, many.stats.drafted, many.stats.accepted) == (
        one.stats.steps, one.stats.drafted, one.stats.accepted)


def test_compile_leaves_nothing_to_compile(cyclic_target, rng):
    """After Engine.compile, requests finishing at different times (every row count) and the
    prefill of new ones, in chunks of every width, compile nothing."""
    model = cyclic_target
    engine = Engine(model, 3, max_batch=2, max_len=256)
    engine.compile((False,))
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **kw: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)
    prompts = _prompts(rng, model.config.vocab_size)[:2] + [rng.integers(0, model.config.vocab_size, n)
                                                             for n in (3, 30, 60, 150)]
    news = (40, 5, 7, 3, 9, 2)
    reqs = [engine.submit(p, max_new_tokens=n, stop_ids=()) for p, n in zip(prompts, news)]
    assert [len(r.result().tokens) for r in reqs] == list(news)
    assert compiles == []
