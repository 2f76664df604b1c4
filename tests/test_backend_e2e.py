"""End to end: a node file that asks for cuda where cuda cannot be used. Without
runtime.allow_cpu_fallback the server refuses to start in one line, exit status 2; with it, the
server serves on the cpu and says why once. ``CUDA_VISIBLE_DEVICES=""`` hides any GPU, so cuda is
unusable here whether or not jax's CUDA plugin is installed."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from examples.export_examples import export_simple
from tests.conftest import ROOT, serve, write_node

NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.parametrize("command", [["run"], ["worker", "--worker", "worker0"]])
def test_unusable_cuda_fails_start_up_in_one_line_with_status_2(tmp_path, command):
    (tmp_path / "models").mkdir()
    node = write_node(tmp_path / "node.yaml", tmp_path / "models", {"runtime": {"backend": "cuda"}})
    done = subprocess.run([sys.executable, "-m", "xlaserve", command[0], str(node), *command[1:]],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, **NO_GPU}, timeout=120)
    assert done.returncode == 2, done.stderr
    named = [line for line in done.stderr.splitlines() if "runtime.backend" in line]
    assert len(named) == 1, done.stderr
    assert "cannot start: runtime.backend: cuda is not available: jax's CUDA plugin" in named[0]
    assert "runtime.allow_cpu_fallback: true" in named[0]
    assert "Traceback" not in done.stderr and "KServe V2 gRPC on" not in done.stderr


def test_cuda_with_fallback_serves_on_cpu_and_says_why_once(tmp_path):
    export_simple(tmp_path / "models", (1,))   # a worker is ready once a model is
    runtime = {"backend": "cuda", "allow_cpu_fallback": True, "mem_fraction": 0.5}
    with serve(tmp_path / "srv", tmp_path / "models", {"runtime": runtime}, env=NO_GPU) as server:
        assert server.get("/readyz")[0] == 200
        lines = server.log().splitlines()
    warnings = [line for line in lines if "running on the cpu because runtime.allow_cpu_fallback is true" in line]
    assert len(warnings) == 1 and " WARNING " in warnings[0]
    assert "runtime.backend: cuda is not available (jax's CUDA plugin" in warnings[0]
    notes = [line for line in lines if "not applicable" in line]
    assert len(notes) == 1 and "runtime.mem_fraction: 0.5 is not applicable on the cpu backend" in notes[0]
    assert any("device: cpu" in line for line in lines)


def test_default_runtime_keys_log_nothing_about_the_allocator(example_server):
    log = example_server.log()
    assert "not applicable" not in log and "allow_cpu_fallback is true" not in log
    assert "GPUs are not counted because runtime.backend is cpu" in log
