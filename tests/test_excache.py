"""The compiled-executable cache: hit after a restart, corrupt and mismatched entries rebuilt,
unsafe directories refused, and the cache's answers identical to a fresh compile."""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from xlaserve.runtime.excache import CacheDirRefused, ExecutableCache, open_executable_cache
from xlaserve.runtime.pjrt import Device

ROOT = Path(__file__).resolve().parent.parent

# z = x + y on int32[2, 3], written out so the test needs no exporter.
MODULE = b"""
module @add {
  func.func public @main(%x: tensor<2x3xi32>, %y: tensor<2x3xi32>) -> tensor<2x3xi32> {
    %0 = stablehlo.add %x, %y : tensor<2x3xi32>
    return %0 : tensor<2x3xi32>
  }
}
"""
OTHER = MODULE.replace(b"stablehlo.add", b"stablehlo.subtract")


@pytest.fixture(scope="module")
def device() -> Device:
    return Device("cpu")


def _run(device: Device, executable) -> np.ndarray:
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    return device.execute(executable, [x, np.full((2, 3), 10, np.int32)])[0]


def _within(seconds: float, function, *args):
    """``function(*args)``, failing the test (not hanging it) when it has not returned in time."""
    result: list = []
    worker = threading.Thread(target=lambda: result.append(function(*args)), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"{function.__name__} still blocked after {seconds}s"
    assert result, f"{function.__name__} raised (see the thread's traceback above)"
    return result[0]


def _private(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def test_miss_then_hit_across_instances(device, tmp_path):
    results = []
    first = ExecutableCache(_private(tmp_path / "c"), device, results.append)
    exe, hit = first.compile_module(Path("model.b2.mlir"), MODULE)
    assert not hit and results == ["miss"]
    np.testing.assert_array_equal(_run(device, exe), np.arange(6).reshape(2, 3) + 10)
    # A new instance is what a restart sees.
    second = ExecutableCache(tmp_path / "c", device, results.append)
    exe2, hit2 = second.compile_module(Path("model.b2.mlir"), MODULE)
    assert hit2 and results == ["miss", "hit"]
    np.testing.assert_array_equal(_run(device, exe2), _run(device, exe))
    assert second.statistics().hits == 1


def test_key_covers_module_bytes_and_device(device, tmp_path):
    cache = ExecutableCache(_private(tmp_path / "c"), device)
    assert cache.key(MODULE) != cache.key(OTHER)
    assert cache.key(MODULE) == ExecutableCache(tmp_path / "c", device).key(MODULE)
    parts = device.cache_key_parts()
    assert {"jaxlib", "backend", "device_kind", "platform_version", "compile_options"} <= set(parts)


def test_an_entry_written_on_a_host_with_other_cpu_features_is_not_used(device, tmp_path, monkeypatch):
    """XLA's cpu code is compiled for the host's instruction set: an entry from a host with
    other extensions (a cache_dir on a shared home directory) could stop the worker with SIGILL.
    The host's features are part of the key, so such an entry is a miss, never a hit."""
    from xlaserve.runtime import pjrt
    results = []
    ExecutableCache(_private(tmp_path / "c"), device, results.append).compile_module(Path("m.b2.mlir"), MODULE)
    assert "cpu_features" in device.cache_key_parts()
    monkeypatch.setattr(pjrt, "host_cpu_features", lambda: "another host")
    exe, hit = ExecutableCache(tmp_path / "c", device, results.append).compile_module(Path("m.b2.mlir"), MODULE)
    assert not hit and results == ["miss", "miss"]
    np.testing.assert_array_equal(_run(device, exe), np.arange(6).reshape(2, 3) + 10)


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "foreign_key"])
def test_damaged_entry_is_ignored_and_rebuilt(device, tmp_path, caplog, damage):
    cache = ExecutableCache(_private(tmp_path / "c"), device)
    cache.compile_module(Path("m.mlir"), MODULE)
    entry = cache.entry_path(cache.key(MODULE))
    data = entry.read_bytes()
    if damage == "truncate":
        entry.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        entry.write_bytes(data[:-10] + bytes(b ^ 0xFF for b in data[-10:]))
    elif damage == "garbage":
        entry.write_bytes(b"not an executable at all")
    else:  # a valid entry of another module copied over this one
        cache.compile_module(Path("o.mlir"), OTHER)
        entry.write_bytes(cache.entry_path(cache.key(OTHER)).read_bytes())
    with caplog.at_level(logging.WARNING, "xlaserve.excache"):
        exe, hit = ExecutableCache(tmp_path / "c", device).compile_module(Path("m.mlir"), MODULE)
    assert not hit
    assert "ignoring entry" in caplog.text and "recompiling" in caplog.text
    np.testing.assert_array_equal(_run(device, exe), np.arange(6).reshape(2, 3) + 10)
    # Rewritten: the next start hits again.
    assert ExecutableCache(tmp_path / "c", device).compile_module(Path("m.mlir"), MODULE)[1]


def test_entries_are_written_atomically(device, tmp_path):
    cache = ExecutableCache(_private(tmp_path / "c"), device)
    cache.compile_module(Path("m.mlir"), MODULE)
    files = [p for p in (tmp_path / "c").rglob("*") if p.is_file()]
    assert files == [cache.entry_path(cache.key(MODULE))]   # no temporary file left behind
    assert files[0].stat().st_mode & 0o077 == 0


def test_directory_writable_by_others_is_refused(device, tmp_path, caplog):
    shared = _private(tmp_path / "shared")
    os.chmod(shared, 0o777)
    with pytest.raises(CacheDirRefused, match=r"writable by other users .*can run code.*chmod go-w"):
        ExecutableCache(shared, device)
    with caplog.at_level(logging.ERROR, "xlaserve.excache"):
        assert open_executable_cache(shared, device) is None
    assert "disabled" in caplog.text and "writable by other users" in caplog.text


def test_unsafe_ancestor_is_refused(device, tmp_path):
    parent = _private(tmp_path / "open")
    os.chmod(parent, 0o777)
    inner = _private(parent / "cache")
    with pytest.raises(CacheDirRefused, match="lies under .*which other users can write"):
        ExecutableCache(inner, device)


def test_disabled_when_cache_dir_is_null(device):
    assert open_executable_cache(None, device) is None


def test_new_directory_is_created_private(device, tmp_path):
    cache = ExecutableCache(tmp_path / "a" / "b", device)
    assert cache.directory.stat().st_mode & 0o077 == 0


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "directory"])
def test_entry_that_is_not_a_regular_file_is_ignored_and_replaced(device, tmp_path, caplog, kind):
    """A FIFO in place of an entry held the load (and every load after it, one compile at a
    time) in open() for good; a link to /dev/zero was read until memory ran out."""
    cache = ExecutableCache(_private(tmp_path / "c"), device)
    entry = cache.entry_path(cache.key(MODULE))
    entry.parent.mkdir(mode=0o700)
    if kind == "fifo":
        os.mkfifo(entry, 0o600)
    elif kind == "dev_zero":
        entry.symlink_to("/dev/zero")
    else:
        entry.mkdir()
    with caplog.at_level(logging.WARNING, "xlaserve.excache"):
        exe, hit = _within(30, cache.compile_module, Path("m.mlir"), MODULE)
    assert not hit and cache.statistics().rejected == 1
    expected = {"fifo": "a FIFO (named pipe)", "dev_zero": "a character device", "directory": "a directory"}[kind]
    assert f"it is {expected}; expected a regular file" in caplog.text and "recompiling" in caplog.text
    np.testing.assert_array_equal(_run(device, exe), np.arange(6).reshape(2, 3) + 10)
    if kind != "directory":   # replaced by a real entry: the next start hits
        assert ExecutableCache(tmp_path / "c", device).compile_module(Path("m.mlir"), MODULE)[1]


def _modules(count: int) -> list[bytes]:
    return [MODULE.replace(b"@add", f"@add{i}".encode()) for i in range(count)]


def test_cache_max_bytes_removes_the_least_recently_used_entries(device, tmp_path, caplog):
    """Every re-export and jax upgrade added entries that stayed on the disk for good."""
    directory = _private(tmp_path / "c")
    probe = ExecutableCache(directory, device)
    probe.compile_module(Path("m.mlir"), MODULE)
    size = probe.entry_path(probe.key(MODULE)).stat().st_size
    probe.entry_path(probe.key(MODULE)).unlink()
    cache = ExecutableCache(directory, device, max_bytes=3 * size + size // 2)   # room for 3 entries
    a, b, c, d = _modules(4)
    for index, module in enumerate((a, b, c)):
        cache.compile_module(Path("m.mlir"), module)
        os.utime(cache.entry_path(cache.key(module)), (1000 + index, 1000 + index))
    assert cache.compile_module(Path("m.mlir"), a)[1]     # a hit: a is now the most recent
    with caplog.at_level(logging.INFO, "xlaserve.excache"):
        cache.compile_module(Path("m.mlir"), d)
    left = {p.name for p in directory.rglob("*.xlaexe")}
    assert left == {cache.entry_path(cache.key(m)).name for m in (a, c, d)}
    assert "removed 1 least recently used entry " in caplog.text and "cache_max_bytes" in caplog.text


def test_stale_temporary_files_of_killed_writers_are_removed(device, tmp_path):
    cache = ExecutableCache(_private(tmp_path / "c"), device)
    cache.compile_module(Path("m.mlir"), MODULE)
    shard = cache.entry_path(cache.key(MODULE)).parent
    stale, live = shard / ".x.xlaexe.abc.tmp", shard / ".y.xlaexe.def.tmp"
    stale.write_bytes(b"half an entry")
    live.write_bytes(b"being written")
    os.utime(stale, (1, 1))
    cache.compile_module(Path("o.mlir"), OTHER)
    assert not stale.exists() and live.exists()
