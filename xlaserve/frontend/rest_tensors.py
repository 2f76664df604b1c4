"""Open Inference Protocol REST bodies <-> the gRPC messages the KServe service takes. Pure: no I/O.

A REST inference request becomes the very ``inference.ModelInferRequest`` a gRPC client would
have sent (:func:`infer_request`), so the service behind it (a worker's or the gateway's) runs it
unchanged: admission, deadlines, coalescing, shared memory. Every tensor that travels in the body
(JSON ``data`` or Triton's binary tensor data extension) becomes one ``raw_input_contents``
entry, encoded here from JSON; what is wrong with a tensor is an :class:`InvalidArgument` naming
the field.

The reply goes the other way (:func:`infer_response`): each output is JSON ``data``, or binary
data after the JSON header when the request asked for it (``binary_data`` on the output, or
``binary_data_output`` on the request), with ``Inference-Header-Content-Length`` saying where
the JSON ends.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import orjson

from xlaserve._proto import grpc_service_pb2 as pb
from xlaserve.codec import deserialize_bytes, serialize_bytes
from xlaserve.dtypes import BY_KSERVE
from xlaserve.errors import InvalidArgument

#: the header of Triton's binary tensor data extension: how many bytes of the body are JSON
HEADER_LENGTH = "inference-header-content-length"
#: tensor parameters that describe the HTTP body itself, never passed on to the model
_BODY_PARAMETERS = frozenset({"binary_data_size", "binary_data", "binary_data_output"})
_INT_KINDS = frozenset("iu")


@dataclass(frozen=True, slots=True)
class RestInfer:
    """A REST inference request translated: the gRPC message, and which outputs (by name) the
    client wants as binary data (``all_binary``: ``binary_data_output``, which asks for every
    output the request does not list, and for each listed one without its own ``binary_data``)."""

    request: pb.ModelInferRequest
    binary: frozenset[str]
    all_binary: bool
    #: the binary tensors' bytes as read-only views into the body, when they were kept out of
    #: ``request`` (its raw_input_contents are then empty); None when the request holds them
    raw: tuple[memoryview, ...] | None = None


def parse_json(data: bytes | memoryview, what: str) -> object:
    try:
        return orjson.loads(data)
    except (orjson.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{what} is not valid JSON: {exc}") from None


def set_parameters(target, parameters: object, owner: str) -> None:
    """JSON ``parameters`` into a protobuf ``map<string, InferParameter>``: a bool, an integer,
    a string or a number each becomes its parameter kind."""
    if parameters is None:
        return
    if not isinstance(parameters, dict):
        raise InvalidArgument(f"{owner}: 'parameters' must be a JSON object, got {_kind(parameters)}")
    for key, value in parameters.items():
        if key in _BODY_PARAMETERS:
            continue
        param = target[key]
        if isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int):
            if value >= 2 ** 63:
                if value >= 2 ** 64:
                    raise InvalidArgument(f"{owner}: parameter '{key}' {value} does not fit 64 bits")
                param.uint64_param = value
            elif value < -2 ** 63:
                raise InvalidArgument(f"{owner}: parameter '{key}' {value} does not fit 64 bits")
            else:
                param.int64_param = value
        elif isinstance(value, str):
            param.string_param = value
        elif isinstance(value, float):
            param.double_param = value
        else:
            raise InvalidArgument(f"{owner}: parameter '{key}' must be a bool, a number or a string, got "
                                  f"{_kind(value)}")


def parameters_json(parameters) -> dict:
    """A protobuf ``map<string, InferParameter>`` as a JSON object."""
    out = {}
    for key, param in parameters.items():
        which = param.WhichOneof("parameter_choice")
        if which is not None:
            out[key] = getattr(param, which)
    return out


def _flag(parameters: dict, key: str, owner: str) -> bool | None:
    """A boolean parameter of Triton's binary data extension, or None when it is absent."""
    value = parameters.get(key)
    if value is not None and not isinstance(value, bool):
        raise InvalidArgument(f"{owner}: parameter '{key}' must be true or false, got {_kind(value)}")
    return value


def _kind(value: object) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def _shape(value: object, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in value):
        raise InvalidArgument(f"{where}: 'shape' must be an array of integers, got {json.dumps(value)[:80]}")
    if any(d < 0 for d in value):
        raise InvalidArgument(f"{where}: 'shape' {value} has a negative dimension")
    if any(d >= 2 ** 63 for d in value):     # the message's shape is int64 (assigning it would raise)
        raise InvalidArgument(f"{where}: 'shape' {value} has a dimension past int64 (at most {2 ** 63 - 1})")
    return value


def _flatten_strings(data: object, name: str, out: list[bytes]) -> None:
    if isinstance(data, list):
        for item in data:
            _flatten_strings(item, name, out)
    elif isinstance(data, str):
        out.append(data.encode("utf-8", "surrogatepass"))
    else:
        raise InvalidArgument(f"input '{name}': BYTES 'data' holds strings, got {_kind(data)}")


def json_tensor_bytes(name: str, datatype: str, shape: list[int], data: object) -> bytes:
    """The raw bytes of one JSON input tensor (row-major, flat or nested ``data``), checked
    against its datatype and its element count (the product of ``shape``)."""
    count = 1
    for d in shape:
        count *= d
    what = f"{datatype}[{','.join(map(str, shape))}]"
    if datatype == "BYTES":
        strings: list[bytes] = []
        try:
            _flatten_strings(data, name, strings)
        except RecursionError:
            raise InvalidArgument(f"input '{name}': 'data' is nested more deeply than any shape") from None
        if len(strings) != count:
            raise InvalidArgument(f"input '{name}': 'data' has {len(strings)} elements, {what} needs {count}")
        array = np.empty(count, dtype=object)
        array[:] = strings
        return serialize_bytes(array)
    dtype = BY_KSERVE[datatype]
    if not isinstance(data, list):
        raise InvalidArgument(f"input '{name}': 'data' must be an array of {count} values for {what}, got "
                              f"{_kind(data)}")
    try:
        values = np.array(data)
    except ValueError:
        raise InvalidArgument(f"input '{name}': 'data' is a ragged nested array; give {count} values for "
                              f"{what}, flat or nested by the shape") from None
    if values.size != count:
        raise InvalidArgument(f"input '{name}': 'data' has {values.size} elements, {what} needs {count}")
    if count == 0:
        return b""
    kind = values.dtype.kind
    if datatype == "BOOL":
        if kind != "b":
            raise InvalidArgument(f"input '{name}': BOOL 'data' holds true and false, got {values.dtype.name} values")
    elif dtype.numpy.kind in _INT_KINDS:
        if kind in "fO":
            # integers past int64 (a UINT64's upper half) make NumPy choose float or object:
            # exact Python integers decide
            exact = np.array(data, dtype=object).reshape(-1)
            if all(type(v) is int for v in exact):
                values, kind = exact, "I"       # exact Python integers, checked below
        info = np.iinfo(dtype.numpy)
        if kind == "f" and np.all(np.isfinite(values)) and np.all(values == np.floor(values)) and (
                int(values.min()) < info.min or int(values.max()) > info.max):
            kind = "out"        # integers past 64 bits, which the JSON parser reads as floats
        if kind not in "iuI":
            got = "non-integer numbers" if kind == "f" else "booleans" if kind == "b" else "non-numbers"
            if kind == "out":
                raise InvalidArgument(f"input '{name}': a value in 'data' does not fit {datatype} "
                                      f"[{info.min}, {info.max}]")
            raise InvalidArgument(f"input '{name}': {datatype} 'data' holds integers, got {got}")
        if int(values.min()) < info.min or int(values.max()) > info.max:
            raise InvalidArgument(f"input '{name}': a value in 'data' does not fit {datatype} "
                                  f"[{info.min}, {info.max}]")
        if kind == "I":
            values = np.array(values.tolist(), dtype=dtype.numpy)
    elif kind not in "iuf" or kind == "b":
        raise InvalidArgument(f"input '{name}': {datatype} 'data' holds numbers, got "
                              f"{'booleans' if kind == 'b' else 'non-numbers'}")
    else:
        with np.errstate(over="ignore"):        # a cast past the range is an error below, not a warning
            array = np.ascontiguousarray(values, dtype=dtype.numpy)
        # JSON carries no infinity, so one here is a number past the type's range (1e39 as FP32)
        if array.dtype.itemsize < 8 and not np.isfinite(array).all():
            raise InvalidArgument(f"input '{name}': a value in 'data' does not fit {datatype} (it would become "
                                  "infinite)")
        return array.tobytes()
    return np.ascontiguousarray(values, dtype=dtype.numpy).tobytes()


#: binary-data inference headers already translated (:func:`infer_request`), by (header bytes,
#: model, version): a client sends the same JSON header again and again while only its tensors'
#: bytes change. At most HEADER_CACHE_ENTRIES (the oldest leaves first), each at most
#: HEADER_CACHE_BYTES; only headers whose inputs all travel as binary data or in shared memory,
#: and without an ``id`` (which a client may change with every request)
HEADER_CACHE_ENTRIES = 256
HEADER_CACHE_BYTES = 4096
_HEADERS: dict[tuple[bytes, str, str], tuple[pb.ModelInferRequest, tuple[int, ...], int, frozenset[str], bool]] = {}


def infer_request(body: bytes | memoryview, header_length: int | None, model: str, version: str) -> RestInfer:
    """The gRPC request for a REST inference body. ``header_length``: the value of
    ``Inference-Header-Content-Length`` (the JSON is then the first ``header_length`` bytes,
    and the binary tensors follow in input order), or None when the whole body is JSON.

    A binary-data header seen before is not parsed again: its translation (the message without
    its tensors' bytes; :data:`_HEADERS`) is copied and the binary tensors are cut from the body
    by the sizes it gave (about 1.5 instead of 8 µs for the ``mlp`` request). A body whose length
    does not fit those sizes is parsed afresh, which names what is wrong."""
    key = None
    if header_length is not None and 0 <= header_length <= HEADER_CACHE_BYTES and header_length <= len(body):
        key = (bytes(body[:header_length]), model, version)
        known = _HEADERS.get(key)
        if known is not None:
            template, sizes, total, binary, all_binary = known
            if header_length + total == len(body):
                request = pb.ModelInferRequest()
                request.CopyFrom(template)
                view = memoryview(body).toreadonly()
                raw = []
                offset = header_length
                for size in sizes:      # views: the body is immutable and lives as long as they do
                    raw.append(view[offset:offset + size])
                    offset += size
                return RestInfer(request, binary, all_binary, tuple(raw))
    wanted, sizes = _infer_request(body, header_length, model, version)
    if key is not None and sizes is not None and not wanted.request.id:
        template = pb.ModelInferRequest()
        template.CopyFrom(wanted.request)
        del template.raw_input_contents[:]
        if len(_HEADERS) >= HEADER_CACHE_ENTRIES:
            del _HEADERS[next(iter(_HEADERS))]
        _HEADERS[key] = (template, tuple(sizes), sum(sizes), wanted.binary, wanted.all_binary)
    return wanted


def _infer_request(body: bytes | memoryview, header_length: int | None, model: str,
                   version: str) -> tuple[RestInfer, list[int] | None]:
    """:func:`infer_request` parsed, and the binary tensors' sizes in order (None when an input
    carries JSON ``data``: the translation then holds the data's bytes)."""
    view = memoryview(body)
    if header_length is None:
        header_length = len(view)
    elif header_length > len(view):
        raise InvalidArgument(f"Inference-Header-Content-Length is {header_length}, but the body has only "
                              f"{len(view)} bytes")
    doc = parse_json(view[:header_length], "the inference request")
    if not isinstance(doc, dict):
        raise InvalidArgument(f"the inference request must be a JSON object, got {_kind(doc)}")
    request = pb.ModelInferRequest(model_name=model, model_version=version)
    rid = doc.get("id")
    if rid is not None:
        if not isinstance(rid, str):
            raise InvalidArgument(f"'id' must be a string, got {_kind(rid)}")
        request.id = rid
    set_parameters(request.parameters, doc.get("parameters"), "the request")
    params = doc.get("parameters") or {}
    all_binary = _flag(params, "binary_data_output", "the request") is True
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InvalidArgument("'inputs' must be a non-empty array of tensors")
    offset = header_length
    raw = request.raw_input_contents
    sizes: list[int] | None = []
    for i, spec in enumerate(inputs):
        if not isinstance(spec, dict):
            raise InvalidArgument(f"inputs[{i}] must be a JSON object, got {_kind(spec)}")
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"inputs[{i}]: 'name' must be a non-empty string")
        where = f"input '{name}'"
        datatype = spec.get("datatype")
        if not isinstance(datatype, str) or datatype not in BY_KSERVE:     # (a list or an object is unhashable)
            raise InvalidArgument(f"{where}: 'datatype' must be one of {', '.join(BY_KSERVE)}, got "
                                  f"{json.dumps(datatype)[:40]}")
        shape = _shape(spec.get("shape"), where)
        tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
        tensor_params = spec.get("parameters") or {}
        set_parameters(tensor.parameters, tensor_params, where)
        if "shared_memory_region" in tensor.parameters:
            if "data" in spec or "binary_data_size" in tensor_params:
                raise InvalidArgument(f"{where} names a shared-memory region and also carries data; give one")
            continue
        size = tensor_params.get("binary_data_size")
        if size is not None:
            if "data" in spec:
                raise InvalidArgument(f"{where} has both 'data' and parameter 'binary_data_size'; give one")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise InvalidArgument(f"{where}: parameter 'binary_data_size' must be a non-negative integer")
            if offset + size > len(view):
                raise InvalidArgument(f"{where}: binary_data_size {size} runs past the end of the body "
                                      f"({len(view) - offset} binary bytes left)")
            raw.append(bytes(view[offset:offset + size]))
            if sizes is not None:
                sizes.append(size)
            offset += size
            continue
        if "data" not in spec:
            raise InvalidArgument(f"{where} has no 'data' (nor 'binary_data_size' nor a shared-memory region)")
        raw.append(json_tensor_bytes(name, datatype, shape, spec["data"]))
        sizes = None
    if offset != len(view):
        raise InvalidArgument(f"the body has {len(view) - offset} bytes after the JSON header and the binary tensors "
                              "its binary_data_size parameters account for")
    binary = set()
    outputs = doc.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list):
            raise InvalidArgument(f"'outputs' must be an array, got {_kind(outputs)}")
        for i, spec in enumerate(outputs):
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise InvalidArgument(f"outputs[{i}] must be an object with a 'name'")
            out = request.outputs.add(name=spec["name"])
            out_params = spec.get("parameters") or {}
            set_parameters(out.parameters, out_params, f"output '{out.name}'")
            flag = _flag(out_params, "binary_data", f"output '{out.name}'")
            if flag or (flag is None and all_binary):
                binary.add(out.name)
    return RestInfer(request, frozenset(binary), all_binary), sizes


def _json_values(name: str, datatype: str, shape: list[int], raw: bytes) -> list | np.ndarray:
    """An output's JSON ``data``: a list of strings (BYTES), or a flat NumPy array that orjson
    writes itself (OPT_SERIALIZE_NUMPY; no Python number per element)."""
    count = 1
    for d in shape:
        count *= d
    if datatype == "BYTES":
        items = deserialize_bytes(raw, count, name)
        try:
            return [b.decode("utf-8") for b in items]
        except UnicodeDecodeError:
            raise InvalidArgument(f"output '{name}' holds bytes that are not UTF-8 text, which JSON cannot carry; "
                                  "ask for it as binary data (output parameter binary_data: true)") from None
    dtype = BY_KSERVE[datatype].numpy
    array = np.frombuffer(raw, dtype=dtype, count=count)
    if datatype in ("FP16", "BF16"):
        array = array.astype(np.float32)
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise _NonFinite
    return array


class _NonFinite(Exception):
    """A float output holds NaN or an infinity: orjson would write null, so the standard library
    writes the response (as NaN, Infinity: what Python's and rapidjson's parsers read)."""


def infer_response(response: pb.ModelInferResponse, wanted: RestInfer) -> tuple[bytes, int | None]:
    """The REST body of a gRPC inference reply, and the JSON header's length when binary output
    data follows it (None: the body is all JSON)."""
    doc: dict = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        doc["id"] = response.id
    if response.parameters:
        doc["parameters"] = parameters_json(response.parameters)
    outputs = []
    blobs = []
    nonfinite = False
    raw = response.raw_output_contents
    for i, tensor in enumerate(response.outputs):
        shape = list(tensor.shape)
        out: dict = {"name": tensor.name, "datatype": tensor.datatype, "shape": shape}
        params = parameters_json(tensor.parameters)
        if "shared_memory_region" in params:
            out["parameters"] = params
        elif tensor.name in wanted.binary or (wanted.all_binary and not wanted.request.outputs):
            data = raw[i] if i < len(raw) else b""
            out["parameters"] = {**params, "binary_data_size": len(data)}
            blobs.append(data)
        else:
            if params:
                out["parameters"] = params
            data = raw[i] if i < len(raw) else b""
            try:
                out["data"] = _json_values(tensor.name, tensor.datatype, shape, data)
            except _NonFinite:
                nonfinite = True
                array = np.frombuffer(data, dtype=BY_KSERVE[tensor.datatype].numpy)
                out["data"] = array.astype(np.float64).tolist()
        outputs.append(out)
    doc["outputs"] = outputs
    if nonfinite:
        for out in outputs:
            if isinstance(out.get("data"), np.ndarray):
                out["data"] = out["data"].tolist()
        header = json.dumps(doc, separators=(",", ":")).encode()
    else:
        header = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return header, None
    return b"".join((header, *blobs)), len(header)


def mapping_json(message) -> dict:
    """A protobuf message as JSON-ready data with protobuf's field names, every scalar and list
    field present (zeros included, as Triton writes them), integers as numbers (the proto3 JSON
    mapping writes 64-bit integers as strings; Triton's REST API writes numbers)."""
    from google.protobuf.descriptor import FieldDescriptor
    out = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            if value_field.message_type is not None:
                out[field.name] = {k: mapping_json(v) for k, v in value.items()}
            else:
                out[field.name] = {k: _scalar(value_field, v) for k, v in value.items()}
        elif field.label == FieldDescriptor.LABEL_REPEATED:
            if field.message_type is not None:
                out[field.name] = [mapping_json(v) for v in value]
            else:
                out[field.name] = [_scalar(field, v) for v in value]
        elif field.message_type is not None or field.containing_oneof is not None:
            if message.HasField(field.name):
                out[field.name] = mapping_json(value) if field.message_type is not None else _scalar(field, value)
        else:
            out[field.name] = _scalar(field, value)
    return out


def _scalar(field, value):
    from google.protobuf.descriptor import FieldDescriptor
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values_by_number[value].name if value in field.enum_type.values_by_number else value
    if field.type == FieldDescriptor.TYPE_BYTES:
        return value.decode("utf-8", "replace")
    return value


def loads_object(body: bytes, what: str) -> Mapping:
    """An optional JSON object body (empty: ``{}``)."""
    if not body.strip():
        return {}
    doc = parse_json(body, what)
    if not isinstance(doc, dict):
        raise InvalidArgument(f"{what} must be a JSON object, got {_kind(doc)}")
    return doc
