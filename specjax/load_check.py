"""A load check of a running `specjax serve`: N clients each send completions back to back
for T seconds, then the figures: requests completed, errors, latency percentiles, aggregate
tokens/s, and the server's resident memory before and after (its /metrics process figures).

    python -m specjax.load_check --url http://127.0.0.1:8000 --clients 8 --seconds 60

Run it twice against one server to see whether memory grows from one run to the next.
Requests alternate between greedy and sampled (temperature 0.8, a seed per request) over
a few code prompts, max_tokens 16 .. --max-tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

PROMPTS = ("def fibonacci(n):", "class Stack:\n    def __init__(self):\n", "import os\n\ndef walk(path):",
           "def parse_args(argv):\n    \"\"\"", "for line in open(path):\n", "class LRUCache:\n")


def _get(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def server_figures(url: str) -> dict[str, float]:
    """The server's resident memory, pages in use and running requests, from /metrics."""
    wanted = {"process_resident_memory_bytes": "rss", "specjax:kv_cache_pages_in_use": "pages",
              "specjax:num_requests_running": "running"}
    out = {}
    for family in text_string_to_metric_families(_get(f"{url}/metrics", 30)):
        for sample in family.samples:
            if sample.name in wanted:
                out[wanted[sample.name]] = sample.value
    return out


def _client(url: str, model: str, index: int, until: float, max_tokens: int, timeout: float,
            latencies: list[float], tokens: list[int], errors: list[str]) -> None:
    rng = np.random.default_rng(index)
    i = 0
    while time.monotonic() < until:
        body = {"model": model, "prompt": PROMPTS[(index + i) % len(PROMPTS)],
                "max_tokens": int(rng.integers(16, max_tokens + 1)), "temperature": 0.0 if i % 2 else 0.8,
                "seed": int(rng.integers(1 << 31))}
        request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                reply = json.loads(r.read())
            latencies.append(time.perf_counter() - t0)
            tokens.append(reply["usage"]["completion_tokens"])
        except (urllib.error.URLError, OSError, KeyError, ValueError) as e:
            errors.append(f"{type(e).__name__}: {e}")
        i += 1


def run(url: str, clients: int, seconds: float, max_tokens: int = 64, timeout: float = 300.0) -> dict:
    """Run the check; returns its figures (also what `main` prints)."""
    model = json.loads(_get(f"{url}/v1/models", 30))["data"][0]["id"]
    before = server_figures(url)
    latencies: list[float] = []
    tokens: list[int] = []
    errors: list[str] = []
    start = time.monotonic()
    threads = [threading.Thread(target=_client, args=(url, model, c, start + seconds, max_tokens, timeout,
                                                      latencies, tokens, errors)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    after = server_figures(url)
    lat = np.array(latencies) if latencies else np.zeros(1)
    return {"clients": clients, "seconds": round(wall, 1), "completed": len(latencies), "errors": len(errors),
            "first_errors": errors[:3], "p50_s": float(np.percentile(lat, 50)), "p99_s": float(np.percentile(lat, 99)),
            "tokens": int(sum(tokens)), "tokens_per_s": sum(tokens) / wall,
            "rss_before_mib": before["rss"] / 2 ** 20, "rss_after_mib": after["rss"] / 2 ** 20,
            "pages_in_use_after": after["pages"], "running_after": after["running"]}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specjax.load_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=64, help="each request asks for 16 .. this many tokens")
    args = p.parse_args(argv)
    if args.clients < 1 or args.seconds <= 0 or args.max_tokens < 16:
        p.error("--clients must be >= 1, --seconds > 0 and --max-tokens >= 16")
    r = run(args.url.rstrip("/"), args.clients, args.seconds, args.max_tokens)
    print(f"{r['clients']} clients, {r['seconds']} s: {r['completed']} requests completed, {r['errors']} errors; "
          f"latency p50 {r['p50_s']:.2f} s, p99 {r['p99_s']:.2f} s; {r['tokens']} tokens, "
          f"{r['tokens_per_s']:.1f} tokens/s aggregate; server RSS {r['rss_before_mib']:.0f} -> "
          f"{r['rss_after_mib']:.0f} MiB; after: {r['running_after']:.0f} running, "
          f"{r['pages_in_use_after']:.0f} pages in use")
    for e in r["first_errors"]:
        print(f"error: {e}", file=sys.stderr)
    return 1 if r["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
