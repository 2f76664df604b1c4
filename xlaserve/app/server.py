"""A worker process: one Trio run holding the actors and the gRPC frontend.

Boot order, in one place: check the model repository and bind both addresses (before JAX is
imported, see :mod:`xlaserve.app.preflight`); log the effective configuration with the ports
bound; start the actors (:func:`~xlaserve.app.compose.run_actors`: the device, the weight
cache, the scheduler, the admin HTTP port and the lifecycle actor, which loads the repository);
then the gRPC frontend, wired to them by the composition root
(:func:`~xlaserve.app.compose.compose_frontend`). SIGTERM or SIGINT drains: the gRPC server
stops taking calls (GOAWAY), in-flight calls finish (for at most ``DRAIN_SECONDS``), then the
actors are cancelled.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import signal
from collections.abc import Awaitable, Callable

import trio

from xlaserve.config import WorkerConfig, effective_config_lines
from xlaserve.app.compose import Actors, compose_frontend, describe_endpoint, run_actors
from xlaserve.app.preflight import Claimed, claim

log = logging.getLogger("xlaserve.worker")

DRAIN_SECONDS = 30.0


async def serve(config: WorkerConfig, *, claimed: Claimed | None = None, ready_callback=None,
                supervisor_exited: Callable[[], Awaitable[None]] | None = None) -> None:
    """Run one worker until SIGTERM/SIGINT, or until ``supervisor_exited()`` returns (a worker
    started by a supervisor stops with it; see :func:`xlaserve.supervisor.supervisor_exited`).
    ``claimed`` holds its addresses already bound (see :mod:`xlaserve.app.preflight`); without it
    they are claimed here. ``ready_callback(grpc_port, http_port)`` is for tests and scripts."""
    if claimed is None:
        claimed = claim(config)
    config = dataclasses.replace(config, grpc_port=claimed.grpc.port, http_port=claimed.http.port,
                                 rest_port=claimed.rest.port if claimed.rest is not None else None)
    log.info("effective configuration of worker %s:\n%s", config.name, "\n".join(effective_config_lines(config)))
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            actors: Actors = await nursery.start(functools.partial(
                run_actors, config, admin_listeners=claimed.http.trio_listeners()))
            # Set when the drain starts: calls that would otherwise never end on their own (a
            # WatchStatus stream) finish then, so the drain waits only for real work.
            draining = trio.Event()
            frontend = compose_frontend(actors, draining=draining)
            server, rest = frontend.grpc, frontend.rest
            await nursery.start(functools.partial(server.serve, listeners=claimed.grpc.trio_listeners(),
                                                  ssl_context=claimed.ssl_context))
            if rest is not None and claimed.rest is not None:
                await nursery.start(functools.partial(rest.serve, claimed.rest.trio_listeners(),
                                                      ssl_context=claimed.rest_ssl_context))
            rest_line = (f", KServe V2 REST{' over TLS' if claimed.rest_ssl_context else ''} on {claimed.rest.address}"
                         if rest is not None and claimed.rest else "")
            log.info("serving: KServe V2 gRPC on %s%s, HTTP on %s (/healthz /readyz /metrics); %s",
                     claimed.grpc.address, rest_line, claimed.http.address, describe_endpoint(config))
            if ready_callback is not None:
                if claimed.rest is not None:
                    ready_callback(claimed.grpc.port, claimed.http.port, claimed.rest.port)
                else:
                    ready_callback(claimed.grpc.port, claimed.http.port)
            await _stop_requested(signals, supervisor_exited)
            log.info("draining: no new calls; waiting up to %.0fs for in-flight requests", DRAIN_SECONDS)
            draining.set()
            actors.scheduler.drain()
            server.close()
            if rest is not None:
                rest.close()
            with trio.move_on_after(DRAIN_SECONDS) as drain:
                await server.wait_closed()
                if rest is not None and claimed.rest is not None:
                    await rest.wait_closed()
            if drain.cancelled_caught:
                log.warning("drain timed out; cancelling what is left")
            nursery.cancel_scope.cancel()
    log.info("worker %s stopped", config.name)


async def _stop_requested(signals, supervisor_exited: Callable[[], Awaitable[None]] | None) -> None:
    """Return at the first SIGTERM/SIGINT, or once ``supervisor_exited()`` returns."""
    async with trio.open_nursery() as nursery:
        async def on_signal() -> None:
            async for _ in signals:
                break
            nursery.cancel_scope.cancel()

        async def on_supervisor_exit() -> None:
            try:
                await supervisor_exited()
            except OSError as exc:      # the descriptor went bad: stop watching; signals still stop it
                log.warning("cannot watch for this worker's supervisor exiting any more (%s); a signal still stops it",
                            exc)
                return
            log.warning("the supervisor that started this worker exited; stopping")
            nursery.cancel_scope.cancel()

        nursery.start_soon(on_signal)
        if supervisor_exited is not None:
            nursery.start_soon(on_supervisor_exit)
