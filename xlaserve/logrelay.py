"""Log lines written off the serving loop: a bounded buffer that a thread of its own drains.

A Trio loop that serves requests must never wait for its logs. A write to a stdout or stderr that
nobody reads (``xlaserve run | less`` paused, a pipe whose reader hangs, a blocked journald)
blocks until the reader reads again, and on the loop that blocks every request. A
:class:`LineRelay` takes lines without waiting: they go into a buffer of at most ``max_bytes``
and its writer thread writes them to the file descriptor. When the buffer is full, lines are
dropped and counted; once the writer can write again, one line says how many, where they were
dropped (``xlaserve: 12 log lines dropped: stdout was not being read``). Memory is bounded
whatever the reader does, and the caller never blocks.

:class:`RelayedLogging` sends a process's own log records (its handlers that write to a stream
such as stderr) through relays the same way.
"""
from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

# Lines a relay may hold before it drops: enough for a burst of start-up logs from every worker
# while the writer catches up, and the most a reader that stopped can cost.
MAX_BUFFER_BYTES = 1 << 20
# A longer entry is cut to this many bytes (a multi-line record such as a crash report with its
# workers' last lines); a worker's line is already cut at 64 KiB before it gets here.
MAX_ENTRY_BYTES = MAX_BUFFER_BYTES // 4
# Charged per line beyond its bytes, for the object that holds it: a flood of empty lines is
# bounded like a flood of long ones.
ENTRY_OVERHEAD_BYTES = 64
# How long closing a relay waits for its writer to write what is buffered; a reader that still
# does not read then loses it (the process is ending).
FLUSH_SECONDS = 2.0


def drop_notice(count: int, stream: str) -> str:
    """The line that stands where ``count`` lines were dropped because ``stream`` was not read."""
    return f"xlaserve: {count} log line{'s' if count != 1 else ''} dropped: {stream} was not being read"


def stream_name(fd: int) -> str:
    return {1: "stdout", 2: "stderr"}.get(fd, f"file descriptor {fd}")


@dataclass(frozen=True, slots=True)
class RelayStatistics:
    """A snapshot of a relay: lines and bytes buffered (those being written included), lines
    written, and lines dropped since it opened (no room, or the write failed)."""

    buffered_lines: int
    buffered_bytes: int
    written_lines: int
    dropped_lines: int


class LineRelay:
    """Writes lines to the file descriptor ``fd`` from a thread of its own; :meth:`put` never waits.

    ``put`` encodes the line (UTF-8; what cannot be encoded, such as a lone surrogate, is written
    as a backslash escape) and appends it to the buffer. While the lines buffered and being
    written take ``max_bytes`` (each charged :data:`ENTRY_OVERHEAD_BYTES` more), a new line is
    dropped; once one is dropped, every line is dropped until the writer takes what is buffered,
    so the dropped lines form one gap in the output. The writer writes the lines before the gap,
    then ``notice(count, stream)`` in its place (default :func:`drop_notice`), then what came
    after. A write that fails (the reader closed its end: EPIPE) loses its lines; they are
    counted and reported with the next write that succeeds. The writer never gives up: a reader
    that comes back gets the lines that came after.

    A context manager: leaving it closes the relay (:meth:`close`). The writer is a daemon
    thread, so a reader that never reads again cannot keep the process from exiting.
    """

    def __init__(self, fd: int, *, stream: str | None = None, max_bytes: int = MAX_BUFFER_BYTES,
                 notice: Callable[[int, str], str] = drop_notice) -> None:
        if max_bytes <= ENTRY_OVERHEAD_BYTES:
            raise ValueError(f"line relay: max_bytes must exceed {ENTRY_OVERHEAD_BYTES}, got {max_bytes}")
        self.fd = fd
        self.stream = stream or stream_name(fd)
        self.max_bytes = max_bytes
        self._max_entry = min(MAX_ENTRY_BYTES, max_bytes - ENTRY_OVERHEAD_BYTES - 1)   # and its newline
        self._notice = notice
        self._changed = threading.Condition(threading.Lock())
        self._lines: deque[bytes] = deque()
        self._held = 0             # bytes charged for the buffered lines and those being written
        self._held_lines = 0
        self._dropping = False     # a gap is open: nothing is taken until the writer takes the buffer
        self._gap = 0              # lines dropped in the open gap
        self._dropped = 0
        self._written = 0
        self._writing = False      # the writer holds lines or a notice it has not written yet
        self._closing = False
        self._thread = threading.Thread(target=self._write_lines, name=f"xlaserve-{self.stream}-relay",
                                        daemon=True)
        self._thread.start()

    def __enter__(self) -> LineRelay:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def put(self, line: str) -> None:
        """Queue ``line`` (without its newline) to be written, or drop it; never waits for the
        reader. Safe from any thread."""
        data = line.encode("utf-8", "backslashreplace")
        if len(data) > self._max_entry:
            marker = f" [cut: log entry longer than {self._max_entry} bytes]".encode()
            data = data[:self._max_entry - len(marker)] + marker
        data += b"\n"
        cost = len(data) + ENTRY_OVERHEAD_BYTES
        with self._changed:
            if self._closing:
                self._dropped += 1
                return
            if self._dropping or self._held + cost > self.max_bytes:
                self._dropping = True
                self._gap += 1
                self._dropped += 1
                return
            self._lines.append(data)
            self._held += cost
            self._held_lines += 1
            self._changed.notify_all()

    def statistics(self) -> RelayStatistics:
        with self._changed:
            return RelayStatistics(self._held_lines, self._held, self._written, self._dropped)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (blocking; at most ``timeout`` seconds) until every line taken so far, and the
        notice of any gap, has been written or lost; whether it was."""
        with self._changed:
            return self._changed.wait_for(lambda: not (self._held or self._gap or self._writing), timeout)

    def close(self, timeout: float = FLUSH_SECONDS) -> bool:
        """Take no more lines; wait (blocking) at most ``timeout`` seconds for the writer to write
        what is buffered. Whether it did: False when the reader still was not reading."""
        self.begin_close()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def begin_close(self) -> None:
        """Take no more lines; the writer ends once it has written what is buffered."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()

    # -- the writer thread --

    def _write_lines(self) -> None:
        lost = 0     # lines whose write failed, to be reported before the next lines written
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._lines or self._gap or self._closing)
                batch = list(self._lines)
                self._lines.clear()
                gap, self._gap = self._gap, 0
                self._dropping = False
                closing = self._closing and not batch
                if closing and not gap and not lost:
                    return
                self._writing = True
            chunks = []
            if lost:
                chunks.append(self._notice_line(lost))
            chunks += batch
            if gap:
                chunks.append(self._notice_line(gap))
            written = _write_all(self.fd, b"".join(chunks))
            if written:
                lost = 0
            else:
                lost += len(batch) + gap
            with self._changed:
                self._held -= sum(len(line) + ENTRY_OVERHEAD_BYTES for line in batch)
                self._held_lines -= len(batch)
                if written:
                    self._written += len(batch)
                else:
                    self._dropped += len(batch)
                self._writing = False
                self._changed.notify_all()
            if closing:
                return

    def _notice_line(self, count: int) -> bytes:
        return self._notice(count, self.stream).encode("utf-8", "backslashreplace") + b"\n"


def _write_all(fd: int, data: bytes) -> bool:
    """Write all of ``data`` to ``fd``, waiting as long as the reader takes (also on a
    descriptor someone made non-blocking); False when the write fails."""
    view = memoryview(data)
    poller = None
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            if poller is None:
                poller = select.poll()
                poller.register(fd, select.POLLOUT)
            poller.poll()
        except OSError:
            return False
    return True


class _RelayHandler(logging.Handler):
    """Formats records as ``handler`` would (its level, filters and formatter) and puts them on
    ``relay`` instead of writing them to ``handler``'s stream."""

    def __init__(self, handler: logging.StreamHandler, relay: LineRelay) -> None:
        super().__init__(handler.level)
        self.handler = handler
        self.relay = relay
        self.filters = list(handler.filters)

    def format(self, record: logging.LogRecord) -> str:
        return self.handler.format(record)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.relay.put(self.format(record))
        except Exception:
            self.handleError(record)


class RelayedLogging:
    """While entered, each handler of ``logger`` (default: the root logger) that writes to a
    stream on a file descriptor (the command's stderr handler) is replaced by one that writes
    the same text through a :class:`LineRelay` on that descriptor (one relay per descriptor).
    Other handlers (files, pytest's capture) are left as they are. Leaving puts the handlers
    back and closes the relays (waiting at most :data:`FLUSH_SECONDS` for a stalled reader).
    """

    def __init__(self, logger: logging.Logger | None = None, *, max_bytes: int = MAX_BUFFER_BYTES,
                 notice: Callable[[int, str], str] = drop_notice) -> None:
        self.logger = logger or logging.getLogger()
        self._max_bytes = max_bytes
        self._notice = notice
        self.relays: dict[int, LineRelay] = {}
        self._replaced: list[tuple[logging.Handler, _RelayHandler]] = []

    def __enter__(self) -> RelayedLogging:
        self.start()
        return self

    def start(self) -> None:
        """Replace the handlers (what entering does)."""
        for handler in list(self.logger.handlers):
            fd = _stream_fd(handler)
            if fd is None:
                continue
            handler.flush()         # what it buffered goes before what the relay writes
            relay = self.relays.get(fd)
            if relay is None:
                relay = self.relays[fd] = LineRelay(fd, max_bytes=self._max_bytes, notice=self._notice)
            relayed = _RelayHandler(handler, relay)
            self.logger.addHandler(relayed)
            self.logger.removeHandler(handler)
            self._replaced.append((handler, relayed))

    def __exit__(self, *exc_info: object) -> None:
        self.restore()
        self.close()

    def restore(self) -> None:
        """Put the original handlers back (the relays stay open until :meth:`close`)."""
        for handler, relayed in self._replaced:
            self.logger.addHandler(handler)
            self.logger.removeHandler(relayed)
        self._replaced.clear()

    def close(self, timeout: float = FLUSH_SECONDS) -> None:
        """Close every relay, waiting at most ``timeout`` seconds in all (blocking)."""
        for relay in self.relays.values():
            relay.begin_close()
        deadline = time.monotonic() + timeout
        for relay in self.relays.values():
            relay.close(max(0.0, deadline - time.monotonic()))


def _stream_fd(handler: logging.Handler) -> int | None:
    if not isinstance(handler, logging.StreamHandler) or isinstance(handler, logging.FileHandler):
        return None
    try:
        return handler.stream.fileno()
    except (AttributeError, OSError, ValueError):    # io.UnsupportedOperation is both of the last
        return None
