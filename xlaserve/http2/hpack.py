"""HPACK (RFC 7541) header compression for the gRPC server's HTTP/2 layer.

:class:`Decoder` decodes the header blocks a peer sends, keeping the dynamic table that the peer's
encoder drives. :func:`encode` encodes the server's own header blocks; it is stateless (static
table references and literals that are never indexed), so the peer's decoder table never changes
and no encoder state has to be kept per connection.

Names and values are ``str`` decoded as latin-1: every byte maps to one code point, so binary
``-bin`` metadata round-trips byte for byte and ``len(s)`` is the octet length HPACK sizes count.

Why the decode cache: a gRPC client sends almost the same header block with every request. After
the first request, grpc C-core's block is nothing but indexed references into the dynamic table,
so the same bytes decode to the same headers for as long as the table stays as it was. The decoder
therefore remembers ``block bytes -> result`` for blocks that did not change the table (no
insertion, no size update) and answers a repeated block with one dict lookup. Any change to the
table empties the cache, so a cached answer is never read against a table it was not decoded with. Only
blocks of at most 1 KiB are remembered, at most 64 of them, so what the cache holds stays small
whatever a client sends.

Huffman strings are decoded by a state machine over 4-bit nibbles, built once at import from the
code table; a per-byte table (two nibble steps fused) is filled in from it lazily.
"""
from __future__ import annotations

from typing import Iterable

__all__ = ["HPACKError", "HeaderListTooLarge", "TooManyHeaderFields", "Decoder", "encode", "STATIC_TABLE"]


class HPACKError(ValueError):
    """A header block is malformed, or breaks a limit this end set (HTTP/2 COMPRESSION_ERROR)."""


class HeaderListTooLarge(HPACKError):
    """A header block decodes to more than the ``max_header_list_size`` this end advertised."""


class TooManyHeaderFields(HPACKError):
    """A header block holds more than ``max_header_fields`` fields (found while decoding: the
    decoder stops at the first field past the limit)."""


# RFC 7541 Appendix A. Index 1 is at position 0.
STATIC_TABLE: tuple[tuple[str, str], ...] = (
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
)
_STATIC_LEN = len(STATIC_TABLE)  # 61

# RFC 7541 Appendix B: (code, bit length) for symbols 0..255 and EOS (256).
_HUFFMAN_CODES: tuple[tuple[int, int], ...] = (
    (0x1ff8, 13), (0x7fffd8, 23), (0xfffffe2, 28), (0xfffffe3, 28),
    (0xfffffe4, 28), (0xfffffe5, 28), (0xfffffe6, 28), (0xfffffe7, 28),
    (0xfffffe8, 28), (0xffffea, 24), (0x3ffffffc, 30), (0xfffffe9, 28),
    (0xfffffea, 28), (0x3ffffffd, 30), (0xfffffeb, 28), (0xfffffec, 28),
    (0xfffffed, 28), (0xfffffee, 28), (0xfffffef, 28), (0xffffff0, 28),
    (0xffffff1, 28), (0xffffff2, 28), (0x3ffffffe, 30), (0xffffff3, 28),
    (0xffffff4, 28), (0xffffff5, 28), (0xffffff6, 28), (0xffffff7, 28),
    (0xffffff8, 28), (0xffffff9, 28), (0xffffffa, 28), (0xffffffb, 28),
    (0x14, 6), (0x3f8, 10), (0x3f9, 10), (0xffa, 12),  # ' ' ! " #
    (0x1ff9, 13), (0x15, 6), (0xf8, 8), (0x7fa, 11),  # $ % & '
    (0x3fa, 10), (0x3fb, 10), (0xf9, 8), (0x7fb, 11),  # ( ) * +
    (0xfa, 8), (0x16, 6), (0x17, 6), (0x18, 6),  # , - . /
    (0x0, 5), (0x1, 5), (0x2, 5), (0x19, 6),  # 0 1 2 3
    (0x1a, 6), (0x1b, 6), (0x1c, 6), (0x1d, 6),  # 4 5 6 7
    (0x1e, 6), (0x1f, 6), (0x5c, 7), (0xfb, 8),  # 8 9 : ;
    (0x7ffc, 15), (0x20, 6), (0xffb, 12), (0x3fc, 10),  # < = > ?
    (0x1ffa, 13), (0x21, 6), (0x5d, 7), (0x5e, 7),  # @ A B C
    (0x5f, 7), (0x60, 7), (0x61, 7), (0x62, 7),  # D E F G
    (0x63, 7), (0x64, 7), (0x65, 7), (0x66, 7),  # H I J K
    (0x67, 7), (0x68, 7), (0x69, 7), (0x6a, 7),  # L M N O
    (0x6b, 7), (0x6c, 7), (0x6d, 7), (0x6e, 7),  # P Q R S
    (0x6f, 7), (0x70, 7), (0x71, 7), (0x72, 7),  # T U V W
    (0xfc, 8), (0x73, 7), (0xfd, 8), (0x1ffb, 13),  # X Y Z [
    (0x7fff0, 19), (0x1ffc, 13), (0x3ffc, 14), (0x22, 6),  # \ ] ^ _
    (0x7ffd, 15), (0x3, 5), (0x23, 6), (0x4, 5),  # ` a b c
    (0x24, 6), (0x5, 5), (0x25, 6), (0x26, 6),  # d e f g
    (0x27, 6), (0x6, 5), (0x74, 7), (0x75, 7),  # h i j k
    (0x28, 6), (0x29, 6), (0x2a, 6), (0x7, 5),  # l m n o
    (0x2b, 6), (0x76, 7), (0x2c, 6), (0x8, 5),  # p q r s
    (0x9, 5), (0x2d, 6), (0x77, 7), (0x78, 7),  # t u v w
    (0x79, 7), (0x7a, 7), (0x7b, 7), (0x7ffe, 15),  # x y z {
    (0x7fc, 11), (0x3ffd, 14), (0x1ffd, 13), (0xffffffc, 28),  # | } ~ DEL
    (0xfffe6, 20), (0x3fffd2, 22), (0xfffe7, 20), (0xfffe8, 20),
    (0x3fffd3, 22), (0x3fffd4, 22), (0x3fffd5, 22), (0x7fffd9, 23),
    (0x3fffd6, 22), (0x7fffda, 23), (0x7fffdb, 23), (0x7fffdc, 23),
    (0x7fffdd, 23), (0x7fffde, 23), (0xffffeb, 24), (0x7fffdf, 23),
    (0xffffec, 24), (0xffffed, 24), (0x3fffd7, 22), (0x7fffe0, 23),
    (0xffffee, 24), (0x7fffe1, 23), (0x7fffe2, 23), (0x7fffe3, 23),
    (0x7fffe4, 23), (0x1fffdc, 21), (0x3fffd8, 22), (0x7fffe5, 23),
    (0x3fffd9, 22), (0x7fffe6, 23), (0x7fffe7, 23), (0xffffef, 24),
    (0x3fffda, 22), (0x1fffdd, 21), (0xfffe9, 20), (0x3fffdb, 22),
    (0x3fffdc, 22), (0x7fffe8, 23), (0x7fffe9, 23), (0x1fffde, 21),
    (0x7fffea, 23), (0x3fffdd, 22), (0x3fffde, 22), (0xfffff0, 24),
    (0x1fffdf, 21), (0x3fffdf, 22), (0x7fffeb, 23), (0x7fffec, 23),
    (0x1fffe0, 21), (0x1fffe1, 21), (0x3fffe0, 22), (0x1fffe2, 21),
    (0x7fffed, 23), (0x3fffe1, 22), (0x7fffee, 23), (0x7fffef, 23),
    (0xfffea, 20), (0x3fffe2, 22), (0x3fffe3, 22), (0x3fffe4, 22),
    (0x7ffff0, 23), (0x3fffe5, 22), (0x3fffe6, 22), (0x7ffff1, 23),
    (0x3ffffe0, 26), (0x3ffffe1, 26), (0xfffeb, 20), (0x7fff1, 19),
    (0x3fffe7, 22), (0x7ffff2, 23), (0x3fffe8, 22), (0x1ffffec, 25),
    (0x3ffffe2, 26), (0x3ffffe3, 26), (0x3ffffe4, 26), (0x7ffffde, 27),
    (0x7ffffdf, 27), (0x3ffffe5, 26), (0xfffff1, 24), (0x1ffffed, 25),
    (0x7fff2, 19), (0x1fffe3, 21), (0x3ffffe6, 26), (0x7ffffe0, 27),
    (0x7ffffe1, 27), (0x3ffffe7, 26), (0x7ffffe2, 27), (0xfffff2, 24),
    (0x1fffe4, 21), (0x1fffe5, 21), (0x3ffffe8, 26), (0x3ffffe9, 26),
    (0xffffffd, 28), (0x7ffffe3, 27), (0x7ffffe4, 27), (0x7ffffe5, 27),
    (0xfffec, 20), (0xfffff3, 24), (0xfffed, 20), (0x1fffe6, 21),
    (0x3fffe9, 22), (0x1fffe7, 21), (0x1fffe8, 21), (0x7ffff3, 23),
    (0x3fffea, 22), (0x3fffeb, 22), (0x1ffffee, 25), (0x1ffffef, 25),
    (0xfffff4, 24), (0xfffff5, 24), (0x3ffffea, 26), (0x7ffff4, 23),
    (0x3ffffeb, 26), (0x7ffffe6, 27), (0x3ffffec, 26), (0x3ffffed, 26),
    (0x7ffffe7, 27), (0x7ffffe8, 27), (0x7ffffe9, 27), (0x7ffffea, 27),
    (0x7ffffeb, 27), (0xffffffe, 28), (0x7ffffec, 27), (0x7ffffed, 27),
    (0x7ffffee, 27), (0x7ffffef, 27), (0x7fffff0, 27), (0x3ffffee, 26),
    (0x3fffffff, 30),  # EOS
)
_EOS = 256


# --- Huffman decoding state machine --------------------------------------------------------------
#
# A state is an internal node of the code tree (0 = the root): the bits read since the last
# complete symbol. _NIBBLE[state << 4 | nibble] is (next state, symbol emitted or -1); a nibble
# emits at most one symbol because the shortest code is 5 bits long. Reaching EOS is marked with
# next state -1. _FINAL[state] is None where a string may end in that state (its pending bits are
# valid padding: at most 7 bits, all ones) and the error message otherwise.

def _build_huffman() -> tuple[list[tuple[int, int]], list[str | None]]:
    kids: list[list[int]] = [[0, 0]]  # per internal node: child node id, or ~symbol for a leaf
    depth = [0]
    all_ones = [True]
    for sym, (code, length) in enumerate(_HUFFMAN_CODES):
        node = 0
        for shift in range(length - 1, -1, -1):
            bit = (code >> shift) & 1
            if shift == 0:
                if kids[node][bit] != 0:
                    raise AssertionError(f"Huffman code for {sym} collides")
                kids[node][bit] = ~sym
                break
            child = kids[node][bit]
            if child < 0:
                raise AssertionError(f"Huffman code for {sym} extends a shorter code")
            if child == 0:
                child = len(kids)
                kids.append([0, 0])
                depth.append(depth[node] + 1)
                all_ones.append(all_ones[node] and bit == 1)
                kids[node][bit] = child
            node = child
    if len(kids) != 256 or any(0 in pair for pair in kids[1:]) or 0 in kids[0]:
        raise AssertionError("Huffman code table is not a complete prefix code")

    nibble: list[tuple[int, int]] = []
    for state in range(len(kids)):
        for value in range(16):
            node, emitted = state, -1
            for shift in (3, 2, 1, 0):
                child = kids[node][(value >> shift) & 1]
                if child < 0:
                    if ~child == _EOS:
                        node = -1
                        break
                    if emitted >= 0:
                        raise AssertionError("two symbols in one nibble")
                    emitted, node = ~child, 0
                else:
                    node = child
            nibble.append((node, emitted))
    final: list[str | None] = []
    for state in range(len(kids)):
        if not all_ones[state]:
            final.append("Huffman string padding is not all ones (not a prefix of EOS)")
        elif depth[state] > 7:
            final.append(f"Huffman string padding is {depth[state]} bits, longer than 7")
        else:
            final.append(None)
    return nibble, final


_NIBBLE, _FINAL = _build_huffman()


# _BYTE_STEPS[state << 8 | byte] = (next state, emitted bytes): two nibble steps fused. Entries are
# filled in from _NIBBLE the first time each (state, byte) pair is seen (None until then).
_BYTE_STEPS: list[tuple[int, bytes] | None] = [None] * (len(_FINAL) << 8)


def _byte_step(key: int) -> tuple[int, bytes]:
    state = key >> 8
    out = bytearray()
    for nibble in ((key >> 4) & 0x0F, key & 0x0F):
        state, symbol = _NIBBLE[(state << 4) | nibble]
        if state < 0:
            raise HPACKError("Huffman string contains the EOS symbol")
        if symbol >= 0:
            out.append(symbol)
    entry = _BYTE_STEPS[key] = (state, bytes(out))
    return entry


def _huffman_decode(data: bytes) -> str:
    steps = _BYTE_STEPS
    state = 0
    out = bytearray()
    for byte in data:
        key = (state << 8) | byte
        try:
            state, emitted = steps[key]
        except TypeError:  # None: first time this (state, byte) pair is seen
            state, emitted = _byte_step(key)
        out += emitted
    error = _FINAL[state]
    if error is not None:
        raise HPACKError(error)
    return out.decode("latin-1")


# --- primitive readers -------------------------------------------------------------------------

_MAX_INT = 2 ** 32


def _read_int(data: bytes, pos: int, value: int) -> tuple[int, int]:
    """Continue an integer whose N-bit prefix was all ones (``value`` = 2**N - 1) at ``pos``."""
    shift = 0
    end = len(data)
    while True:
        if pos >= end:
            raise HPACKError("truncated header block: integer continuation byte missing")
        byte = data[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        if value > _MAX_INT:
            raise HPACKError(f"integer {value} exceeds the limit of 2**32")
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 28:
            raise HPACKError("integer encoding longer than 5 continuation bytes")


def _read_str(data: bytes, pos: int) -> tuple[str, int]:
    if pos >= len(data):
        raise HPACKError("truncated header block: string length missing")
    first = data[pos]
    length = first & 0x7F
    pos += 1
    if length == 0x7F:
        length, pos = _read_int(data, pos, length)
    end = pos + length
    if end > len(data):
        raise HPACKError(
            f"truncated header block: string of {length} bytes, only {len(data) - pos} left")
    if first & 0x80:
        return _huffman_decode(data[pos:end]), end
    return data[pos:end].decode("latin-1"), end


# --- decoder -----------------------------------------------------------------------------------

# Repeated gRPC blocks are tens of bytes; a bound in count and size keeps a connection that sends
# a stream of distinct large blocks from making the cache hold them (at most 64 KiB of keys).
_CACHE_LIMIT = 64
_CACHE_BLOCK_MAX = 1024


class Decoder:
    """Decodes the header blocks of one HTTP/2 connection (one dynamic table).

    ``max_table_size`` is the SETTINGS_HEADER_TABLE_SIZE this end advertised: the peer's size
    updates may not exceed it. ``max_header_list_size`` bounds one decoded block (RFC 7540 size:
    name and value octets plus 32 per field); ``max_header_fields`` the fields in one block,
    counted as they are decoded (a block of 2,000 one-byte indexed fields is refused at the
    field past the limit, not decoded whole first).
    """

    __slots__ = ("_limit", "_max_size", "_size", "_dynamic", "_max_list", "_max_fields", "_cache")

    def __init__(self, max_table_size: int = 4096, max_header_list_size: int = 65536,
                 max_header_fields: int = 2**31 - 1) -> None:
        self._limit = max_table_size
        self._max_size = max_table_size  # current size limit, lowered/raised by size updates
        self._size = 0
        self._dynamic: list[tuple[str, str]] = []  # oldest first; index 62 is the last entry
        self._max_list = max_header_list_size
        self._max_fields = max_header_fields
        self._cache: dict[bytes, tuple[tuple[str, str], ...]] = {}

    @property
    def table(self) -> tuple[tuple[str, str], ...]:
        """The dynamic table, newest entry (index 62) first. For inspection and tests."""
        return tuple(reversed(self._dynamic))

    @property
    def table_size(self) -> int:
        """The dynamic table's size by RFC 7541 section 4.1 (octets + 32 per entry)."""
        return self._size

    def decode(self, block: bytes | bytearray | memoryview) -> tuple[tuple[str, str], ...]:
        """Decode one complete header block into ``(name, value)`` pairs, in order."""
        data = bytes(block)
        cached = self._cache.get(data)
        if cached is not None:
            return cached
        headers, modified = self._parse(data)
        if not modified and len(data) <= _CACHE_BLOCK_MAX:
            cache = self._cache
            if len(cache) >= _CACHE_LIMIT:
                cache.clear()
            cache[data] = headers
        return headers

    def _entry(self, index: int) -> tuple[str, str]:
        if index <= _STATIC_LEN:
            if index == 0:
                raise HPACKError("header field index 0 is not valid")
            return STATIC_TABLE[index - 1]
        dynamic = self._dynamic
        position = len(dynamic) - (index - _STATIC_LEN)
        if position < 0:
            raise HPACKError(
                f"header field index {index} out of range (table holds {_STATIC_LEN + len(dynamic)})")
        return dynamic[position]

    def _insert(self, entry: tuple[str, str]) -> None:
        self._cache.clear()
        dynamic = self._dynamic
        size = len(entry[0]) + len(entry[1]) + 32
        if size > self._max_size:  # RFC 7541 4.4: empties the table, entry not added
            dynamic.clear()
            self._size = 0
            return
        total = self._size + size
        while total > self._max_size:
            name, value = dynamic.pop(0)
            total -= len(name) + len(value) + 32
        dynamic.append(entry)
        self._size = total

    def _resize(self, new_size: int) -> None:
        self._cache.clear()
        if new_size > self._limit:
            raise HPACKError(
                f"dynamic table size update to {new_size} exceeds the limit {self._limit}")
        self._max_size = new_size
        dynamic = self._dynamic
        total = self._size
        while total > new_size:
            name, value = dynamic.pop(0)
            total -= len(name) + len(value) + 32
        self._size = total

    def _parse(self, data: bytes) -> tuple[tuple[tuple[str, str], ...], bool]:
        headers: list[tuple[str, str]] = []
        append = headers.append
        static = STATIC_TABLE
        dynamic = self._dynamic
        list_limit = self._max_list
        list_size = 0
        fields_left = self._max_fields
        modified = False
        updates = 0
        pos = 0
        end = len(data)
        while pos < end:
            first = data[pos]
            pos += 1
            if first & 0x80:  # 6.1 indexed header field
                index = first & 0x7F
                if index == 0x7F:
                    index, pos = _read_int(data, pos, index)
                if 0 < index <= _STATIC_LEN:
                    header = static[index - 1]
                elif _STATIC_LEN < index <= _STATIC_LEN + len(dynamic):
                    header = dynamic[_STATIC_LEN - index]
                else:
                    header = self._entry(index)  # raises the precise error
            elif first & 0xE0 == 0x20:  # 6.3 dynamic table size update
                if headers:
                    raise HPACKError("dynamic table size update after a header field")
                updates += 1
                if updates > 2:     # RFC 7541 4.2: one to signal a reduction, one for the new size
                    raise HPACKError("more than two dynamic table size updates at the start of a header block")
                size = first & 0x1F
                if size == 0x1F:
                    size, pos = _read_int(data, pos, size)
                modified = True
                self._resize(size)
                continue
            else:
                if first & 0x40:  # 6.2.1 literal with incremental indexing
                    index = first & 0x3F
                    prefix_max = 0x3F
                else:  # 6.2.2 without indexing (0000) / 6.2.3 never indexed (0001)
                    index = first & 0x0F
                    prefix_max = 0x0F
                if index == prefix_max:
                    index, pos = _read_int(data, pos, index)
                if index:
                    name = self._entry(index)[0]
                else:
                    name, pos = _read_str(data, pos)
                value, pos = _read_str(data, pos)
                header = (name, value)
                if first & 0x40:
                    modified = True
                    self._insert(header)
            list_size += len(header[0]) + len(header[1]) + 32
            if list_size > list_limit:
                raise HeaderListTooLarge(f"a header block decodes to more than {list_limit} bytes "
                                         "(RFC 9113 field sizes: name, value and 32 per field)")
            fields_left -= 1
            if fields_left < 0:
                raise TooManyHeaderFields(f"a header block holds more than {self._max_fields} header fields")
            append(header)
        return tuple(headers), modified


# --- encoder -----------------------------------------------------------------------------------

_STATIC_PAIR: dict[tuple[str, str], int] = {}
_STATIC_NAME: dict[str, int] = {}
for _i, (_name, _value) in enumerate(STATIC_TABLE, 1):
    _STATIC_PAIR.setdefault((_name, _value), _i)
    _STATIC_NAME.setdefault(_name, _i)
del _i, _name, _value

_FIELD_MEMO: dict[tuple[str, str], bytes] = {}
_FIELD_MEMO_LIMIT = 1024
_FIELD_MEMO_MAX_VALUE = 128


def _int_bytes(value: int, prefix_bits: int, flags: int) -> bytes:
    prefix_max = (1 << prefix_bits) - 1
    if value < prefix_max:
        return bytes((flags | value,))
    out = bytearray((flags | prefix_max,))
    value -= prefix_max
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _latin1(text: str, what: str) -> bytes:
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:
        raise HPACKError(f"header {what} {text[:40]!r} is not latin-1 encodable") from None


def _encode_field(name: str, value: str) -> bytes:
    index = _STATIC_PAIR.get((name, value))
    if index is not None:
        return bytes((0x80 | index,))  # index <= 61: fits the 7-bit prefix
    raw_value = _latin1(value, "value")
    value_part = _int_bytes(len(raw_value), 7, 0) + raw_value
    index = _STATIC_NAME.get(name)
    if index is not None:  # literal without indexing, indexed name
        return _int_bytes(index, 4, 0) + value_part
    raw_name = _latin1(name, "name")
    return b"\x00" + _int_bytes(len(raw_name), 7, 0) + raw_name + value_part


def encode(headers: Iterable[tuple[str, str]]) -> bytes:
    """Encode ``(name, value)`` pairs as one header block without touching any dynamic table."""
    memo = _FIELD_MEMO
    parts = []
    for name, value in headers:
        key = (name, value)
        chunk = memo.get(key)
        if chunk is None:
            chunk = _encode_field(name, value)
            if len(value) <= _FIELD_MEMO_MAX_VALUE:
                if len(memo) >= _FIELD_MEMO_LIMIT:
                    memo.clear()
                memo[key] = chunk
        parts.append(chunk)
    return b"".join(parts)
