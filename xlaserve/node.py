"""What ``xlaserve run`` and ``xlaserve worker`` do with a node file.

A one-worker node (the only shape ``xlaserve run`` serves so far) runs its worker in this
process, serving the public ``listen`` addresses itself. A node of more workers is refused: no
supervisor starts workers and no gateway fronts them yet; each worker can be run on its own
(:func:`run_worker`, behind ``xlaserve worker``). How many workers a node has is
:func:`plan_workers`'s decision.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from dataclasses import dataclass
from types import MappingProxyType

import trio

from xlaserve.config import NodeConfig, WorkerConfig, resolve_worker, worker_count
from xlaserve.config.schema import split_address
from xlaserve.cpupolicy import WORKER_POLICY_ENV, apply_policy, current_policy
from xlaserve.supervisor import (DEVICE_ISOLATED_ENV, READY_FD_ENV, SUPERVISOR_FD_ENV, ready_writer,
                                 supervisor_exited)

log = logging.getLogger("xlaserve.node")


@dataclass(frozen=True, slots=True)
class WorkerPlan:
    """How many workers a node runs (``count``), which key decided it (``origin``, for
    messages) and, for ``gpus: auto``, the INFO line that says what was detected (``note``)."""

    count: int
    origin: str
    note: str = ""


def plan_workers(node: NodeConfig, detected_gpus: int | None = None, why_none: str = "") -> WorkerPlan:
    """The node's worker count. A ``workers:`` list fixes it; else ``gpus: N`` or a list of N
    ordinals asks for N; else (``gpus: auto``) one worker per GPU that jax's CUDA plugin sees,
    ``detected_gpus``, which is None when GPUs were not counted (the node's backend is ``cpu``).
    No GPU detected (``why_none`` says why) still means one worker, whose backend then decides
    between the cpu fallback and refusing to start. Pure: counting is the caller's job."""
    if node.workers_explicit:
        return WorkerPlan(len(node.workers), "its workers: list")
    if node.gpus != "auto":
        return WorkerPlan(worker_count(node), f"gpus: {node.gpus}" if isinstance(node.gpus, int)
                          else f"gpus: {list(node.gpus)}")
    if detected_gpus is None:
        return WorkerPlan(1, "gpus: auto", "gpus: auto: one worker; GPUs are not counted because "
                                           "runtime.backend is cpu")
    if detected_gpus < 1:
        return WorkerPlan(1, "gpus: auto", f"gpus: auto: no GPU detected ({why_none or 'none seen'}); one worker")
    plural = "s" if detected_gpus != 1 else ""
    return WorkerPlan(detected_gpus, f"gpus: auto, {detected_gpus} GPU{plural} detected",
                      f"gpus: auto: {detected_gpus} GPU{plural} detected; {detected_gpus} worker{plural}")


def detect_gpus(node: NodeConfig) -> tuple[int | None, str]:
    """What :func:`plan_workers` needs for ``gpus: auto``: the GPUs jax's CUDA plugin sees and,
    when none, why; ``(None, '')`` when the count does not matter (explicit ``workers:`` or
    ``gpus``, or a ``cpu`` node). Counting creates no PJRT client, so the worker that later
    opens the device still owns it."""
    if node.workers_explicit or node.gpus != "auto" or node.runtime.backend != "cuda":
        return None, ""
    from xlaserve.runtime.pjrt import probe_cuda
    probe = probe_cuda()
    return probe.devices, probe.problem


def lpt_refusal(node: NodeConfig, mode: str, count: int) -> str:
    """Why the node's gateway cannot run ``lpt_packing`` ('' when it can): the gateway places
    the models and balances the workers, so each worker must dispatch in arrival (``fifo``) or
    deadline (``edf``) order, not share its device ``fair``-ly on its own."""
    if mode != "lpt_packing":
        return ""
    fair = [w.name for w in (resolve_worker(node, i, count) for i in range(count))
            if w.scheduler.discipline == "fair"]
    if not fair:
        return ""
    return (f"gateway.scheduling.mode is lpt_packing, which needs every worker's scheduler.discipline to be "
            f"fifo or edf (the gateway places the models and balances the workers); {', '.join(fair)} "
            f"run{'s' if len(fair) == 1 else ''} fair: set global.scheduler.discipline: fifo")


def tls_refusal(node: NodeConfig, count: int) -> str:
    """Why a node of ``count`` workers cannot serve with ``endpoints.tls`` ('' when it can): its
    embedded gateway has no TLS on either side, so it could neither reach a TLS worker (every
    connection fails its handshake, and the node never serves a request) nor give clients the
    TLS they were promised on its own public port."""
    if count <= 1:
        return ""
    tls = [w.name for w in (resolve_worker(node, i, count) for i in range(count)) if w.endpoints.tls is not None]
    if not tls:
        return ""
    return (f"endpoints.tls is set for {', '.join(tls)}, but this node runs {count} workers behind its embedded "
            "gateway, which has no TLS on either side: it could not reach a TLS worker, and its public port "
            "would be cleartext; serve TLS from a one-worker node, or terminate TLS in front of the gateway "
            "(docs/deployment.md) and remove endpoints.tls")


def run_node(node: NodeConfig, ready_file: str | None = None, node_path: str | None = None) -> int:
    """Serve a node until it is stopped. One worker: in this process, on the node's public
    ports. Two or more: a supervisor runs one worker process each (``xlaserve worker``, from the
    node file at ``node_path``) and the embedded gateway serves the public ports in front of
    them. Returns the exit status (2, after logging why, when the node cannot start)."""
    plan = plan_workers(node, *detect_gpus(node))
    if plan.count <= 1:
        run_worker(resolve_worker(node, 0), ready_file, note=plan.note)
        return 0
    from xlaserve.config import ConfigError
    from xlaserve.config.gateway import embedded_gateway_config
    from xlaserve.gateway.run import WorkerAddress, embedded_gateway
    from xlaserve.supervisor import supervise
    if plan.note:
        log.info("%s", plan.note)
    try:
        gateway = embedded_gateway_config(node, os.environ, worker_count=plan.count)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    problem = lpt_refusal(node, gateway.scheduling.mode, plan.count) or tls_refusal(node, plan.count)
    if problem:
        log.error("%s", problem)
        return 2
    names = [resolve_worker(node, i, plan.count).name for i in range(plan.count)]
    workers = []
    for name, endpoint in zip(names, gateway.endpoints):
        host, port = split_address(endpoint)
        workers.append(WorkerAddress(name, host, port))
    log.info("node: %d workers (%s) behind the gateway on %s, routing %s", plan.count, plan.origin,
             gateway.listen.grpc, gateway.scheduling.mode)
    count = plan.count if not node.workers_explicit and node.gpus == "auto" else None
    from xlaserve.supervisor import worker_specs
    try:
        specs = worker_specs(node_path, node, count)
    except ConfigError as exc:     # a device the supervisor's CUDA_VISIBLE_DEVICES does not show
        log.error("%s", exc)
        return 2
    # the gateway's CPU policy is this process's (it hosts the gateway); the workers take back
    # the one the node was started with
    own = current_policy()
    if apply_policy(gateway.cpu_policy, "the node's supervisor and gateway"):
        specs = tuple(dataclasses.replace(s, env=MappingProxyType({**s.env, WORKER_POLICY_ENV: own})) for s in specs)
    return trio.run(functools.partial(supervise, node_path, node, count=count, specs=specs,
                                      gateway=embedded_gateway(gateway, workers, ready_file=ready_file)))


def run_worker(config: WorkerConfig, ready_file: str | None = None, note: str = "") -> None:
    """Run one worker in this process until it is stopped; with ``ready_file``, its bound
    ports are written there (atomically) once gRPC listens. ``note`` (what ``gpus: auto``
    decided) is logged once the addresses are claimed, so a start-up failure stays one line.

    The model repository is checked and both addresses are bound first, before the runtime
    (JAX) is imported (:func:`~xlaserve.app.preflight.claim`); then the backend is decided and
    its PJRT client configured (:func:`open_backend`). Each fails start-up with a StartupError
    before anything else starts: an address in use, a missing repository, an unusable ``cuda``.

    Started by a supervisor (:mod:`xlaserve.supervisor`), the worker also writes its ports to
    the descriptor in ``XLASERVE_READY_FD``, stops (as on SIGTERM) once the supervisor has
    exited (``XLASERVE_SUPERVISOR_FD``), and opens device ordinal 0 when the supervisor made its
    device the only one visible (``XLASERVE_DEVICE_ISOLATED``)."""
    from xlaserve.app.preflight import claim
    if os.environ.get(DEVICE_ISOLATED_ENV) == "1":
        config = dataclasses.replace(config, gpu=0)
    claimed = claim(config)
    if note:
        log.info("%s", note)
    try:
        from xlaserve.runtime.backend import open_backend
        config = dataclasses.replace(config, runtime=open_backend(config.runtime))
        from xlaserve.app.server import serve
        ready = ready_writer(ready_file, os.environ.get(READY_FD_ENV))
        watch = _supervisor_watch(os.environ.pop(SUPERVISOR_FD_ENV, None))
        trio.run(functools.partial(serve, config, claimed=claimed, ready_callback=ready,
                                   supervisor_exited=watch))
    finally:
        claimed.close()


def _supervisor_watch(fd: str | None):
    """What :func:`~xlaserve.app.server.serve` awaits to learn that this worker's supervisor
    exited, from ``XLASERVE_SUPERVISOR_FD``; None without a usable descriptor (one warning)."""
    if fd is None:
        return None
    try:
        number = int(fd)
        os.set_inheritable(number, False)    # for this worker alone, not the processes it starts
    except (ValueError, OSError) as exc:
        log.warning("%s=%r is not an open descriptor (%s); this worker will not stop when its "
                    "supervisor exits", SUPERVISOR_FD_ENV, fd, exc)
        return None
    return functools.partial(supervisor_exited, number)
