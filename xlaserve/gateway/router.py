"""Which worker serves a request: the gateway's routing state and modes (pure: no I/O).

:class:`Router` holds what discovery last saw on each worker (the models it has READY, with
their versions) and answers :meth:`Router.pick` for a model:

- ``round_robin``: the model's ready replicas in turn;
- ``least_outstanding``: the ready replica with the fewest requests in flight at the gateway (to
  that worker, whatever the model; ties go to the worker after the one picked last).

A worker that is down (its connection lost, or stopping) is never picked; a model READY on no
worker has no pick, and :meth:`Router.why_not` says why in words naming each worker's state.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

__all__ = ["ModelOnWorker", "Router", "MODES"]

MODES = ("round_robin", "least_outstanding")


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
                 outstanding: Callable[[str], int] = lambda worker: 0) -> None:
        if mode not in MODES:
            raise ValueError(f"routing mode must be one of {', '.join(MODES)}; got {mode!r}")
        self.workers: tuple[str, ...] = tuple(workers)
        self.mode = mode
        self._outstanding = outstanding
        self._models: dict[str, dict[str, ModelOnWorker]] = {w: {} for w in self.workers}
        self._up: dict[str, bool] = {w: False for w in self.workers}
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

    def worker_down(self, worker: str) -> None:
        """``worker`` is unreachable (or stopping): route nothing to it until it is up again."""
        if worker not in self._up:
            return
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

    def pick(self, model: str) -> str | None:
        """The worker for the next request to ``model``, or None when no worker has it READY."""
        replicas = self._replicas.get(model)
        if not replicas:
            return None
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
                views.append(f"{worker}: unreachable")
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
