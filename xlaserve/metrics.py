"""Prometheus metrics of one worker, in a registry of its own (several workers may share a
process in tests). Metric names follow the node-file vocabulary."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("xlaserve_requests", "Inference requests answered, by model and gRPC status",
                                ["model", "status"], registry=r)
        self.request_seconds = Histogram("xlaserve_request_duration_seconds",
                                         "Time from receiving an inference request to answering it",
                                         ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.executions = Counter("xlaserve_executions", "Model executions on the device, by compiled batch size",
                                  ["model", "batch_size"], registry=r)
        self.batch_rows = Histogram("xlaserve_batch_rows", "Request rows coalesced into one execution",
                                    ["model"], buckets=_ROW_BUCKETS, registry=r)
        self.models = Gauge("xlaserve_models", "Models in the table, by state", ["state"], registry=r)

    def observe_request(self, model: str, status: str, seconds: float) -> None:
        self.requests.labels(model, status).inc()
        if status == "OK":
            self.request_seconds.labels(model).observe(seconds)

    def observe_execution(self, model: str, size: int, rows: int) -> None:
        self.executions.labels(model, str(size)).inc()
        self.batch_rows.labels(model).observe(rows)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
