"""What a StableHLO module's ``@main`` takes and returns, as plain values: the types
:func:`xlaserve.runtime.pjrt.read_signature` reads from a module, and the error a module with no
usable ``@main`` is.

No JAX: the bundle format (:mod:`xlaserve.bundle`) checks a manifest against these types, and
reading a bundle's manifest or weights must not cost a JAX import (only compiling does).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModuleError", "Signature", "TensorType"]


@dataclass(frozen=True, slots=True)
class TensorType:
    """A ranked tensor type of a module signature, row-major. ``None`` marks a dynamic dim."""

    shape: tuple[int | None, ...]
    element: str  # MLIR element type: f32, ui8, i1, bf16...

    def __str__(self) -> str:
        dims = "".join(f"{'?' if d is None else d}x" for d in self.shape)
        return f"tensor<{dims}{self.element}>"


@dataclass(frozen=True, slots=True)
class Signature:
    inputs: tuple[TensorType, ...]
    outputs: tuple[TensorType, ...]


class ModuleError(ValueError):
    """A module cannot be parsed or has no usable ``@main``."""
