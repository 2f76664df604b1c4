"""Replacement policies of the weight cache: which resident model goes first when room is needed.

Pure bookkeeping, no I/O and no clock. A policy is told what happens to resident models (one
became resident, a dispatch used one, one left the device) and answers, when a copy needs room,
the resident models in the order they should be evicted. It never decides what *may* be evicted:
:class:`~xlaserve.runtime.residency.ResidencyBook` skips pinned models, models being loaded and
the model in use, whatever the order says.

* :class:`LeastRecentlyUsed` (``lru``): the least recently used model first.
* :class:`GreedyDualSizeFrequency` (``gdsf``): the model with the lowest
  ``clock + frequency x cost / size`` first, where ``cost`` is the time its load takes and
  ``clock`` is the priority of the last model evicted (so models that stopped being used age
  out). A small model that is cheap to keep and often used outranks a big one used as often.
  An admission filter (TinyLFU's idea) keeps one-off models from displacing hot ones: a
  newcomer referenced less often, lately, than the model next in line for eviction enters on
  probation and goes first unless it is used again.

:class:`LoadCost` learns the load time of a model of a given size from the loads the cache
times; ``benchmarks/cache_sim.py`` replays traces under each policy and Belady's MIN
(docs/weights.md has the numbers that chose the default).
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Protocol

# The policies a node file may name (``runtime.weight_eviction``); the first is the default.
POLICIES = ("gdsf", "lru")
DEFAULT_POLICY = POLICIES[0]

DEFAULT_MISS_OVERHEAD = 0.0005
"""Seconds a miss costs beyond its timed copy (``runtime.weight_miss_overhead_seconds``): the
dispatch's bookkeeping, the serving thread's time taken, caches refilled. Measured on the
density benchmark (cpu, 5x the budget): each load made a request stream about 0.7 ms slower
while its copy was timed at about 0.2 ms (docs/weights.md)."""


class Policy(Protocol):
    """What the residency book asks of a replacement policy."""

    name: str

    def insert(self, key: Hashable, nbytes: int) -> None:
        """``key`` (``nbytes`` of weights) is being made resident: its first reference."""

    def hit(self, key: Hashable, *, first: bool = False) -> None:
        """A dispatch used resident ``key``; ``first`` when it is the use the load was made for
        (already counted by :meth:`insert`: it refreshes recency only)."""

    def remove(self, key: Hashable, *, evicted: bool) -> None:
        """``key`` left the device: ``evicted`` to make room, else its load failed."""

    def forget(self, key: Hashable) -> None:
        """``key`` was unloaded: drop everything known about it."""

    def victims(self) -> Iterator[Hashable]:
        """Every model the policy holds, the one to evict first first."""


class LeastRecentlyUsed:
    """Evict the least recently used model first (the cache's behaviour before issue 25)."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable, nbytes: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def hit(self, key: Hashable, *, first: bool = False) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable, *, evicted: bool) -> None:
        self._order.pop(key, None)

    def forget(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        return iter(list(self._order))


_NEVER = object()
"""A :class:`_Standing`'s cost generation before its cost per byte was first asked for."""


@dataclass(slots=True)
class _Standing:
    nbytes: int
    frequency: int       # references since it became resident (0: on probation, not used again yet)
    clock: float         # the clock at its last reference
    seq: int             # order of the last reference: breaks ties, least recent first
    unit: float = 0.0    # cost / size, as the cost was in generation ``generation``
    generation: object = _NEVER


class GreedyDualSizeFrequency:
    """GreedyDual-Size-Frequency (Cherkasova, 1998) over resident models.

    A model's priority is ``clock_at_last_reference + frequency x cost(model) / size``; the
    lowest goes first, ties least recently used first. The clock rises to the priority of each
    model evicted, so a model that was hot once but is no longer used is overtaken by the
    clock and evicted in time. Frequency counts references since the model became resident
    (it restarts after an eviction) and saturates at ``max_frequency``: unbounded, a model
    hot for a long time keeps its place for as long again after popularity moves on (on the
    simulator's shifting trace, 1.9x MIN's misses at 5x the budget instead of 1.2x).

    ``cost(key, nbytes)`` may change as it is learned; the order always uses the cost as it is
    when the order is asked for, so a learned cost applies to every model alike.
    ``cost_generation()`` says when it changed: any value other than the last one seen means
    every priority is recomputed (one pass over the resident models). Without it the cost is
    taken to be fixed.

    With ``admission`` (the default), every model's references are also counted across
    evictions, and every count is halved each time the references since the last halving
    reach ``aging x`` the number of models counted (TinyLFU's reset; exact counts, since the
    keys are the cache's own models, not a stream of strangers). A newcomer whose count is
    not above that of the model next in line for eviction enters on probation: frequency 0,
    so its priority is the clock and it goes first unless it is used again.

    The order is kept in a binary heap of ``(priority, seq, key)`` with lazy invalidation: a
    reference re-files its model (at the next question, once however many references came
    between), the entries it leaves behind are recognised by their old ``seq`` and dropped
    when they reach the top, and the heap is rebuilt when stale entries outnumber live ones or
    the cost changed. The next victim costs O(log n), not a sort of every resident model; the
    order is exactly the sort's (``seq`` is unique, so ties never reach the key).
    """

    name = "gdsf"

    def __init__(self, cost: Callable[[Hashable, int], float], *, admission: bool = True,
                 aging: int = 10, max_frequency: int = 16,
                 cost_generation: Callable[[], Hashable] | None = None) -> None:
        self._cost = cost
        self._standing: dict[Hashable, _Standing] = {}
        self._seq = itertools.count()
        self.clock = 0.0
        self.admission = admission
        self._aging = aging
        self._counts: dict[Hashable, int] = {}
        self._since_aging = 0
        self.max_frequency = max_frequency
        self._cost_generation = cost_generation
        self._heap: list[tuple[float, int, Hashable]] = []
        self._heap_generation: Hashable = None
        self._stale = True               # the heap must be rebuilt before it is read
        self._dirty: set[Hashable] = set()   # referenced since the heap was last brought up to date

    def _count(self, key: Hashable) -> int:
        self._counts[key] = self._counts.get(key, 0) + 1
        self._since_aging += 1
        if self._since_aging >= self._aging * len(self._counts):
            self._since_aging = 0
            self._counts = {k: c >> 1 for k, c in self._counts.items() if c > 1}
        return self._counts.get(key, 0)

    def priority(self, key: Hashable) -> float:
        generation = self._cost_generation() if self._cost_generation is not None else None
        return self._priority(key, self._standing[key], generation)

    def _priority(self, key: Hashable, s: _Standing, generation: Hashable) -> float:
        """``s``'s priority with the cost of ``generation``: the cost per byte is asked for once
        a generation and kept (a miss re-files each model referenced since the last one, and
        asking the learned cost costs more than the rest of the priority). Without
        ``cost_generation`` the generation is always None: the cost is taken to be fixed, so it
        is asked once."""
        if s.generation != generation:
            s.unit = self._cost(key, s.nbytes) / max(1, s.nbytes)
            s.generation = generation
        return s.clock + s.frequency * s.unit

    def _sync(self) -> None:
        """Bring the heap up to date: rebuilt when the cost changed or stale entries pile up,
        else the models referenced since the last question filed again."""
        generation = self._cost_generation() if self._cost_generation is not None else None
        heap = self._heap
        standing = self._standing
        if self._stale or generation != self._heap_generation or len(heap) > 2 * len(standing) + 32:
            heap[:] = [(self._priority(k, s, generation), s.seq, k) for k, s in standing.items()]
            heapq.heapify(heap)
            self._heap_generation = generation
            self._stale = False
        else:
            for key in self._dirty:
                s = standing[key]
                heapq.heappush(heap, (self._priority(key, s, generation), s.seq, key))
        self._dirty.clear()

    def _top(self) -> Hashable | None:
        """The model to evict first now (None when none is held)."""
        self._sync()
        heap, standing = self._heap, self._standing
        while heap:
            _, seq, key = heap[0]
            s = standing.get(key)
            if s is not None and s.seq == seq:
                return key
            heapq.heappop(heap)
        return None

    def insert(self, key: Hashable, nbytes: int) -> None:
        frequency = 1
        if self.admission:
            count = self._count(key)
            rival = self._top()
            if rival is not None and count <= self._counts.get(rival, 0):
                frequency = 0
        self._standing[key] = _Standing(nbytes, frequency, self.clock, next(self._seq))
        self._dirty.add(key)

    def hit(self, key: Hashable, *, first: bool = False) -> None:
        s = self._standing.get(key)
        if s is None:
            return
        if not first:
            s.frequency = min(s.frequency + 1, self.max_frequency)
            if self.admission:
                self._count(key)
        s.clock = self.clock
        s.seq = next(self._seq)
        self._dirty.add(key)

    def remove(self, key: Hashable, *, evicted: bool) -> None:
        if key not in self._standing:
            return
        if evicted:
            self.clock = max(self.clock, self.priority(key))
        del self._standing[key]
        self._dirty.discard(key)

    def forget(self, key: Hashable) -> None:
        if self._standing.pop(key, None) is not None:
            self._dirty.discard(key)
        self._counts.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        """The order now, lazily (each next victim O(log n)); do not change the policy while
        iterating."""
        top = self._top()
        if top is None:
            return iter(())
        return self._in_order(top)

    def _in_order(self, top: Hashable) -> Iterator[Hashable]:
        yield top                       # the usual plan needs one victim: no copy of the heap
        heap = list(self._heap)         # (top is at its front: _top left it there)
        heapq.heappop(heap)
        standing = self._standing
        while heap:
            _, seq, key = heapq.heappop(heap)
            s = standing.get(key)
            if s is not None and s.seq == seq:
                yield key


class LoadCost:
    """The time a load of ``nbytes`` takes on this device, learned from the loads timed.

    A least-squares line ``overhead + nbytes / bandwidth`` over the recent loads (exponentially
    weighted, half-life ``halflife`` loads), one per ``source`` (``host`` copies and ``disk``
    reads of unpinned models differ). One line per source rather than one number per model:
    two models of one size then always cost the same, whatever noise their own loads had, so
    the order between them is recency's, and a model never loaded yet is costed from the
    others. Before any load the cost is ``nbytes / default_bandwidth``.

    The answers given are remembered and kept until a load moves the line, for some size asked
    about since, by more than ``tolerance`` (relative to the answer plus ``charged_beside``,
    what the caller adds to every answer); only then do they change, all at once,
    and :attr:`generation` with them. Every load nudges the line, and a policy that orders by
    cost re-ranks every resident model when the generation changes: with a tolerance that is
    once in a while (when the device's speed really changed), not on every miss.

    Within a generation every answer for a source comes from one line, the one fitted when the
    first was asked for. The relative difference between two lines, ``(a' + b'x) / (a + bx) -
    1``, is monotonic in the size ``x``, so a load checks only the smallest and largest size
    asked about: O(1) a load however many sizes the catalog has (it was one check per size).
    """

    def __init__(self, default_bandwidth: float = 10e9, halflife: float = 64.0, tolerance: float = 1 / 32,
                 charged_beside: float = 0.0) -> None:
        self.default_bandwidth = default_bandwidth
        self.tolerance = tolerance
        # seconds the user of the answers adds to each (the weight cache's miss overhead): a
        # move is measured against what is charged in all, so that a small model's copy, a
        # fraction of its miss, does not re-rank every resident model on each wobble
        self._beside = charged_beside
        self._decay = 0.5 ** (1.0 / halflife)
        self._sums: dict[str, list[float]] = {}     # source -> [w, sx, sy, sxx, sxy] (x in MiB)
        self.generation = 0                         # changes when the answers do
        self._known: dict[tuple[int, str], float] = {}   # answers given in this generation
        # source -> [the line its answers come from, the smallest and largest size asked]
        self._given: dict[str, list] = {}

    def observe(self, nbytes: int, seconds: float, source: str = "host") -> None:
        if not (seconds >= 0 and math.isfinite(seconds)):
            return
        x = nbytes / (1 << 20)
        sums = self._sums.get(source)
        if sums is None:
            sums = self._sums[source] = [0.0] * 5
        d = self._decay
        sums[0] = sums[0] * d + 1.0
        sums[1] = sums[1] * d + x
        sums[2] = sums[2] * d + seconds
        sums[3] = sums[3] * d + x * x
        sums[4] = sums[4] * d + x * seconds
        given = self._given.get(source)
        if given is None:                           # nothing asked about this source yet
            return
        line, smallest, largest = given
        moved = self._fit(source)                   # only this source's line moved
        for size in (smallest, largest):
            was = self._at(line, size)
            if abs(self._at(moved, size) - was) > self.tolerance * (was + self._beside):
                self.generation += 1
                self._known.clear()
                self._given.clear()
                return

    def __call__(self, nbytes: int, source: str = "host") -> float:
        known = self._known.get((nbytes, source))
        if known is None:
            given = self._given.get(source)
            if given is None:
                given = self._given[source] = [self._fit(source), nbytes, nbytes]
            elif nbytes < given[1]:
                given[1] = nbytes
            elif nbytes > given[2]:
                given[2] = nbytes
            known = self._known[(nbytes, source)] = self._at(given[0], nbytes)
        return known

    def _fit(self, source: str) -> tuple[float, float] | None:
        """The line ``(overhead seconds, seconds per MiB)`` for ``source``; None before any load."""
        sums = self._sums.get(source)
        if sums is None:
            return None
        w, sx, sy, sxx, sxy = sums
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var <= 1e-9 * max(mx * mx, 1e-12):      # one size seen so far: scale its mean time
            return (0.0, my / mx) if mx > 0 else (my, 0.0)
        slope = (sxy / w - mx * my) / var
        overhead = my - slope * mx
        if slope < 0:
            slope, overhead = 0.0, my
        elif overhead < 0:
            slope, overhead = (my / mx if mx > 0 else 0.0), 0.0
        return overhead, slope

    def _at(self, line: tuple[float, float] | None, nbytes: int) -> float:
        if line is None:
            return nbytes / self.default_bandwidth
        overhead, slope = line
        return max(overhead + slope * (nbytes / (1 << 20)), 1e-12)


def make_policy(name: str, cost: Callable[[Hashable, int], float],
                cost_generation: Callable[[], Hashable] | None = None) -> Policy:
    """The policy ``name`` (one of :data:`POLICIES`); ValueError naming the choices otherwise.
    ``cost_generation``: see :class:`GreedyDualSizeFrequency` (None: ``cost`` never changes)."""
    if name == "lru":
        return LeastRecentlyUsed()
    if name == "gdsf":
        return GreedyDualSizeFrequency(cost, cost_generation=cost_generation)
    raise ValueError(f"unknown weight eviction policy {name!r}; expected one of {', '.join(POLICIES)}")
