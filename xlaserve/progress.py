"""Progress of long work (an export, the first compile of many batch sizes), as lines that also
count.

A :class:`Step` is the line a step logs, and a ``str``, so every consumer that takes lines (a
logger, a list in a test) takes it unchanged; a progress bar reads how far its stage is from it.
"""
from __future__ import annotations

import logging
import sys
from typing import TextIO

__all__ = ["ProgressReport", "Step", "bar"]


class Step(str):
    """One finished step of a stage, as the line it logs: ``stage`` (``trace``, ``compile``,
    ``verify``) is ``done`` of ``total`` steps along.

    >>> step = Step("compile", 2, 6, "mlp: model.mlir@b2 compiled in 0.21s (2/6)")
    >>> step.done, step.total, step == "mlp: model.mlir@b2 compiled in 0.21s (2/6)"
    (2, 6, True)
    """

    __slots__ = ("stage", "done", "total")

    def __new__(cls, stage: str, done: int, total: int, line: str) -> Step:
        step = super().__new__(cls, line)
        step.stage, step.done, step.total = stage, done, total
        return step


def bar(step: Step, width: int = 24) -> str:
    """``compile [########........] 2/6``: how far ``step``'s stage is, ``width`` cells wide."""
    filled = width * step.done // step.total if step.total > 0 else width
    return f"{step.stage} [{'#' * filled}{'.' * (width - filled)}] {step.done}/{step.total}"


class ProgressReport:
    """Where long work's lines go: each is logged to ``log`` (a line per step, as on any
    stream); when ``stream`` (default stderr, where the log goes) is a terminal, a bar under the
    lines shows how far the current stage is while its next step runs, and is erased before
    the next line and by :meth:`close`."""

    def __init__(self, log: logging.Logger, stream: TextIO | None = None) -> None:
        self._log = log
        self._stream = stream if stream is not None else sys.stderr
        self._terminal = bool(getattr(self._stream, "isatty", lambda: False)())
        self._shown = False

    def __call__(self, line: str) -> None:
        self._erase()
        self._log.info("%s", line)
        if self._terminal and isinstance(line, Step):
            self._stream.write(bar(line))
            self._stream.flush()
            self._shown = True

    def close(self) -> None:
        """Erase the bar (if one is shown): what follows starts on a clean line."""
        self._erase()

    def _erase(self) -> None:
        if self._shown:
            self._stream.write("\r\x1b[K")      # back to the line's start, clear to its end
            self._stream.flush()
            self._shown = False
