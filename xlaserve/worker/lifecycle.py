"""The lifecycle actor: finds bundles in ``model_repo``, loads them off the Trio thread and
publishes each ready version to the model table. A version is immutable; a new one is built
beside the old and swapped in, and a failed load never takes down a working version.

``model_control_mode`` decides what drives it:

- ``dynamic``: the start-up set, then the repository watcher. watchfiles reports file events
  (grouped: it yields once the repository has been quiet for a moment), and a rescan every
  ``model_poll_seconds`` catches anything events miss (network filesystems, a full inotify
  table). Each rescan compares every bundle's :func:`bundle_fingerprint` with the one of its
  last load attempt and loads, reloads or unloads what differs.
- ``static``: the start-up set only; the control surface refuses loads and unloads.
- ``explicit``: nothing until :class:`LoadModel` / :class:`UnloadModel` arrive.

One task owns the actor's state; requests from the control surface and repository rescans
take turns under ``_turn``.

Memory of a replaced version: the swap releases the old version's device copy
(``WeightCache.release``). Requests admitted to the old version still hold its
:class:`ModelVersion` (host weights and executables) and finish on it; the weight cache gives
them a transient device copy, so the old version's memory is gone once the last of them is
answered.
"""
from __future__ import annotations

import gc
import logging
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import trio

from xlaserve.bundle import (HOOKS_FILE, MAX_BUNDLE_NAME_BYTES, BundleHead, ModelVersion, bundle_fingerprint,
                             bundle_name_ok, is_bundle, load_bundle, name_bytes, read_head)
from xlaserve.config import WorkerConfig
from xlaserve.errors import (BundleError, InternalError, InvalidArgument, ModelNotFound, StartupError, Unavailable,
                             describe_exception)
from xlaserve.runtime.executables import ExecutableTable
from xlaserve.runtime.pjrt import Device
from xlaserve.worker.messages import DropModel, SchedulerMessage
from xlaserve.worker.registry import ModelEntry, ModelState, ModelTable

log = logging.getLogger("xlaserve.lifecycle")

WATCH_STEP_MS = 200          # quiet time that ends a group of file events
QUEUED = "queued: start-up loads one bundle at a time"   # a LOADING entry whose turn has not come
WATCH_DEBOUNCE_MS = 1600     # longest a group of events is held before a rescan
#: model.py imports past ``model_import_timeout_seconds`` that may still be running before loads
#: stop starting new ones. Python cannot stop a thread, so each keeps one until its import ends;
#: without a cap, asking again and again for a bundle whose model.py never returns would pile
#: up threads (and what they hold) for as long as the worker lives.
MAX_ABANDONED_IMPORTS = 8


@dataclass(frozen=True, slots=True)
class LoadModel:
    name: str
    reply: Callable[[Exception | None], None]


@dataclass(frozen=True, slots=True)
class UnloadModel:
    name: str
    reply: Callable[[Exception | None], None]


LifecycleMessage = LoadModel | UnloadModel


@dataclass(frozen=True, slots=True)
class RescanPlan:
    """What a rescan does: bundles to load for the first time, to reload, and to unload."""

    added: tuple[str, ...]
    changed: tuple[str, ...]
    removed: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.added or self.changed or self.removed)


def plan_rescan(seen: Mapping[str, str], current: Mapping[str, str]) -> RescanPlan:
    """Compare the fingerprints of the last load attempts (``seen``) with the repository now
    (``current``): new names are added, different fingerprints changed, missing names removed."""
    return RescanPlan(tuple(sorted(set(current) - set(seen))),
                      tuple(sorted(n for n in current if n in seen and seen[n] != current[n])),
                      tuple(sorted(set(seen) - set(current))))


class LifecycleMetrics:
    """The lifecycle's Prometheus series, registered in the worker's registry."""

    def __init__(self, registry) -> None:
        from prometheus_client import Counter, Gauge, Histogram
        self.loads = Counter("xlaserve_model_loads", "Bundle load attempts (start-up, reload, control RPC), "
                             "by model and outcome (ok, failed)", ["model", "outcome"], registry=registry)
        self.load_seconds = Histogram("xlaserve_model_load_duration_seconds",
                                      "Time to build a new version of a bundle (read, validate, compile)",
                                      ["model"], buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
                                      registry=registry)
        self.unloads = Counter("xlaserve_model_unloads", "Bundles unloaded", ["model"], registry=registry)
        self.executable_cache = Counter("xlaserve_executable_cache", "Compiled-executable cache lookups by "
                                        "result (hit, miss, rejected: a corrupt or mismatched entry rebuilt)",
                                        ["result"], registry=registry)
        self.executables = Gauge("xlaserve_executables", "Loaded executables: one per distinct module, shared by "
                                 "every bundle whose module is identical", registry=registry)
        self.executable_references = Gauge("xlaserve_executable_references", "Modules of the loaded versions "
                                           "(bundles x compiled batch sizes) served by those executables",
                                           registry=registry)


class Lifecycle:
    def __init__(self, config: WorkerConfig, device: Device, table: ModelTable,
                 scheduler: trio.MemorySendChannel[SchedulerMessage], weights, compile_module=None,
                 metrics: LifecycleMetrics | None = None) -> None:
        self._config = config
        self._device = device
        self._table = table
        self._scheduler = scheduler
        self._weights = weights
        # One executable per distinct module, shared by every version built from it: a catalog of
        # fine-tuned variants compiles (and holds) one per architecture and batch size.
        self.executables = ExecutableTable(device, compile_module)
        self._metrics = metrics
        if metrics is not None:
            metrics.executables.set_function(lambda: self.executables.statistics().executables)
            metrics.executable_references.set_function(lambda: self.executables.statistics().references)
        self._versions: dict[str, int] = {}
        self._seen: dict[str, str] = {}   # bundle -> fingerprint at its last load attempt or unload
        self._compile_limiter = trio.CapacityLimiter(1)
        # Its own limiter, never the compile one: an import abandoned at its timeout keeps its
        # token until its thread ends, which may be never (see _read_head).
        self._import_limiter = trio.CapacityLimiter(MAX_ABANDONED_IMPORTS)
        self._turn = trio.Lock()
        # The directory the repository watcher follows, as (st_dev, st_ino), and the event that
        # makes it start over: inotify follows a directory, not its path, so a model_repo deleted
        # and made again, or another directory renamed over it, left the watch on the old one,
        # reporting nothing, and changes waited for the poll (model_poll_seconds) from then on.
        self._watched: tuple[int, int] | None = None
        self._rewatch: trio.Event | None = None
        self._repo_missing = False

    @property
    def model_imports_running(self) -> int:
        """Threads importing a bundle's model.py now; between loads, exactly the imports abandoned
        at ``model_import_timeout_seconds`` that have not ended yet."""
        return self._import_limiter.borrowed_tokens

    @property
    def repo(self) -> Path:
        return Path(self._config.model_repo)

    def _included(self, name: str) -> bool:
        include = self._config.models_include
        return not include or name in include

    def discover(self) -> list[str]:
        """Bundle names in the repository, filtered by ``models_include`` when set."""
        if not self.repo.is_dir():
            log.error("model_repo %s is not a directory; serving no models", self.repo)
            return []
        return sorted(p.name for p in self.repo.iterdir() if is_bundle(p) and self._included(p.name))

    # ---- the actor -----------------------------------------------------------------------
    async def run(self, inbox: trio.MemoryReceiveChannel[LifecycleMessage], *,
                  task_status=trio.TASK_STATUS_IGNORED) -> None:
        mode = self._config.model_control_mode
        async with trio.open_nursery() as nursery:
            task_status.started()
            if mode != "explicit":
                await self.load_all(self.discover())
            else:
                log.info("model_control_mode is explicit: no model loads until RepositoryModelLoad asks")
            self._table.startup_done.set()
            self._weights.log_budget()
            # What start-up made (jax, the executables, the catalog) lives as long as the worker.
            # Frozen out of the cyclic collector's sight, the full collection that a burst of
            # requests sets off takes microseconds instead of ~20 ms of a stalled event loop.
            gc.collect()
            gc.freeze()
            if mode == "dynamic":
                rescans_send, rescans = trio.open_memory_channel[None](1)
                rescans_send.send_nowait(None)   # catch what changed while the start-up set loaded
                nursery.start_soon(self._watch, rescans_send.clone())
                nursery.start_soon(self._poll, rescans_send)
                nursery.start_soon(self._serve_rescans, rescans)
            async with inbox:
                async for message in inbox:
                    async with self._turn:
                        message.reply(await self._answer(message))
            nursery.cancel_scope.cancel()

    async def _answer(self, message: LifecycleMessage) -> Exception | None:
        """A client's load or unload, done: its error, or None. Whatever else it raises (a bug,
        an OSError no check foresaw) is that request's INTERNAL answer, logged, never the end
        of this actor and with it the worker."""
        action = "loading" if isinstance(message, LoadModel) else "unloading"
        try:
            if isinstance(message, LoadModel):
                return await self._load_requested(message.name)
            return await self.unload(message.name)
        except StartupError:
            raise
        except Exception as exc:
            log.exception("%s model %r failed", action, message.name[:200])
            return InternalError(f"{action} model {message.name[:200]!r} failed: {type(exc).__name__}: "
                                 f"{describe_exception(exc)}")

    async def _serve_rescans(self, rescans: trio.MemoryReceiveChannel[None]) -> None:
        async with rescans:
            async for _ in rescans:
                if self._rewatch is not None and _identity(self.repo) != self._watched:
                    self._rewatch.set()
                async with self._turn:
                    try:
                        await self.rescan()
                    except StartupError:
                        raise
                    except Exception:       # the next rescan tries again; serving goes on
                        log.exception("rescanning %s failed", self.repo)

    async def _watch(self, rescans: trio.MemorySendChannel[None]) -> None:
        """File events from watchfiles, each group one rescan request (requests coalesce).

        watchfiles waits for events in a thread that Trio cannot interrupt, so a cancel alone
        would wait up to its 5 s timeout; the stop event, set the moment this task is
        cancelled, ends that wait within one ``WATCH_STEP_MS`` instead.

        The watch follows the directory model_repo named when it started. A rescan that finds
        model_repo is another directory now (deleted and made again, renamed over, a symlink
        swapped) or none sets ``_rewatch``, and the watch starts over on what is there; until
        then the poll carries on alone, as it does when events cannot be watched at all."""
        import watchfiles
        async with rescans:
            while True:
                self._rewatch = rewatch = trio.Event()
                self._watched = _identity(self.repo)
                if self._watched is not None:
                    stop = trio.Event()   # watchfiles' thread only reads is_set()
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_set_when_set_or_cancelled, stop, rewatch)
                        try:
                            async for changes in watchfiles.awatch(self.repo, debounce=WATCH_DEBOUNCE_MS,
                                                                   step=WATCH_STEP_MS, recursive=True,
                                                                   stop_event=stop):
                                log.debug("repository events: %d file change(s)", len(changes))
                                _request_rescan(rescans)
                        except (OSError, RuntimeError) as exc:
                            log.warning("cannot watch %s for file events (%s: %s); rescanning every %gs "
                                        "(model_poll_seconds) instead", self.repo, type(exc).__name__, exc,
                                        self._config.model_poll_seconds)
                        nursery.cancel_scope.cancel()   # the watch has ended: so has its stop task
                await rewatch.wait()
                if _identity(self.repo) is not None:
                    log.info("model_repo %s is another directory now; watching it for file events", self.repo)
                    _request_rescan(rescans)

    async def _poll(self, rescans: trio.MemorySendChannel[None]) -> None:
        """The fallback: one rescan every ``model_poll_seconds``."""
        async with rescans:
            while True:
                await trio.sleep(self._config.model_poll_seconds)
                _request_rescan(rescans)

    # ---- repository rescans ------------------------------------------------------------------
    def current_fingerprints(self) -> dict[str, str] | None:
        """Every bundle directory now, with its fingerprint; None when ``model_repo`` is gone or
        not a directory (as a rescan starts or while it lists it). A directory the actor already
        knows counts even while its manifest is missing (a half-done edit), so that edit is a
        failed reload, never an unload."""
        current: dict[str, str] = {}
        try:
            entries = list(self.repo.iterdir())
        except (FileNotFoundError, NotADirectoryError):
            return None
        for p in entries:
            name = p.name
            if name.startswith(".") or not self._included(name) or not p.is_dir():
                continue
            if not (is_bundle(p) or name in self._seen):
                continue
            try:
                current[name] = bundle_fingerprint(p)
            except OSError:
                # A file or directory removed between the listing and its stat (an editor's swap
                # file, rsync's temporary file renamed into place), or the bundle itself: a known
                # bundle keeps its fingerprint, never counted removed (an unload of a serving
                # model); the removal was a file event, and the next rescan looks again.
                if name in self._seen:
                    current[name] = self._seen[name]
        return current

    async def rescan(self) -> RescanPlan:
        current = self.current_fingerprints()
        if current is None:
            # A repository unmounted, deleted by mistake or halfway through being replaced by
            # another directory is not every bundle removed: what is loaded keeps serving until
            # model_repo is back, and its next rescan compares the bundles there.
            if not self._repo_missing:
                log.warning("model_repo %s is gone or not a directory; the %d loaded model(s) keep serving until "
                            "it is back", self.repo, sum(1 for e in self._table.snapshot.values() if e.serving))
            self._repo_missing = True
            return RescanPlan((), (), ())
        if self._repo_missing:
            log.info("model_repo %s is back; rescanning it", self.repo)
            self._repo_missing = False
        plan = plan_rescan(self._seen, current)
        if plan:
            log.info("repository changed: added %s, changed %s, removed %s",
                     list(plan.added) or "-", list(plan.changed) or "-", list(plan.removed) or "-")
        for name in plan.removed:
            self._seen.pop(name, None)
            if name in self._table.snapshot:
                await self.unload(name)
        for name in (*plan.added, *plan.changed):
            await self.load(name)
        return plan

    # ---- loading -------------------------------------------------------------------------
    async def load_all(self, names: list[str]) -> None:
        started = time.perf_counter()
        hits = compiled = shared = 0
        distinct: set[str] = set()
        # Every bundle is LOADING from the start, not absent until its turn: the index, the
        # status stream and a gateway in front show what this worker is about to serve.
        self._table.publish_all(ModelEntry(name, ModelState.LOADING, QUEUED) for name in names
                                if name not in self._table.snapshot)
        for i, name in enumerate(names, 1):
            log.info("start-up: loading %s (%d of %d)", name, i, len(names))
            entry = await self.load(name)
            if entry.serving is not None:
                for module in entry.serving.modules.values():
                    hits += module.cache_hit
                    shared += module.shared
                    compiled += not (module.cache_hit or module.shared)
                    distinct.add(module.key)
        ready = sum(1 for n in names if self._table.snapshot[n].state is ModelState.READY)
        log.info("start-up: %d of %d bundle(s) ready, %d failed, in %.1fs (%d module(s) from the executable "
                 "cache, %d compiled, %d shared with another bundle's identical module; %d distinct "
                 "executable(s))", ready, len(names), len(names) - ready, time.perf_counter() - started,
                 hits, compiled, shared, len(distinct))

    async def _load_requested(self, name: str) -> Exception | None:
        if (size := name_bytes(name)) > MAX_BUNDLE_NAME_BYTES:
            return InvalidArgument(f"model name '{name[:40]}...' is {size} bytes long (UTF-8); a bundle's directory "
                                   f"name is at most {MAX_BUNDLE_NAME_BYTES} bytes")
        if not bundle_name_ok(name):
            # a client's name is joined to model_repo: "../x" or "/abs/x" would load (and run the
            # hooks of) a bundle from anywhere on the host
            return InvalidArgument(f"model name {name[:200]!r} is not a bundle name: a bundle is a directory directly "
                                   "inside model_repo, its name without '/', '\\', NUL or other control characters "
                                   "and not starting with '.'")
        if not self._included(name) or not is_bundle(self.repo / name):
            return ModelNotFound(name, self.discover())
        entry = await self.load(name)
        if entry.state is not ModelState.READY or entry.reason:
            return Unavailable(f"model '{name}' failed to load: {entry.reason}")
        return None

    async def load(self, name: str) -> ModelEntry:
        """Build a new version of ``name`` and swap it in; on failure the old one keeps serving."""
        path = self.repo / name
        try:
            self._seen[name] = bundle_fingerprint(path)
        except OSError:
            self._seen[name] = ""
        current = self._table.snapshot.get(name)
        if current is None or current.state is ModelState.LOADING:     # (queued at start-up)
            self._table.publish(ModelEntry(name, ModelState.LOADING))
        # The number is taken only when the version is published: a failed attempt uses none,
        # so served versions count up without gaps.
        version = self._versions.get(name, 0) + 1
        started = time.perf_counter()
        try:
            head = await self._read_head(path, version)
            # abandoned when the worker stops: a compile that never ends would otherwise hold the
            # shutdown for good
            model: ModelVersion = await trio.to_thread.run_sync(
                self._load_blocking, path, version, head, limiter=self._compile_limiter, abandon_on_cancel=True)
        except (BundleError, OSError) as exc:
            return self._failed(name, exc)
        except StartupError:
            raise                     # the node cannot start as configured: the worker says so and exits
        except Exception as exc:      # a bug, or MemoryError on a huge file: this load fails, not the worker
            return self._failed(name, self._unexpected(name, "loading it", exc))
        try:
            refused = await self._weights.admit(model, during_startup=not self._table.startup_done.is_set())
        except OSError as exc:    # the file changed since its header was read: cp truncates before it writes
            return self._failed(name, BundleError(name, f"cannot read its weights into memory: {exc}"))
        except StartupError:
            raise                     # an all-resident catalog that does not fit: start-up fails, naming sizes
        except Exception as exc:
            return self._failed(name, self._unexpected(name, "taking its weights into host memory", exc))
        if refused:       # its weights can never fit the device weight budget
            return self._failed(name, BundleError(name, refused))
        seconds = time.perf_counter() - started
        old = self._table.snapshot.get(name)
        entry = ModelEntry(name, ModelState.READY, "", model)
        self._versions[name] = version
        self._table.publish(entry)
        hits = sum(m.cache_hit for m in model.modules.values())
        shared = sum(m.shared for m in model.modules.values())
        log.info("%s version %d ready in %.2fs (%d of %d module(s) from the executable cache, %d shared)", name,
                 version, seconds, hits, len(model.modules), shared)
        if self._metrics is not None:
            self._metrics.loads.labels(name, "ok").inc()
            self._metrics.load_seconds.labels(name).observe(seconds)
        if old is not None and old.serving is not None:
            self._weights.release(name, old.serving.version)
            log.info("%s version %d retired; requests admitted to it finish on it", name, old.serving.version)
        return entry

    @staticmethod
    def _unexpected(name: str, doing: str, exc: Exception) -> BundleError:
        """A load's failure that no check foresaw, logged with its traceback, as the load's error."""
        log.error("bundle '%s': %s failed", name, doing, exc_info=exc)
        detail = describe_exception(exc)
        return BundleError(name, f"{doing} failed: {type(exc).__name__}" + (f": {detail}" if detail else ""))

    def _failed(self, name: str, exc: Exception) -> ModelEntry:
        reason = str(exc) if isinstance(exc, BundleError) else \
            f"bundle '{name}': cannot read it: {getattr(exc, 'strerror', None) or exc}"
        if self._metrics is not None:
            self._metrics.loads.labels(name, "failed").inc()
        previous = self._table.snapshot.get(name)
        if previous is not None and previous.serving is not None:
            log.error("%s; still serving version %d", reason, previous.serving.version)
            return self._table.update(name, reason=f"reload failed, still serving version "
                                                   f"{previous.serving.version}: {reason}")
        log.error("%s", reason)
        return self._table.update(name, state=ModelState.UNAVAILABLE, reason=reason)

    async def _read_head(self, path: Path, version: int) -> BundleHead:
        """The bundle's manifest and what its model.py registered (:func:`read_head`), in a thread
        bounded by ``model_import_timeout_seconds``: a model.py whose top level never returns
        (``time.sleep(10**9)``, a read of a pipe no one writes) held the lifecycle actor, and with it
        every later load, unload and rescan of every model, for good.

        Past the bound the thread is abandoned: it keeps running (Python cannot stop it) and
        whatever it returns or raises is dropped, so it publishes nothing; what it registers lands
        in its own table and its modules leave ``sys.modules`` when it ends. It holds a token of
        the import limiter until then, never the compile limiter's one slot, so later compiles do
        not wait on it; once ``MAX_ABANDONED_IMPORTS`` such threads run, loads fail at once
        instead of starting more."""
        name = path.name
        timeout = self._config.model_import_timeout_seconds
        if not (path / HOOKS_FILE).exists():
            # nothing of the author's runs (not even a model.py written since: its change of the
            # fingerprint brings a reload), and the manifest is read through the loader's
            # regular-file check (a FIFO cannot hold it): no bound and no import token needed
            return await trio.to_thread.run_sync(read_head, path, version, False)
        if not self._import_limiter.available_tokens:
            raise BundleError(name, f"{HOOKS_FILE} is not imported: {self.model_imports_running} earlier "
                              f"{HOOKS_FILE} imports passed model_import_timeout_seconds ({timeout:g} s) and are still "
                              f"running, the most a worker lets run ({MAX_ABANDONED_IMPORTS}); each holds a thread "
                              "that only the end of its import or a restart of the worker frees")
        abandoned = threading.Event()
        with trio.move_on_after(timeout):
            return await trio.to_thread.run_sync(self._read_head_blocking, path, version, abandoned,
                                                 limiter=self._import_limiter, abandon_on_cancel=True)
        abandoned.set()
        raise BundleError(name, f"{HOOKS_FILE} did not finish importing within {timeout:g} s "
                          "(global.model_import_timeout_seconds); the load is abandoned, and whatever the import "
                          "does if it ever ends is dropped")

    @staticmethod
    def _read_head_blocking(path: Path, version: int, abandoned: threading.Event) -> BundleHead:
        started = time.perf_counter()
        try:
            return read_head(path, version)
        finally:
            if abandoned.is_set():
                log.warning("bundle '%s': the %s import abandoned at model_import_timeout_seconds ended after "
                            "%.1fs; what it did is dropped", path.name, HOOKS_FILE, time.perf_counter() - started)

    def _load_blocking(self, path: Path, version: int, head: BundleHead) -> ModelVersion:
        # load() has just fingerprinted it; "" when that failed, and load_bundle tries again
        return load_bundle(path, version, self._device, progress=log.info,
                           fingerprint=self._seen.get(path.name), executables=self.executables, head=head)

    async def unload(self, name: str) -> Exception | None:
        entry = self._table.snapshot.get(name)
        if entry is None:
            return ModelNotFound(name, list(self._table.snapshot))
        if name in self._seen:
            # An unload on request holds in dynamic mode until the bundle's files change.
            try:
                self._seen[name] = bundle_fingerprint(self.repo / name)
            except OSError:
                self._seen.pop(name, None)
        self._table.remove(name)
        await self._scheduler.send(DropModel(name, Unavailable(f"model '{name}' was unloaded")))
        self._weights.release(name)
        if self._metrics is not None:
            self._metrics.unloads.labels(name).inc()
        log.info("%s unloaded", name)
        return None


def _request_rescan(rescans: trio.MemorySendChannel[None]) -> None:
    try:
        rescans.send_nowait(None)
    except trio.WouldBlock:
        pass   # a rescan is already pending; it will see this change too


async def _set_when_set_or_cancelled(event: trio.Event, trigger: trio.Event) -> None:
    try:
        await trigger.wait()
    finally:
        event.set()


def _identity(path: Path) -> tuple[int, int] | None:
    """Which directory ``path`` names now (through symlinks), or None when it names none."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None
