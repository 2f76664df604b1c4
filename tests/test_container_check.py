"""The scripts the container image and its test run, against the real server on loopback (no
container engine needed): deploy/healthcheck.py (the image's HEALTHCHECK) and
deploy/container_check.py (deploy/test-container.sh's client side, with the real Triton client).
deploy/test-container.sh itself needs root and a container engine; here it is only parsed."""
from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.conftest import serve

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"deploy_{name}", DEPLOY / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


container_check = _load("container_check")


def _healthcheck(http_address: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "INFERENCE_SERVER_LISTEN_HTTP": http_address}
    return subprocess.run([sys.executable, str(DEPLOY / "healthcheck.py")], env=env,
                          capture_output=True, text=True, timeout=30)


def test_the_healthcheck_passes_on_a_serving_node(example_server):
    # the port comes from the variable that overrides listen.http, as in the image
    result = _healthcheck(f"0.0.0.0:{example_server.http_port}")
    assert result.returncode == 0, result.stderr


def test_the_healthcheck_fails_where_nothing_answers():
    with socket.socket() as probe:       # a port that was free a moment ago: nothing listens on it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = _healthcheck(f"0.0.0.0:{port}")
    assert result.returncode == 1
    assert f"http://127.0.0.1:{port}/healthz" in result.stderr


def test_the_query_check_compares_the_examples_with_their_references(example_server, capsys):
    assert container_check.main(["ready", example_server.http.removeprefix("http://"), "--timeout", "30"]) == 0
    assert container_check.main(["query", example_server.url]) == 0
    out = capsys.readouterr().out
    for model in ("simple", "mlp", "cnn"):
        assert f"query: {model} " in out and "match" in out


def test_the_drain_check_sees_a_held_request_answered_after_sigterm(examples_repo, tmp_path, capsys):
    # the node file test-container.sh gives the image: mlp's requests wait for more rows
    scheduler = {"models": {"mlp": {"batch_delay_seconds": 2}}}
    with serve(tmp_path / "node", examples_repo, {"scheduler": scheduler}) as server:
        stop = ["kill", "-TERM", str(server.process.pid)]
        assert container_check.main(["drain", server.url, server.http.removeprefix("http://"), "--", *stop]) == 0
        assert server.process.wait(30) == 0
    out = capsys.readouterr().out
    assert "drain: one mlp request queued" in out
    assert "answered" in out and "matching the reference" in out
    assert "draining: no new calls" in server.log()


def test_the_drain_check_fails_when_no_request_is_held(example_server, capsys):
    # Without a hold the request is answered at once. The check fails, whichever way the race
    # goes: it never sees the request queued (the usual case), or sees it and finds it answered
    # before the stop command, or runs the stop command (here `false`, which stops nothing and
    # fails). The shared server is untouched.
    code = container_check.main(["drain", example_server.url, example_server.http.removeprefix("http://"),
                                 "--", "false"])
    assert code == 1
    err = capsys.readouterr().err
    assert "container_check: FAILED:" in err
    assert any(why in err for why in ("batch_delay_seconds hold is missing", "answered before SIGTERM",
                                      "exited with status 1")), err
    assert example_server.process.poll() is None


def test_the_container_test_script_parses():
    subprocess.run(["bash", "-n", str(DEPLOY / "test-container.sh")], check=True)
    assert os.access(DEPLOY / "test-container.sh", os.X_OK)
