"""Issue 14's denial-of-service attacks against the real worker, over raw HTTP/2 frames on loopback.

The scenarios and the harness live in ``tests/h2attacks.py``; ``scripts/attack_probe.py`` runs all
of them and prints how the server fares (docs/security.md has its table for the current server).
Each attack in WITHSTOOD is a test that holds the server to the issue's three goals: RSS grows by at
most 64 MB and comes back, the attacking connection is closed within 1 s of crossing its limit (or
the attack's own goal, see ``h2attacks.Attack``), and a well-behaved Triton client on another
connection keeps its p99 within 3x of its quiet p99.
"""
from __future__ import annotations

import struct

import hpack
import pytest

from examples.export_examples import export_mlp, export_simple
from tests import h2attacks
from tests.conftest import serve

# The attacks the server withstands; only these are collected as tests. Since issue 14's limits,
# every scenario of the table (and malformed_grpc) is here.
WITHSTOOD = {"continuation_flood", "ping_flood", "settings_flood", "settings_window_churn", "rapid_reset",
             "preface_only", "slow_reader", "huffman_header", "table_size_updates", "decode_cache_fill",
             "empty_header_name", "gzip_bomb", "malformed_grpc"}

LEGIT_RETRIES = 2      # further runs of an attack whose only miss was the other client's p99

TABLE = ["continuation_flood", "ping_flood", "settings_flood", "settings_window_churn", "rapid_reset",
         "preface_only", "slow_reader", "huffman_header", "table_size_updates", "decode_cache_fill",
         "empty_header_name", "gzip_bomb"]


def test_every_row_of_the_table_has_a_scenario():
    assert [name for name in h2attacks.ATTACKS if name in TABLE] == TABLE
    assert WITHSTOOD <= h2attacks.ATTACKS.keys()


@pytest.fixture(scope="module")
def attack_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("attack_models")
    export_simple(repo, compiled_batch_sizes=(1, 8))
    export_mlp(repo, compiled_batch_sizes=(1, 8))
    return repo


@pytest.mark.parametrize("name", [name for name in h2attacks.ATTACKS if name in WITHSTOOD])
def test_attack_is_withstood(name, attack_repo, tmp_path):
    with serve(tmp_path, attack_repo) as server:
        address = ("127.0.0.1", server.grpc_port)
        m = h2attacks.measure(h2attacks.ATTACKS[name], address, server.process.pid)
        verdict = h2attacks.judge(m)
        for _ in range(LEGIT_RETRIES):
            if not (verdict.rss and verdict.close is not False and not verdict.legit and not m.legit_failures):
                break
            # Only the other client's p99 missed, with every call answered: with the attacker, the
            # worker and the client on 2 cores, one scheduling stall is enough (slow_reader and
            # decode_cache_fill pass with little to spare). The attack runs again and must pass whole.
            m = h2attacks.measure(h2attacks.ATTACKS[name], address, server.process.pid)
            verdict = h2attacks.judge(m)
        log = server.log()
    assert verdict.rss, f"RSS grew {m.rss_peak_growth_mb} MB, {m.rss_after_growth_mb} MB after: {m}"
    assert verdict.close is not False, f"{m.close_goal!r} goal missed: {m.outcome}"
    assert verdict.legit, f"well-behaved client: p99 {m.quiet_p99_ms} -> {m.attack_p99_ms} ms, {m.legit_errors}"
    assert "Traceback" not in log


# ---- the scenarios' own encoding, checked against the h2 project's HPACK decoder -----------------
def test_request_blocks_decode_as_sent():
    block = h2attacks.request_block(h2attacks.MODEL_INFER, (b"x-big", b"v" * 300))
    fields = hpack.Decoder().decode(block, raw=True)
    assert fields[2] == (b":path", h2attacks.MODEL_INFER.encode())
    assert fields[-1] == (b"x-big", b"v" * 300)
    assert len(h2attacks._FILL_FIELD) == 4096
    assert hpack.Decoder().decode(h2attacks._FILL_FIELD * 2, raw=True) == [(b"x-flood", b"a" * 4084)] * 2


def test_huffman_value_decodes_to_letters():
    encoded = h2attacks._huffman_a(800)
    block = b"\x00" + h2attacks.hpack_int(6, 7) + b"x-huff" + h2attacks.hpack_int(len(encoded), 7, 0x80) + encoded
    assert hpack.Decoder().decode(block, raw=True) == [(b"x-huff", b"a" * 800)]
    assert len(encoded) == 500


def test_table_size_updates_are_valid_hpack():
    decoder = hpack.Decoder()
    assert decoder.decode(h2attacks._TABLE_SIZE_UPDATE * 5 + h2attacks.request_block("/p")) != []
    assert decoder.header_table_size == 4096


def test_frames_split_at_the_frame_size():
    frames = h2attacks.header_frames(3, b"x" * 40_000, 16_384, h2attacks.END_STREAM)
    headers = []
    pos = 0
    while pos < len(frames):
        length_type, flags, sid = struct.unpack_from(">IBI", frames, pos)
        headers.append((length_type & 0xFF, length_type >> 8, flags, sid))
        pos += 9 + (length_type >> 8)
    assert headers == [(h2attacks.HEADERS, 16_384, h2attacks.END_STREAM, 3),
                       (h2attacks.CONTINUATION, 16_384, 0, 3),
                       (h2attacks.CONTINUATION, 40_000 - 32_768, h2attacks.END_HEADERS, 3)]


# ---- the judge -------------------------------------------------------------------------------------
def _measurement(close_goal, *, peak=10.0, after=2.0, quiet=2.0, attacked=5.0, failures=0, **outcome):
    fields = dict(attack="x", connections=1, bytes_sent=1, frames_sent=1, seconds=1.0, limit_after=1.0)
    return h2attacks.Measurement(
        outcome=h2attacks.AttackOutcome(**{**fields, **outcome}), close_goal=close_goal, rss_before_mb=200.0,
        rss_peak_growth_mb=peak, rss_after_growth_mb=after, quiet_p99_ms=quiet, attack_p99_ms=attacked,
        legit_requests=100, legit_failures=failures)


def test_judge_holds_each_goal():
    assert h2attacks.judge(_measurement("close", closed="goaway", closed_after=1.8)).withstood
    assert h2attacks.judge(_measurement("close", closed="goaway", closed_after=2.2)).close is False
    assert h2attacks.judge(_measurement("close")).close is False
    assert h2attacks.judge(_measurement(None)).close is None
    assert h2attacks.judge(_measurement(None, peak=65.0)).rss is False
    assert h2attacks.judge(_measurement(None, after=17.0)).rss is False
    assert h2attacks.judge(_measurement(None, attacked=6.5)).legit is False
    assert h2attacks.judge(_measurement(None, failures=1)).legit is False
    assert h2attacks.judge(_measurement("reject", first_rst_after=1.5)).close is True
    assert h2attacks.judge(_measurement("reject", closed="eof", closed_after=1.0)).close is False
    assert h2attacks.judge(_measurement("answer", calls=4, statuses=(("3", 4),))).close is True
    assert h2attacks.judge(_measurement("answer", calls=4, statuses=(("0", 1), ("3", 3)))).close is False
