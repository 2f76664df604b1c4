"""xlaserve.cpupolicy: the gateway's CPU scheduling policy, and the one a node's workers take back.
Each case that changes a policy runs in a child process, so the test runner keeps its own."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest

from xlaserve import cpupolicy
from xlaserve.cpupolicy import WORKER_POLICY_ENV, apply_policy, current_policy, restore_worker_policy

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")


def run_child(code: str, env: dict[str, str] | None = None) -> str:
    """Run ``code`` in a fresh interpreter; its stdout."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


POLICIES_OF_THREADS = """
    import os, threading
    def policies():
        return sorted({os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")})
"""


def test_batch_covers_the_threads_started_before_and_after():
    out = run_child(POLICIES_OF_THREADS + """
    from xlaserve.cpupolicy import apply_policy
    stop = threading.Event()
    early = threading.Thread(target=stop.wait); early.start()      # a library's thread, started first
    assert apply_policy("batch")
    late = []
    t = threading.Thread(target=lambda: late.append(os.sched_getscheduler(0))); t.start(); t.join()
    print(policies(), late, os.SCHED_BATCH)
    stop.set()
    """)
    assert out == f"[{os.SCHED_BATCH}] [{os.SCHED_BATCH}] {os.SCHED_BATCH}"


def test_normal_leaves_the_policy_the_process_was_started_with():
    # (started under SCHED_BATCH, as `chrt --batch` would: an operator's choice stands)
    out = run_child(POLICIES_OF_THREADS + """
    from xlaserve.cpupolicy import apply_policy
    apply_policy("batch")
    print(apply_policy("normal"), policies())
    """)
    assert out == f"False [{os.SCHED_BATCH}]"


def test_a_worker_takes_back_the_policy_its_supervisor_hands_it():
    # started under the gateway's batch, told the node's own (normal): every thread goes back
    code = POLICIES_OF_THREADS + """
    import os
    from xlaserve.cpupolicy import apply_policy, restore_worker_policy
    apply_policy("batch")       # as a supervisor's child starts: under its gateway's policy
    print(restore_worker_policy(os.environ), policies())
    """
    assert run_child(code, {WORKER_POLICY_ENV: f"{os.SCHED_OTHER}:0"}) == f"True [{os.SCHED_OTHER}]"
    # started by hand (no variable): it keeps the policy it has
    env = {k: v for k, v in os.environ.items() if k != WORKER_POLICY_ENV}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.stdout.strip() == f"False [{os.SCHED_BATCH}]", done.stderr


def test_current_policy_reads_back_as_what_a_worker_restores():
    assert current_policy() == f"{os.sched_getscheduler(0)}:{os.sched_getparam(0).sched_priority}"


@pytest.mark.parametrize("text", ["batch", "3", "3:x", "3:0:1"])
def test_a_malformed_hand_over_is_ignored_with_a_warning(text: str, caplog: pytest.LogCaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(os, "sched_setscheduler", lambda *a: pytest.fail("no policy is set"))
    with caplog.at_level(logging.WARNING, "xlaserve.cpupolicy"):
        assert restore_worker_policy({WORKER_POLICY_ENV: text}) is False
    assert f"ignoring {WORKER_POLICY_ENV}={text!r}: expected POLICY:PRIORITY, two integers" in caplog.text


def test_a_refused_policy_is_a_warning_and_the_process_goes_on(caplog: pytest.LogCaptureFixture,
                                                               monkeypatch: pytest.MonkeyPatch):
    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    with caplog.at_level(logging.WARNING, "xlaserve.cpupolicy"):
        assert apply_policy("batch") is False
        assert restore_worker_policy({WORKER_POLICY_ENV: "1:50"}) is False
    assert ("could not set the CPU scheduling policy of the gateway (cpu_policy batch): Operation not permitted; "
            "it runs under the one it has") in caplog.text
    assert "could not set the CPU scheduling policy of this worker (the node's own CPU policy)" in caplog.text


def test_a_platform_without_the_policy_runs_on_with_a_warning(caplog: pytest.LogCaptureFixture,
                                                              monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(cpupolicy.POLICIES, "batch", None)
    monkeypatch.setattr(os, "sched_setscheduler", lambda *a: pytest.fail("no policy is set"))
    with caplog.at_level(logging.WARNING, "xlaserve.cpupolicy"):
        assert apply_policy("batch") is False
    assert "the gateway runs under the default CPU policy: this platform has no batch scheduling policy" in caplog.text
