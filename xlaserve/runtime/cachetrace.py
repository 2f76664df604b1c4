"""The weight cache's trace: every dispatch's reference, hit or miss, as JSON lines.

A worker with ``runtime.weight_trace: <path>`` writes one header line, then one line per
:meth:`~xlaserve.runtime.weights.WeightCache.ensure_resident` of a model with weights::

    {"format": "xlaserve-weight-trace", "version": 1, "budget_bytes": 3145728, "policy": "gdsf"}
    {"t": 0.0012, "model": "m007", "version": 1, "bytes": 1048576, "floor": "system", "hit": false, "load_seconds": 0.0004}
    {"t": 0.0031, "model": "m007", "version": 1, "bytes": 1048576, "floor": "system", "hit": true, "load_seconds": null}

``t`` is seconds since the cache started; ``load_seconds`` is the copy's time on a miss (a
dispatch that waited for a prefetch under way counts as a hit, as in the metrics). ``python -m
benchmarks.cache_sim replay <path>`` replays it under each policy and Belady's MIN.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("xlaserve.weights")

FORMAT = "xlaserve-weight-trace"
VERSION = 1
# A trace stops (one log line says so) after this many references: about 130 bytes each.
MAX_EVENTS = 10_000_000
_FLUSH_EVERY = 256


@dataclass(frozen=True, slots=True)
class TraceHeader:
    budget_bytes: int
    policy: str


@dataclass(frozen=True, slots=True)
class TraceEvent:
    t: float
    model: str
    version: int
    nbytes: int
    floor: str
    hit: bool
    load_seconds: float | None


class TraceWriter:
    """Appends the cache's references to a JSON-lines file. A write that fails (disk full,
    file removed) stops the trace with one error line; the cache goes on serving."""

    def __init__(self, path: Path, budget_bytes: int, policy: str, *, max_events: int = MAX_EVENTS) -> None:
        self.path = Path(path)
        self.max_events = max_events
        self.events = 0
        self._started = time.monotonic()
        self._file = open(self.path, "w", encoding="utf-8")    # noqa: SIM115 -- held until close()
        self._write({"format": FORMAT, "version": VERSION, "budget_bytes": budget_bytes, "policy": policy})

    def record(self, model: str, version: int, nbytes: int, floor: str, hit: bool,
               load_seconds: float | None) -> None:
        if self._file is None:
            return
        if self.events >= self.max_events:
            log.warning("weight trace %s: stopped after %d references (its limit)", self.path, self.max_events)
            self.close()
            return
        self.events += 1
        self._write({"t": round(time.monotonic() - self._started, 6), "model": model, "version": version,
                     "bytes": nbytes, "floor": floor, "hit": hit,
                     "load_seconds": None if load_seconds is None else round(load_seconds, 7)})
        if self.events % _FLUSH_EVERY == 0:
            self._flush()

    def _write(self, record: dict) -> None:
        try:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        except (OSError, ValueError) as exc:
            self._fail(exc)

    def _flush(self) -> None:
        try:
            self._file.flush()
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        log.error("weight trace %s: cannot write (%s); tracing stops, serving goes on", self.path, exc)
        file, self._file = self._file, None
        try:
            file.close()
        except OSError:
            pass

    def close(self) -> None:
        if self._file is None:
            return
        self._flush()
        if self._file is not None:
            self._file.close()
            self._file = None


def read_trace(path: str | Path) -> tuple[TraceHeader, list[TraceEvent]]:
    """Parse a trace; ValueError naming the line and what was expected. A last line cut short
    (the worker was killed mid-write) is ignored."""
    lines = Path(path).read_text(encoding="utf-8").split("\n")
    if not lines or not lines[0].strip():
        raise ValueError(f"{path}: empty; expected a weight trace's header line")
    try:
        head = json.loads(lines[0])
        if head.get("format") != FORMAT:
            raise ValueError
        header = TraceHeader(int(head["budget_bytes"]), str(head.get("policy", "")))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{path}:1: expected the header {{\"format\": \"{FORMAT}\", \"budget_bytes\": ...}}, "
                         f"got {lines[0][:120]!r}") from None
    events: list[TraceEvent] = []
    last = len(lines) - 1
    for n, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            e = json.loads(line)
            load = e["load_seconds"]
            events.append(TraceEvent(float(e["t"]), str(e["model"]), int(e["version"]), int(e["bytes"]),
                                     str(e["floor"]), bool(e["hit"]), None if load is None else float(load)))
        except (ValueError, KeyError, TypeError, AttributeError):
            if n - 1 == last:
                break
            raise ValueError(f"{path}:{n}: expected a reference with t, model, version, bytes, floor, hit and "
                             f"load_seconds, got {line[:120]!r}") from None
    return header, events
