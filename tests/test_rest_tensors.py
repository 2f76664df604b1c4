"""REST inference bodies <-> gRPC messages (pure): every datatype from JSON, BYTES both ways, the
binary tensor data extension, and errors that name the field."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xlaserve._proto import grpc_service_pb2 as pb
from xlaserve.codec import deserialize_bytes, serialize_bytes
from xlaserve.errors import InvalidArgument
from xlaserve.frontend import rest_tensors
from xlaserve.frontend.rest_tensors import infer_request, infer_response, mapping_json


def _one(datatype: str, shape: list[int], data) -> bytes:
    doc = {"inputs": [{"name": "x", "datatype": datatype, "shape": shape, "data": data}]}
    return infer_request(json.dumps(doc).encode(), None, "m", "").request.raw_input_contents[0]


@pytest.mark.parametrize("datatype,numpy,data", [
    ("BOOL", np.bool_, [[True, False], [False, True]]),
    ("UINT8", np.uint8, [0, 255, 7, 1]), ("UINT16", np.uint16, [0, 65535, 7, 1]),
    ("UINT32", np.uint32, [0, 2 ** 32 - 1, 7, 1]), ("UINT64", np.uint64, [0, 2 ** 64 - 1, 7, 1]),
    ("INT8", np.int8, [-128, 127, 0, 1]), ("INT16", np.int16, [-1, 2, 3, 4]),
    ("INT32", np.int32, [[-(2 ** 31), 2], [3, 2 ** 31 - 1]]), ("INT64", np.int64, [-(2 ** 63), 0, 1, 2 ** 63 - 1]),
    ("FP16", np.float16, [0.5, -1, 2, 3]), ("BF16", ml_dtypes.bfloat16, [0.5, -1, 2, 3]),
    ("FP32", np.float32, [0.25, 1, -2, 3.5]), ("FP64", np.float64, [[0.1, 1], [2, 3]]),
])
def test_every_datatype_from_flat_or_nested_json(datatype, numpy, data):
    raw = _one(datatype, [2, 2], data)
    expected = np.array(data, dtype=numpy).reshape(-1)
    np.testing.assert_array_equal(np.frombuffer(raw, dtype=numpy), expected)


def test_bytes_from_json_strings_and_back_as_json_or_binary():
    raw = _one("BYTES", [1, 3], [["a", "", "héllo"]])
    assert list(deserialize_bytes(raw, 3, "x")) == [b"a", b"", "héllo".encode()]
    response = pb.ModelInferResponse(model_name="m", model_version="1")
    response.outputs.add(name="label", datatype="BYTES", shape=[2])
    response.raw_output_contents.append(serialize_bytes(np.array([b"cat", b"dog"], dtype=object)))
    wanted = infer_request(b'{"inputs":[{"name":"x","datatype":"BYTES","shape":[1],"data":["q"]}]}', None, "m", "")
    body, header = infer_response(response, wanted)
    assert header is None and json.loads(body)["outputs"][0]["data"] == ["cat", "dog"]
    binary = infer_request(b'{"inputs":[{"name":"x","datatype":"BYTES","shape":[1],"data":["q"]}],'
                           b'"outputs":[{"name":"label","parameters":{"binary_data":true}}]}', None, "m", "")
    body, header = infer_response(response, binary)
    doc = json.loads(body[:header])
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == 14
    assert list(deserialize_bytes(body[header:], 2, "label")) == [b"cat", b"dog"]
    response.raw_output_contents[0] = serialize_bytes(np.array([b"\xff", b"ok"], dtype=object))
    with pytest.raises(InvalidArgument, match="not UTF-8 text.*binary_data: true"):
        infer_response(response, wanted)


def test_binary_and_json_inputs_mix_and_parameters_become_typed_parameters():
    header = json.dumps({"id": "r1", "parameters": {"timeout": 5000, "priority": 2.5, "tag": "t", "flag": True},
                         "inputs": [{"name": "a", "datatype": "FP32", "shape": [2],
                                     "parameters": {"binary_data_size": 8}},
                                    {"name": "b", "datatype": "INT32", "shape": [2], "data": [1, 2]},
                                    {"name": "c", "datatype": "FP32", "shape": [1],
                                     "parameters": {"binary_data_size": 4}}]}).encode()
    body = header + np.array([1, 2], np.float32).tobytes() + np.array([3], np.float32).tobytes()
    got = infer_request(body, len(header), "m", "2")
    request = got.request
    assert request.id == "r1" and request.model_version == "2"
    assert request.parameters["timeout"].int64_param == 5000
    assert request.parameters["priority"].double_param == 2.5
    assert request.parameters["tag"].string_param == "t" and request.parameters["flag"].bool_param
    assert "binary_data_size" not in request.inputs[0].parameters
    assert [len(r) for r in request.raw_input_contents] == [8, 8, 4]


@pytest.mark.parametrize("doc,length,message", [
    ({"inputs": [{"name": "x", "datatype": "INT8", "shape": [2], "data": [1, 300]}]}, None,
     "input 'x': a value in 'data' does not fit INT8 [-128, 127]"),
    ({"inputs": [{"name": "x", "datatype": "UINT64", "shape": [2], "data": [2 ** 64, 0]}]}, None,
     "input 'x': a value in 'data' does not fit UINT64"),
    ({"inputs": [{"name": "x", "datatype": "INT32", "shape": [2], "data": [1, "2"]}]}, None,
     "input 'x': INT32 'data' holds integers, got non-numbers"),
    ({"inputs": [{"name": "x", "datatype": "INT32", "shape": [2], "data": [1, None]}]}, None,
     "input 'x': INT32 'data' holds integers, got non-numbers"),
    ({"inputs": [{"name": "x", "datatype": "BOOL", "shape": [2], "data": [1, 0]}]}, None,
     "input 'x': BOOL 'data' holds true and false"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": ["a", "b"]}]}, None,
     "input 'x': FP32 'data' holds numbers, got non-numbers"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [[1], [2, 3]]}]}, None,
     "input 'x': 'data' is a ragged nested array"),
    ({"inputs": [{"name": "x", "datatype": "BYTES", "shape": [2], "data": ["a", 1]}]}, None,
     "input 'x': BYTES 'data' holds strings, got a number"),
    ({"inputs": [{"name": "x", "datatype": "FP8", "shape": [2], "data": [1, 2]}]}, None,
     "input 'x': 'datatype' must be one of BOOL"),
    ({"inputs": [{"name": "x", "datatype": ["FP32"], "shape": [2], "data": [1, 2]}]}, None,
     "input 'x': 'datatype' must be one of BOOL"),      # a list (unhashable) was a TypeError: 500
    ({"inputs": [{"name": "x", "datatype": {"a": 1}, "shape": [2], "data": [1, 2]}]}, None,
     "got {\"a\": 1}"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, -1], "data": [1, 2]}]}, None,
     "input 'x': 'shape' [2, -1] has a negative dimension"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2 ** 63, 1], "data": [1]}]}, None,
     "input 'x': 'shape' [9223372036854775808, 1] has a dimension past int64"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2]}]}, None, "input 'x' has no 'data'"),
    ({"inputs": []}, None, "'inputs' must be a non-empty array"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1, 1e39]}]}, None,
     "input 'x': a value in 'data' does not fit FP32 (it would become infinite)"),
    ({"inputs": [{"name": "x", "datatype": "FP16", "shape": [2], "data": [1, 70000]}]}, None,
     "input 'x': a value in 'data' does not fit FP16"),
    ({"inputs": [{"name": "x", "datatype": "BF16", "shape": [2], "data": [-1e39, 1]}]}, None,
     "input 'x': a value in 'data' does not fit BF16"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1, 2]}],
      "outputs": [{"name": "y", "parameters": {"binary_data": "yes"}}]}, None,
     "output 'y': parameter 'binary_data' must be true or false, got a string"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1, 2]}],
      "parameters": {"binary_data_output": 1}}, None,
     "the request: parameter 'binary_data_output' must be true or false, got a number"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 9}}]}, 0,
     "input 'x': binary_data_size 9 runs past the end of the body"),
])
def test_errors_name_the_field(doc, length, message):
    header = json.dumps(doc).encode()
    with pytest.raises(InvalidArgument) as info:
        infer_request(header + (b"\0" * 8 if length is not None else b""),
                      len(header) if length is not None else None, "m", "")
    assert message in str(info.value)


def test_bytes_left_after_the_binary_tensors_are_an_error():
    header = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"parameters":{"binary_data_size":4}}]}'
    with pytest.raises(InvalidArgument, match="4 bytes after the JSON header and the binary tensors"):
        infer_request(header + b"\0" * 8, len(header), "m", "")
    with pytest.raises(InvalidArgument, match="Inference-Header-Content-Length is 500"):
        infer_request(header, 500, "m", "")


def _binary_header(**extra) -> bytes:
    return json.dumps({**extra, "inputs": [
        {"name": "a", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}},
        {"name": "r", "datatype": "FP32", "shape": [4], "parameters": {"shared_memory_region": "reg",
                                                                       "shared_memory_byte_size": 16}},
        {"name": "c", "datatype": "INT8", "shape": [3], "parameters": {"binary_data_size": 3}}],
        "outputs": [{"name": "y", "parameters": {"binary_data": True}}, {"name": "z"}]}).encode()


def test_a_binary_header_seen_before_is_translated_from_the_cache_as_a_fresh_parse_would():
    rest_tensors._HEADERS.clear()
    header = _binary_header(parameters={"priority": 2})
    first = infer_request(header + b"A" * 8 + b"bcd", len(header), "m", "1")
    assert len(rest_tensors._HEADERS) == 1
    first.request.raw_input_contents[0] = b"changed"        # the caller's message is its own
    again = infer_request(header + b"E" * 8 + b"fgh", len(header), "m", "1")
    rest_tensors._HEADERS.clear()
    fresh = infer_request(header + b"E" * 8 + b"fgh", len(header), "m", "1")
    # from the cache the binary tensors are views into the body, kept out of the message
    assert [bytes(v) for v in again.raw] == [b"E" * 8, b"fgh"] and all(v.readonly for v in again.raw)
    assert not again.request.raw_input_contents and fresh.raw is None
    whole = pb.ModelInferRequest()
    whole.CopyFrom(again.request)
    whole.raw_input_contents.extend(bytes(v) for v in again.raw)
    assert whole.SerializeToString() == fresh.request.SerializeToString()
    assert again.binary == fresh.binary == frozenset({"y"}) and again.all_binary == fresh.all_binary is False
    other_model = infer_request(header + b"E" * 8 + b"fgh", len(header), "n", "")
    assert other_model.request.model_name == "n" and len(rest_tensors._HEADERS) == 2


def test_a_cached_header_with_a_body_of_another_length_gets_the_fresh_parses_error():
    rest_tensors._HEADERS.clear()
    header = _binary_header()
    infer_request(header + b"\0" * 11, len(header), "m", "")
    with pytest.raises(InvalidArgument, match="2 bytes after the JSON header"):
        infer_request(header + b"\0" * 13, len(header), "m", "")
    with pytest.raises(InvalidArgument, match="binary_data_size 3 runs past the end of the body"):
        infer_request(header + b"\0" * 9, len(header), "m", "")


def test_headers_with_json_data_or_an_id_are_not_cached_and_the_cache_is_bounded():
    rest_tensors._HEADERS.clear()
    mixed = json.dumps({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1.5]},
                                   {"name": "b", "datatype": "INT8", "shape": [1],
                                    "parameters": {"binary_data_size": 1}}]}).encode()
    infer_request(mixed + b"\1", len(mixed), "m", "")
    with_id = _binary_header(id="r1")
    assert infer_request(with_id + b"\0" * 11, len(with_id), "m", "").request.id == "r1"
    infer_request(b'{"inputs":[{"name":"a","datatype":"FP32","shape":[1],"data":[1]}]}', None, "m", "")
    assert rest_tensors._HEADERS == {}
    for i in range(rest_tensors.HEADER_CACHE_ENTRIES + 5):
        infer_request(_binary_header(parameters={"n": i}) + b"\0" * 11, len(_binary_header(parameters={"n": i})),
                      "m", "")
    assert len(rest_tensors._HEADERS) == rest_tensors.HEADER_CACHE_ENTRIES
    assert (_binary_header(parameters={"n": 0}), "m", "") not in rest_tensors._HEADERS       # the oldest left
    big = json.dumps({"parameters": {"pad": "x" * rest_tensors.HEADER_CACHE_BYTES},
                      "inputs": [{"name": "b", "datatype": "INT8", "shape": [1],
                                  "parameters": {"binary_data_size": 1}}]}).encode()
    infer_request(big + b"\1", len(big), "m", "")
    assert (big, "m", "") not in rest_tensors._HEADERS
    rest_tensors._HEADERS.clear()


def test_binary_data_output_asks_for_every_output_unless_one_says_otherwise():
    wanted = infer_request(b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1]}],'
                           b'"parameters":{"binary_data_output":true},'
                           b'"outputs":[{"name":"a"},{"name":"b","parameters":{"binary_data":false}}]}', None, "m", "")
    assert wanted.binary == {"a"}
    assert "binary_data_output" not in wanted.request.parameters
    response = pb.ModelInferResponse(model_name="m", model_version="1")
    for name in ("a", "b"):
        response.outputs.add(name=name, datatype="FP32", shape=[1])
        response.raw_output_contents.append(np.array([2.0], np.float32).tobytes())
    body, header = infer_response(response, wanted)
    doc = json.loads(body[:header])
    assert doc["outputs"][0]["parameters"] == {"binary_data_size": 4} and doc["outputs"][1]["data"] == [2.0]


def test_mapping_json_writes_64_bit_integers_as_numbers_and_zeros_too():
    stats = pb.ModelStatisticsResponse()
    s = stats.model_stats.add(name="m", version="1", inference_count=2 ** 40)
    s.inference_stats.success.count = 3
    doc = mapping_json(stats)
    assert doc["model_stats"][0]["inference_count"] == 2 ** 40
    assert doc["model_stats"][0]["execution_count"] == 0
    assert doc["model_stats"][0]["inference_stats"]["success"] == {"count": 3, "ns": 0}


def test_non_finite_float_outputs_are_written_as_nan_and_infinity_not_null():
    wanted = infer_request(b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1]}]}', None, "m", "")
    response = pb.ModelInferResponse(model_name="m", model_version="1")
    response.outputs.add(name="y", datatype="FP32", shape=[3])
    response.raw_output_contents.append(np.array([np.nan, np.inf, 1.5], np.float32).tobytes())
    body, _ = infer_response(response, wanted)
    assert b'"data":[NaN,Infinity,1.5]' in body


def test_absurdly_nested_data_is_a_400_not_a_crash():
    deep = "[" * 1010 + '"a"' + "]" * 1010      # within orjson's depth, past Python's recursion limit
    body = ('{"inputs":[{"name":"x","datatype":"BYTES","shape":[1],"data":' + deep + "}]}").encode()
    with pytest.raises(InvalidArgument, match="nested more deeply"):
        infer_request(body, None, "m", "")
    body = ('{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":' + deep.replace('"a"', "1") + "}]}").encode()
    with pytest.raises(InvalidArgument, match="input 'x'"):
        infer_request(body, None, "m", "")


@pytest.mark.parametrize("datatype,numpy,values", [
    ("BOOL", np.bool_, [True, False]), ("UINT8", np.uint8, [0, 255]), ("UINT64", np.uint64, [0, 2 ** 64 - 1]),
    ("INT8", np.int8, [-128, 127]), ("INT64", np.int64, [-(2 ** 63), 2 ** 63 - 1]),
    ("FP16", np.float16, [0.1, -65504]), ("BF16", ml_dtypes.bfloat16, [0.1, -3]),
    ("FP32", np.float32, [0.1, np.float32(np.pi)]), ("FP64", np.float64, [0.1, np.pi]),
])
def test_json_outputs_of_every_datatype_read_back_as_the_same_values(datatype, numpy, values):
    wanted = infer_request(b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1]}]}', None, "m", "")
    raw = np.array(values, dtype=numpy) if numpy in (np.uint64, np.int64) else np.array(values).astype(numpy)
    response = pb.ModelInferResponse(model_name="m", model_version="1")
    response.outputs.add(name="y", datatype=datatype, shape=[2])
    response.raw_output_contents.append(raw.tobytes())
    body, header = infer_response(response, wanted)
    data = json.loads(body)["outputs"][0]["data"]
    assert header is None and all(type(v) is type(data[0]) for v in data)
    if raw.dtype.kind in "biu":
        assert data == raw.tolist()             # exact, up to 2**64 - 1
    else:
        assert (np.array(data).astype(numpy) == raw).all()     # a float32 reads back as itself


# ---- any JSON where a request's fields go: translated, or refused naming what was wrong ------------
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["", "x", "FP32", "BYTES", "INT8", "BOOL", "a", "shared_memory_region"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(
        ["name", "datatype", "shape", "data", "parameters", "binary_data", "binary_data_size", "x"]), inner, max_size=4),
    max_leaves=12)
_TENSOR = st.fixed_dictionaries(
    {"name": st.sampled_from(["a", "b"]) | _JSON, "datatype": st.sampled_from(["FP32", "INT8", "UINT64", "BOOL", "BYTES",
                                                                                "FP16", "BF16"]) | _JSON,
     "shape": st.lists(st.integers(0, 3), max_size=2) | _JSON},
    optional={"data": st.lists(st.integers(-300, 2 ** 64) | st.floats(-1e40, 1e40) | st.booleans() | st.text(max_size=2),
                               max_size=6) | _JSON,
              "parameters": st.dictionaries(st.sampled_from(["binary_data_size", "shared_memory_region",
                                                             "shared_memory_byte_size", "x"]), _JSON, max_size=2) | _JSON})
_DOC = st.fixed_dictionaries(
    {"inputs": st.lists(_TENSOR, max_size=3) | _JSON},
    optional={"outputs": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["y"]) | _JSON},
                                                        optional={"parameters": _JSON}), max_size=2) | _JSON,
              "parameters": st.dictionaries(st.sampled_from(["binary_data_output", "timeout", "x"]), _JSON,
                                            max_size=2) | _JSON,
              "id": _JSON}) | _JSON


@settings(max_examples=600, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_DOC, tail=st.none() | st.binary(max_size=16))
def test_any_json_request_is_translated_or_refused_with_invalid_argument(doc, tail):
    # a TypeError or KeyError here would be answered 500 (the handler's bug guard): every mistake
    # a client can make must be a 400 naming it (a list as 'datatype' was one, found this way)
    rest_tensors._HEADERS.clear()
    header = json.dumps(doc).encode()
    try:
        infer_request(header + (tail or b""), len(header) if tail is not None else None, "m", "")
    except InvalidArgument:
        pass
