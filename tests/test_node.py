"""How many workers a node runs (plan_workers, pure) and when ``xlaserve run`` refuses it."""
from __future__ import annotations

from pathlib import Path

import pytest

from xlaserve.config import NodeConfig, parse_node_config
from xlaserve.node import WorkerPlan, detect_gpus, plan_workers, refusal


def parse(data: dict) -> NodeConfig:
    return parse_node_config({"model_repo": "models", **data}, Path("/srv/node"))


CUDA = {"global": {"runtime": {"backend": "cuda"}}}


@pytest.mark.parametrize("data, detected, count, origin", [
    ({"workers": [{"name": "a"}, {"name": "b"}], "gpus": 4}, 8, 2, "its workers: list"),
    ({"gpus": 3}, 8, 3, "gpus: 3"),
    ({"gpus": [0, 5]}, None, 2, "gpus: [0, 5]"),
    ({"gpus": 1}, 0, 1, "gpus: 1"),
])
def test_explicit_counts_win_over_what_was_detected(data, detected, count, origin):
    plan = plan_workers(parse(data), detected)
    assert (plan.count, plan.origin, plan.note) == (count, origin, "")


def test_auto_runs_one_worker_per_detected_gpu():
    assert plan_workers(parse(CUDA), 1) == WorkerPlan(1, "gpus: auto, 1 GPU detected",
                                                      "gpus: auto: 1 GPU detected; 1 worker")
    assert plan_workers(parse(CUDA), 4) == WorkerPlan(4, "gpus: auto, 4 GPUs detected",
                                                      "gpus: auto: 4 GPUs detected; 4 workers")


def test_auto_without_a_gpu_is_one_worker_and_says_why():
    plan = plan_workers(parse(CUDA), 0, "jax's CUDA plugin is not installed")
    assert plan == WorkerPlan(1, "gpus: auto", "gpus: auto: no GPU detected (jax's CUDA plugin is not installed); "
                                               "one worker")


def test_auto_on_a_cpu_node_does_not_count_gpus():
    node = parse({})
    assert detect_gpus(node) == (None, "")
    assert plan_workers(node, *detect_gpus(node)) == WorkerPlan(
        1, "gpus: auto", "gpus: auto: one worker; GPUs are not counted because runtime.backend is cpu")


def test_detect_gpus_counts_only_for_auto_on_cuda():
    assert detect_gpus(parse({**CUDA, "gpus": 2})) == (None, "")
    assert detect_gpus(parse({**CUDA, "workers": [{"name": "a"}]})) == (None, "")
    count, why = detect_gpus(parse(CUDA))
    assert count >= 0 and (why == "") == (count > 0)


def test_a_node_of_several_detected_gpus_is_refused_naming_the_count():
    node = parse(CUDA)
    message = refusal(node, plan_workers(node, 4))
    assert message.startswith("this node file asks for 4 workers (gpus: auto, 4 GPUs detected); "
                              "multi-worker nodes (supervisor + gateway) are not available yet")
    assert message.endswith("or set gpus: 1 to serve one GPU")
    assert refusal(node, plan_workers(node, 1)) == "" and refusal(node, plan_workers(node, 0, "none")) == ""


def test_a_listed_node_is_refused_without_the_gpus_hint():
    node = parse({"workers": [{"name": "a"}, {"name": "b"}]})
    message = refusal(node, plan_workers(node))
    assert "2 workers (its workers: list)" in message and "gpus: 1" not in message
