"""Prometheus metrics, one ``CollectorRegistry`` per app (so tests can run several apps in one
process without colliding in the global registry)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "rollout_http_requests",
            "HTTP requests by route, method and status code",
            ["route", "method", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "rollout_http_request_seconds",
            "HTTP request latency",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "rollout_prompt_tokens", "prompt tokens of served requests", registry=r
        )
        self.generation_tokens = Counter(
            "rollout_generation_tokens", "completion tokens generated", registry=r
        )
        self.samples = Counter(
            "rollout_samples", "completions by finish reason", ["finish_reason"], registry=r
        )
        self.tokens_per_second = Gauge(
            "rollout_generation_tokens_per_second",
            "completion tokens per second of the last generate request",
            registry=r,
        )
        self.in_flight = Gauge(
            "rollout_generate_in_flight", "generate requests being decoded", registry=r
        )
        self.waiting = Gauge(
            "rollout_generate_waiting",
            "generate requests queued behind a weight load or sleep",
            registry=r,
        )
        self.weight_version = Gauge("rollout_weight_version", "current weight version", registry=r)
        self.weight_updates = Counter(
            "rollout_weight_updates",
            "weight updates by transport and result",
            ["transport", "result"],
            registry=r,
        )
        self.weight_update_seconds = Histogram(
            "rollout_weight_update_seconds",
            "time generation was paused to load weights",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.weight_update_bytes = Counter(
            "rollout_weight_update_bytes", "bytes of weights loaded", registry=r
        )
        self.sleep_level = Gauge("rollout_sleep_level", "0 awake, 1 or 2 asleep", registry=r)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
