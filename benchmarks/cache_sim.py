"""Offline simulator of the weight cache's replacement policies (issue 25). Deterministic.

Replays a sequence of model references through the cache's own bookkeeping
(:class:`~xlaserve.runtime.residency.ResidencyBook` with each policy of
:mod:`xlaserve.runtime.eviction`) and through Belady's MIN, and prints misses per request and
bytes copied, each relative to MIN.

  python -m benchmarks.cache_sim sweep [--requests 50000] [--seed 1] [--policies lru gdsf]
      Synthetic traces: 100 models of 256 KiB to 4 MiB, catalogs 1x, 2x, 5x and 10x the
      budget; Zipf(0.6), Zipf(1.0), Zipf(1.2), uniform, and Zipf(1.0) whose ranking is reshuffled
      every --shift-every requests.
  python -m benchmarks.cache_sim replay TRACE.jsonl [--budget-bytes N]
      A trace the worker recorded (``runtime.weight_trace``; docs/weights.md): the budget is the
      trace's unless given; costs are the load times the trace measured.

MIN here is the size-oblivious one: on a miss it evicts the resident models whose next use is
farthest in the future until the newcomer fits. With models of one size that is the optimum;
with varied sizes the optimum is NP-hard and this MIN is only an upper bound on it (a policy
that prefers small models can miss less than it; ratios below 1 are possible).
"""
from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from xlaserve.runtime.cachetrace import read_trace
from xlaserve.runtime.eviction import DEFAULT_MISS_OVERHEAD, POLICIES, GreedyDualSizeFrequency, LoadCost, make_policy
from xlaserve.runtime.residency import Floor, ResidencyBook

KIB = 1 << 10
SIZES_KIB = (256, 512, 1024, 2048, 4096)        # the density benchmark's (benchmarks/weights_bench.py)
# Synthetic load cost: a fixed part plus the copy. The default is the cpu backend's measured
# copy bandwidth with a small fixed part; --overhead-ms 2.1 models today's 2.4 ms misses.
DEFAULT_OVERHEAD_MS = 0.05
DEFAULT_BANDWIDTH_GBS = 8.0
# Besides the node file's policies: GDSF without its admission filter, to show what the filter buys.
EXTRA_POLICIES = ("gdsf-plain",)


@dataclass(frozen=True, slots=True)
class Trace:
    """References in order, each model's bytes, the budget, each model's load cost (seconds)
    and the models pinned to the device."""

    name: str
    refs: tuple[Hashable, ...]
    sizes: dict
    budget: int
    cost: Callable[[Hashable, int], float]
    pinned: frozenset = frozenset()


@dataclass(frozen=True, slots=True)
class Result:
    policy: str
    requests: int
    misses: int
    bytes_copied: int
    load_seconds: float      # the misses' costs summed: the time spent loading

    @property
    def miss_ratio(self) -> float:
        return self.misses / self.requests if self.requests else 0.0


class BeladyMin:
    """Evicts the resident model whose next use is farthest in the future (never: first).
    The simulator sets :attr:`now` to the reference being served before each step."""

    name = "min"

    def __init__(self, next_use: Sequence[float]) -> None:
        self._next_use = next_use
        self._due: dict[Hashable, float] = {}
        self.now = 0

    def insert(self, key: Hashable, nbytes: int) -> None:
        self._due[key] = self._next_use[self.now]

    def hit(self, key: Hashable, *, first: bool = False) -> None:
        if key in self._due:
            self._due[key] = self._next_use[self.now]

    def remove(self, key: Hashable, *, evicted: bool) -> None:
        self._due.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        return iter(sorted(self._due, key=lambda k: -self._due[k]))


def next_uses(refs: Sequence[Hashable]) -> list[float]:
    """For each reference, the index of the next reference to the same model (inf: none)."""
    out = [math.inf] * len(refs)
    seen: dict[Hashable, int] = {}
    for i in range(len(refs) - 1, -1, -1):
        out[i] = seen.get(refs[i], math.inf)
        seen[refs[i]] = i
    return out


def replay(trace: Trace, policy: str) -> Result:
    """Serve ``trace`` with ``policy`` (a name of :data:`~xlaserve.runtime.eviction.POLICIES`
    ``gdsf-plain`` or ``min``): every reference must be resident when it is served, a miss
    copies its bytes."""
    belady = BeladyMin(next_uses(trace.refs)) if policy == "min" else None
    if belady is not None:
        chosen = belady
    elif policy == "gdsf-plain":
        chosen = GreedyDualSizeFrequency(trace.cost, admission=False)
    else:
        chosen = make_policy(policy, trace.cost)
    book = ResidencyBook(trace.budget, chosen)
    for key in sorted(trace.pinned, key=str):
        if book.add(key, trace.sizes[key], Floor.DEVICE):
            raise ValueError(f"pinned model {key!r} does not fit the budget")
        book.begin_load(key)
        book.finish_load(key)
    misses = copied = 0
    seconds = 0.0
    for i, key in enumerate(trace.refs):
        if belady is not None:
            belady.now = i
        if key not in book:
            refused = book.add(key, trace.sizes[key], Floor.SYSTEM)
            if refused:
                raise ValueError(f"model {key!r} can never be resident: {refused}")
        if not book.is_resident(key):
            plan = book.plan(key)
            if not plan.ok:
                raise ValueError(f"model {key!r} cannot be made resident: {plan.refused}")
            for victim in plan.evict:
                book.evict(victim)
            book.begin_load(key)
            book.finish_load(key)
            misses += 1
            copied += trace.sizes[key]
            seconds += trace.cost(key, trace.sizes[key])
        book.touch(key)
    return Result(policy, len(trace.refs), misses, copied, seconds)


# ---- synthetic traces -----------------------------------------------------------------------

def linear_cost(overhead_ms: float, bandwidth_gbs: float) -> Callable[[Hashable, int], float]:
    return lambda key, nbytes: overhead_ms / 1e3 + nbytes / (bandwidth_gbs * 1e9)


def synthetic(popularity: str, catalog_x: float, requests: int, seed: int, *, models: int = 100,
              shift_every: int = 5000, cost: Callable[[Hashable, int], float] | None = None) -> Trace:
    """``popularity``: ``zipf:<s>``, ``uniform`` or ``shift:<s>`` (Zipf(s) whose ranking is
    reshuffled every ``shift_every`` references). Model sizes and the ranking are drawn from
    ``seed``; the budget is the catalog's bytes / ``catalog_x``."""
    rng = np.random.default_rng(seed)
    sizes = {f"m{i:03d}": int(rng.choice(SIZES_KIB)) * KIB for i in range(models)}
    names = list(sizes)
    kind, _, s = popularity.partition(":")
    if kind == "uniform":
        weights = np.ones(models)
    elif kind in ("zipf", "shift"):
        weights = 1.0 / np.arange(1, models + 1) ** float(s)
    else:
        raise ValueError(f"unknown popularity {popularity!r}; expected zipf:<s>, uniform or shift:<s>")
    weights /= weights.sum()
    refs: list[str] = []
    while len(refs) < requests:
        ranking = rng.permutation(models)             # rank r -> model ranking[r]
        n = min(requests - len(refs), shift_every if kind == "shift" else requests)
        refs.extend(names[ranking[r]] for r in rng.choice(models, size=n, p=weights))
    budget = max(max(sizes.values()), int(sum(sizes.values()) / catalog_x))
    return Trace(f"{popularity} {catalog_x:g}x", tuple(refs), sizes, budget,
                 cost or linear_cost(DEFAULT_OVERHEAD_MS, DEFAULT_BANDWIDTH_GBS))


def recorded(path: str, budget: int | None = None, miss_overhead: float = DEFAULT_MISS_OVERHEAD) -> Trace:
    """A trace the worker recorded: references are (model, version); a model's cost is learned
    from the load times the trace measured, as the worker learns it (:class:`LoadCost`), plus
    ``miss_overhead`` seconds a miss (``runtime.weight_miss_overhead_seconds``)."""
    header, events = read_trace(path)
    sizes, refs, pinned = {}, [], set()
    learned = LoadCost()
    for event in events:
        key = (event.model, event.version)
        sizes[key] = event.nbytes
        refs.append(key)
        if event.floor == "device":
            pinned.add(key)
        if event.load_seconds is not None:
            learned.observe(event.nbytes, event.load_seconds, "disk" if event.floor == "unpinned" else "host")
    floors = {(e.model, e.version): e.floor for e in events}
    return Trace(path, tuple(refs), sizes, budget or header.budget_bytes,
                 lambda key, nbytes: learned(nbytes, "disk" if floors.get(key) == "unpinned" else "host") + miss_overhead,
                 frozenset(pinned))


# ---- report ---------------------------------------------------------------------------------

def compare(trace: Trace, policies: Sequence[str]) -> dict[str, Result]:
    return {p: replay(trace, p) for p in (*policies, "min")}


def print_table(rows: list[tuple[str, dict[str, Result]]], policies: Sequence[str], out=sys.stdout) -> None:
    """One row per trace: MIN's misses per request, then per policy its misses per request and
    its misses, bytes copied and load time, each divided by MIN's."""
    head = f"{'trace':<14} {'MIN miss/req':>12}"
    for p in policies:
        head += f" | {p + ' miss/req':>16} {'misses':>6} {'bytes':>6} {'time':>6}"
    print(head, file=out)
    for name, results in rows:
        best = results["min"]
        line = f"{name:<14} {best.miss_ratio:>12.4f}"
        for p in policies:
            r = results[p]
            line += (f" | {r.miss_ratio:>16.4f} {_ratio(r.misses, best.misses):>6} "
                     f"{_ratio(r.bytes_copied, best.bytes_copied):>6} {_ratio(r.load_seconds, best.load_seconds):>6}")
        print(line, file=out)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else ("1.000" if a == 0 else "inf")


SWEEP_POPULARITY = ("zipf:0.6", "zipf:1.0", "zipf:1.2", "uniform", "shift:1.0")
SWEEP_CATALOG = (1, 2, 5, 10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cache_sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sweep = sub.add_parser("sweep", help="synthetic traces: popularity x catalog size")
    sweep.add_argument("--requests", type=int, default=50_000)
    sweep.add_argument("--seed", type=int, default=1)
    sweep.add_argument("--shift-every", type=int, default=5000)
    sweep.add_argument("--popularity", nargs="+", default=list(SWEEP_POPULARITY))
    sweep.add_argument("--catalog", nargs="+", type=float, default=list(SWEEP_CATALOG))
    sweep.add_argument("--overhead-ms", type=float, default=DEFAULT_OVERHEAD_MS)
    sweep.add_argument("--bandwidth-gbs", type=float, default=DEFAULT_BANDWIDTH_GBS)
    sweep.add_argument("--policies", nargs="+", default=["lru", "gdsf-plain", "gdsf"], choices=(*POLICIES, *EXTRA_POLICIES))
    rep = sub.add_parser("replay", help="a trace recorded by a worker (runtime.weight_trace)")
    rep.add_argument("trace")
    rep.add_argument("--budget-bytes", type=int, default=None)
    rep.add_argument("--miss-overhead-ms", type=float, default=DEFAULT_MISS_OVERHEAD * 1e3,
                     help="added to each learned load time, as runtime.weight_miss_overhead_seconds is")
    rep.add_argument("--policies", nargs="+", default=list(POLICIES), choices=(*POLICIES, *EXTRA_POLICIES))
    args = parser.parse_args(argv)
    rows = []
    if args.command == "sweep":
        cost = linear_cost(args.overhead_ms, args.bandwidth_gbs)
        print(f"{args.requests} requests, seed {args.seed}, cost {args.overhead_ms} ms + bytes / "
              f"{args.bandwidth_gbs} GB/s, shift every {args.shift_every}")
        for pop in args.popularity:
            for x in args.catalog:
                trace = synthetic(pop, x, args.requests, args.seed, shift_every=args.shift_every, cost=cost)
                rows.append((trace.name, compare(trace, args.policies)))
    else:
        trace = recorded(args.trace, args.budget_bytes, args.miss_overhead_ms / 1e3)
        print(f"{len(trace.refs)} references to {len(trace.sizes)} models, budget {trace.budget} bytes")
        rows.append(("recorded", compare(trace, args.policies)))
    print_table(rows, args.policies)


if __name__ == "__main__":
    main()
