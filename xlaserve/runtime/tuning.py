"""Compile options chosen per module by measurement, when the module is first compiled.

XLA's cpu backend has more than one way to run a convolution (its own Eigen-based path, YNNPACK),
and which is faster depends on the model: grouped convolutions run faster on YNNPACK, ResNet-18's
dense ones on XLA's path, and the Flax MNIST CNN's small dense ones fastest with XLA's own
defaults (docs/benchmarks.md, docs/export.md). One global setting cannot suit all, so a module
that has convolutions (:meth:`Device.compile_choices`) is compiled with each candidate set of
options and timed on trial arguments; the fastest is kept, and the executable cache stores it
with the executable (:mod:`xlaserve.runtime.excache`), so the trial runs once per module, not
once per start. Modules without convolutions (text models, MLPs) are compiled once with the
default options and pay nothing.

The trial's cost is bounded: the timed calls of all candidates together stop after about
:data:`TRIAL_SECONDS` (at least one call each after a warm-up), on top of one extra compile per
candidate. Its result and wall time are logged.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from xlaserve.errors import describe_exception
from xlaserve.runtime.pjrt import DEFAULT_CHOICE, Device

log = logging.getLogger("xlaserve.tuning")

#: About how long the timed trial calls of one module may take, all candidates together.
TRIAL_SECONDS = 1.5
#: Rounds of the trial at most (each round times every candidate once, alternating).
TRIAL_ROUNDS = 5
#: Another candidate replaces the default only when its median is this much lower: a trial on
#: a busy machine is noisy, and the default is the one measured on most models.
MARGIN = 0.05


@dataclass(frozen=True, slots=True)
class Tuned:
    """A compiled module and how its options were chosen: ``choice`` names them
    (:data:`~xlaserve.runtime.pjrt.DEFAULT_CHOICE` or a key of
    :data:`~xlaserve.runtime.pjrt.COMPILE_CHOICES`); ``seconds`` is the trial's wall time,
    compiles included (0 without a trial); ``times`` each candidate's trial calls."""

    executable: object
    choice: str
    seconds: float = 0.0
    times: Mapping[str, tuple[float, ...]] = field(default_factory=dict)


def pick(times: Mapping[str, Sequence[float]], default: str = DEFAULT_CHOICE, margin: float = MARGIN) -> str:
    """The candidate with the lowest median time, except that ``default`` is kept unless that
    median is more than ``margin`` (a fraction) below the default's. Candidates without times
    are left out; with none timed, ``default``."""
    medians = {name: statistics.median(t) for name, t in times.items() if t}
    if not medians:
        return default
    best = min(medians, key=lambda name: (medians[name], name != default))
    if default in medians and medians[best] > (1.0 - margin) * medians[default]:
        return default
    return best


def _rounds(warm: Mapping[str, float], budget: float) -> int:
    per_round = sum(warm.values())
    if per_round <= 0:
        return TRIAL_ROUNDS
    return max(1, min(TRIAL_ROUNDS, int(budget / per_round)))


def compile_tuned(device: Device, module: bytes, path: Path | None = None,
                  budget: float | None = None) -> Tuned:
    """``module`` compiled with the options that ran it fastest on trial arguments, among
    :meth:`Device.compile_choices` (the default alone for most modules: then no trial). The
    candidates are timed in alternating rounds after one warm-up call each, so that load from
    other processes slows them alike; ``budget`` (default :data:`TRIAL_SECONDS`) bounds the
    timed calls. A candidate that fails to compile or run is left out (logged), unless it is
    the default, whose errors pass through as :meth:`Device.compile`'s do."""
    choices = device.compile_choices(module)
    if len(choices) == 1:
        return Tuned(device.compile(module, choices[0]), choices[0])
    started = time.perf_counter()
    where = path.name if path is not None else "module"
    executables = {DEFAULT_CHOICE: device.compile(module, DEFAULT_CHOICE)}
    for choice in choices:
        if choice == DEFAULT_CHOICE:
            continue
        try:
            executables[choice] = device.compile(module, choice)
        except Exception as exc:  # XLA's own error types; the default still serves
            log.warning("compile options %s for %s: cannot compile with them (%s); left out", choice, where,
                        " ".join(describe_exception(exc).split())[:200])
    arguments = device.trial_arguments(module)
    warm: dict[str, float] = {}
    for choice, executable in list(executables.items()):
        at = time.perf_counter()
        try:
            device.execute(executable, arguments)
        except Exception as exc:
            if choice == DEFAULT_CHOICE:
                raise
            log.warning("compile options %s for %s: the trial run failed (%s); left out", choice, where,
                        " ".join(describe_exception(exc).split())[:200])
            del executables[choice]
            continue
        warm[choice] = time.perf_counter() - at
    times: dict[str, list[float]] = {choice: [] for choice in executables}
    for _ in range(_rounds(warm, TRIAL_SECONDS if budget is None else budget)):
        for choice, executable in executables.items():
            at = time.perf_counter()
            device.execute(executable, arguments)
            times[choice].append(time.perf_counter() - at)
    chosen = pick(times)
    seconds = time.perf_counter() - started
    log.info("compile options for %s: %s, chosen by a %.2f s trial (median ms per call: %s)", where, chosen, seconds,
             ", ".join(f"{c} {1e3 * statistics.median(t):.2f}" for c, t in times.items()))
    return Tuned(executables[chosen], chosen, seconds, {c: tuple(t) for c, t in times.items()})
