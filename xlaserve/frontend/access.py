"""Who may call what: restricted API groups (``endpoints.restricted``) and the peers allowed to
use client shared memory (``endpoints.client_shm_peers``).

Every RPC the worker serves belongs to exactly one API group. The groups are Triton's
(``--grpc-restricted-protocol``): ``health``, ``metadata``, ``inference``, ``shared-memory``,
``model-config``, ``model-repository``, ``statistics``, ``trace``, ``logging``; plus xlaserve's
own ``control``, every RPC of the ``WorkerControl`` service. A restricted group is answered
PERMISSION_DENIED unless the call carries the configured header with the configured value,
compared in constant time. :meth:`AccessPolicy.for_methods` refuses a served RPC that is in no
group, so a new RPC cannot slip through unrestricted by accident.

Pure data and functions, no I/O: the tables (the groups, the header rules, the networks) are
:mod:`xlaserve.config.access`, which the node-file schema validates against; here they become
the rules the transport asks about each new call.
"""
from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from xlaserve.config.access import GROUPS, PATH_GROUPS, IPAddress, IPNetwork


class Restriction(Protocol):
    """One entry of ``endpoints.restricted`` (:class:`xlaserve.config.schema.RestrictedApi`)."""

    groups: tuple[str, ...]
    header: str
    value: str


@dataclass(frozen=True, slots=True)
class Rule:
    """What one restricted group asks of a call: ``header`` set to the configured value."""

    group: str
    header: str
    _expected: bytes = field(repr=False)

    def denial(self, metadata: Mapping[str, str]) -> str | None:
        """None if ``metadata`` carries the header with the right value; else the message of the
        PERMISSION_DENIED answer, which names the group and the header, never the value."""
        given = metadata.get(self.header)
        if given is not None and hmac.compare_digest(given.encode("utf-8", "surrogateescape"), self._expected):
            return None
        why = "without" if given is None else "with a wrong value in"
        return (f"the '{self.group}' API group is restricted on this server (endpoints.restricted); the call came "
                f"{why} header '{self.header}', which must carry the value configured for it")


@dataclass(frozen=True, slots=True)
class AccessPolicy:
    """The restricted groups of a worker; empty restricts nothing."""

    rules: Mapping[str, Rule] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_config(cls, restricted: Iterable[Restriction]) -> "AccessPolicy":
        """From ``endpoints.restricted`` (already validated at load; a group named twice is a bug)."""
        rules: dict[str, Rule] = {}
        for entry in restricted:
            for group in entry.groups:
                if group not in GROUPS or group in rules:
                    raise ValueError(f"API group {group!r} is unknown or restricted twice")
                rules[group] = Rule(group, entry.header, entry.value.encode())
        return cls(MappingProxyType(rules))

    def for_methods(self, paths: Iterable[str]) -> dict[str, Rule]:
        """path -> Rule for each of ``paths`` (the RPCs a server serves) whose group is restricted.

        Raises ValueError naming every path that is in no group: each served RPC must have one."""
        paths = list(paths)
        orphans = sorted(p for p in paths if p not in PATH_GROUPS)
        if orphans:
            raise ValueError(f"served RPCs in no API group: {', '.join(orphans)}; add each to a group in "
                             "xlaserve/config/access.py (GROUPS) so that endpoints.restricted covers it")
        return {p: self.rules[PATH_GROUPS[p]] for p in paths if PATH_GROUPS[p] in self.rules}


# --- client shared memory: which peers ---------------------------------------------------------

def peer_address(sockname: object) -> IPAddress | None:
    """The IP address in a socket's ``getpeername()`` result; an IPv4 client of a dual-stack
    listener (``::ffff:a.b.c.d``) is its IPv4 address. None for a peer that is not IP."""
    if not isinstance(sockname, tuple) or not sockname:
        return None
    try:
        address = ipaddress.ip_address(sockname[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def shm_peer_denial(rpc: str, peer: IPAddress | None, networks: Iterable[IPNetwork]) -> str | None:
    """None if ``peer`` is in one of ``networks``; else why ``rpc`` is refused, naming the peer
    and the key. A client elsewhere must not name a /dev/shm object of this host."""
    if peer is not None and any(peer in net for net in networks):
        return None
    who = f"peer {peer}" if peer is not None else "a peer with no IP address"
    return (f"{rpc}: client shared memory is accepted only from peers in endpoints.client_shm_peers "
            f"({', '.join(str(n) for n in networks) or 'none'}); this call comes from {who}")
