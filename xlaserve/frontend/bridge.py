"""Replies from anywhere, awaited by a Trio task.

The worker is one Trio run: the gRPC frontend (:mod:`xlaserve.frontend.grpc_server`), the
scheduler, the lifecycle and the weight cache are all Trio tasks on the main thread. A frontend
handler hands work to an actor together with a one-shot ``reply`` and waits for it with
:meth:`Bridge.call`. Most replies come from the Trio thread itself (the dispatch loop) and wake
the handler directly; a hook or meta thread may reply too, which costs one
``TrioToken.run_sync_soon`` hop.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import trio

from xlaserve.errors import InternalError, internal_message

log = logging.getLogger("xlaserve.bridge")


def _logged(fn: Callable[..., None], *args: Any) -> None:
    """A reply must not raise into whoever made it (a run_sync_soon callback that raised would
    end the Trio run; on the Trio thread, the actor that replied): log instead."""
    try:
        fn(*args)
    except Exception:
        log.exception("a reply from another thread failed on the Trio thread")


class Bridge:
    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self._token = token
        self._thread = threading.get_ident()

    def on_trio(self, fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)`` on the Trio thread: now if this is it, else soon (dropped once the
        worker has stopped). Either way an exception from ``fn`` is logged, not raised: a reply
        is made from whichever actor finished the work (the dispatch loop, the expiry task), and
        a bug in answering one request must not end that actor."""
        if threading.get_ident() == self._thread:
            _logged(fn, *args)
            return
        try:
            self._token.run_sync_soon(_logged, fn, *args)
        except trio.RunFinishedError:
            pass

    async def call(self, start: Callable[[Callable[[Any], None]], None]) -> Any:
        """Call ``start(reply)`` now and wait for what ``reply`` gets (an exception instance is
        raised here). ``reply`` may be called from any thread; the first call counts, later
        calls and calls after the caller gave up are ignored."""
        done = trio.Event()
        box: list[Any] = []

        def resolve(outcome: Any) -> None:
            if not box:
                box.append(outcome)
                done.set()

        def reply(outcome: Any) -> None:
            self.on_trio(resolve, outcome)

        try:
            start(reply)
        except Exception as exc:  # a bug on the actor side fails this call only
            log.exception("bridge call failed")
            reply(InternalError(internal_message(exc)))
        await done.wait()
        outcome = box[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome
