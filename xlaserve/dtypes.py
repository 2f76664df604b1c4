"""The one table of tensor element types: manifest code, KServe datatype, NumPy and MLIR names."""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True, slots=True)
class DType:
    code: str          # manifest spelling: "f32"
    kserve: str        # wire spelling: "FP32"
    numpy: np.dtype    # host representation (object for BYTES)
    mlir: str | None   # StableHLO element type: "f32"; None where no module can carry it

    @property
    def itemsize(self) -> int | None:
        """Bytes per element, or None for variable-length BYTES."""
        return None if self.kserve == "BYTES" else self.numpy.itemsize

    def __str__(self) -> str:
        return self.code


_TABLE = (
    DType("b1", "BOOL", np.dtype(np.bool_), "i1"),
    DType("u8", "UINT8", np.dtype(np.uint8), "ui8"),
    DType("u16", "UINT16", np.dtype(np.uint16), "ui16"),
    DType("u32", "UINT32", np.dtype(np.uint32), "ui32"),
    DType("u64", "UINT64", np.dtype(np.uint64), "ui64"),
    DType("i8", "INT8", np.dtype(np.int8), "i8"),
    DType("i16", "INT16", np.dtype(np.int16), "i16"),
    DType("i32", "INT32", np.dtype(np.int32), "i32"),
    DType("i64", "INT64", np.dtype(np.int64), "i64"),
    DType("f16", "FP16", np.dtype(np.float16), "f16"),
    DType("bf16", "BF16", np.dtype(ml_dtypes.bfloat16), "bf16"),
    DType("f32", "FP32", np.dtype(np.float32), "f32"),
    DType("f64", "FP64", np.dtype(np.float64), "f64"),
    # Client-side only (hooks may produce or consume strings); never a module argument.
    DType("bytes", "BYTES", np.dtype(object), None),
)

BY_CODE = {d.code: d for d in _TABLE}
BY_KSERVE = {d.kserve: d for d in _TABLE}
BY_MLIR = {d.mlir: d for d in _TABLE if d.mlir}
EXECUTABLE_CODES = tuple(d.code for d in _TABLE if d.mlir)


def from_numpy(dtype: np.dtype) -> DType:
    """The DType for a NumPy dtype; strings and bytes map to BYTES."""
    dtype = np.dtype(dtype)
    if dtype.kind in "OSU":
        return BY_CODE["bytes"]
    for d in _TABLE:
        if d.numpy == dtype:
            return d
    raise KeyError(f"no KServe datatype for NumPy dtype {dtype}")
