"""The node file: one typed YAML file that describes a machine's workers.

A node file names one shared model repository, the defaults every worker runs with (``global:``),
optionally one entry per worker (``workers:``) whose blocks merge over those defaults, an optional
pin map (``models:``), the node's public addresses (``listen:``) and the embedded gateway's
settings (``gateway:``, kept raw and validated by the gateway).

Reading it is two steps, both pure:

- :func:`load_node_config` / :func:`parse_node_config` validate the whole file into a
  :class:`NodeConfig`. Every mistake is a :class:`ConfigError` whose message starts with the key
  path (``global.scheduler.max_queue_depth: expected a positive integer, got 'abc'``).
- :func:`resolve_worker` turns a node into the :class:`WorkerConfig` one worker process runs with:
  global blocks, then the worker's own blocks, then the pin map, then environment overrides.

Environment overrides (``INFERENCE_SERVER_<SECTION>_<FIELD>``) are read from the mapping the caller
passes (the CLI passes ``os.environ``); passing nothing means no overrides, which keeps tests
independent of the shell they run in.

The value objects are frozen and slotted; mappings inside them are read-only. Each key's meaning
and default is documented on the class that holds it; ``docs/node-config.md`` is written from these
docstrings.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from types import MappingProxyType, NoneType, UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml

__all__ = [
    "ENV_PREFIX",
    "ConfigError",
    "EndpointsConfig",
    "ListenConfig",
    "ModelSchedConfig",
    "NodeConfig",
    "RuntimeConfig",
    "SchedulerConfig",
    "WorkerConfig",
    "WorkerEntry",
    "effective_config_lines",
    "environment_variables",
    "load_node_config",
    "parse_node_config",
    "resolve_worker",
    "split_address",
    "to_plain",
]

ENV_PREFIX = "INFERENCE_SERVER_"
MAX_PORT = 65535
_MIB = 1024 * 1024


class ConfigError(Exception):
    """The node file or an ``INFERENCE_SERVER_*`` variable is invalid.

    The message starts with where the mistake is (a key path such as ``workers[1].name`` or a
    variable name) and says what was expected.
    """


# --- validation rules, attached to dataclass fields ----------------------------------------------

class _Invalid(Exception):
    """Raised by a custom field parser; the generic code turns it into a ConfigError."""


@dataclass(frozen=True, slots=True)
class _Rule:
    choices: tuple[str, ...] = ()
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    # A custom parser for values the type alone cannot describe; raises _Invalid.
    parse: Callable[[Any], Any] | None = None
    describe: str = ""
    # False for fields an environment variable may not set.
    env: bool = True


def _key(default: Any = MISSING, *, factory: Any = MISSING, **rule: Any) -> Any:
    return field(default=default, default_factory=factory, metadata={"rule": _Rule(**rule)})


_PORT = {"low": 0, "high": MAX_PORT}
_BASE_PORT = {"low": 1, "high": MAX_PORT}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")


def _parse_name(value: Any) -> str:
    if isinstance(value, str) and _NAME.match(value):
        return value
    raise _Invalid


def split_address(text: str) -> tuple[str, int]:
    """Split ``"host:port"`` (``"[::]:8001"`` for IPv6) into host and port; ValueError if bad."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or int(port) > MAX_PORT:
        raise ValueError(f"not a host:port address: {text!r}")
    return host, int(port)


def _join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _parse_address(value: Any) -> str:
    if not isinstance(value, str):
        raise _Invalid
    try:
        split_address(value)
    except ValueError:
        raise _Invalid from None
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
    raise _Invalid


# --- the value objects ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """How a worker drives its device (YAML block ``runtime:``).

    Attributes:
        backend: ``cpu`` or ``cuda``. Default ``cpu``. ``cpu`` is for development, tests and
            fallback; ``cuda`` needs the ``xlaserve[cuda]`` extra.
        mem_fraction: fraction of device memory claimed for the memory pool, in (0, 1].
            Default 0.9. GPU only.
        preallocate: claim the pool up front rather than growing it. Default true. GPU only.
        allow_cpu_fallback: when ``cuda`` is asked for but no GPU can be used, run on the CPU
            instead of failing to start. Default false: a GPU node that silently runs on the CPU
            is worse than one that refuses to start.
        weight_cache_fraction: fraction of the device arena the weight cache may fill with
            weights (pinned and on-demand), in [0, 1]. Default 1.0 (the whole arena, self-sized).
            0 disables on-demand loading: every model's weights stay resident.
        weight_cache_wiggle_fraction: fraction of the arena kept free for activations and
            compiler scratch, in [0, 1). Default 0.1.
        device_memory_bytes: size of the arena the weight budget is computed from on the ``cpu``
            backend, in bytes. Default 0, meaning the machine's total RAM. Set it to simulate a
            small accelerator on the CPU.
    """

    backend: str = _key("cpu", choices=("cpu", "cuda"))
    mem_fraction: float = _key(0.9, low=0.0, low_open=True, high=1.0)
    preallocate: bool = _key(True)
    allow_cpu_fallback: bool = _key(False)
    weight_cache_fraction: float = _key(1.0, low=0.0, high=1.0)
    weight_cache_wiggle_fraction: float = _key(0.1, low=0.0, high=1.0, high_open=True)
    device_memory_bytes: int = _key(0, low=0)


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

    weight: float = _key(1.0, low=0.0, low_open=True)
    residency: str = _key("system", choices=("device", "system", "unpinned"))
    max_batch_size: int | None = _key(None, low=1)
    batch_delay_seconds: float = _key(0.0, low=0.0)
    batch_target_rows: int | None = _key(None, low=1)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How a worker shares its device between models (YAML block ``scheduler:``).

    Attributes:
        discipline: ``fair`` (weighted deficit by learned cost), ``fifo`` (oldest request
            first) or ``edf`` (earliest deadline first; sheds work that cannot finish in time).
            Default ``fair``. Behind a gateway in ``lpt_packing`` mode use ``fifo`` or ``edf``.
        ema_halflife_seconds: half-life of the moving average that learns each model's
            execution cost, > 0. Default 30.0.
        max_queue_depth: per-model queue cap, >= 1; a full model rejects new requests with
            RESOURCE_EXHAUSTED. Default 1024.
        dispatch_timeout_seconds: longest a request may wait in a queue when it carries no
            deadline of its own, > 0. Default 30.0.
        compaction_interval: defragment device memory every N on-demand weight loads; 0 (the
            default) disables. Leave 0 behind a gateway.
        models: per-model overrides (:class:`ModelSchedConfig`), keyed by model name. Default
            empty: every model runs with the defaults.
    """

    discipline: str = _key("fair", choices=("fair", "fifo", "edf"))
    ema_halflife_seconds: float = _key(30.0, low=0.0, low_open=True)
    max_queue_depth: int = _key(1024, low=1)
    dispatch_timeout_seconds: float = _key(30.0, low=0.0, low_open=True)
    compaction_interval: int = _key(0, low=0)
    models: Mapping[str, ModelSchedConfig] = _key(factory=lambda: MappingProxyType({}),
                                                  env=False)

    def for_model(self, name: str) -> ModelSchedConfig:
        """The model's override, or the defaults when it has none."""
        return self.models.get(name) or ModelSchedConfig()


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
    """

    host: str = _key("0.0.0.0")
    port: int | None = _key(None, **_PORT)
    max_concurrent_requests: int = _key(0, low=0)
    allow_client_shm: bool = _key(False)
    max_recv_msg_bytes: int = _key(256 * _MIB, low=1)
    max_send_msg_bytes: int = _key(256 * _MIB, low=1)
    max_connection_buffer_bytes: int = _key(1024 * _MIB, low=1)
    max_held_request_bytes: int = _key(2048 * _MIB, low=1)


@dataclass(frozen=True, slots=True)
class ListenConfig:
    """The node's public addresses (YAML top-level block ``listen:``), each ``"host:port"``.

    A one-worker node's worker binds them itself; with two or more workers the embedded gateway
    binds them.

    Attributes:
        grpc: KServe V2 gRPC. Default ``0.0.0.0:8001``.
        http: health (``/healthz``, ``/readyz``) and Prometheus ``/metrics``. Default
            ``0.0.0.0:8002``.
    """

    grpc: str = _key("0.0.0.0:8001", parse=_parse_address, describe="a host:port address")
    http: str = _key("0.0.0.0:8002", parse=_parse_address, describe="a host:port address")


@dataclass(frozen=True, slots=True)
class WorkerEntry:
    """One entry of ``workers:``, as written (override blocks validated but not yet merged).

    Attributes:
        name: the worker's identity in logs, metrics and the pin map; letters, digits, ``_``,
            ``.``, ``-``. Required.
        port: explicit gRPC port (the same as ``endpoints: {port: ...}`` in this entry).
        gpu: device ordinal this worker uses, >= 0. Default null: the supervisor assigns one
            (or takes it from a ``gpus:`` list); a bare worker uses ordinal 0.
        runtime, scheduler, endpoints: the keys this worker sets in those blocks (a read-only
            mapping of key to value; ``scheduler["models"]`` maps model name to its keys). They
            merge over ``global:`` key by key, and per model for ``scheduler.models``.
        models_include: this worker's allowlist, replacing ``global.models_include``; null
            (the default) keeps the global one.
    """

    name: str = _key(parse=_parse_name,
                     describe="a name of letters, digits, '_', '.' and '-'")
    port: int | None = _key(None, **_PORT)
    gpu: int | None = _key(None, low=0)
    runtime: Mapping[str, Any] = _key(factory=lambda: MappingProxyType({}))
    scheduler: Mapping[str, Any] = _key(factory=lambda: MappingProxyType({}))
    endpoints: Mapping[str, Any] = _key(factory=lambda: MappingProxyType({}))
    models_include: tuple[str, ...] | None = _key(None)


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
        gpus: ``auto`` (one worker per detected GPU, one CPU worker where there is none), a
            count N, or a list of device ordinals. Used by the supervisor when ``workers:`` is
            omitted. Default ``auto``.
        cache_dir: (``global.cache_dir``) where compiled executables are cached across
            restarts; null disables the cache. Default ``~/.cache/xlaserve``. Relative paths
            resolve like ``model_repo``.
        model_control_mode: (``global.``) ``dynamic`` watches the repository and loads,
            reloads and unloads bundles as files change; ``static`` loads the startup set once;
            ``explicit`` acts only on control RPCs. Default ``dynamic``.
        model_poll_seconds: (``global.``) repository poll interval in ``dynamic`` mode when
            file events are unavailable, > 0. Default 15.0.
        models_include: (``global.``) allowlist of model names to load; empty (the default)
            loads every bundle in the repository.
        runtime, scheduler, endpoints: the ``global:`` blocks, with environment overrides
            applied.
        workers: the ``workers:`` entries; when omitted, one implicit worker ``worker0``.
        workers_explicit: whether ``workers:`` was written; when false, the supervisor may
            synthesize ``worker0``, ``worker1``, ... from ``gpus``.
        models: the pin map: model name to the workers that keep it resident on the device
            (``residency: device``). Default empty.
        gateway: the ``gateway:`` block, kept as written; the gateway validates it.
        listen: the node's public addresses.
        env_overrides: the ``INFERENCE_SERVER_*`` overrides, by section (``node``, ``listen``,
            ``runtime``, ``scheduler``, ``endpoints``); already applied to the fields above, and
            applied again on top of each worker's blocks by :func:`resolve_worker`.
    """

    model_repo: Path
    base_port: int = _key(9001, **_BASE_PORT)
    metrics_base_port: int = _key(9101, **_BASE_PORT)
    gpus: str | int | tuple[int, ...] = _key(
        "auto", parse=_parse_gpus, env=False,
        describe="'auto', a positive integer or a list of distinct device ordinals")
    cache_dir: Path | None = field(default_factory=_default_cache_dir)
    model_control_mode: str = _key("dynamic", choices=("dynamic", "static", "explicit"))
    model_poll_seconds: float = _key(15.0, low=0.0, low_open=True)
    models_include: tuple[str, ...] = _key(())
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    endpoints: EndpointsConfig = field(default_factory=EndpointsConfig)
    workers: tuple[WorkerEntry, ...] = field(default_factory=lambda: (WorkerEntry("worker0"),))
    workers_explicit: bool = False
    models: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    gateway: Mapping[str, Any] | None = None
    listen: ListenConfig = field(default_factory=ListenConfig)
    env_overrides: Mapping[str, Mapping[str, Any]] = field(
        default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """What one worker process runs with, fully resolved (see :func:`resolve_worker`).

    ``index`` is the worker's position in the node and ``worker_count`` the node's number of
    workers (two or more means an embedded gateway fronts them). ``gpu`` is null when the
    supervisor assigns the device. ``grpc_*`` and ``http_*`` are the addresses to bind.
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

    @property
    def grpc_address(self) -> str:
        return _join_address(self.grpc_host, self.grpc_port)


# --- the generic field parser --------------------------------------------------------------------

@functools.cache
def _field_specs(cls: type) -> dict[str, tuple[Any, _Rule, bool]]:
    """name -> (type hint, rule, required) for each field of a config dataclass."""
    hints = get_type_hints(cls)
    return {
        f.name: (hints[f.name], f.metadata.get("rule", _Rule()),
                 f.default is MISSING and f.default_factory is MISSING)
        for f in fields(cls)
    }


def _optional_inner(hint: Any) -> Any | None:
    if get_origin(hint) in (Union, UnionType) and NoneType in get_args(hint):
        (inner,) = (a for a in get_args(hint) if a is not NoneType)
        return inner
    return None


def _bound(value: float) -> str:
    return f"{value:g}"


def _expected(hint: Any, rule: _Rule) -> str:
    inner = _optional_inner(hint)
    if inner is not None:
        return f"{_expected(inner, rule)} or null"
    if rule.describe:
        return rule.describe
    if rule.choices:
        return "one of " + ", ".join(rule.choices)
    if hint is bool:
        return "true or false"
    if hint in (int, float):
        noun = "integer" if hint is int else "number"
        article = "an" if hint is int else "a"
        if rule.high is None and rule.low == 0:
            return f"a {'positive' if rule.low_open else 'non-negative'} {noun}"
        if rule.high is None and rule.low == 1 and hint is int:
            return "a positive integer"
        if rule.low is None and rule.high is None:
            return f"{article} {noun}"
        if hint is int:
            return f"an integer in [{rule.low}, {rule.high}]"
        return (f"a number in {'(' if rule.low_open else '['}{_bound(rule.low)}, "
                f"{_bound(rule.high)}{')' if rule.high_open else ']'}")
    if hint is Path:
        return "a path"
    if get_origin(hint) is tuple:
        return "a list of names"
    if get_origin(hint) is Mapping:
        return "a mapping of model name to settings"
    return "a non-empty string"


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (dict, Mapping)):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    return repr(value)


def _in_range(value: float, rule: _Rule) -> bool:
    if rule.low is not None and not (value > rule.low if rule.low_open else value >= rule.low):
        return False
    return rule.high is None or (value < rule.high if rule.high_open else value <= rule.high)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _convert(hint: Any, rule: _Rule, value: Any, path: str, base_dir: Path | None,
             described: Any = None) -> Any:
    """Validate one YAML value against a field's type and rule; ``base_dir`` anchors paths.

    ``described`` is the hint the error message describes (the field's own, optional included).
    """
    def fail() -> ConfigError:
        expected = _expected(described or hint, rule)
        return ConfigError(f"{path}: expected {expected}, got {_show(value)}")

    inner = _optional_inner(hint)
    if inner is not None:
        return None if value is None else _convert(inner, rule, value, path, base_dir, hint)
    if rule.parse is not None:
        try:
            return rule.parse(value)
        except _Invalid:
            raise fail() from None
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if _is_int(value) and _in_range(value, rule):
            return value
    elif hint is float:
        if (_is_int(value) or isinstance(value, float)) and math.isfinite(value) \
                and _in_range(value, rule):
            return float(value)
    elif hint is str:
        if isinstance(value, str) and value and (not rule.choices or value in rule.choices):
            return value
    elif hint is Path:
        if isinstance(value, str) and value:
            resolved = Path(value).expanduser()
            if base_dir is None:
                return resolved.absolute()
            return base_dir / resolved
    elif get_origin(hint) is tuple:
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) and v for v in value):
            return tuple(value)
    elif get_origin(hint) is Mapping:
        if isinstance(value, Mapping):
            nested = get_args(hint)[1]
            out = {}
            for name, sub in value.items():
                if not isinstance(name, str) or not name:
                    raise ConfigError(f"{path}: keys must be model names, got {_show(name)}")
                out[name] = _parse_partial(nested, sub, f"{path}.{name}", base_dir)
            return MappingProxyType(out)
    else:  # pragma: no cover - a field type this parser does not know is a bug here
        raise TypeError(f"no parser for {hint!r}")
    raise fail()


def _value(cls: type, name: str, value: Any, path: str, base_dir: Path | None) -> Any:
    hint, rule, _ = _field_specs(cls)[name]
    return _convert(hint, rule, value, path, base_dir)


def _mapping(raw: Any, path: str) -> Mapping[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {_show(raw)}")
    for key in raw:
        if not isinstance(key, str):
            raise ConfigError(f"{path}: keys must be strings, got {_show(key)}")
    return raw


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _reject_unknown(raw: Mapping[str, Any], known: set[str] | frozenset[str], path: str) -> None:
    for key in raw:
        if key not in known:
            raise ConfigError(
                f"{_join(path, key)}: unknown key (known: {', '.join(sorted(known))})")


# Keys accepted in a block beyond its dataclass fields, each mapped to a field it sets.
_ALIASES: dict[type, frozenset[str]] = {ModelSchedConfig: frozenset({"pin_to_gpu"})}


def _parse_partial(cls: type, raw: Any, path: str,
                   base_dir: Path | None) -> Mapping[str, Any]:
    """Validate the keys a block sets, without filling in defaults (so blocks can merge)."""
    raw = _mapping(raw, path)
    _reject_unknown(raw, set(_field_specs(cls)) | _ALIASES.get(cls, frozenset()), path)
    out = {key: _value(cls, key, value, _join(path, key), base_dir)
           for key, value in raw.items() if key in _field_specs(cls)}
    if cls is ModelSchedConfig and "pin_to_gpu" in raw:
        pin = raw["pin_to_gpu"]
        pin_path = _join(path, "pin_to_gpu")
        if not isinstance(pin, bool):
            raise ConfigError(f"{pin_path}: expected true or false, got {_show(pin)}")
        if "residency" in out and (out["residency"] == "device") != pin:
            raise ConfigError(
                f"{pin_path}: contradicts {_join(path, 'residency')}: {out['residency']}; "
                "set only residency")
        if pin:
            out["residency"] = "device"
    return MappingProxyType(out)


def _merge(base: Any, partial: Mapping[str, Any]) -> Any:
    """``base`` with the keys of ``partial`` set; mapping-of-block fields merge per entry."""
    if not partial:
        return base
    changes = {}
    for name, value in partial.items():
        hint = _field_specs(type(base))[name][0]
        if get_origin(hint) is Mapping and dataclasses.is_dataclass(get_args(hint)[1]):
            nested = get_args(hint)[1]
            merged = dict(getattr(base, name))
            for key, sub in value.items():
                merged[key] = _merge(merged.get(key) or nested(), sub)
            value = MappingProxyType(merged)
        changes[name] = value
    return dataclasses.replace(base, **changes)


# --- environment overrides -----------------------------------------------------------------------

_BLOCKS: dict[str, type] = {"runtime": RuntimeConfig, "scheduler": SchedulerConfig,
                            "endpoints": EndpointsConfig}
_NODE_ENV_FIELDS = ("model_repo", "base_port", "metrics_base_port", "cache_dir",
                    "model_control_mode", "model_poll_seconds", "models_include")
_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


@functools.cache
def _env_table() -> dict[str, tuple[str, type, str]]:
    """Variable name -> (section, dataclass, field) for every supported override."""
    table: dict[str, tuple[str, type, str]] = {}
    sections = [("node", NodeConfig, _NODE_ENV_FIELDS), ("listen", ListenConfig, None)]
    sections += [(name, cls, None) for name, cls in _BLOCKS.items()]
    for section, cls, only in sections:
        for name, (_, rule, _) in _field_specs(cls).items():
            if rule.env and (only is None or name in only):
                prefix = "" if section == "node" else f"{section.upper()}_"
                table[f"{ENV_PREFIX}{prefix}{name.upper()}"] = (section, cls, name)
    return table


def environment_variables() -> list[str]:
    """Every ``INFERENCE_SERVER_*`` variable the node config understands, sorted."""
    return sorted([*_env_table(), f"{ENV_PREFIX}MODEL_DIRS"])


def _from_text(hint: Any, text: str) -> Any:
    """An environment variable's text as the YAML value it stands for (validated afterwards)."""
    inner = _optional_inner(hint)
    if inner is not None:
        return None if text.strip().lower() in ("", "null", "none") else _from_text(inner, text)
    if hint is bool:
        lowered = text.strip().lower()
        return True if lowered in _TRUE else False if lowered in _FALSE else text
    try:
        if hint is int:
            return int(text.strip())
        if hint is float:
            return float(text.strip())
    except ValueError:
        return text
    if get_origin(hint) is tuple:
        return [part for part in text.split(":") if part]
    return text


def _parse_environ(environ: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """The ``INFERENCE_SERVER_*`` variables of ``environ``, as validated values by section."""
    out: dict[str, dict[str, Any]] = {"node": {}, "listen": {}, **{s: {} for s in _BLOCKS}}
    table = _env_table()
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX):
            continue
        text = environ[var]
        if var == f"{ENV_PREFIX}MODEL_DIRS":
            dirs = [part for part in text.split(":") if part]
            if len(dirs) != 1:
                raise ConfigError(
                    f"{var}: expected exactly one directory (xlaserve serves one model "
                    f"repository), got {len(dirs)}")
            if f"{ENV_PREFIX}MODEL_REPO" in environ:
                raise ConfigError(f"{var}: conflicts with {ENV_PREFIX}MODEL_REPO; set one")
            out["node"]["model_repo"] = Path(dirs[0]).expanduser().absolute()
            continue
        if var not in table:
            raise ConfigError(
                f"{var}: unknown variable (known: {', '.join(environment_variables())})")
        section, cls, name = table[var]
        hint, rule, _ = _field_specs(cls)[name]
        value = _from_text(hint, text)
        if hint is bool and not isinstance(value, bool):
            raise ConfigError(
                f"{var}: expected one of true, false, 1, 0, yes, no, got {text!r}")
        out[section][name] = _convert(hint, rule, value, var, None)
    return out


# --- the node file -------------------------------------------------------------------------------

_TOP_KEYS = frozenset({"model_repo", "base_port", "metrics_base_port", "gpus", "global",
                       "workers", "models", "gateway", "listen"})
_GLOBAL_SCALARS = ("cache_dir", "model_control_mode", "model_poll_seconds", "models_include")
_GLOBAL_KEYS = frozenset({*_GLOBAL_SCALARS, *_BLOCKS})
_IMPLICIT_WORKER = re.compile(r"worker(0|[1-9][0-9]*)\Z")


class _NodeLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys instead of keeping the last one silently."""


def _construct_mapping(loader: _NodeLoader, node: yaml.MappingNode,
                       deep: bool = False) -> dict[Any, Any]:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, str) and key in seen:
            raise ConfigError(
                f"line {key_node.start_mark.line + 1}: duplicate key {key!r}")
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_NodeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_node_config(path: str | Path, environ: Mapping[str, str] | None = None) -> NodeConfig:
    """Read and validate a node file. Relative paths in it resolve against its directory.

    ``environ`` supplies ``INFERENCE_SERVER_*`` overrides; pass ``os.environ`` to honour the
    process environment. None means no overrides.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the node file: {error.strerror}") from None
    try:
        data = yaml.load(text, Loader=_NodeLoader)  # a SafeLoader subclass
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    return parse_node_config(data, path.absolute().parent, environ)


def parse_node_config(data: Any, base_dir: str | Path,
                      environ: Mapping[str, str] | None = None) -> NodeConfig:
    """Validate an already-parsed node file (``data``) into a :class:`NodeConfig`.

    ``base_dir`` anchors relative paths (the node file's directory). ``environ`` as in
    :func:`load_node_config`.
    """
    base_dir = Path(base_dir)
    env = _parse_environ(environ or {})
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"node file: expected a mapping at the top level, got {_show(data)}")
    top = _mapping(data, "node file")
    _reject_unknown(top, _TOP_KEYS, "")
    node_fields: dict[str, Any] = {
        key: _value(NodeConfig, key, top[key], key, base_dir)
        for key in ("model_repo", "base_port", "metrics_base_port", "gpus") if key in top}

    global_block = _mapping(top.get("global"), "global")
    _reject_unknown(global_block, _GLOBAL_KEYS, "global")
    for key in _GLOBAL_SCALARS:
        if key in global_block:
            node_fields[key] = _value(NodeConfig, key, global_block[key], f"global.{key}",
                                      base_dir)
    for section, cls in _BLOCKS.items():
        written = _parse_partial(cls, global_block.get(section), f"global.{section}", base_dir)
        node_fields[section] = _merge(_merge(cls(), written), env[section])
    listen = _parse_partial(ListenConfig, top.get("listen"), "listen", base_dir)
    node_fields["listen"] = _merge(_merge(ListenConfig(), listen), env["listen"])
    node_fields.update(env["node"])
    if "model_repo" not in node_fields:
        raise ConfigError(
            f"model_repo: missing (set it in the node file or {ENV_PREFIX}MODEL_REPO)")

    if "workers" in top:
        node_fields["workers"] = _parse_workers(top["workers"], base_dir)
        node_fields["workers_explicit"] = True
    gpus = node_fields.get("gpus", "auto")
    node_fields["models"] = _parse_pins(top.get("models"), node_fields.get("workers"), gpus)
    if top.get("gateway") is not None:
        node_fields["gateway"] = MappingProxyType(dict(_mapping(top["gateway"], "gateway")))
    node_fields["env_overrides"] = MappingProxyType(
        {section: MappingProxyType(values) for section, values in env.items()})
    node = NodeConfig(**node_fields)
    _check_ports(node, _worker_entries(node, None))
    return node


def _parse_workers(raw: Any, base_dir: Path) -> tuple[WorkerEntry, ...]:
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"workers: expected a non-empty list of worker entries, got "
                          f"{_show(raw)}")
    entries: list[WorkerEntry] = []
    seen: dict[str, int] = {}
    for index, item in enumerate(raw):
        path = f"workers[{index}]"
        item = _mapping(item, path)
        _reject_unknown(item, set(_field_specs(WorkerEntry)), path)
        values: dict[str, Any] = {}
        for key, value in item.items():
            cls = _BLOCKS.get(key)
            if cls is not None:
                values[key] = _parse_partial(cls, value, f"{path}.{key}", base_dir)
            else:
                values[key] = _value(WorkerEntry, key, value, f"{path}.{key}", base_dir)
        for key, (_, _, required) in _field_specs(WorkerEntry).items():
            if required and key not in values:
                raise ConfigError(f"{path}.{key}: missing")
        name = values["name"]
        if name in seen:
            raise ConfigError(
                f"{path}.name: duplicate worker name {name!r} (also workers[{seen[name]}])")
        seen[name] = index
        if values.get("port") is not None:
            endpoints = dict(values.get("endpoints", {}))
            if "port" in endpoints:
                raise ConfigError(f"{path}.port: also set as {path}.endpoints.port; set one")
            endpoints["port"] = values["port"]
            values["endpoints"] = MappingProxyType(endpoints)
        entries.append(WorkerEntry(**values))
    return tuple(entries)


def _implicit_count(gpus: str | int | tuple[int, ...]) -> int | None:
    if gpus == "auto":
        return None
    return gpus if isinstance(gpus, int) else len(gpus)


def _parse_pins(raw: Any, workers: tuple[WorkerEntry, ...] | None,
                gpus: str | int | tuple[int, ...]) -> Mapping[str, tuple[str, ...]]:
    pins = {}
    for model, listed in _mapping(raw, "models").items():
        path = f"models.{model}"
        if not isinstance(listed, list) or not all(isinstance(w, str) for w in listed):
            raise ConfigError(f"{path}: expected a list of worker names, got {_show(listed)}")
        for position, worker in enumerate(listed):
            problem = _unknown_worker(worker, workers, _implicit_count(gpus))
            if problem:
                raise ConfigError(f"{path}[{position}]: {problem}")
        pins[model] = tuple(dict.fromkeys(listed))
    return MappingProxyType(pins)


def _unknown_worker(worker: str, workers: tuple[WorkerEntry, ...] | None,
                    implicit_count: int | None) -> str:
    """Why ``worker`` names no worker of the node ('' when it does)."""
    if workers is not None:
        names = [w.name for w in workers]
        return "" if worker in names else \
            f"unknown worker {worker!r} (workers: {', '.join(names)})"
    match = _IMPLICIT_WORKER.match(worker)
    if match and (implicit_count is None or int(match.group(1)) < implicit_count):
        return ""
    known = "worker0, worker1, ..." if implicit_count is None else \
        ", ".join(f"worker{i}" for i in range(implicit_count))
    return (f"unknown worker {worker!r} (workers: {known}; without a workers: list they are "
            "named after their index)")


# --- one worker ----------------------------------------------------------------------------------

def _worker_entries(node: NodeConfig, worker_count: int | None) -> tuple[WorkerEntry, ...]:
    if node.workers_explicit:
        if worker_count is not None and worker_count != len(node.workers):
            raise ConfigError(
                f"workers: the node file lists {len(node.workers)} workers but "
                f"{worker_count} were asked for; an explicit workers: list fixes the count")
        return node.workers
    count = worker_count if worker_count is not None else _implicit_count(node.gpus) or 1
    if not _is_int(count) or count < 1:
        raise ConfigError(f"worker count: expected a positive integer, got {_show(count)}")
    return tuple(WorkerEntry(f"worker{i}") for i in range(count))


def worker_count(node: NodeConfig) -> int:
    """How many workers the node runs: its ``workers:`` list, else one per ``gpus`` entry (a
    count or a list of ordinals), else one."""
    return len(_worker_entries(node, None))


def _endpoints_for(node: NodeConfig, entry: WorkerEntry) -> EndpointsConfig:
    return _merge(_merge(node.endpoints, entry.endpoints),
                  node.env_overrides.get("endpoints", {}))


@dataclass(frozen=True, slots=True)
class _Binding:
    grpc_host: str
    grpc_port: int
    grpc_origin: str
    http_host: str
    http_port: int
    http_origin: str


def _binding(node: NodeConfig, entries: tuple[WorkerEntry, ...], index: int) -> _Binding:
    """Where worker ``index`` listens, and which key each port came from (for errors)."""
    entry = entries[index]
    endpoints = _endpoints_for(node, entry)
    if "port" in node.env_overrides.get("endpoints", {}):
        origin = f"{ENV_PREFIX}ENDPOINTS_PORT"
    elif "port" in entry.endpoints:
        origin = f"workers[{index}].port" if entry.port is not None else \
            f"workers[{index}].endpoints.port"
    else:
        origin = "global.endpoints.port"
    if len(entries) == 1:
        listen_host, listen_port = split_address(node.listen.grpc)
        http_host, http_port = split_address(node.listen.http)
        if endpoints.port is not None:
            return _Binding(endpoints.host, endpoints.port, origin,
                            http_host, http_port, "listen.http")
        return _Binding(listen_host, listen_port, "listen.grpc",
                        http_host, http_port, "listen.http")
    if endpoints.port is None:
        port, origin = node.base_port + index, f"base_port + {index}"
        if port > MAX_PORT:
            raise ConfigError(f"base_port: worker {index} would get port {port} > {MAX_PORT}")
    else:
        port = endpoints.port
    http_port = node.metrics_base_port + index
    if http_port > MAX_PORT:
        raise ConfigError(
            f"metrics_base_port: worker {index} would get port {http_port} > {MAX_PORT}")
    return _Binding(endpoints.host, port, origin, endpoints.host, http_port,
                    f"metrics_base_port + {index}")


def _check_ports(node: NodeConfig, entries: tuple[WorkerEntry, ...]) -> None:
    """Every port the node binds is distinct (0, any free port, never collides)."""
    used: dict[int, str] = {}

    def claim(port: int, what: str, origin: str) -> None:
        if port == 0:
            return
        if port in used:
            raise ConfigError(f"{origin}: port {port} for {what} is already used by {used[port]}")
        used[port] = f"{what} ({origin})"

    if len(entries) > 1:
        claim(split_address(node.listen.grpc)[1], "the gateway's gRPC", "listen.grpc")
        claim(split_address(node.listen.http)[1], "the gateway's HTTP", "listen.http")
    for index, entry in enumerate(entries):
        binding = _binding(node, entries, index)
        claim(binding.grpc_port, f"worker {entry.name}'s gRPC", binding.grpc_origin)
        claim(binding.http_port, f"worker {entry.name}'s HTTP", binding.http_origin)


def resolve_worker(node: NodeConfig, which: int | str = 0,
                   worker_count: int | None = None) -> WorkerConfig:
    """The configuration worker ``which`` (an index or a name) runs with.

    ``worker_count`` is how many workers the supervisor runs when ``workers:`` is omitted
    (workers are then named ``worker0``, ``worker1``, ...); by default it follows ``gpus``
    (a count or a list) or is 1 for ``gpus: auto``. With an explicit ``workers:`` list it must
    be None or that list's length.

    Blocks resolve in this order, each key of a later step winning: built-in defaults, the
    ``global:`` block, the worker entry's block, the ``models:`` pin map (a model pinned on this
    worker gets ``residency: device``), then ``INFERENCE_SERVER_*`` overrides.

    Ports: a one-worker node's worker binds ``listen.grpc`` and ``listen.http`` itself (an
    explicit ``port`` moves its gRPC endpoint to ``endpoints.host:port``). With two or more
    workers, worker i binds gRPC on ``endpoints.host:(port or base_port + i)`` and HTTP on
    ``endpoints.host:metrics_base_port + i``, and the gateway binds the ``listen`` addresses.
    Any two equal ports are a ConfigError.
    """
    entries = _worker_entries(node, worker_count)
    names = [entry.name for entry in entries]
    if isinstance(which, str):
        if which not in names:
            raise ConfigError(f"worker {which!r}: no such worker (workers: {', '.join(names)})")
        index = names.index(which)
    elif _is_int(which) and 0 <= which < len(entries):
        index = which
    else:
        raise ConfigError(f"worker {_show(which)}: no such worker (the node has "
                          f"{len(entries)} worker{'s' if len(entries) != 1 else ''})")
    if not node.workers_explicit:
        for model, pinned in node.models.items():
            for position, worker in enumerate(pinned):
                problem = _unknown_worker(worker, None, len(entries))
                if problem:
                    raise ConfigError(f"models.{model}[{position}]: {problem}")
    _check_ports(node, entries)

    entry = entries[index]
    env = node.env_overrides
    scheduler = _merge(node.scheduler, entry.scheduler)
    pinned_here = {model: {"residency": "device"}
                   for model, workers in node.models.items() if entry.name in workers}
    scheduler = _merge(_merge(scheduler, {"models": pinned_here} if pinned_here else {}),
                       env.get("scheduler", {}))
    models_include = node.models_include
    if entry.models_include is not None and "models_include" not in env.get("node", {}):
        models_include = entry.models_include
    gpu = entry.gpu
    if gpu is None and isinstance(node.gpus, tuple) and index < len(node.gpus):
        gpu = node.gpus[index]
    binding = _binding(node, entries, index)
    return WorkerConfig(
        name=entry.name,
        index=index,
        worker_count=len(entries),
        model_repo=node.model_repo,
        cache_dir=node.cache_dir,
        model_control_mode=node.model_control_mode,
        model_poll_seconds=node.model_poll_seconds,
        models_include=models_include,
        runtime=_merge(_merge(node.runtime, entry.runtime), env.get("runtime", {})),
        scheduler=scheduler,
        endpoints=_endpoints_for(node, entry),
        gpu=gpu,
        grpc_host=binding.grpc_host,
        grpc_port=binding.grpc_port,
        http_host=binding.http_host,
        http_port=binding.http_port,
    )


# --- logging the effective configuration ---------------------------------------------------------

def to_plain(obj: Any) -> Any:
    """A config value as plain YAML/JSON data (dicts, lists, strings, numbers, null)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, Mapping):
        return {str(key): to_plain(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(value) for value in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def effective_config_lines(obj: Any) -> list[str]:
    """``obj`` (usually a :class:`WorkerConfig`) as YAML lines, for logging at start-up."""
    return yaml.safe_dump(to_plain(obj), sort_keys=False, default_flow_style=False).splitlines()
