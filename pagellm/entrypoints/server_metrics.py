"""The server's Prometheus metrics: the engine's stats read at scrape time, and per-request latency
histograms recorded as requests finish (summed across ``--api-server-count`` processes)."""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from pagellm.metrics import GAUGE, STAT_FIELDS
from pagellm.outputs import RequestOutput

_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_HISTOGRAMS = {"time_to_first_token_seconds": "Time to first token",
               "time_per_output_token_seconds": "Time per output token after the first",
               "e2e_request_latency_seconds": "Arrival to finish",
               "request_queue_time_seconds": "Arrival to first scheduling"}


class EngineCollector:
    """Gauges and counters read from the engine's stats at scrape time."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def collect(self):
        s = self.engine.get_stats_now()
        for f in STAT_FIELDS:  # every field pagellm.metrics exports, with its kind and help
            if f.prom is None:
                continue
            family = GaugeMetricFamily if f.kind == GAUGE else CounterMetricFamily
            value = getattr(getattr(s, f.group), f.name)
            if isinstance(value, list):  # one series per position
                m = family(f"pagellm:{f.prom}", f.doc, labels=["model_name", "position"])
                for i, v in enumerate(value):
                    m.add_metric([self.model_name, str(i)], v)
            else:
                m = family(f"pagellm:{f.prom}", f.doc, labels=["model_name"])
                m.add_metric([self.model_name], value)
            yield m


class ServerMetrics:
    """The registry ``GET /metrics`` answers from, and ``record`` for each finished request."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name))
        # With several API server processes (--api-server-count), each records its requests' latency
        # in prometheus_client's multiprocess files and any of them answers /metrics with the sum.
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        if self.multiprocess:
            MultiProcessCollector(self.registry)
        hist_registry = None if self.multiprocess else self.registry  # (multiprocess: read back from the files)
        self.hist = {k: Histogram(f"pagellm:{k}", doc, ["model_name"], registry=hist_registry, buckets=_BUCKETS)
                     for k, doc in _HISTOGRAMS.items()}

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def record(self, out: RequestOutput) -> None:
        m = out.metrics
        if m is None or m.finished_time is None:
            return
        label = self.model_name
        if m.first_token_time is not None:
            self.hist["time_to_first_token_seconds"].labels(label).observe(m.first_token_time - m.arrival_time)
            n_out = max(len(c.token_ids) for c in out.outputs) if out.outputs else 0
            if n_out > 1 and m.last_token_time is not None:
                self.hist["time_per_output_token_seconds"].labels(label).observe(
                    (m.last_token_time - m.first_token_time) / (n_out - 1))
        self.hist["e2e_request_latency_seconds"].labels(label).observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.hist["request_queue_time_seconds"].labels(label).observe(m.first_scheduled_time - m.arrival_time)
