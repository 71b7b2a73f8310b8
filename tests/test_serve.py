"""`specjax serve`: a real server on 127.0.0.1 driven by the official openai client. Every
completion is checked against the same prompt generated alone by `specjax.generate` with
the same settings, never against the server itself."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

import specjax
from specjax import Sampling
from specjax.cli import main
from specjax.engine import Engine, engine_options
from specjax.metrics import ServerMetrics
from specjax.protocol import RequestError, Served, chat_plan, completion_plan
from specjax.server import bind, create_app
from specjax.textstream import TextStream
from conftest import running

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "checkpoints" / "tiny-code"
NAME = "tiny-code-chat"
MAX_LEN = 256  # prompt + max_tokens <= 112 in every test: `generate` then sizes its engine alike
LOOKUP = specjax.Adaptive(specjax.NgramProposer(k=1))  # the served speculation, and the references'
# a template of the tests' own, rendered again by hand below (the shipped model has none)
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}{% if m['name'] is defined %} {{ m['name'] }}{% endif %}|>"
            "\n{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PROMPTS = ["def fibonacci(n):", "class Stack:\n", "import os\n\ndef walk(path):", "def add(a, b):\n    return",
           "for i in range(10):\n", "class Queue:\n    def __init__(self):\n", "def parse(text):\n    \"\"\"",
           "try:\n    import json\nexcept ImportError:"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The shipped tiny-code with a chat template added to its tokenizer."""
    root = tmp_path_factory.mktemp("served") / NAME
    shutil.copytree(SHIPPED, root)
    config = json.loads((root / "tokenizer_config.json").read_text())
    (root / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return root


@pytest.fixture(scope="module")
def model(folder):
    return specjax.load(folder)


@pytest.fixture(scope="module")
def tokenizer(folder):
    """The tests' own tokenizer (the server's is the model's)."""
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def url(model):
    # prompt lookup (k chosen per round) built as `serve` builds it, at the fewest compiles:
    # k = 1, two rows (each row count and each of greedy / sampled is one compile of ~4-9 s),
    # and a pool the size of the references' one-row engine, so they share its compiled steps
    options, per_request = engine_options(LOOKUP)
    pages = Engine(model, max_batch=1, max_len=MAX_LEN, **options).pages.n_pages
    engine = Engine(model, max_batch=2, max_len=MAX_LEN, num_pages=pages, **options)
    with running(create_app(engine, NAME, per_request)) as base:
        yield base


@pytest.fixture(scope="module")
def served(model):
    """What the server checks requests against, for tests of the checks alone."""
    return Served(NAME, model.tokenizer, model.config.vocab_size, tuple(model.eos_ids), MAX_LEN)


@pytest.fixture(scope="module")
def client(url):
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def alone(model, tokenizer, ids, max_tokens, *, temperature=0.0, top_k=0, top_p=1.0, seed=0, stop_ids=None):
    """(text, token count, finish reason) of the prompt generated alone."""
    res = specjax.generate(model, ids, max_new_tokens=max_tokens, sampling=Sampling(temperature, top_k, top_p),
                           seed=seed, stop_ids=stop_ids, speculative=LOOKUP)
    tokens = res.tokens[:-1] if res.stopped else res.tokens
    return tokenizer.decode(tokens, skip_special_tokens=True), len(res.tokens), "stop" if res.stopped else "length"


def ids_of(tokenizer, text):
    return tokenizer(text)["input_ids"]


def metrics(url) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, labels without model_name): value}."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def test_greedy_completion_and_stream_equal_generate(client, url, model, tokenizer):
    ids = ids_of(tokenizer, PROMPTS[0])
    text, count, finish = alone(model, tokenizer, ids, 48)
    before = metrics(url)
    got = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=48, temperature=0)
    assert got.choices[0].text == text and got.choices[0].finish_reason == finish
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), count)
    assert got.usage.total_tokens == len(ids) + count
    after = metrics(url)
    generated = ("specjax:generation_tokens_total", ())
    assert after[generated] - before[generated] == count
    # the prompt as token ids
    assert client.completions.create(model=NAME, prompt=ids, max_tokens=48, temperature=0).choices[0].text == text
    # streamed: the chunks add up to the same text, the last one says why it ended, then usage
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=48, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert len(chunks) > 2 and not chunks[-1].choices and chunks[-1].usage.completion_tokens == count
    assert all(c.usage is None for c in chunks[:-1])
    # vLLM's continuous_usage_stats: every chunk says the usage so far, counting up to the total
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=48, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    so_far = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage.prompt_tokens == len(ids) for c in chunks) and so_far == sorted(so_far)
    assert so_far[-1] == count and so_far[-2] == count and 0 < so_far[0] < count
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]
    assert httpx.get(f"{url}/health").status_code == 200


def test_chat_applies_the_template(client, model, tokenizer):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    rendered = "<|system|>\nYou write Python.\n<|user|>\ndef add(a, b):\n<|assistant|>\n"
    text, count, finish = alone(model, tokenizer, ids_of(tokenizer, rendered), 32)
    got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=32, temperature=0)
    assert got.choices[0].message.content == text and got.choices[0].message.role == "assistant"
    assert got.choices[0].finish_reason == finish and got.usage.completion_tokens == count
    assert got.usage.prompt_tokens == len(ids_of(tokenizer, rendered))
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=32,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == finish


def test_seed_reproduces_sampling_and_n_gives_seed_after_seed(client, model, tokenizer):
    ids = ids_of(tokenizer, PROMPTS[1])
    kw = dict(model=NAME, prompt=PROMPTS[1], max_tokens=24, temperature=0.9, top_p=0.95, extra_body={"top_k": 40})
    want = [alone(model, tokenizer, ids, 24, temperature=0.9, top_k=40, top_p=0.95, seed=s)[0] for s in (5, 6)]
    assert want[0] != want[1]
    first = client.completions.create(seed=5, **kw).choices[0].text
    assert first == want[0] and client.completions.create(seed=5, **kw).choices[0].text == want[0]
    assert client.completions.create(seed=6, **kw).choices[0].text == want[1]
    both = client.completions.create(seed=5, n=2, **kw)
    assert [c.index for c in both.choices] == [0, 1] and [c.text for c in both.choices] == want
    streamed = ["", ""]
    for chunk in client.completions.create(seed=5, n=2, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == want


def test_seeds_take_any_64_bit_integer_modulo_2_32(client, model, tokenizer):
    """vLLM's seed range; the engine's 32-bit seed is the request's modulo 2**32."""
    ids = ids_of(tokenizer, PROMPTS[1])
    kw = dict(model=NAME, prompt=PROMPTS[1], max_tokens=24, temperature=0.9, top_p=0.95, extra_body={"top_k": 40})
    for seed in (-5, 2 ** 40 + 5, 2 ** 63 - 1, -2 ** 63):
        want = alone(model, tokenizer, ids, 24, temperature=0.9, top_k=40, top_p=0.95, seed=seed % 2 ** 32)[0]
        assert client.completions.create(seed=seed, **kw).choices[0].text == want, seed


def test_completions_default_to_16_tokens_and_chat_to_the_rest_of_the_context(client, model, tokenizer, served):
    """OpenAI's and vLLM's max_tokens defaults: 16 for completions (fewer where the context
    has less room), the rest of the context for chat."""
    ids = ids_of(tokenizer, PROMPTS[6])
    text = alone(model, tokenizer, ids, 16, stop_ids=())[0]
    got = client.completions.create(model=NAME, prompt=PROMPTS[6], temperature=0, extra_body={"ignore_eos": True})
    assert (got.choices[0].text, got.usage.completion_tokens, got.choices[0].finish_reason) == (text, 16, "length")

    def budgets(plan):
        return [s.max_new_tokens for s in plan.submissions]

    assert budgets(completion_plan({"prompt": list(range(MAX_LEN - 6))}, served)) == [6]
    # sent as null, a completion's max_tokens is the rest of the context, as vLLM's
    assert budgets(completion_plan({"prompt": list(range(40)), "max_tokens": None}, served)) == [MAX_LEN - 40]
    rendered = "<|user|>\ndef add(a, b):\n<|assistant|>\n"
    chat = {"messages": [{"role": "user", "content": "def add(a, b):"}]}
    assert budgets(chat_plan(chat, served)) == [MAX_LEN - len(ids_of(tokenizer, rendered))]
    # max_completion_tokens wins over max_tokens (both checked), as in vLLM
    assert budgets(chat_plan(chat | {"max_tokens": 9, "max_completion_tokens": 5}, served)) == [5]
    assert budgets(chat_plan(chat | {"max_tokens": 9, "max_completion_tokens": None}, served)) == [9]
    for bad in ({"max_tokens": "x", "max_completion_tokens": 5}, {"max_tokens": 9, "max_completion_tokens": 0}):
        with pytest.raises(RequestError) as e:
            chat_plan(chat | bad, served)
        assert e.value.param == next(k for k, v in bad.items() if v in ("x", 0)), bad


def test_request_defaults_fill_only_the_fields_a_request_leaves_out(served, tokenizer):
    """The folder's defaults (`Served.defaults`) stand in for the sampling fields a request
    leaves out and for chat's max_tokens (capped by the context's room); each field given,
    top_k -1 (vLLM's "off") included, overrides its default; a completion's max_tokens
    stays OpenAI's 16."""
    kept = dataclasses.replace(served, defaults={"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 40})
    chat = {"messages": [{"role": "user", "content": "x"}]}

    def settings(plan):
        return [(s.sampling, s.max_new_tokens) for s in plan.submissions]

    assert settings(chat_plan(chat, kept)) == [(Sampling(0.6, 20, 0.95), 40)]
    assert settings(chat_plan(chat | {"temperature": 0, "top_k": -1, "max_tokens": 7}, kept)) == \
        [(Sampling(0.0, 0, 0.95), 7)]
    assert settings(chat_plan(chat | {"min_p": 0.1, "top_p": None}, kept)) == [(Sampling(0.6, 20, 0.95, 0.1), 40)]
    assert settings(completion_plan({"prompt": "x"}, kept)) == [(Sampling(0.6, 20, 0.95), 16)]
    long = [{"role": "user", "content": " ".join(["x"] * 230)}]
    room = MAX_LEN - len(ids_of(tokenizer, "<|user|>\n" + long[0]["content"] + "\n<|assistant|>\n"))
    assert 0 < room < 40 and settings(chat_plan({"messages": long}, kept))[0][1] == room
    assert settings(chat_plan(chat, served)) == [(Sampling(1.0), MAX_LEN - len(ids_of(tokenizer, "<|user|>\nx\n<|assistant|>\n")))]


def test_the_folders_generation_config_sets_what_requests_leave_out(model, tokenizer, folder, tmp_path):
    """As vLLM's server (--generation-config auto, its default): the sampling fields a
    request leaves out take the model folder's generation_config.json values, and chat's
    max_tokens its max_new_tokens; each checked against the prompt generated alone with
    those settings. With generation_config="vllm", vLLM's own defaults (temperature 1)."""
    sampled = tmp_path / NAME
    shutil.copytree(folder, sampled)
    gen = json.loads((sampled / "generation_config.json").read_text())
    (sampled / "generation_config.json").write_text(json.dumps(
        {**gen, "do_sample": True, "temperature": 0.9, "top_k": 40, "top_p": 0.95, "max_new_tokens": 20}))
    options, per_request = engine_options(LOOKUP)
    pages = Engine(model, max_batch=1, max_len=MAX_LEN, **options).pages.n_pages
    engine = Engine(dataclasses.replace(model, path=sampled), max_batch=2, max_len=MAX_LEN, num_pages=pages,
                    **options)
    ids = ids_of(tokenizer, PROMPTS[1])
    rendered = ids_of(tokenizer, "<|user|>\n" + PROMPTS[0] + "\n<|assistant|>\n")
    chat = dict(model=NAME, messages=[{"role": "user", "content": PROMPTS[0]}], temperature=0,
                extra_body={"ignore_eos": True})
    with running(create_app(engine, NAME, per_request)) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
        got = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=24, seed=5).choices[0].text
        assert got == alone(model, tokenizer, ids, 24, temperature=0.9, top_k=40, top_p=0.95, seed=5)[0]
        greedy = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=24, temperature=0)
        assert greedy.choices[0].text == alone(model, tokenizer, ids, 24)[0]
        reply = client.chat.completions.create(**chat)
        assert reply.usage.completion_tokens == 20
        assert reply.choices[0].message.content == alone(model, tokenizer, rendered, 20, stop_ids=())[0]
    with running(create_app(engine, NAME, per_request, generation_config="vllm")) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
        got = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=24, seed=5).choices[0].text
        assert got == alone(model, tokenizer, ids, 24, temperature=1.0, seed=5)[0]
        assert client.chat.completions.create(**chat).usage.completion_tokens == MAX_LEN - len(rendered)
    with pytest.raises(ValueError, match="generation_config"):
        create_app(engine, NAME, per_request, generation_config="folder")


def test_concurrent_clients_each_get_their_request_alone(client, model, tokenizer, rng):
    """32 clients at once, greedy and sampled, streaming or not, different lengths and
    ignore_eos: each gets what its request generates alone."""
    cases = []
    for i in range(32):
        sampled = i % 2 == 1
        cases.append(dict(prompt=PROMPTS[i % len(PROMPTS)], max_tokens=int(rng.choice([6, 12, 20, 28])),
                          temperature=0.8 if sampled else 0.0, seed=int(rng.integers(1 << 31)),
                          stream=i % 3 == 0, ignore_eos=i % 5 == 0))

    def ask(case):
        kw = dict(model=NAME, prompt=case["prompt"], max_tokens=case["max_tokens"], temperature=case["temperature"],
                  seed=case["seed"], extra_body={"ignore_eos": case["ignore_eos"]})
        if not case["stream"]:
            c = client.completions.create(**kw).choices[0]
            return c.text, c.finish_reason
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw)]
        return "".join(c.text for c in chunks), chunks[-1].finish_reason

    with ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(ask, cases))
    for case, (text, finish) in zip(cases, got):
        want, _, reason = alone(model, tokenizer, ids_of(tokenizer, case["prompt"]), case["max_tokens"],
                                temperature=case["temperature"], seed=case["seed"],
                                stop_ids=() if case["ignore_eos"] else None)
        assert (text, finish) == (want, reason), case


def test_a_client_leaving_mid_stream_frees_its_pages(client, url, model, tokenizer):
    gone = ("specjax:request_success_total", (("finished_reason", "abort"),))
    aborted = metrics(url).get(gone, 0.0)
    want = alone(model, tokenizer, ids_of(tokenizer, PROMPTS[2]), 40)[0]

    def other():
        return "".join(c.choices[0].text for c in client.completions.create(
            model=NAME, prompt=PROMPTS[2], max_tokens=40, temperature=0, stream=True))

    with ThreadPoolExecutor(1) as pool:
        leaving = client.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=120, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
        staying = pool.submit(other)
        for _, chunk in zip(range(2), leaving):
            assert chunk.choices[0].finish_reason is None
        leaving.close()  # drops the connection mid-stream
        assert staying.result() == want
    deadline = time.monotonic() + 60
    while True:
        now = metrics(url)
        if now[("specjax:kv_cache_pages_in_use", ())] == 0 and now[("specjax:num_requests_running", ())] == 0:
            break
        assert time.monotonic() < deadline, "pages were not returned"
        time.sleep(0.1)
    assert now[("specjax:kv_cache_pages_reserved", ())] == 0
    assert now[gone] == aborted + 1  # it was cancelled, not run to its end


def test_stop_strings_and_stop_ids_end_the_text(client, model, tokenizer):
    ids = ids_of(tokenizer, PROMPTS[4])
    full, count, _ = alone(model, tokenizer, ids, 40, stop_ids=())
    stop = full[len(full) // 2:len(full) // 2 + 4]  # four characters, likely across a token boundary
    cut = full.find(stop)
    kw = dict(model=NAME, prompt=PROMPTS[4], max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    # stop_reason as vLLM gives it: the stop string or stop id that ended the choice, else null
    got = client.completions.create(stop=[stop, "\x00never"], **kw).choices[0]
    assert (got.text, got.finish_reason, got.stop_reason) == (full[:cut], "stop", stop)
    chunks = [c.choices[0] for c in client.completions.create(stop=stop, stream=True, **kw)]
    assert "".join(c.text for c in chunks) == full[:cut] and chunks[-1].finish_reason == "stop"
    assert chunks[-1].stop_reason == stop and all(c.stop_reason is None for c in chunks[:-1])
    # the earliest of several stop strings wins
    early = full[2:5]
    got = client.completions.create(stop=[stop, early], **kw).choices[0]
    assert got.text == full[:min(cut, full.find(early))]
    assert got.stop_reason == (early if full.find(early) < cut else stop)
    # a stop id ends generation after it, the id itself not shown
    tokens = specjax.generate(model, ids, max_new_tokens=40, stop_ids=(), speculative=LOOKUP).tokens
    stop_id = tokens[10]
    want = alone(model, tokenizer, ids, 40, stop_ids=[stop_id])
    got = client.completions.create(model=NAME, prompt=ids, max_tokens=40, temperature=0,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert (got.choices[0].text, got.usage.completion_tokens, got.choices[0].finish_reason) == want
    assert got.choices[0].stop_reason == stop_id
    # eos ends this prompt at once: no stop_reason, even with eos among stop_token_ids (vLLM checks eos first)
    ends = 'if __name__ == "__main__":\n    main()\n'
    for extra in ({}, {"stop_token_ids": list(model.eos_ids)}):
        got = client.completions.create(model=NAME, prompt=ends, max_tokens=8, temperature=0, extra_body=extra)
        assert (got.choices[0].finish_reason, got.choices[0].stop_reason) == ("stop", None), extra
    got = client.completions.create(model=NAME, prompt=ends, max_tokens=8, temperature=0,
                                    extra_body={"stop_token_ids": list(model.eos_ids), "ignore_eos": True})
    assert (got.choices[0].finish_reason, got.choices[0].stop_reason) == ("stop", model.eos_ids[0])


BAD = [
    ({"model": 4, "prompt": "x"}, "model"),
    ({"prompt": list(range(MAX_LEN + 4))}, "prompt"),
    ({"prompt": "x", "max_tokens": MAX_LEN}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1, 2, 99999]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "seed": 2 ** 63}, "seed"),
    ({"prompt": "x", "seed": -2 ** 63 - 1}, "seed"),
    ({"prompt": "x", "seed": 1.5}, "seed"),
    ({"prompt": "x", "seed": True}, "seed"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop_token_ids": [8192]}, "stop_token_ids"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "logprobs": 2}, "logprobs"),
    ({"prompt": "x", "logprobs": 0}, "logprobs"),  # 0 == False in Python, but it asks for logprobs
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "presence_penalty": False}, "presence_penalty"),
    ({"prompt": "x", "top_logprobs": 0}, "top_logprobs"),  # a chat field: unknown here
    ({"prompt": "x", "tools": []}, "tools"),
    ({"prompt": "x", "max_tokns": 5}, "max_tokns"),
]


def test_bad_requests_get_400_naming_the_field(url, client):
    with httpx.Client(base_url=url, timeout=60) as http:
        for body, param in BAD:
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 400, body
            error = r.json()["error"]
            assert (error["param"], error["type"], error["code"]) == (param, "invalid_request_error", None), body
            assert error["message"]
        r = http.post("/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    # the server keeps serving
    assert client.completions.create(model=NAME, prompt="x", max_tokens=3, temperature=0).usage.completion_tokens


def test_errors_are_openai_json(url, client):
    """What does not exist is a 404 (an unknown model with OpenAI's model_not_found), a
    wrong method a 405, and text the tokenizer cannot take (lone surrogates, which JSON's
    escapes allow) a 400 naming the field: all in OpenAI's error shape."""
    with httpx.Client(base_url=url, timeout=60) as http:
        chat = {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}
        for r in (http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}),
                  http.post("/v1/chat/completions", json=chat), http.get("/v1/models/gpt-4")):
            assert r.status_code == 404, r.request
            error = r.json()["error"]
            assert (error["param"], error["type"], error["code"]) == ("model", "invalid_request_error",
                                                                      "model_not_found")
        r = http.get("/v1/nothing")
        assert r.status_code == 404 and "GET /v1/nothing" in r.json()["error"]["message"]
        r = http.post("/v1/models")
        assert r.status_code == 405 and "GET" in r.headers["allow"]
        assert r.json()["error"]["type"] == "invalid_request_error"
        lone = [("/v1/completions", '{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
                ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt"),
                ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
                ("/v1/completions", '{"prompt": "x", "\\ud800": 1}', "\ud800")]  # an unknown field, named
        for path, body, param in lone:
            r = http.post(path, content=body.encode(), headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.headers["content-type"] == "application/json", body
            assert r.json()["error"]["param"] == param, body
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    card = client.models.retrieve(NAME)
    assert (card.id, card.object) == (NAME, "model")


class Gated:
    """A tokenizer whose encoding of "wait" waits for `gate` (setting `entered` first) and of
    "fail" raises, as an unforeseen failure would."""

    def __init__(self, tokenizer):
        self.tokenizer, self.entered, self.gate = tokenizer, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, text, **kw):
        if text == "fail":
            raise RuntimeError("the test's tokenizer failed")
        if text == "wait":
            self.entered.set()
            assert self.gate.wait(60)
        return self.tokenizer(text, **kw)


def test_a_prompt_being_tokenized_leaves_the_server_answering(model):
    """Tokenizing runs off the event loop: while one prompt's tokenizing waits, the server
    answers other requests (here the model card of a name with a "/"); a failure nobody
    foresaw is a 500 in OpenAI's error shape."""
    gated = Gated(model.tokenizer)
    engine = Engine(dataclasses.replace(model, tokenizer=gated), None, max_batch=1, max_len=MAX_LEN)
    with running(create_app(engine, "org/tiny")) as base, ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(httpx.post, f"{base}/v1/completions", json={"prompt": "wait", "max_tokens": MAX_LEN},
                              timeout=60)
        try:
            assert gated.entered.wait(30)
            r = httpx.get(f"{base}/v1/models/org/tiny", timeout=10)
            assert r.status_code == 200 and r.json()["id"] == "org/tiny"
        finally:
            gated.gate.set()
        r = waiting.result()  # then it goes on (and is refused: no room for that many tokens)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "fail"}, timeout=60)
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "server_error" and "the test's tokenizer failed" in error["message"]


def test_a_request_meeting_nan_fails_alone_and_the_others_are_served(tmp_path, tokenizer):
    """A completion whose prompt feeds a token with a NaN embedding (the shipped model with
    its head untied and one embedding row poisoned) is a 500 naming NaN logits; completions
    sent with it, which never feed that token, are what they are alone, and so is one sent
    after it."""
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "poisoned"
    shutil.copytree(SHIPPED, folder)
    weights = load_file(folder / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    healthy, bad_prompt = PROMPTS[:3], "x = a @ b"
    poison = next(t for t in ids_of(tokenizer, bad_prompt) if all(t not in ids_of(tokenizer, p) for p in healthy))
    weights["lm_head.weight"] = embed.copy()
    embed[poison] = np.nan
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    model = specjax.load(folder)
    want = [alone(model, tokenizer, ids_of(tokenizer, p), 12)[0] for p in healthy]
    assert all(poison not in specjax.generate(model, ids_of(tokenizer, p), max_new_tokens=12).tokens
               for p in healthy)
    engine = Engine(model, None, max_batch=4, max_len=MAX_LEN)
    with running(create_app(engine, NAME)) as base, ThreadPoolExecutor(4) as pool:
        post = lambda prompt: httpx.post(f"{base}/v1/completions", timeout=120,  # noqa: E731
                                         json={"prompt": prompt, "max_tokens": 12, "temperature": 0})
        sent = [pool.submit(post, p) for p in [bad_prompt, *healthy[:2]]]
        bad, *good = [f.result() for f in sent]
        good.append(post(healthy[2]))
    assert bad.status_code == 500 and "NaN" in bad.json()["error"]["message"], bad.text
    assert [r.json()["choices"][0]["text"] for r in good] == want


def test_neutral_values_must_match_in_type_and_endpoint(served):
    """A field the server does not implement passes only with its neutral value, a boolean
    only where that is one (0 == False in Python, but logprobs: 0 asks for logprobs), and
    only on the endpoint that has the field."""
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for extra in ({"logprobs": False}, {"top_logprobs": 0}, {"presence_penalty": 0.0}, {"tools": []},
                  {"repetition_penalty": 1.0}):
        chat_plan(chat | extra, served)
    completion_plan({"prompt": "x", "logprobs": False, "echo": False, "suffix": "", "best_of": 1}, served)
    for extra in ({"logprobs": 0}, {"logprobs": True}, {"top_logprobs": False}, {"repetition_penalty": True},
                  {"suffix": ""}, {"best_of": 1}):
        with pytest.raises(RequestError) as e:
            chat_plan(chat | extra, served)
        assert e.value.param == next(iter(extra)), extra


def test_chat_messages_are_rendered_as_vllm_renders_them(served, tokenizer):
    """Text parts are joined by newlines, an assistant message's null content is empty, and
    a message's name reaches the template."""
    messages = [{"role": "system", "content": [{"type": "text", "text": "You write"},
                                               {"type": "text", "text": "Python."}]},
                {"role": "user", "name": "ada", "content": "hi"},
                {"role": "assistant", "content": None},
                {"role": "user", "content": "def add(a, b):"}]
    rendered = ("<|system|>\nYou write\nPython.\n<|user ada|>\nhi\n<|assistant|>\n\n<|user|>\ndef add(a, b):\n"
                "<|assistant|>\n")
    assert chat_plan({"messages": messages}, served).prompts == [ids_of(tokenizer, rendered)]
    for bad in ({"role": "user", "content": None}, {"role": "user", "content": "x", "name": 3}):
        with pytest.raises(RequestError) as e:
            chat_plan({"messages": [bad]}, served)
        assert e.value.param == "messages", bad


def test_chat_messages_keep_their_tool_and_reasoning_fields(served, tokenizer):
    """An assistant turn's tool_calls and reasoning_content and a tool result's tool_call_id
    reach the template (they were dropped: the turn rendered empty), rendered as
    transformers renders the same messages; null fields a client echoes back are left out."""
    tools = dataclasses.replace(served, tokenizer=AutoTokenizer.from_pretrained(str(SHIPPED)))
    tools.tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
        "</think>\n{% endif %}{{ m['content'] }}{% for c in m.tool_calls or [] %}<call {{ c.id }}>"
        "{{ c.function.name }}({{ c.function.arguments }})</call>{% endfor %}{% if m.tool_call_id %}"
        "[for {{ m.tool_call_id }}]{% endif %}\n{% endfor %}<|assistant|>\n")
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [{"role": "user", "content": "1 + 2?"},
                {"role": "assistant", "content": None, "reasoning_content": "use the tool", "tool_calls": [call],
                 "refusal": None, "audio": None, "function_call": None},
                {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    want = tools.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    got = chat_plan({"messages": messages}, tools).prompts[0]
    assert got == list(want)
    text = tools.tokenizer.decode(got)
    assert "<think>use the tool</think>" in text and "<call c1>add(" in text and "[for c1]" in text


# Qwen3's switch for its thinking mode, as its chat template reads it (cut to what is tested)
THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
            "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_chat_template_kwargs_and_switches_reach_the_template_as_in_vllm(served):
    """vLLM's chat_template_kwargs are variables of the template (Qwen3's enable_thinking:
    false opens the reply with an empty think block); add_generation_prompt: false leaves
    the assistant's header out, continue_final_message goes on with the last message; each
    prompt is what transformers' apply_chat_template renders. A renderer argument among the
    variables, variables that are no object, and both switches on are 400s naming the field."""
    qwen = dataclasses.replace(served, tokenizer=AutoTokenizer.from_pretrained(str(SHIPPED)))
    qwen.tokenizer.chat_template = THINKING
    messages = [{"role": "user", "content": "def add(a, b):"}]
    partial = [*messages, {"role": "assistant", "content": "    return"}]

    def want(msgs, **kw):
        return list(qwen.tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False, **kw))

    assert chat_plan({"messages": messages}, qwen).prompts == [want(messages, add_generation_prompt=True)]
    off = chat_plan({"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}, qwen).prompts[0]
    assert off == want(messages, add_generation_prompt=True, enable_thinking=False)
    assert qwen.tokenizer.decode(off).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    bare = chat_plan({"messages": messages, "add_generation_prompt": False}, qwen).prompts[0]
    assert bare == want(messages, add_generation_prompt=False)
    going_on = chat_plan({"messages": partial, "add_generation_prompt": False, "continue_final_message": True},
                         qwen).prompts[0]
    assert going_on == want(partial, continue_final_message=True)
    assert qwen.tokenizer.decode(going_on).endswith("    return")
    for bad, param in (({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
                       ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
                       ({"continue_final_message": True}, "continue_final_message"),
                       ({"add_generation_prompt": 1}, "add_generation_prompt")):
        with pytest.raises(RequestError) as e:
            chat_plan({"messages": partial} | bad, qwen)
        assert e.value.param == param, bad


def test_chat_without_a_template_names_messages(model):
    shipped = dataclasses.replace(model, tokenizer=AutoTokenizer.from_pretrained(str(SHIPPED)))  # no template
    with running(create_app(Engine(shipped, None, max_batch=1, max_len=MAX_LEN), "tiny-code")) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages" and "chat template" in error["message"]


PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}


def test_browsers_may_call_from_any_origin_by_default(url, client):
    """CORS as a browser exercises it (the Fetch standard): a preflight of a chat POST with
    the openai client's headers is allowed for any origin, and every answer, errors too,
    is marked readable by the page that asked."""
    page = {"Origin": "http://localhost:5173"}
    with httpx.Client(base_url=url, timeout=60) as http:
        r = http.options("/v1/chat/completions", headers={**page, **PREFLIGHT})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert {"authorization", "content-type"} <= {h.strip().lower() for h in
                                                      r.headers["access-control-allow-headers"].split(",")}
        assert "access-control-allow-credentials" not in r.headers
        for r in (http.get("/v1/models", headers=page), http.get("/v1/nothing", headers=page),
                  http.post("/v1/completions", headers=page, json={"model": "gpt-4", "prompt": "x"})):
            assert r.headers["access-control-allow-origin"] == "*", r.request
        assert "access-control-allow-origin" not in http.get("/v1/models").headers  # no Origin: not a browser's call


def test_allowed_origins_limit_which_pages_may_call(model):
    engine = Engine(model, None, max_batch=1, max_len=MAX_LEN)
    with running(create_app(engine, NAME, allowed_origins=("https://app.example",))) as base:
        ok = httpx.options(f"{base}/v1/chat/completions", headers={"Origin": "https://app.example", **PREFLIGHT})
        other = httpx.options(f"{base}/v1/chat/completions", headers={"Origin": "https://evil.example", **PREFLIGHT})
        get = httpx.get(f"{base}/v1/models", headers={"Origin": "https://evil.example"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    assert get.status_code == 200 and "access-control-allow-origin" not in get.headers
    # a "simple" request (no preflight: text/plain or a form) from another page generates nothing
    with running(create_app(engine, NAME, allowed_origins=("https://app.example",))) as base:
        for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
            r = httpx.post(f"{base}/v1/completions", content=b'{"prompt": "x", "max_tokens": 2}',
                           headers={"Origin": "https://evil.example", **({"content-type": kind} if kind else {})})
            assert r.status_code == 415 and r.json()["error"]["message"].startswith(
                "the request body must be JSON sent with Content-Type: application/json"), kind
        assert metrics(base)[("specjax:prompt_tokens_total", ())] == 0
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=120,
                       headers={"content-type": "Application/JSON; charset=utf-8"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    with running(create_app(engine, NAME, allowed_origins=())) as base:
        r = httpx.options(f"{base}/v1/chat/completions", headers={"Origin": "https://app.example", **PREFLIGHT})
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("bad", ["http://localhost:5173/", "localhost:5173", "ftp://host", "*,http://a.example",
                                 "http://a.example/app"])
def test_serve_refuses_what_is_not_an_origin(bad, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--allowed-origins", bad])
    assert e.value.code == 2 and "--allowed-origins" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["-5", "nan", "inf", "soon"])
def test_serve_refuses_a_shutdown_timeout_that_is_not_seconds(bad, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--shutdown-timeout", bad])
    assert e.value.code == 2 and "--shutdown-timeout" in capsys.readouterr().err


def test_speculation_metrics_add_up(url):
    """vLLM's counters over what the tests ran: drafts were made and some accepted, and
    the per-position counts add up to the accepted total."""
    m = metrics(url)
    drafts = m[("specjax:spec_decode_num_drafts_total", ())]
    accepted = m[("specjax:spec_decode_num_accepted_tokens_total", ())]
    per_pos = {dict(k[1])["position"]: v for k, v in m.items()
               if k[0] == "specjax:spec_decode_num_accepted_tokens_per_pos_total"}
    assert drafts > 0 and 0 < accepted <= m[("specjax:spec_decode_num_draft_tokens_total", ())]
    assert sum(per_pos.values()) == accepted and set(per_pos) == {"0"}  # k = 1: one position
    assert m[("specjax:time_to_first_token_seconds_count", ())] > 0
    assert m[("process_resident_memory_bytes", ())] > 0
    assert np.isclose(m[("specjax:kv_cache_usage_perc", ())], 0.0)


def test_serve_refuses_a_busy_port(capsys):
    with bind("127.0.0.1", 0) as taken, pytest.raises(SystemExit) as e:
        main(["serve", "--port", str(taken.getsockname()[1])])
    assert e.value.code == 2 and "cannot listen there" in capsys.readouterr().err


def test_sigterm_lets_a_running_stream_finish(model, tokenizer):
    """`specjax serve` in its own process: on SIGTERM it stops taking requests, finishes the
    running stream, stops the engine thread and ends by that signal (uvicorn's way)."""
    proc = subprocess.Popen([sys.executable, "-m", "specjax.cli", "serve", "--model", str(SHIPPED), "--port", "0",
                             "--no-warmup", "--speculate", "1", "--max-batch", "1", "--max-len", str(MAX_LEN)],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not (found := [m for line in lines if (m := re.search(r"serving .* at (http://\S+)/v1", line))]):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        base = found[0].group(1)
        want = alone(model, tokenizer, ids_of(tokenizer, PROMPTS[5]), 96, stop_ids=())[0]
        stream = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120).completions.create(
            model="tiny-code", prompt=PROMPTS[5], max_tokens=96, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        text = next(stream).choices[0].text
        proc.send_signal(signal.SIGTERM)
        text += "".join(c.choices[0].text for c in stream)
        assert text == want
        assert proc.wait(60) == -signal.SIGTERM
    finally:
        proc.kill()
    reader.join(10)
    assert "Application shutdown complete" in "".join(lines)


def test_when_the_shutdown_timeout_runs_out_streams_end_with_an_error_event(model, tokenizer):
    """`serve`'s server on SIGTERM: when its shutdown timeout (0 s here) runs out, a stream
    still running gets an error event (503, the server shutting down) and [DONE], a whole
    body, rather than a connection cut mid-stream by uvicorn's own timeout; then the server
    stops."""
    import uvicorn

    from specjax.server import CLOSE_GRACE, _Server

    engine = Engine(model, None, max_batch=2, max_len=MAX_LEN)
    # the stream's steps compiled first: the cancel waits for the device call under way, and a
    # compile on a loaded machine outlasted CLOSE_GRACE (uvicorn then cut the stream)
    engine.submit(ids_of(tokenizer, PROMPTS[0]), max_new_tokens=8, stop_ids=()).result()
    app = create_app(engine, NAME)
    sock = bind("127.0.0.1", 0)
    server = _Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=CLOSE_GRACE), 0.0,
                     app.state.worker)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.02)
    body = {"prompt": PROMPTS[0], "max_tokens": MAX_LEN - 10, "temperature": 0, "stream": True, "ignore_eos": True}
    events = []
    with httpx.stream("POST", f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions", json=body,
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                if len(events) == 1:
                    server.handle_exit(signal.SIGTERM, None)
    thread.join(60)
    assert not thread.is_alive()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and error["message"].startswith("the server is shutting down")
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])
    assert len(text) > 0 and all("finish_reason" in json.loads(e)["choices"][0] for e in events[:-2])


def test_text_stream_holds_back_what_may_start_a_stop_string(tokenizer):
    """Token by token: what is sent never runs past the cut, and adds up to the text
    before the earliest stop string."""
    ids = ids_of(tokenizer, "def area(r):\n    return 3.14159 * r * r  # the area\n")
    text = tokenizer.decode(ids)
    for stop in (" * r", "14159", "area\n", "absent"):
        stream = TextStream(tokenizer, [stop, "never there"])
        want = text[:text.find(stop)] if stop in text else text
        sent = ""
        for i, t in enumerate(ids):
            sent += stream.add([t], final=i == len(ids) - 1)
            assert want.startswith(sent), (stop, sent)
            if stream.stopped:
                break
        assert sent == want and stream.stopped == (stop in text), stop
    # a multi-byte character split across tokens is held until it is whole
    stream = TextStream(tokenizer)
    ids = ids_of(tokenizer, "naïve ☃")
    assert "".join(stream.add([t]) for t in ids) + stream.add([], final=True) == tokenizer.decode(ids)


def test_text_stream_cuts_before_a_stop_string_ahead_of_a_split_character(tokenizer, rng):
    """A stop string whose last characters arrive in pieces (a multi-byte character split
    across tokens): what comes before them is held too, so the text ends before the stop
    string, as the whole text cut at its first occurrence does, and the token count is the
    fewest tokens whose text reaches the stop string's end. Random texts, stops and chunks."""
    for text, stop, want in [("x = 1 ☃ y", " ☃", "x = 1"), ("a → b", " →", "a"), ("价格: 你好", ": 你", "价格")]:
        ids = ids_of(tokenizer, text)
        stream = TextStream(tokenizer, [stop])
        assert "".join(stream.add([t]) for t in ids) == want and stream.stopped, text
    pieces = ["x", " = ", "1", " ", "☃", "→", "价格", ": ", "你好", "naïve", "😀", "\n", "def f():", "€"]
    for _ in range(300):
        ids = ids_of(tokenizer, "".join(rng.choice(pieces, int(rng.integers(2, 10)))))
        full = tokenizer.decode(ids, skip_special_tokens=True)
        at = int(rng.integers(len(full)))
        stop = full[at:at + int(rng.integers(1, 5))]
        cut = full.find(stop)
        used = next(n for n in range(1, len(ids) + 1)
                    if tokenizer.decode(ids[:n], skip_special_tokens=True).startswith(full[:cut + len(stop)]))
        stream, plain, sent, whole, i = TextStream(tokenizer, [stop, "\x00absent"]), TextStream(tokenizer), "", "", 0
        while i < len(ids):
            j = min(len(ids), i + int(rng.integers(1, 4)))
            if not stream.stopped:
                sent += stream.add(ids[i:j], final=j == len(ids))
                assert full[:cut].startswith(sent), (full, stop, sent)
            whole += plain.add(ids[i:j], final=j == len(ids))
            i = j
        assert (sent, stream.stopped, stream.tokens_used) == (full[:cut], True, used), (full, stop)
        assert whole == full


def test_text_stream_decodes_each_token_a_bounded_number_of_times(tokenizer):
    """An update decodes the new tokens and a few before them, not the whole text again:
    the tokens decoded over a completion grow with its length, not with its square."""
    decoded = []

    class Counting:
        def decode(self, ids, **kw):
            decoded.append(len(ids))
            return tokenizer.decode(ids, **kw)

    ids = ids_of(tokenizer, "\n".join(PROMPTS + ["naïve ☃ 价格: 你好 😀"]) * 6)
    stream = TextStream(Counting(), ["\x00absent"])
    sent = "".join(stream.add([t]) for t in ids) + stream.add([], final=True)
    assert sent == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(ids) > 400 and sum(decoded) < 20 * len(ids)  # decoding all each time: len(ids) / 2 a token


def test_speculation_counters_per_round():
    """(drafts, accepted) per round, counted as vLLM does: rounds that drafted, drafts,
    accepted drafts, and per 0-based position the rounds that accepted it."""
    m = ServerMetrics("m")
    m.rounds([3, 0, 2, 1, 4], [2, 0, 2, 0, 1])
    values = {(s.name, s.labels.get("position")): s.value
              for family in text_string_to_metric_families(m.render().decode()) for s in family.samples}
    assert values[("specjax:spec_decode_num_drafts_total", None)] == 4
    assert values[("specjax:spec_decode_num_draft_tokens_total", None)] == 10
    assert values[("specjax:spec_decode_num_accepted_tokens_total", None)] == 5
    per_pos = {p: v for (name, p), v in values.items() if name == "specjax:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {"0": 3, "1": 2}
