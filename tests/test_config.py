"""The node file: parsing, merging, ports, environment overrides and error messages."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from xlaserve.config import (
    ConfigError,
    EndpointsConfig,
    ListenConfig,
    LoggingConfig,
    TracingConfig,
    ModelSchedConfig,
    NodeConfig,
    RuntimeConfig,
    SchedulerConfig,
    SupervisorConfig,
    TlsConfig,
    WorkerConfig,
    effective_config_lines,
    environment_variables,
    load_node_config,
    parse_node_config,
    resolve_worker,
    split_address,
    to_plain,
    worker_count,
)

BASE = Path("/srv/node")
DOCS = Path(__file__).resolve().parent.parent / "docs" / "node-config.md"


def parse(data: dict, environ: dict[str, str] | None = None) -> NodeConfig:
    return parse_node_config({"model_repo": "models", **data}, BASE, environ)


def error_of(data: dict, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        node = parse(data, environ)
        resolve_worker(node)
    return str(caught.value)


# --- defaults ------------------------------------------------------------------------------------

def test_minimal_file_gets_every_default():
    node = parse({})
    assert node.model_repo == BASE / "models"
    assert node.base_port == 9001
    assert node.metrics_base_port == 9101
    assert node.gpus == "auto"
    assert node.cache_dir == Path.home() / ".cache" / "xlaserve"
    assert node.model_control_mode == "dynamic"
    assert node.model_poll_seconds == 15.0
    assert node.model_import_timeout_seconds == 60.0
    assert node.models_include == ()
    assert node.runtime == RuntimeConfig()
    assert node.scheduler == SchedulerConfig()
    assert node.endpoints == EndpointsConfig()
    assert node.listen == ListenConfig()
    assert node.supervisor == SupervisorConfig()
    assert node.logging == LoggingConfig()
    assert [w.name for w in node.workers] == ["worker0"]
    assert not node.workers_explicit
    assert dict(node.models) == {}
    assert node.gateway is None


def test_block_defaults_match_the_documented_values():
    assert RuntimeConfig() == RuntimeConfig(
        backend="cpu", mem_fraction=0.9, preallocate=True, allow_cpu_fallback=False,
        weight_cache_fraction=1.0, weight_cache_wiggle_fraction=0.1, device_memory_bytes=0)
    assert SchedulerConfig().discipline == "fair"
    assert SchedulerConfig().max_queue_depth == 1024
    assert SchedulerConfig().compaction_interval == 0
    assert ModelSchedConfig() == ModelSchedConfig(weight=1.0, residency="system",
                                                  max_batch_size=None, batch_delay_seconds=0.0,
                                                  batch_target_rows=None)
    endpoints = EndpointsConfig()
    assert (endpoints.host, endpoints.port, endpoints.max_concurrent_requests) == \
        ("0.0.0.0", None, 0)
    assert endpoints.allow_client_shm is False
    assert endpoints.max_recv_msg_bytes == endpoints.max_send_msg_bytes == 256 * 1024 * 1024
    assert endpoints.max_connection_buffer_bytes == 1024 * 1024 * 1024
    assert endpoints.max_held_request_bytes == 2 * 1024 * 1024 * 1024


def test_values_are_frozen_and_mappings_read_only():
    node = parse({"global": {"scheduler": {"models": {"m": {"weight": 2}}}}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        node.base_port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        node.scheduler.models["other"] = ModelSchedConfig()  # type: ignore[index]
    assert not hasattr(node, "__dict__")


def test_for_model_returns_the_override_or_the_default():
    node = parse({"global": {"scheduler": {"models": {"m": {"weight": 2}}}}})
    assert node.scheduler.for_model("m") == ModelSchedConfig(weight=2.0)
    assert node.scheduler.for_model("unknown") == ModelSchedConfig()


def test_single_implicit_worker_serves_the_public_addresses():
    worker = resolve_worker(parse({}))
    assert (worker.name, worker.index, worker.worker_count) == ("worker0", 0, 1)
    assert (worker.grpc_host, worker.grpc_port) == ("0.0.0.0", 8001)
    assert (worker.http_host, worker.http_port) == ("0.0.0.0", 8002)
    assert worker.grpc_address == "0.0.0.0:8001"
    assert worker.gpu is None


def test_empty_cache_dir_turns_the_cache_off_and_relative_paths_anchor_at_the_file():
    node = parse({"global": {"cache_dir": None}})
    assert node.cache_dir is None
    node = parse({"global": {"cache_dir": "cache"}})
    assert node.cache_dir == BASE / "cache"
    assert parse({"model_repo": "/abs/models"}).model_repo == Path("/abs/models")


# --- a full file ---------------------------------------------------------------------------------

FULL = """
model_repo: models
base_port: 7000
metrics_base_port: 7100
gpus: [2, 3]
listen:
  grpc: "127.0.0.1:8101"
  http: "[::1]:8102"
global:
  cache_dir: /var/cache/xlaserve
  model_control_mode: explicit
  model_poll_seconds: 5
  models_include: [resnet50, yolo]
  runtime:
    backend: cuda
    mem_fraction: 0.75
    preallocate: false
    allow_cpu_fallback: true
    weight_cache_fraction: 0.5
    weight_cache_wiggle_fraction: 0.2
    device_memory_bytes: 1073741824
  scheduler:
    discipline: edf
    ema_halflife_seconds: 10
    max_queue_depth: 16
    dispatch_timeout_seconds: 2.5
    compaction_interval: 100
    models:
      resnet50: {weight: 2, max_batch_size: 8}
      yolo: {residency: unpinned}
  endpoints:
    host: 10.0.0.1
    max_concurrent_requests: 0
    allow_client_shm: true
    max_recv_msg_bytes: 1024
    max_send_msg_bytes: 2048
    max_connection_buffer_bytes: 4096
workers:
  - name: a
    gpu: 5
    port: 7500
  - name: b
    runtime: {backend: cpu}
    scheduler:
      discipline: fifo
      models:
        resnet50: {max_batch_size: 4}
        vit: {weight: 3}
    endpoints: {max_concurrent_requests: 8}
    models_include: [vit]
models:
  yolo: [b]
gateway:
  scheduling: {mode: round_robin}
"""


@pytest.fixture
def full_node(tmp_path: Path) -> NodeConfig:
    path = tmp_path / "node.yaml"
    path.write_text(FULL)
    return load_node_config(path)


def test_full_file_loads_every_key(full_node: NodeConfig, tmp_path: Path):
    node = full_node
    assert node.model_repo == tmp_path / "models"
    assert (node.base_port, node.metrics_base_port, node.gpus) == (7000, 7100, (2, 3))
    assert node.listen == ListenConfig(grpc="127.0.0.1:8101", http="[::1]:8102")
    assert node.cache_dir == Path("/var/cache/xlaserve")
    assert node.model_control_mode == "explicit"
    assert node.model_poll_seconds == 5.0 and isinstance(node.model_poll_seconds, float)
    assert node.models_include == ("resnet50", "yolo")
    assert node.runtime == RuntimeConfig("cuda", 0.75, False, True, 0.5, 0.2, 1 << 30)
    assert node.scheduler.discipline == "edf"
    assert node.scheduler.ema_halflife_seconds == 10.0
    assert node.scheduler.max_queue_depth == 16
    assert node.scheduler.dispatch_timeout_seconds == 2.5
    assert node.scheduler.compaction_interval == 100
    assert dict(node.scheduler.models) == {
        "resnet50": ModelSchedConfig(weight=2.0, max_batch_size=8),
        "yolo": ModelSchedConfig(residency="unpinned"),
    }
    assert node.endpoints == EndpointsConfig("10.0.0.1", None, 0, True, 1024, 2048, 4096)
    assert [w.name for w in node.workers] == ["a", "b"]
    assert node.workers_explicit
    assert dict(node.models) == {"yolo": ("b",)}
    assert dict(node.gateway) == {"scheduling": {"mode": "round_robin"}}


def test_full_file_resolves_both_workers(full_node: NodeConfig):
    a = resolve_worker(full_node, "a")
    assert (a.index, a.worker_count, a.gpu) == (0, 2, 5)
    assert (a.grpc_host, a.grpc_port) == ("10.0.0.1", 7500)
    assert (a.http_host, a.http_port) == ("10.0.0.1", 7100)
    assert a.runtime == full_node.runtime
    assert a.scheduler == full_node.scheduler
    assert a.models_include == ("resnet50", "yolo")

    b = resolve_worker(full_node, 1)
    assert b.name == "b"
    assert b.gpu == 3, "a worker without gpu: takes its entry of the gpus: list"
    assert (b.grpc_port, b.http_port) == (7001, 7101)
    assert b.runtime == dataclasses.replace(full_node.runtime, backend="cpu")
    assert b.scheduler.discipline == "fifo"
    assert b.scheduler.max_queue_depth == 16
    assert b.endpoints.max_concurrent_requests == 8
    assert b.endpoints.host == "10.0.0.1"
    assert b.models_include == ("vit",)


def test_effective_config_round_trips_through_yaml(full_node: NodeConfig):
    worker = resolve_worker(full_node, "b")
    lines = effective_config_lines(worker)
    assert lines[0] == "name: b"
    assert yaml.safe_load("\n".join(lines)) == to_plain(worker)
    plain = to_plain(worker)
    assert plain["scheduler"]["models"]["yolo"] == {
        "weight": 1.0, "residency": "device", "max_batch_size": None, "batch_delay_seconds": 0.0,
        "batch_target_rows": None}
    assert set(plain) == {f.name for f in dataclasses.fields(WorkerConfig)}


def test_annotated_example_in_the_docs_is_a_valid_node_file():
    text = DOCS.read_text()
    example = text.split("## Annotated example", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", example, re.DOTALL).group(1)
    node = parse_node_config(yaml.safe_load(block), BASE)
    worker1 = resolve_worker(node, "worker1")
    assert worker1.scheduler.max_queue_depth == 256
    assert worker1.scheduler.for_model("severity_grader") == ModelSchedConfig(
        weight=2.0, residency="device", max_batch_size=8)
    assert worker1.scheduler.for_model("resnet50").residency == "device"
    assert (worker1.grpc_port, worker1.http_port) == (9002, 9102)


def test_every_documented_key_is_in_the_docs():
    text = DOCS.read_text()
    for cls in (RuntimeConfig, SchedulerConfig, ModelSchedConfig, EndpointsConfig, TlsConfig, ListenConfig,
                SupervisorConfig, LoggingConfig, TracingConfig):
        for f in dataclasses.fields(cls):
            assert f"`{f.name}`" in text, f"{cls.__name__}.{f.name} is not documented"
    for var in environment_variables():
        short = var.removeprefix("INFERENCE_SERVER_")
        assert var in text or short.split("_")[0] in ("RUNTIME", "SCHEDULER", "ENDPOINTS",
                                                      "SUPERVISOR", "LOGGING", "TRACING"), var


# --- per-worker merging and the pin map ----------------------------------------------------------

def test_worker_blocks_merge_key_by_key_and_scheduler_models_per_model():
    node = parse({
        "global": {
            "runtime": {"backend": "cuda", "mem_fraction": 0.5},
            "scheduler": {"max_queue_depth": 10, "models": {
                "m": {"weight": 2, "max_batch_size": 4},
                "n": {"residency": "unpinned"}}},
        },
        "workers": [
            {"name": "w0"},
            {"name": "w1", "runtime": {"mem_fraction": 0.7},
             "scheduler": {"models": {"m": {"max_batch_size": 2}, "o": {"weight": 5}}}},
        ],
    })
    w0, w1 = resolve_worker(node, "w0"), resolve_worker(node, "w1")
    assert w0.runtime.mem_fraction == 0.5
    assert w1.runtime == dataclasses.replace(node.runtime, mem_fraction=0.7)
    assert w1.runtime.backend == "cuda"
    assert w1.scheduler.max_queue_depth == 10
    assert dict(w1.scheduler.models) == {
        "m": ModelSchedConfig(weight=2.0, max_batch_size=2),
        "n": ModelSchedConfig(residency="unpinned"),
        "o": ModelSchedConfig(weight=5.0),
    }
    assert w0.scheduler.for_model("m").max_batch_size == 4
    assert "o" not in w0.scheduler.models


def test_pin_map_sets_residency_device_only_on_listed_workers():
    node = parse({
        "global": {"scheduler": {"models": {"r": {"weight": 3, "residency": "unpinned"}}}},
        "workers": [{"name": "w0"}, {"name": "w1"}],
        "models": {"r": ["w1"], "s": ["w0", "w1"]},
    })
    w0, w1 = resolve_worker(node, "w0"), resolve_worker(node, "w1")
    assert w0.scheduler.for_model("r") == ModelSchedConfig(weight=3.0, residency="unpinned")
    assert w1.scheduler.for_model("r") == ModelSchedConfig(weight=3.0, residency="device")
    assert w0.scheduler.for_model("s").residency == "device"
    assert w1.scheduler.for_model("s").residency == "device"


def test_pin_map_names_implicit_workers_by_index():
    node = parse({"gpus": 2, "models": {"r": ["worker1"]}})
    assert resolve_worker(node, 0).scheduler.for_model("r").residency == "system"
    assert resolve_worker(node, "worker1").scheduler.for_model("r").residency == "device"


def test_pin_to_gpu_is_an_alias_for_residency_device():
    node = parse({"global": {"scheduler": {"models": {
        "a": {"pin_to_gpu": True}, "b": {"pin_to_gpu": False},
        "c": {"pin_to_gpu": True, "residency": "device"}}}}})
    assert node.scheduler.for_model("a").residency == "device"
    assert node.scheduler.for_model("b").residency == "system"
    assert node.scheduler.for_model("c").residency == "device"


def test_models_include_per_worker_replaces_the_global_list():
    node = parse({"global": {"models_include": ["a", "b"]},
                  "workers": [{"name": "w0", "models_include": ["c"]}, {"name": "w1"}]})
    assert resolve_worker(node, "w0").models_include == ("c",)
    assert resolve_worker(node, "w1").models_include == ("a", "b")


# --- ports ---------------------------------------------------------------------------------------

def test_one_explicit_worker_serves_the_listen_addresses():
    node = parse({"workers": [{"name": "solo"}], "listen": {"grpc": "127.0.0.1:5000",
                                                            "http": "127.0.0.1:5001"}})
    worker = resolve_worker(node, "solo")
    assert (worker.grpc_host, worker.grpc_port) == ("127.0.0.1", 5000)
    assert (worker.http_host, worker.http_port) == ("127.0.0.1", 5001)


def test_rest_is_off_by_default_and_a_one_worker_node_serves_listen_rest():
    assert parse({}).listen.rest is None
    assert resolve_worker(parse({})).rest_port is None
    worker = resolve_worker(parse({"listen": {"rest": "127.0.0.1:8000"}}))
    assert (worker.rest_host, worker.rest_port) == ("127.0.0.1", 8000)
    # with two workers the gateway serves REST; the workers do not
    node = parse({"gpus": 2, "listen": {"rest": "0.0.0.0:8000"}})
    assert [resolve_worker(node, i).rest_port for i in range(2)] == [None, None]
    message = error_of({"listen": {"grpc": "0.0.0.0:8001", "rest": "0.0.0.0:8001"}})
    assert message.startswith("listen.rest: port 8001") and "gRPC" in message
    message = error_of({"gpus": 2, "listen": {"rest": "0.0.0.0:8002"}})
    assert message.startswith("listen.rest: port 8002") and "gateway's HTTP" in message
    assert error_of({"listen": {"rest": "8000"}}) == "listen.rest: expected a host:port address or null, got '8000'"
    assert parse({}, {"INFERENCE_SERVER_LISTEN_REST": "127.0.0.1:8000"}).listen.rest == "127.0.0.1:8000"


def test_one_worker_with_an_explicit_port_binds_endpoints_host():
    node = parse({"global": {"endpoints": {"host": "127.0.0.1"}},
                  "workers": [{"name": "solo", "port": 6000}]})
    worker = resolve_worker(node)
    assert (worker.grpc_host, worker.grpc_port) == ("127.0.0.1", 6000)
    assert worker.http_port == 8002


def test_three_workers_get_base_port_plus_index():
    node = parse({"base_port": 9500, "metrics_base_port": 9600,
                  "global": {"endpoints": {"host": "127.0.0.1"}},
                  "workers": [{"name": "w0"}, {"name": "w1", "port": 9700}, {"name": "w2"}]})
    ports = [(w.grpc_host, w.grpc_port, w.http_port)
             for w in (resolve_worker(node, i) for i in range(3))]
    assert ports == [("127.0.0.1", 9500, 9600), ("127.0.0.1", 9700, 9601),
                     ("127.0.0.1", 9502, 9602)]


def test_implicit_workers_follow_the_worker_count():
    node = parse({})
    workers = [resolve_worker(node, i, worker_count=3) for i in range(3)]
    assert [w.name for w in workers] == ["worker0", "worker1", "worker2"]
    assert [(w.grpc_port, w.http_port) for w in workers] == \
        [(9001, 9101), (9002, 9102), (9003, 9103)]
    assert all(w.worker_count == 3 for w in workers)
    assert resolve_worker(parse({"gpus": 3}), 2).grpc_port == 9003


def test_port_collisions_are_errors_naming_both_keys():
    message = error_of({"workers": [{"name": "w0"}, {"name": "w1", "port": 9001}]})
    assert message.startswith("workers[1].port: port 9001")
    assert "worker w0's gRPC (base_port + 0)" in message
    message = error_of({"base_port": 8001, "workers": [{"name": "w0"}, {"name": "w1"}]})
    assert message.startswith("base_port + 0: port 8001")
    assert "gateway" in message
    message = error_of({"listen": {"grpc": "0.0.0.0:8001", "http": "0.0.0.0:8001"}})
    assert message.startswith("listen.http: port 8001")


def test_ports_beyond_the_range_are_errors():
    assert error_of({"base_port": 65535, "gpus": 2}).startswith("base_port: worker 1")


def test_resolve_rejects_unknown_workers_and_wrong_counts():
    node = parse({"workers": [{"name": "w0"}, {"name": "w1"}]})
    with pytest.raises(ConfigError, match=r"^worker 'w9': no such worker \(workers: w0, w1\)"):
        resolve_worker(node, "w9")
    with pytest.raises(ConfigError, match="^worker 2: no such worker"):
        resolve_worker(node, 2)
    with pytest.raises(ConfigError, match="^workers: the node file lists 2 workers but 3"):
        resolve_worker(node, 0, worker_count=3)
    with pytest.raises(ConfigError, match=r"^models.r\[0\]: unknown worker 'worker2'"):
        resolve_worker(parse({"models": {"r": ["worker2"]}}), 0, worker_count=2)


# --- errors name the key path --------------------------------------------------------------------

@pytest.mark.parametrize(("data", "message"), [
    ({"global": {"scheduler": {"max_queue_depth": "abc"}}},
     "global.scheduler.max_queue_depth: expected a positive integer, got 'abc'"),
    ({"global": {"scheduler": {"max_queue_depth": 0}}},
     "global.scheduler.max_queue_depth: expected a positive integer, got 0"),
    ({"global": {"runtime": {"bakend": "cpu"}}},
     ("global.runtime.bakend: unknown key (known: allow_cpu_fallback, backend, "
      "device_memory_bytes, mem_fraction, preallocate, weight_cache_fraction, "
      "weight_cache_wiggle_fraction, weight_eviction, weight_miss_overhead_seconds, weight_prefetch, "
      "weight_trace)")),
    ({"global": {"runtime": {"weight_miss_overhead_seconds": -1}}},
     "global.runtime.weight_miss_overhead_seconds: expected"),
    ({"global": {"runtime": {"weight_prefetch": "yes"}}},
     "global.runtime.weight_prefetch: expected one of auto, on, off, got 'yes'"),
    ({"global": {"runtime": {"weight_eviction": "fifo"}}},
     "global.runtime.weight_eviction: expected one of gdsf, lru, got 'fifo'"),
    ({"global": {"runtime": {"weight_eviction": ""}}},
     "global.runtime.weight_eviction: expected one of gdsf, lru, got ''"),
    ({"global": {"runtime": {"weight_trace": 7}}},
     "global.runtime.weight_trace: expected"),
    ({"global": {"runtime": {"backend": "tpu"}}},
     "global.runtime.backend: expected one of cpu, cuda, got 'tpu'"),
    ({"global": {"runtime": {"mem_fraction": 0}}},
     "global.runtime.mem_fraction: expected a number in (0, 1], got 0"),
    ({"global": {"runtime": {"weight_cache_wiggle_fraction": 1.0}}},
     "global.runtime.weight_cache_wiggle_fraction: expected a number in [0, 1), got 1.0"),
    ({"global": {"runtime": {"weight_cache_fraction": float("nan")}}},
     "global.runtime.weight_cache_fraction: expected a number in [0, 1], got nan"),
    ({"global": {"runtime": {"preallocate": 1}}},
     "global.runtime.preallocate: expected true or false, got 1"),
    ({"global": {"runtime": {"device_memory_bytes": True}}},
     "global.runtime.device_memory_bytes: expected a non-negative integer, got true"),
    ({"global": {"scheduler": {"discipline": "lifo"}}},
     "global.scheduler.discipline: expected one of fair, fifo, edf, got 'lifo'"),
    ({"global": {"scheduler": {"ema_halflife_seconds": "30s"}}},
     "global.scheduler.ema_halflife_seconds: expected a positive number, got '30s'"),
    ({"global": {"scheduler": {"models": {"m": {"residency": "gpu"}}}}},
     "global.scheduler.models.m.residency: expected one of device, system, unpinned, got 'gpu'"),
    ({"global": {"scheduler": {"models": {"m": {"max_batch_size": 0}}}}},
     "global.scheduler.models.m.max_batch_size: expected a positive integer or null, got 0"),
    ({"global": {"scheduler": {"models": {"m": {"batch_delay_seconds": -0.001}}}}},
     "global.scheduler.models.m.batch_delay_seconds: expected a non-negative number, got -0.001"),
    ({"global": {"scheduler": {"models": {"m": {"batch_target_rows": 0}}}}},
     "global.scheduler.models.m.batch_target_rows: expected a positive integer or null, got 0"),
    ({"global": {"scheduler": {"models": {"m": {"wieght": 1}}}}},
     ("global.scheduler.models.m.wieght: unknown key (known: batch_delay_seconds, batch_target_rows, max_batch_size, pin_to_gpu, "
      "residency, weight)")),
    ({"global": {"scheduler": {"models": {"m": {"pin_to_gpu": "yes"}}}}},
     "global.scheduler.models.m.pin_to_gpu: expected true or false, got 'yes'"),
    ({"global": {"scheduler": {"models": {"m": {"pin_to_gpu": True, "residency": "system"}}}}},
     "global.scheduler.models.m.pin_to_gpu: contradicts global.scheduler.models.m.residency"),
    ({"global": {"endpoints": {"port": -1}}},
     "global.endpoints.port: expected an integer in [0, 65535] or null, got -1"),
    ({"global": {"endpoints": {"max_concurrent_requests": -1}}},
     "global.endpoints.max_concurrent_requests: expected a non-negative integer, got -1"),
    ({"global": {"endpoints": {"max_held_request_bytes": 0}}},
     "global.endpoints.max_held_request_bytes: expected a positive integer, got 0"),
    ({"global": {"model_control_mode": "auto"}},
     "global.model_control_mode: expected one of dynamic, static, explicit, got 'auto'"),
    ({"global": {"models_include": "resnet50"}},
     "global.models_include: expected a list of names, got 'resnet50'"),
    ({"global": {"runtime": ["cpu"]}}, "global.runtime: expected a mapping, got a list"),
    ({"global": {"workers": []}}, "global.workers: unknown key"),
    ({"wokers": []}, ("wokers: unknown key (known: base_port, gateway, global, gpus, listen, "
                      "logging, metrics_base_port, model_repo, models, supervisor, tracing, workers)")),
    ({"base_port": -5}, "base_port: expected an integer in [1, 65535], got -5"),
    ({"gpus": 0}, ("gpus: expected 'auto', a positive integer or a list of distinct device "
                   "ordinals, got 0")),
    ({"gpus": [0, 0]}, "gpus: expected 'auto'"),
    ({"listen": {"grpc": "8001"}}, "listen.grpc: expected a host:port address, got '8001'"),
    ({"listen": {"metrics": "0.0.0.0:8002"}}, "listen.metrics: unknown key (known: grpc, http, rest)"),
    ({"workers": []}, "workers: expected a non-empty list of worker entries"),
    ({"workers": ["w0"]}, "workers[0]: expected a mapping, got 'w0'"),
    ({"workers": [{"name": "w0"}, {"gpu": 1}]}, "workers[1].name: missing"),
    ({"workers": [{"name": "w 0"}]}, "workers[0].name: expected a name of letters"),
    ({"workers": [{"name": "w0"}, {"name": "w0"}]},
     "workers[1].name: duplicate worker name 'w0' (also workers[0])"),
    ({"workers": [{"name": "w0", "port": -1}]},
     "workers[0].port: expected an integer in [0, 65535] or null, got -1"),
    ({"workers": [{"name": "w0", "gpu": -1}]},
     "workers[0].gpu: expected a non-negative integer or null, got -1"),
    ({"workers": [{"name": "w0", "port": 1, "endpoints": {"port": 2}}]},
     "workers[0].port: also set as workers[0].endpoints.port; set one"),
    ({"workers": [{"name": "w0", "runtime": {"backend": "gpu"}}]},
     "workers[0].runtime.backend: expected one of cpu, cuda, got 'gpu'"),
    ({"workers": [{"name": "w0", "scheduler": {"models": {"m": {"weight": 0}}}}]},
     "workers[0].scheduler.models.m.weight: expected a number in [1e-06, 1e+06], got 0"),
    ({"workers": [{"name": "w0", "scheduler": {"models": {"m": {"weight": 5e-324}}}}]},
     "workers[0].scheduler.models.m.weight: expected a number in [1e-06, 1e+06], got 5e-324"),
    ({"workers": [{"name": "w0", "listen": {}}]}, "workers[0].listen: unknown key"),
    ({"workers": [{"name": "w0"}], "models": {"r": ["w0", "w9"]}},
     "models.r[1]: unknown worker 'w9' (workers: w0)"),
    ({"models": {"r": ["w1"]}}, "models.r[0]: unknown worker 'w1'"),
    ({"gpus": 2, "models": {"r": ["worker2"]}},
     "models.r[0]: unknown worker 'worker2' (workers: worker0, worker1;"),
    ({"models": {"r": "worker0"}}, "models.r: expected a list of worker names, got 'worker0'"),
    ({"gateway": ["x"]}, "gateway: expected a mapping, got a list"),
])
def test_errors_name_the_key_path(data: dict, message: str):
    assert error_of(data).startswith(message)


def test_missing_model_repo_and_bad_top_level():
    with pytest.raises(ConfigError, match="^model_repo: missing"):
        parse_node_config({}, BASE)
    with pytest.raises(ConfigError, match="^node file: expected a mapping"):
        parse_node_config(["model_repo"], BASE)


def test_load_reports_unreadable_files_bad_yaml_and_duplicate_keys(tmp_path: Path):
    absent = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError, match=f"^{re.escape(str(absent))}: cannot read the node file"):
        load_node_config(absent)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_repo: x\nglobal:\n  scheduler: [\n  bad: : x\n")
    with pytest.raises(ConfigError) as caught:
        load_node_config(bad)
    # the file, then line:column of the problem, then YAML's own words, all on one line
    assert str(caught.value) == (f"{bad}:4:8: not valid YAML: expected the node content, but found "
                                 "':' (while parsing a flow node)")
    duplicate = tmp_path / "dup.yaml"
    duplicate.write_text("model_repo: a\nglobal:\n  runtime: {}\n  runtime: {}\n")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(duplicate))}:4:3: duplicate key 'runtime'$"):
        load_node_config(duplicate)


def test_load_names_the_file_once_and_variables_without_it(tmp_path: Path):
    node = tmp_path / "node.yaml"
    node.write_text("model_repo: m\nglobal:\n  scheduler: {max_queue_depth: abc}\n")
    with pytest.raises(ConfigError) as caught:
        load_node_config(node)
    assert str(caught.value) == (f"{node}: global.scheduler.max_queue_depth: expected a positive "
                                 "integer, got 'abc'")
    node.write_text("model_repo: m\n")
    with pytest.raises(ConfigError, match="^INFERENCE_SERVER_NOPE: unknown variable"):
        load_node_config(node, {"INFERENCE_SERVER_NOPE": "1"})


# --- environment overrides -----------------------------------------------------------------------

def test_env_overrides_every_section():
    node = parse({"global": {"runtime": {"backend": "cuda"}}}, {
        "INFERENCE_SERVER_RUNTIME_BACKEND": "cpu",
        "INFERENCE_SERVER_RUNTIME_WEIGHT_CACHE_FRACTION": "0.8",
        "INFERENCE_SERVER_RUNTIME_PREALLOCATE": "No",
        "INFERENCE_SERVER_SCHEDULER_DISCIPLINE": "fifo",
        "INFERENCE_SERVER_SCHEDULER_MAX_QUEUE_DEPTH": "7",
        "INFERENCE_SERVER_ENDPOINTS_PORT": "9100",
        "INFERENCE_SERVER_ENDPOINTS_ALLOW_CLIENT_SHM": "1",
        "INFERENCE_SERVER_MODEL_CONTROL_MODE": "static",
        "INFERENCE_SERVER_MODEL_POLL_SECONDS": "2",
        "INFERENCE_SERVER_MODELS_INCLUDE": "a:b",
        "INFERENCE_SERVER_CACHE_DIR": "/tmp/xc",
        "INFERENCE_SERVER_LISTEN_HTTP": "127.0.0.1:9999",
        "UNRELATED": "ignored",
    })
    assert node.runtime == dataclasses.replace(RuntimeConfig(), weight_cache_fraction=0.8,
                                               preallocate=False)
    assert (node.scheduler.discipline, node.scheduler.max_queue_depth) == ("fifo", 7)
    assert (node.endpoints.port, node.endpoints.allow_client_shm) == (9100, True)
    assert node.model_control_mode == "static"
    assert node.model_poll_seconds == 2.0
    assert node.models_include == ("a", "b")
    assert node.cache_dir == Path("/tmp/xc")
    assert node.listen.http == "127.0.0.1:9999"
    worker = resolve_worker(node)
    assert (worker.grpc_port, worker.http_port) == (9100, 9999)


def test_env_overrides_win_over_worker_blocks():
    node = parse({"workers": [{"name": "w0", "runtime": {"backend": "cuda"},
                               "models_include": ["x"]}]},
                 {"INFERENCE_SERVER_RUNTIME_BACKEND": "cpu",
                  "INFERENCE_SERVER_MODELS_INCLUDE": "y"})
    worker = resolve_worker(node)
    assert worker.runtime.backend == "cpu"
    assert worker.models_include == ("y",)


def test_env_model_repo_and_model_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    node = parse_node_config({}, BASE, {"INFERENCE_SERVER_MODEL_REPO": "repo"})
    assert node.model_repo == tmp_path / "repo", "env paths resolve against the working dir"
    node = parse_node_config({"model_repo": "x"}, BASE,
                             {"INFERENCE_SERVER_MODEL_DIRS": "/data/models"})
    assert node.model_repo == Path("/data/models")


def test_env_empty_value_sets_optional_keys_to_null():
    node = parse({"global": {"endpoints": {"port": 9000}}},
                 {"INFERENCE_SERVER_ENDPOINTS_PORT": "", "INFERENCE_SERVER_CACHE_DIR": ""})
    assert node.endpoints.port is None
    assert node.cache_dir is None


@pytest.mark.parametrize(("environ", "message"), [
    ({"INFERENCE_SERVER_RUNTIME_BAKEND": "cpu"},
     "INFERENCE_SERVER_RUNTIME_BAKEND: unknown variable (known: INFERENCE_SERVER_BASE_PORT"),
    ({"INFERENCE_SERVER_SCHEDULER_MODELS": "x"}, "INFERENCE_SERVER_SCHEDULER_MODELS: unknown"),
    ({"INFERENCE_SERVER_GPUS": "2"}, "INFERENCE_SERVER_GPUS: unknown variable"),
    ({"INFERENCE_SERVER_SCHEDULER_MAX_QUEUE_DEPTH": "abc"},
     "INFERENCE_SERVER_SCHEDULER_MAX_QUEUE_DEPTH: expected a positive integer, got 'abc'"),
    ({"INFERENCE_SERVER_SCHEDULER_DISCIPLINE": "lifo"},
     "INFERENCE_SERVER_SCHEDULER_DISCIPLINE: expected one of fair, fifo, edf, got 'lifo'"),
    ({"INFERENCE_SERVER_RUNTIME_PREALLOCATE": "maybe"},
     ("INFERENCE_SERVER_RUNTIME_PREALLOCATE: expected one of true, false, 1, 0, yes, no, "
      "got 'maybe'")),
    ({"INFERENCE_SERVER_RUNTIME_MEM_FRACTION": "1.5"},
     "INFERENCE_SERVER_RUNTIME_MEM_FRACTION: expected a number in (0, 1], got 1.5"),
    ({"INFERENCE_SERVER_ENDPOINTS_PORT": "-1"},
     "INFERENCE_SERVER_ENDPOINTS_PORT: expected an integer in [0, 65535] or null, got -1"),
    ({"INFERENCE_SERVER_LISTEN_GRPC": "localhost"},
     "INFERENCE_SERVER_LISTEN_GRPC: expected a host:port address, got 'localhost'"),
    ({"INFERENCE_SERVER_MODEL_DIRS": "/a:/b"},
     "INFERENCE_SERVER_MODEL_DIRS: expected exactly one directory"),
    ({"INFERENCE_SERVER_MODEL_DIRS": "/a", "INFERENCE_SERVER_MODEL_REPO": "/b"},
     "INFERENCE_SERVER_MODEL_DIRS: conflicts with INFERENCE_SERVER_MODEL_REPO"),
])
def test_bad_env_overrides_name_the_variable(environ: dict[str, str], message: str):
    assert error_of({}, environ).startswith(message)


def test_env_port_on_a_multi_worker_node_collides():
    message = error_of({"gpus": 2}, {"INFERENCE_SERVER_ENDPOINTS_PORT": "9100"})
    assert message.startswith("INFERENCE_SERVER_ENDPOINTS_PORT: port 9100")


# --- one GPU, one cuda worker ----------------------------------------------------------------------

CUDA = {"global": {"runtime": {"backend": "cuda"}}}
SHARED_GPU = ("two workers on one GPU would each claim its memory (runtime.mem_fraction) and fail with "
              "out-of-memory errors while serving: give each cuda worker a GPU of its own")


@pytest.mark.parametrize("data, message", [
    # the same gpu: twice
    ({**CUDA, "workers": [{"name": "a", "gpu": 1}, {"name": "b", "gpu": 1}]},
     "workers[1].gpu: GPU 1 for cuda worker b is already used by cuda worker a (workers[0].gpu)"),
    # a gpu: that is another worker's entry of the gpus: list
    ({**CUDA, "gpus": [2, 3], "workers": [{"name": "a"}, {"name": "b", "gpu": 2}]},
     "workers[1].gpu: GPU 2 for cuda worker b is already used by cuda worker a (gpus[0])"),
    # a worker that names no GPU uses its index: 1 here, which worker a named
    ({**CUDA, "workers": [{"name": "a", "gpu": 1}, {"name": "b"}]},
     "workers[1]: GPU 1 (its index: it sets no gpu:) for cuda worker b is already used by cuda worker a "
     "(workers[0].gpu)"),
    # past the end of a gpus: list, the index again
    ({**CUDA, "gpus": [1], "workers": [{"name": "a"}, {"name": "b"}]},
     "workers[1]: GPU 1 (its index: it sets no gpu:) for cuda worker b is already used by cuda worker a "
     "(gpus[0])"),
    # gpus: N (or auto) does not place an explicit workers: list: each worker's index does
    ({**CUDA, "gpus": 4, "workers": [{"name": "a"}, {"name": "b", "gpu": 0}]},
     "workers[1].gpu: GPU 0 for cuda worker b is already used by cuda worker a (workers[0])"),
    # the backend set per worker, or by the environment, counts
    ({"workers": [{"name": "a", "gpu": 0, "runtime": {"backend": "cuda"}},
                  {"name": "b", "gpu": 0, "runtime": {"backend": "cuda"}}]},
     "workers[1].gpu: GPU 0 for cuda worker b is already used by cuda worker a (workers[0].gpu)"),
])
def test_two_cuda_workers_may_not_share_a_gpu(data: dict, message: str):
    assert error_of(data) == f"{message}; {SHARED_GPU}"


def test_the_environment_backend_counts_for_a_shared_gpu():
    data = {"workers": [{"name": "a", "gpu": 0}, {"name": "b", "gpu": 0}]}
    parse(data)                   # cpu workers: the ordinal is not used
    assert error_of(data, {"INFERENCE_SERVER_RUNTIME_BACKEND": "cuda"}).startswith(
        "workers[1].gpu: GPU 0 for cuda worker b is already used by cuda worker a")


@pytest.mark.parametrize("data", [
    {**CUDA, "gpus": 3}, {**CUDA, "gpus": [4, 1, 0]}, {**CUDA},
    {**CUDA, "workers": [{"name": "a"}, {"name": "b"}, {"name": "c", "gpu": 7}]},
    {**CUDA, "gpus": [1, 0], "workers": [{"name": "a"}, {"name": "b"}]},
    # a cpu worker uses no GPU, whatever ordinal it names
    {**CUDA, "workers": [{"name": "a", "gpu": 0}, {"name": "b", "gpu": 0, "runtime": {"backend": "cpu"}}]},
    {"workers": [{"name": "a", "gpu": 0}, {"name": "b", "gpu": 0}]},
])
def test_cuda_workers_on_distinct_gpus_and_cpu_workers_are_accepted(data: dict):
    node = parse(data)
    workers = [resolve_worker(node, i) for i in range(worker_count(node))]
    on_cuda = [w.device_ordinal for w in workers if w.runtime.backend == "cuda"]
    assert len(set(on_cuda)) == len(on_cuda)


def test_a_worker_without_an_ordinal_uses_its_index():
    """What the supervisor and a worker run on its own open, and what the check above counts."""
    node = parse({**CUDA, "workers": [{"name": "a", "gpu": 3}, {"name": "b"}, {"name": "c"}]})
    workers = [resolve_worker(node, i) for i in range(3)]
    assert [(w.gpu, w.device_ordinal) for w in workers] == [(3, 3), (None, 1), (None, 2)]
    cpu = parse({"workers": [{"name": "a"}, {"name": "b"}, {"name": "c", "gpu": 0}]})
    assert [resolve_worker(cpu, i).device_ordinal for i in range(3)] == [0, 0, 0], "one cpu device"


@pytest.mark.parametrize("data, count", [
    ({}, 1), ({"gpus": "auto"}, 1), ({"gpus": 1}, 1), ({"gpus": 3}, 3), ({"gpus": [0, 5]}, 2),
    ({"gpus": 4, "workers": [{"name": "only"}]}, 1),          # an explicit list fixes the count
    ({"workers": [{"name": "a"}, {"name": "b"}]}, 2),
])
def test_worker_count_follows_the_workers_list_else_gpus(data, count):
    assert worker_count(parse(data)) == count


def test_run_refuses_lpt_packing_over_fair_workers_before_starting_any(caplog):
    from xlaserve.node import run_node
    with caplog.at_level("ERROR", logger="xlaserve.node"):
        assert run_node(parse({"gpus": 2, "gateway": {"scheduling": {"mode": "lpt_packing"}}})) == 2
    assert "lpt_packing, which needs every worker's scheduler.discipline to be fifo or edf" in caplog.text
    assert "worker0, worker1 run fair" in caplog.text


def test_environment_variables_lists_the_documented_examples():
    names = environment_variables()
    for var in ("INFERENCE_SERVER_RUNTIME_BACKEND", "INFERENCE_SERVER_ENDPOINTS_PORT",
                "INFERENCE_SERVER_SCHEDULER_DISCIPLINE", "INFERENCE_SERVER_MODEL_REPO",
                "INFERENCE_SERVER_MODEL_DIRS", "INFERENCE_SERVER_MODELS_INCLUDE",
                "INFERENCE_SERVER_LISTEN_GRPC", "INFERENCE_SERVER_LISTEN_HTTP",
                "INFERENCE_SERVER_RUNTIME_WEIGHT_CACHE_FRACTION",
                "INFERENCE_SERVER_RUNTIME_DEVICE_MEMORY_BYTES"):
        assert var in names


# --- supervisor: and logging: ---------------------------------------------------------------------

def test_supervisor_and_logging_defaults_match_the_documented_values():
    assert SupervisorConfig() == SupervisorConfig(
        restart_backoff_initial_seconds=0.5, restart_backoff_max_seconds=30.0, max_restarts=5,
        restart_window_seconds=60.0, stop_timeout_seconds=30.0)
    assert LoggingConfig() == LoggingConfig(level="info", format="text")


def test_supervisor_and_logging_blocks_are_read_and_env_overrides_win():
    node = parse({"supervisor": {"restart_backoff_initial_seconds": 0.1, "max_restarts": 0,
                                 "stop_timeout_seconds": 0},
                  "logging": {"format": "json"}},
                 {"INFERENCE_SERVER_SUPERVISOR_RESTART_WINDOW_SECONDS": "5",
                  "INFERENCE_SERVER_SUPERVISOR_STOP_TIMEOUT_SECONDS": "2.5",
                  "INFERENCE_SERVER_LOGGING_LEVEL": "debug"})
    assert node.supervisor == SupervisorConfig(restart_backoff_initial_seconds=0.1, max_restarts=0,
                                               restart_window_seconds=5.0, stop_timeout_seconds=2.5)
    assert node.logging == LoggingConfig(level="debug", format="json")
    assert {"INFERENCE_SERVER_SUPERVISOR_MAX_RESTARTS",
            "INFERENCE_SERVER_LOGGING_FORMAT"} <= set(environment_variables())


@pytest.mark.parametrize("data, message", [
    ({"supervisor": {"max_restart": 3}},
     "supervisor.max_restart: unknown key (known: max_restarts, restart_backoff_initial_seconds, "
     "restart_backoff_max_seconds, restart_window_seconds, stop_timeout_seconds)"),
    ({"supervisor": {"max_restarts": -1}},
     "supervisor.max_restarts: expected a non-negative integer, got -1"),
    ({"supervisor": {"max_restarts": 2.5}},
     "supervisor.max_restarts: expected a non-negative integer, got 2.5"),
    ({"supervisor": {"restart_window_seconds": 0}},
     "supervisor.restart_window_seconds: expected a positive number, got 0"),
    ({"supervisor": {"stop_timeout_seconds": "30s"}},
     "supervisor.stop_timeout_seconds: expected a non-negative number, got '30s'"),
    ({"supervisor": {"restart_backoff_initial_seconds": 5, "restart_backoff_max_seconds": 1}},
     "supervisor.restart_backoff_max_seconds: 1 is less than supervisor.restart_backoff_initial_seconds "
     "(5); expected a cap at least as long as the first back-off"),
    ({"supervisor": ["max_restarts"]}, "supervisor: expected a mapping, got a list"),
    ({"logging": {"format": "xml"}}, "logging.format: expected one of text, json, got 'xml'"),
    ({"logging": {"level": "verbose"}},
     "logging.level: expected one of debug, info, warning, error, got 'verbose'"),
    ({"logging": {"colour": True}}, "logging.colour: unknown key (known: format, level)"),
    ({"global": {"supervisor": {}}}, "global.supervisor: unknown key"),
    ({"workers": [{"name": "w0", "logging": {}}]}, "workers[0].logging: unknown key"),
])
def test_supervisor_and_logging_errors_name_the_key(data: dict, message: str):
    assert error_of(data).startswith(message)


def test_a_bad_supervisor_variable_names_it():
    message = error_of({}, {"INFERENCE_SERVER_SUPERVISOR_MAX_RESTARTS": "many"})
    assert message == "INFERENCE_SERVER_SUPERVISOR_MAX_RESTARTS: expected a non-negative integer, got 'many'"


# --- tracing: ------------------------------------------------------------------------------------

def test_tracing_is_off_by_default_and_reaches_every_worker_and_the_gateway():
    from xlaserve.config import embedded_gateway_config
    node = parse({"gpus": 2})
    assert node.tracing == TracingConfig() and node.tracing.enabled is False
    assert TracingConfig().sampling_ratio == 1.0 and TracingConfig().exporter == "otlp"
    on = parse({"gpus": 2, "tracing": {"enabled": True, "sampling_ratio": 0.25, "exporter": "file",
                                       "file": "spans.jsonl", "service_name": "edge"}})
    assert on.tracing.file == BASE / "spans.jsonl"
    assert resolve_worker(on, 1).tracing == on.tracing
    gateway = embedded_gateway_config(on)
    assert gateway.tracing == on.tracing
    # a tracing: block inside gateway: overrides the node's for the gateway alone
    own = parse({"gpus": 2, "tracing": {"enabled": True}, "gateway": {"tracing": {"sampling_ratio": 0.5}}})
    assert embedded_gateway_config(own).tracing == TracingConfig(enabled=True, sampling_ratio=0.5)
    assert resolve_worker(own, 0).tracing.sampling_ratio == 1.0


def test_tracing_variables_override_the_file():
    node = parse({"tracing": {"sampling_ratio": 0.5}},
                 {"INFERENCE_SERVER_TRACING_ENABLED": "true", "INFERENCE_SERVER_TRACING_SAMPLING_RATIO": "0.01"})
    assert node.tracing.enabled is True and node.tracing.sampling_ratio == 0.01


@pytest.mark.parametrize("data, message", [
    ({"tracing": {"enabled": "yes"}}, "tracing.enabled: expected true or false, got 'yes'"),
    ({"tracing": {"sampling_ratio": 1.5}}, "tracing.sampling_ratio: expected a number in [0, 1], got 1.5"),
    ({"tracing": {"sampling_ratio": -0.1}}, "tracing.sampling_ratio: expected a number in [0, 1], got -0.1"),
    ({"tracing": {"exporter": "jaeger"}}, "tracing.exporter: expected one of otlp, file, got 'jaeger'"),
    ({"tracing": {"otlp_endpoint": "localhost:4318"}},
     "tracing.otlp_endpoint: expected an http:// or https:// URL, got 'localhost:4318'"),
    ({"tracing": {"otlp_timeout_seconds": 0}}, "tracing.otlp_timeout_seconds: expected a positive number, got 0"),
    ({"tracing": {"max_queued_spans": 0}}, "tracing.max_queued_spans: expected a positive integer, got 0"),
    ({"tracing": {"service_name": ""}}, "tracing.service_name: expected a non-empty string, got ''"),
    ({"tracing": {"exporter": "file"}},
     "tracing.file: required with tracing.exporter file (the JSON-lines file spans are appended to)"),
    ({"tracing": {"file": "spans.jsonl"}},
     "tracing.file: applies only to tracing.exporter file (tracing.exporter is otlp; otlp sends spans to "
     "tracing.otlp_endpoint)"),
    ({"tracing": {"sample": 0.1}}, "tracing.sample: unknown key (known: enabled, export_interval_seconds, exporter, "
                                   "file, max_queued_spans, otlp_endpoint, otlp_timeout_seconds, sampling_ratio, "
                                   "service_name)"),
    ({"tracing": [1]}, "tracing: expected a mapping, got a list"),
    ({"global": {"tracing": {}}}, "global.tracing: unknown key"),
    ({"gpus": 2, "gateway": {"tracing": {"exporter": "file"}}},
     "gateway.tracing.file: required with gateway.tracing.exporter file"),
])
def test_tracing_errors_name_the_key(data: dict, message: str):
    assert error_of(data).startswith(message)


def test_a_bad_tracing_variable_names_it():
    message = error_of({}, {"INFERENCE_SERVER_TRACING_SAMPLING_RATIO": "half"})
    assert message == "INFERENCE_SERVER_TRACING_SAMPLING_RATIO: expected a number in [0, 1], got 'half'"


def test_split_address():
    assert split_address("0.0.0.0:8001") == ("0.0.0.0", 8001)
    assert split_address("[::]:8001") == ("::", 8001)
    with pytest.raises(ValueError):
        split_address(":8001")


def test_model_import_timeout_seconds_is_a_positive_number_every_worker_gets():
    """The bound on a load's import of model.py (docs/hooks-and-meta.md): 0 or less would fail
    every bundle with hooks, so it is refused with the key's path."""
    for bad in (0, -1, "x", True):
        with pytest.raises(ConfigError, match=r"^global.model_import_timeout_seconds: expected a positive number, "
                                              "got "):
            parse({"global": {"model_import_timeout_seconds": bad}})
    assert resolve_worker(parse({"global": {"model_import_timeout_seconds": 2}})).model_import_timeout_seconds == 2.0
    env = {"INFERENCE_SERVER_MODEL_IMPORT_TIMEOUT_SECONDS": "5"}
    assert resolve_worker(parse({}, env)).model_import_timeout_seconds == 5.0


def test_cache_max_bytes_bounds_the_executable_cache_by_default_and_every_worker_gets_it():
    """Without a bound every re-export and jax upgrade left its executables in cache_dir for good."""
    assert resolve_worker(parse({})).cache_max_bytes == 16 * 1024**3
    for bad in (-1, "x", True, 1.5):
        with pytest.raises(ConfigError, match=r"^global.cache_max_bytes: "):
            parse({"global": {"cache_max_bytes": bad}})
    assert resolve_worker(parse({"global": {"cache_max_bytes": 0}})).cache_max_bytes == 0
    assert resolve_worker(parse({}, {"INFERENCE_SERVER_CACHE_MAX_BYTES": "1000"})).cache_max_bytes == 1000
