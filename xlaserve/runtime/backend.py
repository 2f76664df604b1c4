"""Which backend a worker runs on, and how its device allocator is set up.

:func:`plan_backend` is the decision, a pure function of the ``runtime:`` block and what
:func:`~xlaserve.runtime.pjrt.probe_cuda` found; :func:`open_backend` applies it in the worker
process, before the worker opens its device.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from xlaserve.config import RuntimeConfig
from xlaserve.errors import StartupError
from xlaserve.runtime.pjrt import CudaProbe, configure_client, cuda_client_options, probe_cuda

log = logging.getLogger("xlaserve.runtime")

# The allocator keys, which act on the cuda client only.
_ALLOCATOR_KEYS = ("mem_fraction", "preallocate")


@dataclass(frozen=True, slots=True)
class BackendPlan:
    """What :func:`plan_backend` decided.

    ``backend``: the backend the worker opens. ``client_options``: the cuda client's create
    options (empty on cpu). ``notes``: INFO lines, one per thing in the config that does not
    apply. ``warning``: the one line that says the worker falls back to the cpu, or ''.
    """

    backend: str
    client_options: Mapping[str, str | float | bool] = field(default_factory=lambda: MappingProxyType({}))
    notes: tuple[str, ...] = ()
    warning: str = ""


def plan_backend(runtime: RuntimeConfig, cuda: CudaProbe | None = None) -> BackendPlan:
    """Decide the backend for ``runtime``. ``cuda`` is what :func:`probe_cuda` found in this
    process (needed when ``runtime.backend`` is ``cuda``).

    ``cuda`` that can be used runs on cuda, its allocator set from ``mem_fraction`` and
    ``preallocate``. ``cuda`` that cannot: with ``allow_cpu_fallback`` the worker runs on the cpu
    with one warning naming why; without it, a :class:`StartupError` whose one line names
    ``runtime.backend``, what is missing and how to fix it. On the cpu the allocator keys do not
    apply; values other than the defaults get one note saying so.
    """
    if runtime.backend == "cuda":
        if cuda is None:
            raise ValueError("plan_backend needs the cuda probe when runtime.backend is cuda")
        if cuda.usable:
            return BackendPlan("cuda", MappingProxyType(cuda_client_options(runtime.mem_fraction,
                                                                            runtime.preallocate)))
        if not runtime.allow_cpu_fallback:
            raise StartupError(f"runtime.backend: cuda is not available: {cuda.problem}; {_fix(cuda)}")
        warning = (f"runtime.backend: cuda is not available ({cuda.problem}); running on the cpu because "
                   "runtime.allow_cpu_fallback is true")
        return BackendPlan("cpu", notes=_not_applicable(runtime), warning=warning)
    return BackendPlan(runtime.backend, notes=_not_applicable(runtime))


def _fix(cuda: CudaProbe) -> str:
    fallback = "or set runtime.allow_cpu_fallback: true to run on the cpu instead"
    if not cuda.installed:
        return f'install it with pip install ".[cuda]" (the xlaserve[cuda] extra), {fallback}'
    return f"run on a machine whose NVIDIA GPU and driver the plugin can use, {fallback}"


def _not_applicable(runtime: RuntimeConfig) -> tuple[str, ...]:
    """One note naming the allocator keys set away from their defaults, which a cpu worker
    cannot honour; none when they are at their defaults."""
    defaults = RuntimeConfig()
    changed = [f"runtime.{key}: {_show(getattr(runtime, key))}" for key in _ALLOCATOR_KEYS
               if getattr(runtime, key) != getattr(defaults, key)]
    if not changed:
        return ()
    one = len(changed) == 1
    return (f"{', '.join(changed)} {'is' if one else 'are'} not applicable on the cpu backend "
            f"({'it sizes' if one else 'they size'} the cuda device allocator); ignored",)


def _show(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else f"{value:g}"


def open_backend(runtime: RuntimeConfig) -> RuntimeConfig:
    """Decide and set up this worker process's backend, before its device is opened: probe
    cuda if asked for, log the notes and the fallback warning once, and configure the PJRT
    client (:func:`configure_client`). Returns ``runtime`` with the backend the worker
    actually runs on. Raises :class:`StartupError` when ``cuda`` is asked
    for, cannot be used and no fallback is allowed."""
    plan = plan_backend(runtime, probe_cuda() if runtime.backend == "cuda" else None)
    for note in plan.notes:
        log.info("%s", note)
    if plan.warning:
        log.warning("%s", plan.warning)
    configure_client(plan.backend, plan.client_options)
    if plan.backend == "cuda":
        log.info("cuda device allocator: %s", ", ".join(f"{k}={v}" for k, v in plan.client_options.items()))
    return dataclasses.replace(runtime, backend=plan.backend)
