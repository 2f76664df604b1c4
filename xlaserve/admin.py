"""The admin HTTP port: ``/healthz``, ``/readyz`` and ``/metrics``. A tiny HTTP/1.1 responder on
Trio; it answers GET and HEAD and closes the connection after each response."""
from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from xlaserve.frontend.guard import LineLimiter, describe, origin_form, serve_guarded

log = logging.getLogger("xlaserve.admin")

Route = Callable[[], tuple[int, str, bytes]]
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 400: "Bad Request", 500: "Internal Server Error",
            503: "Service Unavailable"}
_MAX_HEADER = 16 * 1024
_SECONDS = 10.0         # a connection's whole exchange: request read and answer written
#: connections served at once (probes and scrapes need a few), so a flood of connections to this
#: port cannot take the process's file descriptors; one more closes the oldest (see serve_admin)
MAX_CONNECTIONS = 64
#: /metrics renders may take at most 1/(1 + REUSE_FACTOR) of the Trio thread (see reused)
REUSE_FACTOR = 10.0
#: ... after a burst of this many seconds of renders back to back, each one fresh
REUSE_BURST_SECONDS = 0.05


def reused(route: Route, *, factor: float = REUSE_FACTOR, burst: float = REUSE_BURST_SECONDS) -> Route:
    """``route``, answering again with its last answer, without running, while the time its
    renders took owes more than ``burst`` seconds; the debt drains at one second per ``factor``.
    For ``/metrics``: its page is rendered on the Trio thread that also serves inference, and a
    flood of scrapes (hundreds a second) rendered one each, so the scraper took most of the
    thread (mlp fell from ~5 000 to ~800 req/s). Reused, renders take at most 1/(1 + factor)
    of the thread however fast scrapes come, and the page served is at most ``factor`` renders
    old (tens of ms for a worker's page; Prometheus scrapes every 15 s); a scrape that does not
    come in a flood (a probe, a person's curl after a request) is rendered now. A route that
    raises is not kept: the next request runs it again. Not for ``/readyz`` or ``/healthz``."""
    kept: tuple[int, str, bytes] | None = None
    owed, since = 0.0, 0.0          # seconds of render not yet drained, as of when

    def route_reused() -> tuple[int, str, bytes]:
        nonlocal kept, owed, since
        now = trio.current_time()
        owed = max(0.0, owed - (now - since) / factor)
        since = now
        if kept is not None and owed > burst:
            return kept
        kept = None
        answer = route()
        since = trio.current_time()
        owed += since - now
        kept = answer
        return answer

    return route_reused


async def serve_admin(host: str, port: int, routes: dict[str, Route], *,
                      listeners: list[trio.SocketListener] | None = None, max_connections: int = MAX_CONNECTIONS,
                      task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Answer ``routes`` on ``host:port``, or on ``listeners`` already open. Reports the port
    served. Each connection runs inside its own guard (:mod:`xlaserve.frontend.guard`): a peer
    that resets, sends garbage or stalls, or a route that raises, costs that connection only
    (a route's exception is answered 500 and logged, one line a second). At most
    ``max_connections`` are served at once; one more closes the oldest of them and is served.
    An exchange takes a millisecond; a connection held open idle, trickling its head or never
    reading its answer is the oldest one, so a client that holds ``max_connections`` open costs
    only its own (refusing the new one instead let it keep every probe out for good, and a
    liveness probe that fails restarts the process)."""
    limiter = LineLimiter(log)
    active: dict[trio.CancelScope, float] = {}      # served now, oldest first: when each began

    async def handle(stream: trio.SocketStream) -> None:
        if len(active) >= max_connections:
            oldest = next(iter(active))
            began = active.pop(oldest)
            oldest.cancel()
            limiter.line(logging.WARNING, "the admin port serves %d connections at once: closed the oldest "
                         "(%.1f s old) for a new one", max_connections, trio.current_time() - began)
        now = trio.current_time()
        scope = trio.CancelScope(deadline=now + _SECONDS)
        active[scope] = now
        try:
            with scope:
                await _answer(stream, routes, limiter)
        finally:
            active.pop(scope, None)

    if listeners is None:
        listeners = await trio.open_tcp_listeners(port, host=host or None)
    task_status.started(listeners[0].socket.getsockname()[1])
    try:
        async with trio.open_nursery() as nursery:
            await serve_guarded(handle, listeners, nursery=nursery, limiter=limiter, what="admin HTTP")
    finally:
        for listener in listeners:
            with trio.CancelScope(shield=True):
                await listener.aclose()


async def _answer(stream: trio.SocketStream, routes: dict[str, Route], limiter: LineLimiter) -> None:
    data = b""
    # the head ends at an empty line; lines may end in a bare LF (RFC 9112 2.2: a server may take it)
    while b"\r\n\r\n" not in data and b"\n\n" not in data:
        chunk = await stream.receive_some(4096)
        if not chunk:
            return
        data += chunk
        if len(data) > _MAX_HEADER:
            await _send(stream, 400, "text/plain", b"request header too large\n", False)
            return
    request_line = data.split(b"\n", 1)[0].decode("latin-1")
    parts = request_line.split()
    if len(parts) != 3:
        await _send(stream, 400, "text/plain", b"malformed request line\n", False)
        return
    method, target, _ = parts
    path = origin_form(target).split("?", 1)[0]
    route = routes.get(path)
    if route is None:
        await _send(stream, 404, "text/plain", f"no such path {path}; try {' '.join(routes)}\n".encode(), False)
        return
    if method not in ("GET", "HEAD"):
        await _send(stream, 405, "text/plain", b"only GET and HEAD\n", False)
        return
    try:
        status, ctype, body = route()
    except Exception as exc:
        limiter.line(logging.ERROR, "the admin route %s failed (%s); answered 500", path, describe(exc), exc=exc)
        status, ctype, body = 500, "text/plain", f"{path} failed: {describe(exc)}\n".encode()
    await _send(stream, status, ctype, body, method == "HEAD")


async def _send(stream: trio.SocketStream, status: int, ctype: str, body: bytes, head_only: bool) -> None:
    header = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\nContent-Type: {ctype}\r\n"
              f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    await stream.send_all(header if head_only else header + body)
