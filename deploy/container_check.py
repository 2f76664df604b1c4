"""The client side of deploy/test-container.sh: talks to the container from the host with the
real Triton client and checks what comes back against examples/reference.py.

    python deploy/container_check.py ready   HTTP_ADDR [--timeout S]
    python deploy/container_check.py query   GRPC_ADDR
    python deploy/container_check.py drain   GRPC_ADDR HTTP_ADDR -- STOP_COMMAND...

``ready`` waits (bounded) for ``/readyz`` to answer 200. ``query`` runs ``simple``, ``mlp`` and
``cnn`` once each and compares the outputs with the NumPy references. ``drain`` sends one ``mlp``
request that the server holds in its queue (the test's node file gives ``mlp`` a
``batch_delay_seconds`` hold), waits until ``/metrics`` shows it queued, runs STOP_COMMAND (which
sends SIGTERM to the container) and checks that the held request is still answered, correctly,
after the signal. Exit status 0 when every check passes; otherwise 1 and a line saying which
failed. Needs the ``bench`` extra (tritonclient[grpc]).
"""
from __future__ import annotations

import argparse
import queue
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from examples import reference  # noqa: E402  (the repository's references, not an installed module)

# How often the bounded waits look again. They wait on another process (a container starting, a
# request arriving in a queue) that offers nothing to block on but its HTTP port.
_POLL_SECONDS = 0.25


class CheckFailed(Exception):
    """One check did not hold; the message says which and what was seen."""


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_ready(http: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            status, body = _get(f"http://{http}/readyz")
        except OSError as exc:
            last = str(exc)
        else:
            if status == 200:
                print(f"ready: /readyz 200 {body.strip()}")
                return
            last = f"{status} {body.strip()}"
        time.sleep(_POLL_SECONDS)
    raise CheckFailed(f"/readyz on {http} not 200 within {timeout:.0f} s (last: {last})")


def _infer(client, model: str, inputs: dict[str, tuple[np.ndarray, str]]) -> dict[str, np.ndarray]:
    tensors = []
    for name, (array, datatype) in inputs.items():
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    result = client.infer(model, tensors)
    outputs = result.get_response().outputs
    return {out.name: result.as_numpy(out.name) for out in outputs}


def _expect(model: str, got: np.ndarray, want: np.ndarray, *, atol: float = 0.0) -> None:
    if got.shape != want.shape or not np.allclose(got, want, atol=atol, rtol=1e-5):
        raise CheckFailed(f"{model}: output differs from examples/reference.py "
                          f"(shape {got.shape} vs {want.shape}, max |diff| "
                          f"{np.max(np.abs(got.astype(np.float64) - want)) if got.shape == want.shape else '-'})")


def query(grpc: str) -> None:
    client = grpcclient.InferenceServerClient(grpc)
    rng = np.random.default_rng(18)
    a = rng.integers(-1000, 1000, (4, 16), dtype=np.int32)
    b = rng.integers(-1000, 1000, (4, 16), dtype=np.int32)
    out = _infer(client, "simple", {"INPUT0": (a, "INT32"), "INPUT1": (b, "INT32")})
    want_sum, want_diff = reference.simple_ref(a, b)
    _expect("simple", out["OUTPUT0"], want_sum)
    _expect("simple", out["OUTPUT1"], want_diff)
    print("query: simple [4, 16] int32: OUTPUT0, OUTPUT1 match the reference")

    x = rng.standard_normal((32, reference.MLP_HIDDEN)).astype(np.float32)
    out = _infer(client, "mlp", {"input": (x, "FP32")})
    _expect("mlp", out["output"], reference.mlp_ref(x), atol=1e-5)
    print("query: mlp [32, 512] float32: output matches the reference")

    images = rng.integers(0, 256, (4, *reference.CNN_IMAGE), dtype=np.uint8)
    out = _infer(client, "cnn", {"input": (images, "UINT8")})
    logits, labels = reference.cnn_ref(images)
    _expect("cnn", out["logits"], logits, atol=1e-4)
    _expect("cnn", out["label"], labels)
    print("query: cnn [4, 32, 32, 3] uint8: logits, label match the reference")


def _queue_depth(http: str, model: str) -> float:
    _, text = _get(f"http://{http}/metrics")
    match = re.search(rf'^xlaserve_queue_depth\{{model="{re.escape(model)}"\}} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def drain(grpc: str, http: str, stop_command: list[str], timeout: float = 30.0) -> None:
    client = grpcclient.InferenceServerClient(grpc)
    x = np.random.default_rng(19).standard_normal((1, reference.MLP_HIDDEN)).astype(np.float32)
    tensor = grpcclient.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    answers: queue.Queue = queue.Queue()
    sent = time.monotonic()
    client.async_infer("mlp", [tensor], callback=lambda result, error: answers.put((result, error)))
    deadline = sent + timeout
    while _queue_depth(http, "mlp") < 1:
        if time.monotonic() > deadline or not answers.empty():
            raise CheckFailed("the mlp request never showed in xlaserve_queue_depth: the node file's "
                              "batch_delay_seconds hold is missing, so the drain cannot be observed")
        time.sleep(_POLL_SECONDS)
    print(f"drain: one mlp request queued (held by batch_delay_seconds) after {time.monotonic() - sent:.2f} s")
    if not answers.empty():
        raise CheckFailed("the mlp request was answered before SIGTERM could be sent: no drain to observe")
    signalled = time.monotonic()
    stopped = subprocess.run(stop_command, stdout=subprocess.DEVNULL)
    if stopped.returncode != 0:
        raise CheckFailed(f"the stop command {' '.join(stop_command)} exited with status {stopped.returncode}")
    print(f"drain: SIGTERM sent ({' '.join(stop_command)})")
    try:
        result, error = answers.get(timeout=timeout)
    except queue.Empty:
        raise CheckFailed(f"the held mlp request got no answer within {timeout:.0f} s of SIGTERM") from None
    if error is not None:
        raise CheckFailed(f"the held mlp request failed after SIGTERM: {error}")
    _expect("mlp", result.as_numpy("output"), reference.mlp_ref(x), atol=1e-5)
    print(f"drain: the held request was answered {time.monotonic() - signalled:.2f} s after SIGTERM, "
          "matching the reference")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ready")
    p.add_argument("http")
    p.add_argument("--timeout", type=float, default=300.0)
    p = sub.add_parser("query")
    p.add_argument("grpc")
    p = sub.add_parser("drain")
    p.add_argument("grpc")
    p.add_argument("http")
    p.add_argument("stop_command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        if args.command == "ready":
            wait_ready(args.http, args.timeout)
        elif args.command == "query":
            query(args.grpc)
        else:
            command = args.stop_command[1:] if args.stop_command[:1] == ["--"] else args.stop_command
            if not command:
                parser.error("drain needs the command that sends SIGTERM, after --")
            drain(args.grpc, args.http, command)
    except CheckFailed as exc:
        print(f"container_check: FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
