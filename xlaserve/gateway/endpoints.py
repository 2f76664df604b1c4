"""The gateway's workers from its ``endpoints:`` list, following DNS as workers come and go.

An endpoint is ``host:port`` as configured. An IP address is one worker. A DNS name stands for
every address it resolves to (a Kubernetes headless Service answers with one address per ready
pod), each a worker of its own, named ``name:port@address`` (``worker-svc:9001@10.0.0.7``) so
that the same pod keeps the same name from one resolution to the next.

- :func:`resolve` resolves a list once;
- :func:`diff` says what changed between two resolutions (pure);
- :func:`unique` keeps one worker per address and port: two endpoints that resolve to the same
  worker (a name and its IP address, two names of one Service) are one worker, named by the
  first of them in the list, not two connections that would each count its load;
- :func:`follow` is an actor: it resolves the list every ``endpoint_refresh_seconds`` and sends
  an :class:`EndpointsChanged` message whenever the set of workers changes. A name that stops
  resolving keeps the addresses it last resolved to (a DNS outage must not empty the gateway),
  and one warning is logged per failure streak, not one per refresh.
"""
from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import trio

from xlaserve.config.schema import split_address

__all__ = ["Endpoint", "EndpointsChanged", "ResolveError", "diff", "follow", "resolve", "unique"]

log = logging.getLogger("xlaserve.gateway.endpoints")

GetAddrInfo = Callable[..., Awaitable[Sequence[tuple]]]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One worker: the endpoint as configured (``worker-svc:9001``), and the address and port
    it resolved to."""

    configured: str
    address: str
    port: int

    @property
    def name(self) -> str:
        """The worker's stable name: ``configured`` for an IP address endpoint, else
        ``configured@address``."""
        host, _ = split_address(self.configured)
        return self.configured if _is_ip(host) else f"{self.configured}@{self.address}"

    @property
    def target(self) -> str:
        """``address:port`` to connect to (``[address]:port`` for IPv6)."""
        return f"[{self.address}]:{self.port}" if ":" in self.address else \
            f"{self.address}:{self.port}"


@dataclass(frozen=True, slots=True)
class EndpointsChanged:
    """What :func:`follow` sends: the workers that appeared and went since its last message
    (each in the order of ``endpoints``), and the whole set now. The first message has every
    worker of the first resolution in ``added``."""

    added: tuple[Endpoint, ...]
    removed: tuple[Endpoint, ...]
    endpoints: tuple[Endpoint, ...]


class ResolveError(Exception):
    """An endpoint's DNS name did not resolve; the message names it and says why."""

    def __init__(self, configured: str, reason: str) -> None:
        super().__init__(f"endpoint {configured}: cannot resolve: {reason}")
        self.configured = configured
        self.reason = reason


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _address_key(address: str) -> tuple[int, int]:
    parsed = ipaddress.ip_address(address.partition("%")[0])
    return parsed.version, int(parsed)


async def _resolve_one(configured: str, getaddrinfo: GetAddrInfo) -> tuple[Endpoint, ...]:
    host, port = split_address(configured)
    if _is_ip(host):
        return (Endpoint(configured, host, port),)
    try:
        answers = await getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    except OSError as error:  # socket.gaierror included
        raise ResolveError(configured, error.strerror or str(error)) from None
    addresses = {sockaddr[0] for family, _, _, _, sockaddr in answers
                 if family in (socket.AF_INET, socket.AF_INET6)}
    if not addresses:
        raise ResolveError(configured, "no IPv4 or IPv6 address")
    # sorted: DNS servers rotate their answers, and the order must not read as a change
    return tuple(Endpoint(configured, address, port) for address in sorted(addresses, key=_address_key))


async def resolve(endpoints: Iterable[str],
                  getaddrinfo: GetAddrInfo = trio.socket.getaddrinfo) -> tuple[Endpoint, ...]:
    """Every worker ``endpoints`` (``host:port`` strings, validated by the configuration) stand
    for, in their order; a name's addresses sorted. IP addresses are not looked up. Names
    resolve concurrently; if any does not, :class:`ResolveError` names the first in the list
    that did not."""
    endpoints = list(endpoints)
    results: list[tuple[Endpoint, ...] | ResolveError] = [()] * len(endpoints)

    async def one(index: int, configured: str) -> None:
        try:
            results[index] = await _resolve_one(configured, getaddrinfo)
        except ResolveError as error:
            results[index] = error  # kept, so the others finish and the first is reported

    async with trio.open_nursery() as nursery:
        for index, configured in enumerate(endpoints):
            nursery.start_soon(one, index, configured)
    out: list[Endpoint] = []
    for result in results:
        if isinstance(result, ResolveError):
            raise result
        out.extend(result)
    return unique(out)


def unique(endpoints: Iterable[Endpoint]) -> tuple[Endpoint, ...]:
    """``endpoints`` with one per address and port, the first (in order) kept: a worker reached
    through two endpoints is one worker."""
    seen: set[tuple[int, int, int]] = set()
    out: list[Endpoint] = []
    for endpoint in endpoints:
        key = (*_address_key(endpoint.address), endpoint.port)
        if key not in seen:
            seen.add(key)
            out.append(endpoint)
    return tuple(out)


def diff(old: Iterable[Endpoint], new: Iterable[Endpoint]) -> tuple[tuple[Endpoint, ...],
                                                                     tuple[Endpoint, ...]]:
    """``(added, removed)``: the endpoints of ``new`` not in ``old`` (in ``new``'s order) and
    those of ``old`` not in ``new`` (in ``old``'s order)."""
    old, new = tuple(old), tuple(new)
    before, after = set(old), set(new)
    return tuple(e for e in new if e not in before), tuple(e for e in old if e not in after)


async def follow(endpoints: Sequence[str], refresh_seconds: float,
                 send_channel: trio.MemorySendChannel[EndpointsChanged],
                 getaddrinfo: GetAddrInfo = trio.socket.getaddrinfo, *,
                 task_status: trio.TaskStatus[tuple[Endpoint, ...]] = trio.TASK_STATUS_IGNORED,
                 ) -> None:
    """Resolve ``endpoints`` now and every ``refresh_seconds``, and send an
    :class:`EndpointsChanged` on ``send_channel`` for the first resolution and for each later one
    that changes the set of workers. Runs until cancelled, then closes ``send_channel`` (so the
    receiver's ``async for`` ends).

    Each name's lookup may take at most ``refresh_seconds``; one that fails or takes longer keeps
    the addresses the name last resolved to (none, if it never resolved), and is retried at the
    next refresh. The first failure of a name logs a warning; further failures of the same streak
    log nothing; the first success after it logs that the name resolves again.

    With ``nursery.start``, the parent gets the first resolution's endpoints once it is done;
    they also are the first message's ``added``.
    """
    endpoints = list(endpoints)
    known: dict[str, tuple[Endpoint, ...]] = {name: () for name in endpoints}
    failing: set[str] = set()
    twins: set[Endpoint] = set()            # endpoints left out as duplicates (warned once each)
    current: tuple[Endpoint, ...] = ()

    async def refresh(configured: str) -> None:
        reason = f"no answer within {refresh_seconds:g} s (endpoint_refresh_seconds)"
        with trio.move_on_after(refresh_seconds):
            try:
                resolved = await _resolve_one(configured, getaddrinfo)
            except ResolveError as error:
                reason = error.reason
            else:
                if configured in failing:
                    failing.discard(configured)
                    log.info("endpoint %s resolves again: %s", configured,
                             ", ".join(e.address for e in resolved))
                known[configured] = resolved
                return
        if configured not in failing:
            failing.add(configured)
            kept = known[configured]
            keeping = (f"keeping its last known address{'es' if len(kept) != 1 else ''} "
                       f"{', '.join(e.address for e in kept)}") if kept else "no worker for it yet"
            log.warning("endpoint %s: cannot resolve (%s); %s; retrying every %g s",
                        configured, reason, keeping, refresh_seconds)

    async with send_channel:
        first = True
        while True:
            # counted from each round's start: after a receiver was slow to take a message,
            # one refresh runs at once, not one for every period missed
            deadline = trio.current_time() + refresh_seconds
            async with trio.open_nursery() as nursery:
                for configured in endpoints:
                    nursery.start_soon(refresh, configured)
            every = [e for name in endpoints for e in known[name]]
            resolved = unique(every)
            for twin in set(every) - set(resolved):
                if twin not in twins:
                    twins.add(twin)
                    first_of = next(e for e in resolved if e.target == twin.target)
                    log.warning("endpoint %s resolves to %s, already the worker %s: one worker, not two",
                                twin.configured, twin.target, first_of.name)
            twins.intersection_update(every)
            added, removed = diff(current, resolved)
            current = resolved
            if first:
                task_status.started(current)
            if first or added or removed:
                await send_channel.send(EndpointsChanged(added, removed, current))
            first = False
            await trio.sleep_until(deadline)
