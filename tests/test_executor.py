"""Executor: where an execution runs (the Trio thread or a worker thread) and the device limiter."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import trio
from trio.testing import MockClock

from xlaserve.worker import executor as executor_module
from xlaserve.worker.executor import INLINE_BELOW_SECONDS, INLINE_WITH_BACKLOG_BELOW_SECONDS, Executor


class FakeClock:
    """The executor's ``time``: nanoseconds advance only when the fake device works, so a
    measurement never depends on how busy the machine running the tests is."""

    def __init__(self) -> None:
        self.ns = 0

    def perf_counter_ns(self) -> int:
        return self.ns


CLOCK = FakeClock()


class FakeDevice:
    def __init__(self, backend: str, seconds: float) -> None:
        self.backend = backend
        self.seconds = seconds
        self.threads: list[int] = []

    def execute(self, executable, arguments):
        self.threads.append(threading.get_ident())
        CLOCK.ns += round(self.seconds * 1e9)
        return [arguments[-1]]


@pytest.fixture(autouse=True)
def plain_batches(monkeypatch):
    monkeypatch.setattr(executor_module, "assemble", lambda model, requests, size: [r["x"] for r in requests])
    monkeypatch.setattr(executor_module, "split", lambda model, outputs, rows: tuple({"y": o} for o in outputs))
    monkeypatch.setattr(executor_module, "time", CLOCK)


MODEL = SimpleNamespace(modules={1: SimpleNamespace(executable=object())})


def _runs(backend: str, seconds: float, n: int = 3, backlog: bool = False) -> tuple[list[bool], list[bool]]:
    """(inline flag of each run, whether each ran on the Trio thread)."""
    device = FakeDevice(backend, seconds)

    async def main():
        ex = Executor(device, trio.CapacityLimiter(1))
        results = [await ex.run(MODEL, 1, (), [{"x": i}], [1], backlog=backlog) for i in range(n)]
        assert [r.per_request[0]["y"] for r in results] == list(range(n))
        return [r.inline for r in results], [t == threading.get_ident() for t in device.threads]
    return trio.run(main)


def test_first_run_goes_to_a_thread_then_short_ones_run_inline():
    inline, on_trio = _runs("cpu", 0.0001)
    assert inline == [False, True, True]
    assert on_trio == inline


def test_executions_over_the_backend_threshold_stay_on_a_thread():
    assert INLINE_BELOW_SECONDS["cpu"] > 0.002 > INLINE_BELOW_SECONDS["cuda"]
    assert _runs("cpu", 0.002) == ([False, True, True], [False, True, True])
    assert _runs("cuda", 0.002) == ([False, False, False], [False, False, False])
    assert _runs("cpu", INLINE_BELOW_SECONDS["cpu"] * 2, n=2) == ([False, False], [False, False])


def test_with_requests_waiting_only_short_executions_run_inline():
    """A backlog: a 2 ms execution goes to a thread (the frontend keeps receiving), a 0.1 ms one
    still runs inline (a hop would cost more than it)."""
    assert INLINE_WITH_BACKLOG_BELOW_SECONDS < 0.002 < INLINE_BELOW_SECONDS["cpu"]
    assert _runs("cpu", 0.002, backlog=True) == ([False, False, False], [False, False, False])
    assert _runs("cpu", 0.0001, backlog=True) == ([False, True, True], [False, True, True])


def test_an_inline_execution_waits_for_the_device_limiter():
    device = FakeDevice("cpu", 0.0)
    order: list[str] = []

    async def main():
        limiter = trio.CapacityLimiter(1)
        ex = Executor(device, limiter)
        await ex.run(MODEL, 1, (), [{"x": 0}], [1])       # measured: inline from now on

        copying = trio.Event()

        async def copy_weights():
            async with limiter:
                order.append("copy starts")
                copying.set()
                await trio.sleep(0.05)
                order.append("copy ends")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(copy_weights)
            await copying.wait()
            result = await ex.run(MODEL, 1, (), [{"x": 1}], [1])
            order.append("executed")
        assert result.inline
        assert limiter.borrowed_tokens == 0
    trio.run(main, clock=MockClock(autojump_threshold=0))
    assert order == ["copy starts", "copy ends", "executed"]


def test_versions_sharing_an_executable_share_its_measurement():
    """A catalog's fine-tuned variants share one executable (ExecutableTable): once one of them
    has run at a size, the others' first executions there are measured already and run inline;
    a model with its own executable is measured on its own."""
    shared = object()
    variants = [SimpleNamespace(modules={1: SimpleNamespace(executable=shared)}) for _ in range(3)]
    other = SimpleNamespace(modules={1: SimpleNamespace(executable=object())})
    device = FakeDevice("cpu", 0.0001)

    async def main():
        ex = Executor(device, trio.CapacityLimiter(1))
        return [(await ex.run(m, 1, (), [{"x": 0}], [1])).inline for m in (*variants, other, other)]
    assert trio.run(main) == [False, True, True, False, True]
