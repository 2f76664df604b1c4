"""Accepting connections, each inside its own guard.

trio's ``serve_listeners`` lets a handler's exception, or an ``accept`` error it does not know,
end the whole server: that is its contract, so a server that must never die owns both ends.
:func:`serve_guarded` accepts on each listener and runs ``handler(stream)`` for every connection
inside :func:`guarded`: whatever happens to one connection (its peer address, socket options, a
TLS handshake, the HTTP/2 preface, a bug) closes that connection and is logged as one line, at
most one a second, never reaching the nursery that serves the others. Cancellation passes.

``accept`` errors that say the process or the system is out of something (``EMFILE``,
``ENFILE``, ``ENOBUFS``, ``ENOMEM``) back off (0.1 s doubling to 1 s) and retry; any other
``accept`` error does the same (a listener that cannot accept is still better than a process that
exits); a closed listener ends its loop.

Also :func:`origin_form`, the request target every HTTP/1.1 port routes by (the REST listener's
and the admin port's).
"""
from __future__ import annotations

import errno
import logging
import ssl
from collections.abc import Awaitable, Callable

import trio

from xlaserve.errors import describe_exception

#: accept(2) errors that mean the process or the system ran out of descriptors or memory
CAPACITY_ERRNOS = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))
BACKOFF_FIRST = 0.1
BACKOFF_MAX = 1.0
#: what a peer can cause without any bug here: logged as one line, without a traceback
EXPECTED = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, EOFError)


class LineLimiter:
    """Logs at most one line per ``interval`` seconds (Trio's clock); the next line says how
    many were left out. A traceback is logged once per kind of unexpected fault (exception type
    and the place it was raised), since a flood repeats the same one."""

    def __init__(self, logger: logging.Logger, interval: float = 1.0) -> None:
        self.logger = logger
        self.interval = interval
        self.logged_at = -float("inf")
        self.suppressed = 0
        self._tracebacks: set[tuple] = set()

    def line(self, level: int, message: str, *args, exc: BaseException | None = None) -> bool:
        """Log ``message % args`` unless a line went out less than ``interval`` ago (then
        count it). ``exc``: an unexpected exception, logged with its traceback the first time
        its kind is seen. Whether the line was logged."""
        now = trio.current_time()
        if now - self.logged_at < self.interval:
            self.suppressed += 1
            return False
        if self.suppressed:
            message += f" ({self.suppressed} more such lines left out since the last)"
        self.logged_at, self.suppressed = now, 0
        exc_info = None
        if exc is not None:
            kind = _kind(exc)
            if kind not in self._tracebacks and len(self._tracebacks) < 256:
                self._tracebacks.add(kind)
                exc_info = exc
        self.logger.log(level, message, *args, exc_info=exc_info)
        return True


def _kind(exc: BaseException) -> tuple:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = (tb.tb_frame.f_code.co_filename, tb.tb_lineno) if tb is not None else None
    return type(exc), where


def expected(exc: BaseException) -> bool:
    """Whether ``exc`` (or every exception of a group) is something a peer causes: a reset, a
    broken pipe, a TLS alert, a closed stream."""
    if isinstance(exc, BaseExceptionGroup):
        return all(expected(e) for e in exc.exceptions)
    return isinstance(exc, EXPECTED)


def describe(exc: BaseException) -> str:
    """One line for ``exc`` (the first of a group)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{errno.errorcode.get(exc.errno, exc.errno)} ({exc.strerror or exc})"
    text = describe_exception(exc)         # cut, and never raising: it is called while handling a fault
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def guarded(stream: trio.abc.AsyncResource, handler: Callable[[trio.abc.AsyncResource], Awaitable[object]],
                  limiter: LineLimiter, what: str) -> None:
    """Run ``handler(stream)``; an exception closes the stream and is logged as one
    rate-limited line (with its traceback once, when it is not a peer's doing)."""
    try:
        await handler(stream)
    except Exception as exc:
        if expected(exc):
            limiter.line(logging.INFO, "%s %s connection ended: %s", _article(what), what, describe(exc))
        else:
            limiter.line(logging.ERROR, "%s %s connection failed (%s); it is closed, the server goes on",
                         _article(what), what, describe(exc), exc=exc)
    finally:
        try:
            await trio.aclose_forcefully(stream)
        except Exception:       # closing cannot fail in a way that matters to the others
            pass


async def accept_loop(listener: trio.abc.Listener, nursery: trio.Nursery, handler, limiter: LineLimiter,
                      what: str) -> None:
    """Accept on ``listener`` until it is closed, starting ``guarded(stream, handler)`` in
    ``nursery`` for each connection; ``accept`` errors back off and retry (module docstring)."""
    delay = 0.0
    while True:
        try:
            stream = await listener.accept()
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return
        except Exception as exc:
            delay = min(max(delay * 2, BACKOFF_FIRST), BACKOFF_MAX)
            capacity = isinstance(exc, OSError) and exc.errno in CAPACITY_ERRNOS
            limiter.line(logging.WARNING if capacity else logging.ERROR,
                         "the %s port cannot accept connections: %s; retrying in %g s%s", what, describe(exc),
                         delay, " (raise the open-file limit, ulimit -n, or lower endpoints.max_connections)"
                         if capacity else "", exc=None if isinstance(exc, OSError) else exc)
            await trio.sleep(delay)
            continue
        delay = 0.0
        nursery.start_soon(guarded, stream, handler, limiter, what)


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


async def serve_guarded(handler, listeners: list[trio.abc.Listener], *, nursery: trio.Nursery,
                        limiter: LineLimiter, what: str) -> None:
    """:func:`accept_loop` on every listener (connections start in ``nursery``); returns once
    every listener is closed, or runs until cancelled."""
    async with trio.open_nursery() as accepting:
        for listener in listeners:
            accepting.start_soon(accept_loop, listener, nursery, handler, limiter, what)


def origin_form(target: str) -> str:
    """A request target in origin form (``/path?query``): the absolute form a proxy sends
    (``http://host/path?query``; RFC 9112 3.2.2, servers accept it) cut to its path and query,
    anything else as it is."""
    if target[:1] != "/" and target[:7].lower() in ("http://", "https:/"):
        rest = target.split("//", 1)[1]
        cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
        return rest[cut:] if rest[cut:cut + 1] == "/" else "/" + rest[cut:]
    return target
