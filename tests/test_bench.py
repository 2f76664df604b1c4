"""``xlaserve bench`` against the real server: rows counted where the metadata puts the batch axis
(or one per request when there is none), a server's error as one line with exit status 2, and a
plain message when the Triton client is not installed. Also: no module of the package imports
the Triton client when it is loaded, so the server runs without the ``bench`` extra."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT, serve

# A meta model that echoes its input: the cheapest way to serve a tensor shaped any way we like.
ECHO = """
from xlaserve import NamedTensor, register_model

def run(tensors, ctx):
    return [NamedTensor("y", {{t.name: t.data for t in tensors}}["x"])]

register_model("{name}", run=run)
"""

ECHO_MANIFEST = """format_version: "2.0"
kind: meta
client_inputs:
  - {{name: x, dtype: f32, shape: {shape}, dims: {dims}}}
client_outputs:
  - {{name: y, dtype: f32, shape: {shape}, dims: {dims}}}
"""

# Refuses every import of tritonclient, as if the bench extra were not installed.
BLOCK_TRITONCLIENT = """
import sys

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name == "tritonclient" or name.startswith("tritonclient."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Blocker())
"""


@pytest.fixture(scope="module")
def echo_server(tmp_path_factory):
    """``unbatched``: x f32 [3, 10], no batch axis. ``batch_last``: x f32 [4, B], the batch axis last."""
    repo = tmp_path_factory.mktemp("bench") / "models"
    for name, shape, dims in (("unbatched", "zy", "{z: 10, y: 3}"), ("batch_last", "nz", "{z: 4}")):
        (repo / name).mkdir(parents=True)
        (repo / name / "manifest.yaml").write_text(ECHO_MANIFEST.format(shape=shape, dims=dims))
        (repo / name / "model.py").write_text(ECHO.format(name=name))
    with serve(tmp_path_factory.mktemp("bench_server"), repo) as server:
        yield server
    assert server.process.returncode == 0, server.log()


def bench(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    """``xlaserve bench ARGS`` in a fresh interpreter, after running ``prelude`` in it."""
    code = prelude + "\nimport sys\nfrom xlaserve.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    return subprocess.run([sys.executable, "-c", code, "bench", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def rows(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stderr
    (row,) = map(json.loads, out.stdout.splitlines())
    assert row["requests"] > 0 and row["errors"] == {}
    return row


QUICK = ("-c", "2", "-d", "0.5", "--warmup", "0.1", "--quiet")


def test_a_model_without_a_batch_axis_counts_one_row_per_request(echo_server):
    row = rows(bench("--url", echo_server.url, "-m", "unbatched", "-b", "5", *QUICK))
    # before: the first dimension (3) was taken for the batch, so rows/s read 3x requests/s
    assert row["throughput_rows_s"] == row["throughput_rps"]


def test_rows_are_read_on_the_batch_axis_where_the_metadata_puts_it(echo_server):
    row = rows(bench("--url", echo_server.url, "-m", "batch_last", "-b", "3", *QUICK))
    assert row["throughput_rows_s"] == pytest.approx(3 * row["throughput_rps"], abs=0.02)


def test_explicit_inputs_take_their_batch_axis_from_the_metadata(echo_server):
    unbatched = rows(bench("--url", echo_server.url, "-m", "unbatched", "-i", "x:FP32:3x10", *QUICK))
    assert unbatched["throughput_rows_s"] == unbatched["throughput_rps"]
    last = rows(bench("--url", echo_server.url, "-m", "batch_last", "-i", "x:FP32:4x2", *QUICK))
    assert last["throughput_rows_s"] == pytest.approx(2 * last["throughput_rps"], abs=0.02)


@pytest.mark.parametrize("args, expected", [
    (("-m", "nope"), "xlaserve bench: NOT_FOUND: Request for unknown model: 'nope' is not found; model "
                     "'nope' is not in the repository (known models: batch_last, unbatched)"),
    (("-m", "unbatched", "-i", "x:FP32:2x10"), "xlaserve bench: INVALID_ARGUMENT: input 'x': expected shape "
                                                "[3,10]"),
])
def test_a_server_error_is_one_line_and_exit_status_2(echo_server, args, expected):
    out = bench("--url", echo_server.url, *args, *QUICK)
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    assert len(out.stderr.splitlines()) == 1 and out.stderr.startswith(expected), out.stderr
    assert "Traceback" not in out.stderr


def test_a_server_that_is_not_there_is_one_line_and_exit_status_2():
    import socket
    with socket.socket() as s:          # a port that nothing listens on while we hold it unbound
        s.bind(("127.0.0.1", 0))
        url = f"127.0.0.1:{s.getsockname()[1]}"
        out = bench("--url", url, "-m", "mlp", *QUICK)
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.splitlines()) == 1 and out.stderr.startswith("xlaserve bench: UNAVAILABLE: "), out.stderr


def test_bench_without_the_triton_client_says_how_to_install_it():
    out = bench("-m", "mlp", prelude=BLOCK_TRITONCLIENT)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        "xlaserve bench: needs the Triton client (No module named 'tritonclient'); "
        "install it with: pip install 'xlaserve[bench]'"]


def test_no_module_of_the_package_imports_the_triton_client():
    """Every module of xlaserve loads with tritonclient blocked: the server needs no ``bench`` extra
    (the CI wheel check also serves a request from an install without it)."""
    code = BLOCK_TRITONCLIENT + textwrap.dedent("""
        import importlib, pkgutil, xlaserve
        names = [m.name for m in pkgutil.walk_packages(xlaserve.__path__, "xlaserve.")
                 if m.name != "xlaserve.__main__"]        # __main__ runs the CLI
        for name in names:
            importlib.import_module(name)
        print(len(names))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 20        # the walk found the package's modules, not an empty path


def test_the_native_client_sends_the_same_requests_and_counts_rows_alike(echo_server):
    """``--client native`` (xlaserve's own HTTP/2 client for the measured requests): answered
    without errors, rows read on the batch axis as with the Triton client."""
    row = rows(bench("--url", echo_server.url, "-m", "batch_last", "-b", "3", "--client", "native", *QUICK))
    assert row["throughput_rows_s"] == pytest.approx(3 * row["throughput_rps"], abs=0.02)


def test_the_native_client_counts_a_servers_errors_by_status(echo_server):
    from xlaserve.bench import loadgen
    spec = loadgen.InputSpec("x", "FP32", (3, 10), None)
    result = loadgen.measure(echo_server.url, [loadgen.ClientPlan(lambda: "nope")] * 2, {"nope": [spec]},
                             client="native", duration=0.3, warmup=0.05)
    (row,) = result.rows()
    assert row["requests"] == 0 and set(row["errors"]) == {"NOT_FOUND"} and row["errors"]["NOT_FOUND"] > 0


def test_the_native_clients_request_is_a_model_infer_request_with_raw_contents_and_the_timeout():
    import numpy as np

    from xlaserve._proto import grpc_service_pb2 as pb
    from xlaserve.bench import loadgen, native
    specs = [loadgen.InputSpec("a", "FP32", (2, 3)), loadgen.InputSpec("b", "INT64", (2,))]
    request = pb.ModelInferRequest.FromString(native.request_message("m", specs, np.random.default_rng(0), 2.5))
    assert request.model_name == "m"
    assert [(t.name, t.datatype, list(t.shape)) for t in request.inputs] == [("a", "FP32", [2, 3]),
                                                                              ("b", "INT64", [2])]
    assert [len(c) for c in request.raw_input_contents] == [24, 16]
    assert request.parameters["timeout"].int64_param == 2500          # microseconds, as Triton's client sends it
    untimed = pb.ModelInferRequest.FromString(native.request_message("m", specs, np.random.default_rng(0)))
    assert "timeout" not in untimed.parameters


def test_the_native_client_reads_an_outcome_as_a_status_name():
    from grpclib.const import Status

    from xlaserve._proto import grpc_service_pb2 as pb
    from xlaserve.bench.native import outcome_status
    from xlaserve.frontend.grpc_protocol import MESSAGE_PREFIX
    from xlaserve.gateway.upstream import Reply, UpstreamError
    good = pb.ModelInferResponse(model_name="m").SerializeToString()
    assert outcome_status(Reply(0, "", MESSAGE_PREFIX.pack(0, len(good)) + good)) is None
    assert outcome_status(Reply(5, "no such model", b"")) == "NOT_FOUND"
    assert outcome_status(Reply(99, "", b"")) == "UNKNOWN"           # a code gRPC does not define
    assert outcome_status(Reply(0, "", b"")) == "INTERNAL"           # OK without a message
    assert outcome_status(Reply(0, "", MESSAGE_PREFIX.pack(0, 3) + b"\xff\xff\xff")) == "INTERNAL"   # not protobuf
    assert outcome_status(UpstreamError(Status.UNAVAILABLE, "gone")) == "UNAVAILABLE"
