"""One loaded executable per distinct module, shared by every bundle that uses it.

Weights are arguments of ``@main``, so fine-tuned variants of one architecture (bundles whose
modules are byte-identical, weights aside) can run on one compiled executable. The
:class:`ExecutableTable` compiles (or takes from the executable cache) each distinct module once
and hands the same executable to every :class:`~xlaserve.bundle.ModelVersion` built from it. An
entry is counted by the versions holding it: :func:`~xlaserve.bundle.load_bundle` acquires one
reference per module and a finalizer on the version gives them back when the version is
collected (unloaded, or replaced and its last request answered). An entry whose count reaches
zero is dropped, so a reload that changes a module compiles its own, and one that does not
finds the executable the old version (or another bundle) already holds.

The key is a SHA-256 over the module bytes (as compiled: after specialization and kernel
relayout) and what else decides the executable: the device's
:meth:`~xlaserve.runtime.pjrt.Device.cache_key_parts` (versions, backend, device kind, compile
options), the same things the executable cache keys on.

What is derived from a module alone (its ``@main`` signature, its specializations to each batch
size, its kernel permutations and relayouts) is remembered by the module's digest, so a
thousand bundles of ten architectures parse ten modules. Validation against each bundle's
manifest and weights still runs per bundle (it is cheap), so its errors name that bundle.

Thread-safe: loads run off the Trio thread, and a version's finalizer runs wherever the
collector finds it.
"""
from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from xlaserve.runtime.pjrt import (CompiledMemory, Device, channels_last_activations, kernel_permutations,
                                   read_signature, relayout, rewrite_depthwise_convolutions, specialize)
from xlaserve.runtime.signature import Signature, TensorType
from xlaserve.runtime.tuning import compile_tuned

log = logging.getLogger("xlaserve.executables")


def _rewritten_convolutions(module: bytes) -> bytes:
    """The depthwise rewrite, then the channels-last one. The second only changes where values
    are laid out: a module it does not handle (a bug there) is compiled without it, with one
    warning, rather than failing its bundle."""
    depthwise = rewrite_depthwise_convolutions(module)
    try:
        return channels_last_activations(depthwise)
    except Exception as exc:
        log.warning("the channels-last rewrite failed on a module (%s: %s); compiled without it",
                    type(exc).__name__, exc)
        return depthwise


#: ``compile_module(path, module_bytes) -> (executable, cache_hit)``: what compiles a module the
#: table has not loaded (the executable cache's, or the device's own compile).
Compile = Callable[[Path, bytes], tuple[object, bool]]

#: How many modules' analyses (signatures, permutations) are remembered.
ANALYSIS_ENTRIES = 4096
#: The most bytes of derived modules (specializations, relayouts) remembered.
DERIVED_BYTES = 256 << 20


def digest(module: bytes) -> str:
    """The SHA-256 of a module's bytes, hex."""
    return hashlib.sha256(module).hexdigest()


@dataclass(frozen=True, slots=True)
class SharedExecutable:
    """One loaded executable and what XLA says it needs. ``source`` says how the table got it:
    ``compiled`` or ``cache`` (deserialized from the executable cache)."""

    key: str
    executable: object
    memory: CompiledMemory
    source: str


@dataclass(frozen=True, slots=True)
class Acquired:
    """What :meth:`ExecutableTable.acquire` handed out. ``how``: ``shared`` (another version
    already held it), ``cache`` or ``compiled``."""

    entry: SharedExecutable
    how: str


@dataclass(frozen=True, slots=True)
class ExecutableStatistics:
    executables: int      # distinct executables held
    references: int       # module references to them, over every version alive
    shared: int           # acquisitions answered by an executable already held (since start)
    compiled: int         # acquisitions that compiled
    from_cache: int       # acquisitions deserialized from the executable cache


class _Bounded:
    """A least-recently-used map bounded by entries and by the summed ``size`` of its values."""

    def __init__(self, entries: int, max_bytes: int | None = None, size: Callable[[object], int] = len) -> None:
        self._data: OrderedDict[object, object] = OrderedDict()
        self._entries = entries
        self._max_bytes = max_bytes
        self._size = size
        self._bytes = 0

    def get(self, key):
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def put(self, key, value) -> None:
        if key in self._data:
            return
        cost = self._size(value) if self._max_bytes is not None else 0
        if self._max_bytes is not None and cost > self._max_bytes:
            return
        self._data[key] = value
        self._bytes += cost
        while len(self._data) > self._entries or (self._max_bytes is not None and self._bytes > self._max_bytes):
            _, old = self._data.popitem(last=False)
            if self._max_bytes is not None:
                self._bytes -= self._size(old)

    def __len__(self) -> int:
        return len(self._data)


class ExecutableTable:
    """The executables of one device, one per distinct module, counted by the versions using them.

    ``compile_module`` compiles what the table does not hold (default: :func:`~xlaserve.runtime.tuning.compile_tuned`, which
    picks a module's compile options by a trial where it has convolutions)."""

    def __init__(self, device: Device, compile_module: Compile | None = None) -> None:
        self._device = device
        self._compile = compile_module or self._compile_directly
        parts = device.cache_key_parts()
        self._salt = "\n".join(f"{k}={parts[k]}" for k in sorted(parts)).encode()
        self._lock = threading.Lock()
        self._entries: dict[str, SharedExecutable] = {}
        self._counts: dict[str, int] = {}
        self._acquired = {"shared": 0, "compiled": 0, "cache": 0}
        self._signatures = _Bounded(ANALYSIS_ENTRIES)
        self._permutations = _Bounded(ANALYSIS_ENTRIES)
        self._derived = _Bounded(ANALYSIS_ENTRIES, DERIVED_BYTES)

    def _compile_directly(self, path: Path, module: bytes) -> tuple[object, bool]:
        return compile_tuned(self._device, module, path).executable, False

    # ---- executables ---------------------------------------------------------------------------
    def key(self, module: bytes) -> str:
        """The entry ``module`` compiles to on this device."""
        h = hashlib.sha256(self._salt)
        h.update(b"\0module\0")
        h.update(digest(module).encode())
        return h.hexdigest()

    def acquire(self, path: Path, module: bytes) -> Acquired:
        """The executable of ``module``, one more reference to it: the one held when there is
        one, else compiled (or taken from the executable cache) by ``compile_module(path,
        module)``, whose exceptions pass through and leave nothing held. Each call needs one
        :meth:`release`."""
        key = self.key(module)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._counts[key] += 1
                self._acquired["shared"] += 1
                return Acquired(entry, "shared")
        # Compiled outside the lock: a compile takes seconds and a finalizer may need the lock.
        executable, hit = self._compile(path, module)
        fresh = SharedExecutable(key, executable, self._device.compiled_memory(executable),
                                 "cache" if hit else "compiled")
        with self._lock:
            entry = self._entries.get(key)
            how = "shared"
            if entry is None:       # (else another thread loaded it meanwhile: use that one)
                entry, how = fresh, fresh.source
                self._entries[key] = entry
                self._counts[key] = 0
            self._counts[key] += 1
            self._acquired[how] += 1
        return Acquired(entry, how)

    def release(self, *keys: str) -> None:
        """Give back one reference per key; an entry nobody references is dropped."""
        with self._lock:
            for key in keys:
                count = self._counts.get(key, 0) - 1
                if count > 0:
                    self._counts[key] = count
                else:
                    self._counts.pop(key, None)
                    self._entries.pop(key, None)

    def references(self, key: str) -> int:
        """How many module references the entry ``key`` has (0: not held)."""
        with self._lock:
            return self._counts.get(key, 0)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def statistics(self) -> ExecutableStatistics:
        with self._lock:
            return ExecutableStatistics(len(self._entries), sum(self._counts.values()), self._acquired["shared"],
                                        self._acquired["compiled"], self._acquired["cache"])

    # ---- what a module alone decides, remembered by its digest ------------------------------
    def signature(self, module: bytes) -> Signature:
        """:func:`~xlaserve.runtime.pjrt.read_signature`, parsed once per distinct module.
        A module that does not parse is not remembered: its :class:`ModuleError` is raised again."""
        key = digest(module)
        with self._lock:
            found = self._signatures.get(key)
        if found is None:
            found = read_signature(module)
            with self._lock:
                self._signatures.put(key, found)
        return found

    def specialize(self, module: bytes, arguments: Sequence[TensorType]) -> bytes:
        """:func:`~xlaserve.runtime.pjrt.specialize`, run once per module and argument types."""
        return self._derive(("specialize", digest(module), tuple(arguments)), lambda: specialize(module, arguments))

    def kernel_permutations(self, module: bytes) -> dict[int, tuple[int, ...]]:
        """:func:`~xlaserve.runtime.pjrt.kernel_permutations`, once per distinct module."""
        key = digest(module)
        with self._lock:
            found = self._permutations.get(key)
        if found is None:
            found = kernel_permutations(module)
            with self._lock:
                self._permutations.put(key, found)
        return dict(found)

    def rewrite_convolutions(self, module: bytes) -> bytes:
        """:func:`~xlaserve.runtime.pjrt.rewrite_depthwise_convolutions`, then
        :func:`~xlaserve.runtime.pjrt.channels_last_activations`, once per distinct module."""
        return self._derive(("convolutions", digest(module)), lambda: _rewritten_convolutions(module))

    def relayout(self, module: bytes, permutations: Mapping[int, Sequence[int]]) -> bytes:
        """:func:`~xlaserve.runtime.pjrt.relayout`, once per module and permutations."""
        if not permutations:
            return module
        frozen = tuple(sorted((i, tuple(p)) for i, p in permutations.items()))
        return self._derive(("relayout", digest(module), frozen), lambda: relayout(module, permutations))

    def _derive(self, key: tuple, make: Callable[[], bytes]) -> bytes:
        with self._lock:
            found = self._derived.get(key)
        if found is None:
            found = make()
            with self._lock:
                self._derived.put(key, found)
        return found
