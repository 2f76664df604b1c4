"""What the supervisor decides and reads, without processes or clocks: when a worker that exited
is restarted (:class:`RestartPolicy`: a capped, doubling back-off over a sliding window, then
:class:`GiveUp`), how a child's output is cut into bounded lines (:class:`LineSplitter`), and
how a worker's ready report and its exit read (:func:`parse_ready`, :func:`describe_exit`).

Pure: the caller passes the time and the bytes. :mod:`xlaserve.supervisor` runs the processes
and asks these.
"""
from __future__ import annotations

import collections
import json
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xlaserve.config.schema import SupervisorConfig

__all__ = ["MAX_LINE_BYTES", "GiveUp", "LineSplitter", "Restart", "RestartPolicy", "describe_exit",
           "line_text", "ordinal_suffix", "parse_ready"]

# A child that prints a line without end (a runaway loop, binary garbage) must not make the
# supervisor hold it all: past this many bytes the line is written cut, and the rest of it dropped.
MAX_LINE_BYTES = 64 * 1024


# --- the restart policy --------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Restart:
    """Restart the worker after ``delay`` seconds; this is its ``restarts_in_window``-th restart
    within the window."""

    delay: float
    restarts_in_window: int


@dataclass(frozen=True, slots=True)
class GiveUp:
    """Restart no more and stop the node: the worker exited ``exits_in_window`` times within
    the window, more than the restarts allowed."""

    exits_in_window: int


class RestartPolicy:
    """What to do when one worker exits unexpectedly: its exit times in, a decision out.

    Exits are counted over a sliding window of ``window`` seconds (this exit included). The
    n-th exit within the window is answered with a restart after ``initial * 2**(n-1)``
    seconds, at most ``maximum``; an exit that would be restart number ``max_restarts + 1``
    within the window is answered :class:`GiveUp`. A worker that stays up longer than the window
    starts over at ``initial``. Pure: the caller passes the time, so the policy is tested
    without processes or clocks. Memory is bounded: at most ``max_restarts + 1`` times are kept.
    """

    def __init__(self, *, initial: float, maximum: float, max_restarts: int, window: float) -> None:
        if not (0 <= initial <= maximum) or max_restarts < 0 or window <= 0:
            raise ValueError(f"restart policy: need 0 <= initial ({initial}) <= maximum ({maximum}), "
                             f"max_restarts ({max_restarts}) >= 0 and window ({window}) > 0")
        self.initial = initial
        self.maximum = maximum
        self.max_restarts = max_restarts
        self.window = window
        self._exits: collections.deque[float] = collections.deque()

    @classmethod
    def from_config(cls, config: SupervisorConfig) -> RestartPolicy:
        return cls(initial=config.restart_backoff_initial_seconds,
                   maximum=config.restart_backoff_max_seconds,
                   max_restarts=config.max_restarts, window=config.restart_window_seconds)

    def exited(self, now: float) -> Restart | GiveUp:
        """The worker exited at ``now`` (seconds, any monotonic clock; never earlier than a
        previous call's)."""
        self._exits.append(now)
        while self._exits[0] <= now - self.window:
            self._exits.popleft()
        count = len(self._exits)
        if count > self.max_restarts:
            return GiveUp(count)
        # 2**60 already exceeds any cap in seconds; the bound keeps the float finite
        delay = min(self.maximum, self.initial * 2.0 ** min(count - 1, 60))
        return Restart(delay, count)


# --- output lines --------------------------------------------------------------------------------

class LineSplitter:
    """Cuts a byte stream into lines of at most ``limit`` bytes (the newline not counted).

    :meth:`feed` returns the lines completed by a chunk as ``(line, cut)``: a line longer than
    ``limit`` is returned as its first ``limit`` bytes with ``cut`` true as soon as it crosses
    the limit, and its remaining bytes up to the next newline are dropped. So the splitter holds
    at most ``limit`` bytes, whatever the stream. :meth:`finish` returns a last line that had no
    newline (None if there is none)."""

    def __init__(self, limit: int = MAX_LINE_BYTES) -> None:
        self.limit = limit
        self._line = bytearray()
        self._dropping = False

    def feed(self, data: bytes) -> list[tuple[bytes, bool]]:
        lines: list[tuple[bytes, bool]] = []
        start = 0
        while start < len(data):
            newline = data.find(b"\n", start)
            end = len(data) if newline < 0 else newline
            if not self._dropping:
                room = self.limit - len(self._line)
                if end - start > room:
                    self._line += data[start:start + room]
                    lines.append((bytes(self._line), True))
                    self._line.clear()
                    self._dropping = True
                else:
                    self._line += data[start:end]
            if newline < 0:
                break
            if self._dropping:
                self._dropping = False
            else:
                lines.append((bytes(self._line), False))
                self._line.clear()
            start = newline + 1
        return lines

    def finish(self) -> bytes | None:
        if self._dropping or not self._line:
            return None
        line = bytes(self._line)
        self._line.clear()
        return line


# --- what a child's exit and ready report say ------------------------------------------------

def describe_exit(returncode: int) -> str:
    """``exit code 3`` or ``killed by signal SIGKILL``."""
    if returncode < 0:
        try:
            return f"killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def line_text(line: bytes, cut: bool) -> str:
    """A child's line as the node's log writes it: UTF-8 (an undecodable byte replaced), no
    carriage return, and a line :class:`LineSplitter` cut says so."""
    text = line.decode("utf-8", "replace").rstrip("\r")
    return f"{text} [cut: line longer than {MAX_LINE_BYTES} bytes]" if cut else text


def parse_ready(line: bytes) -> tuple[int, int] | None:
    """The ``(grpc_port, http_port)`` of a worker's ready report, a JSON object on one line; None
    for anything else (not JSON, not an object, a port missing, not an int, or out of range)."""
    try:
        report = json.loads(line)
    except (ValueError, RecursionError):    # not JSON, or nested past the parser's recursion
        return None
    if not isinstance(report, dict):
        return None
    ports = report.get("grpc_port"), report.get("http_port")
    if all(isinstance(p, int) and not isinstance(p, bool) and 0 < p <= 65535 for p in ports):
        return ports[0], ports[1]
    return None


def ordinal_suffix(n: int) -> str:
    """``st``, ``nd``, ``rd`` or ``th``: how English writes the ``n``-th."""
    if 10 <= n % 100 <= 20:
        return "th"
    return {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
