"""The lifecycle actor's loads without a server: the real bundle loader, weight cache and CPU
device, driven through :meth:`Lifecycle.load`."""
from __future__ import annotations

import trio

from examples.export_examples import export_mlp
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

    def out_of_memory(path, version):
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
