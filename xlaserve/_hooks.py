"""What a bundle's ``model.py`` imports: :class:`NamedTensor` and :func:`register_model`.

The bundle loader imports ``model.py`` inside :func:`collecting_registrations`, so
``register_model`` calls land in that load's own table; nothing is global.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class NamedTensor:
    """A named NumPy array, row-major, batch included: what hooks take and return."""

    name: str
    data: np.ndarray


@dataclass(frozen=True, slots=True)
class Registration:
    name: str
    preprocess: Callable[[list[NamedTensor]], list[NamedTensor]] | None = None
    postprocess: Callable[[list[NamedTensor]], list[NamedTensor]] | None = None
    run: Callable[..., Any] | None = None


_collector: contextvars.ContextVar[dict[str, Registration] | None] = contextvars.ContextVar(
    "xlaserve_registrations", default=None)


def register_model(name: str, *, preprocess=None, postprocess=None, run=None) -> None:
    """Attach Python hooks to the bundle ``name``. Call it at the top level of ``model.py``.

    ``preprocess(tensors) -> tensors`` maps the client's inputs to the executable's;
    ``postprocess(tensors) -> tensors`` maps the executable's outputs to the client's;
    ``run(tensors, ctx) -> tensors`` is a meta model's whole body (``ctx.infer(model, tensors)``
    calls another model through the scheduler).
    """
    table = _collector.get()
    if table is None:
        raise RuntimeError("register_model() is only effective while xlaserve loads a bundle's model.py")
    for label, hook in (("preprocess", preprocess), ("postprocess", postprocess), ("run", run)):
        if hook is not None and not callable(hook):
            raise TypeError(f"register_model('{name}'): {label} must be callable, got {type(hook).__name__}")
    if name in table:
        raise ValueError(f"register_model('{name}') was called twice")
    table[name] = Registration(name, preprocess, postprocess, run)


@contextlib.contextmanager
def collecting_registrations() -> Iterator[dict[str, Registration]]:
    table: dict[str, Registration] = {}
    token = _collector.set(table)
    try:
        yield table
    finally:
        _collector.reset(token)
