"""Fault injection (issue 24): ``python -m benchmarks.fault_suite [--cases 100000] [--seed 1]
[--targets worker,gateway,node,tls] [--round 64] [--threads 12] [--json]``.

Proves the rule of docs/architecture.md (*Faults stay where they happen*) by trying to break it,
against real processes on loopback:

- ``worker``: one ``xlaserve run`` worker;
- ``gateway``: a standalone ``xlaserve gateway`` in front of two ``xlaserve run`` workers;
- ``node``: ``xlaserve run`` of a two-worker node (the supervisor, its two worker processes and the
  embedded gateway);
- ``tls``: one worker serving gRPC over TLS (for the TLS cases).

They serve ``simple`` (Triton's, from ``examples/export_examples.py``) and three models whose user
code misbehaves on demand: ``faulty_pre`` and ``faulty_post`` (``simple`` with a preprocess or a
postprocess hook) and ``faulty_meta`` (a meta model whose ``run`` calls ``simple``). Element 0 of
the input picks what the hook does: one of :data:`MODES` (raise each common exception type, return
each wrong type, sleep past the request's deadline, or behave).

The cases, drawn from a seeded generator (``--seed``; the same seed gives the same cases):

- ``conn``: a gRPC connection reset (``SO_LINGER`` 0), half-closed or closed at a stage of a call:
  before the server accepts it, inside the preface, in SETTINGS, HEADERS, CONTINUATION or DATA,
  and after whole requests, while their replies are being written.
- ``admin``: the same on the admin HTTP port, and garbage, oversized and half-written requests.
- ``tls`` (``tls`` target only): garbage instead of a ClientHello, a handshake cut at a random
  byte, a handshake that offers no ``h2``, a whole handshake then a reset or garbage.
- ``request``: whole, well-framed ModelInfer requests that are wrong: shapes (int64 overflow,
  negative, huge, wrong rank), datatypes, sizes, raw-content counts, BYTES lengths, parameters
  of every kind, unknown models, versions and outputs, shared-memory regions, protobuf garbage.
  Each must get exactly one answer, never INTERNAL.
- ``user``: requests to the faulty models, each mode; each must get exactly one answer: INTERNAL
  naming the model and the hook, DEADLINE_EXCEEDED for a hook that sleeps past the deadline, OK
  when the hook behaves.
- ``good``: well-formed requests whose answers are checked against NumPy.

Cases run ``--round`` at a time over ``--threads`` client threads. After each round, for every
process of the target: it is alive (and no worker was restarted), a well-behaved Triton client on
a new connection is served the right answer, every request sent was answered once (none twice,
none missing), the gauges of requests in flight and bytes held return to 0 (waited for up to
``QUIESCE_SECONDS``, since a reset client's request may still be running), and the log holds no
ERROR record and no traceback but the hooks' own. The run prints a table and exits 1 on any
death, leak, unanswered request or unexpected record.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import select
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._servers import consecutive_free_pair, free_ports  # noqa: E402
from xlaserve._proto import grpc_service_pb2 as pb  # noqa: E402

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
INFER = "/inference.GRPCInferenceService/ModelInfer"
OK, DEADLINE_EXCEEDED, INTERNAL, UNKNOWN = 0, 4, 13, 2
#: how long the gauges may take to return to 0 after a round (a reset client's request may still run)
QUIESCE_SECONDS = 10.0
#: a case's wait for its answers; a hook sleeps past SLEEP_DEADLINE_MS, well inside it
ANSWER_SECONDS = 15.0
SLEEP_DEADLINE_MS = 50
SLEEP_SECONDS = 0.3

#: what a faulty model's hook does, picked by element 0 of its input (the index into this tuple)
MODES = ("ok", "KeyError", "ValueError", "TypeError", "RuntimeError", "ZeroDivisionError", "MemoryError",
         "AttributeError", "IndexError", "AssertionError", "StopIteration", "RecursionError", "OSError",
         "UnicodeDecodeError", "NotImplementedError", "unprintable", "SystemExit", "KeyboardInterrupt",
         "return_none", "return_name_list", "return_dict_of_junk", "return_wrong_dtype", "return_wrong_shape",
         "return_generator", "return_ints", "return_bad_array", "return_string_data", "return_missing",
         "sleep")

HOOK_SOURCE = '''
import time
import numpy as np
from xlaserve import NamedTensor, register_model

class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("this exception cannot be printed")

class BadArray:
    def __array__(self, *args, **kwargs):
        raise RuntimeError("no array here")

MODES = __MODES__

def misbehave(mode, tensors):
    """What the hook returns (or raises) in ``mode``; ``tensors`` is what it should return."""
    if mode == "ok":
        return tensors
    if mode == "unprintable":
        raise Unprintable()
    if mode == "UnicodeDecodeError":
        b"\\xff".decode("utf-8")
    if mode == "RecursionError":
        def deep(n):
            return deep(n + 1)
        deep(0)
    if mode == "sleep":
        time.sleep(__SLEEP__)
        return tensors
    if mode.startswith("return_"):
        what = mode[len("return_"):]
        first = tensors[0]
        return {
            "none": None,
            "name_list": [NamedTensor([first.name], first.data)] + list(tensors[1:]),
            "dict_of_junk": {"x": object()},
            "wrong_dtype": [NamedTensor(t.name, np.asarray(t.data).astype(np.float64)) for t in tensors],
            "wrong_shape": [NamedTensor(t.name, np.zeros((3, 3, 3), np.int32)) for t in tensors],
            "generator": (t for t in tensors),
            "ints": [1, 2, 3],
            "bad_array": [NamedTensor(t.name, BadArray()) for t in tensors],
            "string_data": [NamedTensor(t.name, "not an array") for t in tensors],
            "missing": list(tensors[1:]),
        }[what]
    raise {"KeyError": KeyError, "ValueError": ValueError, "TypeError": TypeError, "RuntimeError": RuntimeError,
           "ZeroDivisionError": ZeroDivisionError, "MemoryError": MemoryError, "AttributeError": AttributeError,
           "IndexError": IndexError, "AssertionError": AssertionError, "StopIteration": StopIteration,
           "OSError": OSError, "NotImplementedError": NotImplementedError, "SystemExit": SystemExit,
           "KeyboardInterrupt": KeyboardInterrupt}[mode]("fault injected: " + mode)

def mode_of(tensors):
    data = {t.name: t.data for t in tensors}
    first = np.asarray(data.get("INPUT0", data.get("OUTPUT0", data.get("x")))).reshape(-1)[0]
    return MODES[int(first) % len(MODES)]
'''

PRE = HOOK_SOURCE + '''
def preprocess(inputs):
    return misbehave(mode_of(inputs), inputs)

register_model("faulty_pre", preprocess=preprocess)
'''

POST = HOOK_SOURCE + '''
def postprocess(outputs):
    return misbehave(mode_of(outputs), outputs)

register_model("faulty_post", postprocess=postprocess)
'''

META = HOOK_SOURCE + '''
def run(tensors, ctx):
    mode = mode_of(tensors)
    if mode == "ok":
        x = {t.name: t.data for t in tensors}["x"]
        out = ctx.infer("simple", [NamedTensor("INPUT0", x), NamedTensor("INPUT1", np.zeros_like(x))])
        return [NamedTensor("y", out["OUTPUT0"])]
    return misbehave(mode, [NamedTensor("y", {t.name: t.data for t in tensors}["x"])])

register_model("faulty_meta", run=run)
'''

META_MANIFEST = """format_version: "2.0"
kind: meta
client_inputs:
  - {name: x, dtype: i32, shape: fn, dims: {f: 16}}
client_outputs:
  - {name: y, dtype: i32, shape: fn, dims: {f: 16}}
"""

FAULTY = ("faulty_pre", "faulty_post", "faulty_meta")
HOOK_OF = {"faulty_pre": "preprocess", "faulty_post": "postprocess", "faulty_meta": "run"}


# ---- the model repository and the processes ------------------------------------------------------
def _hook_source(source: str) -> str:
    return source.replace("__MODES__", repr(MODES)).replace("__SLEEP__", repr(SLEEP_SECONDS))


def build_repo(repo: Path) -> Path:
    """``simple`` and the three faulty models in ``repo`` (made once; reused when present)."""
    from examples.export_examples import export_simple
    if (repo / "faulty_meta" / "model.py").exists():
        return repo
    repo.mkdir(parents=True, exist_ok=True)
    for name, source in (("faulty_pre", PRE), ("faulty_post", POST)):
        bundle = export_simple(repo, (1, 2, 4, 8)).rename(repo / name)
        manifest = (bundle / "manifest.yaml").read_text().replace("name: simple", f"name: {name}")
        (bundle / "manifest.yaml").write_text(manifest)
        (bundle / "model.py").write_text(_hook_source(source))
    export_simple(repo, (1, 2, 4, 8))
    meta = repo / "faulty_meta"
    meta.mkdir()
    (meta / "manifest.yaml").write_text(META_MANIFEST)
    (meta / "model.py").write_text(_hook_source(META))
    return repo


def make_certs(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (the TLS target's)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fault-suite")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@dataclass
class Process:
    """One server process: its log, and where its log was last read."""
    name: str
    proc: subprocess.Popen
    log_path: Path
    read_to: int = 0

    def new_log_lines(self) -> list[str]:
        with open(self.log_path, "rb") as f:
            f.seek(self.read_to)
            data = f.read()
        cut = data.rfind(b"\n") + 1
        self.read_to += cut
        return data[:cut].decode("utf-8", "replace").splitlines()


@dataclass
class Target:
    """What a case talks to: the public gRPC and admin ports, the workers' admin ports (their
    gauges), the processes, and whether gRPC is TLS."""
    name: str
    grpc: int
    admin: int
    worker_admins: list[int]
    gateway_admin: int | None
    processes: list[Process]
    tls: ssl.SSLContext | None = None


def _node_file(path: Path, repo: Path, grpc: int, http: int, **extra) -> Path:
    import yaml
    node = {"model_repo": str(repo), "listen": {"grpc": f"127.0.0.1:{grpc}", "http": f"127.0.0.1:{http}"},
            "logging": {"format": "json"},
            "global": {"runtime": {"backend": BACKEND}, "model_control_mode": "static",
                       "endpoints": extra.pop("endpoints", {})}}
    node.update(extra)
    path.write_text(yaml.safe_dump(node))
    return path


#: the checkout whose xlaserve the targets run (``--source``), and their backend (``--backend``)
SOURCE = ROOT
BACKEND = "cpu"


def _start(name: str, args: list[str], workdir: Path) -> Process:
    log_path = workdir / f"{name}.log"
    log = open(log_path, "wb")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if BACKEND == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.Popen([sys.executable, "-m", "xlaserve", *args], stdout=log, stderr=subprocess.STDOUT,
                            cwd=SOURCE, env=env, start_new_session=True)
    log.close()
    return Process(name, proc, log_path)


def _wait_ready(processes: list[Process], admins: list[int], timeout: float = 300.0) -> None:
    """Wait until every admin port says ready; on failure the processes are killed, then raise."""
    try:
        _poll_ready(processes, admins, timeout)
    except BaseException:
        for p in processes:
            if p.proc.poll() is None:
                os.killpg(p.proc.pid, signal.SIGKILL)
                p.proc.wait()
        raise


def _poll_ready(processes: list[Process], admins: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for port in admins:
        while True:
            for p in processes:
                if p.proc.poll() is not None:
                    raise RuntimeError(f"{p.name} exited with {p.proc.returncode} while starting:\n"
                                       f"{p.log_path.read_text()[-4000:]}")
            try:
                if _http_get(port, "/readyz")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready within {timeout} s: " + ", ".join(str(p.log_path) for p in processes))
            time.sleep(0.2)


def start_target(kind: str, repo: Path, workdir: Path) -> Target:
    workdir.mkdir(parents=True, exist_ok=True)
    if kind in ("worker", "tls"):
        grpc, http = free_ports(2)
        extra = {}
        tls_context = None
        if kind == "tls":
            cert, key = make_certs(workdir)
            extra["endpoints"] = {"tls": {"cert_file": str(cert), "key_file": str(key)}}
            tls_context = ssl.create_default_context(cafile=str(cert))
            tls_context.set_alpn_protocols(["h2"])
        node = _node_file(workdir / "node.yaml", repo, grpc, http, **extra)
        p = _start(kind, ["run", str(node)], workdir)
        _wait_ready([p], [http])
        return Target(kind, grpc, http, [http], None, [p], tls_context)
    if kind == "node":
        grpc, http = free_ports(2)
        base, metrics_base = consecutive_free_pair(), consecutive_free_pair()     # worker i serves on base + i
        node = _node_file(workdir / "node.yaml", repo, grpc, http, base_port=base,
                          metrics_base_port=metrics_base, workers=[{"name": "a"}, {"name": "b"}])
        p = _start("node", ["run", str(node)], workdir)
        _wait_ready([p], [http, metrics_base, metrics_base + 1])
        return Target(kind, grpc, http, [metrics_base, metrics_base + 1], http, [p])
    if kind == "gateway":
        import yaml
        ports = free_ports(6)
        workers = []
        for i in range(2):
            node = _node_file(workdir / f"node{i}.yaml", repo, ports[2 * i], ports[2 * i + 1])
            workers.append(_start(f"worker{i}", ["run", str(node)], workdir))
        gw_grpc, gw_http = ports[4], ports[5]
        gw = workdir / "gateway.yaml"
        gw.write_text(yaml.safe_dump({
            "listen": {"grpc": f"127.0.0.1:{gw_grpc}", "metrics": f"127.0.0.1:{gw_http}"},
            "logging": {"format": "json"},
            "endpoints": [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[2]}"]}))
        gateway = _start("gateway", ["gateway", str(gw)], workdir)
        processes = [*workers, gateway]
        _wait_ready(processes, [ports[1], ports[3], gw_http])
        return Target(kind, gw_grpc, gw_http, [ports[1], ports[3]], gw_http, processes)
    raise ValueError(f"unknown target {kind!r}")


def stop_target(target: Target) -> list[int]:
    """SIGTERM every process (the gateway first), then wait; their exit statuses."""
    for p in reversed(target.processes):
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
    codes = []
    for p in target.processes:
        try:
            codes.append(p.proc.wait(60))
        except subprocess.TimeoutExpired:
            os.killpg(p.proc.pid, signal.SIGKILL)
            codes.append(p.proc.wait())
    return codes


# ---- HTTP/2 and HTTP/1.1 on raw sockets ------------------------------------------------------------
def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((ftype, flags)) + struct.pack(">I", sid) + payload


CLIENT_SETTINGS = frame(SETTINGS, 0, 0, struct.pack(">HI", 2, 0) + struct.pack(">HI", 4, 2**31 - 1)) + \
    frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1 - 65535))


def request_block(path: str = INFER, timeout_ms: int | None = None) -> bytes:
    import hpack
    fields = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "fault-suite"),
              ("content-type", "application/grpc"), ("te", "trailers")]
    if timeout_ms is not None:
        fields.append(("grpc-timeout", f"{timeout_ms}m"))
    return hpack.Encoder().encode(fields)


def grpc_body(message: bytes) -> bytes:
    return b"\0" + struct.pack(">I", len(message)) + message


def request_frames(sid: int, message: bytes, timeout_ms: int | None = None) -> bytes:
    body = grpc_body(message)
    out = frame(HEADERS, END_HEADERS, sid, request_block(timeout_ms=timeout_ms))
    for i in range(0, max(len(body), 1), 16384):
        chunk = body[i:i + 16384]
        out += frame(DATA, END_STREAM if i + 16384 >= len(body) else 0, sid, chunk)
    return out


def reset_close(sock: socket.socket) -> None:
    """Close with RST instead of FIN (SO_LINGER 0), as load balancers' health checks do."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def end_connection(sock: socket.socket, how: str) -> None:
    """``reset``, ``half-close`` (FIN, then read until the server closes, bounded) or ``close``."""
    if how == "reset":
        reset_close(sock)
        return
    if how == "half-close":
        try:
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(2.0)
            until = time.monotonic() + 2.0
            while time.monotonic() < until and sock.recv(65536):
                pass
        except OSError:
            pass
    sock.close()


def connect(port: int, timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


@dataclass
class Answer:
    status: int | None = None       # grpc-status; None: reset (rst) or never answered
    message: str = ""
    data: bytes = b""
    trailers_seen: int = 0          # a second trailer block on one stream is an answer sent twice
    rst: int | None = None


class H2Client:
    """A gRPC client on one connection that knows nothing of the server's engine: it writes frames,
    reads frames and decodes header blocks with python-hyper's hpack."""

    def __init__(self, target: Target) -> None:
        import hpack
        sock = connect(target.grpc)
        if target.tls is not None:
            sock = target.tls.wrap_socket(sock, server_hostname="127.0.0.1")
        self.sock = sock
        self.decoder = hpack.Decoder()
        self.buf = bytearray()
        self.answers: dict[int, Answer] = {}
        self.goaway: tuple[int, str] | None = None
        self.closed = False
        self.next_sid = 1
        self.block: tuple[int, bytearray, int] | None = None
        self.sock.sendall(PREFACE + CLIENT_SETTINGS)

    def send_request(self, message: bytes, timeout_ms: int | None = None) -> int:
        sid = self.next_sid
        self.next_sid += 2
        self.answers[sid] = Answer()
        self.sock.sendall(request_frames(sid, message, timeout_ms))
        return sid

    def done(self, sid: int) -> bool:
        a = self.answers[sid]
        return a.status is not None or a.rst is not None

    def wait(self, sids, seconds: float = ANSWER_SECONDS) -> None:
        until = time.monotonic() + seconds
        while not self.closed and not all(self.done(s) for s in sids):
            left = until - time.monotonic()
            if left <= 0:
                return
            self._read(left)

    def _read(self, seconds: float) -> None:
        if not (isinstance(self.sock, ssl.SSLSocket) and self.sock.pending()):
            ready, _, _ = select.select([self.sock], [], [], min(seconds, 1.0))
            if not ready:
                return
        try:
            chunk = self.sock.recv(1 << 20)
        except (OSError, ssl.SSLError):
            self.closed = True
            return
        if not chunk:
            self.closed = True
            return
        self.buf += chunk
        pos = 0
        buf = self.buf
        while len(buf) - pos >= 9:
            length = int.from_bytes(buf[pos:pos + 3], "big")
            if len(buf) - pos < 9 + length:
                break
            ftype, flags = buf[pos + 3], buf[pos + 4]
            sid = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
            self._frame(ftype, flags, sid, bytes(buf[pos + 9:pos + 9 + length]))
            pos += 9 + length
        del buf[:pos]

    def _frame(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if ftype == SETTINGS and not flags & ACK:
            self.sock.sendall(frame(SETTINGS, ACK, 0))
        elif ftype == PING and not flags & ACK:
            self.sock.sendall(frame(PING, ACK, 0, payload))
        elif ftype == GOAWAY:
            self.goaway = (struct.unpack(">I", payload[4:8])[0], payload[8:].decode("utf-8", "replace"))
        elif ftype == RST_STREAM and sid in self.answers:
            self.answers[sid].rst = struct.unpack(">I", payload)[0]
        elif ftype == DATA and sid in self.answers:
            self.answers[sid].data += payload
        elif ftype == HEADERS:
            start, stop = 0, len(payload)
            if flags & 0x8:
                start, stop = 1, stop - payload[0]
            if flags & 0x20:
                start += 5
            self.block = (sid, bytearray(payload[start:stop]), flags)
            if flags & END_HEADERS:
                self._headers()
        elif ftype == CONTINUATION and self.block is not None:
            self.block[1].extend(payload)
            if flags & END_HEADERS:
                self._headers()

    def _headers(self) -> None:
        sid, block, flags = self.block
        self.block = None
        fields = dict(self.decoder.decode(bytes(block)))
        answer = self.answers.get(sid)
        if answer is None or "grpc-status" not in fields:
            return
        answer.trailers_seen += 1
        answer.status = int(fields["grpc-status"])
        from urllib.parse import unquote
        answer.message = unquote(fields.get("grpc-message", ""))

    def close(self, how: str = "close") -> None:
        end_connection(self.sock, how)


def _http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# ---- the cases ---------------------------------------------------------------------------------------
@dataclass
class Outcome:
    family: str
    name: str
    sent: int = 0                   # requests sent whole, expecting an answer
    answered: int = 0               # of those, answered exactly once
    twice: int = 0                  # answered more than once
    missing: list[str] = field(default_factory=list)    # requests not answered, and why
    problems: list[str] = field(default_factory=list)   # wrong answers, and the case's own failures
    statuses: Counter = field(default_factory=Counter)


def simple_request(model: str, x: np.ndarray, y: np.ndarray | None = None, **fields) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name=model, **fields)
    r.inputs.add(name="INPUT0", datatype="INT32", shape=list(x.shape))
    r.inputs.add(name="INPUT1", datatype="INT32", shape=list(x.shape))
    r.raw_input_contents.extend([x.tobytes(), (y if y is not None else np.zeros_like(x)).tobytes()])
    return r


def _rows(rng: random.Random, first: int | None = None) -> np.ndarray:
    rows = rng.choice((1, 2, 3, 4, 8))
    x = np.array([[rng.randrange(-1000, 1000) for _ in range(16)] for _ in range(rows)], np.int32)
    if first is not None:
        x[0, 0] = first
    return x


def _param(rng: random.Random) -> pb.InferParameter:
    kind = rng.choice(("bool_param", "int64_param", "string_param", "double_param", "uint64_param", None))
    p = pb.InferParameter()
    if kind == "bool_param":
        p.bool_param = rng.random() < 0.5
    elif kind == "int64_param":
        p.int64_param = rng.choice((-1, 0, 1, 2**63 - 1, -2**63, rng.randrange(-10**9, 10**9)))
    elif kind == "string_param":
        p.string_param = rng.choice(("", "x", "\u00e9\u2603", "1" * 4096, "-5", "region"))
    elif kind == "double_param":
        p.double_param = rng.choice((float("nan"), float("inf"), -1.5, 1e308))
    elif kind == "uint64_param":
        p.uint64_param = rng.choice((0, 2**64 - 1, 7))
    return p


def malformed_request(rng: random.Random) -> tuple[str, bytes]:
    """One whole request that is wrong in one (or several) ways: (what is wrong, its bytes)."""
    x = _rows(rng)
    r = simple_request("simple", x, x)
    what = rng.choice(("shape_overflow", "shape_negative", "shape_huge", "shape_rank", "shape_zero",
                       "batch_mismatch", "dtype", "dtype_junk", "raw_short", "raw_long", "raw_count",
                       "contents_count", "contents_and_raw", "bytes_lengths", "param_timeout", "params_any",
                       "tensor_params", "unknown_model", "version", "unknown_output", "output_params",
                       "shm_missing", "duplicate_input", "missing_input", "unknown_input", "garbage",
                       "truncated", "empty", "meta_shape", "classification"))
    if what == "shape_overflow":
        dims = rng.choice(([2**55, 16], [2**62, 16], [2**63 - 1, 16], [2**32, 2**32]))
        for t in r.inputs:
            t.shape[:] = dims
        if rng.random() < 0.5:
            del r.raw_input_contents[:]
    elif what == "shape_negative":
        r.inputs[rng.randrange(2)].shape[:] = rng.choice(([-1, 16], [1, -16], [-2**63, 16]))
    elif what == "shape_huge":
        r.inputs[0].shape[:] = [rng.choice((9, 10**6, 10**12)), 16]
    elif what == "shape_rank":
        r.inputs[0].shape[:] = rng.choice(([], [16], [1, 16, 1], [1] * 40))
    elif what == "shape_zero":
        for t in r.inputs:
            t.shape[:] = [0, 16]
        r.raw_input_contents[:] = [b"", b""]
    elif what == "batch_mismatch":
        r.inputs[1].shape[:] = [len(x) + 1, 16]
    elif what == "dtype":
        r.inputs[0].datatype = rng.choice(("FP32", "INT64", "BYTES", "BOOL", "FP16", "BF16", "UINT8"))
    elif what == "dtype_junk":
        r.inputs[0].datatype = rng.choice(("", "int32", "INT32 ", "\u2603", "X" * 300))
    elif what == "raw_short":
        r.raw_input_contents[0] = r.raw_input_contents[0][:rng.randrange(len(r.raw_input_contents[0]))]
    elif what == "raw_long":
        r.raw_input_contents[1] += b"\0" * rng.randrange(1, 64)
    elif what == "raw_count":
        r.raw_input_contents.append(b"\0" * 64) if rng.random() < 0.5 else r.raw_input_contents.pop()
    elif what == "contents_count":
        del r.raw_input_contents[:]
        for t in r.inputs:
            t.contents.int_contents.extend(range(rng.randrange(0, 40)))
    elif what == "contents_and_raw":
        r.inputs[0].contents.int_contents.extend(x.reshape(-1).tolist())
    elif what == "bytes_lengths":
        r.inputs[0].datatype = "BYTES"
        r.raw_input_contents[0] = struct.pack("<I", rng.choice((2**32 - 1, 5, 10**6))) + b"ab"
    elif what == "param_timeout":
        r.parameters["timeout"].CopyFrom(_param(rng))
    elif what == "params_any":
        for key in rng.sample(("timeout", "priority", "sequence_id", "binary_data_output", "", "x" * 200,
                               "shared_memory_region", "classification"), 3):
            r.parameters[key].CopyFrom(_param(rng))
    elif what == "tensor_params":
        for key in rng.sample(("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset",
                               "binary_data_size", "x"), 2):
            r.inputs[rng.randrange(2)].parameters[key].CopyFrom(_param(rng))
    elif what == "unknown_model":
        r.model_name = rng.choice(("", "nope", "simple/../simple", "\u2603" * 50, "s" * 10000))
    elif what == "version":
        r.model_version = rng.choice(("2", "-1", "latest", "\0", "99999999999999999999"))
    elif what == "unknown_output":
        r.outputs.add(name=rng.choice(("nope", "", "OUTPUT0 ")))
    elif what == "output_params":
        o = r.outputs.add(name="OUTPUT0")
        for key in rng.sample(("shared_memory_region", "shared_memory_byte_size", "binary_data",
                               "classification", "y"), 2):
            o.parameters[key].CopyFrom(_param(rng))
    elif what == "shm_missing":
        r.inputs[0].parameters["shared_memory_region"].string_param = "no_such_region"
        r.inputs[0].parameters["shared_memory_byte_size"].int64_param = x.nbytes
        r.raw_input_contents.pop(0)
    elif what == "duplicate_input":
        r.inputs.add(name="INPUT0", datatype="INT32", shape=list(x.shape))
        r.raw_input_contents.append(x.tobytes())
    elif what == "missing_input":
        r.inputs.pop()
        r.raw_input_contents.pop()
    elif what == "unknown_input":
        r.inputs[1].name = rng.choice(("INPUT2", "", "input1"))
    elif what == "garbage":
        return what, bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
    elif what == "truncated":
        data = r.SerializeToString()
        return what, data[:rng.randrange(1, len(data))]
    elif what == "empty":
        return what, b""
    elif what == "meta_shape":
        m = pb.ModelInferRequest(model_name="faulty_meta")
        m.inputs.add(name="x", datatype="INT32", shape=rng.choice(([2**40, 16], [1, 17], [-1, 16], [])))
        m.raw_input_contents.append(b"\0" * 64)
        return what, m.SerializeToString()
    elif what == "classification":
        r.outputs.add(name="OUTPUT0").parameters["classification"].int64_param = 3
    return what, r.SerializeToString()


def case_request(target: Target, rng: random.Random) -> Outcome:
    """A few malformed requests on one connection: one answer each, never INTERNAL."""
    out = Outcome("request", "")
    client = H2Client(target)
    try:
        sids = {}
        for _ in range(rng.randrange(1, 6)):
            what, message = malformed_request(rng)
            sids[client.send_request(message)] = what
        client.wait(sids)
        out.name = "+".join(sorted(set(sids.values())))
        _account(out, client, sids, lambda sid, a: None if a.status not in (INTERNAL, UNKNOWN) else
                 f"{sids[sid]}: answered {a.status} {a.message[:200]!r}; a malformed request is never INTERNAL")
    finally:
        client.close(rng.choice(("close", "reset", "half-close")))
    return out


def _account(out: Outcome, client: H2Client, sids, judge) -> None:
    for sid in sids:
        a = client.answers[sid]
        out.sent += 1
        if a.status is None:
            why = f"reset {a.rst}" if a.rst is not None else "no answer"
            if client.goaway:
                why += f" (GOAWAY {client.goaway})"
            out.missing.append(f"stream {sid} ({sids[sid]}): {why}")
            continue
        out.answered += 1
        out.statuses[a.status] += 1
        if a.trailers_seen > 1:
            out.twice += 1
            out.missing.append(f"stream {sid} ({sids[sid]}): answered {a.trailers_seen} times")
        problem = judge(sid, a)
        if problem:
            out.problems.append(problem)


def case_user(target: Target, rng: random.Random) -> Outcome:
    """Requests to the faulty models: INTERNAL naming model and hook, DEADLINE_EXCEEDED for a hook
    that sleeps past the deadline, OK when it behaves."""
    out = Outcome("user", "")
    client = H2Client(target)
    try:
        sids = {}
        for _ in range(rng.randrange(1, 4)):
            model = rng.choice(FAULTY)
            mode = rng.randrange(len(MODES))
            if MODES[mode] == "sleep" and rng.random() < 0.7:     # sleeps are slow: fewer of them
                mode = 0
            x = _rows(rng, first=mode)
            if model == "faulty_meta":
                r = pb.ModelInferRequest(model_name=model)
                r.inputs.add(name="x", datatype="INT32", shape=list(x.shape))
                r.raw_input_contents.append(x.tobytes())
                message = r.SerializeToString()
            else:
                message = simple_request(model, x).SerializeToString()
            timeout = SLEEP_DEADLINE_MS if MODES[mode] == "sleep" else None
            sids[client.send_request(message, timeout)] = (model, MODES[mode], x)
        client.wait(sids)
        out.name = ",".join(f"{m}:{k}" for m, k, _ in sids.values())

        def judge(sid, a):
            model, mode, x = sids[sid]
            if mode == "ok":
                if a.status != OK:
                    return f"{model} {mode}: answered {a.status} {a.message[:200]!r}, expected OK"
                return _check_simple_reply(a.data, x, np.zeros_like(x), model)
            if mode == "sleep":
                if a.status != DEADLINE_EXCEEDED:
                    return f"{model} sleep: answered {a.status} {a.message[:200]!r}, expected DEADLINE_EXCEEDED"
                return None
            if a.status != INTERNAL or model not in a.message or HOOK_OF[model] not in a.message:
                return (f"{model} {mode}: answered {a.status} {a.message[:300]!r}, expected INTERNAL naming the "
                        f"model and its {HOOK_OF[model]} hook")
            return None
        _account(out, client, {s: f"{m}:{k}" for s, (m, k, _) in sids.items()}, judge)
    finally:
        client.close(rng.choice(("close", "reset")))
    return out


def _check_simple_reply(data: bytes, x: np.ndarray, y: np.ndarray, model: str) -> str | None:
    if len(data) < 5:
        return f"{model}: an OK answer without a message"
    response = pb.ModelInferResponse.FromString(data[5:])
    names = [o.name for o in response.outputs]
    first = names[0] if names else None
    if model == "faulty_meta":
        got = np.frombuffer(response.raw_output_contents[0], np.int32).reshape(x.shape)
        want = x
    else:
        got = np.frombuffer(response.raw_output_contents[names.index("OUTPUT0")], np.int32).reshape(x.shape)
        want = x + y
    if not np.array_equal(got, want):
        return f"{model}: wrong answer in {first}"
    return None


def case_good(target: Target, rng: random.Random) -> Outcome:
    out = Outcome("good", "simple")
    client = H2Client(target)
    try:
        sids = {}
        for _ in range(rng.randrange(1, 9)):
            x, y = _rows(rng), _rows(rng)
            y = y[:len(x)] if len(y) >= len(x) else np.resize(y, x.shape)
            sids[client.send_request(simple_request("simple", x, y).SerializeToString())] = (x, y)
        client.wait(sids)
        _account(out, client, {s: "simple" for s in sids}, lambda sid, a: (
            f"simple: answered {a.status} {a.message[:200]!r}" if a.status != OK else
            _check_simple_reply(a.data, *sids[sid], "simple")))
    finally:
        client.close()
    return out


STAGES = ("accept", "preface", "settings", "after_settings", "headers", "continuation", "data", "reply")


def case_conn(target: Target, rng: random.Random) -> Outcome:
    """A connection cut at one stage of a call; nothing is owed to it, the server must go on."""
    stage = rng.choice(STAGES)
    how = "reset" if stage == "accept" else rng.choice(("reset", "half-close", "close"))
    out = Outcome("conn", f"{stage}/{how}")
    try:
        sock = connect(target.grpc)
    except OSError as exc:
        out.problems.append(f"connect failed: {exc}")
        return out
    try:
        if target.tls is not None and stage != "accept":
            sock = target.tls.wrap_socket(sock, server_hostname="127.0.0.1")
        message = simple_request("simple", _rows(rng)).SerializeToString()
        block = request_block()
        if stage == "preface":
            sock.sendall(PREFACE[:rng.randrange(1, len(PREFACE))])
        elif stage == "settings":
            sock.sendall(PREFACE + CLIENT_SETTINGS[:rng.randrange(1, 15)])
        elif stage == "after_settings":
            sock.sendall(PREFACE + CLIENT_SETTINGS)
        elif stage == "headers":
            full = frame(HEADERS, END_HEADERS, 1, block)
            sock.sendall(PREFACE + CLIENT_SETTINGS + full[:rng.randrange(1, len(full))])
        elif stage == "continuation":
            cut = rng.randrange(1, len(block))
            cont = frame(CONTINUATION, END_HEADERS, 1, block[cut:])
            sock.sendall(PREFACE + CLIENT_SETTINGS + frame(HEADERS, 0, 1, block[:cut])
                         + cont[:rng.randrange(0, len(cont))])
        elif stage == "data":
            whole = request_frames(1, message)
            head = len(frame(HEADERS, END_HEADERS, 1, block))
            sock.sendall(PREFACE + CLIENT_SETTINGS + whole[:rng.randrange(head, len(whole))])
        elif stage == "reply":
            burst = b"".join(request_frames(2 * i + 1, message) for i in range(rng.randrange(1, 9)))
            sock.sendall(PREFACE + CLIENT_SETTINGS + burst)
            if rng.random() < 0.5:
                time.sleep(rng.random() * 0.005)        # let some replies be on their way
    except (OSError, ssl.SSLError) as exc:
        if stage != "accept":
            out.problems.append(f"the server broke the connection before the fault ({stage}): {exc}")
    finally:
        end_connection(sock, how)
    return out


def case_admin(target: Target, rng: random.Random) -> Outcome:
    kind = rng.choice(("reset_at_once", "partial", "garbage", "huge_header", "valid_then_reset", "valid",
                       "bad_utf8", "no_path", "half_close_empty", "post", "unknown_path"))
    out = Outcome("admin", kind)
    port = rng.choice([target.admin, *target.worker_admins])
    try:
        sock = connect(port)
    except OSError as exc:
        out.problems.append(f"connect to the admin port failed: {exc}")
        return out
    try:
        if kind == "reset_at_once":
            pass
        elif kind == "partial":
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n"[:rng.randrange(1, 30)])
        elif kind == "garbage":
            sock.sendall(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 600))) + b"\r\n\r\n")
        elif kind == "huge_header":
            sock.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n")
        elif kind == "valid_then_reset":
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        elif kind == "bad_utf8":
            sock.sendall(b"GET /\xff\xfe\xc3 HTTP/1.1\r\n\xff: \xfe\r\n\r\n")
        elif kind == "no_path":
            sock.sendall(b"GET\r\n\r\n")
        elif kind == "post":
            sock.sendall(b"POST /healthz HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello")
        elif kind == "unknown_path":
            sock.sendall(b"GET /" + b"x" * rng.randrange(1, 5000) + b" HTTP/1.1\r\n\r\n")
        if kind == "valid":
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.settimeout(5.0)
            reply = b""
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                reply += chunk
            if not reply.startswith(b"HTTP/1.1 200"):
                out.problems.append(f"GET /healthz answered {reply[:80]!r}")
    except OSError:
        pass        # the server may close a garbage connection before all of it is written
    finally:
        end_connection(sock, "reset" if kind in ("reset_at_once", "valid_then_reset") or rng.random() < 0.5
                       else "half-close")
    return out


def _client_hello(target: Target, alpn: list[str] | None) -> bytes:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if alpn:
        context.set_alpn_protocols(alpn)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = context.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


def case_tls(target: Target, rng: random.Random) -> Outcome:
    kind = rng.choice(("garbage", "cut_hello", "no_h2", "handshake_then_reset", "handshake_then_garbage",
                       "plaintext_h2"))
    out = Outcome("tls", kind)
    try:
        sock = connect(target.grpc)
    except OSError as exc:
        out.problems.append(f"connect to the TLS port failed: {exc}")
        return out
    how = rng.choice(("reset", "close", "half-close"))
    try:
        if kind == "garbage":
            sock.sendall(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 2000))))
        elif kind == "cut_hello":
            hello = _client_hello(target, ["h2"])
            sock.sendall(hello[:rng.randrange(1, len(hello))])
        elif kind == "plaintext_h2":
            sock.sendall(PREFACE + CLIENT_SETTINGS)
        else:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            context.set_alpn_protocols(["http/1.1"] if kind == "no_h2" else ["h2"])
            sock = context.wrap_socket(sock, server_hostname="127.0.0.1")
            if kind == "handshake_then_garbage":
                sock.sendall(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 500))))
    except (OSError, ssl.SSLError):
        pass        # the server refused the handshake: what it should do with most of these
    finally:
        end_connection(sock, how)
    return out


FAMILIES = {"conn": case_conn, "admin": case_admin, "request": case_request, "user": case_user,
            "good": case_good, "tls": case_tls}
#: how often each family is drawn (the tls target draws tls cases instead of user cases)
WEIGHTS = {"conn": 30, "admin": 10, "request": 30, "user": 20, "good": 10}


def draw_family(target: Target, rng: random.Random, only: frozenset[str] | None = None) -> str:
    families = dict(WEIGHTS)
    if target.tls is not None:
        families["tls"] = families.pop("user")
    if only:
        families = {k: v for k, v in families.items() if k in only} or {"good": 1}
    names = list(families)
    return rng.choices(names, weights=[families[n] for n in names])[0]


# ---- after each round ---------------------------------------------------------------------------------
_GAUGE = re.compile(r"^(xlaserve_requests_in_flight|xlaserve_held_request_bytes|xlaserve_gateway_in_flight)"
                    r"(\{[^}]*\})? (\S+)$", re.M)


def gauges(target: Target) -> dict[str, float]:
    """Every in-flight and held-bytes gauge of the target's workers and gateway, by port."""
    found = {}
    for port in {*target.worker_admins, *([target.gateway_admin] if target.gateway_admin else [])}:
        _, text = _http_get(port, "/metrics")
        for name, labels, value in _GAUGE.findall(text):
            found[f"{port}:{name}{labels}"] = float(value)
    return found


def healthy_answer(target: Target, rng: random.Random) -> str | None:
    """A well-behaved Triton client on a new connection: None when served the right answer
    (this suite's own client over TLS, or where tritonclient is not installed)."""
    x = _rows(rng)
    try:
        import tritonclient.grpc as grpcclient
    except ImportError:
        grpcclient = None
    try:
        if target.tls is not None or grpcclient is None:
            return _raw_health(target, x)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{target.grpc}")
        inputs = [grpcclient.InferInput(n, list(x.shape), "INT32") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_data_from_numpy(x)
        inputs[1].set_data_from_numpy(x)
        result = client.infer("simple", inputs, client_timeout=30)
        client.close()
    except Exception as exc:        # what failed is the report
        return f"the well-behaved client failed: {type(exc).__name__}: {exc}"
    if not np.array_equal(result.as_numpy("OUTPUT0"), 2 * x):
        return "the well-behaved client got a wrong answer"
    return None


def _raw_health(target: Target, x: np.ndarray) -> str | None:
    client = H2Client(target)
    try:
        sid = client.send_request(simple_request("simple", x, x).SerializeToString())
        client.wait([sid], 30)
        a = client.answers[sid]
        if a.status != OK:
            return f"the well-behaved client was answered {a.status} {a.message!r}"
        return _check_simple_reply(a.data, x, x, "simple")
    finally:
        client.close()


def log_problems(target: Target) -> list[str]:
    """ERROR records, tracebacks other than the hooks', and worker restarts, since the last look."""
    problems = []
    for p in target.processes:
        for line in p.new_log_lines():
            try:
                record = json.loads(line[line.index("{"):]) if "{" in line else {"message": line}
            except ValueError:
                record = {"message": line}
            level = str(record.get("level", "")).upper()
            message = str(record.get("message", ""))
            hook = "hook" in message
            if level in ("ERROR", "CRITICAL") or ("exception" in record and not hook) or \
                    ("Traceback" in line and not hook) or "restarting it" in message:
                problems.append(f"{p.name}: {line[:600]}")
    return problems


@dataclass
class Report:
    target: str
    cases: int = 0
    by_family: Counter = field(default_factory=Counter)
    sent: int = 0
    answered: int = 0
    twice: int = 0
    unanswered: int = 0
    wrong: int = 0
    deaths: int = 0
    leaks: int = 0
    unhealthy: int = 0
    log_records: int = 0
    statuses: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def failed(self) -> bool:
        return bool(self.twice or self.unanswered or self.wrong or self.deaths or self.leaks or self.unhealthy
                    or self.log_records)

    def note(self, text: str) -> None:
        if len(self.examples) < 20:
            self.examples.append(text)


def run_target(target: Target, cases: int, seed: int, round_size: int, threads: int,
               progress=None, only: frozenset[str] | None = None) -> Report:
    report = Report(target.name)
    started = time.monotonic()
    checker = random.Random(seed ^ 0x5EED)
    log_problems(target)        # start-up lines are not the suite's
    with ThreadPoolExecutor(threads) as pool:
        done = 0
        while done < cases:
            n = min(round_size, cases - done)
            rngs = [random.Random(f"{seed}:{target.name}:{done + i}") for i in range(n)]
            families = [draw_family(target, rng, only) for rng in rngs]
            outcomes = list(pool.map(lambda fr: _run_case(target, *fr), zip(families, rngs)))
            done += n
            for o in outcomes:
                report.cases += 1
                report.by_family[o.family] += 1
                report.sent += o.sent
                report.answered += o.answered
                report.twice += o.twice
                report.unanswered += o.sent - o.answered
                report.statuses.update(o.statuses)
                report.wrong += len(o.problems)
                for p in (*o.missing, *o.problems):
                    report.note(f"{o.family} {o.name}: {p}")
            _check_round(target, report, checker)
            if progress:
                progress(report, done)
            if report.deaths:
                break
    report.seconds = time.monotonic() - started
    return report


def _run_case(target: Target, family: str, rng: random.Random) -> Outcome:
    try:
        return FAMILIES[family](target, rng)
    except Exception as exc:        # the client's own failure (a refused connect, say) is a finding
        out = Outcome(family, "client")
        out.problems.append(f"the case itself failed: {type(exc).__name__}: {exc}")
        return out


def _dead(target: Target, report: Report) -> bool:
    for p in target.processes:
        if p.proc.poll() is not None:
            report.deaths += 1
            report.note(f"{p.name} died (exit status {p.proc.returncode}); its log: {p.log_path}")
            for line in p.new_log_lines()[-8:]:
                report.note(f"  {p.name}: {line[:300]}")
    return bool(report.deaths)


def _check_round(target: Target, report: Report, rng: random.Random) -> None:
    if _dead(target, report):
        return
    problem = healthy_answer(target, rng)
    if problem:
        # a process that is going down refuses connections before it exits: give it the time
        until = time.monotonic() + 10.0
        while time.monotonic() < until and all(p.proc.poll() is None for p in target.processes):
            if healthy_answer(target, rng) is None:
                break
            time.sleep(0.2)
        if _dead(target, report):
            return
        report.unhealthy += 1
        report.note(problem)
    until = time.monotonic() + QUIESCE_SECONDS
    while True:
        try:
            values = gauges(target)
        except OSError as exc:
            if not _dead(target, report):
                report.unhealthy += 1
                report.note(f"the admin port failed: {exc}")
            return
        busy = {k: v for k, v in values.items() if v}
        if not busy:
            break
        if time.monotonic() > until:
            report.leaks += 1
            report.note(f"gauges not back to 0 after {QUIESCE_SECONDS} s: {busy}")
            break
        time.sleep(0.05)
    for line in log_problems(target):
        report.log_records += 1
        report.note(f"log: {line}")


def print_report(r: Report, out=sys.stderr) -> None:
    fams = " ".join(f"{k}={v}" for k, v in sorted(r.by_family.items()))
    print(f"{r.target}: {r.cases} cases ({fams}) in {r.seconds:.0f} s; requests sent {r.sent}, answered {r.answered}, "
          f"unanswered {r.unanswered}, twice {r.twice}, wrong {r.wrong}; deaths {r.deaths}, leaks {r.leaks}, "
          f"unhealthy {r.unhealthy}, unexpected log records {r.log_records}", file=out)
    statuses = ", ".join(f"{k}: {v}" for k, v in sorted(r.statuses.items()))
    print(f"  statuses {statuses}", file=out)
    for e in r.examples:
        print(f"  - {e}", file=out)


@contextmanager
def targets_running(names: list[str], workdir: Path):
    repo = build_repo(workdir / "models")
    with ExitStack() as stack:
        running = []
        for name in names:
            try:
                t = start_target(name, repo, workdir / name)
            except RuntimeError as exc:     # a port taken between choosing it and binding it: once more
                print(f"{name} did not start ({str(exc)[:300]}); trying again", file=sys.stderr)
                t = start_target(name, repo, workdir / f"{name}-again")
            stack.callback(stop_target, t)
            running.append(t)
        yield running


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=100_000, help="cases in all, shared by the targets")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--targets", default="worker,gateway,node,tls")
    ap.add_argument("--round", type=int, default=64, help="cases between checks")
    ap.add_argument("--threads", type=int, default=12)
    ap.add_argument("--workdir", help="where the repository, node files and logs go (default: a temporary one)")
    ap.add_argument("--families", help="only these case families, comma-separated (default: all of "
                    f"{', '.join(FAMILIES)})")
    ap.add_argument("--source", type=Path, default=ROOT, help="the checkout whose xlaserve the targets run "
                    "(another commit's git worktree, to compare)")
    ap.add_argument("--backend", default="cpu", help="the targets' runtime.backend (cpu or cuda)")
    ap.add_argument("--json", action="store_true", help="one JSON line per target on stdout")
    args = ap.parse_args(argv)
    global SOURCE, BACKEND
    SOURCE, BACKEND = args.source.resolve(), args.backend
    names = [n for n in args.targets.split(",") if n]
    per_target = {n: args.cases // len(names) + (1 if i < args.cases % len(names) else 0)
                  for i, n in enumerate(names)}
    with tempfile.TemporaryDirectory(prefix="fault-suite-") as tmp:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        failed = False
        with targets_running(names, workdir) as running:
            reports = []
            for target in running:
                def progress(r, done, total=per_target[target.name]):
                    if done % (args.round * 50) < args.round:
                        print(f"{r.target}: {done}/{total} cases, {r.sent} requests", file=sys.stderr, flush=True)
                only = frozenset(args.families.split(",")) if args.families else None
                r = run_target(target, per_target[target.name], args.seed, args.round, args.threads, progress, only)
                reports.append(r)
        codes = [p.proc.returncode for t in running for p in t.processes]
        for r in reports:
            print_report(r)
            failed |= r.failed()
            if args.json:
                print(json.dumps({"target": r.target, "cases": r.cases, "by_family": dict(r.by_family),
                                  "sent": r.sent, "answered": r.answered, "unanswered": r.unanswered,
                                  "twice": r.twice, "wrong": r.wrong, "deaths": r.deaths, "leaks": r.leaks,
                                  "unhealthy": r.unhealthy, "log_records": r.log_records,
                                  "statuses": {str(k): v for k, v in r.statuses.items()},
                                  "seconds": round(r.seconds, 1), "examples": r.examples}))
        bad_exit = [c for c in codes if c != 0]
        if bad_exit:
            print(f"processes exited with {codes} after SIGTERM (expected 0)", file=sys.stderr)
            failed = True
    total = sum(r.cases for r in reports)
    print(f"{'FAILED' if failed else 'passed'}: {total} cases over {', '.join(names)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
