"""Exceptions to gRPC statuses: the one place a failure becomes the status and message a call
ends with.

Every path that ends a call with an exception asks :func:`status_of`: the :func:`rpc` wrapper of
the services' handlers, and the transport (:mod:`xlaserve.frontend.grpc_server`) for a task-free
call completed with an exception, a task-free entry that raised, and a handler task that raised.
The statuses themselves are declared where the failures are: each :class:`~xlaserve.errors.XlaserveError`
class names its own (``ModelNotFound``→NOT_FOUND, ``QueueFull``→RESOURCE_EXHAUSTED, ...), and a
meta model's ``SubCallError`` carries its sub-call's; the worker's side stays free of the
transport.
"""
from __future__ import annotations

import functools
import logging

from grpclib.const import Status
from grpclib.exceptions import GRPCError

from xlaserve.errors import internal_message

log = logging.getLogger("xlaserve.frontend")


def status_of(exc: BaseException, where: str = "") -> tuple[Status, str]:
    """The status and message that end a call failed by ``exc``.

    - A :class:`~grpclib.exceptions.GRPCError` (the transport's own refusals, a handler that
      names a status itself): its status and message.
    - An exception whose ``status`` is a :class:`~grpclib.const.Status` (every
      :class:`~xlaserve.errors.XlaserveError`): that status, and ``str(exc)``, which says what was
      wrong and what was expected.
    - Anything else is a bug: it is logged here, with its traceback, and answered INTERNAL with
      :func:`~xlaserve.errors.internal_message` (``where`` names the handler, if known). Ask once
      per failure, so that a bug is logged once.
    """
    if isinstance(exc, GRPCError):
        return exc.status, exc.message or ""
    status = getattr(exc, "status", None)
    if isinstance(status, Status):
        return status, str(exc)
    log.error("%s failed", where or "a gRPC call", exc_info=exc)
    return Status.INTERNAL, internal_message(exc, where)


def rpc(method):
    """Wrap a grpclib-shaped handler so that whatever it raises leaves as a
    :class:`~grpclib.exceptions.GRPCError` with the status :func:`status_of` gives (a bug is
    logged once and answered INTERNAL)."""
    @functools.wraps(method)
    async def wrapper(self, stream):
        try:
            await method(self, stream)
        except GRPCError:
            raise
        except Exception as exc:
            raise GRPCError(*status_of(exc, method.__name__)) from None
    return wrapper
