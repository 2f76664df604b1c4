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

import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Protocol

# The policies a node file may name (``runtime.weight_eviction``); the first is the default.
POLICIES = ("gdsf", "lru")
DEFAULT_POLICY = POLICIES[0]


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


@dataclass(slots=True)
class _Standing:
    nbytes: int
    frequency: int       # references since it became resident (0: on probation, not used again yet)
    clock: float         # the clock at its last reference
    seq: int             # order of the last reference: breaks ties, least recent first


class GreedyDualSizeFrequency:
    """GreedyDual-Size-Frequency (Cherkasova, 1998) over resident models.

    A model's priority is ``clock_at_last_reference + frequency x cost(model) / size``; the
    lowest goes first, ties least recently used first. The clock rises to the priority of each
    model evicted, so a model that was hot once but is no longer used is overtaken by the
    clock and evicted in time. Frequency counts references since the model became resident
    (it restarts after an eviction) and saturates at ``max_frequency``: unbounded, a model
    hot for a long time keeps its place for as long again after popularity moves on (on the
    simulator's shifting trace, 1.9x MIN's misses at 5x the budget instead of 1.2x). ``cost(key, nbytes)`` is read when the order is asked
    for, so a cost that is still being learned applies to every model alike.

    With ``admission`` (the default), every model's references are also counted across
    evictions, and every count is halved each time the references since the last halving
    reach ``aging x`` the number of models counted (TinyLFU's reset; exact counts, since the
    keys are the cache's own models, not a stream of strangers). A newcomer whose count is
    not above that of the model next in line for eviction enters on probation: frequency 0,
    so its priority is the clock and it goes first unless it is used again.
    """

    name = "gdsf"

    def __init__(self, cost: Callable[[Hashable, int], float], *, admission: bool = True,
                 aging: int = 10, max_frequency: int = 16) -> None:
        self._cost = cost
        self._standing: dict[Hashable, _Standing] = {}
        self._seq = itertools.count()
        self.clock = 0.0
        self.admission = admission
        self._aging = aging
        self._counts: dict[Hashable, int] = {}
        self._since_aging = 0
        self.max_frequency = max_frequency

    def _count(self, key: Hashable) -> int:
        self._counts[key] = self._counts.get(key, 0) + 1
        self._since_aging += 1
        if self._since_aging >= self._aging * len(self._counts):
            self._since_aging = 0
            self._counts = {k: c >> 1 for k, c in self._counts.items() if c > 1}
        return self._counts.get(key, 0)

    def priority(self, key: Hashable) -> float:
        s = self._standing[key]
        return s.clock + s.frequency * self._cost(key, s.nbytes) / max(1, s.nbytes)

    def insert(self, key: Hashable, nbytes: int) -> None:
        frequency = 1
        if self.admission:
            count = self._count(key)
            rival = min(self._standing, key=lambda k: (self.priority(k), self._standing[k].seq), default=None)
            if rival is not None and count <= self._counts.get(rival, 0):
                frequency = 0
        self._standing[key] = _Standing(nbytes, frequency, self.clock, next(self._seq))

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

    def remove(self, key: Hashable, *, evicted: bool) -> None:
        if key not in self._standing:
            return
        if evicted:
            self.clock = max(self.clock, self.priority(key))
        del self._standing[key]

    def forget(self, key: Hashable) -> None:
        self._standing.pop(key, None)
        self._counts.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        ranked = sorted((self.priority(k), s.seq, i, k) for i, (k, s) in enumerate(self._standing.items()))
        return iter([k for *_, k in ranked])


class LoadCost:
    """The time a load of ``nbytes`` takes on this device, learned from the loads timed.

    A least-squares line ``overhead + nbytes / bandwidth`` over the recent loads (exponentially
    weighted, half-life ``halflife`` loads), one per ``source`` (``host`` copies and ``disk``
    reads of unpinned models differ). One line per source rather than one number per model:
    two models of one size then always cost the same, whatever noise their own loads had, so
    the order between them is recency's, and a model never loaded yet is costed from the
    others. Before any load the cost is ``nbytes / default_bandwidth``.
    """

    def __init__(self, default_bandwidth: float = 10e9, halflife: float = 64.0) -> None:
        self.default_bandwidth = default_bandwidth
        self._decay = 0.5 ** (1.0 / halflife)
        self._sums: dict[str, list[float]] = {}     # source -> [w, sx, sy, sxx, sxy] (x in MiB)

    def observe(self, nbytes: int, seconds: float, source: str = "host") -> None:
        if not (seconds >= 0 and math.isfinite(seconds)):
            return
        x = nbytes / (1 << 20)
        sums = self._sums.setdefault(source, [0.0] * 5)
        for i, term in enumerate((1.0, x, seconds, x * x, x * seconds)):
            sums[i] = sums[i] * self._decay + term

    def __call__(self, nbytes: int, source: str = "host") -> float:
        sums = self._sums.get(source)
        if sums is None:
            return nbytes / self.default_bandwidth
        w, sx, sy, sxx, sxy = sums
        x = nbytes / (1 << 20)
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var <= 1e-9 * max(mx * mx, 1e-12):      # one size seen so far: scale its mean time
            return my * x / mx if mx > 0 else my
        slope = (sxy / w - mx * my) / var
        overhead = my - slope * mx
        if slope < 0:
            slope, overhead = 0.0, my
        elif overhead < 0:
            slope, overhead = (my / mx if mx > 0 else 0.0), 0.0
        return max(overhead + slope * x, 1e-12)


def make_policy(name: str, cost: Callable[[Hashable, int], float]) -> Policy:
    """The policy ``name`` (one of :data:`POLICIES`); ValueError naming the choices otherwise."""
    if name == "lru":
        return LeastRecentlyUsed()
    if name == "gdsf":
        return GreedyDualSizeFrequency(cost)
    raise ValueError(f"unknown weight eviction policy {name!r}; expected one of {', '.join(POLICIES)}")
