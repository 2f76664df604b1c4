"""Reading protobuf's wire format directly, for the few places where parsing a whole message
would copy what only needs to be looked at: the gateway reads a ModelInferRequest's model name
without parsing it, and a large ModelInferRequest's ``raw_input_contents`` are kept as views
into the received bytes instead of the copies a parse makes (two of 150 KB for an ``img_mean``
request: one into the parser's arena, one more for each ``bytes`` the field hands out).

Pure functions over bytes-like objects; nothing here knows the message types beyond field
numbers.
"""
from __future__ import annotations

VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5


def read_varint(data, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` of ``data`` and the position after it. ValueError when it runs
    past the end or past 64 bits."""
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("a truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


MAX_SCANNED_FIELDS = 256
""":func:`split_field` looks at no more top-level fields than this (a ModelInferRequest has a
handful: its names, one per input, output, raw tensor and parameter). A hostile message made of
millions of tiny fields would otherwise cost seconds of Python; past the bound the caller
parses the message whole, in C, as it would without the split."""


def split_field(data, field: int, max_fields: int = MAX_SCANNED_FIELDS) -> tuple[bytes, list[memoryview]] | None:
    """``data`` (a serialized message) without its top-level length-delimited ``field``, as
    bytes, and that field's values, in order, as read-only views into ``data``; None when the
    message has no such field, has more than ``max_fields`` top-level fields, or is not
    well-formed wire format (a truncated field, a group, a wire type that does not exist, the
    field with another wire type): the caller then parses ``data`` whole, and the parser
    reports what is wrong. Parsing the first result gives the message with the field empty;
    nothing of ``data`` is copied but the other fields."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    end = len(view)
    kept: list[memoryview] = []
    values: list[memoryview] = []
    kept_from = pos = 0
    try:
        while pos < end:
            max_fields -= 1
            if max_fields < 0:
                return None
            start = pos
            tag, pos = read_varint(view, pos)
            wire = tag & 7
            if wire == LENGTH_DELIMITED:
                length, pos = read_varint(view, pos)
                if pos + length > end:
                    return None
                if tag >> 3 == field:
                    if start > kept_from:
                        kept.append(view[kept_from:start])
                    values.append(view[pos:pos + length].toreadonly())
                    kept_from = pos + length
                pos += length
            elif tag >> 3 == field or tag >> 3 == 0:
                return None             # the field in another wire type, or field number 0
            elif wire == VARINT:
                _, pos = read_varint(view, pos)
            elif wire == FIXED64:
                pos += 8
            elif wire == FIXED32:
                pos += 4
            else:
                return None             # groups (3, 4) and the wire types 6 and 7
    except ValueError:
        return None
    if pos != end or not values:
        return None
    kept.append(view[kept_from:end])
    return b"".join(kept), values
