"""Scheduling that knows the weight cache (issue 25, part 3): cold models wait, boundedly, while
resident ones have work, so that one load serves more requests. Pure policy decisions first,
then the scheduler over a fake weight cache under Trio's MockClock (every timing exact)."""
from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import trio
from trio.testing import MockClock

from xlaserve.runtime.residency import Floor, ResidencyBook
from xlaserve.worker.policy import Candidate, ColdDeferral, CostModel, DeficitRoundRobin, FifoPolicy

from tests.test_scheduler import Harness, config, per_batch


def cand(name, seq, cold=False, deadline=math.inf, load=0.002, size=1):
    return Candidate(name, size, seq, deadline, cold, load if cold else 0.0)


def fifo_deferral(limit: int, costs: CostModel | None = None) -> ColdDeferral:
    return ColdDeferral(FifoPolicy(), costs or CostModel(30.0), limit)


# ---- the policy, pure -----------------------------------------------------------------------

def test_a_cold_model_waits_for_resident_work_then_goes_after_its_limit():
    policy = fifo_deferral(3)
    picks = []
    for _ in range(4):
        d = policy.decide({"cold": cand("cold", 0, cold=True), "hot": cand("hot", 1)}, 0.0)
        picks.append((d.model, d.forced, d.deferred, d.next_cold))
    # fifo alone would run "cold" first (oldest request); it waits 3 dispatches, then is forced
    assert picks == [("hot", False, ("cold",), "cold")] * 3 + [("cold", True, (), None)]
    assert policy.passes("cold") == 0 and policy.passes("hot") == 1


def test_without_resident_work_or_with_limit_zero_the_discipline_alone_decides():
    assert fifo_deferral(3).decide({"a": cand("a", 0, cold=True), "b": cand("b", 1, cold=True)}, 0).model == "a"
    off = fifo_deferral(0)
    d = off.decide({"cold": cand("cold", 0, cold=True), "hot": cand("hot", 1)}, 0.0)
    assert (d.model, d.deferred, d.forced) == ("cold", (), False)


def test_a_cold_model_is_not_deferred_past_its_deadline():
    costs = CostModel(30.0)
    costs.observe("hot", 1, 0.010, 0.0)        # a resident dispatch takes 10 ms
    costs.observe("cold", 1, 0.005, 0.0)       # the cold one 5 ms, plus a 2 ms load
    policy = fifo_deferral(8, costs)
    roomy = {"cold": cand("cold", 0, cold=True, deadline=0.0171), "hot": cand("hot", 1)}
    assert policy.decide(roomy, 0.0).model == "hot"         # 10 + 2 + 5 < 17.1 ms: it may wait one
    tight = {"cold": cand("cold", 0, cold=True, deadline=0.0169), "hot": cand("hot", 1)}
    d = policy.decide(tight, 0.0)
    assert (d.model, d.forced) == ("cold", True)            # 10 + 2 + 5 > 16.9 ms: it goes now


def test_due_cold_models_go_most_passed_first_and_the_bound_holds():
    """Three cold models and a hot one that always has work: every cold one is dispatched within
    limit + C - 1 dispatches of others (C = 3 cold models with queued work)."""
    limit = 4
    policy = fifo_deferral(limit)
    waiting = {"c1": 1, "c2": 2, "c3": 3}       # cold model -> its oldest request's seq
    since = dict.fromkeys(waiting, 0)
    served = []
    for step in range(20):
        cands = {"hot": cand("hot", 100 + step)}
        cands.update({n: cand(n, s, cold=True) for n, s in waiting.items()})
        d = policy.decide(cands, 0.0)
        if d.model in waiting:
            served.append((d.model, since.pop(d.model)))
            del waiting[d.model]
        for n in since:
            since[n] += 1
        if not waiting:
            break
    assert served == [("c1", 4), ("c2", 5), ("c3", 6)]
    assert all(passed <= limit + 3 - 1 for _, passed in served)


def test_next_cold_names_the_model_closest_to_its_turn():
    policy = fifo_deferral(5)
    policy.decide({"a": cand("a", 0, cold=True), "hot": cand("hot", 9)}, 0.0)    # a: 1 pass
    d = policy.decide({"a": cand("a", 0, cold=True), "b": cand("b", 1, cold=True), "hot": cand("hot", 9)}, 0.0)
    assert (d.model, d.next_cold, set(d.deferred)) == ("hot", "a", {"a", "b"})


def test_deferral_under_fair_keeps_the_device_time_shares():
    """Model a is cold every time it comes up (evicted after each run); b stays resident. Each
    costs 1 s per dispatch and both are always backlogged: deferral reorders, but the resident
    winner pays with a debt, so over a long run each still gets half the device time."""
    costs = CostModel(30.0)
    costs.observe("a", 1, 1.0, 0.0)
    costs.observe("b", 1, 1.0, 0.0)
    policy = ColdDeferral(DeficitRoundRobin(costs, lambda name: 1.0), costs, 4)
    counts = {"a": 0, "b": 0}
    a_cold = True
    for step in range(400):
        d = policy.decide({"a": cand("a", step, cold=a_cold), "b": cand("b", step)}, 0.0)
        counts[d.model] += 1
        a_cold = d.model != "a"       # a stays warm for the dispatch right after its own
    assert abs(counts["a"] - counts["b"]) <= 8, counts


def test_a_debt_is_kept_across_an_idle_spell():
    costs = CostModel(30.0)
    costs.observe("a", 1, 1.0, 0.0)
    costs.observe("b", 1, 1.0, 0.0)
    drr = DeficitRoundRobin(costs, lambda name: 1.0)
    both = {"a": cand("a", 0), "b": cand("b", 1)}
    assert drr.pick(both, 0.0) == "a"                  # credit now a 0, b 1: b is owed
    assert drr.pick(both, 0.0, among=("a",)) == "a"    # a runs again before it could pay: debt 1
    assert drr.pick({"b": cand("b", 1)}, 0.0) == "b"   # a idle meanwhile
    # a still owes: without the debt the tie would go to a (longer since its last turn)
    assert drr.pick(both, 0.0) == "b"


def test_residency_plan_evicts_models_with_queued_work_last():
    book = ResidencyBook(300)
    for key in ("a", "b", "c", "new"):
        book.add(key, 100, Floor.SYSTEM)
    for key in ("a", "b", "c"):
        book.begin_load(key)
        book.finish_load(key)
    assert book.plan("new").evict == ("a",)                       # least recently used
    assert book.plan("new", spare={"a"}).evict == ("b",)          # a has queued work
    assert book.plan("new", spare={"a", "b", "c"}).evict == ("a",)  # no other way: the policy's order
    assert book.plan("new", protect=("b",), spare={"a", "c"}).evict == ("a",)


# ---- the scheduler over a fake weight cache ----------------------------------------------

class FakeCache:
    """Holds ``capacity`` models, LRU, evicting models with queued work last (as the real cache
    does); a load sleeps ``load`` seconds on the Trio clock."""

    def __init__(self, capacity: int, load: float, resident=()) -> None:
        self.capacity = capacity
        self.load = load
        self.resident: OrderedDict[str, None] = OrderedDict.fromkeys(resident)
        self.queued: frozenset[str] = frozenset()
        self.loads: list[tuple[float, str]] = []
        self.hints: list[str] = []

    def load_estimate(self, model) -> float:
        return 0.0 if model.name in self.resident else self.load

    def set_queued(self, models) -> None:
        self.queued = frozenset(m.name for m in models)

    def hint_next(self, model) -> None:
        self.hints.append(model.name)

    async def ensure_resident(self, model):
        if model.name in self.resident:
            self.resident.move_to_end(model.name)
            return ()
        while len(self.resident) >= self.capacity:
            idle = [n for n in self.resident if n not in self.queued]
            del self.resident[idle[0] if idle else next(iter(self.resident))]
        self.loads.append((trio.current_time(), model.name))
        await trio.sleep(self.load)
        self.resident[model.name] = None
        return ()


def run_with(cache: FakeCache, test, cfg, cost):
    async def main():
        async with trio.open_nursery() as nursery:
            h = Harness(cfg, cost, nursery, weights=cache)
            await h.start()
            await test(h)
            nursery.cancel_scope.cancel()
    trio.run(main, clock=MockClock(autojump_threshold=0))


# one request per execution: a closed loop of four clients always has requests queued
ONE_ROW = {"h1": {"max_batch_size": 1}, "h2": {"max_batch_size": 1}}


@pytest.mark.parametrize("limit", [1, 4, 8])
def test_a_cold_model_waits_at_most_its_bound_under_fair(limit):
    """Two resident models in closed loops and a cold newcomer: under ``fair`` it is dispatched
    after at most limit + B - 1 = limit + 2 dispatches of other models (B = 3 backlogged
    models), i.e. within (limit + 2) x 1 ms of device time plus its own load, although its
    unmeasured cost (charged 50 ms) would have kept it waiting about 50 dispatches otherwise."""
    cache = FakeCache(capacity=3, load=0.004, resident=("h1", "h2"))
    cost = {"h1": per_batch(0.001), "h2": per_batch(0.001), "cold": per_batch(0.001)}

    async def test(h):
        h.closed_loop("h1", 4)
        h.closed_loop("h2", 4)
        await trio.sleep(0.1)
        sent = trio.current_time()
        await h.infer("cold")
        log = h.device.log
        at = next(i for i, e in enumerate(log) if e[1] == "cold")
        before = [e for e in log[:at] if e[0] >= sent]
        assert 0 < len(before) <= limit + 2
        assert log[at][0] - sent <= (limit + 2) * 0.001 + 0.004 + 1e-9   # its load comes first
        assert cache.loads == [(log[at][0] - 0.004, "cold")]    # one load, then the execution

    run_with(cache, test, config(discipline="fair", cold_defer_dispatches=limit, models=ONE_ROW), cost)


def test_without_deferral_the_fair_newcomer_waits_for_its_credit():
    """The contrast for the test above: with ``cold_defer_dispatches: 0`` the same newcomer
    waits until its conservative 50 ms charge is earned (about 50 dispatches of 1 ms)."""
    cache = FakeCache(capacity=3, load=0.004, resident=("h1", "h2"))
    cost = {"h1": per_batch(0.001), "h2": per_batch(0.001), "cold": per_batch(0.001)}

    async def test(h):
        h.closed_loop("h1", 4)
        h.closed_loop("h2", 4)
        await trio.sleep(0.1)
        sent = trio.current_time()
        await h.infer("cold")
        log = h.device.log
        at = next(i for i, e in enumerate(log) if e[1] == "cold")
        assert len([e for e in log[:at] if e[0] >= sent]) > 40

    run_with(cache, test, config(discipline="fair", cold_defer_dispatches=0, models=ONE_ROW), cost)


def amortize(limit: int):
    """A resident model in a closed loop of four clients, one request per execution (so it always has requests queued);
    five requests for a cold model arrive 1 ms apart. The
    cache holds one model, so a load of either evicts the other."""
    cache = FakeCache(capacity=1, load=0.004, resident=("hot",))
    cost = {"hot": per_batch(0.001), "cold": per_batch(0.001)}
    out = {}

    async def test(h):
        h.closed_loop("hot", 4)
        await trio.sleep(0.05)
        start = len(h.device.log)
        await h.trickle("cold", 5, gap=0.001)
        await trio.sleep(0.05)
        out["loads"] = len(cache.loads)
        out["cold_rows"] = [sum(e[3]) for e in h.device.log if e[1] == "cold"]
        out["hot"] = sum(1 for e in h.device.log[start:] if e[1] == "hot")

    run_with(cache, test, config(discipline="fifo", cold_defer_dispatches=limit,
                                 models={"hot": {"max_batch_size": 1}}), cost)
    return out


def test_deferral_coalesces_a_cold_models_requests_so_one_load_serves_them():
    off, on = amortize(0), amortize(8)
    assert sum(off["cold_rows"]) == sum(on["cold_rows"]) == 5
    assert len(off["cold_rows"]) > 1               # fifo alone: two loads for five requests
    assert on["cold_rows"] == [5]                  # gathered while the hot model ran: one load
    assert on["loads"] < off["loads"]              # (each load of cold also costs hot a reload)
    assert on["hot"] >= off["hot"]                 # and the resident model lost nothing


def test_the_prefetch_hint_names_the_deferred_cold_model():
    """While the cold model waits, each resident dispatch hints it (not the resident model of the
    oldest request, which needs no copy), so that its load can overlap those executions."""
    cache = FakeCache(capacity=3, load=0.004, resident=("h1",))
    cost = {"h1": per_batch(0.001), "cold": per_batch(0.001)}

    async def test(h):
        h.closed_loop("h1", 4)
        await trio.sleep(0.01)
        cache.hints.clear()
        await h.infer("cold")
        assert cache.hints.count("cold") >= 3

    run_with(cache, test, config(discipline="fifo", cold_defer_dispatches=4,
                                 models={"h1": {"max_batch_size": 1}}), cost)
