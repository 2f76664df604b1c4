"""Device.execute keeps every KServe datatype exact on the way in and out, for host arrays of
any layout the codec produces. (With ``jax.device_put`` and x64 off, FP64, INT64 and UINT64
inputs were narrowed to 32 bits before they reached an executable compiled for 64.)"""
from __future__ import annotations

import numpy as np
import pytest

from xlaserve.runtime.pjrt import Device

# (StableHLO element type, NumPy dtype, a value that the type holds exactly and its narrower
# cousin would not)
TYPES = [
    ("f64", np.float64, 1.0 + 2.0 ** -40),
    ("i64", np.int64, 2 ** 40 + 1),
    ("ui64", np.uint64, 2 ** 63 + 5),
    ("f32", np.float32, 1.5),
    ("f16", np.float16, 0.333),
    ("i8", np.int8, -7),
    ("ui8", np.uint8, 250),
    ("i1", np.bool_, True),
]


def _identity_twice(hlo_type: str) -> bytes:
    """main(x: T[2,3]) -> (x, x) : exercises the put, the execution and both outputs."""
    t = f"tensor<2x3x{hlo_type}>"
    return f"""
module @ident {{
  func.func public @main(%x: {t}) -> ({t}, {t}) {{
    return %x, %x : {t}, {t}
  }}
}}
""".encode()


@pytest.fixture(scope="module")
def device() -> Device:
    return Device("cpu")


@pytest.mark.parametrize("hlo_type,dtype,value", TYPES, ids=[t[0] for t in TYPES])
def test_execute_keeps_dtype_and_values(device, hlo_type, dtype, value):
    executable = device.compile(_identity_twice(hlo_type))
    x = np.full((2, 3), value, dtype=dtype)
    x[0, 0] = dtype(0) if dtype is not np.bool_ else False
    for arg in (x, np.asfortranarray(x), np.frombuffer(x.tobytes(), dtype=dtype).reshape(2, 3)):
        outs = device.execute(executable, [arg])
        assert len(outs) == 2
        for out in outs:
            assert out.dtype == np.dtype(dtype)
            assert out.shape == (2, 3)
            np.testing.assert_array_equal(out, x)


def test_execute_outputs_do_not_follow_later_input_changes(device):
    executable = device.compile(_identity_twice("i32"))
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    out = device.execute(executable, [x])[0].copy()
    x += 100
    np.testing.assert_array_equal(out, np.arange(6, dtype=np.int32).reshape(2, 3))
    np.testing.assert_array_equal(device.execute(executable, [x])[0], np.arange(6).reshape(2, 3) + 100)



@pytest.mark.parametrize("hlo_type,dtype,value", TYPES[:3], ids=[t[0] for t in TYPES[:3]])
def test_put_weights_keeps_64_bit_weights(device, hlo_type, dtype, value):
    """A 64-bit weight (PyTorch's BatchNorm num_batches_tracked is i64) reaches an executable
    compiled for it: put_weights once narrowed it to 32 bits and the execution was refused."""
    executable = device.compile(_identity_twice(hlo_type))
    host = np.full((2, 3), value, dtype=dtype)
    (weight,) = device.put_weights([host])
    assert weight.dtype == np.dtype(dtype)
    for out in device.execute(executable, [weight]):
        np.testing.assert_array_equal(out, host)
