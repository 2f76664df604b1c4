"""Wire <-> NumPy decoding and validation, without a server."""
from __future__ import annotations

import numpy as np
import pytest

from xlaserve._proto import grpc_service_pb2 as pb
from xlaserve.codec import decode_inputs, deserialize_bytes, encode_output, serialize_bytes
from xlaserve.dtypes import BY_CODE
from xlaserve.errors import InvalidArgument
from xlaserve.manifest import parse_manifest

M = parse_manifest({
    "format_version": "2.0",
    "executable_inputs": [
        {"name": "a", "dtype": "i32", "shape": "xn", "dims": {"x": 4}},
        {"name": "b", "dtype": "f16", "shape": "xn", "dims": {"x": 4}}],
    "executable_outputs": [{"name": "y", "dtype": "f32", "shape": "n"}],
    "batching": {"compiled_batch_sizes": [1, 4]}}, "m")


def request(a: np.ndarray, b: np.ndarray, raw=True):
    r = pb.ModelInferRequest(model_name="m")
    r.inputs.add(name="a", datatype="INT32", shape=list(a.shape))
    r.inputs.add(name="b", datatype="FP16", shape=list(b.shape))
    if raw:
        r.raw_input_contents.extend([a.tobytes(), b.tobytes()])
    return r


def test_raw_inputs_decode_as_views():
    a = np.arange(8, dtype=np.int32).reshape(2, 4)
    b = np.ones((2, 4), np.float16)
    d = decode_inputs(request(a, b), M.client_inputs, 4)
    assert d.rows == 2
    np.testing.assert_array_equal(d.arrays["a"], a)
    assert d.arrays["b"].dtype == np.float16
    assert not d.arrays["a"].flags.writeable  # a view of the message bytes, not a copy


def test_typed_contents():
    r = pb.ModelInferRequest(model_name="m")
    t = r.inputs.add(name="a", datatype="INT32", shape=[1, 4])
    t.contents.int_contents.extend([1, 2, 3, 4])
    r.inputs.add(name="b", datatype="FP16", shape=[1, 4])
    with pytest.raises(InvalidArgument, match="FP16 can only travel in raw_input_contents"):
        decode_inputs(r, M.client_inputs, 4)


@pytest.mark.parametrize("mutate, fragment", [
    (lambda r: r.inputs[0].ClearField("datatype") or setattr(r.inputs[0], "datatype", "INT64"),
     "input 'a': expected datatype INT32, got 'INT64'"),
    (lambda r: r.inputs[0].shape.__setitem__(1, 5), "input 'a': expected shape [-1,4] (-1: any batch size), got [2,5]"),
    (lambda r: r.inputs[1].shape.__setitem__(0, 3), "input 'b' has batch size 3 but input 'a' has 2"),
    (lambda r: r.raw_input_contents.__setitem__(0, b"\0" * 4), "input 'a': expected 32 bytes for INT32[2,4], got 4"),
    (lambda r: r.raw_input_contents.pop(), "raw_input_contents has 1 entries for 2 inputs sent inline"),
    (lambda r: (r.inputs.add(name="c", datatype="FP32", shape=[1]), r.raw_input_contents.append(b"\0" * 4)),
     "unknown input 'c'; the model takes 'a' INT32[B,4], 'b' FP16[B,4]"),
    (lambda r: (r.inputs.pop(), r.raw_input_contents.pop()), "missing input(s) 'b'"),
])
def test_bad_inputs_say_what_was_expected(mutate, fragment):
    r = request(np.zeros((2, 4), np.int32), np.zeros((2, 4), np.float16))
    mutate(r)
    with pytest.raises(InvalidArgument) as info:
        decode_inputs(r, M.client_inputs, 4)
    assert fragment in str(info.value)


def test_batch_larger_than_largest_compiled_size():
    r = request(np.zeros((5, 4), np.int32), np.zeros((5, 4), np.float16))
    with pytest.raises(InvalidArgument, match="batch size 5 is larger than the largest compiled batch size 4"):
        decode_inputs(r, M.client_inputs, 4)


def test_bytes_round_trip_and_truncation():
    arr = np.array([b"mild", b"", "severe"], dtype=object)
    wire = serialize_bytes(arr)
    back = deserialize_bytes(wire, 3, "label")
    assert list(back) == [b"mild", b"", b"severe"]
    with pytest.raises(InvalidArgument, match="past the end"):
        deserialize_bytes(wire[:-1], 3, "label")
    with pytest.raises(InvalidArgument, match="trailing bytes"):
        deserialize_bytes(wire + b"x", 3, "label")


def test_encode_output_casts_to_declared_dtype():
    out = encode_output(np.array([1.5, 2.5], np.float64), BY_CODE["f32"])
    assert np.frombuffer(out, np.float32).tolist() == [1.5, 2.5]


def test_raw_contents_skip_inputs_read_from_shared_memory():
    a = np.arange(8, dtype=np.int32).reshape(2, 4)
    b = np.ones((2, 4), np.float16)
    r = request(a, b, raw=False)
    r.inputs[0].parameters["shared_memory_region"].string_param = "region0"
    r.raw_input_contents.append(b.tobytes())  # only the inline input travels raw
    seen = []

    def read_shm(name, params):
        seen.append((name, params["shared_memory_region"].string_param))
        return memoryview(a.tobytes())
    d = decode_inputs(r, M.client_inputs, 4, read_shm)
    assert seen == [("a", "region0")]
    np.testing.assert_array_equal(d.arrays["a"], a)
    np.testing.assert_array_equal(d.arrays["b"], b)


# Absurd shapes (issue 24): refused by their numbers, before anything is allocated.
MB = parse_manifest({
    "format_version": "2.0",
    "executable_inputs": [{"name": "x", "dtype": "f32", "shape": "n"}],
    "executable_outputs": [{"name": "y", "dtype": "f32", "shape": "n"}],
    "client_inputs": [{"name": "t", "dtype": "bytes", "shape": "n"}],
    "batching": {"compiled_batch_sizes": [1]}}, "mb")


@pytest.mark.parametrize("raw", [True, False])
def test_a_shape_whose_element_count_overflows_int64_is_invalid_argument_naming_the_tensor(raw):
    """[2**55, 4] wraps np.prod's int64 to 0, which matched an empty payload before; with no
    batch bound (a meta model) the size bound catches it, with one the batch bound does."""
    r = pb.ModelInferRequest(model_name="m")
    r.inputs.add(name="a", datatype="INT32", shape=[2**55, 4])
    r.inputs.add(name="b", datatype="FP16", shape=[2**55, 4])
    if raw:
        r.raw_input_contents.extend([b"", b""])
    assert int(np.prod([2**55, 4, 4], dtype=np.int64)) == 2**59   # and [2**62, 4] wraps:
    assert int(np.prod([2**62, 4], dtype=np.int64)) == 0
    with pytest.raises(InvalidArgument, match=r"input 'a': shape \[36028797018963968,4\] of INT32 is "
                                              r"576460752303423488 bytes, more than a request may carry "
                                              r"\(endpoints.max_recv_msg_bytes is 1000\)"):
        decode_inputs(r, M.client_inputs, None, max_bytes=1000)
    with pytest.raises(InvalidArgument, match="input 'a': batch size 36028797018963968 is larger than the largest "
                                              "compiled batch size 4"):
        decode_inputs(r, M.client_inputs, 4)
    r.inputs[0].shape[:] = [2**62, 4]
    r.inputs[1].shape[:] = [2**62, 4]
    with pytest.raises(InvalidArgument, match=r"input 'a': expected (73786976294838206464 bytes|18446744073709551616 values)"):
        decode_inputs(r, M.client_inputs, None)     # no size bound: the exact count still refuses it


def test_a_bytes_tensor_claiming_more_elements_than_its_data_can_hold_is_refused_before_allocating():
    r = pb.ModelInferRequest(model_name="mb")
    r.inputs.add(name="t", datatype="BYTES", shape=[2**40])
    r.raw_input_contents.append(b"\0\0\0\0")
    with pytest.raises(InvalidArgument, match=r"input 't': BYTES\[1099511627776\] needs at least 4398046511104 bytes "
                                              r"\(a 4-byte length per element\), got 4"):
        decode_inputs(r, MB.client_inputs, None)
    with pytest.raises(InvalidArgument, match=r"input 't': shape \[1099511627776\] of BYTES is 4398046511104 bytes"):
        decode_inputs(r, MB.client_inputs, None, max_bytes=1 << 20)


def test_shared_memory_inputs_are_not_held_to_the_message_size_bound():
    a = np.arange(8, dtype=np.int32).reshape(2, 4)
    b = np.ones((2, 4), np.float16)
    r = request(a, b, raw=False)
    for t in r.inputs:
        t.parameters["shared_memory_region"].string_param = "r"
    buffers = {"a": memoryview(a.tobytes()), "b": memoryview(b.tobytes())}
    d = decode_inputs(r, M.client_inputs, 4, lambda name, params: buffers[name], max_bytes=8)
    np.testing.assert_array_equal(d.arrays["a"], a)


def test_an_integer_parameter_given_as_a_float_is_refused_saying_what_it_was():
    """REST reads "timeout": 100.0 as a double_param (any JSON number with a '.'); the refusal
    said "a number with a fraction or past 64 bits", which 100.0 is not."""
    from types import MappingProxyType

    import pytest

    from xlaserve._proto import grpc_service_pb2 as pb
    from xlaserve.codec import int_parameter
    from xlaserve.errors import InvalidArgument
    request = pb.ModelInferRequest()
    request.parameters["timeout"].double_param = 100.0
    with pytest.raises(InvalidArgument) as info:
        int_parameter(MappingProxyType(dict(request.parameters)), "timeout", unit=" number of microseconds")
    assert str(info.value) == ("parameter 'timeout' must be an integer number of microseconds, got a floating-point "
                               "number (REST: any JSON number with a '.' or an exponent, 100.0 too) (double_param)")
