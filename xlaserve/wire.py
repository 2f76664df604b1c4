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
"""A scan looks at no more top-level fields than this (a ModelInferRequest has a handful: its
names, one per input, output, raw tensor and parameter). A hostile message made of millions of
tiny fields would otherwise cost seconds of Python; past the bound the caller parses the
message whole, in C."""


class TooManyFields(ValueError):
    """A message has more top-level fields than a scan looks at (:data:`MAX_SCANNED_FIELDS`)."""


def fields(view, max_fields: int = MAX_SCANNED_FIELDS):
    """Each top-level field of the serialized message ``view`` (indexable bytes), in order, as
    ``(number, wire type, start of its tag, start of its value, end of its value)``; a
    length-delimited value is its bytes without the length. ValueError when the message is not
    well-formed wire format (a truncated varint, a field past the end, a group or a wire type
    that does not exist), :class:`TooManyFields` past ``max_fields``."""
    pos, end = 0, len(view)
    while pos < end:
        max_fields -= 1
        if max_fields < 0:
            raise TooManyFields(f"more than {MAX_SCANNED_FIELDS} top-level fields")
        start = pos
        tag, pos = read_varint(view, pos)
        wire = tag & 7
        if wire == LENGTH_DELIMITED:
            length, pos = read_varint(view, pos)
            value, pos = pos, pos + length
        elif wire == VARINT:
            value = pos
            _, pos = read_varint(view, pos)
        elif wire == FIXED64:
            value, pos = pos, pos + 8
        elif wire == FIXED32:
            value, pos = pos, pos + 4
        else:
            raise ValueError(f"wire type {wire} at byte {start}")
        if pos > end:
            raise ValueError("a field runs past the end of the message")
        yield tag >> 3, wire, start, value, pos


def split_field(data, field: int, max_fields: int = MAX_SCANNED_FIELDS) -> tuple[bytes, list[memoryview]] | None:
    """``data`` (a serialized message) without its top-level length-delimited ``field``, as
    bytes, and that field's values, in order, as read-only views into ``data``; None when the
    message has no such field, has more than ``max_fields`` top-level fields, or is not
    well-formed wire format (:func:`fields`; also field number 0, or the field with another wire
    type): the caller then parses ``data`` whole, and the parser reports what is wrong. Parsing
    the first result gives the message with the field empty; nothing of ``data`` is copied but
    the other fields."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    kept: list[memoryview] = []
    values: list[memoryview] = []
    kept_from = 0
    try:
        for number, wire, start, value, end in fields(view, max_fields):
            if number == field:
                if wire != LENGTH_DELIMITED:
                    return None
                if start > kept_from:
                    kept.append(view[kept_from:start])
                values.append(view[value:end].toreadonly())
                kept_from = end
            elif number == 0:
                return None
    except ValueError:
        return None
    if not values:
        return None
    kept.append(view[kept_from:])
    return b"".join(kept), values
