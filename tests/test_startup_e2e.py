"""Start-up and operation as a new user meets them: each start-up failure is one line on stderr
and exit status 2; an empty repository is served but not ready until a model is; the start-up
log says each thing once; SIGTERM drains and exits 0; --version and --help; the example node
file binds loopback only. End to end with the real ``xlaserve run`` and the real Triton client."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from examples.export_examples import export_mlp, export_simple
from tests.conftest import ROOT, serve, write_node
from xlaserve.config import load_node_config, parse_node_config, resolve_worker
from xlaserve.errors import StartupError
from xlaserve.app import preflight


def _xlaserve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xlaserve", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


def _wait(predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
    return value


@pytest.fixture
def taken_port():
    """A loopback port another process is listening on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("case", ["grpc port taken", "http port taken", "model_repo missing",
                                  "model_repo is a file"])
def test_each_startup_failure_is_one_line_and_exit_status_2(tmp_path, taken_port, case):
    repo = tmp_path / "models"
    repo.mkdir()
    listen = {"grpc": "127.0.0.1:0", "http": "127.0.0.1:0"}
    match case:
        case "grpc port taken":
            listen["grpc"] = f"127.0.0.1:{taken_port}"
            expected = f"listen.grpc 127.0.0.1:{taken_port}: address already in use"
        case "http port taken":
            listen["http"] = f"127.0.0.1:{taken_port}"
            expected = f"listen.http 127.0.0.1:{taken_port}: address already in use"
        case "model_repo missing":
            repo = tmp_path / "no_such_repo"
            expected = (f"model_repo {repo}: does not exist (expected a directory holding one subdirectory "
                        "per bundle)")
        case "model_repo is a file":
            repo = tmp_path / "repo.txt"
            repo.write_text("not a directory")
            expected = (f"model_repo {repo}: is not a directory (expected a directory holding one "
                        "subdirectory per bundle)")
    node = write_node(tmp_path / "node.yaml", repo, listen=listen)
    result = _xlaserve("run", str(node))
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [f"xlaserve: cannot start: {expected}"]
    assert result.stdout == ""


def test_a_multi_worker_node_names_the_port_rule_of_the_address_in_use(tmp_path, taken_port):
    """``xlaserve worker`` binds base_port + i and metrics_base_port + i; the message says so."""
    repo = tmp_path / "models"
    repo.mkdir()
    node = parse_node_config({"model_repo": str(repo), "gpus": 2, "base_port": taken_port - 1,
                              "global": {"endpoints": {"host": "127.0.0.1"}}}, tmp_path)
    with pytest.raises(StartupError) as error:
        preflight.claim(resolve_worker(node, 1))
    assert str(error.value) == f"base_port + 1 127.0.0.1:{taken_port}: address already in use"


def test_empty_repository_is_served_but_not_ready_until_a_model_is(tmp_path):
    repo = tmp_path / "models"
    repo.mkdir()
    dynamic = {"model_control_mode": "dynamic", "model_poll_seconds": 0.5}
    with serve(tmp_path / "srv", repo, dynamic, wait_ready=False) as server:
        client = grpcclient.InferenceServerClient(server.url)
        status, body = _wait(lambda: (r := server.get("/readyz"))[1] != "loading models\n" and r,
                             "the start-up set to finish")
        assert (status, body) == (503, f"no model is ready: model_repo {repo} holds no bundle\n")
        assert client.is_server_live() and not client.is_server_ready()
        assert client.get_model_repository_index().models == []

        export_simple(repo, (1,))
        _wait(lambda: server.get("/readyz")[0] == 200, "ready once the new bundle loads")
        assert client.is_server_ready()
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        inputs = []
        for name in ("INPUT0", "INPUT1"):
            tensor = grpcclient.InferInput(name, [1, 16], "INT32")
            tensor.set_data_from_numpy(a)
            inputs.append(tensor)
        np.testing.assert_array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), 2 * a)
    assert server.process.returncode == 0, server.log()


def test_a_repository_whose_every_bundle_failed_is_not_ready(tmp_path):
    repo = tmp_path / "models"
    export_simple(repo, (1,))
    manifest = repo / "simple" / "manifest.yaml"
    manifest.write_text(manifest.read_text().replace("dims: {x: 16}", "dims: {x: 17}"))
    with serve(tmp_path / "srv", repo, wait_ready=False) as server:
        status, body = _wait(lambda: (r := server.get("/readyz"))[1] != "loading models\n" and r,
                             "the start-up set to finish")
        assert status == 503 and body.startswith("no model is ready (UNAVAILABLE=1;")
        assert not grpcclient.InferenceServerClient(server.url).is_server_ready()


def test_startup_log_says_each_thing_once_and_sigterm_drains(tmp_path):
    repo = tmp_path / "models"
    export_simple(repo, (1,))
    dynamic = {"model_control_mode": "dynamic", "model_poll_seconds": 0.5, "cache_dir": None}
    with serve(tmp_path / "srv", repo, dynamic) as server:
        startup_log = server.log()
        # A bundle added while serving: the watcher's file events must not reach the log.
        export_mlp(repo, (1,))
        client = grpcclient.InferenceServerClient(server.url)
        _wait(lambda: client.is_model_ready("mlp"), "mlp to load")
    log = server.log()
    assert server.process.returncode == 0, log
    assert "Unable to initialize backend" not in log and "jax" not in _logger_names(log)
    assert "watchfiles" not in _logger_names(log)
    assert log.count("effective configuration of worker") == 1
    # The budget once the start-up set is admitted; later only when it changes.
    assert startup_log.count("device weight budget") == 1
    # The effective configuration shows the ports bound, not the 0 the node file asked for.
    assert f"grpc_port: {server.grpc_port}\n" in log and f"http_port: {server.http_port}\n" in log
    assert log.count(f"serving: KServe V2 gRPC on 127.0.0.1:{server.grpc_port}, "
                     f"HTTP on 127.0.0.1:{server.http_port}") == 1
    assert "draining: no new calls" in log and log.rstrip().endswith("worker worker0 stopped")


def _logger_names(log: str) -> set[str]:
    """The logger of each record line (``date time LEVEL name: message``)."""
    names = set()
    for line in log.splitlines():
        parts = line.split(" ", 4)
        if len(parts) == 5 and parts[2] in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            names.add(parts[3].rstrip(":").split(".")[0])
    return names


def test_version_and_help():
    result = _xlaserve("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"xlaserve {version('xlaserve')} (jax {version('jax')}, jaxlib {version('jaxlib')})\n"
    result = _xlaserve("--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "xlaserve serves XLA-compiled models" in text and "KServe V2 gRPC" in text
    assert "docs/getting-started.md" in text and "README.md" in text


def test_the_example_node_file_binds_loopback_and_leaves_client_shm_off():
    node = load_node_config(ROOT / "examples" / "node.yaml")
    assert node.listen.grpc == "127.0.0.1:8001" and node.listen.http == "127.0.0.1:8002"
    assert node.endpoints.allow_client_shm is False
    assert node.model_repo == Path(ROOT / "examples" / "models")
