"""The node supervisor behind ``xlaserve run``.

A one-worker node (the only shape so far) runs its worker in this process, serving the public
``listen`` addresses itself.
"""
from __future__ import annotations

import functools
import logging

import trio

from xlaserve.config import NodeConfig, resolve_worker, worker_count

log = logging.getLogger("xlaserve.node")


def run_node(node: NodeConfig, ready_file: str | None = None) -> int:
    from xlaserve.worker.server import serve
    workers = worker_count(node)
    if workers > 1:
        # gpus: N without a workers: list asks for N workers just as a list of N does
        log.error("this node file asks for %d workers (%s); multi-worker nodes (supervisor + gateway) are "
                  "not available yet: run one worker per process with `xlaserve worker NODE --worker NAME`",
                  workers, "its workers: list" if node.workers_explicit else f"gpus: {node.gpus}")
        return 2
    from xlaserve.cli import _ready_writer
    trio.run(functools.partial(serve, resolve_worker(node, 0), ready_callback=_ready_writer(ready_file)))
    return 0
