"""The two log formats of ``logging.format``: ``text`` and ``json``.

A process formats its own records with :func:`formatter`. A supervisor also writes the lines its
workers print, each marked with the worker's name (:func:`worker_line`): ``[worker0] ...`` in
text, a ``worker`` field in JSON. A worker started by the supervisor is told the node's format
(``--log-format``), so in ``json`` its lines arrive as JSON objects and only gain the field.

Either format is safe to show on a terminal, whatever a worker printed or a record quotes (a
model's name, a worker's output in a crash report): in ``text`` every control character but tab
(and the newlines of a multi-line record) is written as ``\\xNN``
(:func:`~xlaserve.controlchars.show_controls`); in ``json`` every one is a JSON escape.
"""
from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

from xlaserve.controlchars import show_controls

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# JSON escapes C0 but not DEL or C1 (U+0080-U+009F), which json.dumps(ensure_ascii=False) writes
# as they are; a terminal that shows the log may read U+009B as CSI
_UNESCAPED_CONTROLS = re.compile(r"[\x7f-\x9f]")


def _json_line(entry: dict[str, Any], **options: Any) -> str:
    """``entry`` as one JSON line, non-ASCII text as it is, every control character escaped."""
    text = json.dumps(entry, ensure_ascii=False, **options)
    return _UNESCAPED_CONTROLS.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


class TextFormatter(logging.Formatter):
    """``time LEVEL logger: message`` (:data:`TEXT_FORMAT`), with control characters but tab and
    newline written as ``\\xNN``: a record that quotes what a peer wrote (a worker's last lines, a
    model's name) cannot rewrite the operator's terminal."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        return show_controls(super().format(record), "\t\n")



class JsonFormatter(logging.Formatter):
    """One JSON object a record: ``time`` (UTC, ISO 8601 with milliseconds), ``level`` (lower
    case, the node file's vocabulary), ``logger``, ``message``; ``worker`` when the record was
    logged with ``extra={"worker": name}``; ``exception`` with the formatted traceback when there
    is one. A multi-line message stays one object (the newlines are escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        entry: dict[str, Any] = {
            "time": f"{seconds}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        worker = getattr(record, "worker", None)
        if worker is not None:
            entry["worker"] = worker
        entry["message"] = record.getMessage()
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return _json_line(entry)


def formatter(log_format: str) -> logging.Formatter:
    """The formatter for ``logging.format`` ``text`` or ``json`` (ValueError for anything else)."""
    if log_format == "json":
        return JsonFormatter()
    if log_format == "text":
        return TextFormatter()
    raise ValueError(f"log format: expected one of {', '.join(LOG_FORMATS)}, got {log_format!r}")


def worker_line(worker: str, text: str, log_format: str) -> str:
    """One line a worker printed (``text``, without its newline) as the supervisor writes it.

    ``text`` format: ``[worker] text``, control characters but tab as ``\\xNN``. ``json``: a line that is itself a JSON object gets a
    ``worker`` field (first; replacing any the worker wrote, since the supervisor knows which
    process printed it); any other line (one with NaN or an infinite number included, which
    JSON has no word for) becomes ``{"worker": ..., "message": text}``. Total:
    whatever a worker prints (JSON nested past the recursion limit, lone surrogates, control
    characters) gives a line, never an exception."""
    if log_format != "json":
        return show_controls(f"[{worker}] {text}", "\t")
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
            if isinstance(parsed, dict):
                parsed.pop("worker", None)
                # allow_nan=False: Python reads NaN, Infinity and 1e999, but written back they
                # would make a line that is not JSON, which a log shipper rejects
                return _json_line({"worker": worker, **parsed}, allow_nan=False)
        except (ValueError, RecursionError):
            # not JSON (or not as JSON defines it: NaN, Infinity), or nested deeper than the parser
            # recurses: the line is kept as text
            pass
    return _json_line({"worker": worker, "message": text})


def process_line(text: str, log_format: str, *, level: str = "warning",
                 logger: str = "xlaserve.supervisor") -> str:
    """A line the process writes of its own, outside its logging (the relay's count of dropped
    lines): ``text`` as is, or in ``json`` an object like :class:`JsonFormatter`'s."""
    if log_format != "json":
        return text
    now = time.time()
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now))
    return _json_line({"time": f"{seconds}.{int(now * 1000) % 1000:03d}Z", "level": level,
                       "logger": logger, "message": text})
