"""lpt_packing's placement (xlaserve.gateway.placement): place, a pure function, loads and budgets in;
the Rebalancer, which decides when to place again and from what loads; residency_for."""
from __future__ import annotations

import math

import pytest

from xlaserve.gateway.placement import ModelLoad, OverBudget, Rebalancer, WorkerBudget, place, residency_for

GiB = 1 << 30


def workers(n: int, budget: int = 10 * GiB) -> list[WorkerBudget]:
    return [WorkerBudget(f"w{i}", budget) for i in range(n)]


def test_lpt_balances_compute_across_two_workers():
    # LPT on [7, 5, 4, 3, 3, 2]: 7+3+2 = 12 against 5+4+3 = 12
    models = [ModelLoad(f"m{load}{i}", load, GiB) for i, load in enumerate([7, 5, 4, 3, 3, 2])]
    p = place(models, workers(2))
    assert sorted(p.load_of.values()) == [12.0, 12.0]
    assert all(len(ws) == 1 for ws in p.workers_of.values())
    assert p.over_budget == ()


def test_the_heaviest_model_goes_first_and_the_least_loaded_worker_takes_each_next():
    p = place([ModelLoad("small", 1.0, 1), ModelLoad("big", 5.0, 1), ModelLoad("mid", 3.0, 1)], workers(2))
    assert p.workers_of["big"] == ("w0",)          # first, ties by name
    assert p.workers_of["mid"] == ("w1",)
    assert p.workers_of["small"] == ("w1",)        # w1 (3.0) is lighter than w0 (5.0)


def test_memory_decides_when_no_worker_has_room_for_the_least_loaded_choice():
    # w0 has the least load but no room for the 6 GiB model: it goes to w1
    ws = [WorkerBudget("w0", 8 * GiB), WorkerBudget("w1", 8 * GiB)]
    p = place([ModelLoad("a", 5.0, 4 * GiB), ModelLoad("b", 4.0, 4 * GiB), ModelLoad("c", 1.0, 4 * GiB),
               ModelLoad("d", 0.5, 3 * GiB)], ws)
    assert p.workers_of == {"a": ("w0",), "b": ("w1",), "c": ("w1",), "d": ("w0",)}
    assert p.over_budget == ()
    assert all(p.bytes_of[w.name] <= w.budget_bytes for w in ws)


def test_a_catalog_of_1_6_budgets_fits_on_two_workers_with_zipf_loads():
    """Issue 15's memory-aware scenario: weights 1.6x one worker's budget, Zipf(1) traffic."""
    budget = 10 * GiB
    n = 16
    size = int(1.6 * budget / n)
    models = [ModelLoad(f"m{k:02d}", 1.0 / (k + 1), size) for k in range(n)]
    p = place(models, workers(2, budget))
    assert p.over_budget == ()
    assert all(b <= budget for b in p.bytes_of.values())
    assert sum(p.bytes_of.values()) == n * size
    assert abs(p.load_of["w0"] - p.load_of["w1"]) <= models[0].load      # within one job of balanced
    assert all(len(ws) == 1 for ws in p.workers_of.values())


def test_replicas_go_to_distinct_workers_and_share_the_load():
    p = place([ModelLoad("hot", 8.0, GiB, replicas=2), ModelLoad("cold", 1.0, GiB)], workers(3))
    assert len(set(p.workers_of["hot"])) == 2
    loads = sorted(p.load_of.values())
    assert loads == [1.0, 4.0, 4.0]                 # each replica of hot carries half
    assert p.workers_of["cold"][0] not in p.workers_of["hot"]     # the third, idle worker


@pytest.mark.parametrize("default, expected", [(1, 1), (2, 2), ("all", 3), (5, 3)])
def test_default_replicas_and_the_cap_at_the_worker_count(default, expected):
    p = place([ModelLoad("m", 3.0, GiB), ModelLoad("own", 1.0, GiB, replicas=1)], workers(3), default)
    assert len(p.workers_of["m"]) == expected
    assert len(set(p.workers_of["m"])) == expected
    assert p.workers_of["own"] and len(p.workers_of["own"]) == 1
    assert math.isclose(sum(p.load_of.values()), 4.0)


def test_models_without_measured_load_spread_by_memory():
    p = place([ModelLoad(f"m{i}", 0.0, (i + 1) * GiB) for i in range(4)], workers(2))
    assert p.bytes_of["w0"] == p.bytes_of["w1"] == 5 * GiB     # 4+1 and 3+2
    assert set(p.load_of.values()) == {0.0}


def test_over_budget_is_placed_anyway_and_reported():
    ws = [WorkerBudget("w0", 2 * GiB), WorkerBudget("w1", 2 * GiB)]
    p = place([ModelLoad("a", 2.0, 2 * GiB), ModelLoad("b", 1.0, 2 * GiB), ModelLoad("c", 0.5, GiB)], ws)
    assert set(p.workers_of) == {"a", "b", "c"}
    assert p.over_budget == (OverBudget("w1", ("b", "c"), 3 * GiB, 2 * GiB),)


def test_the_result_does_not_depend_on_the_order_models_come_in():
    models = [ModelLoad(f"m{i}", float(i % 3), GiB * (1 + i % 2), replicas=1 + i % 2) for i in range(9)]
    first = place(models, workers(3))
    second = place(list(reversed(models)), list(reversed(workers(3))))
    assert dict(first.workers_of) == dict(second.workers_of)


def test_models_on_lists_each_workers_models():
    p = place([ModelLoad("a", 2.0, 1), ModelLoad("b", 1.0, 1), ModelLoad("c", 1.0, 1)], workers(2))
    assert p.models_on("w0") == ("a",)
    assert p.models_on("w1") == ("b", "c")


@pytest.mark.parametrize("models, ws, default, message", [
    ([ModelLoad("m", 1.0, 1)], [], 1, "no workers"),
    ([ModelLoad("m", -1.0, 1)], workers(1), 1, "model 'm': load must be >= 0"),
    ([ModelLoad("m", float("nan"), 1)], workers(1), 1, "model 'm': load must be >= 0"),
    ([ModelLoad("m", 1.0, -5)], workers(1), 1, "model 'm': weight_bytes must be >= 0"),
    ([ModelLoad("m", 1.0, 1, replicas=0)], workers(1), 1, "model 'm': replicas must be an integer >= 1 or 'all'"),
    ([ModelLoad("m", 1.0, 1)], workers(1), "some", "replicas must be an integer >= 1 or 'all', not 'some'"),
    ([ModelLoad("m", 1.0, 1), ModelLoad("m", 2.0, 1)], workers(1), 1, "model 'm' is given twice"),
    ([ModelLoad("m", 1.0, 1)], [WorkerBudget("w", 1), WorkerBudget("w", 1)], 1, "worker 'w' is given twice"),
    ([ModelLoad("m", 1.0, 1)], [WorkerBudget("w", -1)], 1, "worker 'w': budget_bytes must be >= 0"),
])
def test_bad_input_is_refused_naming_what(models, ws, default, message):
    with pytest.raises(ValueError, match=message):
        place(models, ws, default)


def test_a_small_change_in_load_moves_nothing_and_a_large_one_rebalances():
    workers = [WorkerBudget("w0", 100), WorkerBudget("w1", 100)]
    loads = {"a": 0.50, "b": 0.30, "c": 0.20, "d": 0.05}
    first = place([ModelLoad(n, l, 10) for n, l in loads.items()], workers)
    # "a" and "b" trade places in the heaviest-first order: a fresh placement swaps their hosts
    nudged = {**loads, "a": 0.30, "b": 0.31}
    assert place([ModelLoad(n, l, 10) for n, l in nudged.items()], workers).workers_of["a"] != first.workers_of["a"]
    assert place([ModelLoad(n, l, 10) for n, l in nudged.items()], workers,
                 previous=first.workers_of).workers_of == first.workers_of
    # "a" and "b" both become heavy: keeping the old hosts would leave one worker with 1.2 of 1.35
    heavy = {"a": 0.6, "b": 0.6, "c": 0.1, "d": 0.05}
    fresh = place([ModelLoad(n, l, 10) for n, l in heavy.items()], workers)
    moved = place([ModelLoad(n, l, 10) for n, l in heavy.items()], workers, previous=first.workers_of)
    assert moved.workers_of["a"] != moved.workers_of["b"]
    assert max(moved.load_of.values()) == max(fresh.load_of.values())
    # a previous host without room is left
    tight = [WorkerBudget("w0", 10), WorkerBudget("w1", 100)]
    assert place([ModelLoad("a", 1.0, 50)], tight, previous={"a": ("w0",)}).workers_of["a"] == ("w1",)


# ---- when to place again: the Rebalancer -------------------------------------------------------
SIZES = {"a": GiB, "b": GiB, "c": GiB}


def test_the_first_placement_is_by_size_and_nothing_changed_keeps_it():
    r = Rebalancer(30.0, now=0.0)
    first = r.decide(workers(2), ("a", "b"), SIZES, {}, now=1.0)
    assert first.by_size and first.placement is r.placement
    assert sorted(ws for m in ("a", "b") for ws in first.placement.workers_of[m]) == ["w0", "w1"]
    # the same workers and models, under rebalance_compute_seconds of device time: no new placement
    assert r.decide(workers(2), ("a", "b"), SIZES, {("w0", "a"): 29.0}, now=100.0) is None
    assert r.placement is first.placement


def test_a_new_model_or_worker_places_again_at_once():
    r = Rebalancer(30.0, now=0.0)
    r.decide(workers(2), ("a", "b"), SIZES, {}, now=1.0)
    assert set(r.decide(workers(2), ("a", "b", "c"), SIZES, {}, now=2.0).placement.workers_of) == {"a", "b", "c"}
    assert "w2" in r.decide(workers(3), ("a", "b", "c"), SIZES, {}, now=3.0).placement.load_of


def test_measured_device_time_places_again_with_each_models_load_over_the_span():
    r = Rebalancer(30.0, replicas_for=lambda m: None, now=0.0)
    r.decide(workers(2), ("a", "b"), SIZES, {("w0", "a"): 5.0}, now=10.0)
    # since then, 40 s of device time in 100 s: "a" 30 s (on two workers), "b" 10 s
    decided = r.decide(workers(2), ("a", "b"), SIZES,
                       {("w0", "a"): 25.0, ("w1", "a"): 10.0, ("w1", "b"): 10.0}, now=110.0)
    assert not decided.by_size and decided.measured_seconds == pytest.approx(40.0)
    assert sorted(decided.placement.load_of.values()) == pytest.approx([0.1, 0.3])
    # a counter that went back (a worker restarted) counts as no time, never as negative time
    assert r.decide(workers(2), ("a", "b"), SIZES, {("w0", "a"): 0.0}, now=120.0) is None


def test_replica_counts_come_from_the_model_or_the_default():
    r = Rebalancer(30.0, "all", lambda m: 1 if m == "b" else None, now=0.0)
    placed = r.decide(workers(3), ("a", "b"), SIZES, {}, now=1.0).placement.workers_of
    assert len(placed["a"]) == 3 and len(placed["b"]) == 1


@pytest.mark.parametrize("current, placed_here, wanted", [
    ("system", True, None), ("unpinned", True, "system"),
    ("system", False, "unpinned"), ("unpinned", False, None),
    ("device", False, None), ("device", True, None), (None, True, None),
])
def test_residency_for_keeps_host_copies_where_a_model_is_placed_and_leaves_pins(current, placed_here, wanted):
    workers_of = {"m": ("w0",) if placed_here else ("w1",)}
    assert residency_for("w0", "m", current, workers_of) == wanted
