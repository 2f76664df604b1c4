"""The scheduler's policies on a fake device, under Trio's MockClock: every timing is exact."""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
import pytest
import trio
from trio.testing import MockClock

from xlaserve.config import ModelSchedConfig, SchedulerConfig
from xlaserve.errors import Cancelled, DeadlineExceeded, InternalError, ModelNotReady, QueueFull, Unavailable
from xlaserve.metrics import Metrics
from xlaserve.tracing import Tracing
from xlaserve.worker.executor import BatchResult
from xlaserve.worker.messages import CancelRequest, DropModel, InferRequest, InferResult
from xlaserve.worker.policy import Candidate, CostModel, DeficitRoundRobin, EdfPolicy, FifoPolicy
from xlaserve.worker.scheduler import Scheduler
from xlaserve.worker.stats import StatsBook


@dataclass(frozen=True, eq=False)
class FakeModel:
    name: str
    compiled_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    version: int = 1
    weight_bytes: int = 0
    weights: object = None


@dataclass
class FakeDevice:
    """Executes by sleeping on the Trio clock: ``cost[model](size)`` seconds per execution."""

    cost: dict
    log: list = field(default_factory=list)   # (start, model, size, rows)
    backlogs: list = field(default_factory=list)   # each run's backlog flag

    async def run(self, model, size, weights, inputs, rows, backlog=False):
        start = trio.current_time()
        self.log.append((start, model.name, size, tuple(rows)))
        self.backlogs.append(backlog)
        await trio.sleep(self.cost[model.name](size))
        return BatchResult(tuple({"x": r["x"]} for r in inputs), 0, 0, 0)

    def device_time(self, since: float = 0.0) -> dict[str, float]:
        out: dict[str, float] = {}
        for start, name, size, _ in self.log:
            if start >= since:
                out[name] = out.get(name, 0.0) + self.cost[name](size)
        return out


class FakeWeights:
    async def ensure_resident(self, model):
        return ()

    def hint_next(self, model):
        pass


def config(**kw) -> SchedulerConfig:
    models = kw.pop("models", {})
    return SchedulerConfig(models=MappingProxyType({k: ModelSchedConfig(**v) for k, v in models.items()}), **kw)


class Harness:
    def __init__(self, cfg: SchedulerConfig, cost: dict, nursery: trio.Nursery, weights=None, tracing=None) -> None:
        self.device = FakeDevice(cost)
        self.stats = StatsBook()
        self.metrics = Metrics()
        self.scheduler = Scheduler(cfg, self.device, weights or FakeWeights(), self.stats, self.metrics,
                                   tracing=tracing)
        self.send, self._inbox = trio.open_memory_channel(1000)
        self.models: dict[str, FakeModel] = {}
        self.nursery = nursery

    async def start(self):
        await self.nursery.start(self.scheduler.run, self._inbox)

    def model(self, name: str, sizes=(1, 2, 4, 8)) -> FakeModel:
        return self.models.setdefault(name, FakeModel(name, tuple(sizes)))

    def request(self, name: str, reply, rows: int = 1, timeout: float | None = None, tag: int = 0,
                ticket=None, trace=None) -> InferRequest:
        x = np.full((rows, 1), tag, dtype=np.int64)
        now = trio.current_time()
        deadline = math.inf if timeout is None else now + timeout
        return InferRequest(self.model(name), {"x": x}, rows, str(tag), deadline, reply, 0, now, ticket, trace)

    async def infer(self, name: str, rows: int = 1, timeout: float | None = None, tag: int = 0, ticket=None,
                    trace=None):
        send, receive = trio.open_memory_channel(1)
        await self.send.send(self.request(name, send.send_nowait, rows, timeout, tag, ticket, trace))
        return await receive.receive()

    def rejections(self, name: str, reason: str) -> float:
        return self.metrics.registry.get_sample_value("xlaserve_rejections_total",
                                                      {"model": name, "reason": reason}) or 0.0

    def queue_depth(self, name: str) -> float:
        return self.metrics.registry.get_sample_value("xlaserve_queue_depth", {"model": name})

    def submit(self, name: str, rows: int = 1, timeout: float | None = None, tag: int = 0, into=None, ticket=None,
               trace=None):
        async def one():
            outcome = await self.infer(name, rows, timeout, tag, ticket, trace)
            if into is not None:
                into.append((trio.current_time(), name, tag, outcome))
        self.nursery.start_soon(one)

    async def trickle(self, name: str, count: int, gap: float = 0.001) -> None:
        """Submit ``count`` one-row requests for ``name``, ``gap`` seconds apart."""
        for _ in range(count):
            self.submit(name)
            await trio.sleep(gap)

    def closed_loop(self, name: str, clients: int, latencies: list | None = None):
        async def client():
            while True:
                t0 = trio.current_time()
                await self.infer(name)
                if latencies is not None:
                    latencies.append(trio.current_time() - t0)
        for _ in range(clients):
            self.nursery.start_soon(client)


def run(test, cfg: SchedulerConfig, cost: dict, tracing=None):
    async def main():
        async with trio.open_nursery() as nursery:
            h = Harness(cfg, cost, nursery, tracing=tracing)
            await h.start()
            await test(h)
            nursery.cancel_scope.cancel()
    trio.run(main, clock=MockClock(autojump_threshold=0))


def per_batch(seconds: float):
    return lambda size: seconds


# ---- coalescing --------------------------------------------------------------------------

def test_requests_queued_while_busy_run_as_one_batch_with_their_own_rows():
    results = []

    async def test(h: Harness):
        for tag in range(6):
            h.submit("m", tag=tag, into=results)
        await trio.sleep(1)
        # the first dispatch found one request (the others were not yet admitted) or all six
        sizes = [(size, rows) for _, _, size, rows in h.device.log]
        assert sum(len(rows) for _, rows in sizes) == 6
        assert len(sizes) <= 2
        assert all(size == {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 6: 8}[len(rows)] for size, rows in sizes)
        for _, _, tag, outcome in results:
            assert isinstance(outcome, InferResult)
            np.testing.assert_array_equal(outcome.outputs["x"], [[tag]])
        assert h.stats.get("m").inference_count == 6
        assert h.stats.get("m").execution_count == len(sizes)

    run(test, config(), {"m": per_batch(0.01)})


def test_a_coalesced_batch_is_recorded_once_for_the_traces_of_its_requests():
    class Unexported:
        def wake(self, queued_spans: int) -> None:
            pass
    tracing = Tracing(1.0, Unexported())

    async def test(h: Harness):
        h.submit("m", rows=3)            # starts alone, untraced
        await trio.sleep(0.001)
        traces = [tracing.start("xlaserve.infer", {}, time.perf_counter_ns()) for _ in range(3)]
        for tag, trace in enumerate(traces):
            h.submit("m", tag=tag, trace=trace)
        h.submit("m", tag=9)             # untraced, in the same batch
        await trio.sleep(1)
        assert [(size, sum(rows)) for _, _, size, rows in h.device.log] == [(4, 3), (4, 4)]
        execution = traces[0].execution
        assert execution is not None and all(trace.execution is execution for trace in traces)
        assert execution.error is None
        assert 0 < execution.started_ns <= execution.weights_ns <= execution.done_ns
        assert execution.queue_attributes == {"xlaserve.model": "m", "xlaserve.batch.id": 2}
        assert execution.weights_attributes == {"xlaserve.weights.bytes": 0, "xlaserve.batch.id": 2}
        assert execution.execute_attributes == {
            "xlaserve.batch.id": 2, "xlaserve.batch.size": 4, "xlaserve.batch.requests": 4,
            "xlaserve.batch.compiled_size": 4, "xlaserve.compute.input_ns": 0, "xlaserve.compute.infer_ns": 0,
            "xlaserve.compute.output_ns": 0}

    run(test, config(), {"m": per_batch(0.1)}, tracing)


def test_a_failure_in_the_bookkeeping_after_an_execution_still_answers_the_batch(caplog):
    """Statistics that raise (a bug) are logged; the executed batch is answered and the
    scheduler goes on serving."""
    results = []

    async def test(h: Harness):
        def broken(*args, **kwargs):
            raise RuntimeError("a bug in the statistics")
        h.stats.record_execution = broken
        h.submit("m", tag=1, into=results)
        await trio.sleep(1)
        h.submit("m", tag=2, into=results)
        await trio.sleep(1)
        assert [tag for _, _, tag, _ in results] == [1, 2]
        assert all(isinstance(outcome, InferResult) for _, _, _, outcome in results)

    with caplog.at_level(logging.ERROR, "xlaserve.scheduler"):
        run(test, config(), {"m": per_batch(0.01)})
    assert caplog.text.count("recording the execution at batch size 1 failed") == 2


def test_the_executor_is_told_when_requests_wait_beyond_the_batch():
    """While c runs, a's and b's requests queue: c's batch left nothing waiting when it was
    dispatched, the next one leaves the other model's request waiting (backlog), the last none."""
    results = []

    async def test(h: Harness):
        h.submit("c", tag=0, into=results)
        await trio.sleep(0.1)
        h.submit("a", tag=1, into=results)
        h.submit("b", tag=2, into=results)
        await trio.sleep(2)
        assert sorted(name for _, name, _, _ in h.device.log) == ["a", "b", "c"] and h.device.log[0][1] == "c"
        assert h.device.backlogs == [False, True, False]

    run(test, config(), {"a": per_batch(0.01), "b": per_batch(0.01), "c": per_batch(0.5)})


def test_backlog_coalesces_to_the_largest_size_and_pads_the_rest():
    async def test(h: Harness):
        h.submit("m", rows=3)            # starts alone
        await trio.sleep(0.001)
        for _ in range(11):
            h.submit("m")
        await trio.sleep(1)
        assert [(size, sum(rows)) for _, _, size, rows in h.device.log] == [(4, 3), (8, 8), (4, 3)]

    run(test, config(), {"m": per_batch(0.1)})


def test_max_batch_size_caps_rows_but_a_larger_request_still_runs():
    async def test(h: Harness):
        h.submit("m")
        await trio.sleep(0.001)
        for rows in (1, 1, 1, 1, 1, 8):
            h.submit("m", rows=rows)
            await trio.sleep(0.001)
        await trio.sleep(1)
        assert [(size, rows) for _, _, size, rows in h.device.log] == \
            [(1, (1,)), (2, (1, 1)), (2, (1, 1)), (1, (1,)), (8, (8,))]

    run(test, config(models={"m": {"max_batch_size": 2}}), {"m": per_batch(0.1)})


def test_no_artificial_wait_requests_trickling_in_run_one_by_one():
    """An idle device takes what is queued at once; it never holds back for fuller batches."""
    async def test(h: Harness):
        await h.trickle("m", 4)
        await trio.sleep(1)
        assert [size for _, _, size, _ in h.device.log] == [1, 1, 1, 1]

    run(test, config(), {"m": per_batch(0.0005)})


def test_batch_delay_holds_a_lone_model_until_the_target_rows_or_the_delay():
    """With batch_delay_seconds a trickle gathers: the hold ends at batch_target_rows (dispatch
    at once) or when the oldest request has waited the delay (dispatch what is there)."""
    async def test(h: Harness):
        await h.trickle("m", 4)             # 4 rows 1 ms apart: the target, reached at t=3 ms
        await trio.sleep(0.05)
        await h.trickle("m", 2)             # 2 rows: the oldest waits out the 10 ms delay
        await trio.sleep(1)
        starts = [(round(start, 4), size, rows) for start, _, size, rows in h.device.log]
        assert starts == [(0.003, 4, (1, 1, 1, 1)), (0.064, 2, (1, 1))]

    run(test, config(models={"m": {"batch_delay_seconds": 0.01, "batch_target_rows": 4}}),
        {"m": per_batch(0.0005)})


def test_batch_delay_target_defaults_to_the_largest_size_capped_by_max_batch_size():
    async def test(h: Harness):
        await h.trickle("m", 8)
        await trio.sleep(1)
        assert [(round(start, 4), size) for start, _, size, _ in h.device.log] == [(0.001, 2), (0.003, 2),
                                                                                   (0.005, 2), (0.007, 2)]

    run(test, config(models={"m": {"batch_delay_seconds": 0.01, "max_batch_size": 2}}),
        {"m": per_batch(0.0001)})


def test_batch_delay_ends_when_the_queued_rows_reach_the_target_even_if_they_do_not_pack():
    async def test(h: Harness):
        h.submit("m", rows=5)
        await trio.sleep(0.001)
        h.submit("m", rows=4)               # 9 rows queued; one batch of 8 can take only the 5
        await trio.sleep(1)
        assert [(round(start, 4), size, rows) for start, _, size, rows in h.device.log] == \
            [(0.001, 8, (5,)), (0.501, 4, (4,))]     # the 4 left over wait out their own delay

    run(test, config(models={"m": {"batch_delay_seconds": 0.5}}), {"m": per_batch(0.001)})


def test_batch_delay_never_idles_the_device_while_another_model_waits():
    async def test(h: Harness):
        h.submit("m")
        await trio.sleep(0.002)             # m is held (alone, 1 row of 8)
        assert h.device.log == []
        h.submit("other")                   # another backlogged model ends the hold
        await trio.sleep(1)
        assert sorted((round(start, 4), name) for start, name, _, _ in h.device.log)[0][0] == 0.002
        assert {name for _, name, _, _ in h.device.log} == {"m", "other"}

    run(test, config(models={"m": {"batch_delay_seconds": 0.5}}),
        {"m": per_batch(0.001), "other": per_batch(0.001)})


def test_batch_delay_never_holds_a_request_past_its_deadline_less_the_learned_cost():
    results = []

    async def test(h: Harness):
        await h.infer("m", rows=8)          # learn the cost at size 8: 20 ms
        start = trio.current_time()
        h.submit("m", timeout=0.05, into=results)
        await trio.sleep(1)
        assert round(h.device.log[-1][0] - start, 4) == 0.03     # 50 ms deadline - 20 ms cost
        assert isinstance(results[0][3], InferResult)

    run(test, config(models={"m": {"batch_delay_seconds": 0.5}}), {"m": per_batch(0.02)})


def test_batch_delay_ends_sooner_for_a_request_with_an_earlier_deadline_that_arrives_while_held():
    """A request that joins a held queue with a deadline before the hold's end: the hold used to
    go on (only its rows were checked), so that request expired unrun at 1 s while the device sat
    idle until 10 s. Now it shortens the hold to its deadline less the cost (the conservative
    0.05 s charge, nothing being measured yet), and both run together in time."""
    results = []

    async def test(h: Harness):
        h.submit("m", tag=1, into=results)
        await trio.sleep(0.5)
        h.submit("m", tag=2, timeout=0.5, into=results)     # due at 1.0 s
        await trio.sleep(20)
        assert sorted((round(t, 4), tag, type(o).__name__) for t, _, tag, o in results) == \
            [(0.95, 1, "InferResult"), (0.95, 2, "InferResult")]
        assert [(round(start, 4), size) for start, _, size, _ in h.device.log] == [(0.95, 2)]

    run(test, config(models={"m": {"batch_delay_seconds": 10.0}}), {"m": per_batch(0.0)})


def test_batch_delay_ends_with_a_dropped_model_and_at_shutdown():
    results = []

    async def test(h: Harness):
        from xlaserve.errors import ModelNotReady
        h.submit("m", tag=1, into=results)
        await trio.sleep(0.01)
        await h.send.send(DropModel("m", ModelNotReady("model 'm' was unloaded")))
        await trio.sleep(0.001)
        assert isinstance(results[0][3], ModelNotReady) and round(results[0][0], 4) == 0.01
        h.submit("m", tag=2, into=results)
        await trio.sleep(0.01)
        await h.send.aclose()               # the inbox closes: the queue is served, not held
        await trio.sleep(0.001)
        assert isinstance(results[1][3], InferResult) and round(results[1][0], 4) == 0.021
        assert len(h.device.log) == 1

    run(test, config(models={"m": {"batch_delay_seconds": 5.0}}), {"m": per_batch(0.0)})


def test_a_drain_ends_a_hold_at_once():
    """The worker drains (SIGTERM): a held dispatch used to go on holding for rows that could no
    longer come, the device idle, until batch_delay_seconds (or the deadline less the cost) ended
    it; the drain waited that long, or cut the request off at its own limit. Now the drain ends
    the hold in progress and no later dispatch is held."""
    results = []

    async def test(h: Harness):
        h.submit("m", tag=1, into=results)
        await trio.sleep(1)
        assert results == []                # held: 1 row of the 8 it waits for
        h.scheduler.drain()
        await trio.sleep(0.001)
        assert isinstance(results[0][3], InferResult) and round(results[0][0], 4) == 1.0
        h.submit("m", tag=2, into=results)  # a request already on its way when the drain began
        await trio.sleep(0.001)
        assert isinstance(results[1][3], InferResult) and round(results[1][0], 4) == 1.001
        assert [size for _, _, size, _ in h.device.log] == [1, 1]

    run(test, config(models={"m": {"batch_delay_seconds": 20.0}}), {"m": per_batch(0.0)})


def test_full_queue_rejects_with_resource_exhausted_naming_model_and_depth():
    results = []

    async def test(h: Harness):
        for tag in range(4):
            h.submit("m", tag=tag, into=results)   # one runs, two queue, the fourth is refused
            await trio.sleep(0.001)
        await trio.sleep(1)
        refused = [o for _, _, _, o in results if isinstance(o, QueueFull)]
        assert len(refused) == 1
        assert "model 'm' has 2 requests queued" in str(refused[0])
        assert "scheduler.max_queue_depth" in str(refused[0]) and "is 2" in str(refused[0])
        assert h.stats.get("m").fail.count == 1

    run(test, config(max_queue_depth=2), {"m": per_batch(0.1)})


def test_a_dispatch_plans_again_only_the_queues_that_changed(monkeypatch):
    """Attack: thousands of models with one request each. Each dispatch planned the next batch of
    every backlogged model again, so draining N of them planned N(N+1)/2 batches: measured,
    3.3 ms of dispatch-loop CPU per dispatch with 1,000 backlogged models and 11 ms with 3,000
    (27 s to answer 3,000 one-request models, the Trio thread busy throughout). Now a plan is kept
    while its queue is unchanged: draining plans each model's batch once."""
    import xlaserve.worker.scheduler as scheduler_module
    planned = []

    def counting_plan_batch(*args, **kwargs):
        planned.append(args)
        return plan_batch(*args, **kwargs)

    from xlaserve.worker.batching import plan_batch
    monkeypatch.setattr(scheduler_module, "plan_batch", counting_plan_batch)
    n = 200
    results = []

    async def test(h: Harness):
        for i in range(n):
            h.submit(f"m{i}", tag=i, into=results)
        await trio.sleep(10)
        assert len(results) == n and all(not isinstance(o, Exception) for *_, o in results)
        assert len(h.device.log) == n
        assert len(planned) <= 2 * n, f"{len(planned)} batches planned to drain {n} one-request models"
        assert all(h.queue_depth(f"m{i}") == 0 for i in range(n))

    run(test, config(), {f"m{i}": per_batch(0.001) for i in range(n)})


def test_set_policy_max_batch_size_applies_to_a_queue_already_planned():
    """A model's batch is planned while another model runs; lowering its max_batch_size before
    its turn makes the next dispatch take the new cap, not the plan made under the old one."""
    async def test(h: Harness):
        h.submit("busy")
        await trio.sleep(0.001)
        h.submit("busy")
        await trio.sleep(0.001)
        for tag in range(8):
            h.submit("m", tag=tag)
        await trio.sleep(0.15)             # at 0.1 s m's batch was planned, and busy (older) went
        h.scheduler.set_policy("m", max_batch_size=2)
        await trio.sleep(2)
        assert [size for _, name, size, _ in h.device.log if name == "m"] == [2, 2, 2, 2]

    run(test, config(discipline="fifo"), {"busy": per_batch(0.1), "m": per_batch(0.1)})


def test_drop_model_answers_its_queue():
    results = []

    async def test(h: Harness):
        for tag in range(3):
            h.submit("m", tag=tag, into=results)
            await trio.sleep(0.001)
        from xlaserve.errors import ModelNotReady
        await h.send.send(DropModel("m", ModelNotReady("model 'm' was unloaded")))
        await trio.sleep(1)
        errors = [o for _, _, _, o in results if isinstance(o, ModelNotReady)]
        assert len(errors) == 2 and len(h.device.log) == 1

    run(test, config(), {"m": per_batch(0.1)})


# ---- cancellation ------------------------------------------------------------------------

def _ran(h: Harness) -> list[int]:
    """The tags of every request the fake device executed, in order."""
    return [tag for _, _, _, rows in h.device.log for tag in rows]


class TaggingDevice(FakeDevice):
    """Logs the tags of the requests in each execution (its ``rows`` slot) instead of their rows."""

    async def run(self, model, size, weights, inputs, rows, backlog=False):
        self.log.append((trio.current_time(), model.name, size, tuple(int(r["x"][0, 0]) for r in inputs)))
        await trio.sleep(self.cost[model.name](size))
        return BatchResult(tuple({"x": r["x"]} for r in inputs), 0, 0, 0)


def run_tagged(test, cfg: SchedulerConfig, cost: dict):
    async def main():
        async with trio.open_nursery() as nursery:
            h = Harness(cfg, cost, nursery)
            h.device = h.scheduler._executor = TaggingDevice(cost)
            await h.start()
            await test(h)
            nursery.cancel_scope.cancel()
    trio.run(main, clock=MockClock(autojump_threshold=0))


def test_a_queued_request_cancelled_before_dispatch_never_runs_and_is_counted_once():
    """Request 1 runs for 1 s; 2 and 3 queue behind it. 2 is cancelled at 0.5 s: it is answered
    CANCELLED then, leaves the queue (depth 1), and the next batch is 3 alone. Its deadline
    passing later answers nothing more."""
    results = []

    async def test(h: Harness):
        h.submit("m", tag=1, into=results)
        await trio.sleep(0.001)
        h.submit("m", tag=2, timeout=3.0, ticket="two", into=results)
        h.submit("m", tag=3, into=results)
        await trio.sleep(0.499)
        assert h.queue_depth("m") == 2
        await h.send.send(CancelRequest("two"))
        await trio.sleep(0.001)
        (when, _, _, outcome), = [r for r in results if r[2] == 2]
        assert isinstance(outcome, Cancelled) and when == pytest.approx(0.5)
        assert "request '2'" in str(outcome) and "it was not run" in str(outcome)
        assert h.queue_depth("m") == 1
        await trio.sleep(5)
        assert _ran(h) == [1, 3]
        assert sorted(tag for _, _, tag, _ in results) == [1, 2, 3]      # one answer each
        assert h.rejections("m", "cancelled") == 1
        assert h.rejections("m", "deadline_expired") == 0
        assert h.stats.get("m").fail.count == 1 and h.stats.get("m").inference_count == 2

    run_tagged(test, config(discipline="fifo"), {"m": per_batch(1.0)})


def test_cancelling_a_dispatched_or_unknown_request_changes_nothing():
    results = []

    async def test(h: Harness):
        h.submit("m", tag=1, ticket="one", into=results)
        await trio.sleep(0.5)                       # 1 is on the device
        await h.send.send(CancelRequest("one"))
        await h.send.send(CancelRequest("never-sent"))
        await trio.sleep(1)
        (_, _, _, outcome), = results
        assert isinstance(outcome, InferResult)
        assert _ran(h) == [1] and h.rejections("m", "cancelled") == 0

    run_tagged(test, config(), {"m": per_batch(1.0)})


def test_a_cancelled_request_frees_its_queue_slot_in_the_same_burst():
    """max_queue_depth 2, both slots taken: a cancel and a new request that arrive together
    (one inbox burst) admit the new one; the cancelled one is answered once, never run."""
    results = []

    async def test(h: Harness):
        h.submit("m", tag=1, into=results)
        await trio.sleep(0.001)
        h.submit("m", tag=2, ticket="two", into=results)
        h.submit("m", tag=3, into=results)
        await trio.sleep(0.1)
        send, receive = trio.open_memory_channel(1)
        h.send.send_nowait(CancelRequest("two"))
        h.send.send_nowait(h.request("m", send.send_nowait, tag=4))
        assert isinstance(await receive.receive(), InferResult)
        await trio.sleep(5)
        assert [type(o) for _, _, _, o in sorted(results, key=lambda r: r[2])] == [InferResult, Cancelled,
                                                                                   InferResult]
        assert _ran(h) == [1, 3, 4] and h.rejections("m", "queue_full") == 0

    run_tagged(test, config(max_queue_depth=2, discipline="fifo"), {"m": per_batch(1.0)})


def test_a_held_batch_forms_without_the_cancelled_request():
    """batch_delay_seconds holds m until 4 rows are queued: 1, 2, 3 queue, 2 is cancelled, so
    the hold ends only when 4 and 5 arrive, and the one execution carries 1, 3, 4, 5."""
    results = []

    async def test(h: Harness):
        for tag in (1, 2, 3):
            h.submit("m", tag=tag, ticket=tag, into=results)
            await trio.sleep(0.01)
        await h.send.send(CancelRequest(2))
        h.submit("m", tag=4, into=results)
        await trio.sleep(0.01)
        assert h.device.log == []                  # 3 rows: still held
        h.submit("m", tag=5, into=results)
        await trio.sleep(1)
        assert _ran(h) == [1, 3, 4, 5] and round(h.device.log[0][0], 4) == 0.04
        assert h.rejections("m", "cancelled") == 1 and len(results) == 5

    run_tagged(test, config(models={"m": {"batch_delay_seconds": 5.0, "batch_target_rows": 4}}),
               {"m": per_batch(0.1)})


def test_a_request_cancelled_and_dropped_in_one_burst_is_answered_once():
    results = []

    async def test(h: Harness):
        h.submit("busy", tag=1, into=results)
        await trio.sleep(0.001)
        h.submit("m", tag=2, ticket="two", into=results)
        h.submit("m", tag=3, ticket="three", into=results)
        await trio.sleep(0.1)
        h.send.send_nowait(CancelRequest("two"))
        h.send.send_nowait(DropModel("m", ModelNotReady("model 'm' was unloaded")))
        h.send.send_nowait(CancelRequest("three"))       # already answered by the drop: nothing
        await trio.sleep(5)
        outcomes = {tag: type(o) for _, _, tag, o in results}
        assert outcomes == {1: InferResult, 2: Cancelled, 3: ModelNotReady} and len(results) == 3
        assert h.rejections("m", "cancelled") == 1 and h.rejections("m", "model_dropped") == 1
        assert _ran(h) == [1]

    run_tagged(test, config(discipline="fifo"), {"busy": per_batch(1.0), "m": per_batch(0.1)})


# ---- fair: deficit round robin -----------------------------------------------------------

def test_drr_device_time_converges_to_the_weights():
    async def test(h: Harness):
        # more clients than one batch takes (8), so every model stays backlogged
        h.closed_loop("a", 16)
        h.closed_loop("b", 16)
        h.closed_loop("c", 16)
        await trio.sleep(20)
        share = h.device.device_time(since=2.0)
        total = sum(share.values())
        assert share["a"] / total == pytest.approx(1 / 6, abs=0.01)
        assert share["b"] / total == pytest.approx(2 / 6, abs=0.01)
        assert share["c"] / total == pytest.approx(3 / 6, abs=0.01)

    # very different costs per dispatch: shares follow the weights, not the dispatch counts
    cfg = config(models={"a": {"weight": 1}, "b": {"weight": 2}, "c": {"weight": 3}})
    run(test, cfg, {"a": per_batch(0.050), "b": per_batch(0.015), "c": lambda size: 0.01 * size})


def test_fifo_gives_device_time_by_arrival_not_weight():
    async def test(h: Harness):
        h.closed_loop("a", 16)
        h.closed_loop("b", 16)
        await trio.sleep(10)
        share = h.device.device_time(since=2.0)
        # both always have a queue; fifo alternates batches, so the dearer model gets more time
        assert share["a"] > 5 * share["b"]

    run(test, config(discipline="fifo", models={"b": {"weight": 10}}),
        {"a": per_batch(0.050), "b": per_batch(0.005)})


def test_light_model_is_not_starved_by_a_heavy_one_under_fair():
    latencies: list[float] = []

    async def test(h: Harness):
        h.closed_loop("heavy", 28)
        h.closed_loop("light", 1, latencies)
        await trio.sleep(5)
        # light waits for at most one heavy batch plus its own execution
        assert max(latencies[5:]) <= 0.020 + 0.002 + 1e-9

    run(test, config(models={"heavy": {"max_batch_size": 8}}),
        {"heavy": per_batch(0.020), "light": per_batch(0.002)})


def test_idle_model_banks_no_credit():
    async def test(h: Harness):
        h.closed_loop("a", 16)
        await trio.sleep(3)               # b is idle all this time
        h.closed_loop("b", 16)
        await trio.sleep(0.5)
        start = 3.0
        share = h.device.device_time(since=start)
        # equal weights: b gets half, not 10 s of saved-up credit
        assert share["b"] / sum(share.values()) == pytest.approx(0.5, abs=0.1)

    run(test, config(), {"a": per_batch(0.01), "b": per_batch(0.01)})


def test_set_policy_weight_changes_fair_shares():
    async def test(h: Harness):
        h.closed_loop("a", 16)
        h.closed_loop("b", 16)
        await trio.sleep(2)
        h.scheduler.set_policy("b", weight=4.0)
        await trio.sleep(0.1)
        since = trio.current_time()
        await trio.sleep(10)
        share = h.device.device_time(since=since)
        assert share["b"] / sum(share.values()) == pytest.approx(0.8, abs=0.02)
        assert h.scheduler.policy("b").weight == 4.0

    run(test, config(), {"a": per_batch(0.05), "b": per_batch(0.05)})


def test_set_policy_turns_the_hold_on_and_off_at_run_time():
    """A hold set at run time gathers a trickle; turning it off ends the hold in progress at
    once; batch_target_rows=0 goes back to the default target."""
    async def test(h: Harness):
        h.scheduler.set_policy("m", batch_delay_seconds=0.01, batch_target_rows=3)
        assert (h.scheduler.policy("m").batch_delay_seconds, h.scheduler.policy("m").batch_target_rows) == (0.01, 3)
        await h.trickle("m", 3)             # held until the third row, at t=2 ms
        await trio.sleep(0.05)
        h.submit("m")                       # t=52 ms: held, alone, 1 row of the 3
        await trio.sleep(0.002)
        h.scheduler.set_policy("m", batch_delay_seconds=0)
        await trio.sleep(0.05)
        h.scheduler.set_policy("m", batch_delay_seconds=0.01, batch_target_rows=0)
        assert h.scheduler.policy("m").batch_target_rows is None
        t0 = trio.current_time()
        await h.trickle("m", 8)             # the default target: 8 rows (the largest size)
        await trio.sleep(1)
        assert [(round(start, 4), size) for start, _, size, _ in h.device.log] == \
            [(0.002, 4), (0.055, 1), (round(t0 + 0.007, 4), 8)]   # 0.055: off ends the hold at once

    run(test, config(), {"m": per_batch(0.0005)})


def test_set_policy_refuses_a_bad_hold():
    async def test(h: Harness):
        for bad in ({"batch_delay_seconds": -1.0}, {"batch_delay_seconds": math.inf}, {"batch_target_rows": -2}):
            with pytest.raises(ValueError, match="batch_"):
                h.scheduler.set_policy("m", **bad)
        assert h.scheduler.policy("m").batch_delay_seconds == 0.0

    run(test, config(), {"m": per_batch(0.0005)})


def test_drr_charges_an_unmeasured_model_conservatively():
    costs = CostModel(halflife=30)
    costs.observe("a", 1, 0.010, now=0)
    policy = DeficitRoundRobin(costs, lambda name: 1.0)
    # b has never run: charged the dearest measured dispatch (or the default), never zero
    assert costs.charge("b", 1) == pytest.approx(0.05)
    costs.observe("a", 8, 0.080, now=0)
    assert costs.charge("b", 1) == pytest.approx(0.080)
    picks = [policy.pick({"a": Candidate("a", 1, 0, math.inf), "b": Candidate("b", 1, 1, math.inf)}, 0)
             for _ in range(9)]
    # b is charged 80 ms a dispatch until measured, a 10 ms: a runs about 8 times as often
    assert picks.count("b") == 1


# ---- the cost model ----------------------------------------------------------------------

def test_cost_ema_half_life_on_the_clock():
    costs = CostModel(halflife=10)
    assert costs.estimate("m", 4) is None
    costs.observe("m", 4, 1.0, now=0)
    assert costs.estimate("m", 4) == 1.0                  # the first sample as is
    costs.observe("m", 4, 3.0, now=10)                     # the old sample now weighs 1/2
    assert costs.estimate("m", 4) == pytest.approx((0.5 * 1 + 3) / 1.5)
    costs.observe("m", 4, 3.0, now=1000)                   # long ago: forgotten
    assert costs.estimate("m", 4) == pytest.approx(3.0, rel=1e-6)
    # unmeasured sizes borrow from a larger size, or scale a smaller one
    assert costs.estimate("m", 2) == pytest.approx(3.0, rel=1e-6)
    assert costs.estimate("m", 8) == pytest.approx(6.0, rel=1e-6)


# ---- fifo / edf order --------------------------------------------------------------------

def test_fifo_and_edf_policies_order():
    c = {"a": Candidate("a", 1, oldest_seq=5, earliest_deadline=1.0),
         "b": Candidate("b", 1, oldest_seq=2, earliest_deadline=3.0),
         "c": Candidate("c", 1, oldest_seq=9, earliest_deadline=math.inf)}
    assert FifoPolicy().pick(c, 0) == "b"
    assert EdfPolicy().pick(c, 0) == "a"


def test_edf_runs_the_most_urgent_model_first():
    async def test(h: Harness):
        h.submit("busy")
        await trio.sleep(0.001)
        h.submit("late", timeout=5.0)
        h.submit("none")                   # no deadline: due at the dispatch timeout (30 s)
        h.submit("soon", timeout=1.0)
        await trio.sleep(2)
        assert [name for _, name, _, _ in h.device.log] == ["busy", "soon", "late", "none"]

    run(test, config(discipline="edf"), {n: per_batch(0.1) for n in ("busy", "late", "none", "soon")})


def test_answered_requests_with_far_deadlines_do_not_grow_the_expiry_heap():
    """Attack: every request carries a deadline years away (Triton's ``timeout`` of 2**64-1
    microseconds, or ``grpc-timeout: 99999999H``). Each answered request left its entry in the
    expiry heap until its deadline came up, so the worker's memory grew by one entry per request
    for good (20,000 requests: 19,998 entries). Now the heap is rebuilt without them when they
    outnumber the live ones."""
    async def test(h: Harness):
        for _ in range(4096):
            assert isinstance(await h.infer("m", timeout=1e9), InferResult)
        assert len(h.scheduler._expiry) <= 1025     # scheduler.EXPIRY_SLACK stale ones at most
        assert h.queue_depth("m") == 0

    run(test, config(), {"m": per_batch(0.001)})


def test_deadline_passing_in_the_queue_fails_without_running():
    results = []

    async def test(h: Harness):
        h.submit("busy", tag=1, into=results)
        await trio.sleep(0.001)
        h.submit("m", timeout=0.5, tag=2, into=results)
        await trio.sleep(3)
        (when, _, _, outcome), = [r for r in results if r[2] == 2]
        assert isinstance(outcome, DeadlineExceeded)
        assert when == pytest.approx(0.501)
        assert "deadline passed" in str(outcome)
        assert [name for _, name, _, _ in h.device.log] == ["busy"]

    run(test, config(discipline="fifo"), {"busy": per_batch(2.0), "m": per_batch(0.1)})


def test_edf_sheds_work_that_cannot_finish_in_time():
    results = []

    async def test(h: Harness):
        await h.infer("m")                                  # learn: 0.2 s per execution
        h.submit("m", timeout=0.1, tag=1, into=results)     # shed at admission
        await trio.sleep(0.01)
        h.submit("m", timeout=10, tag=2, into=results)      # runs now, until t=0.41
        await trio.sleep(0.001)
        h.submit("m", timeout=0.3, tag=3, into=results)     # by its turn 0.09 s are left: shed
        await trio.sleep(2)
        outcomes = {tag: o for _, _, tag, o in results}
        assert isinstance(outcomes[1], DeadlineExceeded) and "shed" in str(outcomes[1])
        assert isinstance(outcomes[2], InferResult)
        assert isinstance(outcomes[3], DeadlineExceeded) and "shed" in str(outcomes[3])
        shed_at = next(when for when, _, tag, _ in results if tag == 3)
        assert shed_at == pytest.approx(0.41)               # early: its deadline was 0.511
        assert len(h.device.log) == 2

    run(test, config(discipline="edf"), {"m": per_batch(0.2)})


@pytest.mark.parametrize("discipline", ["fair", "fifo", "edf"])
def test_dispatch_timeout_bounds_only_requests_without_a_deadline_of_their_own(discipline):
    results = []

    async def test(h: Harness):
        h.submit("busy", tag=1, into=results)               # holds the device until t=5.0
        await trio.sleep(0.001)
        h.submit("m", tag=2, into=results)                  # no deadline: the dispatch timeout (1 s)
        h.submit("m", timeout=60, tag=3, into=results)      # a deadline past the dispatch timeout
        h.submit("m", timeout=0.5, tag=4, into=results)     # a deadline before it
        await trio.sleep(10)
        outcomes = {tag: (when, o) for when, _, tag, o in results}
        when, outcome = outcomes[2]
        assert isinstance(outcome, DeadlineExceeded) and when == pytest.approx(1.001)
        assert "scheduler.dispatch_timeout_seconds" in str(outcome)
        assert "without a deadline of their own" in str(outcome)
        when, outcome = outcomes[4]
        assert isinstance(outcome, DeadlineExceeded) and when == pytest.approx(0.501)
        assert "deadline passed" in str(outcome)
        when, outcome = outcomes[3]                          # waited 5 s, past the 1 s timeout: it ran
        assert isinstance(outcome, InferResult) and when == pytest.approx(5.1)
        assert [name for _, name, _, _ in h.device.log] == ["busy", "m"]
        assert h.rejections("m", "dispatch_timeout") == 1 and h.rejections("m", "deadline_expired") == 1

    run(test, config(discipline=discipline, dispatch_timeout_seconds=1.0),
        {"busy": per_batch(5.0), "m": per_batch(0.1)})



def test_the_expiry_heap_holds_what_is_queued_not_the_traffic_of_the_last_dispatch_timeout():
    """A request's entry in the expiry heap left only when it reached the top, at its
    ``dispatch_by``: with every request answered at once, the heap still held each one of the
    last ``dispatch_timeout_seconds`` (30 s of traffic, ~130 bytes a request). Entries of
    requests no longer queued are now dropped once they outnumber the queued ones, so a
    steady stream keeps the heap near what waits."""
    from xlaserve.worker.scheduler import EXPIRY_SLACK
    answered = []

    async def test(h: Harness):
        for _ in range(20):                                  # 10,000 requests in 2 s of a 30 s timeout
            for _ in range(500):
                h.submit("m", into=answered)
            await trio.sleep(0.1)
        assert len(answered) == 10_000 and all(isinstance(o, InferResult) for *_, o in answered)
        assert len(h.scheduler._expiry) <= EXPIRY_SLACK + 1, len(h.scheduler._expiry)
        h.submit("slow", tag=1, into=answered)               # holds the device: the others wait
        await trio.sleep(0.001)
        for _ in range(1000):                                # under max_queue_depth (1024)
            h.submit("m", into=answered)
        await trio.sleep(1)
        assert len(h.scheduler._expiry) >= 1000              # the waiting ones keep their entries
        await trio.sleep(40)                                 # "slow" runs 50 s: the waiting ones expire
        timeouts = [o for _, name, _, o in answered[10_000:] if name == "m"]
        assert len(timeouts) == 1000 and all(isinstance(o, DeadlineExceeded) for o in timeouts)

    run(test, config(), {"m": per_batch(0.001), "slow": per_batch(50.0)})

# ---- weights that cannot be made resident ---------------------------------------------------
class RefusingWeights(FakeWeights):
    """Refuses one model's weights, as the cache does when a replaced version cannot come back."""

    async def ensure_resident(self, model):
        if model.name == "gone":
            raise Unavailable("model 'gone' version 1 was replaced; retry")
        if model.name == "broken":
            raise OSError("the device copy failed")
        return ()


def test_weights_refusal_keeps_its_status_and_others_still_run():
    async def test(h):
        h.scheduler._weights = RefusingWeights()
        refused = await h.infer("gone")
        served = await h.infer("ok")
        assert isinstance(refused, Unavailable) and "was replaced; retry" in str(refused)
        assert isinstance(served, InferResult)
    run(test, config(discipline="fifo"), {"gone": per_batch(0.01), "ok": per_batch(0.01)})


def test_an_unexpected_weights_failure_fails_its_batch_only():
    async def test(h):
        h.scheduler._weights = RefusingWeights()
        failed = await h.infer("broken")
        served = await h.infer("ok")
        assert isinstance(failed, InternalError) and "OSError: the device copy failed" in str(failed)
        assert isinstance(served, InferResult)
    run(test, config(discipline="fifo"), {"broken": per_batch(0.01), "ok": per_batch(0.01)})



def test_a_burst_sent_at_once_runs_as_one_batch_even_when_its_first_request_went_straight_to_run():
    """A message sent while the scheduler's run task waits on its inbox goes to that task
    directly; the rest of the burst waits in the channel, where the dispatch loop may drain it
    first (Trio runs a turn's tasks in random order). The dispatch loop lets run admit what it
    holds before forming the batch, so the first request does not run alone after the rest
    (before: about half of these bursts ran as 9 rows, then 1)."""
    async def test(h):
        model = h.model("m", (1, 2, 4, 8, 16))
        for _ in range(60):
            answered = trio.Event()
            left = [10]

            def reply(outcome, left=left, answered=answered) -> None:
                assert isinstance(outcome, InferResult), outcome
                left[0] -= 1
                if not left[0]:
                    answered.set()
            for tag in range(10):       # one burst, sent without yielding (a reader handing on one read's requests)
                h.send.send_nowait(InferRequest(model, {"x": np.full((1, 1), tag, dtype=np.int64)}, 1, str(tag),
                                                math.inf, reply, 0, trio.current_time()))
            await answered.wait()
        assert [rows for _, _, _, rows in h.device.log] == [(1,) * 10] * 60
    run(test, config(), {"m": per_batch(0.001)})
