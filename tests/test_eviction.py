"""Replacement policies of the weight cache and the offline simulator: pure, no server, no device."""
from __future__ import annotations

import pytest

from benchmarks.cache_sim import Trace, next_uses, replay, synthetic
from xlaserve.runtime.eviction import (DEFAULT_POLICY, GreedyDualSizeFrequency, LeastRecentlyUsed, LoadCost,
                                       make_policy)
from xlaserve.runtime.residency import Floor, ResidencyBook

MB = 1 << 20
UNIT = lambda key, nbytes: 1.0      # noqa: E731 -- every load costs the same

# Belady's classic example: with room for 3, LRU misses 10 times and MIN 7.
CLASSIC = tuple("abcdabeabcde")


def unit_trace(refs, slots: int, cost=UNIT) -> Trace:
    sizes = {k: MB for k in refs}
    return Trace("t", tuple(refs), sizes, slots * MB, cost)


def test_known_trace_gives_known_misses_for_lru_gdsf_and_min():
    trace = unit_trace(CLASSIC, 3)
    assert replay(trace, "lru").misses == 10
    assert replay(trace, "min").misses == 7
    # gdsf, worked by hand: b, c, d, e enter on probation (referenced no more often than the next
    # victim), so a stays; b earns its place on its second reference; c, d, e then miss.
    assert replay(trace, "gdsf").misses == 9
    for policy in ("lru", "gdsf", "min"):
        result = replay(trace, policy)
        assert result.requests == 12 and result.bytes_copied == result.misses * MB


def test_next_use_is_the_index_of_the_next_reference():
    assert next_uses(("a", "b", "a", "c")) == [2, float("inf"), float("inf"), float("inf")]


def test_gdsf_evicts_the_big_model_before_small_ones_used_as_often():
    book = ResidencyBook(4 * MB, GreedyDualSizeFrequency(lambda key, nbytes: 1.0, admission=False))
    for key, nbytes in (("big", 3 * MB), ("small", MB), ("new", MB)):
        book.add(key, nbytes, Floor.SYSTEM)
    for key in ("small", "big"):                # small is the least recently used
        book.begin_load(key)
        book.finish_load(key)
        book.touch(key)
    assert book.plan("new").evict == ("big",)
    lru = ResidencyBook(4 * MB)
    for key, nbytes in (("big", 3 * MB), ("small", MB), ("new", MB)):
        lru.add(key, nbytes, Floor.SYSTEM)
    for key in ("small", "big"):
        lru.begin_load(key)
        lru.finish_load(key)
        lru.touch(key)
    assert lru.plan("new").evict == ("small",)


def test_gdsf_keeps_the_model_that_costs_more_to_load():
    costs = {"slow": 5.0, "fast": 1.0}
    book = ResidencyBook(2 * MB, GreedyDualSizeFrequency(lambda key, nbytes: costs.get(key, 1.0), admission=False))
    for key in ("slow", "fast", "new"):
        book.add(key, MB, Floor.SYSTEM)
    for key in ("slow", "fast"):
        book.begin_load(key)
        book.finish_load(key)
        book.touch(key)
    assert book.plan("new").evict == ("fast",)


def test_gdsf_ages_a_formerly_hot_model_out():
    policy = GreedyDualSizeFrequency(UNIT, admission=False)
    book = ResidencyBook(2 * MB, policy)
    for key in ("old", *(f"m{i}" for i in range(40))):
        book.add(key, MB, Floor.SYSTEM)
    book.begin_load("old")
    book.finish_load("old")
    for _ in range(100):
        book.touch("old")
    assert policy._standing["old"].frequency == policy.max_frequency == 16     # saturates
    evicted_old_at = None
    for i in range(40):                          # a stream of other models, each used once
        key = f"m{i}"
        plan = book.plan(key)
        for victim in plan.evict:
            book.evict(victim)
            if victim == "old":
                evicted_old_at = i
        book.begin_load(key)
        book.finish_load(key)
        book.touch(key)
    # each eviction raises the clock by about one reference's worth: old goes after ~16
    assert evicted_old_at is not None and 10 <= evicted_old_at <= 20
    assert policy.clock > 0


def test_pinned_loading_and_protected_models_are_never_victims_under_gdsf():
    book = ResidencyBook(3 * MB, GreedyDualSizeFrequency(UNIT))
    book.add("pinned", MB, Floor.DEVICE)
    book.add("busy", MB, Floor.SYSTEM)
    book.add("idle", MB, Floor.SYSTEM)
    book.add("new", 2 * MB, Floor.SYSTEM)
    for key in ("pinned", "busy", "idle"):
        book.begin_load(key)
        book.finish_load(key)
    assert book.plan("new", protect=("busy",)).refused
    assert set(book.plan("new").evict) == {"busy", "idle"}
    assert "pinned" not in book.evictable()


def test_admission_puts_a_one_off_model_first_in_line():
    policy = GreedyDualSizeFrequency(UNIT)
    book = ResidencyBook(3 * MB, policy)
    for key in ("hot", "warm", "once", "next"):
        book.add(key, MB, Floor.SYSTEM)
    for key in ("hot", "warm"):
        book.begin_load(key)
        book.finish_load(key)
        book.touch(key)
        book.touch(key)                          # referenced twice each
    book.begin_load("once")                      # referenced once: on probation
    book.finish_load("once")
    book.touch("once")
    assert next(book.evictable()) == "once"
    assert book.plan("next").evict == ("once",)


def test_release_forgets_a_model_and_a_failed_load_leaves_no_trace():
    policy = GreedyDualSizeFrequency(UNIT)
    book = ResidencyBook(2 * MB, policy)
    book.add("a", MB, Floor.SYSTEM)
    book.begin_load("a")
    book.finish_load("a", ok=False)
    assert list(policy.victims()) == []
    book.begin_load("a")
    book.finish_load("a")
    book.remove("a")
    assert list(policy.victims()) == [] and "a" not in policy._counts


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="expected one of gdsf, lru"):
        make_policy("fifo", UNIT)
    assert DEFAULT_POLICY == "gdsf"
    assert isinstance(make_policy("lru", UNIT), LeastRecentlyUsed)


def test_load_cost_learns_overhead_plus_bytes_over_bandwidth():
    cost = LoadCost(default_bandwidth=1e9)
    assert cost(2 * MB) == pytest.approx(2 * MB / 1e9)           # nothing measured yet
    for nbytes in (MB, 4 * MB, MB, 4 * MB):                       # 1 ms + 1 ms per MiB
        cost.observe(nbytes, 1e-3 + 1e-3 * nbytes / MB)
    assert cost(2 * MB) == pytest.approx(3e-3)
    assert cost(2 * MB, "disk") == pytest.approx(2 * MB / 1e9)  # another source learns apart
    one_size = LoadCost()
    for seconds in (1e-3, 3e-3):
        one_size.observe(MB, seconds)
    assert one_size(MB) == pytest.approx(2e-3, rel=0.05)
    assert one_size(2 * MB) == pytest.approx(2 * one_size(MB))


def test_noisy_loads_give_a_sane_line():
    cost = LoadCost()
    cost.observe(MB, 1e-3)
    cost.observe(MB, 5e-3)
    cost.observe(2 * MB, 3e-3)               # no slope in that noise: one flat cost, never negative
    assert cost(2 * MB) == pytest.approx(cost(MB)) and cost(MB) > 0
    cost.observe(2 * MB, 9e-3)
    assert cost(2 * MB) > cost(MB) > 0


def test_simulator_is_deterministic_and_gdsf_beats_lru_on_zipf_at_5x():
    a = synthetic("zipf:1.0", 5, 4000, seed=3)
    b = synthetic("zipf:1.0", 5, 4000, seed=3)
    assert a.refs == b.refs and a.sizes == b.sizes and a.budget == b.budget
    assert synthetic("zipf:1.0", 5, 4000, seed=4).refs != a.refs
    lru, gdsf, best = (replay(a, p) for p in ("lru", "gdsf", "min"))
    assert best.misses < gdsf.misses < lru.misses
    assert replay(a, "gdsf") == gdsf                                # replays are repeatable


def test_shifting_popularity_changes_the_hot_set():
    trace = synthetic("shift:1.0", 2, 4000, seed=1, shift_every=1000)
    first, last = set(trace.refs[:1000]), trace.refs[3000:]
    top_first = max(first, key=trace.refs[:1000].count)
    top_last = max(set(last), key=last.count)
    assert top_first != top_last


def test_catalog_that_fits_misses_only_once_per_model():
    trace = synthetic("zipf:1.0", 1, 3000, seed=2)
    for policy in ("lru", "gdsf", "min"):
        assert replay(trace, policy).misses == len(set(trace.refs))


class _SortedGdsf(GreedyDualSizeFrequency):
    """The order as a full sort of every resident model (how the policy computed it before the
    heap): the reference the heap must equal."""

    def _fresh(self, key):
        # the priority from the cost as it is now, nothing kept (the policy keeps a cost per byte
        # a generation: this is what it must equal)
        s = self._standing[key]
        return s.clock + s.frequency * self._cost(key, s.nbytes) / max(1, s.nbytes)

    def priority(self, key):
        return self._fresh(key)

    def _order(self):
        return sorted(self._standing, key=lambda k: (self._fresh(k), self._standing[k].seq))

    def _top(self):
        order = self._order()
        return order[0] if order else None

    def victims(self):
        return iter(self._order())


@pytest.mark.parametrize("seed", range(6))
def test_gdsf_heap_order_equals_the_sort_on_random_sequences(seed):
    import random
    rng = random.Random(seed)
    keys = [f"m{i}" for i in range(12)]
    sizes = {k: rng.choice((1, 2, 3)) * MB for k in keys}
    costs = {k: rng.choice((0.5, 1.0, 2.0)) for k in keys}
    generation = [0]
    cost = lambda key, nbytes: costs[key] * nbytes / MB     # noqa: E731
    heap = GreedyDualSizeFrequency(cost, cost_generation=lambda: generation[0], max_frequency=4)
    ref = _SortedGdsf(cost, cost_generation=lambda: generation[0], max_frequency=4)
    for step in range(1500):
        op = rng.random()
        resident = list(ref._standing)
        if op < 0.3 or not resident:
            key = rng.choice(keys)
            for p in (heap, ref):
                p.insert(key, sizes[key])
        elif op < 0.75:
            key = rng.choice(resident)
            first = rng.random() < 0.1
            for p in (heap, ref):
                p.hit(key, first=first)
        elif op < 0.9:
            key = next(ref.victims()) if rng.random() < 0.8 else rng.choice(resident)
            evicted = rng.random() < 0.9
            for p in (heap, ref):
                p.remove(key, evicted=evicted)
        elif op < 0.95:
            key = rng.choice(keys)
            for p in (heap, ref):
                p.forget(key)
        else:                                   # the cost is learned: every priority may move
            costs[rng.choice(keys)] = rng.choice((0.5, 1.0, 2.0, 4.0))
            generation[0] += 1
        assert list(heap.victims()) == list(ref.victims()), step
        assert heap.clock == ref.clock and heap._counts == ref._counts
    assert len(heap._heap) <= 2 * len(heap._standing) + 32 + 12    # stale entries do not pile up


def test_gdsf_without_a_cost_generation_takes_the_cost_as_fixed_and_with_one_follows_it():
    costs = {"a": 1.0, "b": 2.0}
    generation = [0]
    policy = GreedyDualSizeFrequency(lambda key, nbytes: costs[key], admission=False,
                                     cost_generation=lambda: generation[0])
    for key in ("a", "b"):
        policy.insert(key, MB)
    assert list(policy.victims()) == ["a", "b"]
    costs["a"] = 3.0
    generation[0] += 1
    assert list(policy.victims()) == ["b", "a"]


def test_load_cost_answers_again_from_memory_until_the_next_load():
    cost = LoadCost()
    cost.observe(MB, 1e-3)
    before = cost.generation
    guess = cost(2 * MB)
    assert guess == pytest.approx(2e-3) and cost(2 * MB) == guess
    cost.observe(2 * MB, 5e-3)
    assert cost.generation == before + 1
    assert cost(2 * MB) > 3e-3                # the new load moved the line, not a remembered answer
    cost.observe(MB, float("nan"))           # ignored: no change
    assert cost.generation == before + 1


def test_load_cost_keeps_its_answers_while_loads_move_the_line_less_than_the_tolerance():
    cost = LoadCost(tolerance=0.05)
    for _ in range(8):
        cost.observe(MB, 1e-3)
        cost.observe(4 * MB, 4e-3)
    generation, one, four = cost.generation, cost(MB), cost(4 * MB)
    cost.observe(4 * MB, 4.1e-3)               # moves the line about 0.3%: the same answers
    assert cost.generation == generation and cost(MB) == one and cost(4 * MB) == four
    for _ in range(60):                         # the device got twice as slow: drift adds up
        cost.observe(4 * MB, 8e-3)
        if cost.generation != generation:
            break
    assert cost.generation == generation + 1
    assert cost(4 * MB) > four * 1.05           # the new answers follow the loads
    assert cost(4 * MB) - four < 0.2 * four     # ... from the first move past the tolerance


@pytest.mark.parametrize("policy", ["lru", "gdsf"])
def test_residency_book_running_sums_equal_a_scan(policy):
    import random
    rng = random.Random(7)
    book = ResidencyBook(8 * MB, make_policy(policy, UNIT))
    keys = [f"m{i}" for i in range(10)]
    for step in range(3000):
        key = rng.choice(keys)
        op = rng.random()
        if key not in book:
            book.add(key, rng.choice((1, 2, 3)) * MB, Floor.DEVICE if rng.random() < 0.1 else Floor.SYSTEM)
        elif op < 0.35:
            plan = book.plan(key)
            if plan.ok and not book.is_resident(key) and key not in book.lru_order():
                for victim in plan.evict:
                    book.evict(victim)
                book.begin_load(key)
                book.finish_load(key, ok=rng.random() < 0.9)
        elif op < 0.6:
            book.touch(key)
        elif op < 0.75 and book.is_resident(key) and book.floor(key) is not Floor.DEVICE:
            book.evict(key)
        elif op < 0.85:
            book.set_floor(key, rng.choice(list(Floor)))
        elif op < 0.9:
            book.set_budget(rng.choice((6, 8, 10)) * MB)
        else:
            book.remove(key)
        entries = book._entries
        assert book.used_bytes() == sum(entries[k].nbytes for k in book.lru_order()), step
        assert book.resident_bytes() == sum(e.nbytes for e in entries.values() if e.resident), step
        assert book.pinned_bytes() == sum(e.nbytes for e in entries.values() if e.floor is Floor.DEVICE), step


def test_load_cost_checks_only_the_extreme_sizes_and_agrees_with_checking_every_one():
    """The O(1) check (smallest and largest size asked) changes the generation exactly when a
    check of every size asked about would, over random loads and questions."""
    import random
    rng = random.Random(25)
    cost = LoadCost(tolerance=0.05)
    sizes = [rng.randrange(1, 64) * MB // 4 for _ in range(40)]
    asked: set[int] = set()
    for step in range(3000):
        if rng.random() < 0.3:
            size = rng.choice(sizes)
            asked.add(size)
            cost(size)
            continue
        size = rng.choice(sizes)
        answers = {n: cost._known[(n, "host")] for n in asked}
        before = cost.generation
        cost.observe(size, (0.2e-3 + size / 5e9) * rng.uniform(0.7, 1.3))
        line = cost._fit("host")
        moved = any(abs(cost._at(line, n) - was) > 0.05 * was for n, was in answers.items())
        assert (cost.generation != before) == moved, step
        if moved:
            asked.clear()


def test_load_cost_measures_a_move_against_what_is_charged_in_all():
    """With ``charged_beside`` (the cache's fixed miss overhead) a 20% wobble of a small copy
    is about 1% of the miss: the answers stay; without it they change."""
    def changes(cost: LoadCost) -> bool:
        cost.observe(MB // 4, 30e-6)
        cost(MB // 4)
        generation = cost.generation
        for _ in range(3):
            cost.observe(MB // 4, 36e-6)
        return cost.generation != generation
    assert changes(LoadCost()) and not changes(LoadCost(charged_beside=5e-4))
