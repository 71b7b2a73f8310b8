"""The server's Prometheus metrics, under vLLM's names with the `specjax:` prefix where
vLLM has the metric (its list: vllm's `vllm/v1/metrics/loggers.py`), so dashboards built for
vLLM read them. Counters get prometheus_client's `_total` suffix, as vLLM's do.

Speculation, per engine round of each request (a row's (drafts, accepted) pair, which
`Engine` records in `Request.stats`): `spec_decode_num_drafts` counts rounds that drafted,
`..._num_draft_tokens` the drafts, `..._num_accepted_tokens` those accepted, and
`..._num_accepted_tokens_per_pos{position=i}` the rounds whose draft i (0-based) was
accepted, so position i's acceptance rate is per_pos[i] / num_drafts as in vLLM.

Every value is set on the engine thread; prometheus_client's metrics are thread-safe, and
`render` reads them on the server's.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from .engine import Engine

PREFIX = "specjax:"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    """One registry per server (the process's resident memory and CPU time included, from
    prometheus_client's process collector), labelled with the served model's name."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.model_name = model_name

        def child(kind, name: str, doc: str, **kw):
            """The metric's child for this server's model."""
            return kind(PREFIX + name, doc, ["model_name"], registry=self.registry, **kw).labels(model_name)

        def family(name: str, doc: str, label: str) -> Counter:
            return Counter(PREFIX + name, doc, ["model_name", label], registry=self.registry)

        self.running = child(Gauge, "num_requests_running", "Requests in the engine's batch.")
        self.waiting = child(Gauge, "num_requests_waiting", "Requests queued for a row and their pages.")
        self.kv_usage = child(Gauge, "kv_cache_usage_perc", "KV-cache pages in use, 1 means 100 percent.")
        self.pages_in_use = child(Gauge, "kv_cache_pages_in_use", "KV-cache pages owned by sequences.")
        self.pages_reserved = child(Gauge, "kv_cache_pages_reserved",
                                    "KV-cache pages promised to admitted sequences, not yet taken.")
        self.pages_total = child(Gauge, "kv_cache_pages_total", "KV-cache pages sequences can own.")
        self.prompt_tokens = child(Counter, "prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = child(Counter, "generation_tokens", "Tokens generated.")
        self._success = family("request_success", "Finished requests, by finish reason.", "finished_reason")
        self.drafts = child(Counter, "spec_decode_num_drafts", "Engine rounds of a request that drafted.")
        self.draft_tokens = child(Counter, "spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.accepted = child(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._per_pos = family("spec_decode_num_accepted_tokens_per_pos",
                               "Rounds whose draft at this position (0-based) was accepted.", "position")
        self.ttft = child(Histogram, "time_to_first_token_seconds",
                          "From a request's arrival to its first token.", buckets=TTFT_BUCKETS)
        self.itl = child(Histogram, "inter_token_latency_seconds",
                         "Between successive deliveries of a request's tokens (one per engine step that "
                         "committed some: a step runs several rounds).", buckets=ITL_BUCKETS)
        self.e2e = child(Histogram, "e2e_request_latency_seconds",
                         "From a request's arrival to its end.", buckets=E2E_BUCKETS)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    # ------------------------------------------------------------ engine thread
    def engine_state(self, engine: Engine) -> None:
        pages = engine.pages
        self.running.set(len(engine.running))
        self.waiting.set(len(engine.queue))
        self.pages_in_use.set(pages.in_use)
        self.pages_reserved.set(pages.reserved)
        self.pages_total.set(pages.usable)
        self.kv_usage.set(pages.in_use / pages.usable)

    def admitted(self, prompt_lengths: Sequence[int]) -> None:
        self.prompt_tokens.inc(sum(prompt_lengths))

    def first_token(self, seconds: float, tokens: int) -> None:
        self.ttft.observe(seconds)
        self.generation_tokens.inc(tokens)

    def later_tokens(self, seconds: float, tokens: int) -> None:
        self.itl.observe(seconds)
        self.generation_tokens.inc(tokens)

    def rounds(self, drafts: Sequence[int], accepted: Sequence[int]) -> None:
        """Add a request's rounds: (drafts judged, drafts accepted) per round."""
        for k, a in zip(drafts, accepted):
            if k == 0:
                continue
            self.drafts.inc()
            self.draft_tokens.inc(k)
            self.accepted.inc(a)
            for position in range(a):
                self._per_pos.labels(self.model_name, str(position)).inc()

    def finished(self, reason: str, seconds: float) -> None:
        self._success.labels(self.model_name, reason).inc()
        self.e2e.observe(seconds)
