"""The node file: one typed YAML file that describes a machine's workers.

A node file names one shared model repository, the defaults every worker runs with (``global:``),
optionally one entry per worker (``workers:``) whose blocks merge over those defaults, an optional
pin map (``models:``), the node's public addresses (``listen:``), how a multi-worker node's
supervisor restarts and stops its workers (``supervisor:``), the log level and format
(``logging:``), OpenTelemetry tracing (``tracing:``) and the ``gateway:`` block of the gateway that fronts a multi-worker node.

Five modules, one idea each:

- :mod:`~xlaserve.config.schema`: the documented keys, as frozen dataclasses (a key's meaning
  and default is on the class that holds it);
- :mod:`~xlaserve.config.fields`: generic validation of one value against its key's type and
  bounds, and the wording of every error;
- :mod:`~xlaserve.config.resolve`: environment overrides, reading the node file, workers, ports,
  and the settings one worker runs with;
- :mod:`~xlaserve.config.gateway`: the gateway's schema, its standalone file and the node's
  ``gateway:`` block;
- :mod:`~xlaserve.config.access`: the tables the access keys are checked against (API groups,
  header rules, networks), which the frontend enforces; the schema imports no frontend module.

The value objects are frozen and slotted; mappings inside them are read-only.
"""
from xlaserve.config.fields import ConfigError
from xlaserve.config.gateway import (GatewayConfig, embedded_gateway_config,
                                     gateway_environment_variables, load_gateway_file,
                                     parse_gateway_config)
from xlaserve.config.resolve import (ENV_PREFIX, effective_config_lines, environment_variables,
                                     load_node_config, parse_node_config, resolve_worker,
                                     to_plain, worker_count)
from xlaserve.config.schema import (EndpointsConfig, ListenConfig, LoggingConfig,
                                    ModelSchedConfig, NodeConfig, RuntimeConfig, SchedulerConfig,
                                    SupervisorConfig, TlsConfig, TracingConfig, WorkerConfig,
                                    WorkerEntry, split_address)

__all__ = [
    "ENV_PREFIX",
    "ConfigError",
    "EndpointsConfig",
    "GatewayConfig",
    "ListenConfig",
    "LoggingConfig",
    "ModelSchedConfig",
    "NodeConfig",
    "RuntimeConfig",
    "SchedulerConfig",
    "SupervisorConfig",
    "TlsConfig",
    "TracingConfig",
    "WorkerConfig",
    "WorkerEntry",
    "effective_config_lines",
    "embedded_gateway_config",
    "environment_variables",
    "gateway_environment_variables",
    "load_gateway_file",
    "load_node_config",
    "parse_gateway_config",
    "parse_node_config",
    "resolve_worker",
    "split_address",
    "to_plain",
    "worker_count",
]
