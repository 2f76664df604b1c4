"""How many workers a node runs (plan_workers, pure) and when ``xlaserve run`` refuses it."""
from __future__ import annotations

from pathlib import Path

import pytest

from xlaserve.config import NodeConfig, parse_node_config
from xlaserve.node import WorkerPlan, detect_gpus, lpt_refusal, plan_workers, tls_refusal


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


def test_lpt_packing_refuses_workers_that_run_fair_naming_them():
    node = parse({"workers": [{"name": "a"}, {"name": "b", "scheduler": {"discipline": "fifo"}}]})
    message = lpt_refusal(node, "lpt_packing", 2)
    assert message == ("gateway.scheduling.mode is lpt_packing, which needs every worker's scheduler.discipline "
                       "to be fifo or edf (the gateway places the models and balances the workers); a runs fair: "
                       "set global.scheduler.discipline: fifo")
    assert lpt_refusal(node, "round_robin", 2) == ""
    fifo = parse({"workers": [{"name": "a"}, {"name": "b"}], "global": {"scheduler": {"discipline": "edf"}}})
    assert lpt_refusal(fifo, "lpt_packing", 2) == ""


def test_tls_refuses_a_node_of_several_workers_naming_them():
    """The embedded gateway speaks cleartext to its workers: a node that set endpoints.tls for
    them started, never reached one (each connection failed its TLS handshake, ten log lines a
    second) and answered 'no model is served yet' forever."""
    tls = {"tls": {"cert_file": "server.pem", "key_file": "server.key"}}
    node = parse({"workers": [{"name": "a"}, {"name": "b"}], "global": {"endpoints": tls}})
    assert tls_refusal(node, 2) == (
        "endpoints.tls is set for a, b, but this node runs 2 workers behind its embedded gateway, which has no "
        "TLS on either side: it could not reach a TLS worker, and its public port would be cleartext; serve TLS "
        "from a one-worker node, or terminate TLS in front of the gateway (docs/deployment.md) and remove "
        "endpoints.tls")
    one = parse({"workers": [{"name": "b", "endpoints": tls}, {"name": "c"}]})
    assert tls_refusal(one, 2).startswith("endpoints.tls is set for b, but")
    assert tls_refusal(parse({"global": {"endpoints": tls}}), 1) == ""
    assert tls_refusal(parse({"workers": [{"name": "a"}, {"name": "b"}]}), 2) == ""


def test_a_serving_process_raises_its_open_files_soft_limit_to_the_hard_one():
    """Started at a soft limit of 1,024 (common), one client's shared-memory regions or the
    default max_connections alone would exhaust a worker's descriptors: every accept, model load
    and log file then fails with EMFILE. The soft limit is raised toward the hard one."""
    import subprocess
    import sys
    code = ("import resource\n"
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
            "from xlaserve.cli import OPEN_FILES_WANTED, raise_open_files_limit\n"
            "raise_open_files_limit()\n"
            "now, hard2 = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "want = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_WANTED)\n"
            "assert hard2 == hard and now == want and now > 256, (now, hard, want)\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr
