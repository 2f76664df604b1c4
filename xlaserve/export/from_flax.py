"""Export a Flax model, NNX or Linen, as a verified bundle.

A Flax model becomes the ``fn(params, *inputs)`` and parameter pytree that
:func:`xlaserve.export.from_jax.export_jax` exports, so everything said there (dotted names, binding
order, inferred outputs, verification, dynamic batch) holds here too:

- **NNX** (``flax.nnx.Module``): the model is split into its graph and its state
  (``nnx.split``); the state's arrays (``nnx.Param``, ``nnx.BatchStat`` and any other variable
  but the random-number state) are the parameters, named as the model's attributes name them
  (``linear1.kernel``, ``bn.mean``, ``layers.0.bias``). The module is the model merged back from
  them, switched to inference (``.eval()``: dropout off, batch norm on its running averages), and
  called as ``model(*inputs)``. The model passed in is not changed.
- **Linen** (``flax.linen.Module`` with its ``variables``): the module is
  ``model.apply(variables, *inputs)``; every collection of ``variables`` is stored, named with the
  collection first as Flax's own ``variables`` dict nests them: ``params.Dense_0.kernel``,
  ``batch_stats.BatchNorm_0.mean``. Write the model's ``__call__`` so that its defaults are
  inference (``train=False``).

Flax is imported only when a Flax model is exported (``pip install 'xlaserve[export-flax]'``).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax

from xlaserve.export.from_jax import JaxExport, export_jax
from xlaserve.export.spec import ExportError

__all__ = ["FLAX_KINDS", "export_flax", "flax_function", "flax_kind"]

#: The kinds of Flax model :func:`flax_kind` tells apart.
FLAX_KINDS = ("nnx", "linen")


def flax_kind(obj: Any) -> str | None:
    """``"nnx"`` for an ``nnx.Module`` instance, ``"linen"`` for a ``linen.Module`` instance, else
    None. Imports nothing: an object can only be a Flax model if Flax is already imported."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(obj, nnx.Module):
        return "nnx"
    linen = sys.modules.get("flax.linen")
    if linen is not None and isinstance(obj, linen.Module):
        return "linen"
    return None


def flax_function(model: Any, variables: Any = None) -> tuple[Callable[..., Any], Any]:
    """``(fn, params)`` such that ``fn(params, *inputs)`` runs ``model`` for inference (see the
    module docstring for each kind). ``variables`` are a Linen model's (``model.init``'s result,
    or as restored from a checkpoint); an NNX model carries its own and takes none.

    An object that is not a Flax model, Linen ``variables`` missing or without a ``params``
    collection, or ``variables`` given to an NNX model, is an :class:`ExportError` saying which.
    """
    kind = flax_kind(model)
    if kind == "nnx":
        if variables is not None:
            raise ExportError("an NNX model carries its own state: give no variables (they are for Linen)")
        return _nnx_function(model)
    if kind == "linen":
        if variables is None:
            raise ExportError("a Linen model needs its variables ({'params': ...}, what model.init returns)")
        if not isinstance(variables, Mapping) or "params" not in variables:
            found = sorted(map(str, variables)) if isinstance(variables, Mapping) else type(variables).__name__
            raise ExportError(
                f"Linen variables must be a mapping of collections with 'params' ({{'params': ...,"
                f" 'batch_stats': ...}}, what model.init returns); found {found}: wrap bare"
                " parameters as {'params': params}")

        def linen_fn(variables: Any, *inputs: Any) -> Any:
            return model.apply(variables, *inputs)
        return linen_fn, variables
    raise ExportError(f"{type(model).__module__}.{type(model).__qualname__} is not a Flax model"
                      " (an instance of flax.nnx.Module or flax.linen.Module)")


def _nnx_function(model: Any) -> tuple[Callable[..., Any], Any]:
    from flax import nnx

    # The random-number state (dropout's keys and counters) is no weight: it stays with the
    # graph, a constant of the module (unused once the model is in inference mode).
    graphdef, state, rng_state = nnx.split(model, nnx.Not(nnx.RngState), ...)
    params = nnx.to_pure_dict(state)

    def nnx_fn(params: Any, *inputs: Any) -> Any:
        values = jax.tree_util.tree_map(lambda leaf: leaf, state)    # a copy to fill, per trace
        nnx.replace_by_pure_dict(values, params)
        merged = nnx.merge(graphdef, values, rng_state)
        merged.eval()
        return merged(*inputs)
    return nnx_fn, params


def export_flax(
    out_dir: str | os.PathLike[str],
    model: Any,
    variables: Any = None,
    **options: Any,
) -> JaxExport:
    """Export a Flax ``model`` (NNX, or Linen with its ``variables``) as a bundle at ``out_dir``
    and verify it against the model run by Flax.

    ``options`` are :func:`xlaserve.export.from_jax.export_jax`'s keyword arguments (``inputs`` and
    ``compiled_batch_sizes`` are required; ``dynamic_batch``, ``atol``, ``progress``, ...). Raises
    what ``export_jax`` raises, and :class:`ExportError` for a model :func:`flax_function` refuses.
    """
    fn, params = flax_function(model, variables)
    return export_jax(Path(out_dir), fn, params, **options)
