"""The OpenAI API as `specjax serve` speaks it: request bodies checked field by field into
engine submissions, and the JSON of responses and stream chunks.

Fields follow OpenAI's completions and chat completions APIs, plus vLLM's extra sampling
fields (`top_k`, `min_p`, `stop_token_ids`, `ignore_eos`). Defaults are OpenAI's and
vLLM's: temperature 1; `max_tokens` 16 for completions (less if the context has less room)
and the rest of the context for chat (and for a completion's explicit null); and as in
vLLM, the sampling fields and that max_tokens default to what the model folder's
generation_config.json sets (`Served.defaults`). Chat's `max_completion_tokens` wins over
`max_tokens`. A field this server does not implement (logprobs,
penalties, tools, ...) is refused with a 400 naming it unless it has its neutral value (of
the same type: `logprobs: 0` is not `false`), and so is a field it does not know or one of
the other endpoint's: nothing asked for is silently dropped. An unknown model is a 404.
`seed` takes vLLM's range, any 64-bit integer, and the engine's 32-bit seed is it modulo
2**32. `n` choices of a prompt are n engine requests with seeds seed, seed + 1, ...,
seed + n - 1 (modulo 2**32; without a seed, a random one), so each choice is reproducible
alone.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
import uuid
from typing import Any

from . import chat
from .sampling import Sampling, SamplingError
from .serving import Submission
from .errors import SpecjaxError

MAX_N = 64  # choices per request
SEEDS = 2 ** 32  # the engine's seeds; a request's seed is taken modulo this
SEED_RANGE = (-2 ** 63, 2 ** 63 - 1)  # a request's seed: a 64-bit integer, as vLLM takes
COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's max_tokens default for completions

# fields accepted only with their neutral values (null always is), on both endpoints or one
NEUTRAL: dict[str, tuple] = {
    "logprobs": (False,), "echo": (False,), "presence_penalty": (0,), "frequency_penalty": (0,),
    "repetition_penalty": (1,), "logit_bias": ({},), "min_tokens": (0,), "response_format": ({"type": "text"},),
    "use_beam_search": (False,), "include_stop_str_in_output": (False,), "skip_special_tokens": (True,),
}
COMPLETION_NEUTRAL = NEUTRAL | {"suffix": ("",), "best_of": (1,)}
CHAT_NEUTRAL = NEUTRAL | {"top_logprobs": (0,), "tools": ([],), "tool_choice": ("none",), "functions": ([],)}
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                     "safety_identifier"})  # bookkeeping fields with no effect on the output
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p")
COMMON = frozenset({"model", "max_tokens", "n", "seed", "stop", "stop_token_ids", "ignore_eos", "stream",
                    "stream_options", *SAMPLING_FIELDS})
COMPLETION_FIELDS = COMMON | {"prompt"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "chat_template_kwargs", "add_generation_prompt",
                        "continue_final_message"}


class RequestError(SpecjaxError):
    """A request this server cannot serve: HTTP `status` with an OpenAI-style error body
    naming the field (`param`), and OpenAI's error `code` where it has one."""

    def __init__(self, message: str, param: str | None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Served:
    """What requests are checked against: the served model's name, tokenizer, vocabulary
    and eos ids, the engine's max_len (prompt + new tokens of one sequence), and defaults
    for fields a request leaves out, where they are not vLLM's own (from the model folder's
    generation_config.json, `specjax.model.request_defaults`): SAMPLING_FIELDS, and
    max_tokens for chat (a completion left without one keeps OpenAI's 16)."""

    name: str
    tokenizer: Any
    vocab_size: int
    eos_ids: tuple[int, ...]
    max_len: int
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A checked request: its prompts and one submission per choice, prompt-major (choice
    i is prompt i // n), and how to answer."""

    chat: bool
    prompts: list[list[int]]
    submissions: list[Submission]
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    # the stop ids a choice's stop_reason names, as vLLM's: those asked for, less the eos
    # ids where eos stops (vLLM checks eos first and reports it as no stop_reason)
    stop_token_ids: frozenset[int] = frozenset()
    # vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries the usage so far
    continuous_usage: bool = False


# ------------------------------------------------------------------ field checks

def _integer(body: dict, name: str, default: Any, low: int, high: int | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise RequestError(f"{name} must be an integer {bound}, got {value!r}", name)
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name} must be a number, got {value!r}", name)
    return float(value)


def _boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}", name)
    return value


def _token_list(value: Any, name: str, vocab: int) -> list[int] | None:
    """value as token ids in [0, vocab), or None if it is not a list of integers."""
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return None
    bad = [t for t in value if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"{name}: token ids must be in [0, {vocab}), got {bad[0]}", name)
    return value


def _neutral(value: Any, neutral: Any) -> bool:
    """value is the neutral value: equal, and a boolean only where that is one (in Python
    0 == False and 1 == True, but `logprobs: 0` asks for logprobs)."""
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


def _check_fields(body: Any, known: frozenset[str], neutral: dict[str, tuple]) -> dict:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}", None)
    for name, value in body.items():
        if name in known or name in IGNORED or value is None:
            continue
        if name in neutral:
            if not any(_neutral(value, v) for v in neutral[name]):
                raise RequestError(f"{name} is not supported by this server (got {value!r})", name)
            continue
        raise RequestError(f"unknown field {name!r}", name)
    return body


def unknown_model(model: str, served: Served) -> RequestError:
    """OpenAI's 404 for a model this server does not serve."""
    return RequestError(f"the model {model!r} does not exist; this server serves {served.name!r}", "model",
                        status=404, code="model_not_found")


def _model(body: dict, served: Served) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"model must be a string, got {model!r:.80}", "model")
    if model is not None and model != served.name:
        raise unknown_model(model, served)


def _sampling(body: dict, defaults: dict[str, Any]) -> Sampling:
    """Sampling from the request, each field it leaves out from `defaults` (else vLLM's
    default); each field is checked by `Sampling` as it is added, so an error names the
    field that failed (Sampling's checks are per field)."""
    values = {name: _number(body, name, defaults.get(name, vllm))
              for name, vllm in (("temperature", 1.0), ("top_p", 1.0), ("min_p", 0.0))}
    top_k = _integer(body, "top_k", defaults.get("top_k", 0), -1)
    values["top_k"] = 0 if top_k == -1 else top_k  # vLLM's -1: no top-k
    given: dict[str, Any] = {}
    for name in SAMPLING_FIELDS:
        given[name] = values[name]
        try:
            Sampling(**given)
        except SamplingError as e:
            raise RequestError(str(e), name) from None
    return Sampling(**given)


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a non-empty string or a list of them, got {stop!r}", "stop")
    return tuple(stops)


def _unicode(text: str, param: str) -> str:
    """text, if it is valid Unicode: JSON's \\ud800 escapes make lone surrogates, which
    have no UTF-8 and which the tokenizer refuses."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{param}: the text is not valid Unicode ({e.reason} at {e.start})", param) from None
    return text


def _text_ids(text: str, served: Served, param: str) -> list[int]:
    ids = list(served.tokenizer(_unicode(text, param))["input_ids"])
    if not ids:
        raise RequestError(f"{param}: the prompt is empty (it tokenizes to no tokens)", param)
    return ids


def _prompts(body: dict, served: Served) -> list[list[int]]:
    """OpenAI's prompt forms: text, token ids, a list of texts or a list of token-id lists."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [_text_ids(prompt, served, "prompt")]
    if isinstance(prompt, list) and prompt:
        if (ids := _token_list(prompt, "prompt", served.vocab_size)) is not None:
            return [ids]
        if all(isinstance(p, str) for p in prompt):
            return [_text_ids(p, served, "prompt") for p in prompt]
        lists = [_token_list(p, "prompt", served.vocab_size) for p in prompt]
        if all(ids for ids in lists):
            return lists
    raise RequestError("prompt must be a non-empty string, list of token ids, list of strings or list of "
                       f"token-id lists, got {prompt!r:.80}", "prompt")


def _content(message: Any, at: int) -> dict[str, Any]:
    """The message as the chat template gets it: role, content as one string, the
    participant's name if given, and the message's other fields as sent (an assistant's
    `tool_calls` or `reasoning_content`, a tool result's `tool_call_id`: Qwen3's template
    renders them), less those that are null (a client echoing a reply back sends
    `refusal: null`, `audio: null`, ...)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(f"messages[{at}] must be an object with a role, got {message!r:.80}", "messages")
    content = message.get("content")
    if content is None and message["role"] == "assistant":
        content = ""  # OpenAI allows an assistant message without content; vLLM renders it empty
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        # text parts, joined by newlines as vLLM joins them; other kinds (images) are not served
        content = "\n".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise RequestError(f"messages[{at}].content must be a string or a list of text parts, "
                           f"got {content!r:.80}", "messages")
    out = {k: _unicode(v, "messages") if isinstance(v, str) else v for k, v in message.items()
           if v is not None and k not in ("role", "content", "name")}
    out.update(role=_unicode(message["role"], "messages"), content=_unicode(content, "messages"))
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise RequestError(f"messages[{at}].name must be a string, got {name!r:.80}", "messages")
        out["name"] = _unicode(name, "messages")
    return out


def _chat_prompt(body: dict, served: Served) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages must be a non-empty list, got {messages!r:.80}", "messages")
    if served.tokenizer.chat_template is None:
        raise RequestError(f"model {served.name!r} has no chat template, so messages cannot be formatted; "
                           "use /v1/completions with a prompt", "messages")
    messages = [_content(m, i) for i, m in enumerate(messages)]
    try:
        variables = chat.template_kwargs(body.get("chat_template_kwargs"), "chat_template_kwargs")
    except chat.ChatError as e:
        raise RequestError(str(e), "chat_template_kwargs") from None
    add, go_on = _boolean(body, "add_generation_prompt", True), _boolean(body, "continue_final_message")
    if add and go_on:
        raise RequestError("continue_final_message needs add_generation_prompt: false (vLLM's rule: the last "
                           "message is continued, not answered)", "continue_final_message")
    try:
        ids = chat.render(served.tokenizer, messages, variables, add_generation_prompt=add,
                          continue_final_message=go_on)
    except chat.ChatError as e:
        raise RequestError(f"messages: {e}", "messages") from None
    if not ids:
        raise RequestError("messages: the chat template made an empty prompt", "messages")
    return list(ids)


# ------------------------------------------------------------------ requests

def _plan(body: dict, served: Served, prompts: list[list[int]], chat: bool) -> Plan:
    prompt_param = "messages" if chat else "prompt"
    # chat's max_completion_tokens (OpenAI's newer name) wins over max_tokens where both are
    # given, as in vLLM; a completion's max_tokens left out is OpenAI's 16, but sent as null
    # it is the default chat has (vLLM's CompletionRequest defaults the field, not a null)
    asked = _integer(body, "max_tokens", None, 1)
    tokens_param = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        asked, tokens_param = _integer(body, "max_completion_tokens", None, 1), "max_completion_tokens"
    short = not chat and "max_tokens" not in body
    sampling = _sampling(body, served.defaults)
    n = _integer(body, "n", 1, 1, MAX_N)
    seed = _integer(body, "seed", None, *SEED_RANGE)
    seed = secrets.randbelow(SEEDS) if seed is None else seed % SEEDS
    stop_ids = body.get("stop_token_ids")
    extra = [] if stop_ids is None else _token_list(stop_ids, "stop_token_ids", served.vocab_size)
    if extra is None:
        raise RequestError(f"stop_token_ids must be a list of token ids, got {stop_ids!r:.80}", "stop_token_ids")
    stops = () if _boolean(body, "ignore_eos") else served.eos_ids
    stop_set = tuple(sorted(set(stops) | set(extra)))
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    flags = ("include_usage", "continuous_usage_stats")
    if options is not None and (not stream or not isinstance(options, dict) or set(options) - set(flags)
                                or not all(isinstance(options.get(f, False), bool) for f in flags)):
        raise RequestError("stream_options must be {\"include_usage\": true|false, \"continuous_usage_stats\": "
                           "true|false}, and only with stream: true", "stream_options")
    include_usage = bool(options and options.get("include_usage"))
    submissions = []
    for ids in prompts:
        room = served.max_len - len(ids)
        if room < 1:
            raise RequestError(f"{prompt_param}: the prompt is {len(ids)} tokens; this server's context is "
                               f"{served.max_len} tokens (prompt and completion), so at most "
                               f"{served.max_len - 1} prompt tokens", prompt_param)
        if asked is not None and asked > room:
            raise RequestError(f"{tokens_param} = {asked} with a prompt of {len(ids)} tokens exceeds this server's "
                               f"context of {served.max_len} tokens: at most {room}", tokens_param)
        new = asked if asked is not None else min(COMPLETION_MAX_TOKENS if short else
                                                  served.defaults.get("max_tokens", room), room)
        for j in range(n):
            submissions.append(Submission(ids, new, sampling, (seed + j) % SEEDS, stop_set))
    return Plan(chat, prompts, submissions, _stops(body), stream,
                include_usage, frozenset(extra) - set(stops),
                include_usage and bool(options.get("continuous_usage_stats")))


def completion_plan(body: Any, served: Served) -> Plan:
    """A /v1/completions body, checked."""
    body = _check_fields(body, COMPLETION_FIELDS, COMPLETION_NEUTRAL)
    _model(body, served)
    return _plan(body, served, _prompts(body, served), chat=False)


def chat_plan(body: Any, served: Served) -> Plan:
    """A /v1/chat/completions body, checked."""
    body = _check_fields(body, CHAT_FIELDS, CHAT_NEUTRAL)
    _model(body, served)
    return _plan(body, served, [_chat_prompt(body, served)], chat=True)


# ------------------------------------------------------------------ responses

class Reply:
    """The JSON of one request's response or stream chunks (id, created and model fixed)."""

    def __init__(self, plan: Plan, model: str):
        self.chat, self.model = plan.chat, model
        self.id = f"{'chatcmpl' if plan.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if plan.chat else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def choice(self, index: int, text: str, finish: str | None, delta: bool = False,
               first: bool = False, stop_reason: int | str | None = None) -> dict[str, Any]:
        """A choice, whole or (delta) a stream chunk's; stop_reason as vLLM gives it: the stop
        string or stop id that ended the choice, null otherwise (eos included)."""
        ends = {"finish_reason": finish, "stop_reason": stop_reason}
        if not self.chat:
            return {"index": index, "text": text, "logprobs": None, **ends}
        if not delta:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None, **ends}
        message = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": index, "delta": message, "logprobs": None, **ends}

    def response(self, choices: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
        return {**self._head(self.object), "choices": choices, "usage": usage}

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None,
              with_usage: bool = False) -> dict[str, Any]:
        body = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": choices}
        if with_usage:  # OpenAI: every chunk has usage (null) when the last one carries it
            body["usage"] = usage
        return body


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
