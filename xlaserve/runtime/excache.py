"""The compiled-executable cache in ``cache_dir``: compile a module once, reuse it across restarts.

An entry is keyed by a digest of the module bytes and of everything else that decides whether a
serialized executable fits this device (:meth:`Device.cache_key_parts`: jax and jaxlib versions,
backend, device kind, platform version, compile options). Entries are written to a temporary
file and renamed into place, so a reader never sees half an entry. An entry that is truncated,
corrupt, written for another key or that the backend refuses to deserialize is ignored, rebuilt
and overwritten; so is anything in an entry's place that is not a regular file, checked before it
is read (a FIFO would block the load for good, a link to ``/dev/zero`` would be read without end).

An entry holds the executable and the name of the compile options it was compiled with: a module
with convolutions gets them by a trial when it is first compiled
(:mod:`xlaserve.runtime.tuning`), and a hit deserializes it with the same options, without a
new trial.

The directory is bounded by ``cache_max_bytes``: after each write the least recently used
entries (a hit refreshes an entry's modification time) are removed until the rest fit, and a
temporary file that a killed writer left behind is removed once it is an hour old. Without the
bound every re-export and every jax upgrade would leave its entries on the disk for good.

Deserializing an executable can run the code in it, so the cache refuses a directory that
another user could write to (:class:`CacheDirRefused`): the directory, and every ancestor
without the sticky bit, must be owned by this user or root and not group- or world-writable.

Every method blocks (file I/O, XLA); the lifecycle actor calls :meth:`compile_module` off the
Trio thread, one bundle at a time.
"""
from __future__ import annotations

import hashlib
import logging
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from xlaserve.bundle import open_checked
from xlaserve.runtime.pjrt import Device
from xlaserve.runtime.tuning import compile_tuned

log = logging.getLogger("xlaserve.excache")

# 2: a line naming the compile options follows the digests (1 had none); the digest covers it.
MAGIC = b"XLASERVE-EXECUTABLE 2\n"
_CHOICE_MAX = 64
_DIGEST_LEN = 64  # hex sha256
_ENTRY_SUFFIX = ".xlaexe"
# A temporary file this old is a killed writer's: a live one renames its file within seconds.
_STALE_TEMPORARY_SECONDS = 3600.0


class CacheDirRefused(Exception):
    """``cache_dir`` is unsafe to load executables from; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class CacheStatistics:
    hits: int
    misses: int       # no entry: compiled and written
    rejected: int     # an entry existed but was unusable: compiled and overwritten
    write_errors: int


def check_private_dir(path: Path) -> None:
    """Raise :class:`CacheDirRefused` unless only this user (or root) can write ``path`` and
    replace it. Ancestors with the sticky bit (``/tmp``) protect their entries and are fine."""
    uid = os.getuid()
    trusted = {uid, 0}
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise CacheDirRefused(f"cache_dir {path} is not a directory")
    if st.st_uid not in trusted:
        raise CacheDirRefused(f"cache_dir {path} is owned by uid {st.st_uid}, not by this user (uid {uid}); "
                              "loading a cached executable can run code, so the cache must be private. "
                              "Point cache_dir at a directory you own, or set it to null to disable the cache")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheDirRefused(f"cache_dir {path} is writable by other users (mode {stat.filemode(st.st_mode)}); "
                              "loading a cached executable can run code, so the cache must be private. "
                              f"Run 'chmod go-w {path}', or set cache_dir to null to disable the cache")
    for parent in path.resolve().parents:
        pst = parent.stat()
        if pst.st_mode & stat.S_ISVTX:
            continue
        if pst.st_uid not in trusted or pst.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise CacheDirRefused(f"cache_dir {path} lies under {parent}, which other users can write "
                                  f"(mode {stat.filemode(pst.st_mode)}, uid {pst.st_uid}) and so could replace "
                                  "the cache; loading a cached executable can run code. Move cache_dir under "
                                  "a directory only you can write, or set it to null to disable the cache")


class ExecutableCache:
    """Compiled executables of one device, stored under ``directory``.

    ``on_result(kind)`` is called with ``"hit"``, ``"miss"`` or ``"rejected"`` for each module
    (for metrics). ``max_bytes`` bounds the entries' total size (``cache_max_bytes``); 0 leaves
    it unbounded."""

    def __init__(self, directory: Path, device: Device,
                 on_result: Callable[[str], None] | None = None, max_bytes: int = 0) -> None:
        directory = Path(directory)
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheDirRefused(f"cannot create cache_dir {directory}: {exc.strerror}") from None
        check_private_dir(directory)
        self.directory = directory
        self._device = device
        parts = device.cache_key_parts()
        self._salt = "\n".join(f"{k}={parts[k]}" for k in sorted(parts)).encode()
        self._on_result = on_result
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._counts = {"hit": 0, "miss": 0, "rejected": 0, "write_error": 0}

    def key(self, module: bytes) -> str:
        h = hashlib.sha256()
        h.update(self._salt)
        h.update(b"\0module\0")
        h.update(module)
        return h.hexdigest()

    def entry_path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}{_ENTRY_SUFFIX}"

    def statistics(self) -> CacheStatistics:
        with self._lock:
            c = dict(self._counts)
        return CacheStatistics(c["hit"], c["miss"], c["rejected"], c["write_error"])

    def compile_module(self, path: Path, module: bytes) -> tuple[object, bool]:
        """The executable of ``module``: from the cache when a valid entry exists, else compiled
        and stored. The signature of :data:`xlaserve.bundle.Compile`."""
        key = self.key(module)
        entry = self.entry_path(key)
        blob, choice, why = self._read(entry, key)
        if blob is not None:
            try:
                executable = self._device.deserialize(blob, choice)
            except Exception as exc:  # the backend's own error types; the entry is unusable
                why = f"the backend cannot deserialize it ({' '.join(str(exc).split())[:200]})"
            else:
                self._count("hit")
                try:
                    os.utime(entry)       # recently used: the last to be removed by the bound
                except OSError:
                    pass
                return executable, True
        if why:
            log.warning("executable cache: ignoring entry %s for %s: %s; recompiling", entry.name, path.name, why)
            self._count("rejected")
        else:
            self._count("miss")
        tuned = compile_tuned(self._device, module, path)
        if self._write(entry, key, tuned.executable, tuned.choice):
            self._trim(keep=entry)
        return tuned.executable, False

    def _read(self, entry: Path, key: str) -> tuple[bytes | None, str, str]:
        """The entry's payload and compile options, or (None, '', why it is unusable);
        why is '' when there is no entry."""
        try:
            opened, size_or_kind = open_checked(entry)
            if opened is None:    # a FIFO would block the open, /dev/zero would be read for good
                return None, "", f"it is {size_or_kind}; expected a regular file"
            with opened:
                data = opened.read(size_or_kind)
        except FileNotFoundError:
            return None, "", ""
        except OSError as exc:
            return None, "", f"cannot read it: {exc.strerror}"
        header_len = len(MAGIC) + 2 * (_DIGEST_LEN + 1)
        if len(data) < header_len or not data.startswith(MAGIC):
            return None, "", "it is not an xlaserve executable entry of this version (truncated, foreign or older)"
        stored_key = data[len(MAGIC):len(MAGIC) + _DIGEST_LEN].decode("ascii", "replace")
        offset = len(MAGIC) + _DIGEST_LEN + 1
        digest = data[offset:offset + _DIGEST_LEN].decode("ascii", "replace")
        rest = data[header_len:]
        if stored_key != key:
            return None, "", "it was written for a different module, device or version"
        if hashlib.sha256(rest).hexdigest() != digest:
            return None, "", "its checksum does not match (truncated or corrupt)"
        line, newline, payload = rest.partition(b"\n")
        choice = line.decode("ascii", "replace")
        try:
            self._device.overrides(choice)
        except ValueError:
            newline = b""
        if not newline:
            return None, "", f"it names compile options this server does not have ({choice[:_CHOICE_MAX]!r})"
        return payload, choice, ""

    def _write(self, entry: Path, key: str, executable, choice: str) -> bool:
        try:
            payload = choice.encode("ascii") + b"\n" + self._device.serialize(executable)
            entry.parent.mkdir(mode=0o700, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{entry.name}.", suffix=".tmp", dir=entry.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(MAGIC + key.encode() + b"\n" + hashlib.sha256(payload).hexdigest().encode() + b"\n")
                    f.write(payload)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, entry)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except Exception as exc:  # a full disk or a backend that cannot serialize: serve uncached
            log.warning("executable cache: cannot store %s: %s: %s", entry.name, type(exc).__name__, exc)
            self._count("write_error")
            return False
        return True

    def _trim(self, keep: Path) -> None:
        """Remove killed writers' stale temporary files, then the least recently used entries
        (never ``keep``, just written) until the rest fit ``max_bytes``. Another worker sharing
        the directory may remove the same files at the same time: a file already gone is fine."""
        now = time.time()
        entries: list[tuple[float, int, Path]] = []
        try:
            shards = [d for d in self.directory.iterdir() if len(d.name) == 2 and d.is_dir()]
            for shard in shards:
                for file in shard.iterdir():
                    try:
                        info = file.lstat()
                    except FileNotFoundError:   # another worker sharing the directory removed it
                        continue
                    if not stat.S_ISREG(info.st_mode):
                        continue
                    if file.name.startswith(".") and file.name.endswith(".tmp"):
                        if now - info.st_mtime > _STALE_TEMPORARY_SECONDS:
                            file.unlink(missing_ok=True)
                            log.info("executable cache: removed %s, left by a writer that did not finish",
                                     file.name)
                    elif file.name.endswith(_ENTRY_SUFFIX) and file != keep:
                        entries.append((info.st_mtime, info.st_size, file))
        except OSError as exc:     # listing is best-effort: the next write tries again
            log.warning("executable cache: cannot list %s to keep it under cache_max_bytes: %s",
                        self.directory, exc.strerror or exc)
            return
        if not self._max_bytes:
            return
        try:
            total = keep.stat().st_size + sum(size for _, size, _ in entries)
        except OSError:
            return
        removed = freed = 0
        for _, size, file in sorted(entries, key=lambda e: e[0]):
            if total <= self._max_bytes:
                break
            try:
                file.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("executable cache: cannot remove %s: %s", file.name, exc.strerror or exc)
                continue
            total -= size
            removed += 1
            freed += size
        if removed:
            log.info("executable cache: removed %d least recently used entr%s (%d bytes) to keep %s "
                     "under cache_max_bytes (%d bytes)", removed, "y" if removed == 1 else "ies", freed,
                     self.directory, self._max_bytes)

    def _count(self, kind: str) -> None:
        with self._lock:
            self._counts[kind] += 1
        if self._on_result is not None and kind != "write_error":
            self._on_result(kind)


def open_executable_cache(cache_dir: Path | None, device: Device,
                          on_result: Callable[[str], None] | None = None,
                          max_bytes: int = 0) -> ExecutableCache | None:
    """The worker's cache, or None when ``cache_dir`` is null or refused (the reason is logged
    as an error; the worker then compiles every module)."""
    if cache_dir is None:
        log.info("executable cache: disabled (cache_dir is null)")
        return None
    try:
        cache = ExecutableCache(cache_dir, device, on_result, max_bytes)
    except CacheDirRefused as exc:
        log.error("executable cache: disabled: %s", exc)
        return None
    log.info("executable cache: %s", cache.directory)
    return cache
