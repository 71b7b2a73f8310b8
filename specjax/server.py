"""`specjax serve`: an OpenAI-compatible HTTP server (Starlette on uvicorn) over one batched
`Engine`, which a dedicated thread owns (`specjax.serving`).

Routes: POST /v1/completions and /v1/chat/completions (JSON, or server-sent events with
`stream`), GET /v1/models, /v1/models/{model}, /health and /metrics (Prometheus text,
`specjax.metrics`); every error, unknown paths and methods and the server's own failures
included, is an OpenAI-style JSON error; pages of the allowed web origins may call it from a
browser (CORS, `create_app`). A request's body is parsed and tokenized off the
event loop, so a long prompt does not hold up other clients' streams. Its choices go to
the engine thread as one ticket; their tokens come back as events on this loop, become
text (`specjax.textstream`) and are answered at the end or streamed as they arrive. A
client that goes away (mid-stream or while waiting) cancels its requests, so their pages
return to the pool. On shutdown uvicorn stops accepting and running requests may finish
for the shutdown timeout; then they are cancelled, each answered with a 503 error (a
stream: an error event, then [DONE]); the lifespan's end stops the engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import prometheus_client
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .checkpoint import CheckpointError
from .engine import Engine
from .metrics import ServerMetrics
from .model import request_defaults
from .pages import PoolError
from .protocol import Plan, Reply, RequestError, Served, chat_plan, completion_plan, unknown_model, usage
from .serving import EngineWorker, Failed, Refused, ShuttingDown, Ticket, Tokens
from .textstream import TextStream


SHUTDOWN = "shutdown"  # the finish reason of requests the server cancels when its shutdown timeout runs out
CLOSE_GRACE = 5.0  # seconds uvicorn waits past that timeout for the streams to send their last events


class EngineFailure(RuntimeError):
    """A choice ended without finishing: the engine failed (status 500), or the server
    cancelled it on its way down (503)."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class _Run:
    """One HTTP request's choices in the engine: the ticket, the events its callback puts
    on this loop, and each choice's text and finish reason."""

    def __init__(self, plan: Plan, served: Served, worker: EngineWorker):
        loop = asyncio.get_running_loop()
        self.plan, self.worker = plan, worker
        self.events: asyncio.Queue = asyncio.Queue()
        self.ticket = Ticket(plan.submissions, lambda event: loop.call_soon_threadsafe(self.events.put_nowait, event))
        self.texts = [TextStream(served.tokenizer, plan.stops, s.stop_ids) for s in plan.submissions]
        self.finish: list[str | None] = [None] * len(plan.submissions)
        self.reasons: list[int | str | None] = [None] * len(plan.submissions)  # each choice's stop_reason

    async def admit(self) -> None:
        """Submit every choice; a refusal is the client's error, naming the field."""
        try:
            self.worker.submit(self.ticket)
        except ShuttingDown as e:
            raise RequestError(str(e), None, status=503) from None
        try:
            event = await self.events.get()
        except asyncio.CancelledError:  # the server stops before the engine took it
            self.worker.cancel(self.ticket)
            raise
        if isinstance(event, Refused):
            # the fields were checked first; what the engine still refuses is the size of a
            # sequence (PoolError) or the prompt's ids (GenerationError)
            param = "max_tokens" if isinstance(event.error, PoolError) else "prompt"
            raise RequestError(str(event.error), param)
        if isinstance(event, Failed):
            raise RequestError(f"the engine failed to take the request: {event.message}", None, status=500)

    @property
    def open(self) -> bool:
        return any(f is None for f in self.finish)

    async def next(self) -> tuple[int, str, str | None] | None:
        """The next event as (choice, new text, finish reason once it is over); None for an
        event about a choice that already ended (a stop string ended it first)."""
        event = await self.events.get()
        if isinstance(event, Failed):
            self.finish[event.index] = "error"
            raise EngineFailure(f"generation failed: {event.message}")
        assert isinstance(event, Tokens), event
        i = event.index
        if self.finish[i] is not None:
            return None
        if event.finish == SHUTDOWN:
            self.finish[i] = "abort"
            raise EngineFailure("the server is shutting down: the request was cancelled when its shutdown "
                                "timeout ran out", status=503)
        stream = self.texts[i]
        text = stream.add(event.tokens, final=event.finish is not None)
        if stream.stopped:
            if event.finish is None:
                self.worker.cancel(self.ticket, i, reason="stop")
            self.finish[i], self.reasons[i] = "stop", stream.stop
        else:
            self.finish[i] = event.finish
            if event.finish == "stop" and stream.ids and stream.ids[-1] in self.plan.stop_token_ids:
                self.reasons[i] = stream.ids[-1]  # the engine keeps the stop id as the last token
        return i, text, self.finish[i]

    def cancel(self) -> None:
        """Cancel the choices still running (the client went away, or the server stops)."""
        if self.open:
            self.worker.cancel(self.ticket)

    def usage(self) -> dict[str, int]:
        return usage(sum(len(p) for p in self.plan.prompts), sum(t.tokens_used for t in self.texts))


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (the body has been read: what is left is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _json_media(request: Request) -> None:
    """A generation request's body must be sent as application/json (as vLLM requires): a
    browser sends a cross-origin POST of text/plain or a form without asking first (no CORS
    preflight), so any page could make the server generate past --allowed-origins."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise RequestError(f"the request body must be JSON sent with Content-Type: application/json, got "
                           f"{media or 'no Content-Type'}", None, status=415)


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError as e:  # JSONDecodeError, or bytes that are not text
        raise RequestError(f"the request body is not valid JSON: {e}", None) from None


def _error(error: RequestError, headers: dict[str, str] | None = None) -> Response:
    """error's JSON response, ASCII-escaped: messages quote the request, and JSON strings
    may hold lone surrogates, which have no UTF-8."""
    return Response(json.dumps(error.body()), status_code=error.status, headers=headers,
                    media_type="application/json")


def create_app(engine: Engine, name: str, per_request: dict | None = None,
               allowed_origins: tuple[str, ...] = ("*",), generation_config: str = "auto") -> Starlette:
    """The server's ASGI app for `engine`, serving its model under `name`; per_request are
    extra `Engine.submit` keywords (from `engine_options`). The engine thread starts and
    stops with the app's lifespan.

    generation_config (vLLM's option and values): "auto", the sampling fields and chat's
    max_tokens that a request leaves out default to what the model folder's
    generation_config.json sets, as in vLLM (`specjax.model.request_defaults`); "vllm",
    to vLLM's own defaults (temperature 1, no top-k / top-p / min-p).

    allowed_origins: the web origins whose pages may call the API from a browser (CORS:
    preflights answered, responses marked readable by them); "*" any, as vLLM, SGLang and
    llama.cpp's server allow by default; () none (browsers then refuse cross-origin calls).
    Credentials (cookies) are never allowed: the API takes none."""
    model = engine.model
    if model.tokenizer is None:
        raise CheckpointError(f"{model.path}: serving needs the model's tokenizer (tokenizer.json)")
    if generation_config not in ("auto", "vllm"):
        raise ValueError(f"generation_config must be 'auto' or 'vllm', got {generation_config!r}")
    defaults = request_defaults(model.path) if generation_config == "auto" else {}
    served = Served(name, model.tokenizer, model.config.vocab_size, tuple(model.eos_ids), engine.max_len, defaults)
    metrics = ServerMetrics(name)
    worker = EngineWorker(engine, metrics, per_request)

    async def generate(request: Request, parse: Callable[[Any, Served], Plan]) -> Response:
        _json_media(request)
        raw = await request.body()
        # parsing and tokenizing (the chat template too) take time in the prompt's length,
        # and the tokenizer lets go of the GIL: in a thread, other streams go on meanwhile
        plan = await asyncio.to_thread(lambda: parse(_json(raw), served))
        run = _Run(plan, served, worker)
        await run.admit()
        reply = Reply(plan, name)
        if plan.stream:
            return StreamingResponse(stream(run, reply), media_type="text/event-stream")
        return await complete(run, reply, request)

    async def complete(run: _Run, reply: Reply, request: Request) -> Response:
        async def collect() -> None:
            while run.open:
                await run.next()

        work, gone = asyncio.create_task(collect()), asyncio.create_task(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client left: nobody reads the answer
                return Response(status_code=499)
            work.result()
        except EngineFailure as e:
            raise RequestError(str(e), None, status=e.status) from None
        finally:
            work.cancel()
            gone.cancel()
            run.cancel()
        choices = [reply.choice(i, text.sent, finish, stop_reason=reason)
                   for i, (text, finish, reason) in enumerate(zip(run.texts, run.finish, run.reasons))]
        return JSONResponse(reply.response(choices, run.usage()))

    async def stream(run: _Run, reply: Reply) -> AsyncIterator[str]:
        with_usage = run.plan.include_usage
        so_far = run.usage if run.plan.continuous_usage else lambda: None  # a chunk's usage
        try:
            if run.plan.chat:  # OpenAI's first chunk of each choice names the role
                for i in range(len(run.finish)):
                    first = reply.choice(i, "", None, delta=True, first=True)
                    yield _sse(reply.chunk([first], so_far(), with_usage))
            while run.open:
                got = await run.next()
                if got is not None and (got[1] or got[2] is not None):
                    choice = reply.choice(*got, delta=True, stop_reason=run.reasons[got[0]])
                    yield _sse(reply.chunk([choice], so_far(), with_usage))
            if with_usage:
                yield _sse(reply.chunk([], run.usage(), True))
        except EngineFailure as e:
            yield _sse(RequestError(str(e), None, status=e.status).body())
        finally:  # also when the client went away: Starlette cancels this generator then
            run.cancel()
        yield _sse("[DONE]")

    async def completions(request: Request) -> Response:
        return await generate(request, completion_plan)

    async def chat(request: Request) -> Response:
        return await generate(request, chat_plan)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [card]})

    async def model_card(request: Request) -> Response:
        if request.path_params["model"] != name:
            raise unknown_model(request.path_params["model"], served)
        return JSONResponse(card)

    async def health(request: Request) -> Response:
        return Response(status_code=200 if worker.alive else 503)

    async def metrics_text(request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def request_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestError)
        return _error(exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        """Starlette's own errors (an unknown path, a wrong method) in OpenAI's shape."""
        assert isinstance(exc, HTTPException)
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return _error(RequestError(message, None, status=exc.status_code), exc.headers)

    async def server_error(request: Request, exc: Exception) -> Response:
        """Any other exception: a 500 in OpenAI's shape (Starlette then logs the traceback)."""
        return _error(RequestError(f"internal server error: {type(exc).__name__}: {exc}", None, status=500))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)

    card = {"id": name, "object": "model", "created": int(time.time()), "owned_by": "specjax",
            "max_model_len": engine.max_len}
    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{model:path}", model_card, methods=["GET"]),  # names may have a "/"
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics_text, methods=["GET"])]
    handlers = {RequestError: request_error, HTTPException: http_error, Exception: server_error}
    cors = [Middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                       allow_headers=["*"])] if allowed_origins else []
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers, middleware=cors)
    app.state.worker = worker  # for `serve`, which cancels what still runs when its shutdown timeout runs out
    app.state.served = served  # and prints the request defaults taken from the model folder
    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (bound before the engine compiles, so a busy port is
    an error at once)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    return sock


def serve(engine: Engine, name: str, sock: socket.socket, per_request: dict | None = None, *,
          warmup: bool = True, shutdown_timeout: float = 30.0, allowed_origins: tuple[str, ...] = ("*",),
          generation_config: str = "auto") -> None:
    """Serve until SIGINT / SIGTERM on a socket from `bind`; with `warmup`, every step the
    engine may run is compiled first, so no request waits on a compilation. allowed_origins
    and generation_config: as `create_app`."""
    if warmup:
        print(f"compiling the engine's steps ({engine.max_batch} rows, max_len {engine.max_len}) ...",
              file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        engine.compile()
        print(f"compiled in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    prometheus_client.disable_created_metrics()  # `_created` samples would double the exposition
    app = create_app(engine, name, per_request, allowed_origins, generation_config)
    defaults = app.state.served.defaults
    if defaults:  # as vLLM says so: a client that leaves these out gets the model's, not vLLM's
        shown = ", ".join(f"{k} {v:g}" for k, v in defaults.items())
        print(f"request defaults from {engine.model.path / 'generation_config.json'}: {shown} "
              "(--generation-config vllm for vLLM's own)", file=sys.stderr, flush=True)
    host, port = sock.getsockname()[:2]
    print(f"serving {name!r} at http://{host}:{port}/v1", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=shutdown_timeout + CLOSE_GRACE,
                            log_level="info")
    _Server(config, shutdown_timeout, app.state.worker).run(sockets=[sock])


class _Server(uvicorn.Server):
    """uvicorn's server, whose first SIGINT / SIGTERM also starts the shutdown timeout's
    clock: when it runs out, the requests still running are cancelled, so that each ends
    with an error (a stream: an error event, then [DONE]) before uvicorn's own timeout,
    CLOSE_GRACE later, would cut its connection mid-body."""

    def __init__(self, config: uvicorn.Config, timeout: float, worker: EngineWorker):
        super().__init__(config)
        self.timer = threading.Timer(timeout, worker.cancel_all, args=(SHUTDOWN,))
        self.timer.daemon = True

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.timer.is_alive() and not self.timer.finished.is_set():
            self.timer.start()
        super().handle_exit(sig, frame)
