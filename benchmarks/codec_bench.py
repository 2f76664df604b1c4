"""How fast can the frontend turn ModelInfer bytes into messages and back?

    python -m benchmarks.codec_bench [--repeat 7]

Compares the codecs we could put behind grpclib:

- ``upb``: protobuf's upb-backed classes generated into ``xlaserve._proto`` (what we ship);
- ``betterproto2``: pure-Python dataclasses, generated from the same protos into a temporary
  directory with betterproto2_compiler's protoc plugin when the benchmark starts;
- ``betterproto2+rust``: the same classes, encoded and decoded by betterproto2-rust-codec.

A codec that is not installed, or fails, is skipped with the reason printed.

Each operation is what the frontend does per request, so that lazy and eager codecs pay the same
work: *decode* parses the bytes and reads every field the server uses (model name, id, each
tensor's name, datatype and shape, each raw payload); *encode* builds the message from plain
Python values and serializes it. Reported times are the median over ``--repeat`` runs, in
microseconds per operation.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import timeit
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from xlaserve._proto import grpc_service_pb2

PROTO_DIR = Path(__file__).resolve().parents[2] / "proto"
BETTERPROTO_PACKAGE = "_xlaserve_bench_betterproto2"


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    payload: bytes


@dataclass(frozen=True, slots=True)
class Case:
    """One ModelInfer exchange: the request's inputs and the response's outputs."""

    name: str
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]


def _int32(name: str) -> Tensor:
    return Tensor(name, "INT32", (1, 16), bytes(range(64)))


CASES = (
    Case("small", inputs=(_int32("input_a"), _int32("input_b")), outputs=(_int32("output"),)),
    Case(
        "large",
        # One 224x224 RGB image as UINT8: 150,528 bytes.
        inputs=(Tensor("image", "UINT8", (1, 224, 224, 3), bytes(224 * 224 * 3)),),
        outputs=(Tensor("mask", "UINT8", (1, 224, 224, 3), bytes(224 * 224 * 3)),),
    ),
)


@dataclass(frozen=True, slots=True)
class Codec:
    """How one implementation builds, serializes and parses the two messages."""

    name: str
    build_request: Callable[[Case], object]
    build_response: Callable[[Case], object]
    encode: Callable[[object], bytes]
    decode_request: Callable[[bytes], object]
    decode_response: Callable[[bytes], object]


def _read_request(message) -> tuple:
    """Read what the frontend reads from a request."""
    return (
        message.model_name,
        message.id,
        [(t.name, t.datatype, list(t.shape)) for t in message.inputs],
        [len(payload) for payload in message.raw_input_contents],
    )


def _read_response(message) -> tuple:
    return (
        message.model_name,
        message.id,
        [(t.name, t.datatype, list(t.shape)) for t in message.outputs],
        [len(payload) for payload in message.raw_output_contents],
    )


def _builders(request_cls, response_cls, input_cls, output_cls) -> tuple[Callable[[Case], object], ...]:
    """(build_request, build_response) for one implementation's message classes."""
    def build_request(case: Case):
        return request_cls(model_name="bench", id="1",
                           inputs=[input_cls(name=t.name, datatype=t.datatype, shape=list(t.shape))
                                   for t in case.inputs],
                           raw_input_contents=[t.payload for t in case.inputs])

    def build_response(case: Case):
        return response_cls(model_name="bench", id="1",
                            outputs=[output_cls(name=t.name, datatype=t.datatype, shape=list(t.shape))
                                     for t in case.outputs],
                            raw_output_contents=[t.payload for t in case.outputs])
    return build_request, build_response


def _decoder(cls, read, parse) -> Callable[[bytes], object]:
    """Parse with ``parse(cls, data)``, then read what the frontend reads."""
    def decode(data: bytes):
        message = parse(cls, data)
        read(message)
        return message
    return decode


def upb_codec() -> Codec:
    request_cls = grpc_service_pb2.ModelInferRequest
    response_cls = grpc_service_pb2.ModelInferResponse

    def parse(cls, data: bytes):
        return cls.FromString(data)

    return Codec(
        "upb",
        *_builders(request_cls, response_cls, request_cls.InferInputTensor, response_cls.InferOutputTensor),
        lambda message: message.SerializeToString(),
        _decoder(request_cls, _read_request, parse),
        _decoder(response_cls, _read_response, parse),
    )


def _generate_betterproto(into: Path):
    """Generate betterproto2 classes for proto/ into `into`; return the `inference` module."""
    bin_dir = Path(sys.executable).parent
    plugin = bin_dir / "protoc-gen-python_betterproto2"
    if not plugin.exists():
        raise RuntimeError(f"betterproto2_compiler's plugin is not installed ({plugin} missing)")
    out = into / BETTERPROTO_PACKAGE
    out.mkdir()
    # The plugin formats its output with ruff, which it finds on PATH.
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"--proto_path={PROTO_DIR}",
            f"--plugin=protoc-gen-python_betterproto2={plugin}",
            f"--python_betterproto2_out={out}",
            "grpc_service.proto",
            "model_config.proto",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"betterproto2 generation failed: {done.stderr.strip()[-500:]}")
    sys.path.insert(0, str(into))
    return importlib.import_module(f"{BETTERPROTO_PACKAGE}.inference")


def betterproto_codecs(inference) -> Iterator[Codec | str]:
    """The betterproto2 codec, then the rust one; a string where one cannot run (the reason)."""
    request_cls = inference.ModelInferRequest
    response_cls = inference.ModelInferResponse
    input_cls = inference.ModelInferRequestInferInputTensor
    output_cls = inference.ModelInferResponseInferOutputTensor

    build_request, build_response = _builders(request_cls, response_cls, input_cls, output_cls)

    def parse_python(cls, data: bytes):
        return cls.parse(data)

    yield Codec(
        "betterproto2",
        build_request,
        build_response,
        bytes,
        _decoder(request_cls, _read_request, parse_python),
        _decoder(response_cls, _read_response, parse_python),
    )

    try:
        import betterproto2_rust_codec as rust
    except ImportError as error:
        yield f"betterproto2+rust: not installed ({error})"
        return

    def parse_rust(cls, data: bytes):
        message = cls()
        rust.deserialize(message, data)
        return message

    try:
        rust.serialize(request_cls(model_name="probe"))
    except Exception as error:  # the codec reports incompatibility as a bare RuntimeError
        yield f"betterproto2+rust: rejects betterproto2 messages ({type(error).__name__}: {error})"
        return
    yield Codec(
        "betterproto2+rust",
        build_request,
        build_response,
        rust.serialize,
        _decoder(request_cls, _read_request, parse_rust),
        _decoder(response_cls, _read_response, parse_rust),
    )


def _check(codec: Codec, reference: Codec) -> None:
    """The codec must produce and accept the same wire bytes as upb, or its timing means nothing."""
    for case in CASES:
        for build, decode, ref_build in (
            (codec.build_request, reference.decode_request, reference.build_request),
            (codec.build_response, reference.decode_response, reference.build_response),
        ):
            ours = codec.encode(build(case))
            assert decode(ours) == ref_build(case), f"{codec.name} encodes {case.name} differently"
        wire = reference.encode(reference.build_request(case))
        assert codec.encode(codec.decode_request(wire)) == wire, f"{codec.name} decode {case.name}"


def _median_us(operation: Callable[[], object], repeat: int) -> float:
    timer = timeit.Timer(operation)
    number, _ = timer.autorange()  # enough calls for about 0.2 s per run
    return statistics.median(timer.repeat(repeat=repeat, number=number)) / number * 1e6


@dataclass(frozen=True, slots=True)
class Row:
    codec: str
    case: str
    message: str
    decode_us: float
    encode_us: float

    @property
    def total_us(self) -> float:
        return self.decode_us + self.encode_us


def _build_and_encode(codec: Codec, build: Callable[[Case], object], case: Case) -> bytes:
    return codec.encode(build(case))


def measure(codec: Codec, repeat: int) -> Iterator[Row]:
    for case in CASES:
        for message, build, decode in (
            ("ModelInferRequest", codec.build_request, codec.decode_request),
            ("ModelInferResponse", codec.build_response, codec.decode_response),
        ):
            wire = codec.encode(build(case))
            yield Row(
                codec.name,
                case.name,
                message,
                decode_us=_median_us(partial(decode, wire), repeat),
                encode_us=_median_us(partial(_build_and_encode, codec, build, case), repeat),
            )


def render(rows: list[Row]) -> str:
    baseline = {(r.case, r.message): r.total_us for r in rows if r.codec == "upb"}
    lines = [
        "| codec | size | message | decode µs | encode µs | decode+encode µs | vs upb |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r.total_us / baseline[(r.case, r.message)]
        lines.append(
            f"| {r.codec} | {r.case} | {r.message} | {r.decode_us:.1f} | {r.encode_us:.1f} "
            f"| {r.total_us:.1f} | {ratio:.2f}x |"
        )
    return "\n".join(lines)


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for dist in ("protobuf", "betterproto2", "betterproto2-rust-codec", "grpclib"):
        try:
            found.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            found.append(f"{dist} (not installed)")
    return ", ".join(found)


def main() -> None:
    parser = argparse.ArgumentParser(description="ModelInfer codec benchmark: upb vs betterproto2")
    parser.add_argument("--repeat", type=int, default=7, help="runs per median (default 7)")
    args = parser.parse_args()

    from google.protobuf.internal import api_implementation

    print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs")
    print(f"{_versions()}; protobuf backend: {api_implementation.Type()}")

    upb = upb_codec()
    codecs: list[Codec] = [upb]
    skipped: list[str] = []
    with tempfile.TemporaryDirectory() as scratch:
        try:
            inference = _generate_betterproto(Path(scratch))
        except (ImportError, RuntimeError) as error:
            skipped.append(f"betterproto2: {error}")
        else:
            for codec in betterproto_codecs(inference):
                if isinstance(codec, str):
                    skipped.append(codec)
                else:
                    _check(codec, upb)
                    codecs.append(codec)
        rows = [row for codec in codecs for row in measure(codec, args.repeat)]
    for reason in skipped:
        print(f"skipped {reason}")
    print()
    print(render(rows))


if __name__ == "__main__":
    main()
