"""The gateway's Linux CPU scheduling policy (``cpu_policy``; docs/gateway.md, "CPU policy").

The gateway relays: each time a client's or a worker's bytes arrive it wakes, handles whatever
has come and goes back to wait. Under Linux's default policy (``SCHED_OTHER``) every such
wake-up may preempt whatever runs on the core (a worker's event loop, XLA's threads, a
co-located client). Under ``SCHED_BATCH`` (``cpu_policy: batch``) they do not: the gateway runs
when a core comes free or the running task's slice ends, and then relays everything that arrived
meanwhile. That pays where clients run on the gateway's cores, and costs a little where the
gateway shares them with workers alone (measured in docs/gateway.md), so ``normal``, which sets
nothing, is the default. With a core to spare neither changes anything.

A policy is set on every thread of the process, and threads started later inherit it. It is
applied at the start of the process, before the event loop: by ``xlaserve gateway``, and by a
multi-worker node's supervisor, whose process hosts the embedded gateway. The supervisor's
workers are separate processes that would inherit it too: each takes back the policy the node
was started with, which the supervisor hands it in :data:`WORKER_POLICY_ENV`.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping

log = logging.getLogger("xlaserve.cpupolicy")

__all__ = ["POLICIES", "WORKER_POLICY_ENV", "apply_policy", "current_policy", "restore_worker_policy"]

#: ``cpu_policy`` values that set a policy -> Linux policies (None where the platform has none);
#: ``normal`` sets nothing: the process keeps the policy it was started with
POLICIES: dict[str, int | None] = {"batch": getattr(os, "SCHED_BATCH", None)}

#: set by a node's supervisor on each worker it starts: ``policy:priority``, the numbers
#: ``sched_getscheduler`` and ``sched_getparam`` gave before the gateway's policy was applied
WORKER_POLICY_ENV = "XLASERVE_WORKER_CPU_POLICY"


def current_policy() -> str:
    """The calling thread's policy and priority as :data:`WORKER_POLICY_ENV` carries them,
    or "" where the platform has no scheduling policies."""
    if not hasattr(os, "sched_getscheduler"):
        return ""
    return f"{os.sched_getscheduler(0)}:{os.sched_getparam(0).sched_priority}"


def apply_policy(name: str, what: str = "the gateway") -> bool:
    """Put this process (its threads, and those started later) under ``cpu_policy`` ``name``:
    ``normal`` sets nothing, ``batch`` :data:`POLICIES`' policy. Returns whether one was set;
    where it cannot be (no such policy on this platform, refused by the system) ``what`` runs
    on as it was, with a warning."""
    if name == "normal":
        return False
    policy = POLICIES[name]
    if policy is None or not hasattr(os, "sched_setscheduler"):
        log.warning("%s runs under the default CPU policy: this platform has no %s scheduling policy "
                    "(cpu_policy %s)", what, name, name)
        return False
    return _set(policy, 0, f"{what} (cpu_policy {name})")


def restore_worker_policy(environ: Mapping[str, str]) -> bool:
    """In a worker a node's supervisor started: take back the policy the node was started with
    (:data:`WORKER_POLICY_ENV`), not the gateway's, which the process inherited. Returns
    whether one was set (False when the variable is absent: a worker started by hand keeps its
    own)."""
    text = environ.get(WORKER_POLICY_ENV, "")
    if not text or not hasattr(os, "sched_setscheduler"):
        return False
    try:
        policy, priority = (int(part) for part in text.split(":"))
    except ValueError:
        log.warning("ignoring %s=%r: expected POLICY:PRIORITY, two integers", WORKER_POLICY_ENV, text)
        return False
    return _set(policy, priority, "this worker (the node's own CPU policy)")


def _set(policy: int, priority: int, what: str) -> bool:
    """Every thread of the process under ``policy``: the calling one, those started later (they
    inherit it) and those a library started before (NumPy's BLAS starts its pool at import)."""
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]       # no /proc: the calling thread, and those it starts from now on
    param = os.sched_param(priority)
    try:
        for tid in threads:
            try:
                os.sched_setscheduler(tid, policy, param)
            except ProcessLookupError:     # a thread that ended meanwhile
                pass
    except (OSError, ValueError) as exc:
        log.warning("could not set the CPU scheduling policy of %s: %s; it runs under the one it has",
                    what, getattr(exc, "strerror", None) or exc)
        return False
    return True
