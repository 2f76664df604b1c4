"""Who may call what: restricted API groups (``endpoints.restricted``) and the peers allowed to
use client shared memory (``endpoints.client_shm_peers``).

Every RPC the worker serves belongs to exactly one API group. The groups are Triton's
(``--grpc-restricted-protocol``): ``health``, ``metadata``, ``inference``, ``shared-memory``,
``model-config``, ``model-repository``, ``statistics``, ``trace``, ``logging``; plus xlaserve's
own ``control``, every RPC of the ``WorkerControl`` service. A restricted group is answered
PERMISSION_DENIED unless the call carries the configured header with the configured value,
compared in constant time. :meth:`AccessPolicy.for_methods` refuses a served RPC that is in no
group, so a new RPC cannot slip through unrestricted by accident.

Pure data and functions, no I/O: the node-file schema validates against these tables, and the
transport asks :class:`Rule` about each new call.
"""
from __future__ import annotations

import hmac
import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

_KSERVE = "inference.GRPCInferenceService"
_CONTROL = "xlaserve.control.WorkerControl"

#: group -> the RPCs in it, as (service, method) pairs. Triton's groups first, then ``control``.
GROUPS: Mapping[str, tuple[tuple[str, str], ...]] = MappingProxyType({
    group: tuple((service, rpc) for rpc in rpcs.split())
    for group, service, rpcs in (
        ("health", _KSERVE, "ServerLive ServerReady ModelReady"),
        ("metadata", _KSERVE, "ServerMetadata ModelMetadata"),
        ("inference", _KSERVE, "ModelInfer ModelStreamInfer"),
        ("shared-memory", _KSERVE, "SystemSharedMemoryStatus SystemSharedMemoryRegister "
                                   "SystemSharedMemoryUnregister CudaSharedMemoryStatus "
                                   "CudaSharedMemoryRegister CudaSharedMemoryUnregister"),
        ("model-config", _KSERVE, "ModelConfig"),
        ("model-repository", _KSERVE, "RepositoryIndex RepositoryModelLoad RepositoryModelUnload"),
        ("statistics", _KSERVE, "ModelStatistics"),
        ("trace", _KSERVE, "TraceSetting"),
        ("logging", _KSERVE, "LogSettings"),
        ("control", _CONTROL, "ModelControlStatus SetModelResidency SetModelPolicy CompactMemory "
                              "WatchStatus"),
    )
})


def _path_groups() -> Mapping[str, str]:
    paths: dict[str, str] = {}
    for group, rpcs in GROUPS.items():
        for service, rpc in rpcs:
            path = f"/{service}/{rpc}"
            if path in paths:   # pragma: no cover - a mistake in the table above
                raise AssertionError(f"{path} is in both API groups {paths[path]!r} and {group!r}")
            paths[path] = group
    return MappingProxyType(paths)


#: gRPC path (``/package.Service/Method``) -> its API group.
PATH_GROUPS: Mapping[str, str] = _path_groups()

# RFC 9110 token characters, lower case only (HTTP/2 field names are lower case, RFC 9113 8.2.1).
_FIELD_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9a-z]+\Z")
# Fields the HTTP/2 or gRPC layers own; a client cannot be asked to set them to a secret.
_RESERVED = frozenset({"content-type", "te", "user-agent", "host", "connection", "keep-alive",
                       "proxy-connection", "transfer-encoding", "upgrade"})
# A header value gRPC carries as text: visible ASCII and inner spaces.
_FIELD_VALUE = re.compile(r"[\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?\Z")


def header_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a restricted group's header, or None if it can."""
    if not name:
        return "the header name is empty"
    if name.startswith(":"):
        return f"'{name}' is an HTTP/2 pseudo-header, which a client cannot set"
    if not _FIELD_NAME.match(name):
        return (f"'{name}' is not a valid HTTP/2 header name: use lower-case letters, digits and "
                "!#$%&'*+-.^_`|~ only")
    if name.startswith("grpc-"):
        return f"'{name}' is reserved: names starting with 'grpc-' belong to gRPC itself"
    if name.endswith("-bin"):
        return f"'{name}' is a binary (base64) gRPC header; use a text header (a name not ending in '-bin')"
    if name in _RESERVED:
        return f"'{name}' is reserved for the HTTP/2 and gRPC layers ({', '.join(sorted(_RESERVED))})"
    return None


def header_value_problem(value: str) -> str | None:
    """Why ``value`` cannot be a restricted group's header value, or None if it can."""
    if not value:
        return "the header value is empty"
    if not _FIELD_VALUE.match(value):
        return ("the header value must be printable ASCII (spaces only between other characters), as "
                "gRPC text metadata is")
    return None


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
                             "xlaserve/frontend/access.py (GROUPS) so that endpoints.restricted covers it")
        return {p: self.rules[PATH_GROUPS[p]] for p in paths if PATH_GROUPS[p] in self.rules}


# --- client shared memory: which peers ---------------------------------------------------------

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: ``endpoints.client_shm_peers``'s default: loopback only.
LOOPBACK_NETWORKS = ("127.0.0.0/8", "::1/128")


def parse_network(text: str) -> IPNetwork:
    """A network in CIDR notation (``10.0.0.0/8``, ``::1/128``; a bare address is a /32 or /128).
    ValueError, saying what was expected, for anything else (host bits set included)."""
    try:
        return ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        raise ValueError(f"{text!r} is not a network in CIDR notation such as '127.0.0.0/8' or '::1/128' "
                         f"({exc})") from None


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
