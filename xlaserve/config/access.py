"""The vocabulary of the node file's access keys, shared by the schema that validates them and
the frontend that enforces them: the API groups of every RPC (``endpoints.restricted``), what a
restricted group's header may be, and the networks of ``endpoints.client_shm_peers``.

Pure tables and checks of the standard library: the node file is validated against the same
tables the transport enforces (one table, not two), without importing the frontend.
:mod:`xlaserve.frontend.access` turns them into the rules each call is asked about.
"""
from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from types import MappingProxyType

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


# --- client shared memory: which networks ---------------------------------------------------------

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
