"""/metrics under a flood of scrapes: the worker's page and the gateway's are rendered anew only
while renders have taken at most 1/(1 + REUSE_FACTOR) of the Trio thread (after a short burst);
otherwise the last page is served again (xlaserve/admin.py ``reused``). The gateway merges its
workers' pages again only when a scrape brought a new one. Rendered one per scrape, ~700
scrapes/s cut a worker's mlp throughput from ~5 000 to ~800 req/s (the render runs on the Trio
thread that serves inference). Under Trio's MockClock: a render's time is a jump of the clock
inside it, so every bound is exact."""
from __future__ import annotations

import pytest
import trio
from trio.testing import MockClock

from xlaserve.admin import REUSE_BURST_SECONDS, REUSE_FACTOR, reused
from xlaserve.app.compose import _health
from xlaserve.metrics import Metrics
from xlaserve.worker.registry import ModelTable

RENDER = 0.01       # seconds a render takes here (the clock jumps by it inside the render)


def _run(main) -> None:
    trio.run(main, clock=MockClock(autojump_threshold=0))


def test_a_flood_of_scrapes_of_a_worker_costs_a_tenth_of_its_thread_and_a_lone_scrape_sees_now():
    metrics, rendered = Metrics(), []
    exposition = metrics.exposition

    def render() -> bytes:
        rendered.append(trio.current_time())
        trio.lowlevel.current_clock().jump(RENDER)
        return exposition()
    metrics.exposition = render
    page = _health(None, ModelTable(), metrics)["/metrics"]     # config is read by /readyz only

    async def main() -> None:
        start = trio.current_time()
        for i in range(1000):                   # 1000 scrapes a second, for a second
            if i == 500:
                metrics.requests_in_flight.set(7)
                changed = trio.current_time()
            if b"xlaserve_requests_in_flight 7.0" in page()[2] and i >= 500:
                seen = trio.current_time()
                break
            await trio.sleep(0.001)
        else:
            raise AssertionError("the flood never saw the new value")
        assert seen - changed <= REUSE_FACTOR * RENDER + RENDER          # at most ten renders old
        flood = trio.current_time() - start
        # the burst, then at most one part in 1 + REUSE_FACTOR of the time
        assert len(rendered) * RENDER <= REUSE_BURST_SECONDS + RENDER + flood / (1 + REUSE_FACTOR), len(rendered)
        await trio.sleep(1.0)
        metrics.requests_in_flight.set(8)
        assert b"xlaserve_requests_in_flight 8.0" in page()[2]          # a scrape after a quiet spell: now
        metrics.requests_in_flight.set(9)
        assert b"xlaserve_requests_in_flight 9.0" in page()[2]          # and the next one too (the burst)
    _run(main)


def test_a_route_is_rendered_fresh_through_the_burst_then_kept_until_its_debt_drains_and_not_when_it_raised():
    calls = []

    def route():
        calls.append(trio.current_time())
        trio.lowlevel.current_clock().jump(RENDER)
        if len(calls) == 4:
            raise RuntimeError("render failed")
        return 200, "text/plain", str(len(calls)).encode()
    kept = reused(route, factor=10, burst=0.015)

    async def main() -> None:
        assert kept()[2] == b"1" and kept()[2] == b"2"      # owed 0.01, then 0.02 > the burst
        assert kept()[2] == b"2"
        await trio.sleep(0.04)                  # drains 0.004: still owes more than the burst
        assert kept()[2] == b"2"
        await trio.sleep(0.011)                 # 0.0051 drained in all: owes under the burst
        assert kept()[2] == b"3"
        await trio.sleep(1.0)
        with pytest.raises(RuntimeError):
            kept()
        assert kept()[2] == b"5"                # a failed render is not kept: the next one runs
    _run(main)


def test_the_gateway_merges_worker_pages_again_only_when_a_scrape_brought_a_new_one(monkeypatch):
    from xlaserve.config import parse_gateway_config
    from xlaserve.gateway import scrape
    from xlaserve.gateway.run import Gateway, WorkerAddress

    config = parse_gateway_config({"endpoints": ["a:1"], "metrics_endpoints": ["a:2"]})
    gateway = Gateway([WorkerAddress("a", "127.0.0.1", 1)], config)
    merges = []

    def relabel(pages):
        merges.append(dict(pages))
        trio.lowlevel.current_clock().jump(RENDER)
        return real(pages)
    real = scrape.relabel
    monkeypatch.setattr(scrape, "relabel", relabel)
    page = gateway.routes()["/metrics"]

    async def main() -> None:
        gateway._scraped["a"] = "xlaserve_requests_total 1.0\n"
        for _ in range(50):
            assert b'xlaserve_requests_total{worker="a"} 1.0' in page()[2]
            await trio.sleep(0.01)              # 0.5 s: many times the window
        assert len(merges) == 1                 # the same worker page: merged once
        gateway._scraped["a"] = "xlaserve_requests_total 2.0\n"     # the next scrape of the worker
        await trio.sleep(1.0)
        assert b'xlaserve_requests_total{worker="a"} 2.0' in page()[2] and len(merges) == 2
        del gateway._scraped["a"]               # the worker cannot be scraped: it drops out
        await trio.sleep(1.0)
        assert b'worker="a"} 2.0' not in page()[2]
    _run(main)
