"""The dashboard's side of the worker control API (``xlaserve.control.WorkerControl``): where
the worker (or gateway) is, one snapshot, the snapshot stream, the actions (and the two KServe
repository calls, for load and unload), and the back-off between reconnects. asyncio, like
grpclib's client and Textual's event loop."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from grpclib.client import Channel
from grpclib.exceptions import ProtocolError, StreamTerminatedError

from xlaserve._proto import xlaserve_control_pb2 as pb
from xlaserve._proto.grpc_service_grpc import GRPCInferenceServiceStub
from xlaserve._proto.xlaserve_control_grpc import WorkerControlStub
from xlaserve.controlchars import CONTROL_CHARACTERS, show_controls

DEFAULT_ADDRESS = "localhost:8001"
DEFAULT_PORT = 8001
# The worker refuses to stream faster than this (WatchStatusRequest.interval_seconds).
MIN_INTERVAL_SECONDS = 0.05
# A unary control call (a snapshot, pin, policy, compact) that takes longer than this has failed.
CALL_TIMEOUT_SECONDS = 10.0
# Reconnects wait INITIAL, then twice as long each time, up to MAX; a snapshot resets it.
INITIAL_BACKOFF_SECONDS = 0.5
MAX_BACKOFF_SECONDS = 10.0
# What a call raises when the worker is not there or not a gRPC server (anything else is a bug):
# refused or reset connections, no answer in time, a peer that closes the connection or speaks
# something other than HTTP/2. A worker's refusal is grpclib's GRPCError, handled apart.
CONNECTION_ERRORS = (OSError, TimeoutError, StreamTerminatedError, ProtocolError)


def displayable(message):
    """``message`` (a status from a peer) with every control character in its strings, map keys
    included, written as ``\\xNN`` (:func:`~xlaserve.controlchars.show_controls`): what the
    dashboard and ``--once`` print is text, never a terminal escape a worker or gateway sent.
    Changed in place; returned."""
    for field, value in message.ListFields():
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, val = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            if key.type == key.TYPE_STRING and any(CONTROL_CHARACTERS.search(k) for k in value):
                items = dict(value)
                value.clear()
                for k, v in items.items():
                    value[show_controls(k)] = v
            if val.message_type is not None:
                for v in value.values():
                    displayable(v)
        elif field.type == field.TYPE_STRING:
            if isinstance(value, str):
                if CONTROL_CHARACTERS.search(value):
                    setattr(message, field.name, show_controls(value))
            else:                           # a repeated string field
                value[:] = [show_controls(v) for v in value]
        elif field.type == field.TYPE_MESSAGE:
            for item in (value if not hasattr(value, "ListFields") else (value,)):
                displayable(item)
    return message


@dataclass(frozen=True, slots=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_address(text: str) -> Address:
    """``host:port``, ``host`` (port 8001), ``[v6]:port`` or ``[v6]``. Raises ``ValueError``
    saying what was wrong and what is expected."""
    expected = "expected HOST:PORT, HOST or [IPV6]:PORT, e.g. localhost:8001"
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not host or (rest and not rest.startswith(":")):
            raise ValueError(f"bad address {text!r}: {expected}")
        port_text = rest[1:] if rest else str(DEFAULT_PORT)
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif ":" in text:
        raise ValueError(f"bad address {text!r}: an IPv6 address goes in brackets; {expected}")
    else:
        host, port_text = text, str(DEFAULT_PORT)
    if not host:
        raise ValueError(f"bad address {text!r}: no host; {expected}")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad address {text!r}: the port must be 1-65535; {expected}")
    return Address(host, int(port_text))


def next_backoff(seconds: float) -> float:
    """The wait after a reconnect that waited ``seconds`` failed: twice as long, at most
    :data:`MAX_BACKOFF_SECONDS`."""
    return min(max(seconds, INITIAL_BACKOFF_SECONDS) * 2, MAX_BACKOFF_SECONDS)


async def fetch_status(address: Address, timeout: float = CALL_TIMEOUT_SECONDS) -> pb.ModelControlStatusResponse:
    """One snapshot (``ModelControlStatus``). A worker that cannot be reached raises one of
    :data:`CONNECTION_ERRORS` (``TimeoutError`` after ``timeout`` s); its refusals raise grpclib's
    ``GRPCError``."""
    async with Channel(address.host, address.port) as channel:
        return displayable(await WorkerControlStub(channel).ModelControlStatus(
            pb.ModelControlStatusRequest(), timeout=timeout))


async def watch_status(address: Address, interval: float) -> AsyncIterator[pb.ModelControlStatusResponse]:
    """The worker's snapshots, one every ``interval`` s, until the worker ends the stream (it
    drains), the connection fails (:data:`CONNECTION_ERRORS`) or the worker refuses the stream
    (``GRPCError``). A worker that sends nothing for three intervals (at least 5 s more than one)
    is taken as lost: ``TimeoutError``, so a silently dead connection does not freeze the view."""
    stale_after = max(3 * interval, interval + 5.0)
    async with Channel(address.host, address.port) as channel:
        async with WorkerControlStub(channel).WatchStatus.open() as stream:
            await stream.send_message(pb.WatchStatusRequest(interval_seconds=interval), end=True)
            while True:
                async with asyncio.timeout(stale_after):
                    status = await stream.recv_message()
                if status is None:
                    return
                yield displayable(status)


async def call(address: Address, method: str, request) -> object:
    """One unary control call by name (``SetModelResidency``, ``SetModelPolicy``,
    ``CompactMemory``) on a channel of its own, so an action does not wait on the status stream."""
    async with Channel(address.host, address.port) as channel:
        rpc = getattr(WorkerControlStub(channel), method)
        return await rpc(request, timeout=CALL_TIMEOUT_SECONDS)


# The actions that are KServe calls rather than control calls.
KSERVE_METHODS = frozenset({"RepositoryModelLoad", "RepositoryModelUnload"})


async def kserve_call(address: Address, method: str, request) -> object:
    """One KServe unary call by name (``RepositoryModelLoad``, ``RepositoryModelUnload``) on a
    channel of its own. A load answers once the model is ready (or failed), so it may take as
    long as loading does: no timeout but the worker's own."""
    async with Channel(address.host, address.port) as channel:
        return await getattr(GRPCInferenceServiceStub(channel), method)(request)
