"""What `xlaserve run` prints for a node file it cannot use: one line, the file named once."""
from __future__ import annotations

from pathlib import Path

import pytest

from xlaserve import cli


@pytest.mark.parametrize("text, expected", [
    ("model_repo: x\nglobal:\n  scheduler: [\n  bad: : x\n",
     "{f}:4:8: not valid YAML: expected the node content, but found ':' (while parsing a flow node)"),
    ("model_repo: x\nmodel_repo: y\n", "{f}:2:1: duplicate key 'model_repo'"),
    ("model_repo: x\nglobal: {runtime: {backend: tpu}}\n",
     "{f}: global.runtime.backend: expected one of cpu, cuda, got 'tpu'"),
])
def test_run_prints_one_line_naming_the_file_once(tmp_path: Path, capsys, text: str, expected: str):
    node = tmp_path / "node.yaml"
    node.write_text(text)
    assert cli.main(["run", str(node)]) == 2
    err = capsys.readouterr().err
    assert err == "xlaserve: " + expected.format(f=node) + "\n"
    assert err.count(str(node)) == 1


def test_worker_names_the_file_for_an_unknown_worker(tmp_path: Path, capsys):
    node = tmp_path / "node.yaml"
    node.write_text("model_repo: x\n")
    assert cli.main(["worker", str(node), "--worker", "nope"]) == 2
    assert capsys.readouterr().err == f"xlaserve: {node}: worker 'nope': no such worker (workers: worker0)\n"


def test_run_refuses_two_cuda_workers_on_one_gpu_before_starting_any(tmp_path: Path, capsys, monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("the node was started")
    monkeypatch.setattr("xlaserve.node.run_node", started)    # a tripwire: the file must be refused first
    node = tmp_path / "node.yaml"
    node.write_text("model_repo: x\nglobal: {runtime: {backend: cuda}}\n"
                    "workers:\n  - {name: left, gpu: 0}\n  - {name: right, gpu: 0}\n")
    assert cli.main(["run", str(node)]) == 2
    assert capsys.readouterr().err == (
        f"xlaserve: {node}: workers[1].gpu: GPU 0 for cuda worker right is already used by cuda worker "
        "left (workers[0].gpu); two workers on one GPU would each claim its memory (runtime.mem_fraction) "
        "and fail with out-of-memory errors while serving: give each cuda worker a GPU of its own\n")
