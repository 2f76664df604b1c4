"""``lpt_packing``'s placement: which workers host which models (issue 15, part 3).

A pure function, :func:`place`: models with their measured compute load and weight bytes, workers
with their weight budgets, and a replica count in; a placement out. No I/O and no clock, so the
gateway can call it whenever ``rebalance_compute_seconds`` of measured work have passed, and the
tests can call it with any numbers.

The packing is longest-processing-time-first, subject to memory:

- A model's **load** is what it costs the device per second of wall time: its learned cost per
  request (seconds) times its arrival rate (requests per second), from the workers' statistics.
  A model with ``replicas`` r is placed on r distinct workers, each replica carrying load / r.
- Replicas are placed heaviest first (ties: more weight bytes first, then by name, so the result
  never depends on the order models are given in). Each goes to the worker, among those not yet
  holding that model, whose placed weights still leave room for the model's bytes and whose load
  is the smallest (ties: fewer bytes placed, then name). Zero-load models therefore spread by
  memory.
- When no worker has room, the replica goes to the least loaded worker anyway (a model must be
  served somewhere; the weight cache evicts on demand) and that worker is reported in
  :attr:`Placement.over_budget` with its models and bytes, for the gateway's one warning.

``replicas`` larger than the number of workers is capped to it ("all" means every worker).

The gateway's placement loop (:mod:`xlaserve.gateway.run`) does the I/O: it asks the workers for
their status and statistics and applies a placement. What it decides is here too, as pure
objects: when to place again and from what loads (:class:`Rebalancer`), and what residency a
placement asks each worker to give each model (:func:`residency_for`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

__all__ = ["ModelLoad", "WorkerBudget", "OverBudget", "Placement", "Rebalance", "Rebalancer", "place",
           "residency_for"]

Replicas = int | Literal["all"]


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """One model as the packer sees it. ``replicas`` None: the default replica count."""

    name: str
    load: float                 # device-seconds per second: learned cost x arrival rate
    weight_bytes: int
    replicas: Replicas | None = None


@dataclass(frozen=True, slots=True)
class WorkerBudget:
    """One worker: the bytes of weights it may hold (its weight cache's budget)."""

    name: str
    budget_bytes: int


@dataclass(frozen=True, slots=True)
class OverBudget:
    """A worker whose placed weights exceed its budget: which models, how many bytes."""

    worker: str
    models: tuple[str, ...]
    placed_bytes: int
    budget_bytes: int


@dataclass(frozen=True, slots=True)
class Placement:
    """Where each model lives. ``workers_of[model]`` lists its replicas' workers in the order
    they were chosen (the first is the least loaded when the model was placed)."""

    workers_of: Mapping[str, tuple[str, ...]]
    load_of: Mapping[str, float]            # worker -> load placed on it
    bytes_of: Mapping[str, int]             # worker -> weight bytes placed on it
    over_budget: tuple[OverBudget, ...]

    def models_on(self, worker: str) -> tuple[str, ...]:
        """The models placed on ``worker``, by name."""
        return tuple(sorted(m for m, ws in self.workers_of.items() if worker in ws))


def _replicas(model: ModelLoad, default: Replicas, workers: int) -> int:
    wanted = default if model.replicas is None else model.replicas
    if wanted == "all":
        return workers
    if isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 1:
        raise ValueError(f"model '{model.name}': replicas must be an integer >= 1 or 'all', not {wanted!r}")
    return min(wanted, workers)


def place(models: Iterable[ModelLoad], workers: Iterable[WorkerBudget], default_replicas: Replicas = 1, *,
          previous: Mapping[str, tuple[str, ...]] | None = None, stickiness: float = 0.1) -> Placement:
    """Place ``models`` on ``workers`` (see the module docstring). With ``previous`` (the last
    placement), a replica stays on a worker that held the model if that worker has room and its
    load is within ``stickiness`` x the mean load per worker of the least loaded choice: moving
    a model costs weight copies on two workers, so small changes in measured load move nothing.
    Raises ValueError, naming the model or worker, for a negative load or size, a budget below
    0, a name given twice, a bad replica count, or no workers at all."""
    workers = list(workers)
    models = list(models)
    if not workers:
        raise ValueError("no workers to place models on")
    for kind, names in (("worker", [w.name for w in workers]), ("model", [m.name for m in models])):
        seen = set()
        for name in names:
            if name in seen:
                raise ValueError(f"{kind} '{name}' is given twice")
            seen.add(name)
    for w in workers:
        if w.budget_bytes < 0:
            raise ValueError(f"worker '{w.name}': budget_bytes must be >= 0, not {w.budget_bytes}")
    for m in models:
        if not m.load >= 0:         # also refuses NaN
            raise ValueError(f"model '{m.name}': load must be >= 0, not {m.load}")
        if m.weight_bytes < 0:
            raise ValueError(f"model '{m.name}': weight_bytes must be >= 0, not {m.weight_bytes}")
    budget = {w.name: w.budget_bytes for w in workers}
    load = {w.name: 0.0 for w in workers}
    used = {w.name: 0 for w in workers}
    hosts: dict[str, list[str]] = {}
    counts = {m.name: _replicas(m, default_replicas, len(workers)) for m in models}
    # every replica is a job of load / r; heaviest first, then larger, then by name
    jobs = sorted(((m.load / counts[m.name], m) for m in models for _ in range(counts[m.name])),
                  key=lambda job: (-job[0], -job[1].weight_bytes, job[1].name))
    slack = stickiness * sum(m.load for m in models) / len(workers)
    for share, m in jobs:
        taken = hosts.setdefault(m.name, [])
        free = [w for w in budget if w not in taken]
        fitting = [w for w in free if used[w] + m.weight_bytes <= budget[w]]
        chosen = min(fitting or free, key=lambda w: (load[w], used[w], w))
        if previous:
            stay = [w for w in previous.get(m.name, ()) if w in (fitting or free) and load[w] <= load[chosen] + slack]
            if stay:
                chosen = min(stay, key=lambda w: (load[w], used[w], w))
        taken.append(chosen)
        load[chosen] += share
        used[chosen] += m.weight_bytes
    over = tuple(
        OverBudget(w, tuple(sorted(m for m, ws in hosts.items() if w in ws)), used[w], budget[w])
        for w in budget if used[w] > budget[w])
    return Placement(MappingProxyType({m: tuple(ws) for m, ws in hosts.items()}), MappingProxyType(load),
                     MappingProxyType(used), over)


@dataclass(frozen=True, slots=True)
class Rebalance:
    """A placement to apply: ``placement``, made from ``measured_seconds`` of device time the
    workers executed since the last one (``by_size``: no load measured yet, placed by weight
    size alone)."""

    placement: Placement
    measured_seconds: float
    by_size: bool


class Rebalancer:
    """When to place again, and from what loads: the workers' status in, a placement out.

    :meth:`decide` places the models the first time, again whenever the workers or the models
    change, and whenever the workers have measured ``rebalance_compute_seconds`` of device time
    since the last placement, each model's load then being its device seconds per second over
    that span; otherwise it answers None (keep the placement there is). Each placement starts
    from the last (:func:`place`'s ``previous``). Pure: the caller passes the time and the
    measurements, and applies what is decided.
    """

    def __init__(self, rebalance_compute_seconds: float, default_replicas: Replicas = 1,
                 replicas_for: Callable[[str], Replicas | None] = lambda model: None, *, now: float) -> None:
        self.rebalance_compute_seconds = rebalance_compute_seconds
        self.default_replicas = default_replicas
        self.replicas_for = replicas_for
        self.placement: Placement | None = None      #: the last placement decided
        self._measured_at: Mapping[tuple[str, str], float] = {}
        self._placed_at = now
        self._shape: tuple = ()

    def decide(self, workers: Sequence[WorkerBudget], models: Sequence[str], weight_bytes: Mapping[str, int],
               measured: Mapping[tuple[str, str], float], now: float) -> Rebalance | None:
        """``workers``: those up, with their budgets; ``models``: those ready somewhere, with
        their sizes in ``weight_bytes`` (0 when unknown); ``measured``: the device seconds each
        (worker, model) has executed so far; ``now``: the caller's clock, in seconds."""
        shape = (tuple(w.name for w in workers), tuple(models))
        spent = sum(max(0.0, v - self._measured_at.get(k, 0.0)) for k, v in measured.items())
        if self.placement is not None and shape == self._shape and spent < self.rebalance_compute_seconds:
            return None
        span = max(now - self._placed_at, 1e-9)
        loads = {m: 0.0 for m in models}
        if self.placement is not None:
            for (w, m), v in measured.items():
                if m in loads:
                    loads[m] += max(0.0, v - self._measured_at.get((w, m), 0.0)) / span
        self.placement = place(
            [ModelLoad(m, loads[m], weight_bytes.get(m, 0), self.replicas_for(m)) for m in models],
            workers, self.default_replicas,
            previous=self.placement.workers_of if self.placement is not None else None)
        self._measured_at, self._placed_at, self._shape = measured, now, shape
        return Rebalance(self.placement, spent, not any(loads.values()))


def residency_for(worker: str, model: str, current: str | None,
                  workers_of: Mapping[str, tuple[str, ...]]) -> str | None:
    """The residency a placement asks ``worker`` to give ``model``, or None to leave it as it
    is (``current``, as the worker reports it): ``system`` (its host copy kept) where the
    model is placed, ``unpinned`` (host RAM freed; a stray request reads it from disk)
    elsewhere. A model the operator pinned (``device``), or whose residency is not known, is
    left as it is."""
    if current not in ("system", "unpinned"):
        return None
    wanted = "system" if worker in workers_of.get(model, ()) else "unpinned"
    return None if wanted == current else wanted
