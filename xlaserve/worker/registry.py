"""The model table: what the worker serves. Written by the lifecycle actor only; everyone else
reads :attr:`ModelTable.snapshot`, an immutable mapping replaced on every change."""
from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

import trio

from xlaserve.bundle import ModelVersion


class ModelState(enum.StrEnum):
    LOADING = "LOADING"
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"
    UNLOADING = "UNLOADING"


@dataclass(frozen=True, slots=True)
class ModelEntry:
    name: str
    state: ModelState
    reason: str = ""
    serving: ModelVersion | None = None   # the version requests are admitted to

    @property
    def version(self) -> int | None:
        return self.serving.version if self.serving else None


class ModelTable:
    def __init__(self) -> None:
        self.snapshot: Mapping[str, ModelEntry] = MappingProxyType({})
        self.startup_done = trio.Event()
        #: set (and replaced) whenever the table changes: a status stream sends the change now
        self.changed = trio.Event()

    def ready(self) -> bool:
        """The worker's readiness (``/readyz``, KServe ``ServerReady``): the start-up set has
        finished loading (each bundle ready or failed) and at least one model can be served. An
        empty repository, or one whose every bundle failed, is not ready."""
        return self.startup_done.is_set() and self.state_counts()[ModelState.READY.value] > 0

    def state_counts(self) -> dict[str, int]:
        """How many models are in each state, every state listed (0 for none), by state name."""
        counts = {state.value: 0 for state in ModelState}
        for entry in self.snapshot.values():
            counts[entry.state.value] += 1
        return counts

    def publish(self, entry: ModelEntry) -> None:
        table = dict(self.snapshot)
        table[entry.name] = entry
        self._swap(table)

    def publish_all(self, entries) -> None:
        """Publish several entries in one swap (watchers see them together)."""
        table = dict(self.snapshot)
        for entry in entries:
            table[entry.name] = entry
        self._swap(table)

    def update(self, name: str, **changes) -> ModelEntry:
        entry = replace(self.snapshot[name], **changes)
        self.publish(entry)
        return entry

    def remove(self, name: str) -> None:
        table = dict(self.snapshot)
        if table.pop(name, None) is not None:
            self._swap(table)

    def _swap(self, table: dict[str, ModelEntry]) -> None:
        self.snapshot = MappingProxyType(dict(sorted(table.items())))
        changed, self.changed = self.changed, trio.Event()
        changed.set()
