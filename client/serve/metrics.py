"""Prometheus metrics of a kvpool serve process (``/metrics``)."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    """Reads the engine's queue lengths and counters at scrape time; ``waiting()`` is the queue's length."""

    def __init__(self, engine, waiting: Callable[[], int]) -> None:
        self.engine, self.waiting = engine, waiting

    def collect(self):
        s = self.engine.stats()
        for name, doc, value in (
            ("kvpool_serve_requests_waiting",
             "requests not yet in the batch: being tokenized or queued (the queue length)", self.waiting()),
            ("kvpool_serve_requests_running", "requests in the running batch", s.running),
            ("kvpool_serve_requests_swapped", "requests preempted to the host tier", s.swapped),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (
            ("kvpool_serve_preemptions", "running requests preempted because the pool was full", s.preemptions),
            ("kvpool_serve_swaps", "preemptions by swap to the host tier", s.swaps),
            ("kvpool_serve_recomputes", "preemptions by freeing (recomputed when resumed)", s.recomputes),
            ("kvpool_serve_prefix_hit_tokens", "prompt tokens found in the pool (prefill skipped)", s.prefix_hit_tokens),
            ("kvpool_serve_prompt_tokens", "prompt tokens received", s.prompt_tokens),
            ("kvpool_serve_generation_tokens", "tokens generated", s.generation_tokens),
            ("kvpool_serve_steps", "engine steps run", s.steps),
        ):
            yield CounterMetricFamily(name, doc, value=value)


class ServeMetrics:
    """The registry behind ``/metrics``: latency histograms observed per request, engine figures per scrape
    (``waiting()``: the requests not yet in the batch, those being tokenized included)."""

    def __init__(self, engine, waiting: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, waiting))
        self.ttft = Histogram("kvpool_serve_time_to_first_token_seconds", "arrival to first token",
                              buckets=_LATENCY, registry=self.registry)
        self.tpot = Histogram("kvpool_serve_time_per_output_token_seconds", "mean time between later tokens",
                              buckets=_LATENCY, registry=self.registry)
        self.e2e = Histogram("kvpool_serve_request_seconds", "arrival to the last token",
                             buckets=_LATENCY, registry=self.registry)
        self.finished = Counter("kvpool_serve_requests_finished", "requests ended, by finish reason",
                                ["finish_reason"], registry=self.registry)

    def observe(self, out, seconds: float) -> None:
        """Record a finished request's final ``RequestOutput`` (``seconds``: its whole time)."""
        if out.time_to_first_token is not None:
            self.ttft.observe(out.time_to_first_token)
        if out.time_per_output_token is not None:
            self.tpot.observe(out.time_per_output_token)
        self.e2e.observe(seconds)
        self.finished.labels(out.finish_reason or "none").inc()
