"""The lifecycle actor: finds bundles in ``model_repo``, loads them off the Trio thread and
publishes each ready version to the model table. A version is immutable; a new one is built
beside the old and swapped in, and a failed load never takes down a working version."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from xlaserve.bundle import ModelVersion, is_bundle, load_bundle
from xlaserve.config import WorkerConfig
from xlaserve.errors import BundleError, ModelNotFound, Unavailable
from xlaserve.runtime.pjrt import Device
from xlaserve.worker.messages import DropModel, SchedulerMessage
from xlaserve.worker.registry import ModelEntry, ModelState, ModelTable

log = logging.getLogger("xlaserve.lifecycle")


@dataclass(frozen=True, slots=True)
class LoadModel:
    name: str
    reply: Callable[[Exception | None], None]


@dataclass(frozen=True, slots=True)
class UnloadModel:
    name: str
    reply: Callable[[Exception | None], None]


LifecycleMessage = LoadModel | UnloadModel


class Lifecycle:
    def __init__(self, config: WorkerConfig, device: Device, table: ModelTable,
                 scheduler: trio.MemorySendChannel[SchedulerMessage], weights, compile_module=None) -> None:
        self._config = config
        self._device = device
        self._table = table
        self._scheduler = scheduler
        self._weights = weights
        self._compile_module = compile_module
        self._versions: dict[str, int] = {}
        self._compile_limiter = trio.CapacityLimiter(1)

    @property
    def repo(self) -> Path:
        return Path(self._config.model_repo)

    def discover(self) -> list[str]:
        """Bundle names in the repository, filtered by ``models_include`` when set."""
        if not self.repo.is_dir():
            log.error("model_repo %s is not a directory; serving no models", self.repo)
            return []
        names = sorted(p.name for p in self.repo.iterdir() if is_bundle(p))
        include = self._config.models_include
        return [n for n in names if not include or n in include]

    async def run(self, inbox: trio.MemoryReceiveChannel[LifecycleMessage], *,
                  task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        if self._config.model_control_mode != "explicit":
            await self.load_all(self.discover())
        self._table.startup_done.set()
        async with inbox:
            async for message in inbox:
                match message:
                    case LoadModel(name=name, reply=reply):
                        reply(await self._load_requested(name))
                    case UnloadModel(name=name, reply=reply):
                        reply(await self.unload(name))

    async def load_all(self, names: list[str]) -> None:
        started = time.perf_counter()
        for i, name in enumerate(names, 1):
            log.info("loading %s (%d of %d)", name, i, len(names))
            await self.load(name)
        ready = sum(1 for n in names if self._table.snapshot[n].state is ModelState.READY)
        log.info("start-up: %d of %d bundle(s) ready in %.1fs", ready, len(names), time.perf_counter() - started)

    async def _load_requested(self, name: str) -> Exception | None:
        if not is_bundle(self.repo / name):
            return ModelNotFound(name, self.discover())
        entry = await self.load(name)
        if entry.state is not ModelState.READY:
            return Unavailable(f"model '{name}' failed to load: {entry.reason}")
        return None

    async def load(self, name: str) -> ModelEntry:
        """Build a new version of ``name`` and swap it in; on failure the old one keeps serving."""
        current = self._table.snapshot.get(name)
        if current is None:
            self._table.publish(ModelEntry(name, ModelState.LOADING))
        version = self._versions.get(name, 0) + 1
        self._versions[name] = version
        started = time.perf_counter()
        try:
            model: ModelVersion = await trio.to_thread.run_sync(
                self._load_blocking, self.repo / name, version, limiter=self._compile_limiter)
        except BundleError as exc:
            reason = str(exc)
            log.error("%s", reason)
            previous = self._table.snapshot.get(name)
            if previous is not None and previous.serving is not None:
                return self._table.update(name, reason=f"reload failed, still serving version "
                                                       f"{previous.version}: {reason}")
            return self._table.update(name, state=ModelState.UNAVAILABLE, reason=reason)
        old = self._table.snapshot.get(name)
        entry = ModelEntry(name, ModelState.READY, "", model)
        self._table.publish(entry)
        log.info("%s version %d ready in %.2fs", name, version, time.perf_counter() - started)
        if old is not None and old.serving is not None:
            self._weights.release(name, old.serving.version)
        return entry

    def _load_blocking(self, path: Path, version: int) -> ModelVersion:
        return load_bundle(path, version, self._device, self._compile_module, progress=log.info)

    async def unload(self, name: str) -> Exception | None:
        entry = self._table.snapshot.get(name)
        if entry is None:
            return ModelNotFound(name, list(self._table.snapshot))
        self._table.remove(name)
        await self._scheduler.send(DropModel(name, Unavailable(f"model '{name}' was unloaded")))
        self._weights.release(name)
        log.info("%s unloaded", name)
        return None
