"""The manual says only what the code does: documented node-file keys, metrics, control RPCs and
commands exist, and every node-file key is read by code that acts on it."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from xlaserve._proto import xlaserve_control_pb2
from xlaserve.config import (EndpointsConfig, ListenConfig, LoggingConfig, ModelSchedConfig,
                             NodeConfig, RuntimeConfig, SchedulerConfig, SupervisorConfig,
                             TlsConfig, TracingConfig, WorkerEntry)
from xlaserve.config.gateway import (GatewayConfig, GatewayGrpcConfig, GatewayListenConfig,
                                     GatewayLoggingConfig, ModelReplicasConfig, SchedulingConfig,
                                     WorkerClientConfig)
from xlaserve.config.resolve import _TOP_KEYS

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
GATEWAY_BLOCKS = (GatewayConfig, GatewayListenConfig, GatewayGrpcConfig, WorkerClientConfig,
                  GatewayLoggingConfig, SchedulingConfig, ModelReplicasConfig)
BLOCKS = (NodeConfig, ListenConfig, RuntimeConfig, SchedulerConfig, ModelSchedConfig,
          EndpointsConfig, TlsConfig, WorkerEntry, SupervisorConfig, LoggingConfig, TracingConfig,
          *GATEWAY_BLOCKS)

# Keys the node file accepts that no code acts on yet, and why. Remove a key from here once the
# code reads it; a key read by nothing must be documented as such.
NOT_READ: dict = {}


def _key_table_rows(text: str) -> list[str]:
    """First cells of the rows of every ``| key | type | default | meaning |`` table."""
    cells, in_table = [], False
    for line in text.splitlines():
        if line.startswith("| key |"):
            in_table = True
        elif not line.startswith("|"):
            in_table = False
        elif in_table and not line.startswith("|---"):
            cells.append(line.split("|")[1])
    return cells


def test_every_key_in_the_node_file_tables_exists():
    known = set(_TOP_KEYS) | {"pin_to_gpu"}
    for cls in BLOCKS:
        known |= {f.name for f in dataclasses.fields(cls)}
    cells = _key_table_rows((ROOT / "docs" / "node-config.md").read_text())
    assert len(cells) > 30
    for cell in cells:
        for key in re.findall(r"`([a-z_]+)`", cell):
            assert key in known, f"docs/node-config.md documents `{key}`, which the schema lacks"


def test_every_gateway_key_is_in_a_key_table():
    # the other direction of the test above, for the gateway's blocks: each key has a table row
    documented = set()
    for cell in _key_table_rows((ROOT / "docs" / "node-config.md").read_text()):
        documented |= set(re.findall(r"`([a-z_]+)`", cell))
    for cls in GATEWAY_BLOCKS:
        for f in dataclasses.fields(cls):
            assert f.name in documented, f"{cls.__name__}.{f.name} has no row in docs/node-config.md"


def test_every_node_file_key_is_read_by_the_code():
    # schema.py declares the keys, fields.py validates them generically and config/gateway.py
    # validates the gateway's; a key counts as read when anything else (resolve.py turning it
    # into a WorkerConfig, the worker, the gateway) reads it
    validation = {ROOT / "xlaserve" / "config" / name for name in ("schema.py", "fields.py", "gateway.py")}
    sources = [p.read_text() for p in (ROOT / "xlaserve").rglob("*.py")
               if p not in validation and p.parent.name not in ("_proto", "bench")]
    unread = []
    for cls in BLOCKS:
        for f in dataclasses.fields(cls):
            pattern = re.compile(rf"\.{f.name}\b")
            if not any(pattern.search(text) for text in sources):
                unread.append((cls.__name__, f.name))
    assert sorted(unread) == sorted(NOT_READ), (
        "node-file keys no code reads (document them as such and list them in NOT_READ), or "
        "NOT_READ entries that are read now: " + repr(set(unread) ^ set(NOT_READ)))


def _metric_names() -> set[str]:
    from prometheus_client import CollectorRegistry

    from xlaserve.metrics import Metrics, WeightCacheMetrics
    from xlaserve.worker.lifecycle import LifecycleMetrics
    metrics = Metrics()
    WeightCacheMetrics(metrics.registry)
    LifecycleMetrics(metrics.registry)
    assert isinstance(metrics.registry, CollectorRegistry)
    from xlaserve.gateway.run import Gateway
    gateway = Gateway([])
    names = set()
    for family in [*metrics.registry.collect(), *gateway.registry.collect()]:
        names.add(family.name)
        if family.type == "counter":
            names.add(f"{family.name}_total")
    return names


def test_every_documented_metric_exists():
    names = _metric_names()
    for doc in DOCS:
        for metric in re.findall(r"`(xlaserve_[a-z_]+)", doc.read_text()):
            if metric.startswith("xlaserve_control"):
                continue      # module names, not metrics
            assert metric in names, f"{doc.name} documents metric {metric}, which does not exist"


def test_the_control_api_table_lists_exactly_the_rpcs():
    service = xlaserve_control_pb2.DESCRIPTOR.services_by_name["WorkerControl"]
    rpcs = {m.name for m in service.methods}
    text = (ROOT / "docs" / "lifecycle.md").read_text().split("## Worker control API", 1)[1]
    documented = set(re.findall(r"^\| `([A-Za-z]+)` \|", text, re.MULTILINE))
    assert documented == rpcs


def test_every_documented_command_exists():
    cli = (ROOT / "xlaserve" / "cli.py").read_text()
    commands = set(re.findall(r'add_parser\("([a-z]+)"', cli))
    assert {"run", "worker", "bench"} <= commands
    for doc in DOCS:
        text = doc.read_text()
        used = re.findall(r"`xlaserve ([a-z]+)[ `]", text)
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.DOTALL):
            used += re.findall(r"^\s*(?:\.venv/bin/)?xlaserve ([a-z]+)\b", block, re.MULTILINE)
        used += re.findall(r"^    (?:\.venv/bin/)?xlaserve ([a-z]+)\b", text, re.MULTILINE)
        for command in used:
            assert command in commands, f"{doc.name} uses `xlaserve {command}`, which does not exist"
