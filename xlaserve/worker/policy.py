"""Scheduling disciplines and the learned cost model. Pure: no I/O, no clock of their own.

The scheduler owns one :class:`CostModel` and one policy. When the device frees, it describes
each backlogged model's next dispatch as a :class:`Candidate` and asks the policy which model
goes next; the policy may charge the winner (``fair``) for the dispatch it is about to make.

Times are seconds on the Trio clock (``trio.current_time()``), passed in by the caller, so the
policies run the same under a real clock and under ``trio.testing.MockClock``.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
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
    cold: bool = False        # its weights are not on the device: the dispatch pays a load first
    load_seconds: float = 0.0  # what that load is expected to take (0 when warm)


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
    def pick(self, candidates: Mapping[str, Candidate], now: float,
             among: Collection[str] | None = None) -> str:
        """The model to dispatch next; ``candidates`` holds every backlogged model (never empty).

        ``among`` (None: all of them) are the candidates allowed to win this time; the others
        are still backlogged (under ``fair`` they keep earning credit). The policy may account
        for the dispatch it chose (the scheduler always makes it)."""
        ...


def _eligible(candidates: Mapping[str, Candidate], among: Collection[str] | None):
    return candidates.values() if among is None else (candidates[n] for n in among)


class FifoPolicy:
    """``fifo``: the model of the oldest queued request goes next."""

    def pick(self, candidates: Mapping[str, Candidate], now: float,
             among: Collection[str] | None = None) -> str:
        return min(_eligible(candidates, among), key=lambda c: c.oldest_seq).model


class EdfPolicy:
    """``edf``: the model whose most urgent queued request has the earliest deadline goes next.

    Requests without a deadline of their own are due at their dispatch timeout, so they are
    ordered among the others rather than starved. Ties go to the oldest request.
    """

    def pick(self, candidates: Mapping[str, Candidate], now: float,
             among: Collection[str] | None = None) -> str:
        return min(_eligible(candidates, among), key=lambda c: (c.earliest_deadline, c.oldest_seq)).model


class DeficitRoundRobin:
    """``fair``: deficit round robin over the backlogged models, by weight and learned cost.

    Every backlogged model earns credit (seconds of device time) at a rate proportional to its
    weight; a dispatch costs the model :meth:`CostModel.charge` for its compiled batch size.
    The next model is the one whose credit first covers its next dispatch; rather than turning
    the wheel in quantum-sized steps until one can pay, the credit all models would earn by
    then is handed out at once, which is the same order without the loop. A model that has
    nothing queued drops out and keeps no credit, so idling never banks device time (a debt,
    run up by a dispatch made before its credit covered it, is kept until repaid).
    Over any interval in which a set of models stays backlogged, each one's device time
    approaches its weight's share of the total, within one dispatch.
    """

    def __init__(self, costs: CostModel, weight: Callable[[str], float]) -> None:
        self._costs = costs
        self._weight = weight
        self._credit: dict[str, float] = {}
        self._turn = 0
        self._last_turn: dict[str, int] = {}

    def pick(self, candidates: Mapping[str, Candidate], now: float,
             among: Collection[str] | None = None) -> str:
        """With ``among``, the wheel still turns as far as the unrestricted choice needs (every
        backlogged model earns the same credit whoever runs); the restricted winner pays its
        dispatch from that and may go into debt, which it repays by waiting longer for its
        next turn while it stays backlogged."""
        credit = self._credit
        for name in [n for n in credit if n not in candidates and credit[n] >= 0]:
            del credit[name]           # idle: no banked credit (a debt is kept until repaid)
        allowed = None if among is None else set(among)
        best_name, best_key, best_cost = "", None, 0.0
        turn_wait = math.inf
        for name, c in candidates.items():
            cost = self._costs.charge(name, c.size)
            wait = (cost - credit.setdefault(name, 0.0)) / self._weight(name)
            turn_wait = min(turn_wait, wait)
            if allowed is not None and name not in allowed:
                continue
            key = (wait, self._last_turn.get(name, -1))   # ties: longest since its last turn
            if best_key is None or key < best_key:
                best_name, best_key, best_cost = name, key, cost
        if best_key is None:
            raise ValueError(f"none of {sorted(allowed or ())} is backlogged")
        if turn_wait > 0:
            for name in candidates:
                credit[name] += turn_wait * self._weight(name)
        credit[best_name] -= best_cost
        self._turn += 1
        self._last_turn[best_name] = self._turn
        return best_name


@dataclass(frozen=True, slots=True)
class Decision:
    """What :class:`ColdDeferral` decided for one dispatch."""

    model: str                  # dispatch this model now
    deferred: tuple[str, ...]   # cold models with queued work passed over for a resident one
    forced: bool                # ``model`` is cold and had waited its bound: it went first
    next_cold: str | None       # the cold model likely dispatched next (worth prefetching)


class ColdDeferral:
    """Scheduling that knows the weight cache: amortize a cold model's load over more requests.

    A dispatch of a cold model (:attr:`Candidate.cold`: its weights are not on the device) costs
    a load plus an execution. While a resident model also has queued work, the cold ones wait
    and the discipline (``base``) picks among the resident ones: the cold model's requests keep
    gathering in its queue, so that its one load then serves all of them (up to the largest
    compiled batch), its load can be prefetched behind the resident executions
    (:attr:`Decision.next_cold`), and the load does not evict a resident model that has work
    in favour of one that may have less. The device never idles for this.

    The wait is bounded. Every backlogged model counts the dispatches of other models since it
    was last dispatched (its *passes*). A cold model with at least ``defer_limit`` passes is
    *due*: due models go before anything else, the one with the most passes first (ties: the
    oldest request). So a model that stays cold with queued work is dispatched after at most
    ``defer_limit + C - 1`` dispatches of other models, ``C`` being the number of cold models
    with queued work when it became due (each of those that goes first was due no later).
    A cold model is due at once, whatever its passes, when waiting for one more dispatch (the
    dearest resident candidate's learned cost) plus its load and its own execution could miss
    its most urgent batched request's deadline. ``defer_limit=0`` turns deferral off: the
    discipline alone decides, as before.

    Under ``fair`` a deferred model keeps earning credit and the resident winner pays from
    credit it may not have yet (see :meth:`DeficitRoundRobin.pick`), so device-time shares
    are kept over time; only the order within them changes.
    """

    def __init__(self, base: Policy, costs: CostModel, defer_limit: int) -> None:
        if defer_limit < 0:
            raise ValueError(f"defer_limit must be >= 0, got {defer_limit}")
        self.base = base
        self.defer_limit = defer_limit
        self._costs = costs
        self._passes: dict[str, int] = {}

    def passes(self, model: str) -> int:
        return self._passes.get(model, 0)

    def pick(self, candidates: Mapping[str, Candidate], now: float,
             among: Collection[str] | None = None) -> str:
        return self.decide(candidates, now).model

    def decide(self, candidates: Mapping[str, Candidate], now: float) -> Decision:
        passes = self._passes
        for name in [n for n in passes if n not in candidates]:
            del passes[name]           # no queued work: the count starts again
        cold = [c for c in candidates.values() if c.cold]
        warm = [c.model for c in candidates.values() if not c.cold]
        forced = False
        deferred: tuple[str, ...] = ()
        if not cold or not self.defer_limit:
            model = self.base.pick(candidates, now)
        else:
            step = max((self._costs.charge(n, candidates[n].size) for n in warm), default=0.0)
            due = [c for c in cold if passes.get(c.model, 0) >= self.defer_limit
                   or (warm and not self._may_wait(c, step, now))]
            if due:
                model = max(due, key=lambda c: (passes.get(c.model, 0), -c.oldest_seq)).model
                forced = True
                self.base.pick(candidates, now, among=(model,))    # charged as any dispatch
            elif warm:
                model = self.base.pick(candidates, now, among=warm)
                deferred = tuple(c.model for c in cold)
            else:
                model = self.base.pick(candidates, now)
        for name in candidates:
            if name != model:
                passes[name] = passes.get(name, 0) + 1
        passes.pop(model, None)
        rest = [c for c in cold if c.model != model]
        next_cold = max(rest, key=lambda c: (passes[c.model], -c.oldest_seq)).model if rest else None
        return Decision(model, deferred, forced, next_cold)

    def _may_wait(self, c: Candidate, step: float, now: float) -> bool:
        """Can ``c`` wait one more dispatch of ``step`` seconds and still make its deadline?"""
        if c.earliest_deadline == math.inf:
            return True
        return now + step + c.load_seconds + self._costs.charge(c.model, c.size) < c.earliest_deadline


def make_policy(discipline: str, costs: CostModel, weight: Callable[[str], float]) -> Policy:
    match discipline:
        case "fair":
            return DeficitRoundRobin(costs, weight)
        case "fifo":
            return FifoPolicy()
        case "edf":
            return EdfPolicy()
    raise ValueError(f"unknown scheduler.discipline {discipline!r}; expected fair, fifo or edf")
