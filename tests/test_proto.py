"""The checked-in protocol code is current and wire-compatible with tritonclient 2.73."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FileDescriptor
from google.protobuf.unknown_fields import UnknownFieldSet
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.testing import ChannelFor
from tritonclient.grpc import _utils as triton_utils
from tritonclient.grpc import model_config_pb2 as triton_model_config_pb2
from tritonclient.grpc import service_pb2 as triton_service_pb2

from xlaserve._proto import (
    grpc_service_pb2,
    model_config_pb2,
    xlaserve_control_grpc,
    xlaserve_control_pb2,
)

REPO = Path(__file__).resolve().parent.parent
GENERATED = REPO / "xlaserve" / "_proto"


def test_generated_code_is_current(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    checked_in = {
        p.name: p.read_bytes() for p in GENERATED.iterdir() if p.is_file() and p.suffix != ".pyc"
    }
    assert sorted(fresh) == sorted(checked_in), "run scripts/gen_proto.py and commit the result"
    stale = [name for name in fresh if fresh[name] != checked_in[name]]
    assert not stale, f"{stale} differ from proto/: run scripts/gen_proto.py and commit the result"


# ---------------------------------------------------------------------------------------------
# Descriptors against tritonclient's


def _messages(file: FileDescriptor) -> dict[str, Descriptor]:
    found: dict[str, Descriptor] = {}

    def walk(message: Descriptor) -> None:
        found[message.full_name] = message
        for nested in message.nested_types:
            walk(nested)

    for message in file.message_types_by_name.values():
        walk(message)
    return found


def _enums(file: FileDescriptor) -> dict[str, EnumDescriptor]:
    found = {e.full_name: e for e in file.enum_types_by_name.values()}
    for message in _messages(file).values():
        found.update({e.full_name: e for e in message.enum_types})
    return found


def _field_signature(field) -> tuple:
    target = field.message_type or field.enum_type
    oneof = field.containing_oneof
    return (
        field.number,
        field.type,
        field.label,
        target.full_name if target else None,
        # proto3 `optional` is a synthetic oneof; the wire does not care, but keep it honest.
        oneof.name if oneof else None,
        field.has_presence,
    )


FILE_PAIRS = [
    pytest.param(grpc_service_pb2.DESCRIPTOR, triton_service_pb2.DESCRIPTOR, id="grpc_service"),
    pytest.param(
        model_config_pb2.DESCRIPTOR, triton_model_config_pb2.DESCRIPTOR, id="model_config"
    ),
]


@pytest.mark.parametrize(("ours", "theirs"), FILE_PAIRS)
def test_fields_match_tritonclient(ours: FileDescriptor, theirs: FileDescriptor) -> None:
    assert ours.package == theirs.package == "inference"
    our_messages, their_messages = _messages(ours), _messages(theirs)
    unknown = sorted(set(our_messages) - set(their_messages))
    assert not unknown, f"messages that tritonclient does not know: {unknown}"
    for name, message in our_messages.items():
        their_fields = their_messages[name].fields_by_name
        for field in message.fields:
            assert field.name in their_fields, f"{field.full_name} is not in tritonclient"
            assert _field_signature(field) == _field_signature(their_fields[field.name]), (
                f"{field.full_name}: ours {_field_signature(field)}, "
                f"tritonclient {_field_signature(their_fields[field.name])}"
            )


@pytest.mark.parametrize(("ours", "theirs"), FILE_PAIRS)
def test_enums_match_tritonclient(ours: FileDescriptor, theirs: FileDescriptor) -> None:
    their_enums = _enums(theirs)
    for name, enum in _enums(ours).items():
        assert name in their_enums, f"enum {name} is not in tritonclient"
        assert {v.name: v.number for v in enum.values} == {
            v.name: v.number for v in their_enums[name].values
        }, name


def test_grpc_service_is_complete() -> None:
    """Every message, field and RPC of tritonclient's grpc_service.proto exists in ours."""
    ours, theirs = grpc_service_pb2.DESCRIPTOR, triton_service_pb2.DESCRIPTOR
    our_messages = _messages(ours)
    for name, message in _messages(theirs).items():
        assert name in our_messages, f"missing message {name}"
        missing = set(message.fields_by_name) - set(our_messages[name].fields_by_name)
        assert not missing, f"{name} lacks {sorted(missing)}"

    def rpcs(file: FileDescriptor) -> dict[str, tuple]:
        service = file.services_by_name["GRPCInferenceService"]
        return {
            m.name: (
                m.input_type.full_name,
                m.output_type.full_name,
                m.client_streaming,
                m.server_streaming,
            )
            for m in service.methods
        }

    assert rpcs(ours) == rpcs(theirs)


def test_model_config_omissions_are_reserved() -> None:
    """Fields of Triton's ModelConfig that our subset leaves out keep their numbers reserved."""
    ours = model_config_pb2.ModelConfig.DESCRIPTOR
    theirs = triton_model_config_pb2.ModelConfig.DESCRIPTOR
    omitted = {f.number for f in theirs.fields} - {f.number for f in ours.fields}
    proto = descriptor_pb2.DescriptorProto()
    ours.CopyToProto(proto)
    reserved = {n for r in proto.reserved_range for n in range(r.start, r.end)}
    assert omitted == reserved


# ---------------------------------------------------------------------------------------------
# Bytes across the two implementations


def _triton_request() -> triton_service_pb2.ModelInferRequest:
    """A request built the way tritonclient's InferenceServerClient.infer builds it."""
    image = triton.InferInput("image", [2, 3], "FP32")
    image.set_data_from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
    label = triton.InferInput("label", [2], "BYTES")
    label.set_data_from_numpy(np.array([b"cat", b"dog"], dtype=np.object_))
    output = triton.InferRequestedOutput("scores", class_count=3)
    return triton_utils._get_inference_request(
        model_name="severity_grader",
        inputs=[image, label],
        model_version="2",
        request_id="req-17",
        outputs=[output],
        sequence_id=42,
        sequence_start=True,
        sequence_end=False,
        priority=3,
        timeout=1_000_000,
        parameters={"custom": "value"},
    )


def test_triton_request_round_trips_through_ours() -> None:
    sent = _triton_request()
    wire = sent.SerializeToString(deterministic=True)

    ours = grpc_service_pb2.ModelInferRequest.FromString(wire)
    assert ours.model_name == "severity_grader"
    assert ours.id == "req-17"
    assert [t.name for t in ours.inputs] == ["image", "label"]
    assert list(ours.inputs[0].shape) == [2, 3]
    assert ours.inputs[1].datatype == "BYTES"
    assert ours.parameters["sequence_id"].int64_param == 42
    assert ours.parameters["priority"].uint64_param == 3
    assert ours.outputs[0].parameters["classification"].int64_param == 3
    image = np.frombuffer(ours.raw_input_contents[0], dtype="<f4").reshape(2, 3)
    np.testing.assert_array_equal(image, np.arange(6, dtype=np.float32).reshape(2, 3))
    assert len(UnknownFieldSet(ours)) == 0

    back = ours.SerializeToString(deterministic=True)
    assert back == wire
    assert triton_service_pb2.ModelInferRequest.FromString(back) == sent


def test_our_response_reads_in_tritonclient() -> None:
    scores = np.array([[0.25, 0.75]], dtype=np.float32)
    response = grpc_service_pb2.ModelInferResponse(
        model_name="severity_grader",
        model_version="2",
        id="req-17",
        outputs=[{"name": "scores", "datatype": "FP32", "shape": [1, 2]}],
        raw_output_contents=[scores.tobytes()],
    )
    theirs = triton_service_pb2.ModelInferResponse.FromString(response.SerializeToString())
    result = triton.InferResult(theirs)
    np.testing.assert_array_equal(result.as_numpy("scores"), scores)
    assert result.get_response().id == "req-17"


def test_model_config_reads_in_tritonclient() -> None:
    config = grpc_service_pb2.ModelConfigResponse(
        config={
            "name": "severity_grader",
            "platform": "xla",
            "max_batch_size": 8,
            "input": [{"name": "image", "data_type": "TYPE_FP32", "dims": [224, 224, 3]}],
            "output": [{"name": "scores", "data_type": "TYPE_FP32", "dims": [5]}],
            "dynamic_batching": {"preferred_batch_size": [1, 8]},
            "instance_group": [{"kind": "KIND_CPU", "count": 1}],
        }
    )
    theirs = triton_service_pb2.ModelConfigResponse.FromString(config.SerializeToString())
    assert theirs.config.input[0].data_type == triton_model_config_pb2.TYPE_FP32
    assert list(theirs.config.dynamic_batching.preferred_batch_size) == [1, 8]
    assert (
        theirs.config.instance_group[0].kind == triton_model_config_pb2.ModelInstanceGroup.KIND_CPU
    )


# ---------------------------------------------------------------------------------------------
# grpclib's generated service code


class _Control(xlaserve_control_grpc.WorkerControlBase):
    """Just enough of a worker to carry messages through grpclib's generated code."""

    STATUS = xlaserve_control_pb2.ModelControlStatusResponse(
        worker="worker-0",
        backend="cpu",
        models=[{"name": "m", "state": "READY", "learned_cost_seconds": {8: 0.004}}],
    )

    async def ModelControlStatus(self, stream) -> None:
        await stream.recv_message()
        await stream.send_message(self.STATUS)

    async def SetModelResidency(self, stream) -> None:
        raise GRPCError(Status.UNIMPLEMENTED)

    async def SetModelPolicy(self, stream) -> None:
        request = await stream.recv_message()
        if not request.HasField("weight"):
            raise GRPCError(Status.INVALID_ARGUMENT, "weight is unset")
        await stream.send_message(xlaserve_control_pb2.SetModelPolicyResponse())

    async def CompactMemory(self, stream) -> None:
        raise GRPCError(Status.UNIMPLEMENTED)

    async def WatchStatus(self, stream) -> None:
        await stream.recv_message()
        for _ in range(2):
            await stream.send_message(self.STATUS)


def test_grpclib_stubs_carry_our_messages() -> None:
    async def exchange():
        async with ChannelFor([_Control()]) as channel:
            stub = xlaserve_control_grpc.WorkerControlStub(channel)
            status = await stub.ModelControlStatus(xlaserve_control_pb2.ModelControlStatusRequest())
            await stub.SetModelPolicy(
                xlaserve_control_pb2.SetModelPolicyRequest(model="m", weight=0)
            )
            with pytest.raises(GRPCError) as unset:
                await stub.SetModelPolicy(xlaserve_control_pb2.SetModelPolicyRequest(model="m"))
            async with stub.WatchStatus.open() as stream:
                await stream.send_message(
                    xlaserve_control_pb2.WatchStatusRequest(interval_seconds=1), end=True
                )
                watched = [message async for message in stream]
            return status, unset.value.status, watched

    status, unset_status, watched = asyncio.run(exchange())
    assert status == _Control.STATUS
    assert status.models[0].learned_cost_seconds[8] == 0.004
    assert unset_status == Status.INVALID_ARGUMENT
    assert watched == [_Control.STATUS, _Control.STATUS]


def test_cache_state_fields_round_trip() -> None:
    """Issue 25 part 5: a model's weight misses and eviction rank, and the worker's policy,
    survive the wire (and a gateway's nesting of worker statuses)."""
    pb = xlaserve_control_pb2
    worker = pb.ModelControlStatusResponse(
        worker="w0", eviction_policy="gdsf",
        models=[pb.ModelControl(name="a", weight_misses=2**40 + 3, eviction_rank=1),
                pb.ModelControl(name="pinned", weight_misses=0, eviction_rank=0)])
    back = pb.ModelControlStatusResponse.FromString(
        pb.ModelControlStatusResponse(workers=[worker]).SerializeToString()).workers[0]
    assert back == worker
    assert back.eviction_policy == "gdsf"
    assert [(m.name, m.weight_misses, m.eviction_rank) for m in back.models] == [
        ("a", 2**40 + 3, 1), ("pinned", 0, 0)]
    fields = pb.ModelControl.DESCRIPTOR.fields_by_name
    assert (fields["weight_misses"].number, fields["eviction_rank"].number) == (28, 29)
    assert pb.ModelControlStatusResponse.DESCRIPTOR.fields_by_name["eviction_policy"].number == 12
