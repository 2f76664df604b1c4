"""The node file's schema: every documented key, its type, default, bounds and meaning.

Each block of the node file is a frozen, slotted dataclass here; each field is one key, and its
docstring entry is the key's documentation (``docs/node-config.md`` is written from these
docstrings). Validation is generic (:mod:`xlaserve.config.fields`); how a node's blocks resolve
into one worker's settings is :mod:`xlaserve.config.resolve`.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

from xlaserve.config.access import (GROUPS, LOOPBACK_NETWORKS, IPNetwork, header_name_problem,
                                    header_value_problem, parse_network)
from xlaserve.config.fields import ConfigError, InvalidValue, join_path, config_key, show_value
from xlaserve.runtime.eviction import DEFAULT_MISS_OVERHEAD, DEFAULT_POLICY, POLICIES

MAX_PORT = 65535
_MIB = 1024 * 1024

_PORT = {"low": 0, "high": MAX_PORT}
_BASE_PORT = {"low": 1, "high": MAX_PORT}
#: A model's ``fair`` weight: a relative share, within twelve orders of magnitude of another's.
#: Outside it the fair policy's cost/weight overflowed (5e-324 made a model's credit infinite:
#: it took every dispatch) or underflowed to nothing.
MIN_WEIGHT = 1e-6
MAX_WEIGHT = 1e6
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")


def _parse_name(value: Any) -> str:
    if isinstance(value, str) and _NAME.match(value):
        return value
    raise InvalidValue


def split_address(text: str) -> tuple[str, int]:
    """Split ``"host:port"`` (``"[::]:8001"`` for IPv6) into host and port; ValueError if bad."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or int(port) > MAX_PORT:
        raise ValueError(f"not a host:port address: {text!r}")
    return host, int(port)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_listen_address(value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidValue
    try:
        split_address(value)
    except ValueError:
        raise InvalidValue from None
    return value


def _parse_gpus(value: Any) -> str | int | tuple[int, ...]:
    if value == "auto":
        return "auto"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, list) and value:
        ordinals = tuple(value)
        if (all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in ordinals)
                and len(set(ordinals)) == len(ordinals)):
            return ordinals
    raise InvalidValue


@dataclass(frozen=True, slots=True)
class RestrictedApi:
    """One entry of ``endpoints.restricted``: API groups a call may use only when it carries the
    header ``header`` with the value ``value`` (never logged: the effective configuration shows
    it as ``<redacted>``)."""

    groups: tuple[str, ...]
    header: str
    value: str = field(repr=False, metadata={"secret": True})


_RESTRICTED_KEYS = ("groups", "header", "value")


def _parse_restricted(value: Any) -> tuple[RestrictedApi, ...]:
    if not isinstance(value, (list, tuple)):
        raise InvalidValue
    entries: list[RestrictedApi] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(value):
        where = f"[{i}]"
        if not isinstance(raw, Mapping):
            raise InvalidValue(f"expected a mapping with keys {', '.join(_RESTRICTED_KEYS)}, "
                               f"got {show_value(raw)}", where)
        for key in raw:
            if key not in _RESTRICTED_KEYS:
                raise InvalidValue(f"unknown key (known: {', '.join(_RESTRICTED_KEYS)})", f"{where}.{key}")
        for key in _RESTRICTED_KEYS:
            if key not in raw:
                raise InvalidValue(f"required (an entry sets {', '.join(_RESTRICTED_KEYS)})", f"{where}.{key}")
        groups = raw["groups"]
        if not isinstance(groups, (list, tuple)) or not groups:
            raise InvalidValue(f"expected a non-empty list of API groups ({', '.join(GROUPS)}), "
                               f"got {show_value(groups)}",
                           f"{where}.groups")
        for group in groups:
            if group not in GROUPS:
                raise InvalidValue(f"unknown API group {show_value(group)} (valid: {', '.join(GROUPS)})",
                                   f"{where}.groups")
            if group in seen:
                also = "earlier in this entry" if seen[group] == i else f"also in entry [{seen[group]}]"
                raise InvalidValue(f"API group '{group}' is restricted twice ({also}); a group has one header",
                                   f"{where}.groups")
            seen[group] = i
        header = raw["header"]
        if not isinstance(header, str):
            raise InvalidValue(f"expected a header name (a string), got {show_value(header)}", f"{where}.header")
        problem = header_name_problem(header)
        if problem:
            raise InvalidValue(problem, f"{where}.header")
        secret = raw["value"]
        if not isinstance(secret, str):
            # the value itself is not shown: it is meant to be a secret
            raise InvalidValue("expected a string (quote it if YAML reads it as a number or boolean)", f"{where}.value")
        problem = header_value_problem(secret)
        if problem:
            raise InvalidValue(problem, f"{where}.value")
        entries.append(RestrictedApi(tuple(groups), header, secret))
    return tuple(entries)


def parse_networks(value: Any) -> tuple[IPNetwork, ...]:
    if not isinstance(value, (list, tuple)):
        raise InvalidValue
    networks = []
    for i, text in enumerate(value):
        if not isinstance(text, str):
            raise InvalidValue(f"expected a network in CIDR notation such as '127.0.0.0/8', got {show_value(text)}",
                               f"[{i}]")
        try:
            networks.append(parse_network(text))
        except ValueError as exc:
            raise InvalidValue(str(exc), f"[{i}]") from None
    return tuple(networks)


# --- the value objects ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """How a worker drives its device (YAML block ``runtime:``).

    Attributes:
        backend: ``cpu`` or ``cuda``. Default ``cpu``. ``cpu`` is for development, tests and
            fallback; ``cuda`` needs the ``xlaserve[cuda]`` extra.
        mem_fraction: on ``cuda``, the device allocator's pool as a fraction of the GPU's
            memory, in (0, 1]. Default 0.9. On ``cpu`` a non-default value is logged as not
            applicable.
        preallocate: on ``cuda``, claim the pool up front rather than growing it up to
            ``mem_fraction``. Default true. On ``cpu`` a non-default value is logged as not
            applicable.
        allow_cpu_fallback: when ``cuda`` is asked for but cannot be used, run on the CPU (one
            warning says why) instead of failing to start. Default false: a GPU node that
            silently runs on the CPU is worse than one that refuses to start.
        weight_cache_fraction: fraction of the device arena the weight cache may fill with
            weights (pinned and on-demand), in [0, 1]. Default 1.0 (the whole arena, self-sized).
            0 disables on-demand loading: every model's weights stay resident.
        weight_cache_wiggle_fraction: fraction of the arena kept free for activations and
            compiler scratch, in [0, 1). Default 0.1.
        device_memory_bytes: size of the arena the weight budget is computed from on the ``cpu``
            backend, in bytes. Default 0, meaning the machine's total RAM. Set it to simulate a
            small accelerator on the CPU.
        weight_eviction: the weight cache's replacement policy: ``gdsf`` (GreedyDual-Size-
            Frequency with an admission filter: cost of a load x frequency / size, aged) or
            ``lru`` (least recently used). Default ``gdsf``, chosen on the simulator
            (docs/weights.md).
        weight_prefetch: whether the weight cache starts copying the model the scheduler expects
            next while the current one executes: ``on``, ``off`` or ``auto`` (on where the copy
            is a DMA the host does not perform, ``cuda``; off on ``cpu``, where the copy is a
            memcpy that competes with execution for the same cores). Default ``auto``
            (docs/weights.md#prefetch has the measurements).
        weight_miss_overhead_seconds: what a weight-cache miss costs beyond its timed copy
            (bookkeeping, the serving thread's time, caches refilled), added to the learned copy
            time in ``gdsf``'s cost, >= 0. A fixed part per miss makes the policy keep small
            models, so it misses less. Default 0.0005 (measured: docs/weights.md).
        weight_trace: a file the worker writes every weight-cache reference to (JSON lines:
            time, model, bytes, hit or miss, load time), for ``benchmarks/cache_sim.py``.
            ``{worker}`` in it is replaced by the worker's name; on a node of several workers
            a path without it gets ``.<worker>`` before its suffix. Default null: no trace.
    """

    backend: str = config_key("cpu", choices=("cpu", "cuda"))
    mem_fraction: float = config_key(0.9, low=0.0, low_open=True, high=1.0)
    preallocate: bool = config_key(True)
    allow_cpu_fallback: bool = config_key(False)
    weight_cache_fraction: float = config_key(1.0, low=0.0, high=1.0)
    weight_cache_wiggle_fraction: float = config_key(0.1, low=0.0, high=1.0, high_open=True)
    device_memory_bytes: int = config_key(0, low=0)
    weight_eviction: str = config_key(DEFAULT_POLICY, choices=POLICIES)
    weight_prefetch: str = config_key("auto", choices=("auto", "on", "off"))
    weight_miss_overhead_seconds: float = config_key(DEFAULT_MISS_OVERHEAD, low=0.0)
    weight_trace: Path | None = config_key(None)


@dataclass(frozen=True, slots=True)
class ModelSchedConfig:
    """Per-model scheduling (YAML ``scheduler.models.<model>:``).

    Attributes:
        weight: the model's relative share of device time under the ``fair`` discipline, > 0.
            Default 1.0.
        residency: the model's residency floor: ``device`` keeps its weights on the device for
            the server's lifetime, ``system`` keeps a host copy in RAM and loads it onto the
            device on demand, ``unpinned`` keeps no host copy and re-reads the weights from disk
            on each load. Default ``system``. ``pin_to_gpu: true`` is an alias for
            ``residency: device``.
        max_batch_size: cap on the rows coalesced into one dispatch, >= 1; null (the default)
            is uncapped. It never changes compiled shapes and never splits a request.
        batch_delay_seconds: how long, at most, the model's oldest queued request is held back
            so that more rows gather before a dispatch, >= 0. Default 0: never (a dispatch takes
            whatever has queued when the device frees). A hold happens only while no other model
            has requests queued and never past a request's deadline less the learned cost.
        batch_target_rows: a hold ends as soon as this many rows are queued, >= 1. Default null:
            the largest compiled batch size (capped by ``max_batch_size``).
    """

    # ``pin_to_gpu: true`` is accepted as an alias of ``residency: device``
    ALIASES: ClassVar[Mapping[str, Callable[..., Mapping[str, Any]]]]

    weight: float = config_key(1.0, low=MIN_WEIGHT, high=MAX_WEIGHT)
    residency: str = config_key("system", choices=("device", "system", "unpinned"))
    max_batch_size: int | None = config_key(None, low=1)
    batch_delay_seconds: float = config_key(0.0, low=0.0)
    batch_target_rows: int | None = config_key(None, low=1)


def _pin_to_gpu(pin: Any, out: Mapping[str, Any], pin_path: str, path: str) -> Mapping[str, Any]:
    if not isinstance(pin, bool):
        raise ConfigError(f"{pin_path}: expected true or false, got {show_value(pin)}")
    if "residency" in out and (out["residency"] == "device") != pin:
        raise ConfigError(
            f"{pin_path}: contradicts {join_path(path, 'residency')}: {out['residency']}; "
            "set only residency")
    return {**out, "residency": "device"} if pin else out


ModelSchedConfig.ALIASES = MappingProxyType({"pin_to_gpu": _pin_to_gpu})
#: The settings of a model without overrides. Frozen, so one instance serves every such model: the
#: dispatch loop asks for a model's settings several times per backlogged model per dispatch.
DEFAULT_MODEL_SCHED = ModelSchedConfig()


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How a worker shares its device between models (YAML block ``scheduler:``).

    Attributes:
        discipline: ``fair`` (weighted deficit by learned cost), ``fifo`` (oldest request
            first) or ``edf`` (earliest deadline first; sheds work that cannot finish in time).
            Default ``fair``.
        ema_halflife_seconds: half-life of the moving average that learns each model's
            execution cost, > 0. Default 30.0.
        max_queue_depth: per-model queue cap, >= 1; a full model rejects new requests with
            RESOURCE_EXHAUSTED. Default 1024.
        dispatch_timeout_seconds: longest a request may wait in a queue when it carries no
            deadline of its own, > 0. Default 30.0.
        compaction_interval: defragment device memory every N on-demand weight loads (nothing
            to do on ``cpu``); 0 (the default) disables.
        cold_defer_dispatches: how many dispatches of other models a model whose weights are
            not on the device may wait while resident models have queued work, so that its
            requests gather and one load serves them (docs/scheduler.md, "Cold models"), >= 0.
            0 (the default) disables: measured, it raised p99 and saved no loads on a closed
            loop (docs/scheduler.md).
        models: per-model overrides (:class:`ModelSchedConfig`), keyed by model name. Default
            empty: every model runs with the defaults.
    """

    discipline: str = config_key("fair", choices=("fair", "fifo", "edf"))
    ema_halflife_seconds: float = config_key(30.0, low=0.0, low_open=True)
    max_queue_depth: int = config_key(1024, low=1)
    dispatch_timeout_seconds: float = config_key(30.0, low=0.0, low_open=True)
    compaction_interval: int = config_key(0, low=0)
    cold_defer_dispatches: int = config_key(0, low=0)
    models: Mapping[str, ModelSchedConfig] = config_key(factory=lambda: MappingProxyType({}),
                                                        env=False)

    def for_model(self, name: str) -> ModelSchedConfig:
        """The model's override, or the defaults when it has none."""
        return self.models.get(name) or DEFAULT_MODEL_SCHED


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """TLS on a worker's gRPC endpoint (YAML ``endpoints.tls:``; null, the default, serves
    cleartext HTTP/2). Each file is read and checked at start-up; a problem stops the worker
    with one line naming the key and the file. Relative paths resolve against the node file's
    directory.

    Attributes:
        cert_file: the server's certificate chain, PEM: its certificate first, then any
            intermediates. Required.
        key_file: the private key of that certificate, PEM, not encrypted. Required.
        client_ca_file: CA certificates, PEM, that sign the certificates clients must present:
            given, a client without a certificate signed by one of them is refused during the
            handshake (mutual TLS). Default null: clients are not asked for a certificate.
    """

    cert_file: Path = config_key()
    key_file: Path = config_key()
    client_ca_file: Path | None = config_key(None)


@dataclass(frozen=True, slots=True)
class EndpointsConfig:
    """A worker's gRPC endpoint (YAML block ``endpoints:``).

    Attributes:
        host: the address a worker of a multi-worker node binds. Default ``0.0.0.0``.
        port: an explicit gRPC port for the worker, 0..65535 (0: any free port). Default null:
            see the port rules in :func:`resolve_worker`.
        max_concurrent_requests: inference requests the worker may have in flight (accepted,
            not yet answered), >= 0; past it a new one is answered RESOURCE_EXHAUSTED at once.
            Default 0: uncapped, so load beyond the device's pace waits in the per-model queues
            (``scheduler.max_queue_depth``) within ``max_held_request_bytes``. Set it where a
            gateway in front wants a worker to shed at a fixed count; keep it above the gateway's
            per-worker stream limit.
        allow_client_shm: accept system shared-memory regions registered by clients. Default
            false: only enable it when clients run on the same host and are trusted.
        max_recv_msg_bytes: largest gRPC message accepted, >= 1. Default 256 MiB.
        max_send_msg_bytes: largest gRPC message sent, >= 1. Default 256 MiB.
        max_connection_buffer_bytes: request bytes one client connection may have the worker
            hold before they are handled (messages still arriving, stream messages not yet
            read), >= 1; never less than one largest message. The call whose data would cross
            it fails with RESOURCE_EXHAUSTED. Default 1 GiB.
        max_held_request_bytes: bytes of inference requests the worker may hold, over all
            connections, from decoding until the answer is handed to the connection: their input
            tensors and their expected fixed-size outputs, >= 1. A request that would cross it
            is answered RESOURCE_EXHAUSTED at once; the others go on. Default 2 GiB (8 largest
            messages at the default ``max_recv_msg_bytes``; far above what a queue of small
            requests needs, small beside the host RAM the weight cache's host copies use).
        max_undecoded_request_bytes: request bytes all client connections together may have
            the worker hold before they are handled (what ``max_connection_buffer_bytes`` bounds
            per connection), >= 1; never less than one largest message. Past it the worker stops
            reading from the connections that hold the most (flow control holds their clients;
            they are not closed for it) until the total falls. Default 2 GiB (the default
            ``max_held_request_bytes``: the bytes of requests arriving match those of requests
            decoded).
        max_connections: client connections the worker serves at once, >= 1. One more is
            sent GOAWAY (ENHANCE_YOUR_CALM, naming this key) and closed at once; the open ones go
            on. Default 1024 (a connection's read buffer costs the pages its reads use, at most 4 MiB).

    The HTTP/2 limits of one client connection (docs/security.md says what each stops). A
    connection past one is sent GOAWAY (ENHANCE_YOUR_CALM) naming the key and closed; the
    others go on:

        max_concurrent_streams: calls open at once (advertised in SETTINGS); a call reset while
            its request is queued or running counts until that work is over. One more stream is
            refused (REFUSED_STREAM). Default 128.
        max_header_list_bytes: one request's decoded header fields (name + value + 32 each),
            advertised as SETTINGS_MAX_HEADER_LIST_SIZE. Default 64 KiB.
        max_header_fields: header fields in one request's header block, counted while it is
            decoded (decoding stops at the first field past it). A gRPC request carries about
            ten. Default 100 (Envoy's ``max_headers_count``).
        max_header_block_bytes: one request's encoded header block (HEADERS and CONTINUATION
            payloads), checked before any of it is decoded. Default 64 KiB.
        max_continuation_frames: CONTINUATION frames in one header block. Default 8 (nghttp2's).
        max_settings_entries: entries in one SETTINGS frame (there are six settings). Default 32.
        max_queued_control_frames: PING and SETTINGS acknowledgements and RST_STREAMs queued for a
            client that does not read them. Default 10000.
        glitch_burst, glitches_per_second: a token bucket of the work a client may waste:
            streams it resets, streams refused past max_concurrent_streams, empty DATA and
            CONTINUATION frames, SETTINGS frames after the first, malformed requests. Default a
            burst of 1000 refilled at 33 per second (nghttp2's stream-reset defaults).
        handshake_timeout_seconds: from connecting to the client's first SETTINGS frame. Default 5.
        idle_timeout_seconds: a connection with no call open this long gets GOAWAY (NO_ERROR) and
            is closed; 0 never. Default 300.
        keepalive_interval_seconds: nothing received this long: the server sends a PING; 0 never.
            Default 60.
        keepalive_timeout_seconds: no frame this long after that PING: closed. Default 20.
        max_queued_reply_bytes: output queued for one connection past which the server stops
            reading that client's requests until half of it has gone out; and reply bytes
            waiting for flow-control window past which its new streams are refused
            (REFUSED_STREAM) until they have gone. Default 4 MiB.
        write_timeout_seconds: a write that makes no progress this long (the client stopped
            reading) closes the connection. Default 60.
        restricted: API groups that need a header (:class:`RestrictedApi` entries ``{groups,
            header, value}``), as Triton's ``--grpc-restricted-protocol``. Groups: ``health``,
            ``metadata``, ``inference``, ``shared-memory``, ``model-config``,
            ``model-repository``, ``statistics``, ``trace``, ``logging`` and ``control`` (the
            WorkerControl service); each at most once. A call in a restricted group without the
            header, or with another value, is answered PERMISSION_DENIED naming the group and the
            header. The header is a lower-case HTTP/2 field name, not ``grpc-*``, ``*-bin`` nor one
            the transport owns. Default empty: nothing restricted. Not settable from the
            environment.
        client_shm_peers: the networks (CIDR strings) whose clients may use client shared
            memory when ``allow_client_shm`` is true: the system shared-memory RPCs and
            ModelInfer with shared-memory parameters from any other peer are answered
            PERMISSION_DENIED naming the peer. Default ``[127.0.0.0/8, ::1/128]``: loopback only.
            Not settable from the environment.
        tls: serve gRPC over TLS 1.2 or later with ALPN ``h2`` (:class:`TlsConfig`: ``cert_file``,
            ``key_file``, optional ``client_ca_file`` for mutual TLS). Default null: cleartext
            HTTP/2 (h2c with prior knowledge). Not settable from the environment.
        max_connection_inflate_bytes: decompressed request bytes one client connection may
            have the worker hold at once (gzip/deflate messages inflated and not yet parsed),
            >= 1. A compressed message is inflated only up to what is left of it (and of
            ``max_inflate_bytes``, and ``max_recv_msg_bytes``), decided before inflating; one
            that would inflate past it fails with RESOURCE_EXHAUSTED naming this key. Default
            16 MiB (four times gRPC's usual 4 MiB message limit): a 250 KiB gzip message of
            zeros costs at most that, not 255 MiB.
        max_inflate_bytes: the same over all connections of the worker, >= 1. Default 256 MiB
            (one largest message at the default ``max_recv_msg_bytes``).
        rest_max_header_bytes: the largest head (request line and header fields) a REST request
            may have (``listen.rest``), >= 1024; a larger one is answered 431 and its connection
            closed. Default 16 KiB.
        rest_max_headers: header fields one REST request may have, >= 1 (431 past it). Default 100.
        rest_max_json_bytes: the JSON a REST request may carry (an inference's JSON header or whole
            JSON body; any other route's body), >= 1024; past it 413 before it is parsed. Parsing
            costs the worker's Trio thread and about 13x the JSON's size in memory. Default 32 MiB.
        rest_header_timeout_seconds: a REST request's head must arrive within this, counted from
            its first byte (from the connection's start for its first request); 408 and closed
            past it (slow headers, slowloris). Default 10.
        rest_body_timeout_seconds: a REST request's whole body must arrive within this once its
            head has (slow bodies, a Content-Length that promises more than comes); 408 and
            closed past it. Default 60.
        rest_idle_timeout_seconds: a kept-alive REST connection with no request begun this long
            is closed. Default 60.
    """

    host: str = config_key("0.0.0.0")
    port: int | None = config_key(None, **_PORT)
    max_concurrent_requests: int = config_key(0, low=0)
    allow_client_shm: bool = config_key(False)
    max_recv_msg_bytes: int = config_key(256 * _MIB, low=1)
    max_send_msg_bytes: int = config_key(256 * _MIB, low=1)
    max_connection_buffer_bytes: int = config_key(1024 * _MIB, low=1)
    max_held_request_bytes: int = config_key(2048 * _MIB, low=1)
    max_undecoded_request_bytes: int = config_key(2048 * _MIB, low=1)
    max_connections: int = config_key(1024, low=1)
    max_concurrent_streams: int = config_key(128, low=1, high=2**31 - 1)
    max_header_list_bytes: int = config_key(64 * 1024, low=1024, high=2**31 - 1)
    max_header_fields: int = config_key(100, low=16, high=2**31 - 1)
    max_header_block_bytes: int = config_key(64 * 1024, low=1024, high=2**31 - 1)
    max_continuation_frames: int = config_key(8, low=0)
    max_settings_entries: int = config_key(32, low=6)
    max_queued_control_frames: int = config_key(10000, low=1)
    glitch_burst: int = config_key(1000, low=1)
    glitches_per_second: float = config_key(33.0, low=0.0)
    handshake_timeout_seconds: float = config_key(5.0, low=0.0, low_open=True)
    idle_timeout_seconds: float = config_key(300.0, low=0.0)
    keepalive_interval_seconds: float = config_key(60.0, low=0.0)
    keepalive_timeout_seconds: float = config_key(20.0, low=0.0, low_open=True)
    max_queued_reply_bytes: int = config_key(4 * _MIB, low=64 * 1024)
    write_timeout_seconds: float = config_key(60.0, low=0.0, low_open=True)
    restricted: tuple[RestrictedApi, ...] = config_key(
        (), parse=_parse_restricted, env=False, describe="a list of {groups, header, value} entries")
    client_shm_peers: tuple[IPNetwork, ...] = config_key(
        tuple(parse_network(n) for n in LOOPBACK_NETWORKS), parse=parse_networks, env=False,
        describe="a list of networks in CIDR notation")
    tls: TlsConfig | None = config_key(None, env=False)
    max_connection_inflate_bytes: int = config_key(16 * _MIB, low=1)
    max_inflate_bytes: int = config_key(256 * _MIB, low=1)
    rest_max_header_bytes: int = config_key(16 * 1024, low=1024)
    rest_max_headers: int = config_key(100, low=1)
    rest_max_json_bytes: int = config_key(32 * _MIB, low=1024)
    rest_header_timeout_seconds: float = config_key(10.0, low=0.0, low_open=True)
    rest_body_timeout_seconds: float = config_key(60.0, low=0.0, low_open=True)
    rest_idle_timeout_seconds: float = config_key(60.0, low=0.0, low_open=True)


@dataclass(frozen=True, slots=True)
class ListenConfig:
    """The node's public addresses (YAML top-level block ``listen:``), each ``"host:port"``.

    A one-worker node's worker binds them itself. With two or more workers the embedded
    gateway binds them.

    Attributes:
        grpc: KServe V2 gRPC. Default ``0.0.0.0:8001``.
        http: health (``/healthz``, ``/readyz``) and Prometheus ``/metrics``. Default
            ``0.0.0.0:8002``.
        rest: the Open Inference Protocol over HTTP/1.1 (KServe V2 REST with Triton's
            extensions; Triton's port is 8000). Default null: not served.
    """

    grpc: str = config_key("0.0.0.0:8001", parse=parse_listen_address, describe="a host:port address")
    http: str = config_key("0.0.0.0:8002", parse=parse_listen_address, describe="a host:port address")
    rest: str | None = config_key(None, parse=parse_listen_address, describe="a host:port address")


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    """How the supervisor of a multi-worker node keeps its workers running (YAML top-level block
    ``supervisor:``; see docs/supervisor.md). A one-worker node served by ``xlaserve run`` has no
    supervisor and ignores it.

    A worker that exits without being asked to is restarted after a back-off that starts at
    ``restart_backoff_initial_seconds`` and doubles with each exit of that worker within the last
    ``restart_window_seconds``, capped at ``restart_backoff_max_seconds``. The exit that would be
    its ``max_restarts + 1``-th restart within the window stops the whole node instead (exit
    status 1), naming the worker, how it exited and its last log lines.

    Attributes:
        restart_backoff_initial_seconds: the wait before restarting a worker whose previous exit
            is older than the window, >= 0. Default 0.5.
        restart_backoff_max_seconds: the longest wait before a restart, >= 0 and not less than
            ``restart_backoff_initial_seconds``. Default 30.
        max_restarts: restarts of one worker allowed within ``restart_window_seconds``, >= 0
            (0: the first unexpected exit stops the node). Default 5.
        restart_window_seconds: the sliding window, in seconds, over which a worker's exits are
            counted, > 0. Default 60.
        stop_timeout_seconds: on SIGTERM/SIGINT, how long the gateway may drain, and then how
            long the workers have between SIGTERM and SIGKILL, >= 0 each. Default 30.
    """

    restart_backoff_initial_seconds: float = config_key(0.5, low=0.0)
    restart_backoff_max_seconds: float = config_key(30.0, low=0.0)
    max_restarts: int = config_key(5, low=0)
    restart_window_seconds: float = config_key(60.0, low=0.0, low_open=True)
    stop_timeout_seconds: float = config_key(30.0, low=0.0)


LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    """The node's log output (YAML top-level block ``logging:``).

    Attributes:
        level: the least severe messages written: ``debug``, ``info``, ``warning`` or ``error``.
            Default ``info``. The command line's ``--log-level`` wins over it.
        format: ``text`` (one ``time LEVEL logger: message`` line a record; a supervised worker's
            lines prefixed ``[name] ``) or ``json`` (one JSON object a line, with ``time``,
            ``level``, ``logger`` and ``message``; a supervised worker's lines carry a
            ``worker`` field). Default ``text``. Control characters (an ESC a worker printed)
            are written ``\\xNN`` in ``text`` (tab and a record's newlines kept) and as JSON
            escapes in ``json``. The command line's ``--log-format`` wins over it.
    """

    level: str = config_key("info", choices=LOG_LEVELS)
    format: str = config_key("text", choices=("text", "json"))


TRACING_EXPORTERS = ("otlp", "file")


def _parse_otlp_endpoint(value: Any) -> str:
    if isinstance(value, str) and re.match(r"https?://[^/\s]+", value) and not any(c.isspace() for c in value):
        return value
    raise InvalidValue


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """OpenTelemetry traces of each request's stages (YAML top-level block ``tracing:``; see
    docs/tracing.md). Off unless ``enabled``; while off, the OpenTelemetry packages are not
    imported and a request costs one or two ``is None`` checks more. The OTLP exporter and the
    SDK are the install extra ``otel``; a node with tracing enabled but without them starts and
    serves untraced, logging one error that names the extra.

    Attributes:
        enabled: trace requests. Default false.
        sampling_ratio: the share of requests without a sampled parent that are traced, in
            [0, 1] (the decision is made from the trace id, so every process of a trace makes
            the same one). A request whose W3C ``traceparent`` says the caller sampled it is
            traced, and one whose caller did not is not (parent-based sampling). Default 1.
        service_name: the ``service.name`` resource attribute of every span. Default
            ``xlaserve``.
        exporter: ``otlp`` (OTLP over HTTP/protobuf to ``otlp_endpoint``) or ``file`` (one JSON
            object a finished span, a line, appended to ``file``). Default ``otlp``.
        otlp_endpoint: where ``otlp`` posts spans, an ``http://`` or ``https://`` URL. Default
            ``http://localhost:4318/v1/traces`` (an OpenTelemetry Collector on this machine).
        otlp_timeout_seconds: how long one export may take, reading the collector's answer
            included, > 0; also the longest shutdown waits for the last export. Default 10.
        file: the JSON-lines file the ``file`` exporter appends to (created if missing; every
            process of a node may share it). Required with ``exporter: file``; only with it.
        max_queued_spans: finished spans waiting to be exported, >= 1; past it new spans are
            dropped (and counted in the log at shutdown), never held. Default 2048.
        export_interval_seconds: how often queued spans are exported, > 0. Default 1.
    """

    enabled: bool = config_key(False)
    sampling_ratio: float = config_key(1.0, low=0.0, high=1.0)
    service_name: str = config_key("xlaserve")
    exporter: str = config_key("otlp", choices=TRACING_EXPORTERS)
    otlp_endpoint: str = config_key("http://localhost:4318/v1/traces", parse=_parse_otlp_endpoint,
                                    describe="an http:// or https:// URL")
    otlp_timeout_seconds: float = config_key(10.0, low=0.0, low_open=True)
    file: Path | None = config_key(None)
    max_queued_spans: int = config_key(2048, low=1)
    export_interval_seconds: float = config_key(1.0, low=0.0, low_open=True)


def check_tracing(tracing: TracingConfig, path: str = "tracing") -> None:
    """The rules between ``tracing:`` keys that no single key's bounds can say."""
    if tracing.exporter == "file" and tracing.file is None:
        raise ConfigError(f"{path}.file: required with {path}.exporter file (the JSON-lines file spans are "
                          "appended to)")
    if tracing.exporter != "file" and tracing.file is not None:
        raise ConfigError(f"{path}.file: applies only to {path}.exporter file ({path}.exporter is "
                          f"{tracing.exporter}; otlp sends spans to {path}.otlp_endpoint)")


@dataclass(frozen=True, slots=True)
class WorkerEntry:
    """One entry of ``workers:``, as written (override blocks validated but not yet merged).

    Attributes:
        name: the worker's identity in logs, metrics and the pin map; letters, digits, ``_``,
            ``.``, ``-``. Required.
        port: explicit gRPC port (the same as ``endpoints: {port: ...}`` in this entry).
        gpu: device ordinal this worker uses, >= 0. Default null: the worker's entry of a
            ``gpus:`` list when there is one, else (on ``cuda``) the ordinal equal to its index
            in ``workers:``. Two ``cuda`` workers may not use the same ordinal.
        runtime, scheduler, endpoints: the keys this worker sets in those blocks (a read-only
            mapping of key to value; ``scheduler["models"]`` maps model name to its keys). They
            merge over ``global:`` key by key, and per model for ``scheduler.models``.
        models_include: this worker's allowlist, replacing ``global.models_include``; null
            (the default) keeps the global one.
    """

    name: str = config_key(parse=_parse_name,
                           describe="a name of letters, digits, '_', '.' and '-'")
    port: int | None = config_key(None, **_PORT)
    gpu: int | None = config_key(None, low=0)
    runtime: Mapping[str, Any] = config_key(factory=lambda: MappingProxyType({}))
    scheduler: Mapping[str, Any] = config_key(factory=lambda: MappingProxyType({}))
    endpoints: Mapping[str, Any] = config_key(factory=lambda: MappingProxyType({}))
    models_include: tuple[str, ...] | None = config_key(None)


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "xlaserve"


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """A validated node file.

    Attributes:
        model_repo: the shared bundle repository; each subdirectory holding a
            ``manifest.yaml`` is a bundle named after the directory. Required. A relative
            path resolves against the node file's directory.
        base_port: with two or more workers, worker i's gRPC port is ``base_port + i`` unless
            it sets one. Default 9001.
        metrics_base_port: with two or more workers, worker i's HTTP port (health, metrics) is
            ``metrics_base_port + i``. Default 9101.
        gpus: ``auto`` (when ``runtime.backend`` is ``cuda``, one worker per GPU jax's CUDA
            plugin sees, one where it sees none; one worker on a ``cpu`` node), a count N, or a
            list of device ordinals. How many workers the node has when ``workers:``
            is omitted. Default ``auto``. With more than one worker ``xlaserve run`` runs a
            supervisor and the embedded gateway.
        cache_dir: (``global.cache_dir``) where compiled executables are cached across
            restarts; null disables the cache. Default ``~/.cache/xlaserve``. Relative paths
            resolve like ``model_repo``.
        cache_max_bytes: (``global.``) the most bytes the executable cache's entries may take
            in ``cache_dir``; past it the least recently used entries are removed after each
            write. 0 leaves it unbounded. Default 16 GiB.
        model_control_mode: (``global.``) ``dynamic`` watches the repository and loads,
            reloads and unloads bundles as files change; ``static`` loads the startup set once;
            ``explicit`` acts only on control RPCs. Default ``dynamic``.
        model_poll_seconds: (``global.``) interval of the repository rescan that ``dynamic``
            mode runs beside file events (it notices changes where events are unavailable),
            > 0. Default 15.0.
        model_import_timeout_seconds: (``global.``) how long a load may spend importing a
            bundle's ``model.py`` (its top-level code), > 0. Past it that load fails and the
            lifecycle goes on to the next; the import's thread, which Python cannot stop, is
            abandoned and whatever it gives back is dropped. Compiling is not bounded by it.
            Default 60.0.
        models_include: (``global.``) allowlist of model names to load; empty (the default)
            loads every bundle in the repository.
        runtime, scheduler, endpoints: the ``global:`` blocks, with environment overrides
            applied.
        workers: the ``workers:`` entries; when omitted, one implicit worker ``worker0``.
        workers_explicit: whether ``workers:`` was written; when false, the workers are
            ``worker0``, ``worker1``, ..., as many as ``gpus`` asks for.
        models: the pin map: model name to the workers that keep it resident on the device
            (``residency: device``). Default empty.
        gateway: the ``gateway:`` block as written; validated when the node loads
            (:mod:`xlaserve.config.gateway`), and read by
            :func:`~xlaserve.config.gateway.embedded_gateway_config`.
        listen: the node's public addresses.
        supervisor: how a multi-worker node's workers are restarted and stopped
            (:class:`SupervisorConfig`).
        logging: log level and format (:class:`LoggingConfig`).
        tracing: OpenTelemetry tracing of requests (:class:`TracingConfig`).
        env_overrides: the ``INFERENCE_SERVER_*`` overrides, by section (``node``, ``listen``,
            ``supervisor``, ``logging``, ``runtime``, ``scheduler``, ``endpoints``); already
            applied to the fields above, and applied again on top of each worker's blocks by
            :func:`resolve_worker`.
    """

    model_repo: Path
    base_port: int = config_key(9001, **_BASE_PORT)
    metrics_base_port: int = config_key(9101, **_BASE_PORT)
    gpus: str | int | tuple[int, ...] = config_key(
        "auto", parse=_parse_gpus, env=False,
        describe="'auto', a positive integer or a list of distinct device ordinals")
    cache_dir: Path | None = field(default_factory=_default_cache_dir)
    cache_max_bytes: int = config_key(16 * 1024 * _MIB, low=0)
    model_control_mode: str = config_key("dynamic", choices=("dynamic", "static", "explicit"))
    model_poll_seconds: float = config_key(15.0, low=0.0, low_open=True)
    model_import_timeout_seconds: float = config_key(60.0, low=0.0, low_open=True)
    models_include: tuple[str, ...] = config_key(())
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    endpoints: EndpointsConfig = field(default_factory=EndpointsConfig)
    workers: tuple[WorkerEntry, ...] = field(default_factory=lambda: (WorkerEntry("worker0"),))
    workers_explicit: bool = False
    models: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    gateway: Mapping[str, Any] | None = None
    listen: ListenConfig = field(default_factory=ListenConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    env_overrides: Mapping[str, Mapping[str, Any]] = field(
        default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """What one worker process runs with, fully resolved (see :func:`resolve_worker`).

    ``index`` is the worker's position in the node and ``worker_count`` the node's number of
    workers (two or more: the port rules of a multi-worker node apply). ``gpu`` is null when
    nothing names an ordinal; the worker then uses the ordinal equal to its index on ``cuda``,
    0 on ``cpu`` (:attr:`device_ordinal`). ``grpc_*`` and ``http_*`` are
    the addresses to bind. ``tracing`` is the node's ``tracing:`` block.
    """

    name: str
    index: int
    worker_count: int
    model_repo: Path
    cache_dir: Path | None
    model_control_mode: str
    model_poll_seconds: float
    models_include: tuple[str, ...]
    runtime: RuntimeConfig
    scheduler: SchedulerConfig
    endpoints: EndpointsConfig
    gpu: int | None
    grpc_host: str
    grpc_port: int
    http_host: str
    http_port: int
    tracing: TracingConfig = field(default_factory=TracingConfig)
    rest_host: str | None = None     #: None: no REST port (``listen.rest`` unset, or a gateway serves it)
    rest_port: int | None = None
    model_import_timeout_seconds: float = 60.0
    cache_max_bytes: int = 16 * 1024 * 1024 * 1024

    @property
    def device_ordinal(self) -> int:
        """The device this worker opens: its ``gpu``; else, on ``cuda``, its index in the node (so
        the workers of a node that names no ordinals use GPUs 0, 1, ... in order, whether the
        supervisor starts them or each is run on its own; the node file's check that no two
        ``cuda`` workers share a GPU counts the same way); else 0 (the one ``cpu`` device)."""
        if self.gpu is not None:
            return self.gpu
        return self.index if self.runtime.backend == "cuda" else 0

    @property
    def grpc_address(self) -> str:
        return join_address(self.grpc_host, self.grpc_port)
