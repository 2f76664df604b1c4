"""What the frontend lets in: the in-flight count cap and the held-bytes budget of inference
requests (``endpoints.max_concurrent_requests``, ``endpoints.max_held_request_bytes``).

Pure bookkeeping, no I/O: the KServe service takes an :class:`Admitted` (:meth:`Admission.admit`)
when a ModelInfer arrives, which counts it in flight, then :meth:`Admitted.hold` once the request
is decoded and its size known; the request's one answer calls :meth:`Admitted.release`, which gives
back all it took exactly once, whatever the outcome and wherever it failed. A
request refused by either limit is answered RESOURCE_EXHAUSTED at once; the others go on.

Why bytes and not a count: under load beyond the device's pace requests wait in the per-model
queues, and what a waiting request costs the host is its tensors. A count cap sheds a closed loop
of small requests the device could easily have served in turn; a byte budget lets them wait and
still stops a flood of large requests from taking the host's memory.
"""
from __future__ import annotations

from xlaserve.errors import ResourceExhausted
from xlaserve.manifest import TensorDecl


class Admitted:
    """One request's share of the admission counts: in flight from :meth:`Admission.admit`, its
    model (:meth:`found`) and its held bytes (:meth:`hold`), all given back by one
    :meth:`release`. The request's answer owns it: every path that answers calls ``release``,
    and a second call gives nothing back twice."""

    __slots__ = ("_admission", "model", "held", "released")

    def __init__(self, admission: "Admission") -> None:
        self._admission = admission
        self.model: str | None = None
        self.held = 0
        self.released = False
        admission.in_flight += 1

    def check(self) -> None:
        """Raise ResourceExhausted when this request took the count past
        ``max_concurrent_requests`` (it stays counted until :meth:`release`)."""
        admission = self._admission
        limit = admission.max_concurrent_requests
        if limit and admission.in_flight > limit:
            raise ResourceExhausted(f"{admission.in_flight - 1} inference requests are in flight, the limit "
                                    f"(endpoints.max_concurrent_requests) is {limit}; retry later")

    def found(self, model: str) -> None:
        """The request is for ``model``: counted there too until :meth:`release`."""
        self._admission.found(model)
        self.model = model

    def hold(self, nbytes: int) -> None:
        """Hold ``nbytes`` until :meth:`release` (ResourceExhausted past the budget: nothing held)."""
        self.held = self._admission.hold(nbytes)

    def release(self) -> bool:
        """Give back everything taken; False (and nothing given back) when already released."""
        if self.released:
            return False
        self.released = True
        admission = self._admission
        admission.leave(self.held)
        if self.model is not None:
            admission.lost(self.model)
        return True


class Admission:
    """Counts the inference requests in flight and the bytes they hold. Trio thread only.

    ``max_concurrent_requests`` 0 is uncapped; ``max_held_request_bytes`` is always a limit.
    """

    __slots__ = ("max_concurrent_requests", "max_held_request_bytes", "in_flight", "held_bytes", "by_model")

    def __init__(self, max_concurrent_requests: int, max_held_request_bytes: int) -> None:
        self.max_concurrent_requests = max_concurrent_requests
        self.max_held_request_bytes = max_held_request_bytes
        self.in_flight = 0       #: requests entered and not yet left
        self.held_bytes = 0      #: bytes held by requests past :meth:`hold`, not yet left
        #: requests in flight per model, of those found (:meth:`found`); a model leaves the
        #: mapping when it has none, so it holds only models with requests in flight
        self.by_model: dict[str, int] = {}

    def found(self, model: str) -> None:
        """The request just entered is for ``model`` (a model the worker knows): count it there
        too, until :meth:`lost` when it is answered."""
        self.by_model[model] = self.by_model.get(model, 0) + 1

    def lost(self, model: str) -> None:
        """A request counted by :meth:`found` for ``model`` is answered."""
        left = self.by_model[model] - 1
        if left:
            self.by_model[model] = left
        else:
            del self.by_model[model]

    def admit(self) -> Admitted:
        """Count one more request in flight and return its share, to be released by its answer
        (:meth:`Admitted.check` then says whether the count cap refuses it)."""
        return Admitted(self)

    def enter(self) -> None:
        """Count one more request in flight, without a share to release (its answer calls
        :meth:`leave`). Past ``max_concurrent_requests`` raise ResourceExhausted; the request is
        counted all the same, so its answer must :meth:`leave` as any other's does (with 0 bytes)."""
        Admitted(self).check()

    def hold(self, nbytes: int) -> int:
        """Hold ``nbytes`` for an entered request and return them (what its :meth:`leave` gives
        back). When they would take the held total past ``max_held_request_bytes`` nothing is
        held and ResourceExhausted says how much and what the limit is."""
        held = self.held_bytes + nbytes
        limit = self.max_held_request_bytes
        if held > limit:
            if nbytes > limit:
                raise ResourceExhausted(
                    f"this request needs {nbytes} bytes (its input tensors and expected outputs), more than the "
                    f"worker may hold for all requests together (endpoints.max_held_request_bytes) of {limit}; "
                    "send fewer rows per request or raise the limit")
            raise ResourceExhausted(
                f"the worker would hold {held} bytes of requests not yet answered with this one ({nbytes} bytes), "
                f"the limit (endpoints.max_held_request_bytes) is {limit}; retry later")
        self.held_bytes = held
        return nbytes

    def leave(self, nbytes: int) -> None:
        """A request is answered: it is no longer in flight and gives back the ``nbytes`` that
        :meth:`hold` returned for it (0 when it was refused or failed before holding)."""
        self.in_flight -= 1
        self.held_bytes -= nbytes


def output_bytes_per_row(outputs: tuple[TensorDecl, ...]) -> tuple[int, int]:
    """What a reply to ``outputs`` will hold: (bytes per batch row of the batched outputs, bytes
    of the unbatched ones). Variable-length BYTES outputs count nothing: their size is known only
    once they exist."""
    per_row = fixed = 0
    for decl in outputs:
        n = decl.dtype.itemsize
        if n is None:
            continue
        for size in decl.row_major_shape(1):
            n *= size
        if decl.batched:
            per_row += n
        else:
            fixed += n
    return per_row, fixed
