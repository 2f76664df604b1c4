"""KServe V2 tensors <-> NumPy arrays, validated against a manifest. Pure: no I/O.

The wire is row-major, as are NumPy and StableHLO; manifests name axes column-major, so the
expected wire shape of a tensor is its manifest letters reversed (see :mod:`xlaserve.manifest`).
Decoding is zero-copy where the wire allows: raw contents become ``np.frombuffer`` views.
"""
from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from xlaserve.dtypes import DType
from xlaserve.errors import InvalidArgument
from xlaserve.manifest import TensorDecl

# Which InferTensorContents field carries each datatype (KServe V2 protocol).
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

ShmReader = Callable[[str, object], memoryview]
"""``(tensor_name, tensor_parameters) -> buffer`` or raises; supplied by the shared-memory extension."""


@dataclass(frozen=True, slots=True)
class DecodedInputs:
    arrays: Mapping[str, np.ndarray]
    rows: int                       # the batch size the request carries


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def deserialize_bytes(buf, count: int, name: str) -> np.ndarray:
    """Length-prefixed BYTES elements (uint32 little-endian length, then the bytes)."""
    view = memoryview(buf)
    out = np.empty(count, dtype=object)
    offset = 0
    for i in range(count):
        if offset + 4 > len(view):
            raise InvalidArgument(f"input '{name}': BYTES data ends after {i} of {count} elements")
        (length,) = struct.unpack_from("<I", view, offset)
        offset += 4
        if offset + length > len(view):
            raise InvalidArgument(f"input '{name}': BYTES element {i} claims {length} bytes past the end of the data")
        out[i] = bytes(view[offset:offset + length])
        offset += length
    if offset != len(view):
        raise InvalidArgument(f"input '{name}': {len(view) - offset} trailing bytes after {count} BYTES elements")
    return out


def serialize_bytes(array: np.ndarray) -> bytes:
    parts = []
    for item in array.reshape(-1):
        b = item if isinstance(item, bytes) else str(item).encode()
        parts.append(struct.pack("<I", len(b)))
        parts.append(b)
    return b"".join(parts)


def decode_inputs(request, expected: Sequence[TensorDecl], max_rows: int | None,
                  read_shm: ShmReader | None = None, max_bytes: int | None = None,
                  raw: Sequence | None = None) -> DecodedInputs:
    """Decode and validate a ModelInferRequest's inputs against the model's client inputs.
    ``raw``: its ``raw_input_contents`` when they were kept out of the parsed message (views
    into the received bytes, :func:`xlaserve.wire.split_field`); else the message's own.

    Every error is :class:`InvalidArgument` naming the tensor, what was expected and what was
    sent. ``max_rows`` bounds the batch dimension (the largest compiled batch size).
    ``max_bytes`` bounds what one tensor sent in the message (not through shared memory) may
    declare: ``endpoints.max_recv_msg_bytes``, which its data cannot exceed anyway.

    Shapes are checked before anything is allocated, with exact integers: a shape whose element
    count would overflow int64 (``[2**55, 512]``), a batch past ``max_rows`` or a size past
    ``max_bytes`` is refused by the numbers alone, whatever data comes with it.
    """
    def want() -> str:   # for error messages only: not built on the request path
        return ", ".join(f"'{d.name}' {d.describe()}" for d in expected)
    if raw is None:
        raw = request.raw_input_contents
    inputs = request.inputs

    if len(raw) > len(inputs):
        raise _raw_mismatch(raw, inputs)
    next_raw = 0
    arrays: dict[str, np.ndarray] = {}
    rows: int | None = None
    rows_from = ""
    for tensor in inputs:
        name = tensor.name
        for decl in expected:       # a model has a few inputs: a scan beats building a dict a request
            if decl.name == name:
                break
        else:
            raise InvalidArgument(f"unknown input '{name}'; the model takes {want()}")
        if name in arrays:
            raise InvalidArgument(f"input '{name}' is given twice")
        if tensor.datatype != decl.dtype.kserve:
            raise InvalidArgument(f"input '{name}': expected datatype {decl.dtype.kserve}, got "
                                  f"'{tensor.datatype}'")
        shape = tuple(tensor.shape)     # Python ints already (int64 on the wire)
        _check_shape(name, decl, shape)
        axis = decl.batch_axis
        if axis is not None:
            n = shape[axis]
            if rows is None:
                rows, rows_from = n, tensor.name
            elif n != rows:
                raise InvalidArgument(f"input '{tensor.name}' has batch size {n} but input '{rows_from}' has "
                                      f"{rows}; all inputs of one request share the batch axis")
            if max_rows is not None and n > max_rows:
                raise InvalidArgument(f"input '{tensor.name}': batch size {n} is larger than the largest compiled "
                                      f"batch size {max_rows}")
        count = math.prod(shape)        # exact: np.prod would wrap past int64
        params = tensor.parameters
        in_shm = "shared_memory_region" in params
        if max_bytes is not None and not in_shm:
            _check_size(tensor.name, decl.dtype, shape, count, max_bytes)
        buffer = None
        if in_shm:
            if read_shm is None:
                raise InvalidArgument(f"input '{tensor.name}' names a shared-memory region, but client shared "
                                      "memory is not enabled on this server")
            buffer = read_shm(tensor.name, params)
        elif raw:
            if next_raw == len(raw):
                raise _raw_mismatch(raw, inputs)
            buffer = raw[next_raw]
            next_raw += 1
        if buffer is not None:
            arrays[tensor.name] = _from_buffer(tensor.name, decl.dtype, shape, count, buffer)
        else:
            arrays[tensor.name] = _from_contents(tensor, decl.dtype, shape, count)
    if raw and next_raw != len(raw):
        raise _raw_mismatch(raw, inputs)
    missing = [d.name for d in expected if d.name not in arrays]
    if missing:
        raise InvalidArgument(f"missing input(s) {', '.join(repr(m) for m in missing)}; the model takes {want()}")
    rows = rows if rows is not None else 1
    if rows < 1:
        raise InvalidArgument(f"input '{rows_from}': the batch dimension must be at least 1, got {rows}")
    return DecodedInputs(arrays, rows)


def _raw_mismatch(raw, inputs) -> InvalidArgument:
    """Raw contents belong, in order, to the inputs that are not read from shared memory."""
    inline = sum(1 for t in inputs if "shared_memory_region" not in t.parameters)
    return InvalidArgument(f"raw_input_contents has {len(raw)} entries for {inline} inputs sent inline; "
                           "when raw contents are used, every inline input needs exactly one")


def _check_shape(name: str, decl: TensorDecl, shape: tuple[int, ...]) -> None:
    expected = decl.wire_dims()
    if len(shape) != len(expected):
        ok = False
    else:
        ok = True
        for w, g in zip(expected, shape):
            if w != g and (w != -1 or g < 0):
                ok = False
                break
    if not ok:
        raise InvalidArgument(f"input '{name}': expected shape {_shape_text(expected)} (-1: any batch size), "
                              f"got {_shape_text(shape)}")


def _check_size(name: str, dtype: DType, shape: tuple[int, ...], count: int, max_bytes: int) -> None:
    """Refuse a tensor whose shape alone says it is larger than ``max_bytes`` (a BYTES element
    is at least its 4-byte length prefix on the wire)."""
    size = count * (dtype.itemsize or 4)
    if size > max_bytes:
        raise InvalidArgument(f"input '{name}': shape {_shape_text(shape)} of {dtype.kserve} is {size} bytes, more "
                              f"than a request may carry (endpoints.max_recv_msg_bytes is {max_bytes}); send large "
                              "tensors through shared memory")


def _from_buffer(name: str, dtype: DType, shape: tuple[int, ...], count: int, buffer) -> np.ndarray:
    got = len(buffer) if not isinstance(buffer, memoryview) else buffer.nbytes
    if dtype.kserve == "BYTES":
        if count * 4 > got:         # each element has at least its length prefix
            raise InvalidArgument(f"input '{name}': BYTES{_shape_text(shape)} needs at least {count * 4} bytes "
                                  f"(a 4-byte length per element), got {got}")
        return deserialize_bytes(buffer, count, name).reshape(shape)
    want = count * dtype.itemsize
    if got != want:
        raise InvalidArgument(f"input '{name}': expected {want} bytes for {dtype.kserve}{_shape_text(shape)}, "
                              f"got {got}")
    return np.frombuffer(buffer, dtype=dtype.numpy, count=count).reshape(shape)


def _from_contents(tensor, dtype: DType, shape: tuple[int, ...], count: int) -> np.ndarray:
    name = tensor.name
    field = CONTENTS_FIELD.get(dtype.kserve)
    if field is None:
        raise InvalidArgument(f"input '{name}': {dtype.kserve} can only travel in raw_input_contents")
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise InvalidArgument(f"input '{name}': expected {count} values in contents.{field} for "
                              f"{dtype.kserve}{_shape_text(shape)}, got {len(values)}")
    if dtype.kserve == "BYTES":
        array = np.empty(count, dtype=object)
        array[:] = list(values)
        return array.reshape(shape)
    try:
        return np.asarray(values, dtype=dtype.numpy).reshape(shape)
    except OverflowError:
        raise InvalidArgument(f"input '{name}': a value in contents.{field} does not fit {dtype.kserve}") from None


def encoded_size(array: np.ndarray, dtype: DType) -> int:
    """``len(encode_output(array, dtype))``, without encoding anything: a fixed-size tensor by its
    shape, a BYTES tensor element by element (a 4-byte length, then the bytes)."""
    if dtype.kserve != "BYTES":
        return array.size * np.dtype(dtype.numpy).itemsize
    if array.size == 0:
        return 0
    if array.dtype.kind == "S":         # an element is its bytes up to the trailing NULs
        return 4 * array.size + int(np.char.str_len(array).sum())
    return 4 * array.size + sum(len(item) if isinstance(item, bytes) else len(str(item).encode())
                                for item in array.reshape(-1))


def encode_output(array: np.ndarray, dtype: DType) -> bytes:
    """Raw wire bytes of one output tensor."""
    if dtype.kserve == "BYTES":
        return serialize_bytes(array)
    if array.dtype != dtype.numpy:
        array = array.astype(dtype.numpy)
    return np.ascontiguousarray(array).tobytes()


#: what each kind of InferParameter holds, as an error message says it
_PARAMETER_KINDS = {"bool_param": "a boolean", "string_param": "a string",
                    "double_param": "a floating-point number (REST: any JSON number with a '.' or an exponent, "
                                    "100.0 too)"}


def int_parameter(parameters: Mapping, key: str, owner: str = "", unit: str = "") -> int | None:
    """A request parameter that must be a non-negative integer (``int64_param`` or
    ``uint64_param``): its value, or None when absent. ``owner`` prefixes the error messages
    (``tensor 'x'``); ``unit`` follows "an integer" in them (`` number of microseconds``)."""
    if key not in parameters:
        return None
    prefix = f"{owner}: " if owner else ""
    param = parameters[key]
    which = param.WhichOneof("parameter_choice")
    if which not in ("int64_param", "uint64_param"):
        raise InvalidArgument(f"{prefix}parameter '{key}' must be an integer{unit}, got "
                              f"{_PARAMETER_KINDS.get(which, 'nothing')} ({which})")
    value = getattr(param, which)
    if value < 0:
        raise InvalidArgument(f"{prefix}parameter '{key}' must not be negative, got {value}")
    return value


