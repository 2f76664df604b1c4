"""The weight cache: residency policy (pure) and the cache itself on the real cpu device."""
from __future__ import annotations

import dataclasses
import gc
import logging
import threading
from types import MappingProxyType, SimpleNamespace

import numpy as np
import pytest
import trio
from safetensors.numpy import save_file

from xlaserve.bundle import ModelVersion, read_weights
from xlaserve.errors import FailedPrecondition, Unavailable
from xlaserve.runtime.pjrt import CompiledMemory, Device
from xlaserve.runtime.eviction import GreedyDualSizeFrequency
from xlaserve.runtime.residency import Budget, Floor, ResidencyBook, ThrashMonitor
from xlaserve.config import RuntimeConfig
from xlaserve.runtime.weights import CatalogTooLarge, WeightCache, budget_for

MB = 1 << 20


# ---- policy ---------------------------------------------------------------------------------

def test_lru_evicts_least_recently_used_first():
    book = ResidencyBook(3 * MB)
    for k in "abcd":
        assert book.add(k, MB, Floor.SYSTEM) == ""
    for k in "abc":
        assert book.plan(k).ok and not book.plan(k).evict
        book.begin_load(k)
        book.finish_load(k)
    book.touch("a")                     # b is now the least recently used
    plan = book.plan("d")
    assert plan.evict == ("b",)
    book.evict("b")
    book.begin_load("d")
    book.finish_load("d")
    assert book.lru_order() == ("c", "a", "d")
    assert book.resident_bytes() == 3 * MB and book.free_bytes() == 0


def test_pinned_and_protected_models_are_never_chosen():
    book = ResidencyBook(3 * MB)
    book.add("pinned", MB, Floor.DEVICE)
    book.add("busy", MB, Floor.SYSTEM)
    book.add("idle", MB, Floor.SYSTEM)
    book.add("new", 2 * MB, Floor.SYSTEM)
    for k in ("pinned", "busy", "idle"):
        book.begin_load(k)
        book.finish_load(k)
    assert book.plan("new", protect=("busy",)).refused   # only 'idle' (1 MB) may go; 2 MB needed
    assert book.plan("new").evict == ("busy", "idle")
    with pytest.raises(ValueError, match="pinned"):
        book.evict("pinned")
    assert "more than is free" in book.plan("new", may_evict=False).refused


def test_floor_admission_gives_the_numbers():
    book = ResidencyBook(2 * MB)
    reason = book.add("huge", 3 * MB, Floor.SYSTEM)
    assert "3.0 MiB (3145728 bytes)" in reason and "2.0 MiB (2097152 bytes)" in reason
    assert book.add("p1", MB + 1, Floor.DEVICE) == ""
    assert "already pinned" in book.add("p2", MB, Floor.DEVICE)
    book.add("s", MB, Floor.SYSTEM)
    assert "already pinned" in book.set_floor("s", Floor.DEVICE)
    assert book.set_floor("s", Floor.UNPINNED) == "" and book.floor("s") is Floor.UNPINNED


def test_loading_reserves_bytes_and_a_failed_copy_returns_them():
    book = ResidencyBook(2 * MB)
    book.add("a", MB, Floor.SYSTEM)
    book.add("b", 2 * MB, Floor.SYSTEM)
    book.begin_load("a")
    assert book.free_bytes() == MB and book.plan("b").refused   # a loading model is not evictable
    book.finish_load("a", ok=False)
    assert book.free_bytes() == 2 * MB and not book.is_resident("a")


def test_budget_arithmetic():
    b = Budget(arena=1000, fraction=1.0, wiggle=100)
    assert b.bytes == 900 and b.on_demand
    assert Budget(1000, 0.5, 100).bytes == 500
    assert Budget(1000, 1.0, 100, activations=300).bytes == 700     # headroom from the executables
    assert Budget(1000, 0.0, 100).bytes == 900 and not Budget(1000, 0.0, 100).on_demand
    assert "arena" in b.explain() and "headroom" in b.explain()


def test_cuda_arena_is_the_allocator_pool_that_mem_fraction_already_sized():
    # the cuda client's BFC pool is mem_fraction x device memory and reports itself as the
    # device's bytes_limit; applying mem_fraction again would shrink the arena to 0.5 x 0.5
    gpu = SimpleNamespace(backend="cuda", memory_bytes=lambda: 8 * MB)
    budget = budget_for(RuntimeConfig(backend="cuda", mem_fraction=0.5, weight_cache_wiggle_fraction=0.25), gpu)
    assert (budget.arena, budget.wiggle) == (8 * MB, 2 * MB)
    cpu = SimpleNamespace(backend="cpu", memory_bytes=lambda: None)
    assert budget_for(RuntimeConfig(device_memory_bytes=4 * MB, mem_fraction=0.5), cpu).arena == 4 * MB


def test_thrash_monitor_warns_when_most_dispatches_evict_once_per_window():
    now = [0.0]
    m = ThrashMonitor(window=10, threshold=0.5, interval=5.0, clock=lambda: now[0])
    assert not any(m.record(i % 2 == 0) for i in range(20))         # half is not most
    warnings = []
    for _ in range(30):
        warnings.append(m.record(True))
        now[0] += 1.0                   # a dispatch a second: a window is 10 s, past the interval
    assert warnings.count(True) == 3 and warnings.index(True) < 10
    assert m.warned() == 0


def test_thrash_monitor_warns_at_most_once_per_interval_and_counts_the_windows_it_kept_quiet():
    now = [100.0]
    m = ThrashMonitor(window=10, threshold=0.5, interval=30.0, clock=lambda: now[0])
    fast = [m.record(True) for _ in range(100)]         # 100 evicting dispatches in no time
    assert fast.count(True) == 1 and m.suppressed == 9    # one warning, then 9 more windows met it
    assert m.warned() == 9 and m.suppressed == 0          # the next warning says so, once
    now[0] += 29.9
    assert not any(m.record(True) for _ in range(10)) and m.suppressed == 1
    now[0] += 0.1                                         # 30 s after the warning
    assert [m.record(True) for _ in range(10)].count(True) == 1
    assert m.warned() == 1
    assert not any(m.record(False) for _ in range(100))   # calm again: nothing to say


# ---- the cache on the cpu device ------------------------------------------------------------

@pytest.fixture(scope="module")
def device():
    return Device("cpu")


def make_model(tmp_path, name: str, nbytes: int, version: int = 1, fill: float = 1.0) -> ModelVersion:
    bundle = tmp_path / name
    bundle.mkdir(exist_ok=True)
    n = nbytes // 4
    save_file({"w": np.full(n, fill, np.float32)}, str(bundle / "weights.safetensors"))
    weights = _weights_of(bundle)
    # The cache reads only name, version, weights and modules (no executables: no activations).
    return ModelVersion(name, version, bundle, None, "f", weights, weights.nbytes, MappingProxyType({}),
                        None, 0.0)


def _weights_of(bundle):
    manifest = SimpleNamespace(bundle=bundle.name, weights_file="weights.safetensors", weights_order=None)
    return read_weights(bundle, manifest)


def run(fn, *args):
    return trio.run(fn, *args)


def cache_for(device, budget_bytes: int, floors=None, **kw) -> WeightCache:
    floors = floors or {}
    return WeightCache(device, trio.CapacityLimiter(1), Budget(budget_bytes, 1.0, 0),
                       residency=lambda n: floors.get(n, "system"), **kw)


def test_device_copy_is_a_separate_buffer_with_the_weights(tmp_path, device):
    model = make_model(tmp_path, "m", MB, fill=3.0)

    async def main():
        cache = cache_for(device, 4 * MB)
        assert await cache.admit(model) == ""
        (w,) = await cache.ensure_resident(model)
        host = model.weights.read()[0]
        assert not device.shares_memory(w, host)
        np.testing.assert_array_equal(np.asarray(w), host)
        snap = cache.snapshot()
        assert snap.resident_bytes == MB and snap.models[0].host_bytes == MB and snap.models[0].loads == 1
    run(main)


def test_a_weights_file_replaced_by_a_fifo_after_the_load_is_refused_without_blocking(tmp_path):
    """A fresh host copy opens the file again: replaced by a FIFO since the load, the open (and
    the weight cache's thread with it) blocked until some writer came."""
    import os
    import threading
    model = make_model(tmp_path, "m", MB)
    file = tmp_path / "m" / "weights.safetensors"
    file.unlink()
    os.mkfifo(file)
    outcome: list = []

    def read() -> None:
        try:
            model.weights.read()
        except OSError as exc:
            outcome.append(exc)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(5.0)
    if reader.is_alive():       # blocked in open(): a writer lets it go, then the test fails
        os.close(os.open(file, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5.0)
        pytest.fail("reading the weights blocked on the FIFO")
    (error,) = outcome
    assert "weights.safetensors is no longer a regular file; it changed on disk after the model was loaded" in \
        str(error)


def test_host_copy_survives_the_file_being_rewritten_in_place(tmp_path, device):
    """`cp new weights.safetensors` truncates the file in place: the host copy must not be a
    mapping of it (a truncated shared mapping faults and would kill the worker)."""
    model = make_model(tmp_path, "m", MB, fill=5.0)

    async def main():
        cache = cache_for(device, 4 * MB)
        assert await cache.admit(model) == ""
        model.weights.file.write_bytes(b"")          # truncated, as cp does before writing
        (w,) = await cache.ensure_resident(model)     # first load comes from the host copy
        assert float(np.asarray(w).reshape(-1)[0]) == 5.0
    run(main)


def test_lru_eviction_under_budget_and_pinned_stays(tmp_path, device):
    models = {n: make_model(tmp_path, n, MB) for n in ("pin", "a", "b", "c")}

    async def main():
        cache = cache_for(device, 3 * MB, {"pin": "device"})
        for m in models.values():
            assert await cache.admit(m) == ""
        assert [r.model for r in cache.snapshot() if r.resident_bytes] == ["pin"]   # pinned at admission
        for name in ("a", "b", "c", "a", "b", "c"):
            await cache.ensure_resident(models[name])
            snap = cache.snapshot()
            assert snap.resident_bytes <= snap.budget_bytes
            assert any(r.model == "pin" and r.resident_bytes for r in snap)
        by = {r.model: r for r in cache.snapshot()}
        assert by["pin"].evictions == 0 and by["a"].evictions == 2 and by["pin"].floor == "device"
        assert [r.model for r in cache.snapshot() if r.resident_bytes] == ["pin", "b", "c"]
    run(main)


def test_unpinned_reads_from_disk_every_load_and_system_keeps_its_host_copy(tmp_path, device):
    unpinned = make_model(tmp_path, "u", MB)
    system = make_model(tmp_path, "s", MB)

    async def main():
        cache = cache_for(device, MB, {"u": "unpinned"})
        await cache.admit(unpinned)
        await cache.admit(system)
        by = {r.model: r for r in cache.snapshot()}
        assert by["u"].host_bytes == 0 and by["s"].host_bytes == MB
        await cache.ensure_resident(unpinned)
        await cache.ensure_resident(system)             # evicts u
        (unpinned.path / "weights.safetensors").unlink()
        (system.path / "weights.safetensors").unlink()
        with pytest.raises(Unavailable, match="residency unpinned.*No such file"):
            await cache.ensure_resident(unpinned)       # no host copy: it went to disk
        await cache.ensure_resident(system)             # resident
        cache.release("s")
        assert cache.snapshot().resident_bytes == 0
    run(main)


def test_a_replaced_version_serves_its_requests_for_as_long_as_one_holds_it(tmp_path, device):
    """Reload: a request resolved to v1 just before the swap may reach the queue after v2's
    requests have run. It still runs on v1's weights (the file now holds v2's), and v1's host
    copy goes once nothing holds v1."""
    v1 = make_model(tmp_path, "m", MB, version=1, fill=1.0)

    async def main():
        nonlocal v1
        cache = cache_for(device, 4 * MB)
        await cache.admit(v1)
        await cache.ensure_resident(v1)
        v2 = make_model(tmp_path, "m", MB, version=2, fill=2.0)     # overwrites the weights file
        await cache.admit(v2)
        cache.release("m", 1)
        assert float(np.asarray((await cache.ensure_resident(v2))[0])[0]) == 2.0
        for _ in range(2):                                          # v2 ran first; v1 still answers
            assert float(np.asarray((await cache.ensure_resident(v1))[0])[0]) == 1.0
        assert ("m", 1) in cache._retired
        del v1
        gc.collect()
        assert ("m", 1) not in cache._retired and ("m", 1) not in cache._released
        assert float(np.asarray((await cache.ensure_resident(v2))[0])[0]) == 2.0
    run(main)


def test_a_version_admitted_after_a_failed_admission_of_its_number_serves(tmp_path, device):
    """A reload whose weights were cut short after their header was read (cp truncates, then
    writes) fails at admission and uses no version number, so the next good reload has the same
    one. The failed admission marked that number released, and the good version, READY, answered
    every request "its weights are gone" until the next reload."""
    v1 = make_model(tmp_path, "m", MB, version=1, fill=1.0)

    async def main():
        cache = cache_for(device, 4 * MB)
        await cache.admit(v1)
        cut = make_model(tmp_path, "m", MB, version=2, fill=2.0)
        cut.weights.file.write_bytes(cut.weights.file.read_bytes()[:1000])
        with pytest.raises(OSError, match="1000 bytes"):
            await cache.admit(cut)
        assert [r.model for r in cache.snapshot()] == ["m"] and cache.snapshot().models[0].version == 1
        v2 = make_model(tmp_path, "m", MB, version=2, fill=3.0)        # the copy has completed
        assert await cache.admit(v2) == ""
        cache.release("m", 1)
        assert float(np.asarray((await cache.ensure_resident(v2))[0])[0]) == 3.0
    run(main)


def test_too_big_model_is_refused_with_the_numbers(tmp_path, device):
    model = make_model(tmp_path, "big", 2 * MB)

    async def main():
        cache = cache_for(device, MB)
        reason = await cache.admit(model)
        assert "2.0 MiB (2097152 bytes)" in reason and "1.0 MiB (1048576 bytes)" in reason and "big" in reason
        assert cache.snapshot().models == ()
    run(main)


def _with_activations(model: ModelVersion, nbytes: int) -> ModelVersion:
    """``model`` with one executable that needs ``nbytes`` of temporaries beside its weights."""
    module = SimpleNamespace(memory=CompiledMemory(0, 0, nbytes, 0))
    return dataclasses.replace(model, modules=MappingProxyType({1: module}))


def test_a_model_whose_activations_would_squeeze_the_budget_below_the_pinned_weights_is_refused(tmp_path, device):
    # Before: the new model's headroom shrank the budget to 5 MiB under 8 MiB of pinned weights
    # (never evicted), so the device held more than the budget and the arena overflowed.
    pinned = make_model(tmp_path, "pinned", 8 * MB)
    greedy = _with_activations(make_model(tmp_path, "greedy", MB), 5 * MB)
    weightless = _with_activations(dataclasses.replace(greedy, name="weightless", weights=None, weight_bytes=0), 5 * MB)
    huge = _with_activations(make_model(tmp_path, "huge", 20 * MB), 2 * MB)

    async def main():
        cache = WeightCache(device, trio.CapacityLimiter(1), Budget(10 * MB, 0.9, 0),
                            residency=lambda n: "device" if n == "pinned" else "system")
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run)
            assert await cache.admit(pinned) == ""
            for model in (greedy, weightless):
                reason = await cache.admit(model)
                assert (f"model '{model.name}' cannot be served" in reason and "need 5.0 MiB" in reason
                        and "budget to 5.0 MiB" in reason and "8.0 MiB (8388608 bytes) that pinned models" in reason)
            assert "20.0 MiB" in await cache.admit(huge)      # refused for its size: keeps no headroom either
            snap = cache.snapshot()
            assert (snap.budget_bytes, snap.headroom_bytes, snap.resident_bytes) == (int(9 * MB), 0, 8 * MB)
            assert [m.model for m in snap] == ["pinned"]
            nursery.cancel_scope.cancel()
    run(main)


def test_fraction_zero_keeps_everything_resident_and_fails_start_up_when_it_does_not_fit(tmp_path, device):
    a, b = make_model(tmp_path, "a", MB), make_model(tmp_path, "b", MB)

    async def main():
        cache = WeightCache(device, trio.CapacityLimiter(1), Budget(int(1.5 * MB), 0.0, 0))
        assert await cache.admit(a, during_startup=True) == ""
        assert cache.snapshot().resident_bytes == MB
        with pytest.raises(CatalogTooLarge, match=r"does not fit.*1\.0 MiB"):
            await cache.admit(b, during_startup=True)
        assert "does not fit" in await cache.admit(b)           # after start-up: just unavailable
    run(main)


def test_prefetch_copies_the_hinted_model_without_evicting_the_one_in_use(tmp_path, device):
    a, b, c = (make_model(tmp_path, n, MB) for n in "abc")

    async def main():
        cache = cache_for(device, 2 * MB, metrics=None)
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run)
            for m in (a, b, c):
                await cache.admit(m)
            await cache.ensure_resident(a)
            cache.hint_next(b)                           # fits in free space
            await cache.ensure_resident(b)               # waits for the prefetch: a hit
            by = {r.model: r for r in cache.snapshot()}
            assert by["b"].hits == 1 and by["b"].loads == 1
            cache.hint_next(c)                           # must evict a (idle), never b (in use)
            await cache.ensure_resident(c)
            by = {r.model: r for r in cache.snapshot()}
            assert by["c"].hits == 1 and by["a"].evictions == 1 and by["b"].evictions == 0
            nursery.cancel_scope.cancel()
    run(main)


def test_a_dispatch_that_fits_only_once_a_prefetch_lands_waits_for_it(tmp_path, device):
    # budget 2 MB: 'a' (1 MB) in use, 'b' (1 MB) being prefetched, then a dispatch of 'c' (2 MB):
    # only the bytes the prefetch holds keep 'c' out, so the dispatch waits for them, not fails
    a, b = make_model(tmp_path, "a", MB), make_model(tmp_path, "b", MB)
    c = make_model(tmp_path, "c", 2 * MB)

    async def main():
        cache = cache_for(device, 2 * MB, metrics=None)
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run)
            for m in (a, b, c):
                await cache.admit(m)
            await cache.ensure_resident(a)
            cache.hint_next(b)
            assert cache._prefetching                    # under way when 'c' is asked for
            arrays = await cache.ensure_resident(c)
            assert len(arrays) == 1 and not cache._prefetching
            by = {r.model: r for r in cache.snapshot()}
            assert by["c"].loads == 1 and by["b"].loads == 1 and by["b"].evictions == 1
            nursery.cancel_scope.cancel()
    run(main)


def test_set_residency_pins_and_refuses_past_the_budget(tmp_path, device):
    a, b = make_model(tmp_path, "a", MB), make_model(tmp_path, "b", MB)

    async def main():
        cache = cache_for(device, int(1.5 * MB))
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run)
            await cache.admit(a)
            await cache.admit(b)
            cache.set_residency("a", "device")
            assert cache.residency("a") == "device"
            await cache.ensure_resident(a)
            with pytest.raises(Unavailable, match="cannot be evicted"):
                await cache.ensure_resident(b)          # a is pinned: b cannot make room
            assert [r.model for r in cache.snapshot() if r.resident_bytes] == ["a"]
            with pytest.raises(FailedPrecondition, match="already pinned"):
                cache.set_residency("b", "device")
            with pytest.raises(ValueError, match="one of device, system, unpinned"):
                cache.set_residency("b", "gpu")
            cache.set_residency("b", "unpinned")
            assert {r.model: r.host_bytes for r in cache.snapshot()}["b"] == 0
            # the weight pool's one region holds a (pinned): nothing to give back
            assert await cache.compact() == ("nothing to do: the weight pool has no empty region", 0)
            nursery.cancel_scope.cancel()
    run(main)


class _GatedReads:
    """A model's weights whose reads wait for ``gate`` and count how many run at once."""

    def __init__(self, weights) -> None:
        self._weights = weights
        self.gate = threading.Event()
        self.gate.set()
        self._lock = threading.Lock()
        self.running = self.most = 0

    def __getattr__(self, name):
        return getattr(self._weights, name)

    def read(self):
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            self.gate.wait(10)
            return self._weights.read()
        finally:
            with self._lock:
                self.running -= 1


def test_a_storm_of_residency_changes_reads_one_host_copy_at_a_time(tmp_path, device):
    """Each change to device started its own task and host read: a storm of device/unpinned
    held as many copies of the weights as reads in flight (68 MiB for a 1 MiB model on a real
    worker). One task per model applies the floor, once more if asked again meanwhile, and ends
    with the copies the last floor wants."""
    reads = _GatedReads(make_model(tmp_path, "a", MB).weights)
    a = dataclasses.replace(make_model(tmp_path, "a", MB), weights=reads)

    async def main():
        cache = cache_for(device, 4 * MB)
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run)
            await cache.admit(a)
            reads.gate.clear()                  # reads wait: the storm's tasks pile up
            for _ in range(50):
                cache.set_residency("a", "unpinned")
                cache.set_residency("a", "device")
                await trio.sleep(0)
            await trio.sleep(0.1)
            reads.gate.set()
            with trio.fail_after(10):
                while {r.model: (r.host_bytes, r.resident_bytes) for r in cache.snapshot()}["a"] != (MB, MB):
                    await trio.sleep(0.01)
            assert reads.most == 1
            assert cache.residency("a") == "device"
            nursery.cancel_scope.cancel()
    run(main)


def test_thrashing_logs_a_warning_naming_models_sizes_and_budget(tmp_path, device, caplog):
    models = [make_model(tmp_path, n, MB) for n in "abc"]

    async def main():
        cache = cache_for(device, 2 * MB)
        for m in models:
            await cache.admit(m)
        for i in range(70):
            await cache.ensure_resident(models[i % 3])
        return cache.snapshot()
    with caplog.at_level(logging.WARNING, logger="xlaserve.weights"):
        snap = run(main)
    (record,) = [r for r in caplog.records if "thrashing" in r.message]
    # which of the three the policy keeps varies with it (lru keeps none, gdsf keeps one): the
    # warning names exactly those it evicted
    evicted = {r.model for r in snap if r.evictions}
    assert evicted and all((f"{n} (1.0 MiB" in record.message) == (n in evicted) for n in "abc")
    assert "budget 2.0 MiB" in record.message and "more window" not in record.message


def test_a_thrashing_worker_warns_once_per_interval_saying_how_many_windows_it_kept_quiet(tmp_path, device, caplog):
    models = [make_model(tmp_path, n, MB) for n in "abc"]
    now = [0.0]

    async def main():
        cache = cache_for(device, 2 * MB)
        cache._thrash = ThrashMonitor(interval=30.0, clock=lambda: now[0])
        for m in models:
            await cache.admit(m)
        for i in range(64 * 5):                 # five windows at once: one warning
            await cache.ensure_resident(models[i % 3])
        now[0] += 30.0
        for i in range(64):                     # the next window, 30 s on: the second
            await cache.ensure_resident(models[i % 3])
    with caplog.at_level(logging.WARNING, logger="xlaserve.weights"):
        run(main)
    first, second = [r.message for r in caplog.records if "thrashing" in r.message]
    assert "more window" not in first
    assert "(and in 4 more window(s) of 64 since the last warning, not logged: at most one warning every 30 s)" in second


def test_device_copy_never_aliases_page_aligned_host_memory(device):
    # the cpu client wraps page-aligned memory in place even with may_alias=False
    raw = np.empty(MB + 4096, np.uint8)
    skew = (-raw.ctypes.data) % 4096
    host = raw[skew:skew + MB].view(np.float32)
    host[:] = 2.0
    (w,) = device.put_weights([host])
    assert not device.shares_memory(w, host)
    host[:] = 0.0
    assert float(np.asarray(w)[0]) == 2.0


# ---- policy choice and the reference trace (issue 25) ----------------------------------------

def test_unknown_eviction_policy_is_refused(device):
    with pytest.raises(ValueError, match="unknown weight eviction policy 'mru'; expected one of gdsf, lru"):
        WeightCache(device, trio.CapacityLimiter(1), eviction="mru")


@pytest.mark.parametrize("policy", ["lru", "gdsf"])
def test_trace_records_what_the_cache_saw(tmp_path, device, policy):
    from benchmarks.cache_sim import recorded, replay
    from xlaserve.runtime.cachetrace import TraceWriter, read_trace
    models = {n: make_model(tmp_path, n, MB) for n in "abc"}
    order = "abacabcc"
    path = tmp_path / "trace.jsonl"

    async def main():
        trace = TraceWriter(path, 2 * MB, policy)
        cache = cache_for(device, 2 * MB, eviction=policy, trace=trace)
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run)
            for m in models.values():
                await cache.admit(m)
            seen = []
            for name in order:
                loads = {r.model: r.loads for r in cache.snapshot()}
                await cache.ensure_resident(models[name])
                seen.append({r.model: r.loads for r in cache.snapshot()}[name] == loads[name])   # no copy: a hit
            snap = cache.snapshot()
            nursery.cancel_scope.cancel()           # run() ending closes the trace
        return seen, snap
    seen, snap = run(main)
    header, events = read_trace(path)
    assert header.budget_bytes == 2 * MB and header.policy == policy == snap.policy
    assert [e.model for e in events] == list(order)
    assert [e.hit for e in events] == seen
    assert all(e.version == 1 and e.nbytes == MB and e.floor == "system" for e in events)
    assert all((e.load_seconds is None) == e.hit for e in events)
    assert all(e.load_seconds > 0 for e in events if not e.hit)
    assert [e.t for e in events] == sorted(e.t for e in events)
    assert sum(not e.hit for e in events) == sum(r.loads for r in snap)
    assert all(r.bytes_copied == r.loads * MB for r in snap)
    # replaying the recorded trace under the policy that recorded it gives the same misses
    assert replay(recorded(str(path)), policy).misses == sum(not e.hit for e in events)


def test_trace_stops_at_its_limit_and_a_cut_last_line_is_ignored(tmp_path, caplog):
    from xlaserve.runtime.cachetrace import TraceWriter, read_trace
    path = tmp_path / "t.jsonl"
    trace = TraceWriter(path, MB, "gdsf", max_events=2)
    with caplog.at_level(logging.WARNING, logger="xlaserve.weights"):
        for hit in (False, True, True):
            trace.record("m", 1, MB, "system", hit, None if hit else 0.001)
    trace.close()
    assert "stopped after 2 references" in caplog.text
    _, events = read_trace(path)
    assert [e.hit for e in events] == [False, True]
    with path.open("a") as f:
        f.write('{"t": 1.0, "model": "m", "ver')        # killed mid-write
    assert len(read_trace(path)[1]) == 2
    path.write_text(path.read_text().replace('"hit":true', '"hit":true,"bytes":"x"', 1))
    with pytest.raises(ValueError, match=r"t.jsonl:3: expected a reference"):
        read_trace(path)
    (tmp_path / "empty").write_text("")
    with pytest.raises(ValueError, match="expected a weight trace's header"):
        read_trace(tmp_path / "empty")


def test_a_trace_that_cannot_be_written_stops_and_serving_goes_on(tmp_path, device, caplog):
    from xlaserve.runtime.cachetrace import TraceWriter
    model = make_model(tmp_path, "m", MB)
    trace = TraceWriter(tmp_path / "t.jsonl", MB, "gdsf")
    trace._file.close()                          # as if the disk went away: every write fails

    async def main():
        cache = cache_for(device, 2 * MB, trace=trace)
        await cache.admit(model)
        for _ in range(3):
            (w,) = await cache.ensure_resident(model)
        return cache.snapshot()
    with caplog.at_level(logging.ERROR, logger="xlaserve.weights"):
        snap = run(main)
    assert snap.models[0].hits == 2 and snap.models[0].loads == 1
    assert caplog.text.count("cannot write") == 1


def test_weight_trace_path_per_worker():
    from pathlib import Path

    from xlaserve.config import parse_node_config, resolve_worker
    from xlaserve.app.compose import weight_trace_path

    def path_of(trace, workers=1, which=0):
        node = parse_node_config({"model_repo": "m", "global": {"runtime": {"weight_trace": trace}},
                                  "workers": [{"name": f"w{i}", "gpu": i} for i in range(workers)]}, Path("/srv"))
        return weight_trace_path(resolve_worker(node, which))
    assert path_of("t/trace.jsonl") == Path("/srv/t/trace.jsonl")
    assert path_of("t/trace.jsonl", workers=2, which=1) == Path("/srv/t/trace.w1.jsonl")
    assert path_of("/tmp/{worker}-trace.jsonl", workers=2, which=0) == Path("/tmp/w0-trace.jsonl")
    node = parse_node_config({"model_repo": "m"}, Path("/srv"))
    assert weight_trace_path(resolve_worker(node)) is None


def test_models_with_queued_work_are_evicted_last_and_never_by_a_prefetch(tmp_path, device):
    """The scheduler tells the cache which models have queued work (issue 25, part 3): a load
    evicts an idle model instead, and ``load_estimate`` says who is cold."""
    a, b, c, d = (make_model(tmp_path, n, MB) for n in "abcd")

    async def main():
        cache = cache_for(device, 2 * MB, eviction="lru")
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run)
            for m in (a, b, c, d):
                await cache.admit(m)
            assert cache.load_estimate(a) > 0
            await cache.ensure_resident(a)
            await cache.ensure_resident(b)
            assert cache.load_estimate(a) == 0.0 and cache.load_estimate(c) > 0
            cache.set_queued([a])                        # a is least recently used but has work
            await cache.ensure_resident(c)
            resident = {r.model for r in cache.snapshot() if r.resident_bytes}
            assert resident == {"a", "c"}
            cache.set_queued([a, c])
            cache.hint_next(d)                           # would have to evict a (queued) or c (in use)
            assert all(r.loads == 0 for r in cache.snapshot() if r.model == "d")
            await cache.ensure_resident(b)               # both have work: the policy's order (LRU: a)
            resident = {r.model for r in cache.snapshot() if r.resident_bytes}
            assert resident == {"b", "c"}
            nursery.cancel_scope.cancel()
    run(main)


# ---- what the cache would evict next, and its metrics (issue 25, part 5) -------------------

def test_eviction_order_is_the_order_plan_takes_them():
    book = ResidencyBook(4 * MB)
    for k in ("pinned", "a", "b", "c", "queued"):
        book.add(k, MB, Floor.DEVICE if k == "pinned" else Floor.SYSTEM)
    book.add("new", 3 * MB, Floor.SYSTEM)
    book.add("loading", MB, Floor.SYSTEM)
    for k in ("pinned", "queued", "a", "b"):
        book.begin_load(k)
        book.finish_load(k)
    # LRU: queued is the least recently used, but it has work: it goes last; pinned never
    assert book.eviction_order(spare={"queued"}) == ("a", "b", "queued")
    assert book.eviction_order() == ("queued", "a", "b")
    assert book.plan("new", spare={"queued"}).evict == ("a", "b", "queued")
    assert book.plan("c", spare={"queued"}).evict == ("a",)         # a prefix of the order
    book.evict("a")
    book.begin_load("loading")                                      # a copy under way: not a victim
    assert book.eviction_order(spare={"queued"}) == ("b", "queued")
    assert book.eviction_order(protect=("b",)) == ("queued",)


@pytest.mark.parametrize("eviction", ["gdsf", "lru"])
def test_eviction_rank_is_the_order_the_cache_then_evicts(tmp_path, device, eviction):
    """At every step the snapshot's eviction order (rank 1 first) is exactly what the next load
    evicts, in order, with a pinned model, models with queued work and the model just used."""
    names = [f"m{i}" for i in range(8)]
    models = {n: make_model(tmp_path, n, MB) for n in names}
    models["pin"] = make_model(tmp_path, "pin", MB)
    models["big"] = make_model(tmp_path, "big", 3 * MB)
    rng = np.random.default_rng(5)

    async def main():
        cache = cache_for(device, 5 * MB, floors={"pin": "device"}, eviction=eviction)
        evicted: list[tuple[str, int]] = []
        book_evict = cache._book.evict

        def recording(key):
            evicted.append(key)
            book_evict(key)
        cache._book.evict = recording
        for m in models.values():
            await cache.admit(m)
        checked = 0
        for step in range(60):
            name = "big" if step % 9 == 8 else str(rng.choice(names[:6] if step < 30 else names))
            queued = [models[n] for n in rng.choice(names, 2, replace=False)] if step % 3 else []
            cache.set_queued(queued)
            snap = cache.snapshot()
            order = snap.eviction_order
            ranks = {(r.model, r.version): r.eviction_rank for r in snap}
            assert [k for k, _ in sorted(((k, r) for k, r in ranks.items() if r), key=lambda x: x[1])] == list(order)
            assert snap.next_victim == (order[0] if order else None)
            assert ("pin", 1) not in order and ranks[("pin", 1)] == 0
            spared = {(m.name, 1) for m in queued}
            # those with queued work come after every other evictable model
            assert [k in spared for k in order] == sorted(k in spared for k in order)
            evicted.clear()
            await cache.ensure_resident(models[name])
            assert tuple(evicted) == order[:len(evicted)], (step, order, evicted)
            checked += len(evicted)
        assert checked > 20                               # the catalog is larger than the budget: many victims
    run(main)


def _samples(registry) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client import generate_latest
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_after_loads_evictions_and_prefetches(tmp_path, device):
    """On a real cpu cache: the per-model counters and histograms, the eviction order, the
    prefetch counters and the weight pool, as /metrics shows them."""
    from xlaserve.metrics import Metrics, WeightCacheMetrics

    a, b, c = (make_model(tmp_path, n, MB) for n in "abc")
    pin = make_model(tmp_path, "pin", 2 * MB)

    async def main():
        metrics = Metrics()
        cache = cache_for(device, 4 * MB, floors={"pin": "device"}, eviction="lru",
                          metrics=WeightCacheMetrics(metrics.registry))
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run)
            for m in (a, b, c, pin):
                await cache.admit(m)
            await cache.ensure_resident(a)                 # miss
            await cache.ensure_resident(b)                 # miss (fills the budget with pin)
            await cache.ensure_resident(a)                 # hit
            await cache.ensure_resident(c)                 # miss, evicts b (least recently used)
            cache.hint_next(b)                             # prefetch: evicts a, not c (in use)
            await cache.ensure_resident(b)                 # waits for it or finds it landed: a hit
            got = _samples(metrics.registry)
            snap = cache.snapshot()
            nursery.cancel_scope.cancel()
        return got, snap

    got, snap = run(main)

    def model(name, metric):
        return got.get((metric, (("model", name),)), 0)     # a counter never moved has no series
    assert [model(n, "xlaserve_weight_cache_model_misses_total") for n in "abc"] == [1, 1, 1]
    assert [model(n, "xlaserve_weight_cache_model_evictions_total") for n in "abc"] == [1, 1, 0]
    # every copy: pin at admission, a, b twice (the second by the prefetch), c
    assert [model(n, "xlaserve_weight_cache_model_load_seconds_count") for n in ("a", "b", "c", "pin")] == [1, 2, 1, 1]
    assert model("b", "xlaserve_weight_cache_model_bytes_copied_total") == 2 * MB
    assert model("pin", "xlaserve_weight_cache_model_misses_total") == 0     # pinned at admission: no miss
    assert got[("xlaserve_weight_cache_bytes_copied_total", ())] == 6 * MB
    assert model("b", "xlaserve_weight_cache_model_prefetch_hits_total") == 1
    # the eviction order: c then b (LRU; pin never); as the snapshot says, ranks from 1
    assert snap.eviction_order == (("c", 1), ("b", 1))
    ranks = {labels: v for (name, labels), v in got.items() if name == "xlaserve_weight_cache_model_eviction_rank"}
    assert ranks == {(("model", "c"), ("version", "1")): 1, (("model", "b"), ("version", "1")): 2}
    assert got[("xlaserve_weight_cache_policy_info", (("policy", "lru"),))] == 1
    assert got[("xlaserve_weight_cache_prefetches_total", ())] == 1
    assert (got[("xlaserve_weight_cache_prefetches_landed_total", ())]
            + got[("xlaserve_weight_cache_prefetches_late_total", ())]) == 1
    assert (snap.prefetches_landed, snap.prefetches_late) == (
        got[("xlaserve_weight_cache_prefetches_landed_total", ())], got[("xlaserve_weight_cache_prefetches_late_total", ())])
    pool = snap.pool
    assert got[("xlaserve_weight_pool_regions", ())] == pool.regions >= 1
    assert got[("xlaserve_weight_pool_reserved_bytes", ())] == pool.capacity_bytes >= 4 * MB
    assert got[("xlaserve_weight_pool_used_bytes", ())] == pool.used_bytes
    assert got[("xlaserve_weight_pool_largest_free_bytes", ())] == pool.largest_free_bytes
    assert got[("xlaserve_weight_pool_idle_bytes", ())] == pool.idle_bytes <= pool.used_bytes
    assert got[("xlaserve_weight_pool_slot_reuses_total", ())] == pool.reused
    # a, b and pin each took an extent; c (a's and b's layout) went into b's slot once b was
    # evicted, and b's prefetch into a's: slots, not new extents
    assert (pool.reused, pool.leases) == (2, 3)
    by = {r.model: r for r in snap}
    assert (by["a"].misses, by["b"].misses, by["pin"].misses) == (1, 1, 0)
    assert [by[n].eviction_rank for n in ("c", "b", "a", "pin")] == [1, 2, 0, 0]


class _PinnedCpu(Device):
    """The cpu device made to take the cuda path of the cache: page-locked host copies (the cpu
    client has a ``pinned_host`` memory too), no weight pool, loads started and polled."""

    @property
    def host_memory_kind(self) -> str:
        return "pinned_host"

    @property
    def pools_weights(self) -> bool:
        return False


@pytest.mark.parametrize("poll_seconds", [5.0, 0.0])
def test_the_gpu_path_starts_the_transfer_and_polls_for_its_end(tmp_path, monkeypatch, poll_seconds):
    import xlaserve.runtime.weights as weights_module
    device = _PinnedCpu("cpu")
    assert device.transfers_async
    monkeypatch.setattr(weights_module, "TRANSFER_POLL_SECONDS", poll_seconds)
    polls, waits, fresh = [], [], [False]
    ready, start = device.weights_ready, device.start_weights

    def start_weights(host):
        fresh[0] = True
        return start(host)

    def weights_ready(arrays):
        polls.append(1)
        if fresh[0]:                                     # not ready at each transfer's first look
            fresh[0] = False
            return False
        return ready(arrays)
    monkeypatch.setattr(device, "start_weights", start_weights)
    wait = device.wait_weights

    def wait_weights(arrays):
        waits.append(trio.lowlevel.in_trio_run())
        return wait(arrays)
    monkeypatch.setattr(device, "weights_ready", weights_ready)
    monkeypatch.setattr(device, "wait_weights", wait_weights)
    a = make_model(tmp_path, "a", MB, fill=2.0)
    b = make_model(tmp_path, "b", MB, fill=5.0)

    async def main():
        cache = cache_for(device, 3 * MB // 2)
        assert await cache.admit(a) == "" and await cache.admit(b) == ""
        for model, fill in ((a, 2.0), (b, 5.0), (a, 2.0)):
            arrays = await cache.ensure_resident(model)
            assert arrays[0].sharding.memory_kind == "device"
            assert arrays[0].unsafe_buffer_pointer() != cache._host[(model.name, 1)][0].unsafe_buffer_pointer()
            assert float(np.asarray(arrays[0])[7]) == fill
        assert cache._host[("a", 1)][0].sharding.memory_kind == "pinned_host"
        assert sorted(m.loads for m in cache.snapshot()) == [1, 2]
        assert cache.snapshot().pool is None
    run(main)
    if poll_seconds:
        assert waits == [True] * 3 and len(polls) >= 4       # polled on the Trio thread, waited there when done
    else:
        assert waits == [False] * 3                         # gave up polling: waited in a thread


@pytest.mark.parametrize(("overhead", "first"), [(0.0, "small"), (0.01, "big")])
def test_the_miss_overhead_makes_gdsf_keep_small_models(tmp_path, device, overhead, first):
    # the cache charges the policy its learned copy time plus the fixed part of a miss
    small = make_model(tmp_path, "small", MB // 4)

    async def main():
        cache = cache_for(device, 9 * MB, metrics=None, miss_overhead=overhead)
        await cache.admit(small)
        key = ("small", 1)
        assert cache._cost_of(key, MB // 4) == pytest.approx(cache._load_cost(MB // 4, "host") + overhead)
    run(main)
    # equal frequency: a cost of bytes alone ranks by recency (the small model, older, goes
    # first); a fixed part per miss makes a small model dearer per byte to lose: the big one goes
    policy = GreedyDualSizeFrequency(lambda key, nbytes: nbytes / 1e9 + overhead, admission=False)
    policy.insert("small", MB // 4)
    policy.insert("big", 4 * MB)
    assert next(iter(policy.victims())) == first


def test_weight_cache_metrics_are_plain_counts_until_scraped():
    """The dispatch loop counts into plain numbers; the scrape turns them into the same families
    Prometheus' own counters and histograms gave: per model and in total, the load histogram
    cumulative with inclusive bounds."""
    from prometheus_client import CollectorRegistry

    from xlaserve.metrics import WeightCacheMetrics
    registry = CollectorRegistry(auto_describe=True)
    m = WeightCacheMetrics(registry)
    m.hit("a", prefetched=True)
    m.hit("a", prefetched=False)
    m.load("a", 0.0005, miss=True, nbytes=100)       # on a bound: in its bucket (le is inclusive)
    m.load("b", 0.3, miss=False, nbytes=50)          # a prefetch: a load, not a miss
    m.evict("a")
    m.missed(0.25)
    m.missed(0.5)
    got = _samples(registry)
    assert got[("xlaserve_weight_cache_model_hits_total", (("model", "a"),))] == 2
    assert got[("xlaserve_weight_cache_hits_total", ())] == 2
    assert got[("xlaserve_weight_cache_model_prefetch_hits_total", (("model", "a"),))] == 1
    assert got.get(("xlaserve_weight_cache_model_misses_total", (("model", "b"),)), 0) == 0   # no series yet
    assert got[("xlaserve_weight_cache_misses_total", ())] == 1
    assert got[("xlaserve_weight_cache_bytes_copied_total", ())] == 150
    assert got[("xlaserve_weight_cache_model_evictions_total", (("model", "a"),))] == 1
    assert got[("xlaserve_weight_cache_miss_seconds_total", ())] == 0.75

    def bucket(le, model=None):
        labels = (("le", le),) + ((("model", model),) if model else ())
        name = "xlaserve_weight_cache_model_load_seconds_bucket" if model else "xlaserve_weight_cache_load_seconds_bucket"
        return got[(name, labels)]
    assert [bucket(le, "a") for le in ("0.0001", "0.0005", "0.2", "0.5", "+Inf")] == [0, 1, 1, 1, 1]
    assert [bucket(le) for le in ("0.0001", "0.0005", "0.2", "0.5", "+Inf")] == [0, 1, 1, 2, 2]
    assert got[("xlaserve_weight_cache_load_seconds_count", ())] == 2
    assert got[("xlaserve_weight_cache_load_seconds_sum", ())] == pytest.approx(0.3005)
    assert got[("xlaserve_weight_cache_model_load_seconds_sum", (("model", "b"),))] == pytest.approx(0.3)


def test_the_host_copy_is_read_in_the_pools_layout_and_loads_as_one_span(tmp_path, device):
    """The bundle reads each tensor into one buffer at the pool's offsets (binding order, not
    the file's; odd sizes; a transposed kernel stays in place), so the cache copies a model
    with one memcpy; the weights that come back are the file's, through a miss into a slot."""
    from xlaserve.runtime.pool import packed_span
    bundle = tmp_path / "m"
    bundle.mkdir()
    tensors = {"b": np.arange(7, dtype=np.float32), "a": np.arange(15, dtype=np.int64).reshape(3, 5),
               "c": np.array([True, False, True])}
    save_file(tensors, str(bundle / "weights.safetensors"))
    weights = _weights_of(bundle)                    # names sorted: a, b, c (the file holds them otherwise)
    host = weights.read()
    assert [np.asarray(h).tolist() for h in host] == [tensors[n].tolist() for n in ("a", "b", "c")]
    assert [h.ctypes.data - host[0].ctypes.data for h in host] == [0, 128, 192]
    assert host[0].ctypes.data % 4096 == 0 and packed_span(host) is not None
    other = tmp_path / "n"
    other.mkdir()
    save_file({k: (v * 2 if v.dtype != np.bool_ else ~v) for k, v in tensors.items()}, str(other / "weights.safetensors"))
    a = ModelVersion("m", 1, bundle, None, "f", weights, weights.nbytes, MappingProxyType({}), None, 0.0)
    b_weights = _weights_of(other)
    b = ModelVersion("n", 1, other, None, "f", b_weights, b_weights.nbytes, MappingProxyType({}), None, 0.0)

    async def main():
        cache = cache_for(device, weights.nbytes + 100)            # room for one: each call a miss
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run)
            for m in (a, b):
                await cache.admit(m)
            got = []
            for m in (a, b, a, b):
                arrays = await cache.ensure_resident(m)
                got.append([np.asarray(x).tolist() for x in arrays])
                del arrays
            reused = cache.snapshot().pool.reused
            nursery.cancel_scope.cancel()
        return got, reused
    got, reused = run(main)
    want_a = [tensors[n].tolist() for n in ("a", "b", "c")]
    want_b = [(tensors["a"] * 2).tolist(), (tensors["b"] * 2).tolist(), (~tensors["c"]).tolist()]
    assert got == [want_a, want_b, want_a, want_b]
    assert reused >= 2
