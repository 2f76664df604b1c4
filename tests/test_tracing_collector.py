"""The OTLP exporter against a broken or hostile collector (a real socket on loopback): its
answer is read bounded in bytes and time, and shutdown does not wait on a collector that hangs."""
from __future__ import annotations

import socket
import threading
import time

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: E402
from opentelemetry.sdk.trace.export import SpanExportResult  # noqa: E402

from xlaserve.config import TracingConfig  # noqa: E402
from xlaserve.tracing import Tracing  # noqa: E402
from xlaserve.tracing.export import SpanExport, bounded_session  # noqa: E402


class Collector:
    """A fake collector on loopback: ``answer(conn)`` runs for each connection, after the request's
    headers were read (``None``: accept and never read)."""

    def __init__(self, answer) -> None:
        self.sent = 0
        self._answer = answer
        self._server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._server.getsockname()[1]}/v1/traces"
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            if self._answer is None:
                return
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            self._answer(self, conn)
        except OSError:
            pass

    def close(self) -> None:
        self._server.close()
        for conn in self._conns:
            conn.close()


def endless(collector: Collector, conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"x" * 65536
    while collector.sent < 1 << 30:
        conn.sendall(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        collector.sent += len(chunk)


def drip(collector: Collector, conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n")
    for _ in range(1000):
        conn.sendall(b"x")
        time.sleep(0.05)


def _export_in_thread(exporter, limit: float):
    result = []
    worker = threading.Thread(target=lambda: result.append(exporter.export([])), daemon=True)
    start = time.monotonic()
    worker.start()
    worker.join(limit)
    assert not worker.is_alive(), f"export still running after {limit}s"
    return result[0], time.monotonic() - start


@pytest.mark.parametrize("answer", [endless, drip], ids=["endless-body", "dripped-body"])
def test_a_collectors_endless_or_dripped_answer_is_cut_off_within_the_timeout(answer):
    """The attack: a collector that answers 200 and then a body that never ends, fast (requests
    read it all into memory: the worker grew by gigabytes) or a byte at a time (each read within
    requests' timeout, so the export never ended and shutdown waited on it forever)."""
    collector = Collector(answer)
    try:
        exporter = OTLPSpanExporter(endpoint=collector.endpoint, timeout=1.0, session=bounded_session())
        result, took = _export_in_thread(exporter, 10.0)
        assert result is SpanExportResult.SUCCESS       # the status was 200; the body is not read
        assert took < 3.0
        assert collector.sent < 64 << 20               # cut off, not read to the end
        exporter.shutdown()
    finally:
        collector.close()


def test_a_short_answer_is_read_and_the_connection_kept():
    def ok(collector: Collector, conn: socket.socket) -> None:
        while True:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            data = conn.recv(1 << 20)
            while data and b"\r\n\r\n" not in data:
                data += conn.recv(1 << 20)
            if not data:
                return
    collector = Collector(ok)
    try:
        exporter = OTLPSpanExporter(endpoint=collector.endpoint, timeout=2.0, session=bounded_session())
        for _ in range(3):
            assert _export_in_thread(exporter, 10.0)[0] is SpanExportResult.SUCCESS
        assert len(collector._conns) == 1
        exporter.shutdown()
    finally:
        collector.close()


def test_shutdown_waits_at_most_the_export_timeout_on_a_collector_that_never_reads(caplog):
    """The attack: a collector that accepts the connection and never reads. Each batch of the
    final export cost its whole timeout, one after the other (2,048 queued spans: seven batches,
    70 s at the default 10 s), so SIGTERM outlasted a Kubernetes grace period."""
    collector = Collector(None)
    try:
        config = TracingConfig(enabled=True, otlp_endpoint=collector.endpoint, otlp_timeout_seconds=0.5,
                               export_interval_seconds=60.0)
        export = SpanExport.from_config(config, "w")
        tracing = Tracing(1.0, export, config.max_queued_spans)
        export.start(tracing)
        for _ in range(400):
            tracing.start("r", {}, time.perf_counter_ns()).finish()
        start = time.monotonic()
        tracing.close()
        assert time.monotonic() - start < 2.0
        assert "were not exported" in caplog.text or "did not finish" in caplog.text
    finally:
        collector.close()
