"""Progress of long work (an export, the first compile of many batch sizes), as lines that also
count.

A :class:`Step` is the line a step logs, and a ``str``, so every consumer that takes lines (a
logger, a list in a test) takes it unchanged; a progress bar reads how far its stage is from it.
"""
from __future__ import annotations

__all__ = ["Step"]


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
