"""Making bundles: a JAX function, a Flax model or a PyTorch module as a verified xlaserve bundle
(``xlaserve export``, docs/export.md).

The rooms, each one route or one step of every route:

- :mod:`~xlaserve.export.spec`: the vocabulary every route shares (tensor specs, dtypes, errors);
  pure, no JAX or torch.
- :mod:`~xlaserve.export.writer`: traces a JAX function into modules and writes the bundle.
- :mod:`~xlaserve.export.from_jax`, :mod:`~xlaserve.export.from_flax`,
  :mod:`~xlaserve.export.from_torch` (with :mod:`~xlaserve.export.torch_rewrites`): the routes.
- :mod:`~xlaserve.export.verify`: runs every module as the server would, against the source.
- :mod:`~xlaserve.export.cli`: the command line.

The names below are the package's face. Each is imported from its room when it is first used,
so that importing the package (or its command line) loads none of JAX, Flax or torch until an
export needs them: ``from xlaserve.export import TensorSpec`` costs NumPy alone, and only
``export_torch`` imports torch.
"""
from __future__ import annotations

import importlib
from typing import Any

#: Public name -> the room of this package that defines it.
_ROOMS = {
    **dict.fromkeys(["DTYPES", "ExportError", "TensorSpec", "TracingError", "dtype_code",
                     "module_file_name", "row_major_shape"], "spec"),
    **dict.fromkeys(["MANIFEST_FILE", "WEIGHTS_FILE", "check_64_bit_types", "export_bundle",
                     "write_bundle"], "writer"),
    **dict.fromkeys(["JaxExport", "default_axes", "export_jax", "flatten_params", "hooks_skeleton",
                     "infer_outputs", "output_specs"], "from_jax"),
    **dict.fromkeys(["export_flax", "flax_function", "flax_kind"], "from_flax"),
    **dict.fromkeys(["ROUTES", "TorchExport", "export_torch", "module_from", "state_weights",
                     "to_numpy", "to_torch"], "from_torch"),
    **dict.fromkeys(["DEFAULT_TOLERANCES", "OutputCheck", "Verification", "VerificationError",
                     "compare", "output_scale", "sample_inputs", "tolerance", "verify_bundle"],
                    "verify"),
}

__all__ = sorted(_ROOMS)


def __getattr__(name: str) -> Any:
    room = _ROOMS.get(name)
    if room is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{room}"), name)
    globals()[name] = value          # found once; later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_ROOMS))
