"""Reading protobuf's wire format directly (xlaserve/wire.py): a ModelInferRequest's
raw_input_contents kept as views into the received bytes, everything else parsed as before;
anything not well-formed left to the parser, which names what is wrong."""
from __future__ import annotations

import numpy as np
import pytest

from xlaserve._proto import grpc_service_pb2 as pb
from xlaserve.errors import InvalidArgument
from xlaserve.frontend.kserve import RAW_INPUT_CONTENTS, SPLIT_RAW_ABOVE, ModelInferWire
from xlaserve.wire import read_varint, split_field


def _request(*raws: bytes) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="img_mean", model_version="2", id="req-7")
    r.parameters["timeout"].int64_param = 5000
    for i, raw in enumerate(raws):
        r.inputs.add(name=f"in{i}", datatype="UINT8", shape=[len(raw)])
        r.raw_input_contents.append(raw)
    r.outputs.add(name="output")
    return r


def test_varints_round_trip_and_a_truncated_one_is_refused():
    assert read_varint(b"\x96\x01", 0) == (150, 2)
    assert read_varint(b"\x00\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 1) == (2**64 - 1, 11)
    with pytest.raises(ValueError, match="truncated"):
        read_varint(b"\x96", 0)


def test_the_raw_contents_come_out_as_views_and_the_rest_parses_as_before():
    raws = [bytes(range(256)) * 3, b"", np.arange(1000, dtype=np.uint8).tobytes()]
    message = _request(*raws)
    data = bytearray(message.SerializeToString())
    rest, values = split_field(data, RAW_INPUT_CONTENTS)
    assert [bytes(v) for v in values] == raws
    assert all(v.readonly and v.obj is data for v in values)         # views into the message: no copy
    parsed = pb.ModelInferRequest.FromString(rest)
    del message.raw_input_contents[:]
    assert parsed == message


def test_fields_after_and_between_the_raw_contents_are_kept_in_order():
    """The wire allows any order: raw contents first, an input after them, then more."""
    head = pb.ModelInferRequest(model_name="m")
    first = pb.ModelInferRequest(raw_input_contents=[b"AAAA"])
    middle = pb.ModelInferRequest(inputs=[pb.ModelInferRequest.InferInputTensor(name="x", datatype="UINT8", shape=[4])])
    last = pb.ModelInferRequest(raw_input_contents=[b"BB"], id="z")
    data = b"".join(m.SerializeToString() for m in (first, head, middle, last))
    rest, values = split_field(data, RAW_INPUT_CONTENTS)
    assert [bytes(v) for v in values] == [b"AAAA", b"BB"]
    whole = pb.ModelInferRequest.FromString(data)
    assert list(whole.raw_input_contents) == [b"AAAA", b"BB"]
    del whole.raw_input_contents[:]
    assert pb.ModelInferRequest.FromString(rest) == whole


@pytest.mark.parametrize("data", [
    _request().SerializeToString(),                              # no raw contents: parse it whole
    _request(b"xyz").SerializeToString()[:-3],                   # truncated inside a field
    b"\x3a\x05abc",                                              # field 7 says 5 bytes, has 3
    b"\x38\x01",                                                 # field 7 as a varint
    b"\x0b\x0c",                                                 # a group (wire type 3)
    b"\x3a\x01a\x0e",                                            # wire type 6 after a good field
    b"\x3a\x01a\x80",                                            # a tag cut short
    b"\x02\x00",                                                 # field number 0
])
def test_what_is_not_well_formed_or_has_no_raw_contents_is_left_to_the_parser(data):
    assert split_field(data, RAW_INPUT_CONTENTS) is None


def test_model_infer_wire_splits_large_requests_only_and_names_a_bad_one():
    small = _request(b"s" * 100).SerializeToString()
    message, raw = ModelInferWire(memoryview(small)).parse()
    assert raw is None and list(message.raw_input_contents) == [b"s" * 100]     # small: parsed whole
    big_raw = np.random.default_rng(1).integers(0, 256, SPLIT_RAW_ABOVE + 1, np.uint8).tobytes()
    big = _request(big_raw).SerializeToString()
    message, raw = ModelInferWire(memoryview(big)).parse()
    assert [bytes(r) for r in raw] == [big_raw] and not message.raw_input_contents
    assert (message.model_name, message.id, message.inputs[0].shape) == ("img_mean", "req-7", [len(big_raw)])
    with pytest.raises(InvalidArgument, match="not a valid inference.ModelInferRequest message"):
        ModelInferWire(memoryview(big + b"\x3a\xff")).parse()      # a raw field cut off at its length


def _random_message(rng) -> bytes:
    """A ModelInferRequest's top-level fields in a random order, raw contents among them, with
    unknown fields of every wire type mixed in (a newer client's)."""
    parts = [pb.ModelInferRequest(raw_input_contents=[rng.bytes(int(rng.integers(0, 300)))]).SerializeToString()
             for _ in range(int(rng.integers(0, 4)))]
    parts += [pb.ModelInferRequest(model_name="m" * int(rng.integers(1, 5))).SerializeToString(),
              pb.ModelInferRequest(id="x").SerializeToString(),
              pb.ModelInferRequest(inputs=[pb.ModelInferRequest.InferInputTensor(name="a", shape=[1, 2])])
              .SerializeToString(),
              b"\xa0\x06\x2a",                   # field 100, varint 42
              b"\xa9\x06" + bytes(8),            # field 101, fixed64
              b"\xb5\x06" + bytes(4),            # field 102, fixed32
              b"\xba\x06\x02hi"]                 # field 103, length-delimited
    order = rng.permutation(len(parts))
    return b"".join(parts[i] for i in order)


def test_splitting_agrees_with_the_parser_on_random_and_damaged_messages():
    """A differential check against upb: on random messages (any field order, unknown fields)
    and on the same messages with bytes flipped or cut, whenever the split gives an answer the
    parser agrees with it: the same message with the raw contents taken out, the same contents
    in the same order, and an error exactly when the whole message is one."""
    rng = np.random.default_rng(28)
    split_some = damaged_agreed = 0
    for trial in range(3000):
        data = bytearray(_random_message(rng))
        if trial % 2 and data:
            for _ in range(int(rng.integers(1, 4))):
                data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
            if rng.random() < 0.3:
                del data[int(rng.integers(0, len(data))):]
        split = split_field(bytes(data), RAW_INPUT_CONTENTS)
        try:
            whole = pb.ModelInferRequest.FromString(bytes(data))
        except Exception:
            whole = None
        if split is None:
            continue
        split_some += 1
        try:
            rest = pb.ModelInferRequest.FromString(split[0])
        except Exception:
            rest = None
        assert (whole is None) == (rest is None), trial
        if whole is not None:
            assert list(whole.raw_input_contents) == [bytes(v) for v in split[1]], trial
            del whole.raw_input_contents[:]
            assert whole.SerializeToString(deterministic=True) == rest.SerializeToString(deterministic=True), trial
            damaged_agreed += trial % 2
    assert split_some > 1000 and damaged_agreed > 50


def test_a_message_of_many_tiny_fields_is_left_to_the_parser_after_a_bounded_scan(monkeypatch):
    """Hostile input: a large message of millions of two-byte fields is not walked in Python to
    its end; the scan stops at MAX_SCANNED_FIELDS and the parser (C) takes it whole."""
    from xlaserve import wire
    reads = []
    monkeypatch.setattr(wire, "read_varint", lambda data, pos: reads.append(pos) or read_varint(data, pos))
    raw = pb.ModelInferRequest(raw_input_contents=[b"x" * 100]).SerializeToString()
    flood = b"\xa0\x06\x00" * 2_000_000                       # field 100 = 0, two million times
    assert split_field(raw + flood, RAW_INPUT_CONTENTS) is None
    assert 0 < len(reads) <= 2 * (wire.MAX_SCANNED_FIELDS + 1)    # a tag and a value a field, then it stopped
    fields = b"\xa0\x06\x00" * (wire.MAX_SCANNED_FIELDS - 1)
    assert split_field(raw + fields, RAW_INPUT_CONTENTS) is not None      # at the bound: split
    assert split_field(raw + fields + b"\xa0\x06\x00", RAW_INPUT_CONTENTS) is None
    message, views = ModelInferWire(memoryview(raw + flood)).parse()      # parsed whole instead
    assert views is None and list(message.raw_input_contents) == [b"x" * 100]
