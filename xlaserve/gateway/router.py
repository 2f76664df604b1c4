"""Which worker serves a request: the gateway's routing state and modes (pure: no I/O).

:class:`Router` holds what discovery last saw on each worker (the models it has READY, with
their versions) and answers :meth:`Router.pick` for a model:

- ``round_robin``: the model's ready replicas in turn;
- ``least_outstanding``: the ready replica with the fewest requests in flight at the gateway (to
  that worker, whatever the model; ties go to the worker after the one picked last);
- ``lpt_packing``: only the workers the placement chose for the model (:meth:`Router.set_placement`;
  any ready replica until there is one, or when none of the chosen is ready). Requests fill one
  replica before the next gets any: the open replica takes the model's requests until
  ``fill_factor`` x the model's largest compiled batch size (:meth:`Router.set_capacity`) are in
  flight to it, then a batch opens on the next replica with room, in turn (``fill_rr``) or on the
  least loaded worker by the placement's measured load (``fill_least``); when every replica is
  full, the one with the fewest in flight. Requests are counted, not rows: the gateway does not
  decode tensors.

A worker that is down (its connection lost, or stopping) is never picked; a model READY on no
worker has no pick, and :meth:`Router.why_not` says why in words naming each worker's state.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

__all__ = ["ModelOnWorker", "Router", "MODES", "POLICIES"]

MODES = ("round_robin", "least_outstanding", "lpt_packing")
POLICIES = ("fill_rr", "fill_least")


@dataclass(frozen=True, slots=True)
class ModelOnWorker:
    """One model as one worker reports it (WatchStatus / RepositoryIndex)."""

    name: str
    state: str          # READY, LOADING, UNAVAILABLE, UNLOADING
    version: int
    reason: str = ""


class Router:
    """Routing over ``workers`` (names, in the node's order). ``outstanding(worker)`` gives the
    requests in flight to a worker (least_outstanding reads it at each pick)."""

    def __init__(self, workers: Iterable[str], mode: str = "round_robin",
                 outstanding: Callable[[str], int] = lambda worker: 0, *, fill_factor: float = 1.0,
                 policy: str = "fill_rr") -> None:
        if mode not in MODES:
            raise ValueError(f"routing mode must be one of {', '.join(MODES)}; got {mode!r}")
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        self.workers: tuple[str, ...] = tuple(workers)
        self.mode = mode
        #: whether picks read the calls in flight per (worker, model) (lpt_packing's filling):
        #: only then must the caller report them (started, finished)
        self.counts_calls = mode == "lpt_packing"
        self.fill_factor = fill_factor
        self.policy = policy
        self._outstanding = outstanding
        self._placed: Mapping[str, tuple[str, ...]] | None = None
        self._load: Mapping[str, float] = {}
        self._capacity: dict[str, int] = {}
        self._open: dict[str, str] = {}                      # model -> the replica being filled
        self._in_flight: dict[tuple[str, str], int] = {}     # (worker, model) -> requests
        self._models: dict[str, dict[str, ModelOnWorker]] = {w: {} for w in self.workers}
        self._up: dict[str, bool] = {w: False for w in self.workers}
        self._why_down: dict[str, str] = {}
        self._replicas: dict[str, tuple[str, ...]] = {}
        self._turn: dict[str, int] = {}

    # ---- which workers there are (DNS endpoints come and go) ------------------------------
    def add_worker(self, worker: str) -> None:
        """A new worker, down until discovery reports it."""
        if worker not in self._up:
            self.workers += (worker,)
            self._up[worker] = False
            self._models[worker] = {}

    def remove_worker(self, worker: str) -> None:
        if worker in self._up:
            self.workers = tuple(w for w in self.workers if w != worker)
            del self._up[worker], self._models[worker]
            self._rebuild()

    # ---- what discovery reports -----------------------------------------------------------
    def worker_up(self, worker: str, models: Iterable[ModelOnWorker]) -> None:
        """``worker`` is reachable and serves ``models`` (its whole catalog, as reported now)."""
        if worker not in self._up:
            return                  # removed meanwhile
        self._up[worker] = True
        self._models[worker] = {m.name: m for m in models}
        self._rebuild()

    def worker_down(self, worker: str, why: str = "unreachable") -> None:
        """``worker`` is unreachable (or stopping, or refused: ``why``): route nothing to it
        until it is up again."""
        if worker not in self._up:
            return
        self._why_down[worker] = why
        self._up[worker] = False
        self._models[worker] = {}
        self._rebuild()

    def _rebuild(self) -> None:
        replicas: dict[str, list[str]] = {}
        for worker in self.workers:
            if not self._up[worker]:
                continue
            for model in self._models[worker].values():
                if model.state == "READY":
                    replicas.setdefault(model.name, []).append(worker)
        self._replicas = {name: tuple(ws) for name, ws in replicas.items()}

    # ---- questions -------------------------------------------------------------------------
    def is_up(self, worker: str) -> bool:
        return self._up.get(worker, False)

    def replicas(self, model: str) -> tuple[str, ...]:
        """The workers that have ``model`` READY, in the node's order."""
        return self._replicas.get(model, ())

    def models(self) -> dict[str, dict[str, ModelOnWorker]]:
        """Every model any reachable worker reports: name -> worker -> what it says."""
        out: dict[str, dict[str, ModelOnWorker]] = {}
        for worker in self.workers:
            for name, model in self._models[worker].items():
                out.setdefault(name, {})[worker] = model
        return out

    def ready_models(self) -> tuple[str, ...]:
        return tuple(sorted(self._replicas))

    # ---- lpt_packing -----------------------------------------------------------------------
    def set_placement(self, workers_of: Mapping[str, tuple[str, ...]], load_of: Mapping[str, float]) -> None:
        """The placement to route by (``lpt_packing``): model -> its workers; worker -> load."""
        self._placed = dict(workers_of)
        self._load = dict(load_of)

    def placed(self, model: str) -> tuple[str, ...]:
        return self._placed.get(model, ()) if self._placed is not None else ()

    def set_capacity(self, model: str, largest_batch: int) -> None:
        """The model's largest compiled batch size (what one replica's batch holds)."""
        self._capacity[model] = max(1, largest_batch)

    def forget_models_except(self, known: Iterable[str]) -> None:
        """Drop what is kept per model (capacity, the replica being filled, the round-robin turn)
        for every model not in ``known``: a worker that reports new names all the time (broken or
        hostile) would otherwise grow these without bound."""
        known = set(known)
        for table in (self._capacity, self._open, self._turn):
            for model in [m for m in table if m not in known]:
                del table[model]

    def started(self, worker: str, model: str) -> None:
        """A request to ``model`` went to ``worker`` (counted for filling)."""
        key = (worker, model)
        self._in_flight[key] = self._in_flight.get(key, 0) + 1

    def finished(self, worker: str, model: str) -> None:
        key = (worker, model)
        left = self._in_flight.get(key, 0) - 1
        if left > 0:
            self._in_flight[key] = left
        else:
            self._in_flight.pop(key, None)

    def in_flight(self, worker: str, model: str) -> int:
        return self._in_flight.get((worker, model), 0)

    def _fill(self, model: str, replicas: tuple[str, ...]) -> str:
        placed = [w for w in self.placed(model) if w in replicas]
        if placed:
            replicas = tuple(placed)
        cap = max(1, round(self.fill_factor * self._capacity.get(model, 1)))
        current = self._open.get(model)
        if current in replicas and self.in_flight(current, model) < cap:
            return current
        room = [w for w in replicas if self.in_flight(w, model) < cap]
        if not room:
            chosen = min(replicas, key=lambda w: self.in_flight(w, model))
        elif self.policy == "fill_least":
            chosen = min(room, key=lambda w: (self._load.get(w, 0.0), self._outstanding(w), replicas.index(w)))
        else:
            after = replicas.index(current) + 1 if current in replicas else 0
            chosen = next(replicas[(after + i) % len(replicas)] for i in range(len(replicas))
                          if replicas[(after + i) % len(replicas)] in room)
        self._open[model] = chosen
        return chosen

    def pick(self, model: str) -> str | None:
        """The worker for the next request to ``model``, or None when no worker has it READY."""
        replicas = self._replicas.get(model)
        if not replicas:
            return None
        if self.mode == "lpt_packing":
            return self._fill(model, replicas)
        turn = self._turn.get(model, 0)
        if self.mode == "round_robin" or len(replicas) == 1:
            worker = replicas[turn % len(replicas)]
        else:
            n = len(replicas)
            worker = min((replicas[(turn + i) % n] for i in range(n)), key=self._outstanding)
        self._turn[model] = turn + 1
        return worker

    def why_not(self, model: str) -> str:
        """Why ``model`` has no pick, naming each worker's view of it."""
        views = []
        for worker in self.workers:
            if not self._up[worker]:
                views.append(f"{worker}: {self._why_down.get(worker, 'unreachable')}")
                continue
            seen = self._models[worker].get(model)
            if seen is None:
                views.append(f"{worker}: not in its repository")
            else:
                views.append(f"{worker}: {seen.state}" + (f" ({seen.reason})" if seen.reason else ""))
        known = sorted(self.models())
        if not any(model in self._models[w] for w in self.workers):
            listed = ", ".join(known[:20]) + (", ..." if len(known) > 20 else "")
            return f"model '{model}' is not served by any worker ({'; '.join(views)}); models: {listed or 'none'}"
        return f"model '{model}' is not ready on any worker ({'; '.join(views)})"

    def snapshot(self) -> Mapping[str, object]:
        """For metrics and the dashboard: up flags and replicas."""
        return {"up": dict(self._up), "replicas": dict(self._replicas)}
