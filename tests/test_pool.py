"""The weight pool (issue 25): pure allocation, reuse and fragmentation, and its use by the
weight cache on the real cpu device (weights intact through loads, evictions and reloads;
memory an execution still holds is never reused)."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import trio

from tests.test_weights import cache_for, make_model
from xlaserve.runtime.pool import ALIGN, Extents, WeightPool

KB = 1024


# ---- Extents: pure -------------------------------------------------------------------------

def test_extents_are_aligned_and_best_fit():
    ext = Extents(10 * KB, align=ALIGN)
    a = ext.alloc(1)                    # rounded up to one ALIGN
    b = ext.alloc(2 * KB + 1)
    assert (a, b) == (0, ALIGN)
    assert ext.used_bytes == ALIGN + 2 * KB + ALIGN
    c = ext.alloc(KB)
    ext.free(b)                         # a hole of 2 KiB + 64 before c
    # 1 KiB fits both the hole and the tail: best fit takes the hole, the tail stays whole
    tail = ext.largest_free
    d = ext.alloc(KB)
    assert d == b and ext.largest_free == tail
    assert ext.alloc(10 * KB) is None   # more than is free anywhere
    for off in (a, c, d):
        ext.free(off)
    assert ext.empty and ext.free_extents() == ((0, ext.capacity),)


def test_extents_coalesce_whatever_order_they_are_freed_in():
    rng = np.random.default_rng(3)
    ext = Extents(1 << 20)
    for _ in range(20):
        offsets = [ext.alloc(int(n)) for n in rng.integers(1, 64 * KB, 12)]
        assert None not in offsets
        for i in rng.permutation(len(offsets)):
            ext.free(offsets[i])
        assert ext.free_extents() == ((0, ext.capacity),)


def test_extents_refuse_a_double_free():
    ext = Extents(4 * KB)
    off = ext.alloc(KB)
    ext.free(off)
    with pytest.raises(KeyError):
        ext.free(off)


def test_fragmentation_fails_a_fit_that_the_free_total_allows():
    ext = Extents(4 * KB)
    blocks = [ext.alloc(KB) for _ in range(4)]
    ext.free(blocks[0])
    ext.free(blocks[2])
    assert ext.free_bytes == 2 * KB and ext.largest_free == KB
    assert ext.alloc(2 * KB) is None    # two 1 KiB holes are not one 2 KiB extent
    ext.free(blocks[1])                 # the neighbours merge: 3 KiB in one piece
    assert ext.largest_free == 3 * KB and ext.alloc(2 * KB) == 0


# ---- WeightPool: reuse, growth, release ------------------------------------------------------

def _fill(pool: WeightPool, nbytes: int, value: int) -> np.ndarray:
    lease = pool.lease([nbytes])
    arr = lease.array(np.uint8, (nbytes,))
    arr[:] = value
    lease.seal()
    return arr


def test_pool_reuses_the_memory_of_dropped_arrays_without_growing():
    pool = WeightPool(64 * KB)
    first = _fill(pool, 48 * KB, 1)
    address = first.ctypes.data
    del first
    gc.collect()
    again = _fill(pool, 48 * KB, 2)
    stats = pool.stats()
    assert again.ctypes.data == address and again.ctypes.data % ALIGN == 0
    assert (stats.regions, stats.grown, stats.leases, stats.used_bytes) == (1, 1, 2, 48 * KB)


def test_pool_never_hands_out_memory_an_array_still_uses():
    """An evicted model's arrays may still be in an execution: their extent must not be reused
    until they are gone, so the pool grows instead."""
    pool = WeightPool(64 * KB)
    held = _fill(pool, 48 * KB, 7)
    other = _fill(pool, 48 * KB, 9)     # does not fit beside `held`: a second region
    assert pool.stats().regions == 2
    assert (held == 7).all() and (other == 9).all()
    del held, other
    gc.collect()
    assert pool.stats().used_bytes == 0
    assert pool.trim() == 2 * 64 * KB and pool.stats().regions == 0


def test_pool_collects_before_growing_and_gives_back_past_four_times_its_size():
    pending = []
    pool = WeightPool(16 * KB, collect=pending.clear)   # a library that defers its last decref
    pending.append(_fill(pool, 12 * KB, 1))
    assert pool.stats().used_bytes == 12 * KB
    _fill(pool, 12 * KB, 2)             # needs the first extent: collect() drops it
    stats = pool.stats()
    assert (stats.regions, stats.grown) == (1, 1)
    held = [_fill(pool, 12 * KB, i) for i in range(6)]  # all alive: six regions
    assert pool.stats().regions == 6
    del held
    gc.collect()
    stats = pool.stats()
    # empty regions are kept up to four times keep_bytes (64 KiB: four regions), the rest given back
    assert stats.regions == 4 and stats.released == 2 and stats.used_bytes == 0
    assert pool.trim() == 4 * 16 * KB and pool.stats().regions == 0


def test_lease_places_each_tensor_aligned_in_one_extent():
    pool = WeightPool(64 * KB)
    sizes = [12, 4000, 1]
    lease = pool.lease(sizes)
    arrays = [lease.array(np.float32, (3,)), lease.array(np.int64, (500,)), lease.array(np.bool_, ())]
    lease.seal()
    starts = [a.ctypes.data for a in arrays]
    assert all(s % ALIGN == 0 for s in starts) and starts == sorted(starts)
    assert starts[-1] - starts[0] < WeightPool.extent_bytes(sizes)
    assert [a.shape for a in arrays] == [(3,), (500,), ()] and all(a.flags.writeable for a in arrays)
    assert pool.stats().used_bytes == WeightPool.extent_bytes(sizes)
    del arrays[1]
    gc.collect()
    assert pool.stats().used_bytes == WeightPool.extent_bytes(sizes)   # one extent: freed with the last
    del arrays
    gc.collect()
    assert pool.stats().used_bytes == 0


# ---- on the cpu device ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def device():
    from xlaserve.runtime.pjrt import Device
    return Device("cpu")


def test_device_load_aliases_the_pool_and_returns_the_extent_when_collected(device):
    pool = WeightPool(4 << 20, collect=device.collect_garbage)
    host = (np.arange(1000, dtype=np.float32), np.full((3, 5), 7, np.int64), np.array(True))
    arrays = device.load_weights(host, pool)
    for got, want in zip(arrays, host):
        assert np.asarray(got).dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), want)
    extent = WeightPool.extent_bytes([a.nbytes for a in host])
    assert pool.stats().used_bytes == extent and pool.stats().idle_bytes == 0     # held: not idle
    assert not any(device.shares_memory(a, h) for a, h in zip(arrays, host))   # never the host copy
    del arrays, got
    stats = pool.stats()                # dropped: the extent stays, as a slot for the next such model
    assert stats.used_bytes == extent and stats.idle_bytes == sum(a.nbytes for a in host)
    pool.trim()                         # idle slots go back, then their extents
    gc.collect()
    assert pool.stats().used_bytes == 0


def test_a_model_of_the_same_layout_reuses_the_slot_and_its_arrays(device):
    pool = WeightPool(4 << 20, collect=device.collect_garbage)
    first = (np.full((4, 8), 1.0, np.float32), np.arange(3, dtype=np.int32))
    second = (np.full((4, 8), 2.0, np.float32), np.arange(3, dtype=np.int32) + 10)
    a = device.load_weights(first, pool)
    where = [x.unsafe_buffer_pointer() for x in a]
    del a                               # evicted: nothing holds its arrays
    b = device.load_weights(second, pool)
    assert [x.unsafe_buffer_pointer() for x in b] == where       # the same memory, no new lease
    assert pool.stats().leases == 1 and pool.stats().reused == 1
    for got, want in zip(b, second):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_a_slot_whose_arrays_are_held_is_not_reused(device):
    """An execution (or a NumPy view) still holding an evicted model's arrays keeps its bytes:
    the next model of the same layout gets other memory."""
    pool = WeightPool(4 << 20, collect=device.collect_garbage)
    a = device.load_weights((np.full(64, 1.0, np.float32),), pool)
    view = np.asarray(a[0])             # holds the array, as an execution's arguments would
    del a
    b = device.load_weights((np.full(64, 2.0, np.float32),), pool)
    np.testing.assert_array_equal(view, 1.0)                  # untouched
    np.testing.assert_array_equal(np.asarray(b[0]), 2.0)
    assert pool.stats().leases == 2 and pool.stats().reused == 0
    held = b
    del b
    c = device.load_weights((np.full(64, 3.0, np.float32),), pool)   # held through another tuple: not idle
    np.testing.assert_array_equal(np.asarray(held[0]), 2.0)
    np.testing.assert_array_equal(np.asarray(c[0]), 3.0)
    del view
    d = device.load_weights((np.full(64, 4.0, np.float32),), pool)    # the first slot is idle again
    assert pool.stats().reused == 1
    np.testing.assert_array_equal(np.asarray(d[0]), 4.0)


def test_a_released_slot_is_the_first_a_reuse_checks_and_a_reused_one_the_last(device, monkeypatch):
    """Many slots of one layout, all held but one: the one the cache let go of (``released``)
    is found first, so a miss does not test every slot in use; a slot just reused goes last."""
    from xlaserve.runtime import pool as pool_module
    from xlaserve.runtime.pjrt import weights_signature
    pool = WeightPool(4 << 20, collect=device.collect_garbage)
    held = [device.load_weights((np.full(64, float(i), np.float32),), pool) for i in range(8)]
    signature = weights_signature((np.zeros(64, np.float32),))
    evicted = held.pop(5)
    pool.released(evicted)
    del evicted                          # idle now: nothing else holds slot 5's array
    checked = []
    idle = pool_module.Slot.idle
    monkeypatch.setattr(pool_module.Slot, "idle", lambda slot: checked.append(slot) or idle(slot))
    got = device.load_weights_into_slot((np.full(64, 99.0, np.float32),), pool, signature)
    assert len(checked) == 1             # the released slot, first
    np.testing.assert_array_equal(np.asarray(got[0]), 99.0)
    assert list(pool._slots[signature])[-1] is checked[0]      # reused: now last
    assert pool.stats().reused == 1
    # no idle slot of that layout: nothing is done, the caller loads another way
    assert device.load_weights_into_slot((np.zeros(64, np.float32),), pool, signature) is None
    pool.released(())                    # nothing to go on: ignored
    pool.released((np.zeros(3, np.float32),))   # arrays no slot made: ignored
    for i, arrays in zip((0, 1, 2, 3, 4, 6, 7), held):          # the others kept their weights
        np.testing.assert_array_equal(np.asarray(arrays[0]), float(i))


def _packed(*arrays):
    """``arrays`` copied into one buffer laid out as a lease lays them out (as the bundle reads
    a host copy)."""
    from xlaserve.runtime.pool import aligned_bytes, packed_offsets
    offsets = packed_offsets([a.nbytes for a in arrays])
    buffer = aligned_bytes(offsets[-1] + arrays[-1].nbytes)
    out = []
    for a, at in zip(arrays, offsets):
        view = buffer[at:at + a.nbytes].view(a.dtype).reshape(a.shape)
        view[...] = a
        out.append(view)
    return tuple(out)


def test_packed_span_is_the_host_copy_as_one_buffer_or_none():
    from xlaserve.runtime.pool import packed_span
    host = _packed(np.arange(5, dtype=np.float32), np.ones((3, 3), np.int64), np.array(True))
    span = packed_span(host)
    assert span is not None and span.dtype == np.uint8 and not span.flags.writeable
    assert len(span) == ALIGN + 2 * ALIGN + 1      # 20 bytes, 72, 1, each from a 64-byte boundary
    assert span.ctypes.data == host[0].ctypes.data
    assert len(packed_span(host[1:])) == 2 * ALIGN + 1             # a packed run need not start the buffer
    assert packed_span((host[0], host[2])) is None                 # a gap
    assert packed_span((host[1], host[0])) is None                 # out of order
    assert packed_span((np.zeros(4), np.zeros(4))) is None         # two allocations
    assert packed_span((host[0], np.zeros(4))) is None
    assert packed_span(()) is None


def test_a_load_copies_a_packed_host_copy_as_one_span_into_new_and_reused_slots(device, monkeypatch):
    """Into a new extent and into an idle slot (at once and in steps): every tensor lands in
    place, odd sizes and every dtype, with one copy of the span rather than one a tensor."""
    from xlaserve.runtime import pjrt
    from xlaserve.runtime.pool import packed_span
    pool = WeightPool(4 << 20, collect=device.collect_garbage)
    shapes = [((7,), np.float32), ((3, 5), np.int64), ((), np.bool_), ((1000,), np.float16)]

    def host(fill):
        return _packed(*(np.full(shape, fill, dtype) for shape, dtype in shapes))
    copies = []
    real = pjrt._copy_in_chunks

    def counting(sources, targets, step_bytes):
        copies.append(len(sources))
        return real(sources, targets, step_bytes)
    monkeypatch.setattr(pjrt, "_copy_in_chunks", counting)
    first = host(1)
    a = _run(device.load_weights_in_steps(first, pool, 1 << 20, packed_span(first)))     # a new extent
    for got, (shape, dtype) in zip(a, shapes):
        np.testing.assert_array_equal(np.asarray(got), np.full(shape, 1, dtype))
    del a, got
    second = host(2)                                  # into the idle slot, at once
    b = device.load_weights_into_slot(second, pool, pjrt.weights_signature(second), packed_span(second))
    for got, (shape, dtype) in zip(b, shapes):
        np.testing.assert_array_equal(np.asarray(got), np.full(shape, 2, dtype))
    del b, got
    third = host(3)                                   # into the idle slot, in steps of 1 KiB
    c = _run(device.load_weights_in_steps(third, pool, KB, packed_span(third)))
    for got, (shape, dtype) in zip(c, shapes):
        np.testing.assert_array_equal(np.asarray(got), np.full(shape, 3, dtype))
    assert copies == [1, 1]                           # one span each time, not four tensors
    assert pool.stats().leases == 1 and pool.stats().reused == 2


def _run(steps):
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def test_a_full_pool_gives_idle_slots_back_before_growing(device):
    """Slots of other layouts fill the pool's one region; a load that needs their room takes it
    back from the oldest idle ones instead of allocating another region."""
    kb = 1 << 10
    pool = WeightPool(64 * kb, collect=device.collect_garbage)
    for i, cols in enumerate((1, 2, 4, 8)):   # four 16 KiB models of different shapes, each dropped
        device.load_weights((np.full((4 * kb // cols, cols), i, np.float32),), pool)
    assert pool.stats().idle_bytes == 64 * kb
    got = device.load_weights((np.full(32 * kb // 4, 9.0, np.float32),), pool)   # a fifth layout, 32 KiB
    np.testing.assert_array_equal(np.asarray(got[0]), 9.0)
    stats = pool.stats()
    assert stats.grown == 1 and stats.regions == 1          # no second region
    assert stats.idle_bytes == 32 * kb                       # the two oldest slots went


def test_an_abandoned_load_leaves_its_slot_reusable(device):
    pool = WeightPool(4 << 20, collect=device.collect_garbage)
    device.load_weights((np.zeros(100_000, np.float32),), pool)
    steps = device.load_weights_in_steps((np.ones(100_000, np.float32),), pool, 64 * KB)
    next(steps)                         # copying into the idle slot, part way
    steps.close()                       # cancelled
    got = device.load_weights((np.full(100_000, 5.0, np.float32),), pool)
    np.testing.assert_array_equal(np.asarray(got[0]), 5.0)
    assert pool.stats().reused == 2 and pool.stats().leases == 1


def test_loading_in_steps_copies_large_tensors_in_pieces_and_closing_early_frees(device):
    pool = WeightPool(4 << 20, collect=device.collect_garbage)
    host = (np.arange(100_000, dtype=np.float32), np.ones(10, np.float32))
    steps = device.load_weights_in_steps(host, pool, 64 * KB)
    yielded = 0
    while True:
        try:
            next(steps)
            yielded += 1
        except StopIteration as done:
            arrays = done.value
            break
    # a step between chunks only: 7 chunks of the 400,000 bytes, the small tensor after them in the last step
    assert yielded == -(-400_000 // (64 * KB)) - 1
    np.testing.assert_array_equal(np.asarray(arrays[0]), host[0])
    small = device.load_weights_in_steps((np.ones(1000, np.float32),), pool, 64 * KB)
    with pytest.raises(StopIteration):   # under one step: copied without a pause, none after it
        next(small)
    steps = device.load_weights_in_steps(host, pool, 64 * KB)   # `arrays` hold the first slot: a new lease
    next(steps)
    steps.close()                       # cancelled part way
    del steps
    gc.collect()
    # `arrays`' extent and the small model's (an idle slot now); the abandoned lease went back
    assert pool.stats().used_bytes == WeightPool.extent_bytes([a.nbytes for a in host]) + WeightPool.extent_bytes([4000])
    assert pool.stats().leases == 3 and pool.stats().idle_bytes == 4000


def test_weights_stay_right_through_loads_evictions_and_reloads(tmp_path, device):
    """Three models through a budget of one, many times over, with one model's arrays held
    across its eviction (as an execution would): every array returned holds its own model's
    weights, then and later, and after the first loads the pool stops growing."""
    mb = 1 << 20
    models = [make_model(tmp_path, n, mb, fill=float(i + 1)) for i, n in enumerate("abc")]

    async def main():
        cache = cache_for(device, int(1.5 * mb))
        for m in models:
            assert await cache.admit(m) == ""
        held = await cache.ensure_resident(models[0])
        grown = None
        for i in range(30):
            model = models[(i % 2) + 1]     # b, c, b, ...: a is evicted at once, its arrays still held
            (w,) = await cache.ensure_resident(model)
            assert float(np.asarray(w).reshape(-1)[0]) == float((i % 2) + 2)
            assert float(np.asarray(held[0]).reshape(-1)[0]) == 1.0
            if i == 3:
                grown = cache.snapshot().pool.grown
        assert cache.snapshot().pool.grown == grown
        del held, w
        for i in range(30):
            (w,) = await cache.ensure_resident(models[i % 3])
            assert float(np.asarray(w).reshape(-1)[-1]) == float(i % 3 + 1)
        snap = cache.snapshot()
        assert sum(r.evictions for r in snap) >= 55
        # at most: a's extent held, the previous model's (alive while the next loads), the new one
        assert snap.pool.grown == grown and snap.pool.capacity_bytes <= 3 * int(1.5 * mb)
    trio.run(main)


def test_prefetch_copy_starts_at_the_hint_and_lands_during_an_inline_execution(tmp_path, device):
    """The dispatch loop hints the next model and then executes on the Trio thread without a
    checkpoint (an inline execution): the copy must already be running in its own thread, so
    that by the time the execution ends the next model is resident and its use does not wait."""
    import time

    mb = 1 << 20
    a, b = make_model(tmp_path, "a", mb, fill=1.0), make_model(tmp_path, "b", mb, fill=2.0)

    async def main():
        cache = cache_for(device, 4 * mb)
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run)
            await cache.admit(a)
            await cache.admit(b)
            await cache.ensure_resident(a)
            cache.hint_next(b)
            # "execution": the Trio thread is busy, no checkpoint, until the copy thread is done
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not cache._prefetch_copied.get(("b", 1)):
                time.sleep(0.001)
            await trio.sleep(0)                 # one checkpoint: the prefetch's task finishes it
            (w,) = await cache.ensure_resident(b)
            assert float(np.asarray(w).reshape(-1)[0]) == 2.0
            snap = cache.snapshot()
            assert (snap.prefetches, snap.prefetches_landed, snap.prefetches_late) == (1, 1, 0)
            assert {r.model: r.hits for r in snap}["b"] == 1
            nursery.cancel_scope.cancel()
    trio.run(main)
