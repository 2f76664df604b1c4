"""The gateway's configuration: its schema, the standalone file, the node's ``gateway:`` block.

One gateway, two ways to configure it, one schema (:class:`GatewayConfig`):

- a standalone gateway (``xlaserve gateway gateway.yaml``) fronts workers anywhere, named by
  an ``endpoints:`` list: :func:`load_gateway_file` / :func:`parse_gateway_config`;
- the embedded gateway of a multi-worker node fronts that node's workers:
  :func:`embedded_gateway_config` reads the node file's ``gateway:`` block, takes its public
  addresses from the node's ``listen:`` block and its endpoints from the workers themselves.

Both take ``INFERENCE_SERVER_GATEWAY_<SECTION>_<FIELD>`` environment overrides, applied last.
Validation is the node file's (:mod:`xlaserve.config.fields`): every mistake is a
:class:`ConfigError` whose message starts with the key path (``gateway.scheduling.mode`` in a
node file, ``scheduling.mode`` in a gateway file) or the variable's name.
"""
from __future__ import annotations

import dataclasses
import functools
import ipaddress
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

from xlaserve.config.access import LOOPBACK_NETWORKS, IPNetwork, parse_network
from xlaserve.config.fields import (ConfigError, convert_value, field_specs, InvalidValue, is_int, join_path,
                                    config_key, as_mapping, merge_partial, parse_partial, reject_unknown,
                                    show_value, field_value)
from xlaserve.config.resolve import (GATEWAY_ENV_PREFIX, NODE_CHECKS, from_env_text, load_yaml_file,
                                     resolve_worker)
from xlaserve.config.resolve import worker_count as _node_worker_count
from xlaserve.config.schema import (MAX_PORT, NodeConfig, TracingConfig, join_address, parse_listen_address,
                                    parse_networks, check_tracing, split_address)

_MIB = 1024 * 1024
_ADDRESS = "a host:port address"
# RFC 1123 host names, plus '_' (Kubernetes service and SRV-style names use it)
_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?\Z")


# --- value parsers -------------------------------------------------------------------------------

def _endpoint_problem(text: str) -> str:
    """Why ``text`` is not a worker endpoint ``host:port`` ('' when it is)."""
    try:
        host, port = split_address(text)
    except ValueError:
        return f"expected a host:port address, got {text!r}"
    if port == 0:
        return f"{text!r}: port 0 names no worker (expected 1..{MAX_PORT})"
    try:
        ipaddress.ip_address(host)
        return ""
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if len(host) > 253 or not all(_LABEL.match(label) for label in labels):
        return f"{text!r}: {host!r} is neither an IP address nor a DNS name"
    return ""


def _parse_endpoints(value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise InvalidValue
    seen: dict[str, int] = {}
    for i, text in enumerate(value):
        if not isinstance(text, str):
            raise InvalidValue(f"expected a host:port address, got {show_value(text)}", f"[{i}]")
        problem = _endpoint_problem(text)
        if problem:
            raise InvalidValue(problem, f"[{i}]")
        if text in seen:
            raise InvalidValue(f"{text!r} is listed twice (also [{seen[text]}])", f"[{i}]")
        seen[text] = i
    return tuple(value)


def _parse_replicas(value: Any) -> int | str:
    if value == "all" or (is_int(value) and value >= 1):
        return value
    raise InvalidValue


_REPLICAS = "a positive integer or 'all'"


# --- the value objects ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class GatewayListenConfig:
    """The gateway's public addresses (YAML block ``listen:``), each ``"host:port"``.

    Attributes:
        grpc: KServe V2 gRPC for clients. Default ``0.0.0.0:8001``; in a node file, the node's
            ``listen.grpc``.
        metrics: health (``/healthz``, ``/readyz``) and Prometheus ``/metrics``. ``http`` is
            an alias (the node's ``listen:`` block calls this address ``http``). Default
            ``0.0.0.0:8002``; in a node file, the node's ``listen.http``.
        rest: the Open Inference Protocol over HTTP/1.1 (KServe V2 REST), answered by routing
            each request to a worker over gRPC. Default null (not served); in a node file, the
            node's ``listen.rest``.
    """

    # ``http`` is accepted as an alias of ``metrics``
    ALIASES: ClassVar[Mapping[str, Callable[..., Mapping[str, Any]]]]

    grpc: str = config_key("0.0.0.0:8001", parse=parse_listen_address, describe=_ADDRESS)
    metrics: str = config_key("0.0.0.0:8002", parse=parse_listen_address, describe=_ADDRESS)
    rest: str | None = config_key(None, parse=parse_listen_address, describe=_ADDRESS)


def _http_alias(value: Any, out: Mapping[str, Any], alias_path: str,
                path: str) -> Mapping[str, Any]:
    if "metrics" in out:
        raise ConfigError(f"{alias_path}: also set as {join_path(path, 'metrics')}; set one "
                          "(http is another name for metrics)")
    return {**out, "metrics": field_value(GatewayListenConfig, "metrics", value, alias_path, None)}


GatewayListenConfig.ALIASES = MappingProxyType({"http": _http_alias})


@dataclass(frozen=True, slots=True)
class GatewayGrpcConfig:
    """The gateway's gRPC server (YAML block ``grpc:``).

    Attributes:
        max_recv_msg_bytes: largest gRPC message accepted from a client, >= 1. Default 256 MiB.
        max_send_msg_bytes: largest gRPC message sent to a client, >= 1. Default 256 MiB.
        max_concurrent_requests_per_worker: the gateway accepts at most this many requests in
            flight times the number of workers, >= 0; one more is answered RESOURCE_EXHAUSTED.
            0 is uncapped. Default 64: above ``worker_client.max_concurrent_streams`` (32), so
            a burst waits at the gateway rather than being refused while workers catch up.
        client_shm_peers: the networks (CIDR strings) whose clients may use system shared
            memory through the gateway: the shared-memory RPCs, and ModelInfer naming a region,
            from any other peer are answered PERMISSION_DENIED naming the peer (a worker sees the
            gateway, not the client, so the gateway checks). Default ``[127.0.0.0/8, ::1/128]``:
            loopback only; in a node file, the node's ``endpoints.client_shm_peers``. Not
            settable from the environment.
    """

    max_recv_msg_bytes: int = config_key(256 * _MIB, low=1)
    max_send_msg_bytes: int = config_key(256 * _MIB, low=1)
    max_concurrent_requests_per_worker: int = config_key(64, low=0)
    client_shm_peers: tuple[IPNetwork, ...] = config_key(
        tuple(parse_network(n) for n in LOOPBACK_NETWORKS), parse=parse_networks, env=False,
        describe="a list of networks in CIDR notation")


@dataclass(frozen=True, slots=True)
class WorkerClientConfig:
    """How the gateway talks to each worker (YAML block ``worker_client:``).

    Attributes:
        request_timeout_seconds: longest the gateway waits for a worker's answer to one call,
            > 0; past it the call fails with DEADLINE_EXCEEDED (a client deadline that is
            sooner wins). Default 60.
        max_concurrent_streams: calls the gateway has in flight to one worker at once, >= 1;
            more wait at the gateway. Default 32. Keep a worker's
            ``endpoints.max_concurrent_requests`` (when set) above it.
        connect_timeout_seconds: longest a connection to a worker may take to open, > 0.
            Default 5.
    """

    request_timeout_seconds: float = config_key(60.0, low=0.0, low_open=True)
    max_concurrent_streams: int = config_key(32, low=1, high=2**31 - 1)
    connect_timeout_seconds: float = config_key(5.0, low=0.0, low_open=True)


@dataclass(frozen=True, slots=True)
class GatewayLoggingConfig:
    """The gateway's log (YAML block ``logging:``).

    Attributes:
        level: ``debug``, ``info``, ``warning`` or ``error``. Default ``info``.
        format: ``text`` (one line per record) or ``json`` (one JSON object per line).
            Default ``text``.
    """

    level: str = config_key("info", choices=("debug", "info", "warning", "error"))
    format: str = config_key("text", choices=("text", "json"))


@dataclass(frozen=True, slots=True)
class ModelReplicasConfig:
    """One model's entry under ``scheduling.models`` (``lpt_packing`` only).

    Attributes:
        replicas: how many distinct workers serve the model: a positive integer, capped at
            the number of workers, or ``all`` (every worker). Required.
    """

    replicas: int | str = config_key(parse=_parse_replicas, describe=_REPLICAS, env=False)


# the keys that only lpt_packing reads; another mode refuses them
LPT_PACKING_ONLY = ("default_replicas", "routing_fill_factor", "routing_policy",
                    "rebalance_compute_seconds", "models")


@dataclass(frozen=True, slots=True)
class SchedulingConfig:
    """Which worker serves each request (YAML block ``scheduling:``).

    Attributes:
        mode: ``round_robin`` (the workers that serve the model, in turn),
            ``least_outstanding`` (the one with the fewest of the gateway's requests in flight)
            or ``lpt_packing`` (the gateway places each model on ``replicas`` workers by its
            measured load, longest processing time first, and fills one replica's batch before
            the next). Default ``round_robin``.
        default_replicas: ``lpt_packing``: the replica count of a model without its own
            ``models.<name>.replicas``: a positive integer or ``all``. Default 1.
        routing_fill_factor: ``lpt_packing``: a replica takes a model's requests until this
            many times its largest compiled batch size are in flight, then the next replica
            does, > 0. Default 1.0.
        routing_policy: ``lpt_packing``: which replica a new batch opens on: ``fill_rr`` (in
            turn) or ``fill_least`` (the replica on the least loaded worker). Default
            ``fill_rr``.
        rebalance_compute_seconds: ``lpt_packing``: models are placed again after the workers
            have together measured this many seconds of device time since the last placement,
            > 0. Default 30: the worker's default ``ema_halflife_seconds``, so each placement
            sees costs and rates that half changed since the last one, while busy workers move
            weights at most every few seconds.
        models: ``lpt_packing``: per-model settings (:class:`ModelReplicasConfig`), keyed by
            model name. Default empty.

    The ``lpt_packing`` keys given with another mode are an error: ``round_robin`` and
    ``least_outstanding`` route across whichever workers serve a model and take no replica
    count.
    """

    mode: str = config_key("round_robin", choices=("round_robin", "least_outstanding", "lpt_packing"))
    default_replicas: int | str = config_key(1, parse=_parse_replicas, describe=_REPLICAS)
    routing_fill_factor: float = config_key(1.0, low=0.0, low_open=True)
    routing_policy: str = config_key("fill_rr", choices=("fill_rr", "fill_least"))
    rebalance_compute_seconds: float = config_key(30.0, low=0.0, low_open=True)
    models: Mapping[str, ModelReplicasConfig] = config_key(
        factory=lambda: MappingProxyType({}), env=False)

    def replicas_for(self, model: str) -> int | str:
        """The model's replica count: its own ``models.<model>.replicas``, else
        ``default_replicas``."""
        entry = self.models.get(model)
        return entry.replicas if entry is not None else self.default_replicas


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """A validated gateway configuration (a gateway file, or a node's ``gateway:`` block).

    Attributes:
        listen: the public addresses (:class:`GatewayListenConfig`).
        grpc: the gRPC server's limits (:class:`GatewayGrpcConfig`).
        worker_client: calls to workers (:class:`WorkerClientConfig`).
        logging: the log (:class:`GatewayLoggingConfig`).
        scheduling: routing and placement (:class:`SchedulingConfig`).
        tracing: OpenTelemetry tracing of the requests the gateway forwards
            (:class:`~xlaserve.config.schema.TracingConfig`; a node's gateway starts from the
            node's ``tracing:`` block).
        endpoints: the workers' gRPC addresses, ``"host:port"``; a host may be a DNS name that
            resolves to several addresses (each one a worker). A standalone gateway needs at
            least one. In a node file it is not a key: the node's workers are the endpoints.
        endpoint_refresh_seconds: how often DNS names among ``endpoints`` are resolved again,
            > 0. Default 10.
        metrics_endpoints: the workers' HTTP addresses, ``"host:port"``, whose ``/metrics``
            the gateway scrapes and serves again on its own with a ``worker`` label. Default
            empty. In a node file it is not a key: the node's workers are these.
        cpu_policy: the gateway process's Linux CPU scheduling policy: ``normal`` (the one
            it was started with, Linux's default) or ``batch`` (``SCHED_BATCH``: its wake-ups do
            not preempt what runs on its cores; it pays where clients share the gateway's
            cores, and costs a little where only workers do: docs/gateway.md, "CPU policy").
            Default ``normal``. A node's gateway runs in the supervisor's process, so the
            supervisor runs under it; its workers keep the node's own policy
            (:mod:`xlaserve.cpupolicy`).
    """

    listen: GatewayListenConfig = field(default_factory=GatewayListenConfig)
    grpc: GatewayGrpcConfig = field(default_factory=GatewayGrpcConfig)
    worker_client: WorkerClientConfig = field(default_factory=WorkerClientConfig)
    logging: GatewayLoggingConfig = field(default_factory=GatewayLoggingConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    endpoints: tuple[str, ...] = config_key(
        (), parse=_parse_endpoints, describe="a list of host:port addresses")
    endpoint_refresh_seconds: float = config_key(10.0, low=0.0, low_open=True)
    metrics_endpoints: tuple[str, ...] = config_key(
        (), parse=_parse_endpoints, describe="a list of host:port addresses")
    cpu_policy: str = config_key("normal", choices=("normal", "batch"))


_SECTIONS: dict[str, type] = {"listen": GatewayListenConfig, "grpc": GatewayGrpcConfig,
                              "worker_client": WorkerClientConfig,
                              "logging": GatewayLoggingConfig, "scheduling": SchedulingConfig,
                              "tracing": TracingConfig}
_TOP_FIELDS = ("endpoints", "endpoint_refresh_seconds", "metrics_endpoints", "cpu_policy")
_WORKER_ADDRESSES = ("endpoints", "metrics_endpoints")


# --- environment overrides -----------------------------------------------------------------------

@functools.cache
def _env_table() -> dict[str, tuple[str, type, str]]:
    """Variable name -> (section, dataclass, field); section '' is the top level."""
    table: dict[str, tuple[str, type, str]] = {}
    sections: list[tuple[str, type, tuple[str, ...] | None]] = [("", GatewayConfig, _TOP_FIELDS)]
    sections += [(name, cls, None) for name, cls in _SECTIONS.items()]
    for section, cls, only in sections:
        for name, (_, rule, _) in field_specs(cls).items():
            if rule.env and (only is None or name in only):
                prefix = f"{section.upper()}_" if section else ""
                table[f"{GATEWAY_ENV_PREFIX}{prefix}{name.upper()}"] = (section, cls, name)
    return table


def gateway_environment_variables() -> list[str]:
    """Every ``INFERENCE_SERVER_GATEWAY_*`` variable the gateway understands, sorted."""
    return sorted(_env_table())


@dataclass(frozen=True, slots=True)
class _Overrides:
    """Validated values by section ('' the top level), and where each came from."""

    values: Mapping[str, Mapping[str, Any]]
    origin: Mapping[tuple[str, str], str]


def _parse_environ(environ: Mapping[str, str], embedded: bool) -> _Overrides:
    values: dict[str, dict[str, Any]] = {"": {}, **{s: {} for s in _SECTIONS}}
    origin: dict[tuple[str, str], str] = {}
    table = _env_table()
    for var in sorted(environ):
        if not var.startswith(GATEWAY_ENV_PREFIX):
            continue
        if var not in table:
            raise ConfigError(f"{var}: unknown variable (known: "
                              f"{', '.join(gateway_environment_variables())})")
        section, cls, name = table[var]
        if embedded and not section and name in _WORKER_ADDRESSES:
            raise ConfigError(f"{var}: a node's gateway fronts the node's own workers; "
                              f"{name} applies only to a standalone gateway")
        hint, rule, _ = field_specs(cls)[name]
        text = environ[var]
        if name in _WORKER_ADDRESSES:
            # host:port addresses hold colons: the list is comma- or space-separated
            value: Any = [part for part in re.split(r"[,\s]+", text) if part]
        elif rule.parse is _parse_replicas:
            value = int(text) if text.strip().isdigit() else text.strip()
        else:
            value = from_env_text(hint, text)
        values[section][name] = convert_value(hint, rule, value, var, None)
        origin[(section, name)] = var
    return _Overrides(values, origin)


# --- parsing -------------------------------------------------------------------------------------

def _scheduling(base: SchedulingConfig, raw: Any, path: str, env: _Overrides) -> SchedulingConfig:
    written = dict(parse_partial(SchedulingConfig, raw, path, None))
    models = written.pop("models", None)
    scheduling = merge_partial(merge_partial(base, written), env.values["scheduling"])
    if models is not None:
        entries = {}
        for model, keys in models.items():
            if "replicas" not in keys:
                raise ConfigError(f"{path}.models.{model}.replicas: required (a model's entry "
                                  "sets its replica count)")
            entries[model] = ModelReplicasConfig(**keys)
        scheduling = dataclasses.replace(scheduling, models=MappingProxyType(entries))
        written["models"] = models
    if scheduling.mode != "lpt_packing":
        mode_origin = env.origin.get(("scheduling", "mode"), join_path(path, "mode"))
        for key in LPT_PACKING_ONLY:
            if key in written or key in env.values["scheduling"]:
                where = env.origin.get(("scheduling", key), join_path(path, key))
                raise ConfigError(
                    f"{where}: applies only to mode lpt_packing ({mode_origin} is "
                    f"{scheduling.mode}; round_robin and least_outstanding route across the "
                    "workers that serve a model and take no replica count)")
    return scheduling


def _parse(data: Any, prefix: str, environ: Mapping[str, str] | None, embedded: bool,
           base: GatewayConfig) -> tuple[GatewayConfig, Mapping[str, str]]:
    """``base`` with the keys of ``data`` (a gateway file or block) and then the environment's
    applied, and the origin of each listen address (for messages)."""
    env = _parse_environ(environ or {}, embedded)
    where = prefix or "gateway file"
    if data is not None and not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {show_value(data)}")
    top = as_mapping(data, where)
    if embedded:
        for key in _WORKER_ADDRESSES:
            if key in top:
                raise ConfigError(f"{join_path(prefix, key)}: not a key of a node's gateway: block "
                                  "(its endpoints are the node's workers); it applies only to a "
                                  "standalone gateway")
    reject_unknown(top, {*_SECTIONS, *_TOP_FIELDS} - (set(_WORKER_ADDRESSES) if embedded else set()),
                   prefix)
    changes: dict[str, Any] = {}
    for section, cls in _SECTIONS.items():
        path = join_path(prefix, section)
        if section == "scheduling":
            changes[section] = _scheduling(base.scheduling, top.get(section), path, env)
            continue
        written = parse_partial(cls, top.get(section), path, None)
        changes[section] = merge_partial(merge_partial(getattr(base, section), written), env.values[section])
    for key in _TOP_FIELDS:
        if key in top:
            changes[key] = field_value(GatewayConfig, key, top[key], join_path(prefix, key), None)
    changes.update(env.values[""])
    check_tracing(changes["tracing"], join_path(prefix, "tracing"))
    listen = as_mapping(top.get("listen"), join_path(prefix, "listen"))
    origins = {}
    for key, alias in (("grpc", None), ("metrics", "http"), ("rest", None)):
        written_as = key if key in listen else alias if alias in listen else None
        origins[key] = env.origin.get(("listen", key)) or \
            (join_path(prefix, f"listen.{written_as}") if written_as else "")
    return dataclasses.replace(base, **changes), MappingProxyType(origins)


def parse_gateway_config(data: Any, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """Validate an already-parsed standalone gateway file (``data``) into a
    :class:`GatewayConfig`, with ``INFERENCE_SERVER_GATEWAY_*`` overrides from ``environ``
    (None: none). ``endpoints`` must end up non-empty."""
    config, _ = _parse(data, "", environ, False, GatewayConfig())
    if not config.endpoints:
        raise ConfigError(f"endpoints: required: a standalone gateway needs a non-empty list of "
                          f"worker host:port addresses (or {GATEWAY_ENV_PREFIX}ENDPOINTS)")
    return config


def load_gateway_file(path: str | Path, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """Read and validate a standalone gateway's file (what ``xlaserve gateway FILE`` serves).

    ``environ`` supplies ``INFERENCE_SERVER_GATEWAY_*`` overrides; pass ``os.environ`` to honour
    the process environment. None means no overrides. A mistake in the file is a ConfigError
    starting with the file's name; one in a variable starts with the variable's.
    """
    return load_yaml_file(Path(path), "gateway file", lambda data: parse_gateway_config(data, environ))


# --- the embedded gateway ------------------------------------------------------------------------

def _node_base(node: NodeConfig) -> GatewayConfig:
    return GatewayConfig(listen=GatewayListenConfig(grpc=node.listen.grpc, metrics=node.listen.http,
                                                    rest=node.listen.rest),
                         grpc=GatewayGrpcConfig(client_shm_peers=node.endpoints.client_shm_peers),
                         tracing=node.tracing)


def check_node_gateway(node: NodeConfig, environ: Mapping[str, str] | None) -> None:
    """Validate ``node.gateway`` and the ``INFERENCE_SERVER_GATEWAY_*`` variables of
    ``environ``: what the node file's loader calls, so that a mistake stops any command that
    reads the node, with the key path ``gateway.xxx`` or the variable's name."""
    _parse(node.gateway, "gateway", environ, True, _node_base(node))


NODE_CHECKS.append(check_node_gateway)


def _connect_host(host: str) -> str:
    """Where to reach a worker bound to ``host``: a wildcard bind is reached on loopback."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if address.is_unspecified:
        return "::1" if address.version == 6 else "127.0.0.1"
    return host


def embedded_gateway_config(node: NodeConfig, environ: Mapping[str, str] | None = None,
                            worker_count: int | None = None) -> GatewayConfig:
    """The configuration of the gateway that fronts ``node``'s workers.

    Built in this order, each later step winning key by key: built-in defaults; the node's
    ``listen:`` addresses (already with ``INFERENCE_SERVER_LISTEN_*`` applied) as the gateway's
    ``listen.grpc`` and ``listen.metrics``; the node file's ``gateway:`` block; then
    ``INFERENCE_SERVER_GATEWAY_*`` variables from ``environ`` (None: none).

    ``endpoints`` are the workers' gRPC addresses and ``metrics_endpoints`` their HTTP ones, in
    worker order, as :func:`~xlaserve.config.resolve_worker` binds them (a worker bound to a
    wildcard such as ``0.0.0.0`` is reached on loopback). ``worker_count`` is as in
    ``resolve_worker``: pass the count ``gpus: auto`` detected; by default it follows the node
    file. A node of one worker has no gateway (its worker serves ``listen:`` itself): a
    ConfigError. So is a gateway address whose port a worker also binds.
    """
    config, origins = _parse(node.gateway, "gateway", environ, True, _node_base(node))
    count = worker_count if worker_count is not None else _node_worker_count(node)
    if count < 2:
        raise ConfigError("gateway: a node of one worker has no gateway (its worker serves the "
                          "listen: addresses itself)")
    workers = [resolve_worker(node, i, count) for i in range(count)]
    used: dict[int, str] = {}
    for key, address, node_key in (("grpc", config.listen.grpc, "listen.grpc"),
                                   ("metrics", config.listen.metrics, "listen.http"),
                                   ("rest", config.listen.rest, "listen.rest")):
        if address is None:
            continue
        port = split_address(address)[1]
        origin = origins[key] or node_key
        if port and port in used:
            raise ConfigError(f"{origin}: port {port} for the gateway's {key} is already used "
                              f"by {used[port]}")
        for worker in workers:
            for what, bound in (("gRPC", worker.grpc_port), ("HTTP", worker.http_port)):
                if port and port == bound:
                    raise ConfigError(f"{origin}: port {port} for the gateway's {key} is "
                                      f"already used by worker {worker.name}'s {what}")
        used[port] = f"the gateway's {key} ({origin})"
    return dataclasses.replace(
        config,
        endpoints=tuple(join_address(_connect_host(w.grpc_host), w.grpc_port) for w in workers),
        metrics_endpoints=tuple(join_address(_connect_host(w.http_host), w.http_port)
                                for w in workers))
