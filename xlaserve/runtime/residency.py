"""Residency policy of the weight cache: the byte budget, residency floors and eviction order.

Pure bookkeeping, no I/O: :class:`ResidencyBook` decides what is resident, what to evict to
make room (in the order of a replacement policy, :mod:`xlaserve.runtime.eviction`) and what may
never be evicted; :class:`~xlaserve.runtime.weights.WeightCache` does the copies it decides on.
:class:`ThrashMonitor` watches how often dispatches evict.
"""
from __future__ import annotations

import enum
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator
from dataclasses import dataclass

from xlaserve.runtime.eviction import LeastRecentlyUsed, Policy


class Floor(enum.StrEnum):
    """How resident a model's weights stay at least (``scheduler.models.<name>.residency``)."""

    DEVICE = "device"      # on the device for the server's lifetime; counted in the budget
    SYSTEM = "system"      # host copy kept; device copy on demand, evictable
    UNPINNED = "unpinned"  # no host copy; read from disk on every load

    @classmethod
    def parse(cls, value: str) -> Floor:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"residency must be one of device, system, unpinned; got {value!r}") from None


def fmt_bytes(n: int) -> str:
    """``1536`` -> ``'1.5 KiB (1536 bytes)'``: human and exact, for messages."""
    size = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{n} bytes" if unit == "bytes" else f"{size:.1f} {unit} ({n} bytes)"


@dataclass(frozen=True, slots=True)
class Budget:
    """The device weight budget and how it was derived, in bytes.

    ``bytes = min(weight_cache_fraction x arena, arena - headroom)``; ``headroom`` is the larger
    of ``weight_cache_wiggle_fraction x arena`` and the biggest activation footprint (temp +
    output + input bytes) of any compiled executable seen so far.
    """

    arena: int
    fraction: float
    wiggle: int
    activations: int = 0

    @property
    def headroom(self) -> int:
        return max(self.wiggle, self.activations)

    @property
    def on_demand(self) -> bool:
        """False when ``weight_cache_fraction`` is 0: every model's weights stay resident."""
        return self.fraction > 0

    @property
    def bytes(self) -> int:
        room = max(0, self.arena - self.headroom)
        return room if not self.on_demand else min(int(self.fraction * self.arena), room)

    def explain(self) -> str:
        share = (f"weight_cache_fraction {self.fraction:g} of the arena" if self.on_demand
                 else "weight_cache_fraction 0: all weights resident")
        return (f"device weight budget {fmt_bytes(self.bytes)}: arena {fmt_bytes(self.arena)}, {share}, "
                f"headroom {fmt_bytes(self.headroom)} kept free for activations "
                f"(wiggle {fmt_bytes(self.wiggle)}, largest executable {fmt_bytes(self.activations)})")


@dataclass(frozen=True, slots=True)
class Plan:
    """What making one model resident takes: the models to evict first, in the policy's order.
    ``refused`` says why it cannot be done now (nothing is evicted then)."""

    evict: tuple[Hashable, ...] = ()
    refused: str = ""

    @property
    def ok(self) -> bool:
        return not self.refused


@dataclass(slots=True)
class _Entry:
    nbytes: int
    floor: Floor
    resident: bool = False
    loading: bool = False   # a copy is under way; its bytes are already reserved
    fresh: bool = False     # made resident and not used yet: its first use was counted at the load


def _may_evict(entry: _Entry | None) -> bool:
    """Whether a model with this entry may be evicted now (whatever the caller protects):
    resident, not being copied, not pinned to the device."""
    return entry is not None and entry.resident and not entry.loading and entry.floor is not Floor.DEVICE


class ResidencyBook:
    """Which models are resident against a byte budget, and which to evict to make room.

    Keys are opaque (the cache uses ``(name, version)``). Victims are taken in ``policy``'s
    order (default :class:`~xlaserve.runtime.eviction.LeastRecentlyUsed`); whatever it says, a
    model with floor ``device`` is never chosen for eviction, nor is any key in ``protect`` (the
    model executing now) or a model being loaded.
    """

    def __init__(self, budget: int, policy: Policy | None = None) -> None:
        self.budget = budget
        self.policy: Policy = policy or LeastRecentlyUsed()
        self._entries: dict[Hashable, _Entry] = {}
        self._lru: OrderedDict[Hashable, None] = OrderedDict()  # resident or loading, oldest first
        # running sums, so that no question about bytes scans every model
        self._used = 0          # bytes of the models in _lru (resident or loading)
        self._resident = 0      # bytes of the resident models
        self._pinned = 0        # bytes of the models with floor device

    # ---- registration ----------------------------------------------------------------------
    def add(self, key: Hashable, nbytes: int, floor: Floor) -> str:
        """Register a model (a key already known is forgotten first); returns why it can never be
        served under this budget, or ''."""
        if nbytes > self.budget:
            return (f"its weights take {fmt_bytes(nbytes)} but the whole device weight budget is "
                    f"{fmt_bytes(self.budget)}")
        if floor is Floor.DEVICE and self.pinned_bytes() + nbytes > self.budget:
            return (f"pinning it (residency: device) needs {fmt_bytes(nbytes)} but models already pinned "
                    f"hold {fmt_bytes(self.pinned_bytes())} of the {fmt_bytes(self.budget)} budget")
        if key in self._entries:
            self.remove(key)
        self._entries[key] = _Entry(nbytes, floor)
        if floor is Floor.DEVICE:
            self._pinned += nbytes
        return ""

    def remove(self, key: Hashable) -> bool:
        """Forget a model; True when it was resident or loading (its device copy must go)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            if key in self._lru:
                self._used -= entry.nbytes
            if entry.resident:
                self._resident -= entry.nbytes
            if entry.floor is Floor.DEVICE:
                self._pinned -= entry.nbytes
        self._lru.pop(key, None)
        self.policy.forget(key)
        return entry is not None and (entry.resident or entry.loading)

    def set_floor(self, key: Hashable, floor: Floor) -> str:
        """Change a model's floor; returns why not (pinning past the budget), or ''."""
        entry = self._entries[key]
        if floor is Floor.DEVICE and entry.floor is not Floor.DEVICE:
            pinned = self.pinned_bytes()
            if pinned + entry.nbytes > self.budget:
                return (f"pinning it needs {fmt_bytes(entry.nbytes)} but models already pinned hold "
                        f"{fmt_bytes(pinned)} of the {fmt_bytes(self.budget)} budget")
        self._pinned += entry.nbytes * ((floor is Floor.DEVICE) - (entry.floor is Floor.DEVICE))
        entry.floor = floor
        return ""

    def set_budget(self, budget: int) -> None:
        self.budget = budget

    # ---- queries ---------------------------------------------------------------------------
    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def floor(self, key: Hashable) -> Floor:
        return self._entries[key].floor

    def nbytes(self, key: Hashable) -> int:
        return self._entries[key].nbytes

    def is_resident(self, key: Hashable) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.resident

    def keys(self) -> tuple[Hashable, ...]:
        return tuple(self._entries)

    def lru_order(self) -> tuple[Hashable, ...]:
        """Resident (or loading) models, least recently used first."""
        return tuple(self._lru)

    def evictable(self, protect: Iterable[Hashable] = ()) -> Iterator[Hashable]:
        """Resident models that may be evicted now, in the policy's order (next victim first):
        not pinned to the device, not loading, not in ``protect``."""
        protected = set(protect)
        for key in self.policy.victims():
            if key not in protected and _may_evict(self._entries.get(key)):
                yield key

    def used_bytes(self) -> int:
        """Bytes resident or reserved by a copy under way."""
        return self._used

    def resident_bytes(self) -> int:
        return self._resident

    def pinned_bytes(self) -> int:
        return self._pinned

    def free_bytes(self) -> int:
        return self.budget - self.used_bytes()

    # ---- decisions -------------------------------------------------------------------------
    def plan(self, key: Hashable, protect: Iterable[Hashable] = (), *, may_evict: bool = True,
             spare: Collection[Hashable] = ()) -> Plan:
        """What making ``key`` resident takes. With ``may_evict=False`` (prefetch is polite)
        the plan is refused unless the model fits in free space already. Models in ``spare``
        (those with queued work) are victims only when the others do not make room, and then
        in the policy's order."""
        entry = self._entries[key]
        if entry.resident or entry.loading:
            return Plan()
        need = entry.nbytes - self.free_bytes()
        if need <= 0:
            return Plan()
        if not may_evict:
            return Plan(refused=f"needs {fmt_bytes(need)} more than is free")
        # _in_eviction_order inlined: a miss plans once, and on a small model the generators'
        # layers cost as much as the plan
        entries = self._entries
        protected = {*protect, key}
        victims: list[Hashable] = []
        spared: list[Hashable] = []
        for other in self.policy.victims():
            e = entries.get(other)
            if other in protected or not _may_evict(e):
                continue
            if other in spare:
                spared.append(other)
                continue
            victims.append(other)
            need -= e.nbytes
            if need <= 0:
                return Plan(tuple(victims))
        for other in spared:
            victims.append(other)
            need -= entries[other].nbytes
            if need <= 0:
                return Plan(tuple(victims))
        return Plan(refused=(f"it needs {fmt_bytes(entry.nbytes)}; the budget is {fmt_bytes(self.budget)}, "
                             f"{fmt_bytes(self.used_bytes())} of it held by models that cannot be evicted now "
                             "(pinned, in use or loading)"))

    def eviction_order(self, protect: Iterable[Hashable] = (),
                       spare: Collection[Hashable] = ()) -> tuple[Hashable, ...]:
        """Every model a load would evict now, in the order :meth:`plan` takes them (the next
        victim first): the evictable models (:meth:`evictable`) not in ``spare`` in the policy's
        order, then those in ``spare`` in the policy's order. A load evicts a prefix of it."""
        return tuple(self._in_eviction_order(protect, spare))

    def _in_eviction_order(self, protect: Iterable[Hashable], spare: Collection[Hashable]) -> Iterator[Hashable]:
        spared: list[Hashable] = []
        for other in self.evictable(protect):
            if other in spare:
                spared.append(other)
            else:
                yield other
        yield from spared

    def begin_load(self, key: Hashable) -> None:
        """Reserve the model's bytes: a copy onto the device is under way."""
        entry = self._entries[key]
        entry.loading = True
        entry.fresh = True
        if key not in self._lru:
            self._used += entry.nbytes
        self._lru[key] = None
        self._lru.move_to_end(key)
        self.policy.insert(key, entry.nbytes)

    def finish_load(self, key: Hashable, ok: bool = True) -> None:
        entry = self._entries.get(key)
        if entry is None:      # removed while the copy ran
            return
        entry.loading = False
        if ok and not entry.resident:
            self._resident += entry.nbytes
        elif not ok and entry.resident:
            self._resident -= entry.nbytes
        entry.resident = ok
        if ok:
            self._lru.move_to_end(key)
        else:
            if self._lru.pop(key, 0) is None:
                self._used -= entry.nbytes
            self.policy.remove(key, evicted=False)

    def evict(self, key: Hashable) -> None:
        entry = self._entries[key]
        if entry.floor is Floor.DEVICE:
            raise ValueError(f"{key!r} is pinned (residency: device) and cannot be evicted")
        if entry.resident:
            self._resident -= entry.nbytes
        entry.resident = False
        if self._lru.pop(key, 0) is None:
            self._used -= entry.nbytes
        self.policy.remove(key, evicted=True)

    def touch(self, key: Hashable) -> None:
        """A dispatch used a resident model: most recently used now, and one more reference
        for the policy (the first use after a load was counted by the load)."""
        if key in self._lru:
            self._lru.move_to_end(key)
            entry = self._entries[key]
            self.policy.hit(key, first=entry.fresh)
            entry.fresh = False


class ThrashMonitor:
    """Counts how many of the last ``window`` dispatches had to evict. :meth:`record` returns
    True when the share exceeds ``threshold``, no warning was given in the last ``window``
    dispatches and none in the last ``interval`` seconds (``clock``: monotonic seconds), so a
    thrashing worker warns about once per window, and no more often than once per interval
    however fast it dispatches (a worker at 2,000 dispatches a second would otherwise log a
    warning of a few KiB 30 times a second). :attr:`suppressed` says how many windows met the
    share since the last warning without one."""

    def __init__(self, window: int = 64, threshold: float = 0.5, *, interval: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self.threshold = threshold
        self.interval = interval
        self._clock = clock
        self._recent: deque[bool] = deque(maxlen=window)
        self._evicting = 0          # how many of _recent are True
        self._since_warning = window
        self._warned_at: float | None = None
        self.suppressed = 0

    def record(self, evicted: bool) -> bool:
        recent = self._recent
        if len(recent) == self.window:
            self._evicting -= recent[0]
        recent.append(evicted)
        self._evicting += evicted
        self._since_warning += 1
        if (len(recent) == self.window and self._since_warning >= self.window
                and self._evicting > self.threshold * self.window):
            self._since_warning = 0
            now = self._clock()
            if self._warned_at is not None and now - self._warned_at < self.interval:
                self.suppressed += 1
                return False
            self._warned_at = now
            return True
        return False

    def warned(self) -> int:
        """The windows suppressed since the last warning (the one being given now); resets it."""
        count, self.suppressed = self.suppressed, 0
        return count

    @property
    def evicting_share(self) -> float:
        return self._evicting / len(self._recent) if self._recent else 0.0
