"""HPACK codec: RFC 7541 Appendix C examples, cross-checks against the ``hpack`` package, the
decode cache, and every error the decoder reports."""
from __future__ import annotations

import random

import hpack as ref
import pytest
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH

from xlaserve.http2.hpack import STATIC_TABLE, Decoder, HeaderListTooLarge, HPACKError, TooManyHeaderFields, encode
from xlaserve.http2 import hpack as ours

ref_huffman = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)


def h(text: str) -> bytes:
    return bytes.fromhex(text.replace(" ", "").replace("\n", ""))


def huff(raw: bytes) -> bytes:
    """A Huffman string literal (H bit + length) of ``raw``, encoded by the hpack package."""
    coded = ref_huffman.encode(raw)
    assert len(coded) < 127
    return bytes((0x80 | len(coded),)) + coded


def plain(raw: bytes) -> bytes:
    assert len(raw) < 127
    return bytes((len(raw),)) + raw


# --- tables --------------------------------------------------------------------------------------

def test_static_table():
    assert len(STATIC_TABLE) == 61
    assert STATIC_TABLE[0] == (":authority", "")
    assert STATIC_TABLE[1] == (":method", "GET")
    assert STATIC_TABLE[7] == (":status", "200")
    assert STATIC_TABLE[30] == ("content-type", "")
    assert STATIC_TABLE[60] == ("www-authenticate", "")
    table = ref.table.HeaderTable.STATIC_TABLE
    assert [(n.decode(), v.decode()) for n, v in table] == list(STATIC_TABLE)


def test_huffman_code_table_matches_hpack_package():
    assert [c for c, _ in ours._HUFFMAN_CODES] == list(REQUEST_CODES)
    assert [n for _, n in ours._HUFFMAN_CODES] == list(REQUEST_CODES_LENGTH)


# --- RFC 7541 Appendix C -------------------------------------------------------------------------

def test_c2_1_literal_with_indexing():
    d = Decoder()
    block = h("400a 6375 7374 6f6d 2d6b 6579 0d63 7573 746f 6d2d 6865 6164 6572")
    assert d.decode(block) == (("custom-key", "custom-header"),)
    assert d.table == (("custom-key", "custom-header"),)
    assert d.table_size == 55


def test_c2_2_literal_without_indexing():
    d = Decoder()
    assert d.decode(h("040c 2f73 616d 706c 652f 7061 7468")) == ((":path", "/sample/path"),)
    assert d.table == () and d.table_size == 0


def test_c2_3_literal_never_indexed():
    d = Decoder()
    assert d.decode(h("1008 7061 7373 776f 7264 0673 6563 7265 74")) == (("password", "secret"),)
    assert d.table == () and d.table_size == 0


def test_c2_4_indexed():
    d = Decoder()
    assert d.decode(b"\x82") == ((":method", "GET"),)
    assert d.table == () and d.table_size == 0


REQUESTS_EXPECTED = [
    ((":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "www.example.com")),
    ((":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "www.example.com"),
     ("cache-control", "no-cache")),
    ((":method", "GET"), (":scheme", "https"), (":path", "/index.html"),
     (":authority", "www.example.com"), ("custom-key", "custom-value")),
]
REQUESTS_TABLES = [
    ([(":authority", "www.example.com")], 57),
    ([("cache-control", "no-cache"), (":authority", "www.example.com")], 110),
    ([("custom-key", "custom-value"), ("cache-control", "no-cache"),
      (":authority", "www.example.com")], 164),
]
C3_BLOCKS = [  # C.3: requests without Huffman coding
    h("8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d"),
    h("8286 84be 5808 6e6f 2d63 6163 6865"),
    h("8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65"),
]
C4_BLOCKS = [  # C.4: the same requests with Huffman coding
    h("8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff"),
    h("8286 84be 5886 a8eb 1064 9cbf"),
    h("8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf"),
]


@pytest.mark.parametrize("blocks", [C3_BLOCKS, C4_BLOCKS], ids=["C.3", "C.4"])
def test_c3_c4_requests(blocks):
    d = Decoder()
    for block, expected, (table, size) in zip(blocks, REQUESTS_EXPECTED, REQUESTS_TABLES):
        assert d.decode(block) == expected
        assert d.table == tuple(table)
        assert d.table_size == size


DATE1 = "Mon, 21 Oct 2013 20:13:21 GMT"
DATE2 = "Mon, 21 Oct 2013 20:13:22 GMT"
LOCATION = "https://www.example.com"
COOKIE = "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1"
RESPONSES_EXPECTED = [
    ((":status", "302"), ("cache-control", "private"), ("date", DATE1), ("location", LOCATION)),
    ((":status", "307"), ("cache-control", "private"), ("date", DATE1), ("location", LOCATION)),
    ((":status", "200"), ("cache-control", "private"), ("date", DATE2), ("location", LOCATION),
     ("content-encoding", "gzip"), ("set-cookie", COOKIE)),
]
RESPONSES_TABLES = [
    ([("location", LOCATION), ("date", DATE1), ("cache-control", "private"), (":status", "302")],
     222),
    ([(":status", "307"), ("location", LOCATION), ("date", DATE1), ("cache-control", "private")],
     222),
    ([("set-cookie", COOKIE), ("content-encoding", "gzip"), ("date", DATE2)], 215),
]
C5_BLOCKS = [  # C.5: responses without Huffman coding, table size 256
    h("""4803 3330 3258 0770 7269 7661 7465 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133
         2032 303a 3133 3a32 3120 474d 546e 1768 7474 7073 3a2f 2f77 7777 2e65 7861 6d70
         6c65 2e63 6f6d"""),
    h("4803 3330 37c1 c0bf"),
    h("""88c1 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a 3133 3a32 3220 474d
         54c0 5a04 677a 6970 7738 666f 6f3d 4153 444a 4b48 514b 425a 584f 5157 454f 5049
         5541 5851 5745 4f49 553b 206d 6178 2d61 6765 3d33 3630 303b 2076 6572 7369 6f6e
         3d31"""),
]
C6_BLOCKS = [  # C.6: the same responses with Huffman coding
    h("""4882 6402 5885 aec3 771a 4b61 96d0 7abe 9410 54d4 44a8 2005 9504 0b81 66e0 82a6
         2d1b ff6e 919d 29ad 1718 63c7 8f0b 97c8 e9ae 82ae 43d3"""),
    h("4883 640e ffc1 c0bf"),
    h("""88c1 6196 d07a be94 1054 d444 a820 0595 040b 8166 e084 a62d 1bff c05a 839b d9ab
         77ad 94e7 821d d7f2 e6c7 b335 dfdf cd5b 3960 d5af 2708 7f36 72c1 ab27 0fb5 291f
         9587 3160 65c0 03ed 4ee5 b106 3d50 07"""),
]


@pytest.mark.parametrize("blocks", [C5_BLOCKS, C6_BLOCKS], ids=["C.5", "C.6"])
def test_c5_c6_responses_with_eviction(blocks):
    d = Decoder(max_table_size=256)
    for block, expected, (table, size) in zip(blocks, RESPONSES_EXPECTED, RESPONSES_TABLES):
        assert d.decode(block) == expected
        assert d.table == tuple(table)
        assert d.table_size == size


def test_appendix_c_blocks_match_hpack_package_encoder():
    """The hand-copied RFC bytes are what an independent encoder produces for those headers."""
    for huffman, blocks in ((False, C3_BLOCKS), (True, C4_BLOCKS)):
        enc = ref.Encoder()
        assert [enc.encode(list(e), huffman=huffman) for e in REQUESTS_EXPECTED] == blocks


# --- cross-checks against the hpack package ------------------------------------------------------

NAMES = ["x-a", "x-bb", "grpc-timeout", "user-agent", "te", "x-trace-bin", "authorization",
         "content-type", ":path", "custom"]


def random_headers(rng: random.Random, pool: list[tuple[bytes, bytes]]):
    headers = []
    for _ in range(rng.randint(0, 12)):
        if pool and rng.random() < 0.5:
            headers.append(rng.choice(pool))
            continue
        name = rng.choice(NAMES) if rng.random() < 0.7 else "".join(
            rng.choice("abcdefghijklmnopqrstuvwxyz-") for _ in range(rng.randint(1, 20)))
        length = rng.choice([0, 1, 5, 20, 126, 127, 128, 300])
        value = bytes(rng.randrange(256) for _ in range(rng.randint(0, length)))
        pair = (name.encode(), value)
        pool.append(pair)
        headers.append(pair)
    return headers


def as_text(headers):
    return tuple((n.decode("latin-1"), v.decode("latin-1")) for n, v in headers)


@pytest.mark.parametrize("huffman", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_random_blocks_against_hpack_encoder(huffman, seed):
    rng = random.Random(seed)
    enc = ref.Encoder()
    dec = Decoder()
    pool: list[tuple[bytes, bytes]] = []
    for _ in range(150):
        headers = random_headers(rng, pool)
        sensitive = [(n, v, rng.random() < 0.1) for n, v in headers]  # some never-indexed
        block = enc.encode(sensitive, huffman=huffman)
        assert dec.decode(block) == as_text(headers)
        assert dec.table_size <= 4096


def test_random_blocks_with_encoder_table_size_changes():
    rng = random.Random(99)
    enc = ref.Encoder()
    dec = Decoder(max_table_size=4096)
    pool: list[tuple[bytes, bytes]] = []
    sizes = [256, 0, 4096, 100, 1000, 4096, 64]
    for i in range(140):
        if i % 20 == 10:
            enc.header_table_size = sizes[(i // 20) % len(sizes)]
        headers = random_headers(rng, pool)
        block = enc.encode(headers, huffman=rng.random() < 0.5)
        assert dec.decode(block) == as_text(headers)
        assert dec.table_size <= enc.header_table_size
        assert dec.table == as_text(enc.header_table.dynamic_entries)


def test_two_size_updates_at_block_start():
    enc = ref.Encoder()
    enc.encode([(b"x-a", b"1")])
    enc.header_table_size = 0
    enc.header_table_size = 200
    block = enc.encode([(b"x-b", b"2")])
    assert block[0] & 0xE0 == 0x20 and block[1] & 0xE0 == 0x20
    dec = Decoder()
    dec.decode(b"\x40" + plain(b"x-a") + plain(b"1"))
    assert dec.decode(block) == (("x-b", "2"),)
    assert dec.table == (("x-b", "2"),)


def test_large_indices_and_long_strings():
    dec = Decoder()
    names = [f"n{i:03d}" for i in range(100)]  # 100 entries of 4 + 1 + 32 = 37 octets
    block = b"".join(b"\x40" + plain(n.encode()) + plain(b"v") for n in names)
    assert dec.decode(block) == tuple((n, "v") for n in names)
    assert dec.table_size == 3700
    # index 62 + 99 = 161 is the oldest entry: 7-bit prefix all ones plus a continuation byte
    assert dec.decode(b"\xff" + bytes((161 - 127,))) == (("n000", "v"),)
    long_value = bytes(range(256)) * 3
    length = len(long_value) - 127
    literal = b"\x00" + plain(b"x-long-bin") + b"\x7f" + bytes(((length & 0x7F) | 0x80, length >> 7))
    assert dec.decode(literal + long_value) == (("x-long-bin", long_value.decode("latin-1")),)


# --- Huffman -------------------------------------------------------------------------------------

def test_huffman_every_byte_value():
    dec = Decoder()
    for byte in range(256):
        block = b"\x00" + plain(b"x") + huff(bytes((byte,)))
        assert dec.decode(block) == (("x", chr(byte)),)
    everything = bytes(range(256))
    coded = ref_huffman.encode(everything)
    assert ours._huffman_decode(coded) == everything.decode("latin-1")
    rng = random.Random(5)
    for _ in range(200):
        raw = bytes(rng.randrange(256) for _ in range(rng.randint(0, 60)))
        assert ours._huffman_decode(ref_huffman.encode(raw)) == raw.decode("latin-1")


def test_huffman_empty_string():
    assert Decoder().decode(b"\x00\x81\x1f\x80") == (("a", ""),)  # 'a' = 00011 + 111 padding


# --- the decode cache ----------------------------------------------------------------------------

def grpc_request(enc: ref.Encoder) -> bytes:
    return enc.encode([
        (":method", "POST"), (":scheme", "http"), (":path", "/inference.GRPCInferenceService/ModelInfer"),
        (":authority", "localhost:8001"), ("te", "trailers"), ("content-type", "application/grpc"),
        ("user-agent", "grpc-python/1.60.0 grpc-c/37.0.0 (linux; chttp2)"),
        ("grpc-accept-encoding", "identity, deflate, gzip"), ("grpc-timeout", "10S"),
    ])


def test_cache_serves_repeated_indexed_block():
    enc = ref.Encoder()
    dec = Decoder()
    first = dec.decode(grpc_request(enc))
    block = grpc_request(enc)  # now only indexed references
    assert all(b & 0x80 for b in block)
    second = dec.decode(block)
    assert second == first
    assert dec.decode(bytearray(block)) is second  # served from the cache
    assert dec.decode(memoryview(block)) is second


def test_cache_not_stale_after_table_change():
    dec = Decoder()
    insert_a = b"\x40" + plain(b"x-a") + plain(b"1")
    insert_b = b"\x40" + plain(b"x-b") + plain(b"2")
    assert dec.decode(insert_a) == (("x-a", "1"),)
    cached = dec.decode(b"\xbe")
    assert cached == (("x-a", "1"),)
    assert dec.decode(insert_b) == (("x-b", "2"),)
    assert dec.decode(b"\xbe") == (("x-b", "2"),)  # not the cached ("x-a", "1")
    assert dec.decode(b"\xbe\xbf") == (("x-b", "2"), ("x-a", "1"))


def test_same_inserting_block_inserts_every_time():
    dec = Decoder()
    block = b"\x40" + plain(b"x-a") + huff(b"hello")
    assert dec.decode(block) == (("x-a", "hello"),)
    assert dec.decode(block) == (("x-a", "hello"),)
    assert dec.table == (("x-a", "hello"), ("x-a", "hello"))
    assert dec.table_size == 2 * (3 + 5 + 32)
    assert dec.decode(b"\x40" + plain(b"x-b") + plain(b"2")) == (("x-b", "2"),)
    assert dec.decode(b"\xbe\xbf\xc0") == (("x-b", "2"), ("x-a", "hello"), ("x-a", "hello"))
    with pytest.raises(HPACKError, match="out of range"):
        dec.decode(b"\xc1")


def test_cache_cleared_by_size_update_and_bounded():
    dec = Decoder()
    dec.decode(b"\x40" + plain(b"x-a") + plain(b"1"))
    assert dec.decode(b"\xbe") == (("x-a", "1"),)
    assert dec.decode(b"\x20") == ()  # size update to 0 evicts everything
    with pytest.raises(HPACKError, match="out of range"):
        dec.decode(b"\xbe")
    for i in range(2000):
        dec.decode(b"\x00" + plain(b"k") + plain(str(i).encode()))
    assert len(dec._cache) <= 512


# --- errors --------------------------------------------------------------------------------------

BIG = b"\xff" + bytes((0x80 | 0x7F,)) * 4 + b"\x7f"  # 127 + (2**35 - 1)


@pytest.mark.parametrize("block, message", [
    (b"\x80", "index 0"),
    (b"\xbe", "index 62 out of range"),
    (b"\xff\x80\x01", "index 255 out of range"),
    (b"\x7e" + plain(b"v"), "index 62 out of range"),  # literal with indexed name
    (b"\x0f\x30" + plain(b"v"), "index 63 out of range"),
    (b"\xff", "truncated header block: integer"),
    (b"\xff\x80", "truncated header block: integer"),
    (b"\x40", "truncated header block: string length"),
    (b"\x40" + plain(b"name"), "truncated header block: string length"),
    (b"\x40\x05ab", "truncated header block: string of 5 bytes, only 2 left"),
    (b"\x00\x01a\x7f", "truncated header block: integer"),
    (BIG, "exceeds the limit of 2\\*\\*32"),
    (b"\xff\x80\x80\x80\x80\x80\x00", "longer than 5 continuation bytes"),
    (b"\x00\x01a\x82\x1f\xff", "padding is 11 bits, longer than 7"),  # 'a' + 11 one bits
    (b"\x00\x01a\x81\xff", "padding is 8 bits, longer than 7"),
    (b"\x00\x01a\x81\x18", "padding is not all ones"),  # 'a' + 000
    (b"\x00\x01a\x84\xff\xff\xff\xff", "EOS"),
    (b"\x3f\xe2\x1f", "size update to 4097 exceeds the limit 4096"),
    (b"\x82\x20", "size update after a header field"),
])
def test_decode_errors(block, message):
    with pytest.raises(HPACKError, match=message):
        Decoder().decode(block)


def test_error_is_value_error_and_not_cached():
    dec = Decoder()
    for _ in range(2):
        with pytest.raises(ValueError):
            dec.decode(b"\x80")
    assert not dec._cache


def test_size_update_limit_follows_constructor():
    dec = Decoder(max_table_size=100)
    assert dec.decode(b"\x3f\x45") == ()  # 31 + 69 = 100: allowed
    with pytest.raises(HPACKError, match="101 exceeds the limit 100"):
        dec.decode(b"\x3f\x46")
    # a table of 100 octets keeps one 36-octet entry of two
    dec = Decoder(max_table_size=100)
    dec.decode(b"\x40" + plain(b"a") + plain(b"bcd") + b"\x40" + plain(b"e") + plain(b"fgh"))
    assert dec.table_size == 72
    dec.decode(b"\x40" + plain(b"i") + plain(b"jkl"))
    assert dec.table == (("i", "jkl"), ("e", "fgh"))
    dec.decode(b"\x40" + plain(b"m") + plain(bytes(70)))  # 103 > 100: empties the table
    assert dec.table == () and dec.table_size == 0


def test_header_list_size_limit():
    dec = Decoder(max_header_list_size=100)
    assert dec.decode(b"\x00" + plain(b"a") + plain(bytes(67))) == (("a", "\x00" * 67),)  # 100
    with pytest.raises(HeaderListTooLarge, match="more than 100 bytes"):
        dec.decode(b"\x00" + plain(b"a") + plain(bytes(68)))
    with pytest.raises(HeaderListTooLarge, match="more than 100 bytes"):
        dec.decode(b"\x82" * 4)  # 4 * (7 + 3 + 32)


# --- encoder -------------------------------------------------------------------------------------

def test_encode_static_matches():
    assert encode([(":status", "200")]) == b"\x88"
    assert encode([]) == b""
    assert encode([("content-type", "application/grpc")]) == b"\x0f\x10\x10application/grpc"
    assert encode([("grpc-status", "0")]) == b"\x00\x0bgrpc-status\x010"
    assert encode([("grpc-message", "")]) == b"\x00\x0cgrpc-message\x00"
    assert encode([(":status", "404")]) == b"\x8d"
    assert encode([(":status", "201")]) == b"\x08\x03201"  # name 8, literal without indexing


def test_encode_rejects_non_latin1():
    with pytest.raises(HPACKError, match="latin-1"):
        encode([("grpc-message", "caf\u00e9 \u2603")])


GRPC_RESPONSES = [
    [(":status", "200"), ("content-type", "application/grpc"), ("grpc-accept-encoding", "identity")],
    [("grpc-status", "0"), ("grpc-message", "")],
    [("grpc-status", "3"), ("grpc-message", "unexpected shape for input%20%22a%22"),
     ("x-trace-bin", "".join(map(chr, range(256))))],
    [(":status", "200"), ("content-length", "0"), ("www-authenticate", ""),
     ("long", "v" * 300), ("x" * 200, "")],
]


@pytest.mark.parametrize("headers", GRPC_RESPONSES)
def test_encode_round_trips(headers):
    block = encode(headers)
    assert encode(headers) == block  # memoized fields give the same bytes
    dec = Decoder()
    assert dec.decode(block) == tuple(headers)
    assert dec.table == ()  # stateless: nothing for the peer to index
    raw = ref.Decoder().decode(block, raw=True)
    assert [(n.decode("latin-1"), v.decode("latin-1")) for n, v in raw] == headers


def test_encode_random_round_trip():
    rng = random.Random(11)
    ref_dec = ref.Decoder()
    dec = Decoder()
    for _ in range(200):
        headers = [(n.decode(), v.decode("latin-1")) for n, v in random_headers(rng, [])]
        headers += rng.sample(STATIC_TABLE, 3)
        block = encode(headers)
        assert dec.decode(block) == tuple(headers)
        raw = ref_dec.decode(block, raw=True)
        assert [(n.decode("latin-1"), v.decode("latin-1")) for n, v in raw] == headers


def test_max_header_fields_stops_decoding_at_the_field_past_it():
    """101 indexed fields then a reference to an index that does not exist: the decoder stops at
    field 101 (TooManyHeaderFields), never reaching the bad index that decoding the whole block
    first would report."""
    block = bytes([0x82]) * 101 + bytes([0xFF, 0x7F])
    with pytest.raises(TooManyHeaderFields, match="more than 100 header fields"):
        Decoder(max_header_fields=100).decode(block)
    assert len(Decoder(max_header_fields=101).decode(bytes([0x82]) * 101)) == 101
    with pytest.raises(HPACKError, match="out of range"):
        Decoder(max_header_fields=200).decode(block)
