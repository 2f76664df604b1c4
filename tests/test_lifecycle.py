"""The lifecycle actor's loads without a server: the real bundle loader, weight cache and CPU
device, driven through :meth:`Lifecycle.load`."""
from __future__ import annotations

import trio

from examples.export_examples import export_mlp, export_simple
from xlaserve.config.resolve import parse_node_config, resolve_worker
from xlaserve.runtime.pjrt import Device
from xlaserve.runtime.weights import WeightCache
from xlaserve.worker.lifecycle import Lifecycle
from xlaserve.worker.registry import ModelState, ModelTable


def test_weights_cut_short_while_the_bundle_compiles_fail_that_load_only(tmp_path):
    """``cp`` of new weights over a bundle truncates the file first: when that lands between the
    header read and the weight cache's read of the data (the modules compile in between), the
    OSError escaped the lifecycle actor and ended the worker."""
    repo = tmp_path / "models"
    export_mlp(repo, (1,))
    weights = repo / "mlp" / "weights.safetensors"
    device = Device("cpu")

    def compile_and_cut_the_weights(path, module):
        with open(weights, "r+b") as f:
            f.truncate(100)
        return device.compile(module), False

    config = resolve_worker(parse_node_config({"model_repo": str(repo), "global": {"runtime": {"backend": "cpu"}}},
                                              tmp_path))

    async def main():
        scheduler, _ = trio.open_memory_channel(1)
        lifecycle = Lifecycle(config, device, ModelTable(), scheduler, WeightCache(device, trio.CapacityLimiter(1)),
                              compile_and_cut_the_weights)
        return await lifecycle.load("mlp")

    entry = trio.run(main)
    assert entry.state is ModelState.UNAVAILABLE and entry.serving is None
    assert entry.reason.startswith(f"bundle 'mlp': cannot read its weights into memory: {weights.resolve()} is 100 "
                                   "bytes but its tensors end at byte ")


def test_whatever_else_a_load_raises_fails_that_load_only(tmp_path, caplog):
    """Past the loader's own checks (a bug, or MemoryError reading a huge module file), an
    exception fails the load of that bundle, logged with its traceback; it ended the lifecycle
    actor, and with it the worker."""
    repo = tmp_path / "models"
    export_mlp(repo, (1,))
    device = Device("cpu")
    config = resolve_worker(parse_node_config({"model_repo": str(repo), "global": {"runtime": {"backend": "cpu"}}},
                                              tmp_path))

    def out_of_memory(path, version, head):
        raise MemoryError()

    async def main():
        scheduler, _ = trio.open_memory_channel(1)
        lifecycle = Lifecycle(config, device, ModelTable(), scheduler, WeightCache(device, trio.CapacityLimiter(1)))
        lifecycle._load_blocking = out_of_memory        # what the loader's own checks do not turn into BundleError
        return await lifecycle.load("mlp")

    entry = trio.run(main)
    assert entry.state is ModelState.UNAVAILABLE and entry.serving is None
    assert entry.reason == "bundle 'mlp': loading it failed: MemoryError", entry.reason
    assert any(r.exc_info and r.exc_info[0] is MemoryError for r in caplog.records)


def test_a_request_that_fails_unforeseen_is_answered_internal_and_the_actor_goes_on(tmp_path, caplog, monkeypatch):
    """A client's load or unload that raises past every check (here an OSError, as ENAMETOOLONG
    from a name the checks let through was) is answered INTERNAL and logged; it ended the
    lifecycle actor, and with it the worker."""
    import gc

    from xlaserve.errors import InternalError
    from xlaserve.worker.lifecycle import LoadModel, UnloadModel
    monkeypatch.setattr(gc, "freeze", lambda: None)     # the actor freezes a worker's start-up objects, not pytest's
    repo = tmp_path / "models"
    export_mlp(repo, (1,))
    device = Device("cpu")
    config = resolve_worker(parse_node_config(
        {"model_repo": str(repo), "global": {"runtime": {"backend": "cpu"}, "model_control_mode": "explicit"}},
        tmp_path))
    answers: list = []

    async def main():
        scheduler, _ = trio.open_memory_channel(1)
        lifecycle = Lifecycle(config, device, ModelTable(), scheduler, WeightCache(device, trio.CapacityLimiter(1)))
        calls = [0]

        async def broken(name):
            calls[0] += 1
            if calls[0] == 1:
                raise OSError(36, "File name too long")
            return None
        lifecycle._load_requested = broken
        send, inbox = trio.open_memory_channel(4)
        async with trio.open_nursery() as nursery:
            await nursery.start(lifecycle.run, inbox)
            for message in (LoadModel("x", answers.append), LoadModel("mlp", answers.append),
                            UnloadModel("nope", answers.append)):
                await send.send(message)
            while len(answers) < 3:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert isinstance(answers[0], InternalError)
    assert str(answers[0]) == "loading model 'x' failed: OSError: [Errno 36] File name too long"
    assert answers[1] is None and "'nope'" in str(answers[2])       # the actor went on answering
    assert any(r.exc_info and r.exc_info[0] is OSError for r in caplog.records)


def test_a_model_py_that_never_finishes_importing_fails_its_load_and_later_loads_go_on(tmp_path, caplog):
    """A model.py whose top level never returns (here: a read of a pipe no one writes) held the
    lifecycle actor, and with it every later load, unload and rescan of every model, for good;
    its thread also held the one compile slot. Now the import is bounded by
    ``model_import_timeout_seconds`` (default 60 s): the reload fails naming the bound, the
    version serving keeps serving, and another model then loads (compiles) normally. When the
    import does end, what it registered is dropped: nothing is published."""
    import os
    import sys
    import time

    from trio.testing import MockClock
    repo = tmp_path / "models"
    export_simple(repo, (1,))
    export_mlp(repo, (1,))
    device = Device("cpu")
    config = resolve_worker(parse_node_config({"model_repo": str(repo), "global": {"runtime": {"backend": "cpu"}}},
                                              tmp_path))
    gate, release = os.pipe()
    seen: dict[str, object] = {}

    async def main():
        scheduler, _ = trio.open_memory_channel(1)
        table = ModelTable()
        lifecycle = Lifecycle(config, device, table, scheduler, WeightCache(device, trio.CapacityLimiter(1)))
        # bounded in virtual time: before the fix the reload below never returned
        with trio.fail_after(600):
            assert (await lifecycle.load("simple")).state is ModelState.READY
            (repo / "simple" / "model.py").write_text(
                f"import os\nos.read({gate}, 1)\nfrom xlaserve import register_model\nregister_model('simple')\n")
            started = trio.current_time()
            seen["reload"] = await lifecycle.load("simple")
            seen["waited"] = trio.current_time() - started
            seen["mlp"] = await lifecycle.load("mlp")
            seen["running"] = lifecycle.model_imports_running
        os.close(release)        # the import ends now (its read sees EOF); what it does is dropped
        seen["released"] = True
        for _ in range(2000):
            if not lifecycle.model_imports_running:
                break
            await trio.to_thread.run_sync(time.sleep, 0.005)
        seen["running after"] = lifecycle.model_imports_running
        seen["simple after"] = table.snapshot["simple"]

    try:
        # The loads run in real threads: a threshold of 0 would jump virtual time past the bound
        # while a well-behaved import or a compile is still in its thread. 5 real seconds with
        # nothing to do stands for "hung".
        trio.run(main, clock=MockClock(autojump_threshold=5))
    finally:
        os.close(gate)
        if "released" not in seen:
            os.close(release)
    reload, mlp = seen["reload"], seen["mlp"]
    assert reload.state is ModelState.READY and reload.serving.version == 1
    assert reload.reason == ("reload failed, still serving version 1: bundle 'simple': model.py did not finish "
                             "importing within 60 s (global.model_import_timeout_seconds); the load is abandoned, "
                             "and whatever the import does if it ever ends is dropped"), reload.reason
    assert seen["waited"] == 60
    assert mlp.state is ModelState.READY and not mlp.reason
    assert seen["running"] == 1 and seen["running after"] == 0
    after = seen["simple after"]
    assert after.serving.version == 1 and after.reason == reload.reason       # the late import published nothing
    assert not [m for m in sys.modules if m.startswith("_xlaserve_bundle_simple")]
    assert any("the model.py import abandoned at model_import_timeout_seconds ended after" in r.getMessage()
               for r in caplog.records)


def test_abandoned_model_py_imports_are_capped(tmp_path, monkeypatch):
    """Python cannot stop a hung import's thread: asking again and again for a bundle whose
    model.py never returns would pile up threads for as long as the worker lives. Once
    MAX_ABANDONED_IMPORTS of them run (1 here), a load fails at once, saying why."""
    import os

    from trio.testing import MockClock

    from xlaserve.worker import lifecycle as lifecycle_module
    monkeypatch.setattr(lifecycle_module, "MAX_ABANDONED_IMPORTS", 1)
    repo = tmp_path / "models"
    export_simple(repo, (1,))
    export_mlp(repo, (1,))          # no model.py: the cap does not concern it
    device = Device("cpu")
    config = resolve_worker(parse_node_config(
        {"model_repo": str(repo), "global": {"runtime": {"backend": "cpu"}, "model_import_timeout_seconds": 5}},
        tmp_path))
    gate, release = os.pipe()
    (repo / "simple" / "model.py").write_text(f"import os\nos.read({gate}, 1)\n")
    entries = []

    async def main():
        scheduler, _ = trio.open_memory_channel(1)
        lifecycle = Lifecycle(config, device, ModelTable(), scheduler, WeightCache(device, trio.CapacityLimiter(1)))
        with trio.fail_after(600):
            entries.append(await lifecycle.load("simple"))
            started = trio.current_time()
            entries.append(await lifecycle.load("simple"))
            assert trio.current_time() == started       # refused at once, no second thread
            entries.append(await lifecycle.load("mlp"))

    try:
        trio.run(main, clock=MockClock(autojump_threshold=5))
    finally:
        os.close(release)
        os.close(gate)
    assert "model.py did not finish importing within 5 s" in entries[0].reason
    assert entries[1].reason == (
        "bundle 'simple': model.py is not imported: 1 earlier model.py imports passed model_import_timeout_seconds "
        "(5 s) and are still running, the most a worker lets run (1); each holds a thread that only the end of its "
        "import or a restart of the worker frees"), entries[1].reason
    assert entries[2].state is ModelState.READY, entries[2].reason


def test_a_directory_whose_name_holds_a_control_character_is_no_bundle(tmp_path):
    """A directory may hold a newline or an ESC in its name; a model's name goes into log lines,
    metrics labels and dashboards, where one would fake a line or rewrite a terminal. Such a
    directory is not served, and a load naming it is refused, saying what a name may hold."""
    import shutil
    repo = tmp_path / "models"
    export_simple(repo, (1,))
    for odd in ("two\nlines", "esc\x1b[2J", "csi\x9b"):
        shutil.copytree(repo / "simple", repo / odd)
    device = Device("cpu")
    config = resolve_worker(parse_node_config({"model_repo": str(repo), "global": {"runtime": {"backend": "cpu"}}},
                                              tmp_path))
    refusals = []

    async def main():
        scheduler, _ = trio.open_memory_channel(1)
        lifecycle = Lifecycle(config, device, ModelTable(), scheduler, WeightCache(device, trio.CapacityLimiter(1)))
        assert lifecycle.discover() == ["simple"]
        for odd in ("two\nlines", "esc\x1b[2J"):
            refusals.append(await lifecycle._load_requested(odd))

    trio.run(main)
    assert all("is not a bundle name" in str(r) and "control characters" in str(r) for r in refusals), refusals


def test_a_directory_the_worker_may_not_read_is_skipped_and_rescans_go_on(tmp_path, monkeypatch):
    """A directory in model_repo that the worker may not search (``chmod 000``, another user's
    ``0700``) made checking it for a manifest raise PermissionError: every rescan failed (a
    traceback in the log each time) and no bundle was added, reloaded or removed while it
    was there. It is no bundle the worker can load, so it is skipped."""
    import os
    import pathlib
    repo = tmp_path / "models"
    export_simple(repo, (1,))
    locked = repo / "locked"
    (locked / "inner").mkdir(parents=True)
    os.chmod(locked, 0)       # root may read it anyway: the stat below refuses as a non-root worker's would
    real_stat = pathlib.Path.stat

    def stat(self, *, follow_symlinks=True):
        if self.parent == locked:
            raise PermissionError(13, "Permission denied", str(self))
        return real_stat(self, follow_symlinks=follow_symlinks)

    monkeypatch.setattr(pathlib.Path, "stat", stat)
    device = Device("cpu")
    config = resolve_worker(parse_node_config({"model_repo": str(repo), "global": {"runtime": {"backend": "cpu"}}},
                                              tmp_path))

    async def main():
        scheduler, _ = trio.open_memory_channel(1)
        lifecycle = Lifecycle(config, device, ModelTable(), scheduler, WeightCache(device, trio.CapacityLimiter(1)))
        assert lifecycle.discover() == ["simple"]
        return await lifecycle.rescan()

    try:
        plan = trio.run(main)
    finally:
        os.chmod(locked, 0o755)
    assert plan.added == ("simple",) and not plan.changed and not plan.removed


def test_a_file_gone_while_a_rescan_fingerprints_its_bundle_does_not_unload_it(tmp_path, monkeypatch):
    """A rescan lists a bundle's files, then stats each: a file removed in between (an editor's
    swap file, rsync's temporary file renamed into place, a build's scratch file) raised
    FileNotFoundError, and the rescan counted the whole bundle as removed. The serving model
    was unloaded (its queued requests UNAVAILABLE, new ones NOT_FOUND) and loaded again by the
    next rescan: a worker with files coming and going inside one bundle answered 7304 of 60,000
    requests with errors. The bundle keeps its fingerprint; the next rescan looks again."""
    import xlaserve.worker.lifecycle as lifecycle_module
    repo = tmp_path / "models"
    export_simple(repo, (1,))
    device = Device("cpu")
    config = resolve_worker(parse_node_config({"model_repo": str(repo), "global": {"runtime": {"backend": "cpu"}}},
                                              tmp_path))
    real_fingerprint = lifecycle_module.bundle_fingerprint

    def vanished(path):
        raise FileNotFoundError(2, "No such file or directory", str(path / "simple.swp"))

    async def main():
        scheduler, _ = trio.open_memory_channel(1)
        table = ModelTable()
        lifecycle = Lifecycle(config, device, table, scheduler, WeightCache(device, trio.CapacityLimiter(1)))
        assert (await lifecycle.rescan()).added == ("simple",)
        monkeypatch.setattr(lifecycle_module, "bundle_fingerprint", vanished)
        during = await lifecycle.rescan()
        monkeypatch.setattr(lifecycle_module, "bundle_fingerprint", real_fingerprint)
        return during, table.snapshot["simple"], await lifecycle.rescan()

    during, entry, after = trio.run(main)
    assert not during and entry.state is ModelState.READY and entry.serving.version == 1
    assert not after
