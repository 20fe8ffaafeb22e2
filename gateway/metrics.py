"""Prometheus metrics, one registry per app so several gateways can live in one process (tests)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_COMMIT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1)


class Metrics:
    def __init__(self, queue_depth: Callable[[], float]) -> None:
        self.registry = CollectorRegistry()
        self._private = CollectorRegistry()  # figures for the operator alone (see watch_prefix_caches)
        r = self.registry
        # model: the served name a request was routed to, without an adapter's version (versions come and go);
        # backend: its backend. Both empty for a request never routed, so made-up model names add no series.
        self.requests = Counter("harness_requests", "HTTP requests handled.", ["route", "status", "model", "backend"],
                                registry=r)
        self.latency = Histogram("harness_request_latency_seconds", "Time from request to last byte.",
                                 ["route", "model", "backend"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("harness_time_to_first_token_seconds",
                              "Streamed requests: time to the first generated content or tool-call token.",
                              ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("harness_tokens", "Tokens processed.", ["model", "kind"], registry=r)
        self.errors = Counter("harness_errors", "Errors returned, by OpenAI error type.", ["type"], registry=r)
        self.queue_depth = Gauge("harness_store_queue_depth", "Records waiting for the store writer.",
                                 registry=r)
        self.queue_depth.set_function(queue_depth)
        self.commit_latency = Histogram("harness_store_commit_seconds", "Time to write and commit one batch.",
                                        buckets=_COMMIT_BUCKETS, registry=r)
        self.commit_batch = Histogram("harness_store_commit_batch_size", "Records per committed batch.",
                                      buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r)

    def watch_prefix_caches(self, backends: Iterable[Any]) -> None:
        """Export the embedded backends' prefix-cache counters (``prefix_stats``), read when scraped, to readers
        who may see every tenant's (``render(private=True)``): they move with each request's cache hits, which
        would tell one tenant how much of another's prompt was cached."""
        self._private.register(_PrefixCaches(list(backends)))

    def count_tokens(self, model: str, prompt: int, completion: int) -> None:
        """Tokens a model call used: every call, a guard's retries and an agent's steps and summaries alike."""
        if prompt:
            self.tokens.labels(_served(model), "prompt").inc(prompt)
        if completion:
            self.tokens.labels(_served(model), "completion").inc(completion)

    def observe_request(self, route: str, status: int, model: str, backend: str, seconds: float) -> None:
        model = _served(model) if backend else ""
        self.requests.labels(route, str(status), model, backend).inc()
        self.latency.labels(route, model, backend).observe(seconds)

    def observe_commit(self, batch: int, seconds: float) -> None:
        self.commit_latency.observe(seconds)
        self.commit_batch.observe(batch)

    def render(self, *, private: bool = False) -> bytes:
        public = generate_latest(self.registry)
        return public + generate_latest(self._private) if private else public


def _served(model: str) -> str:
    """A model's series name: an adapter's versions come and go, so they are folded into its name."""
    return model.partition("@")[0]


class _PrefixCaches:
    """A collector over every backend with a prefix cache (the embedded model's)."""

    _COUNTERS = (("hits", "Requests whose prompt started with cached keys and values."),
                 ("misses", "Requests prefilled from the start."),
                 ("prefill_computed", "Prompt tokens run through the model."),
                 ("prefill_saved", "Prompt tokens taken from the prefix cache instead."),
                 ("evictions", "Prefix-cache entries evicted to stay within the budget."))
    _GAUGES = (("entries", "Prefix-cache entries held."), ("bytes", "Bytes of keys and values the prefix cache holds."))

    def __init__(self, backends: list[Any]) -> None:
        self.backends = backends

    def collect(self) -> Iterator[Metric]:
        found = [(b.name, stats) for b in self.backends if (stats := getattr(b, "prefix_stats", None)) is not None]
        for name, help_text in self._COUNTERS:
            family = CounterMetricFamily(f"harness_prefix_cache_{name}", help_text, labels=["backend"])
            for backend, stats in found:
                family.add_metric([backend], getattr(stats, name))
            yield family
        for name, help_text in self._GAUGES:
            family = GaugeMetricFamily(f"harness_prefix_cache_{name}", help_text, labels=["backend"])
            for backend, stats in found:
                family.add_metric([backend], getattr(stats, name))
            yield family
