"""The gateway's configuration (xlaserve.config.gateway) and DNS endpoints
(xlaserve.gateway.endpoints): the standalone file, the node's gateway: block, environment
overrides, error messages; resolving, diffing and following endpoints under Trio's MockClock."""
from __future__ import annotations

import logging
import re
import socket
from pathlib import Path

import pytest
import trio
import yaml
from trio.testing import MockClock

from xlaserve.config import (ConfigError, GatewayConfig, effective_config_lines,
                             embedded_gateway_config, environment_variables, gateway_environment_variables,
                             load_gateway_file, load_node_config, parse_gateway_config,
                             parse_node_config)
from xlaserve.config.gateway import (GatewayGrpcConfig, GatewayListenConfig, GatewayLoggingConfig,
                                     ModelReplicasConfig, SchedulingConfig, WorkerClientConfig)
from xlaserve.gateway.endpoints import (Endpoint, EndpointsChanged, ResolveError, diff, follow, unique,
                                        resolve)

BASE = Path("/srv/node")
MIB = 1024 * 1024


def gateway(data: dict, environ: dict[str, str] | None = None) -> GatewayConfig:
    return parse_gateway_config({"endpoints": ["w0:9001"], **data}, environ)


def gateway_error(data: dict, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        gateway(data, environ)
    return str(caught.value)


def node(data: dict, environ: dict[str, str] | None = None):
    return parse_node_config({"model_repo": "models", **data}, BASE, environ)


def node_error(data: dict, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        node(data, environ)
    return str(caught.value)


# --- the schema ----------------------------------------------------------------------------------

def test_defaults_match_the_documented_values():
    config = GatewayConfig()
    assert config.listen == GatewayListenConfig("0.0.0.0:8001", "0.0.0.0:8002")
    assert config.grpc == GatewayGrpcConfig(256 * MIB, 256 * MIB, 64)
    assert config.worker_client == WorkerClientConfig(60.0, 32, 5.0)
    assert config.logging == GatewayLoggingConfig("info", "text")
    assert config.scheduling == SchedulingConfig(
        mode="round_robin", default_replicas=1, routing_fill_factor=1.0,
        routing_policy="fill_rr", rebalance_compute_seconds=30.0)
    assert dict(config.scheduling.models) == {}
    assert (config.endpoints, config.endpoint_refresh_seconds, config.metrics_endpoints) == \
        ((), 10.0, ())
    assert config.cpu_policy == "normal"


FULL = """\
listen:
  grpc: "127.0.0.1:7001"
  metrics: "[::1]:7002"
grpc:
  max_recv_msg_bytes: 1048576
  max_send_msg_bytes: 2097152
  max_concurrent_requests_per_worker: 0
worker_client:
  request_timeout_seconds: 2.5
  max_concurrent_streams: 4
  connect_timeout_seconds: 1
logging:
  level: debug
  format: json
scheduling:
  mode: lpt_packing
  default_replicas: all
  routing_fill_factor: 1.5
  routing_policy: fill_least
  rebalance_compute_seconds: 12
  models:
    resnet50: {replicas: 2}
    vit: {replicas: all}
endpoints:
  - "worker-svc.ns.svc.cluster.local:9001"
  - "10.0.0.5:9001"
  - "[fd00::7]:9001"
endpoint_refresh_seconds: 2
metrics_endpoints: ["worker-svc:9101"]
cpu_policy: batch
"""


def test_a_full_gateway_file_loads_every_key(tmp_path: Path):
    path = tmp_path / "gateway.yaml"
    path.write_text(FULL)
    config = load_gateway_file(path)
    assert config.listen == GatewayListenConfig("127.0.0.1:7001", "[::1]:7002")
    assert config.grpc == GatewayGrpcConfig(MIB, 2 * MIB, 0)
    assert config.worker_client == WorkerClientConfig(2.5, 4, 1.0)
    assert isinstance(config.worker_client.connect_timeout_seconds, float)
    assert config.logging == GatewayLoggingConfig("debug", "json")
    scheduling = config.scheduling
    assert (scheduling.mode, scheduling.default_replicas, scheduling.routing_fill_factor,
            scheduling.routing_policy, scheduling.rebalance_compute_seconds) == \
        ("lpt_packing", "all", 1.5, "fill_least", 12.0)
    assert dict(scheduling.models) == {"resnet50": ModelReplicasConfig(2),
                                       "vit": ModelReplicasConfig("all")}
    assert config.endpoints == ("worker-svc.ns.svc.cluster.local:9001", "10.0.0.5:9001",
                                "[fd00::7]:9001")
    assert config.endpoint_refresh_seconds == 2.0
    assert config.metrics_endpoints == ("worker-svc:9101",)
    assert config.cpu_policy == "batch"


def test_the_seeds_gateway_file_loads(tmp_path: Path):
    # node-configuration.txt's gateway.yml, as written there
    path = tmp_path / "gateway.yml"
    path.write_text("""\
listen:
  grpc: "0.0.0.0:8001"
  metrics: "0.0.0.0:8002"
grpc:
  max_recv_msg_bytes: 268435456   # 256 MiB
  max_send_msg_bytes: 268435456
  max_concurrent_requests_per_worker: 64
worker_client:
  request_timeout_seconds: 60
  max_concurrent_streams: 32
logging:
  level: "info"
  format: "json"
scheduling:
  mode: round_robin
endpoints:
  - "worker0:8080"
  - "worker1:8081"
""")
    config = load_gateway_file(path)
    assert config.endpoints == ("worker0:8080", "worker1:8081")
    assert config.logging.format == "json"
    assert config.grpc == GatewayGrpcConfig()


def test_the_examples_in_the_docs_load(tmp_path: Path):
    docs = Path(__file__).resolve().parent.parent / "docs"
    text = (docs / "gateway.md").read_text()
    example = re.search(r"```yaml\n(# gateway.yaml.*?)```", text, re.DOTALL).group(1)
    path = tmp_path / "gateway.yaml"
    path.write_text(example)
    config = load_gateway_file(path)
    assert config.scheduling.replicas_for("resnet50") == 2
    assert len(config.endpoints) == 3 and len(config.metrics_endpoints) == 2
    text = (docs / "node-config.md").read_text()
    block = re.search(r"```yaml\n(gateway:\n.*?)```", text, re.DOTALL).group(1)
    nodefile = node({"gpus": 2, **yaml.safe_load(block)})
    assert embedded_gateway_config(nodefile).scheduling.mode == "lpt_packing"


def test_the_logged_configuration_reads_back_as_the_same(tmp_path: Path):
    path = tmp_path / "gateway.yaml"
    path.write_text(FULL)
    config = load_gateway_file(path)
    path.write_text("\n".join(effective_config_lines(config)))
    assert load_gateway_file(path) == config


def test_replicas_for_a_model():
    scheduling = gateway({"scheduling": {"mode": "lpt_packing", "default_replicas": 2,
                                         "models": {"hot": {"replicas": "all"}}}}).scheduling
    assert scheduling.replicas_for("hot") == "all"
    assert scheduling.replicas_for("cold") == 2


def test_http_is_an_alias_of_metrics():
    assert gateway({"listen": {"http": "127.0.0.1:9"}}).listen.metrics == "127.0.0.1:9"
    message = gateway_error({"listen": {"http": "127.0.0.1:9", "metrics": "127.0.0.1:8"}})
    assert message == ("listen.http: also set as listen.metrics; set one "
                       "(http is another name for metrics)")
    assert gateway_error({"listen": {"http": "9"}}) == \
        "listen.http: expected a host:port address, got '9'"


@pytest.mark.parametrize(("data", "message"), [
    ({"scheduling": {"mode": "x"}},
     "scheduling.mode: expected one of round_robin, least_outstanding, lpt_packing, got 'x'"),
    ({"scheduling": {"mode": "lpt_packing", "default_replicas": 0}},
     "scheduling.default_replicas: expected a positive integer or 'all', got 0"),
    ({"scheduling": {"mode": "lpt_packing", "default_replicas": "some"}},
     "scheduling.default_replicas: expected a positive integer or 'all', got 'some'"),
    ({"scheduling": {"mode": "lpt_packing", "default_replicas": True}},
     "scheduling.default_replicas: expected a positive integer or 'all', got true"),
    ({"scheduling": {"mode": "lpt_packing", "routing_fill_factor": 0}},
     "scheduling.routing_fill_factor: expected a positive number, got 0"),
    ({"scheduling": {"mode": "lpt_packing", "routing_policy": "fill"}},
     "scheduling.routing_policy: expected one of fill_rr, fill_least, got 'fill'"),
    ({"scheduling": {"mode": "lpt_packing", "rebalance_compute_seconds": -1}},
     "scheduling.rebalance_compute_seconds: expected a positive number, got -1"),
    ({"scheduling": {"mode": "lpt_packing", "models": {"m": {}}}},
     "scheduling.models.m.replicas: required (a model's entry sets its replica count)"),
    ({"scheduling": {"mode": "lpt_packing", "models": {"m": {"replicas": 0}}}},
     "scheduling.models.m.replicas: expected a positive integer or 'all', got 0"),
    ({"scheduling": {"mode": "lpt_packing", "models": {"m": {"replica": 2}}}},
     "scheduling.models.m.replica: unknown key (known: replicas)"),
    ({"scheduling": {"mode": "lpt_packing", "models": ["m"]}},
     "scheduling.models: expected a mapping of model name to settings, got a list"),
    ({"scheduling": {"modes": "round_robin"}},
     "scheduling.modes: unknown key (known: default_replicas, mode, models, "
     "rebalance_compute_seconds, routing_fill_factor, routing_policy)"),
    ({"scheduling": "round_robin"}, "scheduling: expected a mapping, got 'round_robin'"),
    ({"grpc": {"max_recv_msg_bytes": 0}},
     "grpc.max_recv_msg_bytes: expected a positive integer, got 0"),
    ({"grpc": {"max_concurrent_requests_per_worker": -1}},
     "grpc.max_concurrent_requests_per_worker: expected a non-negative integer, got -1"),
    ({"worker_client": {"request_timeout_seconds": 0}},
     "worker_client.request_timeout_seconds: expected a positive number, got 0"),
    ({"worker_client": {"max_concurrent_streams": 0}},
     "worker_client.max_concurrent_streams: expected an integer in [1, 2147483647], got 0"),
    ({"worker_client": {"connect_timeout_seconds": "5s"}},
     "worker_client.connect_timeout_seconds: expected a positive number, got '5s'"),
    ({"logging": {"format": "xml"}}, "logging.format: expected one of text, json, got 'xml'"),
    ({"logging": {"level": "INFO"}},
     "logging.level: expected one of debug, info, warning, error, got 'INFO'"),
    ({"listen": {"grpc": "8001"}}, "listen.grpc: expected a host:port address, got '8001'"),
    ({"listen": {"health": "0.0.0.0:1"}}, "listen.health: unknown key (known: grpc, http, metrics, rest)"),
    ({"endpoints": "w0:9001"}, "endpoints: expected a list of host:port addresses, got 'w0:9001'"),
    ({"endpoints": ["w0"]}, "endpoints[0]: expected a host:port address, got 'w0'"),
    ({"endpoints": [9001]}, "endpoints[0]: expected a host:port address, got 9001"),
    ({"endpoints": ["w0:0"]}, "endpoints[0]: 'w0:0': port 0 names no worker (expected 1..65535)"),
    ({"endpoints": ["w0:9001", "w1:9001", "w0:9001"]},
     "endpoints[2]: 'w0:9001' is listed twice (also [0])"),
    ({"endpoints": ["bad host:9001"]},
     "endpoints[0]: 'bad host:9001': 'bad host' is neither an IP address nor a DNS name"),
    ({"endpoints": ["-w0:9001"]}, "endpoints[0]: '-w0:9001': '-w0' is neither"),
    ({"metrics_endpoints": ["w0:x"]}, "metrics_endpoints[0]: expected a host:port address, got 'w0:x'"),
    ({"endpoint_refresh_seconds": 0}, "endpoint_refresh_seconds: expected a positive number, got 0"),
    ({"endpoint": ["w0:1"]},
     "endpoint: unknown key (known: cpu_policy, endpoint_refresh_seconds, endpoints, grpc, listen, logging, "
     "metrics_endpoints, scheduling, tracing, worker_client)"),
])
def test_errors_name_the_key_and_what_was_expected(data: dict, message: str):
    assert gateway_error(data).startswith(message)


@pytest.mark.parametrize("key", ["default_replicas", "routing_fill_factor", "routing_policy",
                                 "rebalance_compute_seconds", "models"])
@pytest.mark.parametrize("mode", ["round_robin", "least_outstanding", None])
def test_lpt_packing_knobs_are_refused_with_another_mode(key: str, mode: str | None):
    value = {"default_replicas": 2, "routing_fill_factor": 2.0, "routing_policy": "fill_rr",
             "rebalance_compute_seconds": 5, "models": {"m": {"replicas": 2}}}[key]
    scheduling = {key: value} if mode is None else {"mode": mode, key: value}
    message = gateway_error({"scheduling": scheduling})
    assert message == (f"scheduling.{key}: applies only to mode lpt_packing (scheduling.mode is "
                       f"{mode or 'round_robin'}; round_robin and least_outstanding route across "
                       "the workers that serve a model and take no replica count)")
    assert gateway({"scheduling": {**scheduling, "mode": "lpt_packing"}}).scheduling.mode == \
        "lpt_packing"


def test_a_standalone_gateway_needs_endpoints():
    for data in ({}, {"endpoints": []}, None):
        with pytest.raises(ConfigError, match=r"^endpoints: required: a standalone gateway needs "
                                              r"a non-empty list of worker host:port addresses"):
            parse_gateway_config(data)
    with pytest.raises(ConfigError, match="^gateway file: expected a mapping, got a list"):
        parse_gateway_config(["w0:1"])
    config = parse_gateway_config({}, {"INFERENCE_SERVER_GATEWAY_ENDPOINTS": "w0:1, w1:2 [::1]:3"})
    assert config.endpoints == ("w0:1", "w1:2", "[::1]:3")


def test_load_reports_the_file_then_the_problem(tmp_path: Path):
    absent = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError, match=f"^{re.escape(str(absent))}: cannot read the gateway file"):
        load_gateway_file(absent)
    path = tmp_path / "gateway.yaml"
    path.write_text('endpoints: ["w0:1"]\nscheduling: {mode: fastest}\n')
    with pytest.raises(ConfigError) as caught:
        load_gateway_file(path)
    assert str(caught.value) == (f"{path}: scheduling.mode: expected one of round_robin, "
                                 "least_outstanding, lpt_packing, got 'fastest'")
    path.write_text('endpoints: ["w0:1"]\nlogging: {}\nlogging: {}\n')
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}:3:1: duplicate key 'logging'$"):
        load_gateway_file(path)
    path.write_text("endpoints: [\n")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}:2:1: not valid YAML"):
        load_gateway_file(path)
    path.write_text('endpoints: ["w0:1"]\n')
    with pytest.raises(ConfigError) as caught:
        load_gateway_file(path, {"INFERENCE_SERVER_GATEWAY_LOGGING_LEVEL": "loud"})
    assert str(caught.value) == ("INFERENCE_SERVER_GATEWAY_LOGGING_LEVEL: expected one of debug, "
                                 "info, warning, error, got 'loud'")


# --- environment overrides -----------------------------------------------------------------------

def test_env_overrides_every_section_and_win_over_the_file():
    config = gateway({"scheduling": {"mode": "round_robin"}, "worker_client": {
        "request_timeout_seconds": 30}}, {
        "INFERENCE_SERVER_GATEWAY_SCHEDULING_MODE": "lpt_packing",
        "INFERENCE_SERVER_GATEWAY_SCHEDULING_DEFAULT_REPLICAS": "all",
        "INFERENCE_SERVER_GATEWAY_SCHEDULING_ROUTING_FILL_FACTOR": "2",
        "INFERENCE_SERVER_GATEWAY_WORKER_CLIENT_REQUEST_TIMEOUT_SECONDS": "5",
        "INFERENCE_SERVER_GATEWAY_WORKER_CLIENT_MAX_CONCURRENT_STREAMS": "8",
        "INFERENCE_SERVER_GATEWAY_GRPC_MAX_CONCURRENT_REQUESTS_PER_WORKER": "0",
        "INFERENCE_SERVER_GATEWAY_LISTEN_METRICS": "127.0.0.1:9",
        "INFERENCE_SERVER_GATEWAY_LOGGING_FORMAT": "json",
        "INFERENCE_SERVER_GATEWAY_ENDPOINT_REFRESH_SECONDS": "0.5",
        "INFERENCE_SERVER_GATEWAY_METRICS_ENDPOINTS": "w0:9101,w1:9102",
        "INFERENCE_SERVER_RUNTIME_BACKEND": "cuda",     # a worker's: not the gateway's business
        "UNRELATED": "x",
    })
    assert (config.scheduling.mode, config.scheduling.default_replicas,
            config.scheduling.routing_fill_factor) == ("lpt_packing", "all", 2.0)
    assert config.worker_client == WorkerClientConfig(5.0, 8, 5.0)
    assert config.grpc.max_concurrent_requests_per_worker == 0
    assert config.listen.metrics == "127.0.0.1:9"
    assert config.logging.format == "json"
    assert config.endpoint_refresh_seconds == 0.5
    assert config.metrics_endpoints == ("w0:9101", "w1:9102")
    assert gateway({"scheduling": {"mode": "lpt_packing"}},
                   {"INFERENCE_SERVER_GATEWAY_SCHEDULING_DEFAULT_REPLICAS": "3"}
                   ).scheduling.default_replicas == 3


@pytest.mark.parametrize(("environ", "message"), [
    ({"INFERENCE_SERVER_GATEWAY_SCHEDULING_MODE": "random"},
     "INFERENCE_SERVER_GATEWAY_SCHEDULING_MODE: expected one of round_robin, least_outstanding, "
     "lpt_packing, got 'random'"),
    ({"INFERENCE_SERVER_GATEWAY_WORKER_CLIENT_REQUEST_TIMEOUT_SECONDS": "soon"},
     "INFERENCE_SERVER_GATEWAY_WORKER_CLIENT_REQUEST_TIMEOUT_SECONDS: expected a positive number, "
     "got 'soon'"),
    ({"INFERENCE_SERVER_GATEWAY_SCHEDULING_MODE": "lpt_packing",
      "INFERENCE_SERVER_GATEWAY_SCHEDULING_DEFAULT_REPLICAS": "0"},
     "INFERENCE_SERVER_GATEWAY_SCHEDULING_DEFAULT_REPLICAS: expected a positive integer or 'all', "
     "got 0"),
    ({"INFERENCE_SERVER_GATEWAY_ENDPOINTS": "w0:1,w0"},
     "INFERENCE_SERVER_GATEWAY_ENDPOINTS[1]: expected a host:port address, got 'w0'"),
    ({"INFERENCE_SERVER_GATEWAY_SCHEDULING_MODELS": "m"},
     "INFERENCE_SERVER_GATEWAY_SCHEDULING_MODELS: unknown variable (known: "
     "INFERENCE_SERVER_GATEWAY_CPU_POLICY, INFERENCE_SERVER_GATEWAY_ENDPOINTS, "
     "INFERENCE_SERVER_GATEWAY_ENDPOINT_REFRESH_SECONDS,"),
    ({"INFERENCE_SERVER_GATEWAY_MODE": "lpt_packing"},
     "INFERENCE_SERVER_GATEWAY_MODE: unknown variable"),
    # a knob of lpt_packing from the environment, the mode from the file (round_robin there)
    ({"INFERENCE_SERVER_GATEWAY_SCHEDULING_ROUTING_POLICY": "fill_least"},
     "INFERENCE_SERVER_GATEWAY_SCHEDULING_ROUTING_POLICY: applies only to mode lpt_packing "
     "(scheduling.mode is round_robin;"),
])
def test_env_errors_name_the_variable(environ: dict[str, str], message: str):
    assert gateway_error({"scheduling": {"mode": "round_robin"}}, environ).startswith(message)


def test_env_mode_against_the_files_knobs_names_both():
    message = gateway_error({"scheduling": {"mode": "lpt_packing", "default_replicas": 2}},
                            {"INFERENCE_SERVER_GATEWAY_SCHEDULING_MODE": "least_outstanding"})
    assert message.startswith("scheduling.default_replicas: applies only to mode lpt_packing "
                              "(INFERENCE_SERVER_GATEWAY_SCHEDULING_MODE is least_outstanding;")


def test_variable_names_follow_the_section_and_field():
    names = gateway_environment_variables()
    assert "INFERENCE_SERVER_GATEWAY_SCHEDULING_MODE" in names
    assert "INFERENCE_SERVER_GATEWAY_WORKER_CLIENT_REQUEST_TIMEOUT_SECONDS" in names
    assert "INFERENCE_SERVER_GATEWAY_SCHEDULING_MODELS" not in names
    assert not set(names) & set(environment_variables())


# --- the node's gateway: block -------------------------------------------------------------------

def test_the_node_loader_validates_the_gateway_block():
    assert node_error({"gateway": {"scheduling": {"mode": "x"}}}) == (
        "gateway.scheduling.mode: expected one of round_robin, least_outstanding, lpt_packing, "
        "got 'x'")
    assert node_error({"gateway": {"worker_client": {"timeout": 1}}}).startswith(
        "gateway.worker_client.timeout: unknown key (known: connect_timeout_seconds, "
        "max_concurrent_streams, request_timeout_seconds)")
    assert node_error({"gateway": {"scheduling": {"default_replicas": 2}}}).startswith(
        "gateway.scheduling.default_replicas: applies only to mode lpt_packing "
        "(gateway.scheduling.mode is round_robin;")
    assert node_error({"gateway": {"workers": []}}).startswith(
        "gateway.workers: unknown key (known: cpu_policy, endpoint_refresh_seconds, grpc, listen, logging, "
        "scheduling, tracing, worker_client)")


@pytest.mark.parametrize("key", ["endpoints", "metrics_endpoints"])
def test_a_nodes_gateway_takes_no_endpoints(key: str):
    assert node_error({"gateway": {key: ["w0:1"]}}) == (
        f"gateway.{key}: not a key of a node's gateway: block (its endpoints are the node's "
        "workers); it applies only to a standalone gateway")
    var = f"INFERENCE_SERVER_GATEWAY_{key.upper()}"
    assert node_error({}, {var: "w0:1"}) == (
        f"{var}: a node's gateway fronts the node's own workers; {key} applies only to a "
        "standalone gateway")


def test_the_node_loader_passes_gateway_variables_to_the_gateway(tmp_path: Path):
    path = tmp_path / "node.yaml"
    path.write_text("model_repo: m\n")
    # known to the gateway, so not an unknown variable of the node
    load_node_config(path, {"INFERENCE_SERVER_GATEWAY_SCHEDULING_MODE": "lpt_packing"})
    with pytest.raises(ConfigError) as caught:
        load_node_config(path, {"INFERENCE_SERVER_GATEWAY_SCHEDULING_MODE": "fastest"})
    assert str(caught.value).startswith("INFERENCE_SERVER_GATEWAY_SCHEDULING_MODE: expected one of")
    with pytest.raises(ConfigError, match="^INFERENCE_SERVER_GATEWAY_NOPE: unknown variable"):
        load_node_config(path, {"INFERENCE_SERVER_GATEWAY_NOPE": "1"})
    path.write_text("model_repo: m\ngateway:\n  logging: {format: yaml}\n")
    with pytest.raises(ConfigError) as caught:
        load_node_config(path)
    assert str(caught.value) == f"{path}: gateway.logging.format: expected one of text, json, got 'yaml'"


def test_embedded_gateway_fronts_the_nodes_workers():
    two = node({"listen": {"grpc": "0.0.0.0:8001", "http": "127.0.0.1:8002"},
                "workers": [{"name": "a"}, {"name": "b", "endpoints": {"host": "10.1.2.3"}}],
                "gateway": {"scheduling": {"mode": "least_outstanding"},
                            "worker_client": {"max_concurrent_streams": 16}}})
    config = embedded_gateway_config(two)
    assert config.listen == GatewayListenConfig("0.0.0.0:8001", "127.0.0.1:8002")
    assert config.endpoints == ("127.0.0.1:9001", "10.1.2.3:9002")   # a wildcard bind: loopback
    assert config.metrics_endpoints == ("127.0.0.1:9101", "10.1.2.3:9102")
    assert config.scheduling.mode == "least_outstanding"
    assert config.worker_client.max_concurrent_streams == 16
    ipv6 = node({"gpus": 2, "global": {"endpoints": {"host": "::"}}})
    assert embedded_gateway_config(ipv6).endpoints == ("[::1]:9001", "[::1]:9002")


def test_embedded_gateway_listen_order_node_then_block_then_environment():
    environ = {"INFERENCE_SERVER_LISTEN_GRPC": "127.0.0.1:7001"}
    nodefile = node({"gpus": 2, "gateway": {"listen": {"http": "127.0.0.1:7002"}}}, environ)
    config = embedded_gateway_config(nodefile, environ)
    assert config.listen == GatewayListenConfig("127.0.0.1:7001", "127.0.0.1:7002")
    environ["INFERENCE_SERVER_GATEWAY_LISTEN_GRPC"] = "127.0.0.1:7101"
    assert embedded_gateway_config(nodefile, environ).listen.grpc == "127.0.0.1:7101"
    # the node's listen: had its variable applied when the node loaded
    assert embedded_gateway_config(nodefile).listen.grpc == "127.0.0.1:7001"


def test_embedded_gateway_serves_the_nodes_rest_address_and_checks_its_port():
    config = embedded_gateway_config(node({"gpus": 2, "listen": {"rest": "127.0.0.1:8000"}}))
    assert config.listen.rest == "127.0.0.1:8000"
    assert embedded_gateway_config(node({"gpus": 2})).listen.rest is None
    standalone = parse_gateway_config({"listen": {"rest": "0.0.0.0:8000"}, "endpoints": ["10.0.0.1:8001"]})
    assert standalone.listen.rest == "0.0.0.0:8000"
    assert parse_gateway_config({"endpoints": ["10.0.0.1:8001"]}).listen.rest is None
    with pytest.raises(ConfigError) as caught:
        embedded_gateway_config(node({"gpus": 2, "gateway": {"listen": {"rest": "0.0.0.0:9001"}}}))
    assert str(caught.value) == ("gateway.listen.rest: port 9001 for the gateway's rest is "
                                 "already used by worker worker0's gRPC")


def test_embedded_gateway_env_overrides_the_block():
    nodefile = node({"gpus": 3, "gateway": {"scheduling": {"mode": "round_robin"}}})
    config = embedded_gateway_config(nodefile, {
        "INFERENCE_SERVER_GATEWAY_SCHEDULING_MODE": "lpt_packing",
        "INFERENCE_SERVER_GATEWAY_SCHEDULING_DEFAULT_REPLICAS": "2"})
    assert (config.scheduling.mode, config.scheduling.default_replicas) == ("lpt_packing", 2)
    assert len(config.endpoints) == 3


def test_cpu_policy_is_batch_or_normal_in_a_file_a_node_and_the_environment():
    assert gateway({"endpoints": ["w0:1"], "cpu_policy": "batch"}).cpu_policy == "batch"
    assert gateway({"endpoints": ["w0:1"]}, {"INFERENCE_SERVER_GATEWAY_CPU_POLICY": "batch"}).cpu_policy == "batch"
    assert gateway_error({"endpoints": ["w0:1"], "cpu_policy": "idle"}) == \
        "cpu_policy: expected one of normal, batch, got 'idle'"
    assert gateway_error({"endpoints": ["w0:1"]}, {"INFERENCE_SERVER_GATEWAY_CPU_POLICY": "fifo"}).startswith(
        "INFERENCE_SERVER_GATEWAY_CPU_POLICY: ")
    nodefile = node({"gpus": 2, "gateway": {"cpu_policy": "batch"}})
    assert embedded_gateway_config(nodefile, {}).cpu_policy == "batch"
    assert embedded_gateway_config(node({"gpus": 2}), {}).cpu_policy == "normal"
    assert node_error({"gpus": 2, "gateway": {"cpu_policy": 1}}).startswith("gateway.cpu_policy: ")


def test_embedded_gateway_worker_count_for_gpus_auto():
    auto = node({})      # gpus: auto: the count is detected, and passed in
    config = embedded_gateway_config(auto, worker_count=3)
    assert config.endpoints == ("127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003")
    with pytest.raises(ConfigError, match="^gateway: a node of one worker has no gateway"):
        embedded_gateway_config(auto)


def test_embedded_gateway_ports_must_not_collide_with_workers():
    collide = node({"gpus": 2, "gateway": {"listen": {"grpc": "0.0.0.0:9002"}}})
    with pytest.raises(ConfigError) as caught:
        embedded_gateway_config(collide)
    assert str(caught.value) == ("gateway.listen.grpc: port 9002 for the gateway's grpc is "
                                 "already used by worker worker1's gRPC")
    same = node({"gpus": 2, "gateway": {"listen": {"metrics": "0.0.0.0:8001"}}})
    with pytest.raises(ConfigError) as caught:
        embedded_gateway_config(same)
    assert str(caught.value) == ("gateway.listen.metrics: port 8001 for the gateway's metrics is "
                                 "already used by the gateway's grpc (listen.grpc)")
    with pytest.raises(ConfigError, match="^INFERENCE_SERVER_GATEWAY_LISTEN_METRICS: port 9101 "):
        embedded_gateway_config(node({"gpus": 2}),
                                {"INFERENCE_SERVER_GATEWAY_LISTEN_METRICS": "0.0.0.0:9101"})


# --- DNS endpoints -------------------------------------------------------------------------------

class FakeDns:
    """A getaddrinfo over a table the test edits: name -> addresses, an OSError, or 'hang'."""

    def __init__(self, table: dict[str, object]) -> None:
        self.table = table
        self.lookups: list[str] = []
        self.times: list[float] = []

    async def __call__(self, host, port, family=0, type=0, proto=0, flags=0):
        self.lookups.append(host)
        self.times.append(trio.current_time())
        await trio.lowlevel.checkpoint()
        entry = self.table.get(host, socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
        if entry == "hang":
            await trio.sleep_forever()
        if isinstance(entry, BaseException):
            raise entry
        out = []
        for address in entry:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sockaddr = (address, port, 0, 0) if family == socket.AF_INET6 else (address, port)
            out.append((family, socket.SOCK_STREAM, 6, "", sockaddr))
        return out


def test_resolve_expands_names_and_keeps_ip_addresses():
    dns = FakeDns({"worker-svc": ["10.0.0.9", "10.0.0.7", "10.0.0.9", "fd00::1"]})

    async def main():
        return await resolve(["10.1.1.1:9001", "worker-svc:9001", "[fd00::5]:9002"], dns)

    endpoints = trio.run(main)
    assert [e.name for e in endpoints] == [
        "10.1.1.1:9001", "worker-svc:9001@10.0.0.7", "worker-svc:9001@10.0.0.9",
        "worker-svc:9001@fd00::1", "[fd00::5]:9002"]
    assert [e.target for e in endpoints] == [
        "10.1.1.1:9001", "10.0.0.7:9001", "10.0.0.9:9001", "[fd00::1]:9001", "[fd00::5]:9002"]
    assert endpoints[1] == Endpoint("worker-svc:9001", "10.0.0.7", 9001)
    assert dns.lookups == ["worker-svc"], "IP addresses are not looked up"


def test_resolve_names_the_first_endpoint_that_fails():
    dns = FakeDns({"ok": ["10.0.0.1"], "empty": []})

    async def main(endpoints):
        return await resolve(endpoints, dns)

    with pytest.raises(ResolveError) as caught:
        trio.run(main, ["ok:1", "gone:1", "also-gone:1"])
    assert str(caught.value) == "endpoint gone:1: cannot resolve: Name or service not known"
    with pytest.raises(ResolveError, match="^endpoint empty:1: cannot resolve: no IPv4 or IPv6 address$"):
        trio.run(main, ["empty:1"])


def test_endpoints_that_reach_one_worker_are_one_worker():
    """A name and its IP address, or two names of one Service: one worker (the first in the
    list names it), not two connections that would each count its load."""
    dns = FakeDns({"svc": ["10.0.0.7", "10.0.0.8"], "alias": ["10.0.0.8"]})

    async def main():
        return await resolve(["10.0.0.7:9001", "svc:9001", "alias:9001", "svc:9002"], dns)

    endpoints = trio.run(main)
    assert [e.name for e in endpoints] == ["10.0.0.7:9001", "svc:9001@10.0.0.8", "svc:9002@10.0.0.7",
                                           "svc:9002@10.0.0.8"], "one per address and port"
    one = Endpoint("svc:9001", "10.0.0.7", 9001)
    assert unique([one, Endpoint("10.0.0.7:9001", "10.0.0.7", 9001)]) == (one,)


def test_follow_warns_once_about_an_endpoint_that_duplicates_another(caplog: pytest.LogCaptureFixture):
    dns = FakeDns({"svc": ["10.0.0.1"], "alias": ["10.0.0.1"]})
    messages: list[EndpointsChanged] = []

    async def main():
        send, receive = trio.open_memory_channel[EndpointsChanged](10)
        async with trio.open_nursery() as nursery:
            await nursery.start(follow, ["svc:1", "alias:1"], 5.0, send, dns)
            await trio.sleep(12)               # two more refreshes find the same duplicate
            dns.table["alias"] = ["10.0.0.2"]  # now a worker of its own
            await trio.sleep(5)
            nursery.cancel_scope.cancel()
        async for message in receive:
            messages.append(message)

    with caplog.at_level(logging.WARNING, logger="xlaserve.gateway.endpoints"):
        trio.run(main, clock=MockClock(autojump_threshold=0))
    assert [e.name for e in messages[0].endpoints] == ["svc:1@10.0.0.1"]
    assert [e.name for e in messages[-1].endpoints] == ["svc:1@10.0.0.1", "alias:1@10.0.0.2"]
    assert [r.getMessage() for r in caplog.records] == [
        "endpoint alias:1 resolves to 10.0.0.1:1, already the worker svc:1@10.0.0.1: one worker, not two"]


def test_diff_is_added_and_removed_in_order():
    a, b, c, d = (Endpoint("svc:1", f"10.0.0.{i}", 1) for i in range(4))
    assert diff((a, b, c), (c, d, b)) == ((d,), (a,))
    assert diff((), (a, b)) == ((a, b), ())
    assert diff((a, b), (a, b)) == ((), ())
    assert diff((a,), ()) == ((), (a,))


def test_follow_sends_the_first_set_then_only_changes():
    dns = FakeDns({"svc": ["10.0.0.1", "10.0.0.2"]})
    log: list[tuple[float, EndpointsChanged]] = []

    async def main():
        send, receive = trio.open_memory_channel[EndpointsChanged](0)
        async with trio.open_nursery() as nursery:
            first = await nursery.start(follow, ["svc:9001", "10.9.9.9:9001"], 10.0, send, dns)
            assert [e.name for e in first] == ["svc:9001@10.0.0.1", "svc:9001@10.0.0.2",
                                               "10.9.9.9:9001"]

            async def change_dns():
                await trio.sleep(25)            # between the refreshes at 20 s and 30 s
                dns.table["svc"] = ["10.0.0.2", "10.0.0.3"]
                await trio.sleep(30)            # at 55 s: the last pod goes
                dns.table["svc"] = ["10.0.0.3"]

            nursery.start_soon(change_dns)
            async for message in receive:
                log.append((trio.current_time(), message))
                if len(log) == 3:
                    nursery.cancel_scope.cancel()

    trio.run(main, clock=MockClock(autojump_threshold=0))
    (t0, m0), (t1, m1), (t2, m2) = log
    assert t0 == 0 and [e.name for e in m0.added] == [e.name for e in m0.endpoints]
    assert m0.removed == ()
    assert t1 == 30                       # 10 s and 20 s changed nothing: no message
    assert [e.address for e in m1.added] == ["10.0.0.3"]
    assert [e.address for e in m1.removed] == ["10.0.0.1"]
    assert [e.name for e in m1.endpoints] == ["svc:9001@10.0.0.2", "svc:9001@10.0.0.3",
                                              "10.9.9.9:9001"]
    assert t2 == 60 and [e.address for e in m2.removed] == ["10.0.0.2"] and m2.added == ()


def test_follow_keeps_a_failing_names_addresses_and_warns_once(caplog: pytest.LogCaptureFixture):
    dns = FakeDns({"svc": ["10.0.0.1"]})
    messages: list[EndpointsChanged] = []

    async def main():
        send, receive = trio.open_memory_channel[EndpointsChanged](10)
        async with trio.open_nursery() as nursery:
            await nursery.start(follow, ["svc:1"], 5.0, send, dns)
            dns.table["svc"] = OSError("temporary failure in name resolution")
            await trio.sleep(17)               # refreshes at 5, 10, 15 fail
            dns.table["svc"] = "hang"          # a lookup that never answers fails at its timeout
            await trio.sleep(10)               # the refreshes at 20 and 25 give up after 5 s each
            dns.table["svc"] = ["10.0.0.1"]    # at 27; the refresh at 30 answers
            await trio.sleep(10)
            dns.table["svc"] = socket.gaierror(socket.EAI_AGAIN, "Temporary failure")
            await trio.sleep(10)               # at 40, a new streak: one more warning
            nursery.cancel_scope.cancel()
        async for message in receive:          # ends: follow closed the channel when it ended
            messages.append(message)

    with caplog.at_level(logging.INFO, logger="xlaserve.gateway.endpoints"):
        trio.run(main, clock=MockClock(autojump_threshold=0))
    assert len(messages) == 1, "failures keep the last known addresses: nothing changed"
    assert [e.address for e in messages[0].endpoints] == ["10.0.0.1"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "endpoint svc:1: cannot resolve (temporary failure in name resolution); keeping its last "
        "known address 10.0.0.1; retrying every 5 s",
        "endpoint svc:1: cannot resolve (Temporary failure); keeping its last known address "
        "10.0.0.1; retrying every 5 s"]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == ["endpoint svc:1 resolves again: 10.0.0.1"]


def test_follow_starts_without_a_name_that_does_not_resolve_yet(caplog: pytest.LogCaptureFixture):
    dns = FakeDns({"ready": ["10.0.0.1"]})
    log: list[EndpointsChanged] = []

    async def main():
        send, receive = trio.open_memory_channel[EndpointsChanged](0)
        async with trio.open_nursery() as nursery:
            first = await nursery.start(follow, ["ready:1", "later:1"], 1.0, send, dns)
            assert [e.name for e in first] == ["ready:1@10.0.0.1"]
            dns.table["later"] = "hang"
            async for message in receive:
                log.append(message)
                if len(log) == 1:
                    await trio.sleep(3.5)
                    dns.table["later"] = ["10.0.0.2"]
                else:
                    nursery.cancel_scope.cancel()

    with caplog.at_level(logging.WARNING, logger="xlaserve.gateway.endpoints"):
        trio.run(main, clock=MockClock(autojump_threshold=0))
    assert [[e.name for e in m.added] for m in log] == [["ready:1@10.0.0.1"], ["later:1@10.0.0.2"]]
    assert [r.getMessage() for r in caplog.records] == [
        "endpoint later:1: cannot resolve (Name or service not known); no worker for it yet; "
        "retrying every 1 s"]


def test_a_slow_receiver_delays_refreshes_without_a_burst():
    dns = FakeDns({"svc": ["10.0.0.1"]})

    async def main():
        send, receive = trio.open_memory_channel[EndpointsChanged](0)
        async with trio.open_nursery() as nursery:
            await nursery.start(follow, ["svc:1"], 10.0, send, dns)
            await receive.receive()                        # the first set, at 0
            dns.table["svc"] = ["10.0.0.2"]                # the refresh at 10 has news ...
            await trio.sleep(35)                           # ... taken only at 35
            assert [e.address for e in (await receive.receive()).added] == ["10.0.0.2"]
            await trio.sleep(28)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=MockClock(autojump_threshold=0))
    # one refresh at once after the wait (the data is old), then the period again: not one
    # refresh for every period missed (20 and 30 would both have run at 35)
    assert dns.times == [0, 10, 35, 45, 55]
