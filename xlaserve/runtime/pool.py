"""Device memory for weights, allocated once and reused (issue 25: "a miss costs the copy").

On the ``cpu`` backend device memory is host memory, and PJRT's cpu client wraps host memory
aligned to :data:`ALIGN` bytes as a device buffer without copying it. A load then costs one
``memcpy`` into memory of this pool and a wrap per tensor; without the pool it cost a fresh
allocation per tensor (page faults on every byte, and ``munmap`` when it was evicted) and a
second copy. The pool holds a few large regions; a model's tensors take one extent of a region
(best fit; freed extents coalesce), and an extent goes back to the pool only when every device
array that wraps it has been collected, so an execution still holding an evicted model's arrays
never sees another model's bytes written under it.

A model's extent and the device arrays that wrap it are also kept after its eviction, as a
*slot*: the next model whose tensors have the same shapes and dtypes (a fine-tuned variant of the
same architecture, or any model of the same layout) is copied into it and served by the same
arrays, without a lease, a wrap per tensor or jax's collection of the old arrays. A slot is
reused only when nothing but the pool holds its arrays (CPython's reference counts say so,
exactly), so the rule above still holds; the pool gives idle slots back, the oldest first, when
a lease finds no room otherwise.

:class:`Extents` is the allocator of one region, pure and single-threaded. :class:`WeightPool`
is thread-safe: extents come back from whichever thread drops the last array (a finalizer).
"""
from __future__ import annotations

import bisect
import math
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

ALIGN = 64
"""Every tensor starts at a multiple of this: PJRT's cpu client aliases memory aligned so
(measured with jax 0.10.2: 64 and up are wrapped, 16 and 32 are copied)."""

REGION_BYTES = 64 << 20
"""The size a pool grows by (or the request, if larger); capped by the pool's ``keep_bytes``."""


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def packed_offsets(sizes) -> list[int]:
    """Where a lease places tensors of ``sizes`` bytes, from the start of its extent: in order,
    each at the next :data:`ALIGN`-aligned offset. The host copy of a model's weights is laid
    out the same way (``HostWeights.read``), so that a load is one ``memcpy`` of a span."""
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += _round_up(max(n, 1), ALIGN)
    return offsets


def packed_span(arrays) -> np.ndarray | None:
    """A read-only ``uint8`` view of the bytes from the first of ``arrays`` to the end of the
    last, when they are C-contiguous views of one NumPy buffer laid out as a lease lays out
    tensors of their sizes (:func:`packed_offsets`); None otherwise. Copying that span into a
    slot of the same shapes copies every tensor into place at once."""
    if not arrays:
        return None
    roots = {id(_root(a)) for a in arrays}
    root = _root(arrays[0])
    if len(roots) != 1 or not isinstance(root, np.ndarray) or not root.flags.c_contiguous:
        return None
    base = root.__array_interface__["data"][0]
    first = arrays[0].__array_interface__["data"][0]
    for a, offset in zip(arrays, packed_offsets([a.nbytes for a in arrays])):
        if not a.flags.c_contiguous or a.__array_interface__["data"][0] != first + offset:
            return None
    start = first - base
    end = start + offset + arrays[-1].nbytes
    if start < 0 or end > root.nbytes:
        return None
    span = root.reshape(-1).view(np.uint8)[start:end]
    span.flags.writeable = False
    return span


def _root(array):
    """The object at the bottom of ``array``'s chain of bases (through memoryviews)."""
    while True:
        base = array.obj if isinstance(array, memoryview) else getattr(array, "base", None)
        if base is None:
            return array
        array = base


class Extents:
    """Best-fit allocation of byte ranges in ``[0, capacity)``, every offset and size a multiple
    of ``align``. A freed extent merges with free neighbours, so space given back in any order
    is whole again once everything is free."""

    def __init__(self, capacity: int, align: int = ALIGN) -> None:
        self.capacity = capacity - capacity % align
        self.align = align
        self._free: list[tuple[int, int]] = [(0, self.capacity)] if self.capacity else []  # (offset, size), sorted
        self._used: dict[int, int] = {}

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a new extent of ``nbytes`` (rounded up; at least ``align``), or None when
        no free extent is large enough. Best fit: the smallest free extent that holds it, the
        lowest such on a tie, so large holes stay whole for large models."""
        size = _round_up(max(nbytes, 1), self.align)
        best = None
        for i, (offset, free) in enumerate(self._free):
            if free >= size and (best is None or free < self._free[best][1]):
                best = i
                if free == size:
                    break
        if best is None:
            return None
        offset, free = self._free[best]
        if free == size:
            del self._free[best]
        else:
            self._free[best] = (offset + size, free - size)
        self._used[offset] = size
        return offset

    def free(self, offset: int) -> None:
        """Give back the extent at ``offset``. KeyError if it is not allocated."""
        size = self._used.pop(offset)
        i = bisect.bisect_left(self._free, (offset, 0))
        if i < len(self._free) and self._free[i][0] == offset + size:      # merge the next one
            size += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # merge into the previous
            prev_offset, prev_size = self._free[i - 1]
            self._free[i - 1] = (prev_offset, prev_size + size)
        else:
            self._free.insert(i, (offset, size))

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def largest_free(self) -> int:
        return max((size for _, size in self._free), default=0)

    @property
    def empty(self) -> bool:
        return not self._used

    def free_extents(self) -> tuple[tuple[int, int], ...]:
        """The free ``(offset, size)`` ranges, in address order (for tests and statistics)."""
        return tuple(self._free)


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of a :class:`WeightPool`."""

    capacity_bytes: int        # all regions together
    used_bytes: int            # held by extents whose arrays are alive
    largest_free_bytes: int    # the largest model that fits without growing
    regions: int
    leases: int                # extents handed out, ever
    grown: int                 # times a region was added because nothing fitted
    released: int              # regions given back to the system
    idle_bytes: int = 0        # of used_bytes: evicted models' slots kept for reuse
    reused: int = 0            # loads that reused a slot instead of a new lease, ever


@dataclass(slots=True, eq=False)   # identity: regions are compared as objects
class _Region:
    memory: np.ndarray         # uint8, ALIGN-aligned
    extents: Extents


@dataclass(slots=True, eq=False)   # identity: a slot is one extent
class Slot:
    """One model's extent with the device arrays that wrap it, kept for the next model of the
    same ``signature`` (its tensors' shapes and dtypes, in order). ``views`` are the writable
    host arrays over the extent, one per tensor. ``busy`` while a load copies into it."""

    signature: tuple
    arrays: list               # the only reference to each array while the slot is idle (a list:
    views: tuple               # tuple() of a tuple is the same object, of a list a new one)
    nbytes: int
    used: int = 0              # the pool's clock at its last use: the oldest idle slot goes first
    busy: bool = False
    span: np.ndarray | None = None   # the extent's bytes (uint8), its tensors at packed_offsets

    def idle(self) -> bool:
        """Whether nothing but this slot holds its arrays (an execution, the cache, a NumPy view
        made from one: each holds a reference)."""
        arrays = self.arrays
        for i in range(len(arrays)):
            if sys.getrefcount(arrays[i]) > 2:    # the list's reference and the argument's
                return False
        return not self.busy


class Lease:
    """One model's extent. :meth:`array` makes each tensor's array in it; the extent returns to
    the pool when :meth:`seal` has been called and every array made here has been collected."""

    __slots__ = ("_pool", "_region", "_offset", "_cursor", "_refs", "_alive", "_sealed")

    def __init__(self, pool: WeightPool, region: _Region, offset: int) -> None:
        self._pool = pool
        self._region = region
        self._offset = offset
        self._cursor = offset
        self._refs: list[weakref.ref] = []     # kept so that their callbacks run
        self._alive = 0
        self._sealed = False

    def array(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A writable array of ``dtype`` and ``shape`` in the next ``ALIGN``-aligned part of the
        extent (the sizes given to :meth:`WeightPool.lease`, in order)."""
        dtype = np.dtype(dtype)
        nbytes = dtype.itemsize * math.prod(shape)
        start = self._cursor
        out = self._region.memory[start:start + nbytes].view(dtype).reshape(shape)
        self._cursor = start + _round_up(max(nbytes, 1), ALIGN)
        with self._pool._lock:
            self._refs.append(weakref.ref(out, self._drop))
            self._alive += 1
        return out

    def span(self) -> np.ndarray:
        """The bytes of the extent from its start to the end of the last array made (uint8)."""
        return self._region.memory[self._offset:self._cursor]

    def seal(self) -> None:
        """No more arrays will be made: the extent is free once those made are gone."""
        with self._pool._lock:
            self._sealed = True
            if not self._alive:
                self._pool._give_back_locked(self)

    def _drop(self, ref: weakref.ref) -> None:
        # a weakref callback: runs on whichever thread dropped the array's last reference
        with self._pool._lock:
            self._alive -= 1
            if self._sealed and not self._alive:
                self._pool._give_back_locked(self)


class WeightPool:
    """Regions of memory allocated once and reused for every load.

    ``allocate(n)`` returns ``n`` bytes as a 1-D uint8 array aligned to :data:`ALIGN` (default:
    page-aligned NumPy memory). ``keep_bytes``: the capacity the pool is meant to hold (the weight
    budget). A region is added past it only when fragmentation or arrays still in use leave no
    extent large enough; an empty region is given back when the pool holds more than four times
    ``keep_bytes``, or by :meth:`trim` (compaction). ``collect`` is called before the
    pool grows, to run finalizers whose last reference a library deferred (jax drops the host
    memory it wrapped on its next call, or when asked)."""

    def __init__(self, keep_bytes: int, *, region_bytes: int = REGION_BYTES,
                 allocate: Callable[[int], np.ndarray] | None = None,
                 collect: Callable[[], None] = lambda: None) -> None:
        self._keep = max(ALIGN, keep_bytes)
        self._region_bytes = max(ALIGN, min(region_bytes, _round_up(self._keep, ALIGN)))
        self._allocate = allocate or _page_aligned
        self._collect = collect
        self._lock = threading.RLock()       # RLock: a finalizer may run while it is held
        self._regions: list[_Region] = []
        self._live: set[Lease] = set()      # outstanding leases (their weakrefs live in them)
        # per signature, its slots: those likely idle first (evicted: :meth:`released`), those
        # reused last; a reuse looks from the front, so it rarely checks a slot in use
        self._slots: dict[tuple, OrderedDict[Slot, None]] = {}
        self._slot_of: dict[int, Slot] = {}     # id of a slot's first array -> the slot
        self._clock = 0
        self._leases = 0
        self._grown = 0
        self._released = 0
        self._reused = 0

    @staticmethod
    def extent_bytes(sizes: Sequence[int]) -> int:
        """The bytes a lease for tensors of ``sizes`` bytes takes (each part aligned)."""
        return sum(_round_up(max(n, 1), ALIGN) for n in sizes)

    def lease(self, sizes: Sequence[int]) -> Lease:
        """One extent for tensors of ``sizes`` bytes, from free space if any region has a large
        enough extent (after collecting what was dropped), else from a new region."""
        need = self.extent_bytes(sizes)
        found = self._take(need)
        if found is None:
            self._collect()                 # finalizers run here, outside our lock
            found = self._take(need)
        while found is None and self._drop_oldest_idle():
            self._collect()                 # the slot's arrays go, then its extent
            found = self._take(need)
        if found is None:
            memory = self._allocate(max(need, self._region_bytes))
            region = _Region(memory, Extents(len(memory)))
            with self._lock:
                self._regions.append(region)
                self._grown += 1
                found = self._lease_locked(region, region.extents.alloc(need))
        return found

    def keep(self, signature: tuple, arrays: tuple, views: tuple, span: np.ndarray | None = None) -> Slot:
        """Keep a new load's extent as a slot (its arrays wrap ``views``; ``span``, its bytes:
        :meth:`Lease.span`); it is busy until :meth:`done` with it."""
        slot = Slot(signature, list(arrays), views, sum(v.nbytes for v in views), busy=True, span=span)
        with self._lock:
            self._clock += 1
            slot.used = self._clock
            self._slots.setdefault(signature, OrderedDict())[slot] = None
            if slot.arrays:
                self._slot_of[id(slot.arrays[0])] = slot
        return slot

    def released(self, arrays: Sequence) -> None:
        """The weight cache let go of ``arrays`` (a model evicted): their slot, if they are one's,
        is the first a reuse of its signature checks (it is idle once no execution holds them)."""
        if not arrays:
            return
        with self._lock:
            slot = self._slot_of.get(id(arrays[0]))
            if slot is not None and slot.arrays[0] is arrays[0]:
                self._slots[slot.signature].move_to_end(slot, last=False)

    def reuse(self, signature: tuple) -> Slot | None:
        """An idle slot of ``signature``, now busy (the caller copies into its views, then calls
        :meth:`done`), or None."""
        with self._lock:
            slots = self._slots.get(signature)
            if slots is None:
                return None
            for slot in slots:
                if slot.idle():
                    slot.busy = True
                    self._clock += 1
                    slot.used = self._clock
                    self._reused += 1
                    slots.move_to_end(slot)
                    return slot
        return None

    def done(self, slot: Slot) -> tuple:
        """The load into ``slot`` is over (copied, or abandoned): a new tuple of its arrays for
        the caller (held, its references keep the slot from being reused)."""
        arrays = tuple(slot.arrays)
        slot.busy = False
        return arrays

    def _drop_oldest_idle(self) -> bool:
        """Forget the idle slot used least recently (its extent is free once jax lets go of its
        arrays); False when none is idle."""
        with self._lock:
            oldest = None
            for slots in self._slots.values():
                for slot in slots:
                    if (oldest is None or slot.used < oldest.used) and slot.idle():
                        oldest = slot
            if oldest is None:
                return False
            self._forget_slot_locked(oldest)
            return True

    def _forget_slot_locked(self, slot: Slot) -> None:
        slots = self._slots[slot.signature]
        del slots[slot]
        if slot.arrays and self._slot_of.get(id(slot.arrays[0])) is slot:
            del self._slot_of[id(slot.arrays[0])]
        if not slots:
            del self._slots[slot.signature]

    def _take(self, need: int) -> Lease | None:
        with self._lock:
            best: _Region | None = None
            for region in self._regions:    # the fullest region that has room: keeps others empty
                if region.extents.largest_free >= need and (
                        best is None or region.extents.free_bytes < best.extents.free_bytes):
                    best = region
            if best is None:
                return None
            return self._lease_locked(best, best.extents.alloc(need))

    def _lease_locked(self, region: _Region, offset: int) -> Lease:
        lease = Lease(self, region, offset)
        self._live.add(lease)
        self._leases += 1
        return lease

    def _give_back_locked(self, lease: Lease) -> None:
        self._live.discard(lease)
        region = lease._region
        region.extents.free(lease._offset)
        # An empty region is kept while the pool is within four times what it keeps: a region
        # given back at once is allocated (and its pages faulted) again by the next load that
        # finds the others held, by an execution still using an evicted model or by the arrays
        # of the previous dispatch (measured: a region allocated on every load). trim() gives
        # back every empty one.
        if region.extents.empty and len(self._regions) > 1 and self._capacity() > 4 * self._keep:
            self._regions.remove(region)
            self._released += 1

    def trim(self) -> int:
        """Give every idle slot and then every empty region back to the system; returns the
        bytes of the regions released."""
        with self._lock:
            for slot in [s for slots in self._slots.values() for s in slots if s.idle()]:
                self._forget_slot_locked(slot)
        self._collect()
        with self._lock:
            empty = [r for r in self._regions if r.extents.empty]
            for region in empty:
                self._regions.remove(region)
            self._released += len(empty)
            return sum(r.extents.capacity for r in empty)

    def _capacity(self) -> int:
        return sum(r.extents.capacity for r in self._regions)

    def stats(self) -> PoolStats:
        with self._lock:
            idle = sum(slot.nbytes for slots in self._slots.values() for slot in slots if slot.idle())
            return PoolStats(self._capacity(), sum(r.extents.used_bytes for r in self._regions),
                             max((r.extents.largest_free for r in self._regions), default=0),
                             len(self._regions), self._leases, self._grown, self._released, idle, self._reused)


def aligned_bytes(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """``nbytes`` of uninitialized uint8 memory whose start is a multiple of ``align`` bytes."""
    raw = np.empty(nbytes + align, np.uint8)
    skew = (-raw.ctypes.data) % align
    return raw[skew:skew + nbytes]


def _page_aligned(nbytes: int) -> np.ndarray:
    return aligned_bytes(nbytes, 4096)
