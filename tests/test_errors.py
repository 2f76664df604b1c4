"""Each xlaserve error maps to one gRPC status through the one mapping,
:func:`xlaserve.frontend.statuses.status_of`, and the frontend turns bugs into INTERNAL."""
from __future__ import annotations

import asyncio
import logging

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from xlaserve import errors
from xlaserve.frontend.statuses import rpc, status_of
from xlaserve.worker.inference import SubCallError

EXPECTED = [
    (errors.InvalidArgument("input 'x': expected FP32, found INT8"), Status.INVALID_ARGUMENT),
    (errors.ModelNotFound("m"), Status.NOT_FOUND),
    (errors.NotFound("region 'r' is not registered"), Status.NOT_FOUND),
    (errors.ModelNotReady("model 'm' is LOADING"), Status.UNAVAILABLE),
    (errors.Unavailable("the model lifecycle actor is busy"), Status.UNAVAILABLE),
    (errors.QueueFull("model 'm' has 3 requests queued"), Status.RESOURCE_EXHAUSTED),
    (errors.ResourceExhausted("held bytes over the limit"), Status.RESOURCE_EXHAUSTED),
    (errors.DeadlineExceeded("late"), Status.DEADLINE_EXCEEDED),
    (errors.Cancelled("the client reset the stream"), Status.CANCELLED),
    (errors.Unimplemented("TraceSetting is not supported"), Status.UNIMPLEMENTED),
    (errors.FailedPrecondition("model_control_mode is static"), Status.FAILED_PRECONDITION),
    (errors.PermissionDenied("client shared memory from peer 10.0.0.7"), Status.PERMISSION_DENIED),
    (errors.InternalError("a hook raised"), Status.INTERNAL),
]


@pytest.mark.parametrize("error, status", EXPECTED, ids=lambda v: type(v).__name__ if isinstance(v, Exception) else "")
def test_status_of_each_error(error, status, caplog):
    assert status_of(error) == (status, str(error))
    assert not caplog.records          # an expected failure is not logged as a bug


def test_every_error_class_is_mapped():
    """A new XlaserveError class without a case above fails here: its status is a decision."""
    classes = {c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.XlaserveError)}
    assert classes - {errors.XlaserveError} == {type(error) for error, _ in EXPECTED}


def test_sub_call_error_keeps_the_sub_calls_status():
    cause = errors.DeadlineExceeded("model 'mlp': the deadline passed while queued")
    error = SubCallError(f"model 'meta': run: ctx.infer('mlp'): {cause}", cause)
    assert status_of(error) == (Status.DEADLINE_EXCEEDED, f"model 'meta': run: ctx.infer('mlp'): {cause}")


def test_grpc_error_keeps_its_status_and_message():
    assert status_of(GRPCError(Status.OUT_OF_RANGE, "out of range")) == (Status.OUT_OF_RANGE, "out of range")
    assert status_of(GRPCError(Status.ABORTED)) == (Status.ABORTED, "")


def test_a_bug_is_internal_and_logged_once_with_its_traceback(caplog):
    try:
        {}["oops"]
    except KeyError as exc:
        bug = exc
    with caplog.at_level(logging.ERROR):
        assert status_of(bug, "ModelConfig") == (Status.INTERNAL, "internal error in ModelConfig: KeyError: 'oops'")
    (record,) = caplog.records
    assert record.getMessage() == "ModelConfig failed" and record.exc_info[1] is bug
    caplog.clear()
    assert status_of(ValueError("bad value")) == (Status.INTERNAL, "internal error: ValueError: bad value")
    assert [r.getMessage() for r in caplog.records] == ["a gRPC call failed"]


def test_a_status_attribute_that_is_not_a_grpc_status_is_a_bug():
    class HttpError(Exception):
        status = 404
    assert status_of(HttpError("not here")) == (Status.INTERNAL, "internal error: HttpError: not here")


def test_model_not_found_lists_known_models():
    assert str(errors.ModelNotFound("mpl", ["mlp", "cnn"])) == \
        "Request for unknown model: 'mpl' is not found; model 'mpl' is not in the repository (known models: cnn, mlp)"


class _Service:
    @rpc
    async def Expected(self, stream):
        raise errors.QueueFull("model 'mlp' has 3 requests queued")

    @rpc
    async def Bug(self, stream):
        raise KeyError("oops")

    @rpc
    async def Named(self, stream):
        raise GRPCError(Status.ABORTED, "named by the handler")


def test_rpc_wrapper_maps_expected_errors_and_bugs(caplog):
    with pytest.raises(GRPCError) as info:
        asyncio.run(_Service().Expected(None))
    assert info.value.status is Status.RESOURCE_EXHAUSTED
    assert info.value.message == "model 'mlp' has 3 requests queued"
    with pytest.raises(GRPCError) as info:
        asyncio.run(_Service().Named(None))
    assert (info.value.status, info.value.message) == (Status.ABORTED, "named by the handler")
    assert not caplog.records
    with pytest.raises(GRPCError) as info:
        asyncio.run(_Service().Bug(None))
    assert info.value.status is Status.INTERNAL
    assert info.value.message == "internal error in Bug: KeyError: 'oops'"
    assert [r.getMessage() for r in caplog.records] == ["Bug failed"]   # logged once, with its traceback
    assert caplog.records[0].exc_info is not None


def test_an_internal_message_is_bounded_and_survives_an_exception_that_cannot_be_printed():
    """A bug's INTERNAL answer quotes at most a few hundred characters of its exception, and an
    exception whose __str__ raises (user code can make one) still gives a message: the status is
    built where a failure is already being handled, so it must not raise itself."""
    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no")

    assert errors.internal_message(Unprintable(), "h") == "internal error in h: Unprintable: <Unprintable whose str() raised>"
    long = errors.internal_message(ValueError("x" * 5000))
    assert long.startswith("internal error: ValueError: " + "x" * 200 + "... (4800 more characters)")
    assert len(long) < 300
