"""Prometheus metrics for /metrics: every `vlserve:` counter/gauge of the engine, plus latency histograms
(TTFT, inter-token, end-to-end) and request counters, in a registry of their own."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
_E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
_ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/version", "/metrics"}


class _EngineCollector(Collector):
    """Reads the engine's `get_metrics()` dict at scrape time: `*_total` become counters, the rest gauges.

    With data-parallel replicas those are the sums over the replicas (usage fractions averaged), and each engine's
    own values come as `vlserve:replica:<name>{engine="i"}` families beside them."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        metrics = dict(self.engine.get_metrics())
        metrics["vlserve:num_aborted_requests_total"] = getattr(self.engine, "num_aborted", 0)
        yield from self._families(metrics)
        replicas = getattr(self.engine, "get_replica_metrics", lambda: [])()
        if len(replicas) > 1:
            yield from _replica_families(replicas)

    def _families(self, metrics: dict[str, float]):
        labelled: dict[str, list[tuple[str, str, float]]] = {}  # name -> (label, value, metric) for `name{l="v"}`
        for key, value in sorted(metrics.items()):
            name, brace, labels = key.partition("{")
            if brace:
                label, _, label_value = labels.rstrip("}").partition("=")
                labelled.setdefault(name, []).append((label, label_value.strip('"'), float(value)))
                continue
            doc = f"vlserve engine metric {name}"
            if name.endswith("_total"):
                yield CounterMetricFamily(name, doc, value=float(value))
            else:
                yield GaugeMetricFamily(name, doc, value=float(value))
        for name, rows in labelled.items():
            family = CounterMetricFamily(name, f"vlserve engine metric {name}", labels=[rows[0][0]])
            for _, label_value, value in rows:
                family.add_metric([label_value], value)
            yield family


def _replica_families(replicas: list[dict[str, float]]):
    """`vlserve:replica:<name>{engine="i"[, its own label]}` for every engine counter of every replica."""
    families: dict[str, tuple[object, list[str]]] = {}
    for engine_index, metrics in enumerate(replicas):
        for key, value in sorted(metrics.items()):
            base, brace, labels = key.partition("{")
            name = "vlserve:replica:" + base.removeprefix("vlserve:")
            label_names, label_values = ["engine"], [str(engine_index)]
            if brace:
                label, _, label_value = labels.rstrip("}").partition("=")
                label_names.append(label)
                label_values.append(label_value.strip('"'))
            if name not in families:
                kind = CounterMetricFamily if name.endswith("_total") else GaugeMetricFamily
                families[name] = (
                    kind(name, f"vlserve engine metric {base}, per data-parallel replica", labels=label_names),
                    label_names,
                )
            family, names = families[name]
            if names == label_names:
                family.add_metric(label_values, float(value))
    for family, _ in families.values():
        yield family


class ServerMetrics:
    """The /metrics registry. Registered as a stats listener on the AsyncLLM (called from its engine thread)."""

    def __init__(self, engine):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine))
        r = self.registry
        self.ttft = Histogram(
            "vlserve:time_to_first_token_seconds",
            "Time from arrival to the first output token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vlserve:inter_token_latency_seconds",
            "Time between successive output tokens.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vlserve:e2e_request_latency_seconds",
            "Time from arrival to the end of a request.",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.request_success = Counter(
            "vlserve:request_success", "Requests that ended, by finish reason.", ["finished_reason"], registry=r
        )
        self.request_prompt_tokens = Counter(
            "vlserve:request_prompt_tokens", "Prompt tokens of ended requests.", registry=r
        )
        self.request_generation_tokens = Counter(
            "vlserve:request_generation_tokens", "Output tokens of ended requests.", registry=r
        )
        self.http_requests = Counter(
            "vlserve:http_requests", "HTTP requests by endpoint and status code.", ["endpoint", "status"], registry=r
        )
        engine.add_stats_listener(self)

    # StatsListener (engine thread) -------------------------------------------------------------------------------
    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def on_finished(self, finish_reason: str, e2e_seconds: float, prompt_tokens: int, output_tokens: int) -> None:
        self.request_success.labels(finished_reason=finish_reason).inc()
        self.e2e.observe(e2e_seconds)
        self.request_prompt_tokens.inc(prompt_tokens)
        self.request_generation_tokens.inc(output_tokens)

    # HTTP ----------------------------------------------------------------------------------------------------------
    def count_http(self, path: str, status: int) -> None:
        """Count one HTTP response (unknown paths are folded into "other" to bound label cardinality)."""
        self.http_requests.labels(endpoint=path if path in _ENDPOINTS else "other", status=str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
