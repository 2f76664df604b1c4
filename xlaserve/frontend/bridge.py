"""The one asyncio <-> Trio seam.

grpclib is asyncio-only; the worker's actors are Trio. The worker runs Trio as a *guest* of
the asyncio loop (``trio.lowlevel.start_guest_run``): both run on the main thread, Trio's
tasks interleaved with asyncio's callbacks. The frontend asks the Trio side for work with
:meth:`Bridge.call`, which hands it a one-shot reply that resolves an asyncio future. Because
both sides share the thread, a reply resolves its future directly.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

import trio

from xlaserve.errors import InternalError, Unavailable

log = logging.getLogger("xlaserve.bridge")


class Bridge:
    def __init__(self, loop: asyncio.AbstractEventLoop, token: trio.lowlevel.TrioToken) -> None:
        self._loop = loop
        self._token = token
        self._thread = threading.get_ident()
        self._pending: list[Callable[[], None]] = []

    def call(self, start: Callable[[Callable[[Any], None]], None]) -> asyncio.Future:
        """Run ``start(reply)`` on the Trio side; the future resolves with what ``reply`` gets
        (an exception instance is raised from the future). ``reply`` may be called from any
        thread; the first call counts, later calls and calls after the caller gave up are
        ignored."""
        future = self._loop.create_future()

        def resolve(outcome: Any) -> None:
            if future.done():
                return
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

        def reply(outcome: Any) -> None:
            # Usually called on the shared thread; a hook thread may call it directly, which
            # costs one wake-up of the loop instead of a hop through Trio first.
            if threading.get_ident() == self._thread:
                resolve(outcome)
            else:
                self._loop.call_soon_threadsafe(resolve, outcome)

        def begin() -> None:
            try:
                start(reply)
            except Exception as exc:  # a bug on the Trio side must not end the Trio run
                log.exception("bridge call failed")
                reply(InternalError(f"internal error: {type(exc).__name__}: {exc}"))

        self.run_soon(begin)
        return future

    def run_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the Trio side soon. Calls made in one asyncio tick share one wakeup."""
        assert threading.get_ident() == self._thread, "the bridge is used from the loop's thread only"
        self._pending.append(fn)
        if len(self._pending) == 1:
            try:
                self._token.run_sync_soon(self._drain)
            except trio.RunFinishedError:
                self._pending.clear()
                raise Unavailable("the worker is shutting down") from None

    def _drain(self) -> None:
        pending, self._pending = self._pending, []
        for fn in pending:
            fn()
