"""Node resolution: environment overrides, the node file, workers, ports, one worker's settings.

Reading a node file is two steps, both pure:

- :func:`load_node_config` / :func:`parse_node_config` validate the whole file into a
  :class:`~xlaserve.config.schema.NodeConfig`. Every mistake is a :class:`ConfigError` whose
  message starts with the key path.
- :func:`resolve_worker` turns a node into the :class:`~xlaserve.config.schema.WorkerConfig` one
  worker process runs with: global blocks, then the worker's own blocks, then the pin map, then
  environment overrides.

Environment overrides (``INFERENCE_SERVER_<SECTION>_<FIELD>``) are read from the mapping the caller
passes (the CLI passes ``os.environ``); passing nothing means no overrides, which keeps tests
independent of the shell they run in.
"""
from __future__ import annotations

import dataclasses
import functools
import ipaddress
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, get_origin

import yaml

from xlaserve.bounded import expansion_problem
from xlaserve.config.fields import (ConfigError, convert_value, field_specs, is_int, optional_inner,
                                    as_mapping, merge_partial, parse_partial, reject_unknown, show_value,
                                    field_value)
from xlaserve.config.schema import (MAX_PORT, EndpointsConfig, ListenConfig, LoggingConfig,
                                    NodeConfig, RuntimeConfig, SchedulerConfig, SupervisorConfig,
                                    TracingConfig, WorkerConfig, WorkerEntry, check_tracing,
                                    split_address)

ENV_PREFIX = "INFERENCE_SERVER_"
GATEWAY_ENV_PREFIX = f"{ENV_PREFIX}GATEWAY_"


# --- environment overrides -----------------------------------------------------------------------

_BLOCKS: dict[str, type] = {"runtime": RuntimeConfig, "scheduler": SchedulerConfig,
                            "endpoints": EndpointsConfig}
_NODE_ENV_FIELDS = ("model_repo", "base_port", "metrics_base_port", "cache_dir", "cache_max_bytes",
                    "model_control_mode", "model_poll_seconds", "model_import_timeout_seconds", "models_include")
# Top-level blocks read whole by the node (never per worker), like ``listen:``.
_NODE_BLOCKS: dict[str, type] = {"listen": ListenConfig, "supervisor": SupervisorConfig,
                                 "logging": LoggingConfig, "tracing": TracingConfig}
_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


@functools.cache
def _env_table() -> dict[str, tuple[str, type, str]]:
    """Variable name -> (section, dataclass, field) for every supported override."""
    table: dict[str, tuple[str, type, str]] = {}
    sections = [("node", NodeConfig, _NODE_ENV_FIELDS)]
    sections += [(name, cls, None) for name, cls in _NODE_BLOCKS.items()]
    sections += [(name, cls, None) for name, cls in _BLOCKS.items()]
    for section, cls, only in sections:
        for name, (_, rule, _) in field_specs(cls).items():
            if rule.env and (only is None or name in only):
                prefix = "" if section == "node" else f"{section.upper()}_"
                table[f"{ENV_PREFIX}{prefix}{name.upper()}"] = (section, cls, name)
    return table


def environment_variables() -> list[str]:
    """Every ``INFERENCE_SERVER_*`` variable the node config understands, sorted."""
    return sorted([*_env_table(), f"{ENV_PREFIX}MODEL_DIRS"])


def from_env_text(hint: Any, text: str) -> Any:
    """An environment variable's text as the YAML value it stands for (validated afterwards)."""
    inner = optional_inner(hint)
    if inner is not None:
        return None if text.strip().lower() in ("", "null", "none") else from_env_text(inner, text)
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
    out: dict[str, dict[str, Any]] = {"node": {}, **{s: {} for s in _NODE_BLOCKS},
                                      **{s: {} for s in _BLOCKS}}
    table = _env_table()
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX) or var.startswith(GATEWAY_ENV_PREFIX):
            continue  # INFERENCE_SERVER_GATEWAY_*: the gateway's (xlaserve.config.gateway)
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
        hint, rule, _ = field_specs(cls)[name]
        value = from_env_text(hint, text)
        if hint is bool and not isinstance(value, bool):
            raise ConfigError(
                f"{var}: expected one of true, false, 1, 0, yes, no, got {text!r}")
        out[section][name] = convert_value(hint, rule, value, var, None)
    return out


# --- the node file -------------------------------------------------------------------------------

_TOP_KEYS = frozenset({"model_repo", "base_port", "metrics_base_port", "gpus", "global",
                       "workers", "models", "gateway", *_NODE_BLOCKS})
_GLOBAL_SCALARS = ("cache_dir", "cache_max_bytes", "model_control_mode", "model_poll_seconds", "model_import_timeout_seconds",
                   "models_include")
_GLOBAL_KEYS = frozenset({*_GLOBAL_SCALARS, *_BLOCKS})
_IMPLICIT_WORKER = re.compile(r"worker(0|[1-9][0-9]*)\Z")


class _DuplicateKey(ConfigError):
    """A key written twice in one mapping (YAML would silently keep the last)."""


class _NodeLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys instead of keeping the last one silently."""


def _construct_mapping(loader: _NodeLoader, node: yaml.MappingNode,
                       deep: bool = False) -> dict[Any, Any]:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, str) and key in seen:
            mark = key_node.start_mark
            raise _DuplicateKey(f"{mark.line + 1}:{mark.column + 1}: duplicate key {key!r}")
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_NodeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_node_config(path: str | Path, environ: Mapping[str, str] | None = None) -> NodeConfig:
    """Read and validate a node file. Relative paths in it resolve against its directory.

    ``environ`` supplies ``INFERENCE_SERVER_*`` overrides; pass ``os.environ`` to honour the
    process environment. None means no overrides.
    """
    path = Path(path)
    return load_yaml_file(path, "node file", lambda data: parse_node_config(data, path.absolute().parent, environ))


def load_yaml_file(path: Path, what: str, parse: Callable[[Any], Any]) -> Any:
    """``parse`` of the YAML in ``path`` (duplicate keys refused). A mistake in the file is a
    ConfigError starting with the file's name (``what`` names the kind of file when it cannot be
    read); one in an ``INFERENCE_SERVER_*`` variable starts with the variable's."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the {what}: {error.strerror}") from None
    try:
        data = yaml.load(text, Loader=_NodeLoader)  # a SafeLoader subclass
    except _DuplicateKey as error:
        raise ConfigError(f"{path}:{error}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}:{_yaml_problem(error)}") from None
    except RecursionError:
        raise ConfigError(f"{path}: lists or mappings are nested too deeply to be read") from None
    problem = expansion_problem(data)
    if problem is not None:
        raise ConfigError(f"{path}: cannot be read: {problem}")
    try:
        return parse(data)
    except ConfigError as error:
        if str(error).startswith(ENV_PREFIX):  # about a variable, not about the file
            raise
        raise ConfigError(f"{path}: {error}") from None


def _yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML syntax error as ``LINE:COLUMN: not valid YAML: what (while what)``, one line."""
    mark = getattr(error, "problem_mark", None)
    where = f"{mark.line + 1}:{mark.column + 1}:" if mark is not None else ""
    problem = getattr(error, "problem", None) or str(error)
    context = getattr(error, "context", None)
    text = f"{problem} ({context})" if context else problem
    return f"{where} not valid YAML: {' '.join(text.split())}"


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
        raise ConfigError(f"node file: expected a mapping at the top level, got {show_value(data)}")
    top = as_mapping(data, "node file")
    reject_unknown(top, _TOP_KEYS, "")
    node_fields: dict[str, Any] = {
        key: field_value(NodeConfig, key, top[key], key, base_dir)
        for key in ("model_repo", "base_port", "metrics_base_port", "gpus") if key in top}

    global_block = as_mapping(top.get("global"), "global")
    reject_unknown(global_block, _GLOBAL_KEYS, "global")
    for key in _GLOBAL_SCALARS:
        if key in global_block:
            node_fields[key] = field_value(NodeConfig, key, global_block[key], f"global.{key}",
                                           base_dir)
    for section, cls in _BLOCKS.items():
        written = parse_partial(cls, global_block.get(section), f"global.{section}", base_dir)
        node_fields[section] = merge_partial(merge_partial(cls(), written), env[section])
    for section, cls in _NODE_BLOCKS.items():
        written = parse_partial(cls, top.get(section), section, base_dir)
        node_fields[section] = merge_partial(merge_partial(cls(), written), env[section])
    _check_supervisor(node_fields["supervisor"])
    check_tracing(node_fields["tracing"])
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
        node_fields["gateway"] = MappingProxyType(dict(as_mapping(top["gateway"], "gateway")))
    node_fields["env_overrides"] = MappingProxyType(
        {section: MappingProxyType(values) for section, values in env.items()})
    node = NodeConfig(**node_fields)
    entries = _worker_entries(node, None)
    _check_ports(node, entries)
    _check_devices(node, entries)
    for check in NODE_CHECKS:
        check(node, environ)
    return node


#: Checks every parsed node passes too, ``check(node, environ)`` raising ConfigError. The
#: gateway's schema adds its own (xlaserve.config.gateway builds on this module, so this module
#: does not import it; importing xlaserve.config registers it).
NODE_CHECKS: list = []


def _check_supervisor(supervisor: SupervisorConfig) -> None:
    """The rules between ``supervisor:`` keys that no single key's bounds can say."""
    if supervisor.restart_backoff_max_seconds < supervisor.restart_backoff_initial_seconds:
        raise ConfigError(
            f"supervisor.restart_backoff_max_seconds: {supervisor.restart_backoff_max_seconds:g} is "
            f"less than supervisor.restart_backoff_initial_seconds "
            f"({supervisor.restart_backoff_initial_seconds:g}); expected a cap at least as long as "
            "the first back-off")


def _parse_workers(raw: Any, base_dir: Path) -> tuple[WorkerEntry, ...]:
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"workers: expected a non-empty list of worker entries, got "
                          f"{show_value(raw)}")
    entries: list[WorkerEntry] = []
    seen: dict[str, int] = {}
    for index, item in enumerate(raw):
        path = f"workers[{index}]"
        item = as_mapping(item, path)
        reject_unknown(item, set(field_specs(WorkerEntry)), path)
        values: dict[str, Any] = {}
        for key, value in item.items():
            cls = _BLOCKS.get(key)
            if cls is not None:
                values[key] = parse_partial(cls, value, f"{path}.{key}", base_dir)
            else:
                values[key] = field_value(WorkerEntry, key, value, f"{path}.{key}", base_dir)
        for key, (_, _, required) in field_specs(WorkerEntry).items():
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
    for model, listed in as_mapping(raw, "models").items():
        path = f"models.{model}"
        if not isinstance(listed, list) or not all(isinstance(w, str) for w in listed):
            raise ConfigError(f"{path}: expected a list of worker names, got {show_value(listed)}")
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
    if not is_int(count) or count < 1:
        raise ConfigError(f"worker count: expected a positive integer, got {show_value(count)}")
    return tuple(WorkerEntry(f"worker{i}") for i in range(count))


def worker_count(node: NodeConfig) -> int:
    """How many workers the node runs: its ``workers:`` list, else one per ``gpus`` entry (a
    count or a list of ordinals), else one."""
    return len(_worker_entries(node, None))


def _endpoints_for(node: NodeConfig, entry: WorkerEntry) -> EndpointsConfig:
    return merge_partial(merge_partial(node.endpoints, entry.endpoints),
                         node.env_overrides.get("endpoints", {}))


@dataclass(frozen=True, slots=True)
class _Binding:
    grpc_host: str
    grpc_port: int
    grpc_origin: str
    http_host: str
    http_port: int
    http_origin: str
    rest_host: str | None = None
    rest_port: int | None = None


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
        rest_host, rest_port = split_address(node.listen.rest) if node.listen.rest else (None, None)
        if endpoints.port is not None:
            return _Binding(endpoints.host, endpoints.port, origin,
                            http_host, http_port, "listen.http", rest_host, rest_port)
        return _Binding(listen_host, listen_port, "listen.grpc",
                        http_host, http_port, "listen.http", rest_host, rest_port)
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
        if node.listen.rest:
            claim(split_address(node.listen.rest)[1], "the gateway's REST", "listen.rest")
    for index, entry in enumerate(entries):
        binding = _binding(node, entries, index)
        claim(binding.grpc_port, f"worker {entry.name}'s gRPC", binding.grpc_origin)
        claim(binding.http_port, f"worker {entry.name}'s HTTP", binding.http_origin)
        if binding.rest_port is not None:
            claim(binding.rest_port, f"worker {entry.name}'s REST", "listen.rest")


def _named_device(node: NodeConfig, entry: WorkerEntry, index: int) -> tuple[int, str] | None:
    """The GPU ordinal the node file names for worker ``index`` and the key that names it (its
    ``gpu:``, else its entry of a ``gpus:`` list); None when nothing does, and the worker then
    uses the ordinal equal to its index (:attr:`~xlaserve.config.schema.WorkerConfig.device_ordinal`)."""
    if entry.gpu is not None:
        return entry.gpu, f"workers[{index}].gpu"
    if isinstance(node.gpus, tuple) and index < len(node.gpus):
        return node.gpus[index], f"gpus[{index}]"
    return None


def _check_devices(node: NodeConfig, entries: tuple[WorkerEntry, ...]) -> None:
    """No two ``cuda`` workers use the same GPU. Each sizes its allocator's pool and its weight
    budget from the whole device (``runtime.mem_fraction``), so two on one GPU claim nearly twice
    its memory and fail with out-of-memory errors while serving, far from the cause; refused here
    instead. A worker's GPU is its ``gpu:``, else its entry of a ``gpus:`` list, else its index
    (what the supervisor and a worker run on its own use). ``cpu`` workers use no GPU and are
    not counted, whatever ordinal they name."""
    used: dict[int, str] = {}
    runtime_env = node.env_overrides.get("runtime", {})
    for index, entry in enumerate(entries):
        backend = merge_partial(merge_partial(node.runtime, entry.runtime), runtime_env).backend
        if backend != "cuda":
            continue
        named = _named_device(node, entry, index)
        if named is not None:
            ordinal, origin = named
            what = f"GPU {ordinal}"
        else:
            ordinal, origin = index, f"workers[{index}]"
            what = f"GPU {ordinal} (its index: it sets no gpu:)"
        if ordinal in used:
            raise ConfigError(
                f"{origin}: {what} for cuda worker {entry.name} is already used by {used[ordinal]}; "
                "two workers on one GPU would each claim its memory (runtime.mem_fraction) and fail "
                "with out-of-memory errors while serving: give each cuda worker a GPU of its own")
        used[ordinal] = f"cuda worker {entry.name} ({origin})"


def resolve_worker(node: NodeConfig, which: int | str = 0,
                   worker_count: int | None = None) -> WorkerConfig:
    """The configuration worker ``which`` (an index or a name) runs with.

    ``worker_count`` is how many workers the node has when ``workers:`` is omitted (workers
    are then named ``worker0``, ``worker1``, ...); by default it follows ``gpus`` (a count or
    a list) or is 1 for ``gpus: auto``. With an explicit ``workers:`` list it must
    be None or that list's length.

    Blocks resolve in this order, each key of a later step winning: built-in defaults, the
    ``global:`` block, the worker entry's block, the ``models:`` pin map (a model pinned on this
    worker gets ``residency: device``), then ``INFERENCE_SERVER_*`` overrides.

    Ports: a one-worker node's worker binds ``listen.grpc`` and ``listen.http`` itself (an
    explicit ``port`` moves its gRPC endpoint to ``endpoints.host:port``). With two or more
    workers, worker i binds gRPC on ``endpoints.host:(port or base_port + i)`` and HTTP on
    ``endpoints.host:metrics_base_port + i``; the ``listen`` addresses are then the embedded
    gateway's, bound by no worker, and checked with the rest. Any two equal ports are a
    ConfigError.
    """
    entries = _worker_entries(node, worker_count)
    names = [entry.name for entry in entries]
    if isinstance(which, str):
        if which not in names:
            raise ConfigError(f"worker {which!r}: no such worker (workers: {', '.join(names)})")
        index = names.index(which)
    elif is_int(which) and 0 <= which < len(entries):
        index = which
    else:
        raise ConfigError(f"worker {show_value(which)}: no such worker (the node has "
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
    scheduler = merge_partial(node.scheduler, entry.scheduler)
    pinned_here = {model: {"residency": "device"}
                   for model, workers in node.models.items() if entry.name in workers}
    scheduler = merge_partial(merge_partial(scheduler, {"models": pinned_here} if pinned_here else {}),
                              env.get("scheduler", {}))
    models_include = node.models_include
    if entry.models_include is not None and "models_include" not in env.get("node", {}):
        models_include = entry.models_include
    named = _named_device(node, entry, index)
    gpu = named[0] if named is not None else None
    binding = _binding(node, entries, index)
    return WorkerConfig(
        name=entry.name,
        index=index,
        worker_count=len(entries),
        model_repo=node.model_repo,
        cache_dir=node.cache_dir,
        model_control_mode=node.model_control_mode,
        model_poll_seconds=node.model_poll_seconds,
        model_import_timeout_seconds=node.model_import_timeout_seconds,
        cache_max_bytes=node.cache_max_bytes,
        models_include=models_include,
        runtime=merge_partial(merge_partial(node.runtime, entry.runtime), env.get("runtime", {})),
        scheduler=scheduler,
        endpoints=_endpoints_for(node, entry),
        gpu=gpu,
        grpc_host=binding.grpc_host,
        grpc_port=binding.grpc_port,
        http_host=binding.http_host,
        http_port=binding.http_port,
        tracing=node.tracing,
        rest_host=binding.rest_host,
        rest_port=binding.rest_port,
    )


# --- logging the effective configuration ---------------------------------------------------------

def to_plain(obj: Any) -> Any:
    """A config value as plain YAML/JSON data (dicts, lists, strings, numbers, null)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: "<redacted>" if f.metadata.get("secret") else to_plain(getattr(obj, f.name))
                for f in fields(obj)}
    if isinstance(obj, Mapping):
        return {str(key): to_plain(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(value) for value in obj]
    if isinstance(obj, (Path, ipaddress.IPv4Network, ipaddress.IPv6Network)):
        return str(obj)
    return obj


def effective_config_lines(obj: Any) -> list[str]:
    """``obj`` (usually a :class:`WorkerConfig`) as YAML lines, for logging at start-up."""
    return yaml.safe_dump(to_plain(obj), sort_keys=False, default_flow_style=False).splitlines()
