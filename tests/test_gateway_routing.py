"""The gateway's pure parts: routing, the model-name peek, merging statistics and indexes."""
from __future__ import annotations

import math

import pytest
import trio
import trio.testing
from grpclib.const import Status

from xlaserve._proto import grpc_service_pb2 as pb
from xlaserve.gateway.router import ModelOnWorker, Router
from xlaserve.gateway.service import merge_index, merge_statistics, model_name_of
from xlaserve.gateway.upstream import Reply, grpc_timeout


def ready(*names: str, version: int = 1) -> list[ModelOnWorker]:
    return [ModelOnWorker(n, "READY", version) for n in names]


def test_round_robin_takes_the_ready_replicas_in_turn_and_skips_a_down_worker():
    router = Router(["w0", "w1", "w2"])
    router.worker_up("w0", ready("a", "b"))
    router.worker_up("w1", ready("a"))
    router.worker_up("w2", [ModelOnWorker("a", "LOADING", 2)])
    assert [router.pick("a") for _ in range(4)] == ["w0", "w1", "w0", "w1"]
    assert [router.pick("b") for _ in range(2)] == ["w0", "w0"]
    router.worker_down("w0")
    assert [router.pick("a") for _ in range(2)] == ["w1", "w1"]
    assert router.pick("b") is None
    assert router.why_not("b") == ("model 'b' is not served by any worker (w0: unreachable; w1: not in its "
                                   "repository; w2: not in its repository); models: a")


def test_least_outstanding_picks_the_fewest_in_flight_and_alternates_ties():
    outstanding = {"w0": 0, "w1": 0}
    router = Router(["w0", "w1"], "least_outstanding", outstanding=outstanding.__getitem__)
    for w in ("w0", "w1"):
        router.worker_up(w, ready("m"))
    assert [router.pick("m") for _ in range(4)] == ["w0", "w1", "w0", "w1"]
    outstanding["w0"] = 5
    assert [router.pick("m") for _ in range(3)] == ["w1", "w1", "w1"]
    outstanding["w1"] = 9
    assert router.pick("m") == "w0"


def test_a_model_known_but_not_ready_says_each_workers_state():
    router = Router(["w0", "w1"])
    router.worker_up("w0", [ModelOnWorker("m", "UNAVAILABLE", 0, "weights missing")])
    assert router.pick("m") is None
    assert router.why_not("m") == ("model 'm' is not ready on any worker (w0: UNAVAILABLE (weights missing); "
                                   "w1: unreachable)")


def test_unknown_modes_are_refused():
    with pytest.raises(ValueError, match="round_robin, least_outstanding"):
        Router(["w0"], "random")


def test_model_name_is_read_without_parsing_the_tensors():
    request = pb.ModelInferRequest(model_name="résumé", model_version="3", id="x")
    request.inputs.add(name="input", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(b"\0" * 16)
    assert model_name_of(request.SerializeToString()) == "résumé"
    # fields in any order: the name after the tensors
    tail = pb.ModelInferRequest(model_name="late").SerializeToString()
    head = pb.ModelInferRequest(raw_input_contents=[b"x" * 300], id="i").SerializeToString()
    assert model_name_of(head + tail) == "late"
    for garbage, why in ((b"", "no model_name"), (b"\x0a\x10ab", "past the end"), (b"\xff", "truncated varint"),
                         (b"\x0b", "wire type 3")):
        with pytest.raises(ValueError, match=why):
            model_name_of(garbage)
    # a flood of tiny fields before the name: not walked in Python to its end, parsed in C
    flood = b"\xa0\x06\x00" * 1_000_000
    assert model_name_of(flood + tail) == "late"
    with pytest.raises(ValueError, match="no model_name"):
        model_name_of(flood)
    with pytest.raises(ValueError):
        model_name_of(flood + b"\x0a\x10ab")


def _stats(count: int, ns: int, *, last: int, batches: dict[int, int]) -> pb.ModelStatistics:
    s = pb.ModelStatistics(name="m", version="1", last_inference=last, inference_count=count, execution_count=count)
    s.inference_stats.success.count, s.inference_stats.success.ns = count, ns
    s.inference_stats.queue.count, s.inference_stats.queue.ns = count, ns // 2
    for size, n in batches.items():
        b = s.batch_stats.add(batch_size=size)
        b.compute_infer.count, b.compute_infer.ns = n, n * 10
    return s


def test_statistics_of_the_replicas_are_summed():
    a = pb.ModelStatisticsResponse(model_stats=[_stats(3, 300, last=5, batches={1: 3})])
    b = pb.ModelStatisticsResponse(model_stats=[_stats(4, 400, last=9, batches={1: 2, 8: 1}),
                                                pb.ModelStatistics(name="other", version="2", inference_count=7)])
    merged = {(s.name, s.version): s for s in merge_statistics({"w0": a, "w1": b}).model_stats}
    m = merged[("m", "1")]
    assert (m.inference_count, m.execution_count, m.last_inference) == (7, 7, 9)
    assert (m.inference_stats.success.count, m.inference_stats.success.ns) == (7, 700)
    assert m.inference_stats.queue.ns == 350
    assert {b.batch_size: (b.compute_infer.count, b.compute_infer.ns) for b in m.batch_stats} == \
        {1: (5, 50), 8: (1, 10)}
    assert merged[("other", "2")].inference_count == 7


def test_the_index_is_ready_where_any_worker_is_and_names_each_workers_state():
    w0 = pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(name="m", version="2", state="READY"),
                                            pb.RepositoryIndexResponse.ModelIndex(name="x", version="1", state="READY")])
    w1 = pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(
        name="m", version="1", state="UNAVAILABLE", reason="bad weights")])
    merged = {m.name: m for m in merge_index({"w0": w0, "w1": w1}, {"w2": "connection refused"}).models}
    assert (merged["m"].state, merged["m"].version) == ("READY", "2")
    assert merged["m"].reason == ("w0: READY v2; w1: UNAVAILABLE v1 (bad weights); w2: unreachable "
                                  "(connection refused)")
    assert merged["x"].reason.startswith("w0: READY v1; w1: not in its repository")
    alone = merge_index({"w0": w0}, {}).models
    assert [m.reason for m in alone] == ["", ""]       # one worker, all agree: no reason


def test_reply_messages_and_timeouts_on_the_wire():
    assert Reply(0, "", b"\0\0\0\0\x02hi\0\0\0\0\x00").messages() == [b"hi", b""]
    assert grpc_timeout(0.0001) == "1m" and grpc_timeout(2.5) == "2500m" and grpc_timeout(1e6) == "1000000S"


def test_the_worker_is_told_a_clients_deadline_never_the_gateways_request_timeout():
    """Without a client deadline no grpc-timeout goes to the worker (an edf worker would order
    every request by the gateway's 60 s); the gateway still fails the call after its request
    timeout. A client's deadline is forwarded as what is left of it."""
    from types import SimpleNamespace

    from xlaserve.http2.hpack import Decoder
    from xlaserve.gateway.service import _time_left
    from xlaserve.gateway.upstream import Upstream

    async def main():
        upstream = Upstream("w", "127.0.0.1", 1, request_timeout=60.0)
        upstream.up = True
        upstream._reset_state()
        plain = upstream.start("/p", b"x", lambda outcome: None)
        timed = upstream.start("/p", b"x", lambda outcome: None, timeout=2.5)
        decode = Decoder(max_header_list_size=1 << 16).decode
        assert "grpc-timeout" not in dict(decode(plain.block))
        assert dict(decode(timed.block))["grpc-timeout"] == "2500m"
        assert plain.deadline == trio.current_time() + 60.0 and timed.deadline == trio.current_time() + 2.5
        assert upstream._timer_at == math.inf   # the timer task has not run yet: it is woken
    trio.run(main, clock=trio.testing.MockClock())
    assert _time_left(SimpleNamespace(deadline=None), 60.0) is None
    assert _time_left(SimpleNamespace(deadline=SimpleNamespace(time_remaining=lambda: 300.0)), 60.0) == 60.0
    assert _time_left(SimpleNamespace(deadline=SimpleNamespace(time_remaining=lambda: 1.5)), 60.0) == 1.5


def test_calls_with_the_request_timeout_expire_in_order_and_ended_ones_do_not_pile_up():
    """The usual timeout's deadlines are kept in start order; an unanswered call at the head
    must not keep every answered call behind it until its deadline."""
    from xlaserve.gateway.upstream import Upstream, UpstreamError

    async def main():
        upstream = Upstream("w", "127.0.0.1", 1, request_timeout=60.0)
        upstream.up = True
        upstream._reset_state()
        outcomes: dict[int, object] = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(upstream._timer_loop)
            stuck = upstream.start("/p", b"x", lambda o: outcomes.__setitem__(0, o))
            await trio.sleep(1)
            for i in range(1, 10_001):
                call = upstream.start("/p", b"x", lambda o, i=i: outcomes.__setitem__(i, o))
                upstream._give_up(call, UpstreamError(Status.CANCELLED, "answered"))
                upstream._h2.take_output()              # (a worker that reads what it is sent)
            assert len(upstream._in_order) <= 2 * upstream.outstanding + 2049
            late = upstream.start("/p", b"x", lambda o: outcomes.__setitem__(-1, o))
            await trio.sleep(58.5)
            assert 0 not in outcomes                     # at 59.5 s; it started at 0
            await trio.sleep(1)
            assert outcomes[0].status is Status.DEADLINE_EXCEEDED and stuck.done
            assert -1 not in outcomes                    # started 1 s later: due at 61 s
            await trio.sleep(1)
            assert outcomes[-1].status is Status.DEADLINE_EXCEEDED and late.done
            nursery.cancel_scope.cancel()
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_worker_pages_merge_into_one_exposition_with_a_worker_label():
    from prometheus_client.parser import text_string_to_metric_families

    from xlaserve.gateway.scrape import relabel
    a = ('# HELP xlaserve_requests Requests.\n# TYPE xlaserve_requests counter\n'
         'xlaserve_requests_total{model="m"} 3.0\n# HELP up Up.\n# TYPE up gauge\nup 1.0\n')
    b = ('# HELP xlaserve_requests Requests.\n# TYPE xlaserve_requests counter\n'
         'xlaserve_requests_total{model="m"} 4.0\nxlaserve_requests_total{model="n"} 1.0\n')
    page = relabel({"a": a, 'b"1': b})
    assert page.count("# TYPE xlaserve_requests counter") == 1
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(page) for s in f.samples}
    assert samples[("xlaserve_requests_total", (("model", "m"), ("worker", "a")))] == 3.0
    assert samples[("xlaserve_requests_total", (("model", "m"), ("worker", 'b"1')))] == 4.0
    assert samples[("xlaserve_requests_total", (("model", "n"), ("worker", 'b"1')))] == 1.0
    assert samples[("up", (("worker", "a"),))] == 1.0
    assert relabel({}) == ""


def test_a_worker_page_with_broken_lines_leaves_the_merged_page_valid():
    """A line that was not a valid sample (labels not name="value", a value that is no number,
    a worker label of its own) was passed on and made the gateway's whole /metrics page
    unparseable: Prometheus fails the scrape, the gateway's own metrics and every good worker's
    with it. Such lines are dropped; the valid ones stay."""
    from prometheus_client.parser import text_string_to_metric_families

    from xlaserve.gateway.scrape import relabel
    good = '# TYPE xlaserve_requests counter\nxlaserve_requests_total{model="m"} 3.0\n'
    broken = ('xlaserve_a{bad label} 1\nxlaserve_b hello\nxlaserve_c{worker="evil"} 1\nxlaserve_d 1 2 3\n'
              '<html><body>502 Bad Gateway</body></html>\nxlaserve_e{x="a\\"b",} +Inf 1700000000\n'
              'xlaserve_f{ } -1.5e3\n')
    page = relabel({"a": good, "b": broken})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(page) for s in f.samples}
    assert samples == {("xlaserve_requests_total", (("model", "m"), ("worker", "a"))): 3.0,
                       ("xlaserve_e", (("worker", "b"), ("x", 'a"b'))): float("inf"),
                       ("xlaserve_f", (("worker", "b"),)): -1500.0}
    assert "xlaserve_d" not in page and "evil" not in page


def test_a_worker_status_gRPC_does_not_define_is_unknown():
    from grpclib.const import Status

    from xlaserve.gateway.upstream import status_named
    assert status_named(5) is Status.NOT_FOUND and status_named(99) is Status.UNKNOWN


def test_ended_calls_do_not_pile_up_in_the_timer_heap():
    """Every call's timeout is a heap entry; calls answered long before their deadline must not
    keep their bytes (or their entries, past a bound) until it passes: at 5,000 requests/s and a
    60 s timeout that held 300,000 requests' bytes (the gateway's RSS grew 45 MB/s)."""
    from xlaserve.gateway.upstream import Upstream, _Call

    async def main():
        upstream = Upstream("w", "127.0.0.1", 1)
        answered = []
        for i in range(10_000):
            call = _Call(b"h", b"x" * 1000, answered.append, trio.current_time() + 60, None)
            upstream._timers.append((call.deadline, i, call))
            upstream.outstanding += 1
            upstream._finish(call, Reply(0, "", b""))
            assert call.data == b"" and call.on_done is None
        assert len(answered) == 10_000 and upstream.outstanding == 0
        assert len(upstream._timers) <= 2 * 1024 + 2
    trio.run(main)


def test_lpt_packing_places_a_model_once_it_is_ready_somewhere_and_spreads_by_size(monkeypatch):
    """A worker lists its whole start-up set at once, LOADING and without sizes; placing those
    as if they weighed nothing put every model on the first worker (lpt_packing then served Zipf
    traffic at round_robin's throughput). Only models ready somewhere, with their sizes, are placed."""
    from xlaserve.config import parse_gateway_config
    from xlaserve.gateway import run as gateway_run
    from xlaserve.gateway.run import Gateway, WorkerAddress

    config = parse_gateway_config({"endpoints": ["a:1", "b:2"], "scheduling": {"mode": "lpt_packing"}})
    gateway = Gateway([WorkerAddress("a", "127.0.0.1", 1), WorkerAddress("b", "127.0.0.1", 2)], config)
    enforced: list[dict] = []

    async def no_device_seconds():
        return {}

    async def enforce(workers):
        enforced.append(dict(gateway.placement.workers_of))
    monkeypatch.setattr(gateway, "_device_seconds", no_device_seconds)
    monkeypatch.setattr(gateway, "_enforce", enforce)
    names = [f"m{i}" for i in range(6)]
    sizes = {name: (i + 1) << 20 for i, name in enumerate(names)}

    def report(ready: set[str]) -> None:
        for worker in ("a", "b"):
            gateway._budgets[worker] = 100 << 20
            gateway.router.worker_up(worker, [ModelOnWorker(n, "READY" if n in ready else "LOADING", 1, "")
                                              for n in names])
        for name in ready:
            gateway._weight_bytes[name] = sizes[name]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            report(set())                                   # start-up: everything queued
            nursery.start_soon(gateway._placement_loop)
            await trio.sleep(3 * gateway_run.PLACEMENT_CHECK)
            assert gateway.placement is None and not enforced   # nothing ready: nothing placed
            report({"m0", "m1"})
            await trio.sleep(2 * gateway_run.PLACEMENT_CHECK)
            assert set(gateway.placement.workers_of) == {"m0", "m1"}
            report(set(names))
            await trio.sleep(2 * gateway_run.PLACEMENT_CHECK)
            nursery.cancel_scope.cancel()
        placed = gateway.placement.workers_of
        assert set(placed) == set(names) and all(len(ws) == 1 for ws in placed.values())
        on = {w: sum(sizes[m] for m, ws in placed.items() if w in ws) for w in ("a", "b")}
        assert on["a"] and on["b"] and abs(on["a"] - on["b"]) <= sizes["m5"], on   # spread by size
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
