"""Batch assembly: the requests' rows in one array per input, zero-padded, in memory the cpu
device takes without copying it."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from xlaserve.runtime.pjrt import Device
from xlaserve.runtime.pool import ALIGN
from xlaserve.worker.executor import aligned_empty, assemble


def _model(*inputs: tuple[str, int, type]) -> SimpleNamespace:
    decls = [SimpleNamespace(name=name, batch_axis=axis, dtype=SimpleNamespace(numpy=np.dtype(dtype)))
             for name, axis, dtype in inputs]
    return SimpleNamespace(manifest=SimpleNamespace(executable_inputs=decls))


def _unaligned(a: np.ndarray) -> np.ndarray:
    """``a``'s values in memory that starts 16 bytes past a multiple of ALIGN (as bytes that
    protobuf hands the codec may)."""
    raw = np.empty(a.nbytes + 2 * ALIGN, np.uint8)
    at = (-raw.ctypes.data) % ALIGN + 16
    out = raw[at:at + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def test_rows_are_concatenated_in_order_and_padded_with_zeros():
    rng = np.random.default_rng(0)
    parts = [_unaligned(rng.integers(0, 256, (n, 4, 3), dtype=np.uint8)) for n in (1, 2, 1)]
    [out] = assemble(_model(("x", 0, np.uint8)), [{"x": p} for p in parts], 6)
    assert out.shape == (6, 4, 3) and out.dtype == np.uint8
    np.testing.assert_array_equal(out[:4], np.concatenate(parts))
    assert not out[4:].any()
    assert out.ctypes.data % ALIGN == 0 and out.flags.c_contiguous


def test_another_batch_axis_and_several_inputs():
    a = [np.arange(6, dtype=np.float32).reshape(3, 1, 2), np.full((3, 2, 2), 7, np.float32)]
    b = [np.array([[1]], np.int64), np.array([[2], [3]], np.int64)]
    out_a, out_b = assemble(_model(("a", 1, np.float32), ("b", 0, np.int64)),
                            [{"a": a[0], "b": b[0]}, {"a": a[1], "b": b[1]}], 4)
    np.testing.assert_array_equal(out_a, np.concatenate([*a, np.zeros((3, 1, 2), np.float32)], axis=1))
    np.testing.assert_array_equal(out_b, [[1], [2], [3], [0]])
    assert out_a.ctypes.data % ALIGN == 0 and out_b.ctypes.data % ALIGN == 0


def test_rows_are_converted_to_the_declared_dtype():
    [out] = assemble(_model(("x", 0, np.float32)), [{"x": np.array([[1.5]], np.float64)},
                                                      {"x": np.array([[2]], np.int32)}], 2)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [[1.5], [2.0]])


def test_one_request_that_fills_the_batch_is_not_copied():
    x = np.arange(12, dtype=np.int32).reshape(2, 6)
    [out] = assemble(_model(("x", 0, np.int32)), [{"x": x}], 2)
    assert np.shares_memory(out, x)


@pytest.mark.parametrize("shape,dtype", [((0, 3), np.float32), ((5,), np.uint8), ((2, 3, 7), np.float64)])
def test_aligned_empty(shape, dtype):
    out = aligned_empty(shape, dtype)
    assert out.shape == shape and out.dtype == dtype and out.flags.c_contiguous and out.flags.writeable
    if out.size:                # an empty array's address means nothing (NumPy may not keep it)
        assert out.ctypes.data % ALIGN == 0


def test_the_cpu_device_uses_an_assembled_batch_without_copying_it():
    device = Device("cpu")
    parts = [_unaligned(np.full((1, 64), i, np.uint8)) for i in range(3)]
    [batch] = assemble(_model(("x", 0, np.uint8)), [{"x": p} for p in parts], 4)
    assert device.shares_memory(device._put(batch), batch)
    # the premise: memory only 16-byte aligned (np.concatenate's) is copied by PJRT
    unaligned = _unaligned(batch)
    assert not device.shares_memory(device._put(unaligned), unaligned)
