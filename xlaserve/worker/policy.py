"""Scheduling disciplines and the learned cost model. Pure: no I/O, no clock of their own.

The scheduler owns one :class:`CostModel` and one policy. When the device frees, it describes
each backlogged model's next dispatch as a :class:`Candidate` and asks the policy which model
goes next; the policy may charge the winner (``fair``) for the dispatch it is about to make.

Times are seconds on the Trio clock (``trio.current_time()``), passed in by the caller, so the
policies run the same under a real clock and under ``trio.testing.MockClock``.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

#: What an unmeasured dispatch is charged when nothing at all has been measured yet.
#: Deliberately high for a CPU- or GPU-sized model so a newcomer cannot grab the device on credit.
DEFAULT_UNMEASURED_SECONDS = 0.05


@dataclass(frozen=True, slots=True)
class Candidate:
    """A backlogged model's next dispatch, as the scheduler would make it now."""

    model: str
    size: int                 # the compiled batch size it would run at
    oldest_seq: int           # admission order of its oldest queued request
    earliest_deadline: float  # the soonest a queued request must be dispatched by (inf: none)


@dataclass(frozen=True, slots=True)
class CostSnapshot:
    """The learned execution time of one (model, compiled batch size)."""

    model: str
    size: int
    seconds: float
    samples: int


class _Ema:
    """A time-decayed mean: a sample's weight halves every ``halflife`` seconds."""

    __slots__ = ("total", "weight", "at", "samples")

    def __init__(self) -> None:
        self.total = 0.0
        self.weight = 0.0
        self.at = 0.0
        self.samples = 0

    def add(self, value: float, now: float, halflife: float) -> None:
        if self.samples:
            decay = math.exp2(-max(0.0, now - self.at) / halflife)
            self.total *= decay
            self.weight *= decay
        self.total += value
        self.weight += 1.0
        self.at = now
        self.samples += 1

    @property
    def mean(self) -> float:
        return self.total / self.weight


class CostModel:
    """Each (model, compiled batch size)'s execution seconds, an exponential moving average.

    A sample's influence halves every ``halflife`` seconds of the clock the caller passes, so a
    model whose cost changes (its weights were evicted, the device got busier) is re-learned in
    a few half-lives and the very first sample is used as is.

    :meth:`estimate` answers None for a size never measured and with no measured size to reason
    from; :meth:`charge` never does: it falls back on a conservative figure (the dearest
    dispatch measured on this device, or :data:`DEFAULT_UNMEASURED_SECONDS`).
    """

    def __init__(self, halflife: float, unmeasured_seconds: float = DEFAULT_UNMEASURED_SECONDS) -> None:
        if halflife <= 0:
            raise ValueError(f"halflife must be > 0 seconds, got {halflife}")
        self.halflife = halflife
        self._unmeasured = unmeasured_seconds
        self._ema: dict[tuple[str, int], _Ema] = {}
        self._sizes: dict[str, list[int]] = {}
        self._dearest = 0.0

    def observe(self, model: str, size: int, seconds: float, now: float) -> None:
        key = (model, size)
        ema = self._ema.get(key)
        if ema is None:
            ema = self._ema[key] = _Ema()
            self._sizes.setdefault(model, []).append(size)
            self._sizes[model].sort()
        ema.add(seconds, now, self.halflife)
        self._dearest = max(self._dearest, seconds)

    def estimate(self, model: str, size: int) -> float | None:
        """Learned seconds of one execution of ``model`` at ``size``; None if nothing is known.

        An unmeasured size borrows from the nearest measured size: a larger one's cost as is
        (an upper bound), else a smaller one's scaled up linearly with the rows.
        """
        ema = self._ema.get((model, size))
        if ema is not None:
            return ema.mean
        sizes = self._sizes.get(model)
        if not sizes:
            return None
        larger = [s for s in sizes if s > size]
        if larger:
            return self._ema[(model, larger[0])].mean
        below = sizes[-1]
        return self._ema[(model, below)].mean * size / below

    def charge(self, model: str, size: int) -> float:
        """What a dispatch of ``model`` at ``size`` costs: the estimate, or a conservative one."""
        known = self.estimate(model, size)
        if known is not None:
            return known
        return max(self._dearest, self._unmeasured)

    def forget(self, model: str) -> None:
        for size in self._sizes.pop(model, ()):
            del self._ema[(model, size)]

    def snapshot(self) -> tuple[CostSnapshot, ...]:
        return tuple(CostSnapshot(m, s, e.mean, e.samples) for (m, s), e in sorted(self._ema.items()))


class Policy(Protocol):
    def pick(self, candidates: Mapping[str, Candidate], now: float) -> str:
        """The model to dispatch next; ``candidates`` holds every backlogged model (never empty).

        The policy may account for the dispatch it chose (the scheduler always makes it)."""
        ...


class FifoPolicy:
    """``fifo``: the model of the oldest queued request goes next."""

    def pick(self, candidates: Mapping[str, Candidate], now: float) -> str:
        return min(candidates.values(), key=lambda c: c.oldest_seq).model


class EdfPolicy:
    """``edf``: the model whose most urgent queued request has the earliest deadline goes next.

    Requests without a deadline of their own are due at their dispatch timeout, so they are
    ordered among the others rather than starved. Ties go to the oldest request.
    """

    def pick(self, candidates: Mapping[str, Candidate], now: float) -> str:
        return min(candidates.values(), key=lambda c: (c.earliest_deadline, c.oldest_seq)).model


class DeficitRoundRobin:
    """``fair``: deficit round robin over the backlogged models, by weight and learned cost.

    Every backlogged model earns credit (seconds of device time) at a rate proportional to its
    weight; a dispatch costs the model :meth:`CostModel.charge` for its compiled batch size.
    The next model is the one whose credit first covers its next dispatch; rather than turning
    the wheel in quantum-sized steps until one can pay, the credit all models would earn by
    then is handed out at once, which is the same order without the loop. A model that has
    nothing queued drops out and keeps no credit, so idling never banks device time.
    Over any interval in which a set of models stays backlogged, each one's device time
    approaches its weight's share of the total, within one dispatch.
    """

    def __init__(self, costs: CostModel, weight: Callable[[str], float]) -> None:
        self._costs = costs
        self._weight = weight
        self._credit: dict[str, float] = {}
        self._turn = 0
        self._last_turn: dict[str, int] = {}

    def pick(self, candidates: Mapping[str, Candidate], now: float) -> str:
        credit = self._credit
        for name in [n for n in credit if n not in candidates]:
            del credit[name]           # idle: no banked credit
        best_name, best_key, best_cost = "", None, 0.0
        for name, c in candidates.items():
            cost = self._costs.charge(name, c.size)
            weight = self._weight(name)
            wait = (cost - credit.setdefault(name, 0.0)) / weight
            key = (wait, self._last_turn.get(name, -1))   # ties: longest since its last turn
            if best_key is None or key < best_key:
                best_name, best_key, best_cost = name, key, cost
        wait = best_key[0]
        if wait > 0:
            for name in candidates:
                credit[name] += wait * self._weight(name)
        credit[best_name] -= best_cost
        self._turn += 1
        self._last_turn[best_name] = self._turn
        return best_name


def make_policy(discipline: str, costs: CostModel, weight: Callable[[str], float]) -> Policy:
    match discipline:
        case "fair":
            return DeficitRoundRobin(costs, weight)
        case "fifo":
            return FifoPolicy()
        case "edf":
            return EdfPolicy()
    raise ValueError(f"unknown scheduler.discipline {discipline!r}; expected fair, fifo or edf")
