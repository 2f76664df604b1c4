"""Each xlaserve error maps to one gRPC status, and the frontend turns bugs into INTERNAL."""
from __future__ import annotations

import asyncio

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from xlaserve import errors
from xlaserve.frontend.kserve import rpc


@pytest.mark.parametrize("error, status", [
    (errors.ModelNotFound("m"), Status.NOT_FOUND),
    (errors.NotFound("region"), Status.NOT_FOUND),
    (errors.ModelNotReady("m"), Status.UNAVAILABLE),
    (errors.QueueFull("q"), Status.RESOURCE_EXHAUSTED),
    (errors.InvalidArgument("x"), Status.INVALID_ARGUMENT),
    (errors.DeadlineExceeded("late"), Status.DEADLINE_EXCEEDED),
    (errors.Unimplemented("no"), Status.UNIMPLEMENTED),
    (errors.FailedPrecondition("static"), Status.FAILED_PRECONDITION),
])
def test_status_of_each_error(error, status):
    assert error.status is status


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


def test_rpc_wrapper_maps_expected_errors_and_bugs(caplog):
    with pytest.raises(GRPCError) as info:
        asyncio.run(_Service().Expected(None))
    assert info.value.status is Status.RESOURCE_EXHAUSTED
    assert info.value.message == "model 'mlp' has 3 requests queued"
    with pytest.raises(GRPCError) as info:
        asyncio.run(_Service().Bug(None))
    assert info.value.status is Status.INTERNAL
    assert "KeyError" in info.value.message
    assert any("Bug failed" in r.message for r in caplog.records)  # logged once, with traceback
