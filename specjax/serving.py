"""The engine thread of `specjax serve`: one thread owns the batched `Engine` (which is not
thread-safe) and every request of every client goes into it, so concurrent clients share
its device calls (continuous batching).

The thread's loop: take submissions and cancellations from a thread-safe queue (blocking
while the engine is idle), run `engine.step()` while it has work, and post each request's
new tokens to whoever submitted it through the `post` callback the submitter gave (the
server passes one that hands events to its asyncio loop with `call_soon_threadsafe`).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Sequence

from .engine import Engine, Request
from .metrics import ServerMetrics
from .pages import PoolError
from .results import GenerationError
from .sampling import Sampling


@dataclasses.dataclass(frozen=True)
class Submission:
    """One engine request: a prompt and its settings (`Engine.submit`'s arguments)."""

    ids: Sequence[int]
    max_new_tokens: int
    sampling: Sampling
    seed: int
    stop_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Admitted:
    """Every submission of a ticket was accepted by the engine (sent before any tokens)."""


@dataclasses.dataclass(frozen=True)
class Refused:
    """The engine refused one submission of a ticket; none of them runs."""

    index: int
    error: GenerationError | PoolError


@dataclasses.dataclass(frozen=True)
class Tokens:
    """Tokens submission `index` committed; `finish` once it is over: "stop" (a stop id),
    "length" (max_new_tokens), or the reason it was cancelled with."""

    index: int
    tokens: list[int]
    finish: str | None = None


@dataclasses.dataclass(frozen=True)
class Failed:
    """The engine failed while running submission `index` (it is over)."""

    index: int
    message: str


Event = Admitted | Refused | Tokens | Failed


class Ticket:
    """What one client request submits together (n choices, several prompts) and the
    callback its events go to; `post` is called on the engine thread and must not block."""

    def __init__(self, submissions: Sequence[Submission], post: Callable[[Event], None]):
        if not submissions:
            raise ValueError("a ticket needs at least one submission")
        self.submissions, self.post = list(submissions), post
        self.arrived = time.perf_counter()


@dataclasses.dataclass
class _Running:
    """The engine thread's view of one running submission."""

    ticket: Ticket
    index: int
    request: Request
    last_token_at: float | None = None
    counted_steps: int = 0  # entries of request.stats already added to the metrics


class ShuttingDown(RuntimeError):
    """A submission after the engine thread was told to stop."""


class EngineWorker:
    """The thread that owns `engine` (module docstring). `submit` and `cancel` may be called
    from any thread; `per_request` are extra `Engine.submit` keywords for every request
    (what `engine_options` says the proposer needs)."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, per_request: dict | None = None):
        self.engine, self.metrics, self.per_request = engine, metrics, dict(per_request or {})
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._running: dict[Request, _Running] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="specjax-engine", daemon=True)

    # ------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, ticket: Ticket) -> None:
        """Queue a ticket; its first event is `Admitted`, `Refused` or `Failed`."""
        if self._stopping.is_set():
            raise ShuttingDown("the server is shutting down")
        self._commands.put(("submit", ticket, None, None))

    def cancel(self, ticket: Ticket, index: int | None = None, reason: str = "abort") -> None:
        """Cancel submission `index` of a ticket (all of them for None) if still running;
        its pages return to the pool. `reason` is its finish reason in the metrics."""
        self._commands.put(("cancel", ticket, index, reason))

    def cancel_all(self, reason: str) -> None:
        """Cancel every running submission of every ticket, each told `reason`."""
        self._commands.put(("cancel", None, None, reason))

    def stop(self, timeout: float | None = None) -> None:
        """Cancel everything running and end the thread (after its current step)."""
        self._stopping.set()
        self._commands.put(("stop", None, None, None))
        self._thread.join(timeout)

    # ------------------------------------------------------------ the engine thread
    def _loop(self) -> None:
        while True:
            if not self._take_commands(block=not self.engine.has_work()):
                return
            if self.engine.has_work():
                self._step()
            self.metrics.engine_state(self.engine)

    def _take_commands(self, block: bool) -> bool:
        """Apply the queued commands (waiting for one if `block`); False on stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            kind, ticket, index, reason = command
            if kind == "stop":
                for run in list(self._running.values()):
                    self._cancel(run, "abort")
                return False
            if kind == "submit":
                self._submit(ticket)
            else:
                for run in [r for r in self._running.values()
                            if ticket in (None, r.ticket) and index in (None, r.index)]:
                    self._cancel(run, reason)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _submit(self, ticket: Ticket) -> None:
        started: list[_Running] = []
        for i, sub in enumerate(ticket.submissions):
            try:
                req = self.engine.submit(sub.ids, max_new_tokens=sub.max_new_tokens, sampling=sub.sampling,
                                         seed=sub.seed, stop_ids=sub.stop_ids, **self.per_request)
            except Exception as e:  # the client's error (Refused) or the engine's (Failed); none of it runs
                for run in started:
                    self.engine.cancel(run.request)
                    del self._running[run.request]
                bad_input = isinstance(e, (GenerationError, PoolError))
                ticket.post(Refused(i, e) if bad_input else Failed(i, f"{type(e).__name__}: {e}"))
                return
            run = _Running(ticket, i, req)
            self._running[req] = run
            started.append(run)
        self.metrics.admitted([len(sub.ids) for sub in ticket.submissions])
        ticket.post(Admitted())

    def _cancel(self, run: _Running, reason: str) -> None:
        self.engine.cancel(run.request)
        self._done(run, reason)
        run.ticket.post(Tokens(run.index, [], reason))

    def _step(self) -> None:
        try:
            new = self.engine.step()
        except Exception as e:  # reported to the clients; the server keeps serving
            # the engine has finished the requests of the failed call; the others in a row
            # may be half-done (a prefill chunk), so they are cancelled and reported too
            for run in list(self._running.values()):
                if run.request.done or run.request.slot is not None:
                    self.engine.cancel(run.request)
                    self._done(run, "error")
                    run.ticket.post(Failed(run.index, f"{type(e).__name__}: {e}"))
            return
        now = time.perf_counter()
        for req, tokens in new.items():
            run = self._running.get(req)
            if run is None:
                continue
            if tokens:
                if run.last_token_at is None:
                    self.metrics.first_token(now - run.ticket.arrived, len(tokens))
                else:
                    self.metrics.later_tokens(now - run.last_token_at, len(tokens))
                run.last_token_at = now
            if req.error is not None:  # this request alone failed (NaN logits); the others go on
                self._done(run, "error")
                run.ticket.post(Failed(run.index, f"{type(req.error).__name__}: {req.error}"))
                continue
            finish = ("stop" if req.stopped else "length") if req.done else None
            if finish is not None:
                self._done(run, finish)
            else:
                self._count_rounds(run)
            run.ticket.post(Tokens(run.index, list(tokens), finish))

    def _count_rounds(self, run: _Running) -> None:
        stats = run.request.stats
        self.metrics.rounds(stats.ks[run.counted_steps:], stats.accepts[run.counted_steps:])
        run.counted_steps = len(stats.ks)

    def _done(self, run: _Running, reason: str) -> None:
        self._count_rounds(run)
        del self._running[run.request]
        self.metrics.finished(reason, time.perf_counter() - run.ticket.arrived)
