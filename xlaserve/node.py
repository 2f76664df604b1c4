"""The node supervisor behind ``xlaserve run``.

A one-worker node (the only shape so far) runs its worker in this process, serving the public
``listen`` addresses itself.
"""
from __future__ import annotations

import functools
import json
import logging
import os

import trio

from xlaserve.config import NodeConfig, WorkerConfig, resolve_worker, worker_count

log = logging.getLogger("xlaserve.node")


def run_node(node: NodeConfig, ready_file: str | None = None) -> int:
    workers = worker_count(node)
    if workers > 1:
        # gpus: N without a workers: list asks for N workers just as a list of N does
        log.error("this node file asks for %d workers (%s); multi-worker nodes (supervisor + gateway) are "
                  "not available yet: run one worker per process with `xlaserve worker NODE --worker NAME`",
                  workers, "its workers: list" if node.workers_explicit else f"gpus: {node.gpus}")
        return 2
    run_worker(resolve_worker(node, 0), ready_file)
    return 0


def run_worker(config: WorkerConfig, ready_file: str | None = None) -> None:
    """Run one worker in this process until it is stopped; with ``ready_file``, its bound
    ports are written there (atomically) once gRPC listens.

    The model repository is checked and both addresses are bound before the runtime (JAX) is
    imported, so those mistakes fail start-up at once (:class:`~xlaserve.errors.StartupError`)."""
    from xlaserve.worker.preflight import claim
    claimed = claim(config)
    try:
        from xlaserve.worker.server import serve
        trio.run(functools.partial(serve, config, claimed=claimed, ready_callback=_ready_writer(ready_file)))
    finally:
        claimed.close()


def _ready_writer(path: str | None):
    if not path:
        return None

    def write(grpc_port: int, http_port: int) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"grpc_port": grpc_port, "http_port": http_port, "pid": os.getpid()}, f)
        os.replace(tmp, path)
    return write
