"""xlaserve's expected failures and the one mapping from each to a gRPC status.

Anything that is not an :class:`XlaserveError` reaching the frontend is a bug: it is logged
once with its traceback and answered INTERNAL.
"""
from __future__ import annotations

from grpclib.const import Status


class XlaserveError(Exception):
    """Base of every expected failure. ``str(error)`` is the message the client sees."""

    status: Status = Status.INTERNAL


class InvalidArgument(XlaserveError):
    """A request is malformed: wrong dtype, shape, byte size, unknown input..."""

    status = Status.INVALID_ARGUMENT


class ModelNotFound(XlaserveError):
    """No model of that name. The message opens with Triton's own wording ("Request for unknown
    model: 'NAME' is not found", which Triton's example clients look for), then says why in
    xlaserve's terms and which models there are."""

    status = Status.NOT_FOUND

    def __init__(self, model: str, known: list[str] | None = None) -> None:
        hint = f" (known models: {', '.join(sorted(known))})" if known else ""
        super().__init__(f"Request for unknown model: '{model}' is not found; model '{model}' is not in the "
                         f"repository{hint}")
        self.model = model


class NotFound(XlaserveError):
    """Something other than a model is unknown (a shared-memory region, a version)."""

    status = Status.NOT_FOUND


class ModelNotReady(XlaserveError):
    status = Status.UNAVAILABLE


class Unavailable(XlaserveError):
    status = Status.UNAVAILABLE


class QueueFull(XlaserveError):
    status = Status.RESOURCE_EXHAUSTED


class ResourceExhausted(XlaserveError):
    status = Status.RESOURCE_EXHAUSTED


class DeadlineExceeded(XlaserveError):
    status = Status.DEADLINE_EXCEEDED


class Cancelled(XlaserveError):
    """The caller went away (it reset the stream, or its connection closed) before the request ran."""

    status = Status.CANCELLED


class Unimplemented(XlaserveError):
    status = Status.UNIMPLEMENTED


class FailedPrecondition(XlaserveError):
    status = Status.FAILED_PRECONDITION


class PermissionDenied(XlaserveError):
    """The caller may not do this (a restricted API group, client shared memory from a peer
    outside ``endpoints.client_shm_peers``)."""

    status = Status.PERMISSION_DENIED


class InternalError(XlaserveError):
    """An expected internal failure whose message is safe to show (a hook raised, say)."""

    status = Status.INTERNAL


QUOTE_CHARS = 200
"""How much of an exception's text (or a value's repr) a status message quotes."""


def cut_text(text: str, limit: int = QUOTE_CHARS) -> str:
    """``text``, cut to ``limit`` characters with a note of how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def describe_exception(exc: BaseException) -> str:
    """``str(exc)``, safe for a status message: cut to a few hundred characters, and a
    placeholder when its ``__str__`` raises (user code, or a bug, made it), whatever it raises:
    a ``__str__`` that raises ``SystemExit`` must not carry it out of the guard that is
    describing the failure (it stopped the worker)."""
    try:
        text = str(exc)
    except BaseException:
        return f"<{type(exc).__name__} whose str() raised>"
    return cut_text(text)


def internal_message(exc: BaseException, where: str = "") -> str:
    """What an INTERNAL answer to an unexpected exception (a bug, logged with its traceback
    where it is caught) says: where, if known, and the exception's type and text (cut, and never
    raising, whatever the exception's ``__str__`` does)."""
    return f"internal error{' in ' + where if where else ''}: {type(exc).__name__}: {describe_exception(exc)}"


class BundleError(Exception):
    """A bundle cannot be loaded. The message names the bundle, the part, expected and found."""

    def __init__(self, bundle: str, message: str) -> None:
        super().__init__(f"bundle '{bundle}': {message}")
        self.bundle = bundle


class StartupError(Exception):
    """The worker cannot start as configured (the message says why and what to change). The
    command line prints it without a traceback and exits non-zero."""


def find_startup_error(exc: BaseException) -> StartupError | None:
    """The :class:`StartupError` inside ``exc`` (through exception groups and causes), if any."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, StartupError):
            return e
        if isinstance(e, BaseExceptionGroup):
            stack.extend(e.exceptions)
        stack.extend((e.__cause__, e.__context__))
    return None
