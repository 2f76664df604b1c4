"""Shared fixtures. End-to-end tests start the real server (``python -m xlaserve run``) as a
subprocess on loopback with free ports and talk to it with the real Triton client."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # examples.* importable


def infer_input(name: str, array: np.ndarray, datatype: str, client=grpcclient):
    """A Triton ``InferInput`` holding ``array``; ``client`` is tritonclient.grpc or its aio module."""
    tensor = client.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


@dataclass
class RunningServer:
    process: subprocess.Popen
    grpc_port: int
    http_port: int
    log_path: Path
    node_path: Path
    rest_port: int | None = None

    @property
    def rest(self) -> str:
        """``host:port`` of the REST port (``listen.rest``), as tritonclient.http takes it."""
        return f"127.0.0.1:{self.rest_port}"

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.http + path, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()


def write_node(path: Path, repo: Path, global_: dict | None = None, **top) -> Path:
    node = {"model_repo": str(repo), "listen": {"grpc": "127.0.0.1:0", "http": "127.0.0.1:0"},
            "global": {"runtime": {"backend": "cpu"}, "model_control_mode": "static", **(global_ or {})}}
    node.update(top)
    path.write_text(yaml.safe_dump(node))
    return path


@contextmanager
def serve(tmp: Path, repo: Path, global_: dict | None = None, *, wait_ready: bool = True,
          env: dict | None = None, timeout: float = 120.0, root: Path = ROOT, **top):
    """Start ``xlaserve run`` on a node file built from the arguments; stop it with SIGTERM.
    ``root``: the checkout whose ``xlaserve`` runs (benchmarks compare two)."""
    tmp.mkdir(parents=True, exist_ok=True)
    node = write_node(tmp / "node.yaml", repo, global_, **top)
    ready = tmp / "ready.json"
    ready.unlink(missing_ok=True)
    log_path = tmp / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "xlaserve", "run", str(node), "--ready-file", str(ready)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=root, env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not start:\n{log_path.read_text()}")
            time.sleep(0.05)
        ports = json.loads(ready.read_text())
        server = RunningServer(proc, ports["grpc_port"], ports["http_port"], log_path, node, ports.get("rest_port"))
        while wait_ready and server.get("/readyz")[0] != 200:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"server not ready:\n{log_path.read_text()}")
            time.sleep(0.05)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


@pytest.fixture(scope="session")
def examples_repo(tmp_path_factory) -> Path:
    """The example bundles, exported once per test session."""
    out = tmp_path_factory.mktemp("examples") / "models"
    subprocess.run([sys.executable, str(ROOT / "examples" / "export_examples.py"), str(out)], check=True,
                   cwd=ROOT, capture_output=True)
    return out


@pytest.fixture(scope="session")
def example_server(examples_repo, tmp_path_factory):
    """One server over the example bundles, shared by the tests that only read from it."""
    with serve(tmp_path_factory.mktemp("example_server"), examples_repo,
               {"endpoints": {"allow_client_shm": True}}) as server:
        yield server
    assert server.process.returncode == 0, server.log()
