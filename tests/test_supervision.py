"""The supervisor's pure parts (xlaserve/supervision.py): the restart policy, the line splitter,
and how a child's lines, ready report and exit read. No processes, no clocks."""
from __future__ import annotations

import signal

import pytest

from xlaserve.config import SupervisorConfig
from xlaserve.supervision import (MAX_LINE_BYTES, GiveUp, LineSplitter, Restart, RestartPolicy, describe_exit,
                                  line_text, ordinal_suffix, parse_ready)

# --- the restart policy ----------------------------------------------------------------------------


def test_the_back_off_doubles_from_the_default_and_the_sixth_exit_in_a_minute_gives_up():
    policy = RestartPolicy.from_config(SupervisorConfig())
    decisions = [policy.exited(t) for t in (0.0, 1.0, 2.0, 3.0, 4.0)]
    assert decisions == [Restart(0.5, 1), Restart(1.0, 2), Restart(2.0, 3), Restart(4.0, 4),
                         Restart(8.0, 5)]
    assert policy.exited(5.0) == GiveUp(6)


def test_the_back_off_is_capped():
    policy = RestartPolicy(initial=1.0, maximum=3.0, max_restarts=10, window=100.0)
    assert [policy.exited(t).delay for t in range(5)] == [1.0, 2.0, 3.0, 3.0, 3.0]


def test_exits_older_than_the_window_are_forgotten():
    policy = RestartPolicy(initial=0.5, maximum=30.0, max_restarts=2, window=10.0)
    assert policy.exited(0.0) == Restart(0.5, 1)
    assert policy.exited(5.0) == Restart(1.0, 2)
    # the exit at 0 is 10 s old: out of the window, so this is the second exit in it, not the third
    assert policy.exited(10.0) == Restart(1.0, 2)
    # a worker that stays up longer than the window starts over at the first back-off
    assert policy.exited(100.0) == Restart(0.5, 1)
    assert policy.exited(101.0) == Restart(1.0, 2)
    assert policy.exited(102.0) == GiveUp(3)


def test_max_restarts_zero_gives_up_at_the_first_exit():
    assert RestartPolicy(initial=0.5, maximum=1.0, max_restarts=0, window=60.0).exited(0.0) == GiveUp(1)


def test_a_long_run_of_allowed_restarts_stays_finite():
    policy = RestartPolicy(initial=0.5, maximum=30.0, max_restarts=5000, window=1e9)
    delays = [policy.exited(float(t)).delay for t in range(5000)]
    assert delays[-1] == 30.0 and all(d <= 30.0 for d in delays)


@pytest.mark.parametrize("kwargs", [
    {"initial": 2.0, "maximum": 1.0, "max_restarts": 1, "window": 1.0},
    {"initial": -1.0, "maximum": 1.0, "max_restarts": 1, "window": 1.0},
    {"initial": 0.5, "maximum": 1.0, "max_restarts": -1, "window": 1.0},
    {"initial": 0.5, "maximum": 1.0, "max_restarts": 1, "window": 0.0},
])
def test_an_impossible_policy_is_refused(kwargs):
    with pytest.raises(ValueError, match="restart policy"):
        RestartPolicy(**kwargs)


def test_describe_exit_names_the_code_or_the_signal():
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-signal.SIGKILL) == "killed by signal SIGKILL"
    assert describe_exit(-200) == "killed by signal 200"


# --- lines -----------------------------------------------------------------------------------------


def test_lines_are_reassembled_across_chunks():
    splitter = LineSplitter(100)
    assert splitter.feed(b"one\ntw") == [(b"one", False)]
    assert splitter.feed(b"o\n\nthr") == [(b"two", False), (b"", False)]
    assert splitter.feed(b"ee") == []
    assert splitter.finish() == b"three"
    assert splitter.finish() is None


def test_an_endless_line_is_cut_at_the_limit_and_the_rest_dropped():
    splitter = LineSplitter(1000)
    out = []
    for _ in range(1000):                     # 1 MB without a newline, in 1 KiB chunks
        out += splitter.feed(b"x" * 1024)
        assert len(splitter._line) <= 1000    # what it holds never grows past the limit
    assert out == [(b"x" * 1000, True)]
    assert splitter.feed(b"tail of it\nnext\n") == [(b"next", False)]
    assert splitter.finish() is None


def test_a_line_of_exactly_the_limit_is_not_cut():
    splitter = LineSplitter(4)
    assert splitter.feed(b"abcd\nabcde\nz\n") == [(b"abcd", False), (b"abcd", True), (b"z", False)]


def test_a_cut_line_without_newline_leaves_nothing_to_finish():
    splitter = LineSplitter(4)
    assert splitter.feed(b"abcdefgh") == [(b"abcd", True)]
    assert splitter.finish() is None


def test_a_cut_line_says_so_and_an_undecodable_byte_is_replaced():
    assert line_text(b"plain\r", False) == "plain"
    assert line_text(b"x" * 4, True) == f"xxxx [cut: line longer than {MAX_LINE_BYTES} bytes]"
    assert line_text(b"caf\xe9", False) == "caf\ufffd"


# --- the ready report and the crash report's words -------------------------------------------------


def test_a_ready_report_gives_both_ports():
    assert parse_ready(b'{"grpc_port": 8001, "http_port": 8000, "pid": 7}') == (8001, 8000)


@pytest.mark.parametrize("line", [
    b"not json", b"[8001, 8000]", b'{"grpc_port": 8001}', b'{"grpc_port": true, "http_port": 8000}',
    b'{"grpc_port": 0, "http_port": 8000}', b'{"grpc_port": 8001, "http_port": 65536}',
    b'{"grpc_port": "8001", "http_port": 8000}', b"[" * 100_000,
])
def test_anything_but_a_ready_report_is_not_believed(line):
    assert parse_ready(line) is None


def test_ordinal_suffixes():
    assert [f"{n}{ordinal_suffix(n)}" for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 111, 112)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st", "111th", "112th"]
