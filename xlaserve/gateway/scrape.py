"""The workers' ``/metrics``, served again on the gateway's own with a ``worker`` label.

:func:`scrape` fetches one worker's Prometheus text page (HTTP/1.1 GET, bounded in time and
size); :func:`relabel` merges several pages into one valid exposition: each metric family once
(its ``# HELP`` and ``# TYPE`` from the first page that has it), with every page's samples under
it, each sample carrying ``worker="NAME"``. A line that is not a valid sample (its labels,
its value) or that carries a ``worker`` label of its own is dropped, so one broken page cannot
make the merged one unparseable.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import trio

__all__ = ["scrape", "relabel", "MAX_PAGE_BYTES"]

MAX_PAGE_BYTES = 8 * 1024 * 1024
# a sample line of the text format 0.0.4, whole: name, label set, value, optional timestamp. A
# line that is not one is dropped: passed on, it made the gateway's whole page unparseable, and
# Prometheus fails the scrape (the gateway's own metrics and every other worker's with it)
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*"'
_VALUE = r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|Inf|inf|NaN|nan)"
_SAMPLE = re.compile(rf"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{{\s*(?:{_LABEL}\s*(?:,\s*{_LABEL}\s*)*,?\s*)?\}})?"
                     rf"([ \t]+{_VALUE}(?:[ \t]+-?\d+)?)[ \t]*")
_WORKER_LABEL = re.compile(r'[{,]\s*worker\s*="')


async def scrape(host: str, port: int, *, timeout: float = 5.0, path: str = "/metrics") -> str:
    """The body of ``GET http://host:port/path``. Raises OSError (or trio.TooSlowError) when the
    worker cannot be reached, answers other than 200, or sends more than MAX_PAGE_BYTES."""
    with trio.fail_after(timeout):
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
            data = bytearray()
            while True:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                data += chunk
                if len(data) > MAX_PAGE_BYTES:
                    raise OSError(f"the page is larger than {MAX_PAGE_BYTES} bytes")
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split()
    if len(status) < 2 or status[1] != b"200":
        raise OSError(f"HTTP status {status[1].decode(errors='replace') if len(status) > 1 else '?'}")
    return body.decode("utf-8", errors="replace")


def _family_of(name: str, families: Mapping[str, object]) -> str:
    for suffix in ("_bucket", "_count", "_sum", "_total", "_created", "_gcount", "_gsum"):
        if name.endswith(suffix) and name[: -len(suffix)] in families:
            return name[: -len(suffix)]
    return name


def relabel(pages: Mapping[str, str]) -> str:
    """One exposition of ``pages`` (worker name -> its /metrics text), each sample labelled
    with its worker."""
    families: dict[str, dict] = {}
    for worker, text in pages.items():
        label = 'worker="' + worker.replace("\\", "\\\\").replace('"', '\\"') + '"'
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = families.setdefault(parts[2], {"meta": {}, "samples": []})
                    family["meta"].setdefault(parts[1], line)
                continue
            match = _SAMPLE.fullmatch(line)
            if match is None:
                continue
            name, labels, rest = match.groups()
            if labels and _WORKER_LABEL.search(labels):     # a second worker label: not a valid series
                continue
            labels = "{" + label + ("," + labels[1:] if labels and labels != "{}" else "}")
            family = families.setdefault(_family_of(name, families), {"meta": {}, "samples": []})
            family["samples"].append(name + labels + rest)
    out = []
    for family in families.values():
        out.extend(family["meta"][k] for k in ("HELP", "TYPE") if k in family["meta"])
        out.extend(family["samples"])
    return "\n".join(out) + ("\n" if out else "")
