"""Test helpers shared by several files: a GrpcServer run by ``trio.run`` in a background thread,
and the transport fuzzer (scripts/fuzz_transport.py, not a package) loaded as a module."""
from __future__ import annotations

import importlib.util
import sys
import threading

import trio

from tests.conftest import ROOT

TIMEOUT = 5.0          # seconds the server may take to start


class TrioServerThread:
    """Runs ``self.server`` (a GrpcServer, set by the subclass before calling ``__init__``) on
    127.0.0.1 from ``trio.run`` in a daemon thread; ``port`` is its port once started."""

    thread_name = "grpc-server"

    def __init__(self) -> None:
        self.port = 0
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()
        assert self._ready.wait(TIMEOUT), "the server did not start"
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.port = await self._serve(nursery)
            self._ready.set()
            await trio.sleep_forever()

    async def _serve(self, nursery: trio.Nursery) -> int:
        """Start what the thread serves in ``nursery``; its gRPC port."""
        return await nursery.start(self.server.serve, "127.0.0.1", 0)


def load_fuzzer():
    """scripts/fuzz_transport.py as the module ``fuzz_transport`` (loaded once per process)."""
    if "fuzz_transport" in sys.modules:
        return sys.modules["fuzz_transport"]
    spec = importlib.util.spec_from_file_location("fuzz_transport", ROOT / "scripts" / "fuzz_transport.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module        # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
