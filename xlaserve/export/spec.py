"""What an export is made of, whichever route makes it: the tensors of a manifest
(:class:`TensorSpec`), the dtypes a module argument can have (:data:`DTYPES`, :func:`dtype_code`),
the files' names and the errors every route raises (:class:`ExportError`, :class:`TracingError`).

Pure values and checks: nothing here imports JAX or torch, so the JAX, Flax and PyTorch routes
(:mod:`xlaserve.export.from_jax`, :mod:`~xlaserve.export.from_flax`,
:mod:`~xlaserve.export.from_torch`), the bundle writer (:mod:`xlaserve.export.writer`) and the
command line (:mod:`xlaserve.export.cli`) share one vocabulary.
"""
from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from xlaserve.dtypes import BY_CODE, EXECUTABLE_CODES
from xlaserve.manifest import BATCH_AXIS

__all__ = [
    "DTYPES",
    "ExportError",
    "TensorSpec",
    "TracingError",
    "abstract_shape",
    "check_batch_sizes",
    "dtype_code",
    "module_file_name",
    "row_major_shape",
]

#: Manifest dtype code -> NumPy dtype, for every type a module argument can have.
DTYPES: Mapping[str, np.dtype] = types.MappingProxyType(
    {code: BY_CODE[code].numpy for code in EXECUTABLE_CODES}
)

# "np.float32" and "jnp.bfloat16" written as text (a command line, a config) name the same type.
_DTYPE_PREFIXES = ("numpy.", "np.", "jax.numpy.", "jnp.", "torch.")


class ExportError(ValueError):
    """An export that cannot be done as asked: the message names the tensor, weight or batch size."""


def dtype_code(dtype: Any) -> str:
    """The manifest code (``f32``) of a dtype given the way users write one.

    Accepted: a manifest code (``"f32"``), a NumPy/JAX name (``"float32"``, ``"bfloat16"``,
    also as text with a ``np.``/``numpy.``/``jnp.``/``jax.numpy.``/``torch.`` prefix), or a type
    or dtype object (``np.float32``, ``jnp.bfloat16``, ``np.dtype("int8")``, ``torch.float32``).
    Anything else is a ``ValueError`` that lists what is accepted.
    """
    if type(dtype).__module__ == "torch":    # torch.float32 prints as its name; no torch import
        dtype = str(dtype)
    if isinstance(dtype, str):
        text = dtype.strip()
        if text in DTYPES:
            return text
        for prefix in _DTYPE_PREFIXES:
            if text.startswith(prefix):
                text = text[len(prefix):]
                break
        by_name = {np_dtype.name: code for code, np_dtype in DTYPES.items()}
        if text in by_name:
            return by_name[text]
    elif dtype is not None:                  # np.dtype(None) is float64: never a user's choice
        try:
            found = np.dtype(dtype)
        except TypeError:
            found = None
        for code, np_dtype in DTYPES.items():
            if found == np_dtype:
                return code
    names = ", ".join(f"{code} ({np_dtype.name})" for code, np_dtype in DTYPES.items())
    raise ValueError(
        f"unknown dtype {dtype!r}: expected a manifest code or its NumPy/JAX name: {names}"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSpec:
    """One manifest tensor: ``{name, dtype, shape, dims}``.

    ``shape`` names every axis with one letter, fastest-varying first (column-major); ``n`` is the
    batch axis and ``dims`` gives the size of every other letter. A row-major NumPy array lists
    the axes in reverse: NHWC ``[B, 224, 224, 3]`` is ``TensorSpec("x", "u8", "cwhn",
    {"c": 3, "w": 224, "h": 224})``.

    ``dtype`` may be given any way :func:`dtype_code` accepts (``"float32"``, ``np.uint8``,
    ``jnp.bfloat16``); the spec stores the manifest code, so ``TensorSpec("x", np.float32, ...)
    == TensorSpec("x", "f32", ...)``.
    """

    name: str
    dtype: str
    shape: str
    dims: Mapping[str, int] = dataclasses.field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        # A read-only copy: a TensorSpec is a value, and two equal specs must stay equal.
        object.__setattr__(self, "dims", types.MappingProxyType(dict(self.dims)))
        if not self.name:
            raise ValueError("tensor name must not be empty")
        try:
            object.__setattr__(self, "dtype", dtype_code(self.dtype))
        except ValueError as exc:
            raise ValueError(f"tensor {self.name!r}: {exc}") from None
        if not re.fullmatch(r"[a-z]*", self.shape) or len(set(self.shape)) != len(self.shape):
            raise ValueError(
                f"tensor {self.name!r}: shape {self.shape!r} must be distinct lowercase letters,"
                " one per axis"
            )
        expected = set(self.shape) - {BATCH_AXIS}
        if set(self.dims) != expected:
            raise ValueError(
                f"tensor {self.name!r}: dims must name exactly the non-batch axes"
                f" {sorted(expected)} of shape {self.shape!r}, found {sorted(self.dims)}"
            )
        for letter, size in self.dims.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ValueError(
                    f"tensor {self.name!r}: dims[{letter!r}] must be a non-negative int,"
                    f" found {size!r}"
                )

    def row_major(self, batch: int) -> tuple[int, ...]:
        """The row-major (NumPy, StableHLO, wire) shape of this tensor at batch size ``batch``."""
        return row_major_shape(self.shape, self.dims, batch)

    def to_manifest(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": self.shape,
            # Listed in axis order so the manifest reads like the shape string.
            "dims": {letter: self.dims[letter] for letter in self.shape if letter != BATCH_AXIS},
        }


def row_major_shape(shape: str, dims: Mapping[str, int], batch: int) -> tuple[int, ...]:
    """Convert a column-major shape string to a row-major shape.

    The letters are reversed and ``n`` becomes ``batch``::

        >>> row_major_shape("cwhn", {"c": 3, "w": 224, "h": 224}, 8)
        (8, 224, 224, 3)
    """
    try:
        return tuple(batch if letter == BATCH_AXIS else int(dims[letter]) for letter in reversed(shape))
    except KeyError as e:
        raise ValueError(f"shape {shape!r}: no size in dims for axis {e.args[0]!r}") from None


def module_file_name(batch: int | None, *, bytecode: bool = False) -> str:
    """``model.b{N}.mlir`` (StableHLO text) or ``model.b{N}.mlirbc`` (bytecode); ``batch`` None
    names the one module of a dynamic-batch bundle, ``model.mlir`` (``model.mlirbc``)."""
    return f"model{'' if batch is None else f'.b{batch}'}.{'mlirbc' if bytecode else 'mlir'}"


def check_batch_sizes(compiled_batch_sizes: Sequence[int]) -> list[int]:
    """The compiled batch sizes sorted, or a ``ValueError`` naming the one that is not a positive
    int (or the duplicates, or that none was given)."""
    sizes = list(compiled_batch_sizes)
    if not sizes:
        raise ValueError("compiled_batch_sizes must not be empty")
    for size in sizes:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"compiled batch size {size!r} must be a positive int")
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"compiled_batch_sizes {sizes} has duplicates")
    return sorted(sizes)


class TracingError(ExportError):
    """The exported function raised while JAX traced it at one compiled batch size.

    The message names the bundle, the batch size (the symbolic ``b`` of a dynamic-batch export),
    the error and the abstract signature the function was called with (``call``); ``__cause__`` is the function's own exception, with its
    traceback into the user's code. ``stage`` says what was being done ("traced"; a PyTorch
    export that torch-mlir fails to lower says so).
    """

    def __init__(self, bundle: str, batch: int, cause: BaseException, call: str, stage: str = "traced") -> None:
        self.bundle, self.batch, self.cause, self.call = bundle, batch, cause, call
        reason = " ".join(str(cause).split())[:600] or "(no message)"
        super().__init__(
            f"bundle {bundle!r}: the function raised {type(cause).__name__} while being {stage} at"
            f" {'compiled batch size' if isinstance(batch, int) else 'the symbolic batch size'} {batch}:"
            f" {reason}\n  it was called as {call}"
        )


def abstract_shape(shape: Sequence[int], dtype: Any) -> str:
    """``f32[4,512]``: a dtype code and a row-major shape, as the signatures in messages read."""
    try:
        code = dtype_code(dtype)
    except ValueError:
        code = str(np.dtype(dtype))
    return f"{code}[{','.join(str(d) for d in shape)}]"
