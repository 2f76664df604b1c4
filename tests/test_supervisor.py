"""The supervisor: the worker command lines of a node, and the process side with real stand-in
workers (tiny ``python -c`` scripts that print,
report ready, exit, crash or ignore SIGTERM), at back-offs of a few tens of milliseconds."""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import trio
import trio.testing
from trio.testing import MockClock

from xlaserve.config import ConfigError, LoggingConfig, SupervisorConfig, parse_node_config
from xlaserve.logformat import JsonFormatter, formatter, process_line, worker_line
from xlaserve.logrelay import ENTRY_OVERHEAD_BYTES, LineRelay, RelayStatistics, drop_notice
from xlaserve.supervision import MAX_LINE_BYTES
from xlaserve.supervisor import (DEVICE_ISOLATED_ENV, READY_FD_ENV, TAIL_LINES, Supervisor, WorkerExited,
                                 WorkerReady, WorkerStarted, WorkerState, WorkerSpec, supervise,
                                 visible_device, worker_specs)

# --- log formats -----------------------------------------------------------------------------------


def test_worker_lines_in_text_are_prefixed():
    assert worker_line("worker1", "2026 INFO x: hello", "text") == "[worker1] 2026 INFO x: hello"


def test_worker_lines_in_json_carry_the_worker():
    plain = json.loads(worker_line("w0", "Traceback (most recent call last):", "json"))
    assert plain == {"worker": "w0", "message": "Traceback (most recent call last):"}
    own = worker_line("w0", json.dumps({"level": "info", "message": "up", "worker": "liar"}), "json")
    assert own.startswith('{"worker": "w0"')
    assert json.loads(own) == {"worker": "w0", "level": "info", "message": "up"}
    # JSON that is not an object, and broken JSON, are text
    assert json.loads(worker_line("w0", "[1, 2]", "json")) == {"worker": "w0", "message": "[1, 2]"}
    assert json.loads(worker_line("w0", "{oops", "json")) == {"worker": "w0", "message": "{oops"}


def test_a_worker_line_is_a_line_whatever_the_worker_printed():
    # nested past the parser's recursion limit, a lone surrogate (valid JSON escape), NUL and
    # escapes, the replacement character of invalid UTF-8: each gives one line, no exception
    hostile = ['{"a":' + "[" * 100_000, "[" * 100_000, '{"m": "\\ud800"}', "\x00\x1b[2J\r",
               "\ufffd\ufffd", '{"a": 1e999}', "{" * 50_000]
    for text in hostile:
        assert worker_line("w0", text, "text").startswith("[w0] ")
        entry = json.loads(worker_line("w0", text, "json"))
        assert entry["worker"] == "w0"
    assert json.loads(worker_line("w0", hostile[0], "json"))["message"] == hostile[0]
    assert json.loads(worker_line("w0", hostile[2], "json")) == {"worker": "w0", "m": "\ud800"}


# ESC [ 2 J clears the screen, ESC ] 0 ; ... BEL retitles the window, CR hides what came before on
# the line, U+009B is a one-character CSI, U+0085 a newline to some terminals
HOSTILE = "clear\x1b[2J title\x1b]0;pwned\x07 hide\rshown \x7f\x9b\x85\x00 tab\tkept"
SHOWN = r"clear\x1b[2J title\x1b]0;pwned\x07 hide\x0dshown \x7f\x9b\x85\x00 tab" + "\tkept"
TERMINAL_CONTROLS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")     # every control character but tab


def test_a_worker_line_in_text_shows_control_characters_as_escapes():
    assert worker_line("w0", HOSTILE, "text") == f"[w0] {SHOWN}"
    assert worker_line("w0", "plain line", "text") == "[w0] plain line"


def test_a_worker_line_in_json_escapes_every_control_character():
    for text in (HOSTILE, json.dumps({"message": HOSTILE})):
        line = worker_line("w0", text, "json")
        assert not TERMINAL_CONTROLS.search(line) and "\t" not in line
        assert json.loads(line)["message"] == HOSTILE
    entry = json.loads(process_line(HOSTILE, "json"))
    assert entry["message"] == HOSTILE


def test_the_processs_own_records_show_what_they_quote_as_text():
    """The crash report quotes a worker's last lines; a message may quote a model's name."""
    record = logging.LogRecord("xlaserve.supervisor", logging.ERROR, __file__, 1,
                               "worker %s exited. Its last lines:\n  %s", ("w0", HOSTILE), None)
    text = formatter("text").format(record)
    assert text.endswith(f"worker w0 exited. Its last lines:\n  {SHOWN}")
    json_line = formatter("json").format(record)
    assert not TERMINAL_CONTROLS.search(json_line) and "\t" not in json_line
    assert json.loads(json_line)["message"].endswith(HOSTILE)


def test_a_worker_line_with_nan_or_an_infinite_number_is_still_json():
    # Python reads these, but written back as they were they are not JSON: a log shipper (Go's
    # encoding/json, jq, Loki) rejects the line. Such a line is kept as text in `message`.
    def strict(line: str) -> dict:
        def refuse(constant: str):
            raise ValueError(f"not JSON: {constant}")
        return json.loads(line, parse_constant=refuse)
    for text in ('{"loss": NaN}', '{"a": 1e999}', '{"b": -Infinity, "c": [Infinity]}'):
        assert strict(worker_line("w0", text, "json")) == {"worker": "w0", "message": text}
    assert strict(worker_line("w0", '{"a": 1e308}', "json")) == {"worker": "w0", "a": 1e308}


def test_the_count_of_dropped_lines_is_a_line_in_the_nodes_format():
    text = drop_notice(3, "stdout")
    assert text == "xlaserve: 3 log lines dropped: stdout was not being read"
    assert drop_notice(1, "stderr") == "xlaserve: 1 log line dropped: stderr was not being read"
    assert process_line(text, "text") == text
    entry = json.loads(process_line(text, "json"))
    assert entry.pop("time").endswith("Z")
    assert entry == {"level": "warning", "logger": "xlaserve.supervisor", "message": text}


def test_the_json_formatter_writes_one_object_a_record():
    record = logging.LogRecord("xlaserve.supervisor", logging.ERROR, __file__, 1,
                               "worker %s died:\n  last line", ("w1",), None)
    record.worker = "w1"
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record.exc_info = sys.exc_info()
    line = JsonFormatter().format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["level"] == "error" and entry["logger"] == "xlaserve.supervisor"
    assert entry["worker"] == "w1" and entry["message"] == "worker w1 died:\n  last line"
    assert "RuntimeError: boom" in entry["exception"]
    assert entry["time"].endswith("Z")


# --- the worker command lines of a node ------------------------------------------------------------

NODE_PATH = Path("/srv/node/node.yaml")


def node_of(data: dict, environ: dict | None = None):
    return parse_node_config({"model_repo": "models", **data}, NODE_PATH.parent, environ)


def test_a_cpu_node_runs_xlaserve_worker_per_worker_with_its_logging():
    node = node_of({"gpus": 2, "logging": {"level": "debug", "format": "json"}})
    specs = worker_specs(NODE_PATH, node, python="/py")
    assert [s.name for s in specs] == ["worker0", "worker1"]
    assert specs[1].argv == ("/py", "-m", "xlaserve", "--log-level", "debug", "--log-format", "json",
                             "worker", str(NODE_PATH), "--worker", "worker1")
    assert dict(specs[0].env) == {}           # cpu: no device to isolate


def test_a_detected_count_is_passed_to_each_worker():
    specs = worker_specs(NODE_PATH, node_of({}), 3, python="/py", log_level="warning")
    assert [s.name for s in specs] == ["worker0", "worker1", "worker2"]
    assert specs[2].argv[-4:] == ("--worker", "worker2", "--worker-count", "3")
    assert specs[2].argv[3:7] == ("--log-level", "warning", "--log-format", "text")


def test_on_cuda_each_worker_sees_only_its_device():
    node = node_of({"global": {"runtime": {"backend": "cuda"}},
                    "workers": [{"name": "a"}, {"name": "b", "gpu": 3}, {"name": "c"}]})
    specs = worker_specs(NODE_PATH, node, python="/py", environ={})
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0", "3", "2"]
    assert all(s.env[DEVICE_ISOLATED_ENV] == "1" for s in specs)
    # a container-level filter maps the ordinals onto the devices it lets through
    filtered = worker_specs(NODE_PATH, node, python="/py", environ={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in filtered] == ["4", "7", "6"]
    with pytest.raises(ConfigError, match=r"worker b: device ordinal 3: CUDA_VISIBLE_DEVICES='4,5' "
                                          r"shows 2 devices"):
        worker_specs(NODE_PATH, node, python="/py", environ={"CUDA_VISIBLE_DEVICES": "4,5"})


def test_a_filter_that_lists_one_device_twice_gives_it_to_one_worker_only():
    node = node_of({"global": {"runtime": {"backend": "cuda"}}, "gpus": 2})
    with pytest.raises(ConfigError, match=r"^worker worker1: device ordinal 1 is CUDA_VISIBLE_DEVICES entry "
                                          r"'3', which worker worker0 already has \(CUDA_VISIBLE_DEVICES='3,3'\)"):
        worker_specs(NODE_PATH, node, python="/py", environ={"CUDA_VISIBLE_DEVICES": "3,3"})


def test_run_refuses_a_device_the_filter_does_not_show_with_one_line(caplog, monkeypatch):
    from xlaserve.node import run_node
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    node = node_of({"global": {"runtime": {"backend": "cuda"}}, "gpus": 2})
    with caplog.at_level("ERROR", logger="xlaserve.node"):
        assert run_node(node, node_path=str(NODE_PATH)) == 2
    assert "worker worker1: device ordinal 1: CUDA_VISIBLE_DEVICES='5' shows 1 device" in caplog.text


def test_visible_device_keeps_uuids():
    assert visible_device(1, "GPU-aaa, GPU-bbb") == "GPU-bbb"
    assert visible_device(1, "") == "1"


# --- the process side ------------------------------------------------------------------------------

# Every stand-in worker starts with this: ready() reports ports the way `xlaserve worker` does.
PRELUDE = """\
import json, os, signal, sys, time
def ready(grpc=7001, http=7101):
    with open(int(os.environ['XLASERVE_READY_FD']), 'w') as f:
        f.write(json.dumps({'grpc_port': grpc, 'http_port': http, 'pid': os.getpid()}) + '\\n')
"""

FAST = SupervisorConfig(restart_backoff_initial_seconds=0.02, restart_backoff_max_seconds=0.05,
                        max_restarts=2, restart_window_seconds=60.0, stop_timeout_seconds=2.0)


def fake(name: str, code: str, **env: str) -> WorkerSpec:
    return WorkerSpec(name, (sys.executable, "-c", PRELUDE + code), env)


# a worker that prints a line, reports ready and serves until SIGTERM (its default action ends it)
SERVES = "print('serving', flush=True); ready(); time.sleep(60)"


class Lines(list):
    def of(self, worker: str) -> list[str]:
        prefix = f"[{worker}] "
        return [line[len(prefix):] for line in self if line.startswith(prefix)]


async def wait_for(receive, count: int, kind: type) -> list:
    seen = []
    async for event in receive:
        seen.append(event)
        if sum(isinstance(e, kind) for e in seen) == count:
            return seen
    raise AssertionError(f"events ended before {count} {kind.__name__}: {seen}")


def run_until_ready(specs: list[WorkerSpec], **supervisor) -> None:
    """A supervisor over ``specs`` (FAST), stopped once every worker has reported ready."""
    async def main():
        running = Supervisor(specs, FAST, **supervisor)
        events = running.subscribe()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(running.run)
            await wait_for(events, len(specs), WorkerReady)
            running.stop()
    trio.run(main)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_worker_output_is_multiplexed_with_each_workers_name_and_the_ready_report_is_read():
    lines = Lines()
    specs = [fake("w0", "print('out0', flush=True); print('err0', file=sys.stderr, flush=True); " + SERVES),
             fake("w1", "print('hello from', os.environ['ONLY_MINE'], flush=True); ready(7002, 7102);"
                        "time.sleep(60)", ONLY_MINE="w1")]

    async def main():
        supervisor = Supervisor(specs, FAST, write=lines.append)
        events = supervisor.subscribe()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(supervisor.run)
            seen = await wait_for(events, 2, WorkerReady)
            status = {s.name: s for s in supervisor.status()}
            assert status["w0"].state is WorkerState.RUNNING and status["w1"].grpc_port == 7002
            assert status["w1"].http_port == 7102 and status["w1"].restarts == 0
            ready = {e.name: e for e in seen if isinstance(e, WorkerReady)}
            started = {e.name: e for e in seen if isinstance(e, WorkerStarted)}
            assert ready["w0"] == WorkerReady("w0", started["w0"].pid, 7001, 7101)
            assert started["w1"].attempt == 0 and started["w1"].pid == status["w1"].pid
            supervisor.stop()
        return supervisor

    supervisor = trio.run(main)
    assert lines.of("w1") == ["hello from w1"]
    assert lines.of("w0")[:2] == ["out0", "err0"] and "serving" in lines.of("w0")
    assert all(s.state is WorkerState.STOPPED and s.pid is None for s in supervisor.status())


def test_json_log_format_gives_every_worker_line_a_worker_field():
    lines = Lines()
    record = json.dumps({"level": "info", "message": "model mlp ready"})
    specs = [fake("w0", f"print({record!r}); print('plain text', flush=True); ready(); time.sleep(60)")]

    run_until_ready(specs, log_format="json", write=lines.append)
    assert [json.loads(line) for line in lines] == [
        {"worker": "w0", "level": "info", "message": "model mlp ready"},
        {"worker": "w0", "message": "plain text"}]


def test_an_enormous_line_is_cut_and_the_next_line_still_arrives():
    lines = Lines()
    # 1 MiB without a newline, then a normal line; then the worker exits and is not restarted
    specs = [fake("w0", "sys.stdout.write('y' * (1 << 20)); print(); print('after', flush=True)")]

    async def main():
        config = SupervisorConfig(max_restarts=0, stop_timeout_seconds=1.0)
        return await Supervisor(specs, config, write=lines.append).run()

    assert trio.run(main) == 1
    cut, after = lines.of("w0")
    assert cut == "y" * MAX_LINE_BYTES + f" [cut: line longer than {MAX_LINE_BYTES} bytes]"
    assert after == "after"


def test_a_crashing_worker_is_restarted_with_back_off_then_the_node_stops_naming_it(caplog):
    lines = Lines()
    # w0 prints a numbered line and crashes at once; w1 serves and must be stopped with the node
    specs = [fake("w0", "print('attempt line', time.time(), flush=True); sys.exit(3)"),
             fake("w1", SERVES)]
    events: list = []

    async def main():
        supervisor = Supervisor(specs, FAST, write=lines.append)
        receive = supervisor.subscribe()
        async with trio.open_nursery() as nursery:
            async def collect():
                async for event in receive:
                    events.append((trio.current_time(), event))
            nursery.start_soon(collect)
            started = trio.current_time()
            code = await supervisor.run()
            return code, trio.current_time() - started, supervisor.status()

    with caplog.at_level(logging.WARNING, logger="xlaserve.supervisor"):
        code, elapsed, status = trio.run(main)
    assert code == 1
    w0_exits = [e for _, e in events if isinstance(e, WorkerExited) and e.name == "w0"]
    assert [(e.returncode, e.restarting_in) for e in w0_exits] == [(3, 0.02), (3, 0.04), (3, None)]
    w0_starts = [(t, e) for t, e in events if isinstance(e, WorkerStarted) and e.name == "w0"]
    assert [e.attempt for _, e in w0_starts] == [0, 1, 2]
    exit_times = [t for t, e in events if isinstance(e, WorkerExited) and e.name == "w0"]
    # each restart waited out its back-off after the exit before it
    assert w0_starts[1][0] - exit_times[0] >= 0.02 and w0_starts[2][0] - exit_times[1] >= 0.04
    # w1 was stopped with the node (SIGTERM's default action), not restarted
    w1_exits = [e for _, e in events if isinstance(e, WorkerExited) and e.name == "w1"]
    assert [(e.returncode, e.restarting_in) for e in w1_exits] == [(-signal.SIGTERM, None)]
    by_name = {s.name: s for s in status}
    assert by_name["w0"].restarts == 2 and by_name["w0"].last_returncode == 3
    assert by_name["w1"].last_returncode == -signal.SIGTERM
    report = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(report) == 1 and report[0].worker == "w0"
    message = report[0].getMessage()
    assert message.startswith("worker w0 exited (exit code 3), its 3rd exit within 60 s "
                              "(supervisor.max_restarts: 2); stopping the node. Its last 3 lines:")
    assert message.count("attempt line") == 3
    assert len(lines.of("w0")) == 3
    assert elapsed < 5


def test_a_workers_control_characters_never_reach_the_supervisors_terminal(capfd, caplog):
    """Two real processes: a worker prints escape sequences, then crashes; its lines go through the
    supervisor's relay to its stdout, and the crash report that quotes them through its logging."""
    specs = [fake("w0", f"print({HOSTILE!r}, flush=True); sys.exit(3)")]

    async def main():
        return await Supervisor(specs, SupervisorConfig(max_restarts=0, stop_timeout_seconds=1.0)).run()

    with caplog.at_level(logging.ERROR, logger="xlaserve.supervisor"):
        assert trio.run(main) == 1
    out = capfd.readouterr().out
    assert out == f"[w0] {SHOWN}\n"
    (report,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    shown = formatter("text").format(report)
    assert shown.endswith(f"Its last 1 lines:\n  {SHOWN}")
    assert not TERMINAL_CONTROLS.search(shown.replace("\n", ""))


def test_a_worker_killed_by_a_signal_is_reported_by_the_signals_name(caplog):
    specs = [fake("w0", "print('about to die', flush=True); os.kill(os.getpid(), signal.SIGKILL)")]

    async def main():
        config = SupervisorConfig(max_restarts=0, stop_timeout_seconds=1.0)
        return await Supervisor(specs, config, write=lambda line: None).run()

    with caplog.at_level(logging.ERROR, logger="xlaserve.supervisor"):
        assert trio.run(main) == 1
    assert "worker w0 exited (killed by signal SIGKILL), its 1st exit" in caplog.text
    assert "\n  about to die" in caplog.text


def test_the_crash_report_keeps_only_the_last_lines():
    specs = [fake("w0", "[print('line', i) for i in range(500)]; sys.exit(1)")]

    async def main():
        supervisor = Supervisor(specs, SupervisorConfig(max_restarts=0), write=lambda line: None)
        await supervisor.run()
        return list(supervisor._workers[0].tail)

    tail = trio.run(main)
    assert tail == [f"line {i}" for i in range(500 - TAIL_LINES, 500)]


def test_a_program_that_cannot_be_started_counts_as_a_crash(tmp_path):
    lines = Lines()
    specs = [WorkerSpec("w0", (str(tmp_path / "no-such-program"),))]

    async def main():
        supervisor = Supervisor(specs, SupervisorConfig(max_restarts=0), write=lines.append)
        return await supervisor.run(), supervisor.status()

    code, (status,) = trio.run(main)
    assert code == 1 and status.last_returncode == 127
    assert lines.of("w0")[0].startswith(f"cannot start '{tmp_path / 'no-such-program'}': ")


def test_stop_drains_first_then_sigterm_then_sigkill_for_a_worker_that_ignores_it():
    lines = Lines()
    specs = [fake("polite", "signal.signal(signal.SIGTERM, lambda *_: (print('draining', flush=True),"
                            " sys.exit(0))); ready(); time.sleep(60)"),
             fake("deaf", "signal.signal(signal.SIGTERM, signal.SIG_IGN); ready(); time.sleep(60)")]
    config = SupervisorConfig(stop_timeout_seconds=0.3)
    order: list[str] = []

    async def main():
        supervisor = Supervisor(specs, config, write=lines.append)

        async def drain():
            # the gateway drains while every worker still runs and none was signalled
            states = {s.state for s in supervisor.status()}
            pids = [s.pid for s in supervisor.status()]
            order.append(f"hook saw {sorted(x.value for x in states)}, alive {all(map(alive, pids))}")
            await trio.sleep(0.05)
            order.append("hook done")
        supervisor.add_before_stop(drain)
        events = supervisor.subscribe()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(supervisor.run)
            seen = await wait_for(events, 2, WorkerReady)
            pids = {e.name: e.pid for e in seen if isinstance(e, WorkerReady)}
            supervisor.stop()
            stopped_at = trio.current_time()
            exits = {e.name: (e, trio.current_time() - stopped_at) async for e in events
                     if isinstance(e, WorkerExited)}
        return pids, exits, supervisor.status()

    pids, exits, status = trio.run(main)
    assert order == ["hook saw ['running'], alive True", "hook done"]
    polite, polite_after = exits["polite"]
    deaf, deaf_after = exits["deaf"]
    assert polite.returncode == 0 and polite.restarting_in is None and polite_after < deaf_after
    assert deaf.returncode == -signal.SIGKILL and deaf_after >= 0.05 + 0.3
    assert lines.of("polite")[-1] == "draining"
    assert not alive(pids["polite"]) and not alive(pids["deaf"])
    assert all(s.state is WorkerState.STOPPED for s in status)


def test_a_hook_that_hangs_or_fails_does_not_keep_the_workers_running(caplog):
    specs = [fake("w0", SERVES)]
    config = SupervisorConfig(stop_timeout_seconds=0.2)

    async def hangs():
        await trio.sleep_forever()

    async def fails():
        raise RuntimeError("drain bug")

    async def main(hook):
        supervisor = Supervisor(specs, config, write=lambda line: None, before_stop=hook)
        events = supervisor.subscribe()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(supervisor.run)
            await wait_for(events, 1, WorkerReady)
            supervisor.stop()
            return [e async for e in events]

    with caplog.at_level(logging.WARNING, logger="xlaserve.supervisor"):
        for hook in (hangs, fails):
            exits = [e for e in trio.run(main, hook) if isinstance(e, WorkerExited)]
            assert [e.returncode for e in exits] == [-signal.SIGTERM]
    assert "did not finish within supervisor.stop_timeout_seconds (0.2 s)" in caplog.text
    assert "a before-stop hook failed" in caplog.text and "drain bug" in caplog.text


def test_a_worker_in_its_back_off_is_not_restarted_once_the_node_stops():
    specs = [fake("w0", "sys.exit(5)")]
    config = SupervisorConfig(restart_backoff_initial_seconds=30.0, restart_backoff_max_seconds=30.0)

    async def main():
        supervisor = Supervisor(specs, config, write=lambda line: None)
        events = supervisor.subscribe()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(supervisor.run)
            (_, exited) = await wait_for(events, 1, WorkerExited)
            assert exited.restarting_in == 30.0
            assert supervisor.status()[0].state is WorkerState.RESTARTING
            supervisor.stop()
            rest = [e async for e in events]
        return rest, trio.current_time()

    started = time.monotonic()
    rest, _ = trio.run(main)
    assert rest == [] and time.monotonic() - started < 5


def test_processes_a_worker_started_do_not_outlive_it(tmp_path, caplog):
    """A worker runs in a session of its own; what it starts (a hook's subprocess) is in its
    process group, and is killed once the worker has exited, instead of outliving the node."""
    pid_file = tmp_path / "child.pid"
    specs = [fake("w0", "import subprocess; child = subprocess.Popen(['sleep', '300']); "
                        f"open({str(pid_file)!r}, 'w').write(str(child.pid)); " + SERVES)]

    run_until_ready(specs, write=lambda line: None)
    child = int(pid_file.read_text())

    def running(pid: int) -> bool:      # a zombie (killed, its new parent not reaping) counts as ended
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().rpartition(")")[2].split()[0] != "Z"
        except FileNotFoundError:
            return False
    for _ in range(100):
        if not running(child):
            break
        time.sleep(0.02)
    assert not running(child)
    assert any("left processes of its own running; they were killed" in r.getMessage() for r in caplog.records)


def test_cancelling_the_supervisor_still_stops_its_workers():
    specs = [fake("w0", SERVES), fake("w1", SERVES)]

    async def main():
        supervisor = Supervisor(specs, FAST, write=lambda line: None)
        events = supervisor.subscribe()
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(supervisor.run)
                seen = await wait_for(events, 2, WorkerReady)
                scope.cancel()
        return [e.pid for e in seen if isinstance(e, WorkerReady)]

    pids = trio.run(main)
    assert len(pids) == 2 and not any(map(alive, pids))


def test_supervise_stops_on_sigterm_after_the_gateway_drained(tmp_path):
    node = node_of({"supervisor": {"stop_timeout_seconds": 1.0}, "logging": {"format": "json"}})
    lines = Lines()
    order: list[str] = []

    async def gateway(supervisor):
        async def drain():
            order.append("drain")
        supervisor.add_before_stop(drain)
        events = supervisor.subscribe()
        await wait_for(events, 2, WorkerReady)
        order.append("ready")
        os.kill(os.getpid(), signal.SIGTERM)       # handled by supervise: the node stops, exit 0
        async for event in events:
            if isinstance(event, WorkerExited):
                order.append(f"exited {event.name}")
        await trio.sleep_forever()                 # cancelled once the workers are stopped

    specs = [fake("w0", SERVES), fake("w1", SERVES)]
    code = trio.run(lambda: supervise(NODE_PATH, node, gateway=gateway, specs=specs, write=lines.append))
    assert code == 0
    assert order[:2] == ["ready", "drain"] and sorted(order[2:]) == ["exited w0", "exited w1"]
    assert {json.loads(line)["worker"] for line in lines} == {"w0", "w1"}


def test_a_subscriber_that_stops_reading_is_cut_off_not_buffered_forever(caplog, monkeypatch):
    monkeypatch.setattr("xlaserve.supervisor.MAX_PENDING_EVENTS", 3)
    specs = [fake("w0", "sys.exit(1)")]
    config = SupervisorConfig(restart_backoff_initial_seconds=0.0, restart_backoff_max_seconds=0.0,
                              max_restarts=3)

    async def main():
        supervisor = Supervisor(specs, config, write=lambda line: None)
        stalled = supervisor.subscribe()           # never read until the end
        reader = supervisor.subscribe()
        async with trio.open_nursery() as nursery:
            got: list = []

            async def read():
                async for event in reader:
                    got.append(event)
            nursery.start_soon(read)
            await supervisor.run()
        return [e async for e in stalled], got

    with caplog.at_level(logging.ERROR, logger="xlaserve.supervisor"):
        stalled, got = trio.run(main)
    assert len(stalled) == 3 and len(got) == 8    # 4 starts, 4 exits
    assert "left 3 unread; closing its channel" in caplog.text


def test_supervisor_refuses_duplicate_names():
    with pytest.raises(ValueError, match="distinct names"):
        Supervisor([fake("w", ""), fake("w", "")])


# --- output that never stalls the loop: the relay, and workers that print anything -------------------


class Drain:
    """Reads a pipe (a descriptor, or a file object it then closes) in a thread, from
    :meth:`start` until its end."""

    def __init__(self, pipe) -> None:
        self.pipe = pipe
        self.fd = pipe if isinstance(pipe, int) else pipe.fileno()
        self.data = bytearray()
        self._thread = threading.Thread(target=self._read, daemon=True)

    def start(self) -> Drain:
        self._thread.start()
        return self

    def _read(self) -> None:
        while chunk := os.read(self.fd, 1 << 16):
            self.data += chunk

    def lines(self) -> list[str]:
        self._thread.join(60)
        assert not self._thread.is_alive(), "the pipe did not end"
        if isinstance(self.pipe, int):
            os.close(self.pipe)
        else:
            self.pipe.close()
        return self.data.decode().splitlines()


def returns_within(seconds: float, fn):
    """``fn()`` run in a thread: a call that blocks fails the test instead of hanging it."""
    outcome: list = []

    def call():
        try:
            outcome.append((True, fn()))
        except BaseException as exc:
            outcome.append((False, exc))
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still blocked after {seconds} s"
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def test_a_stdout_nobody_reads_costs_counted_lines_never_the_loop_and_the_count_follows():
    read, write = os.pipe()
    drain = Drain(read)
    relay = LineRelay(write, stream="stdout", max_bytes=32 * 1024)
    total = 20_000       # 2 MB: far past the pipe's 64 KiB and the relay's 32 KiB
    line = "line {:05d} " + "x" * 90

    async def serving():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await trio.sleep(0.001)
                ticks += 1
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tick)
            for i in range(total):
                relay.put(line.format(i))
                if i % 100 == 99:
                    await trio.sleep(0.001)
            nursery.cancel_scope.cancel()
        return ticks

    try:
        ticks = returns_within(60, lambda: trio.run(serving, clock=MockClock(autojump_threshold=0)))
        stats = relay.statistics()
    finally:
        drain.start()                        # the reader resumes
    assert ticks >= total // 100 - 1         # the loop kept running beside the writes
    assert stats.dropped_lines > total // 2 and stats.buffered_bytes <= 32 * 1024
    assert stats.buffered_lines + stats.written_lines + stats.dropped_lines == total
    assert relay.flush(timeout=60)           # what was buffered, then the count of the gap
    relay.put("after the stall")
    assert relay.close(timeout=60)
    os.close(write)
    out = drain.lines()
    # the lines in order; in the place of each gap, the count of exactly the lines it lost
    notice = re.compile(r"xlaserve: (\d+) log lines? dropped: stdout was not being read")
    following, gaps = 0, []
    for entry in out[:-1]:
        if match := notice.fullmatch(entry):
            gaps.append(int(match.group(1)))
            following += gaps[-1]
        else:
            assert entry == line.format(following)
            following += 1
    assert following == total and out[-1] == "after the stall"
    assert gaps and sum(gaps) == stats.dropped_lines
    assert relay.statistics() == RelayStatistics(0, 0, total - sum(gaps) + 1, sum(gaps))


def test_a_stdout_that_keeps_up_gets_every_line_in_order():
    read, write = os.pipe()
    drain = Drain(read).start()
    relay = LineRelay(write, max_bytes=64 * 1024)
    for burst in range(100):
        for i in range(400):                 # a burst fits the buffer however slow the writer is
            relay.put(f"{burst}:{i} \ud800")  # a lone surrogate is written escaped, never an error
        assert relay.flush(timeout=60)
    assert relay.close()
    os.close(write)
    assert drain.lines() == [f"{b}:{i} \\ud800" for b in range(100) for i in range(400)]
    assert relay.statistics() == RelayStatistics(0, 0, 40_000, 0)


def test_a_reader_that_went_away_costs_counted_lines_and_a_long_entry_is_cut():
    read, write = os.pipe()
    relay = LineRelay(write, max_bytes=4096)
    os.close(read)                           # EPIPE from now on: lines are lost, counted
    for i in range(10):
        relay.put(f"lost {i}")
    assert relay.flush(timeout=60)
    assert relay.statistics().dropped_lines == 10 and relay.statistics().written_lines == 0
    relay.close()
    os.close(write)

    read, write = os.pipe()
    drain = Drain(read).start()
    with LineRelay(write, max_bytes=4096) as relay:
        relay.put("y" * 10_000)
    os.close(write)
    (entry,) = drain.lines()
    assert len(entry.encode()) == 4096 - ENTRY_OVERHEAD_BYTES - 1
    assert entry.endswith(f" [cut: log entry longer than {4096 - ENTRY_OVERHEAD_BYTES - 1} bytes]")


def test_the_supervisor_writes_worker_lines_to_stdout_by_default_losing_none(capfd):
    specs = [fake("w0", "for i in range(3000): print(i)\nsys.stdout.flush(); ready(); time.sleep(60)")]

    async def main():
        supervisor = Supervisor(specs, FAST)            # no write: this process's stdout, relayed
        events = supervisor.subscribe()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(supervisor.run)
            await wait_for(events, 1, WorkerReady)
            supervisor.stop()

    trio.run(main)
    assert capfd.readouterr().out.splitlines() == [f"[w0] {i}" for i in range(3000)]


def test_a_chunk_of_many_lines_is_relayed_in_turns_with_the_other_tasks():
    from xlaserve.supervisor import LINES_PER_TURN
    lines = Lines()
    supervisor = Supervisor([fake("w0", "")], FAST, write=lines.append)
    seen: list[int] = []

    async def main():
        send, receive = trio.testing.memory_stream_one_way_pair()
        await send.send_all(b"\n" * 65_536)      # one read of the pipe: 65,536 empty lines
        await send.aclose()
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(supervisor._relay_output, supervisor._workers[0], receive, done)
            while not done.is_set():               # another task of the loop (the gateway's)
                seen.append(len(lines))
                await trio.lowlevel.checkpoint()

    trio.run(main)
    assert len(lines) == 65_536
    # the other task ran between turns of LINES_PER_TURN lines (each turn it runs before or after
    # one step of the relay, so it sees at least every other step), not once after the 65,536
    between = {n for n in seen if 0 < n < 65_536}
    assert len(between) >= 65_536 // LINES_PER_TURN // 2 - 1
    assert all(n % LINES_PER_TURN == 0 for n in between)


# Runs supervise() as `xlaserve run` does (its logging on stderr), its stdout and stderr pipes that
# the test does not read: the workers print 2 MB each, then the node logs 2 MB of its own. Once
# both workers are ready (their pipes were read) and its records are logged, it writes "alive" to
# the report descriptor, waits for "go", and stops.
NODE_SCRIPT = """
import logging, os, sys, trio
from pathlib import Path
from xlaserve.config import parse_node_config
from xlaserve.supervisor import WorkerReady, WorkerSpec, supervise
logging.basicConfig(level=logging.INFO, format="%(message)s")
report, go, count = map(int, sys.argv[1:4])
prelude = sys.argv[4]
node = parse_node_config({"model_repo": "m", "supervisor": {"stop_timeout_seconds": 5}}, Path("/"))
code = prelude + f"for i in range({count}): print('w', i, 'x' * 90)\\nsys.stdout.flush(); ready(); time.sleep(60)"
specs = [WorkerSpec(f"w{n}", (sys.executable, "-c", code)) for n in range(2)]

async def gateway(supervisor):
    events = supervisor.subscribe()
    ready = 0
    async for event in events:
        ready += isinstance(event, WorkerReady)
        if ready == 2:
            break
    for i in range(count):
        logging.getLogger("xlaserve.gateway").info("own %d %s", i, "y" * 90)
        if i % 100 == 0:
            await trio.sleep(0)
    os.write(report, b"alive\\n")
    await trio.to_thread.run_sync(os.read, go, 1)
    supervisor.stop()
    await trio.sleep_forever()

sys.exit(trio.run(lambda: supervise(Path("/node.yaml"), node, gateway=gateway, specs=specs,
                                    handle_signals=False)))
"""


def test_a_node_whose_stdout_and_stderr_nobody_reads_keeps_serving_and_counts_what_it_dropped():
    count = 20_000
    report_read, report_write = os.pipe()
    go_read, go_write = os.pipe()
    child = subprocess.Popen([sys.executable, "-c", NODE_SCRIPT, str(report_write), str(go_read), str(count),
                              PRELUDE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             pass_fds=(report_write, go_read))
    os.close(report_write)
    os.close(go_read)
    out, err = Drain(child.stdout), Drain(child.stderr)
    try:
        alive = returns_within(60, lambda: os.read(report_read, 100))
    finally:
        out.start()
        err.start()
        os.write(go_write, b"g")
    assert alive == b"alive\n"               # it got there with neither pipe read
    assert child.wait(60) == 0
    os.close(report_read)
    os.close(go_write)
    stdout, stderr = out.lines(), err.lines()

    def dropped(lines: list[str], stream: str) -> int:
        notice = re.compile(rf"xlaserve: (\d+) log lines dropped: {stream} was not being read")
        counts = [int(m.group(1)) for m in map(notice.fullmatch, lines) if m]
        assert counts, f"no count of dropped lines on {stream}"
        return sum(counts)
    workers = [line for line in stdout if line.startswith("[w")]
    assert len(workers) + dropped(stdout, "stdout") == 2 * count
    own = [line for line in stderr if line.startswith("own ")]
    assert len(own) + dropped(stderr, "stderr") == count
    assert own[:3] == [f"own {i} {'y' * 90}" for i in range(3)]     # the first ones arrived


def test_whatever_a_worker_prints_or_closes_the_supervisor_goes_on(capfd, caplog):
    # invalid UTF-8, JSON nested past the recursion limit, a lone surrogate, 1 MiB without a
    # newline, a last line without one, a ready report of nested garbage, its output closed early
    code = """
out = sys.stdout.buffer
out.write(b'bad \\xff\\xfe utf-8 \\xc3\\n' + b'{"a":' + b'[' * 60000 + b'\\n' + b'{"m": "\\\\ud800"}\\n')
out.write(b'z' * (1 << 20) + b'\\n' + b'last words')
out.flush()
with open(int(os.environ['XLASERVE_READY_FD']), 'w') as f:
    f.write('[' * 4000 + '\\n')
os.close(1); os.close(2)
time.sleep(0.05)
os._exit(5)
"""
    config = SupervisorConfig(restart_backoff_initial_seconds=0.01, restart_backoff_max_seconds=0.01,
                              max_restarts=1, stop_timeout_seconds=2.0)

    async def main():
        supervisor = Supervisor([fake("w0", code)], config, log_format="json")
        return await supervisor.run(), supervisor.status()

    with caplog.at_level(logging.WARNING, logger="xlaserve.supervisor"):
        code_, status = trio.run(main)
    assert code_ == 1                        # it gave up after the restart, as for any crash
    assert status[0].restarts == 1 and status[0].last_returncode == 5
    entries = [json.loads(line) for line in capfd.readouterr().out.splitlines()]
    one_run = [{"worker": "w0", "message": "bad \ufffd\ufffd utf-8 \ufffd"},
               {"worker": "w0", "message": '{"a":' + "[" * 60_000},
               {"worker": "w0", "m": "\ud800"},
               {"worker": "w0", "message": "z" * MAX_LINE_BYTES + f" [cut: line longer than {MAX_LINE_BYTES} bytes]"},
               {"worker": "w0", "message": "last words"}]
    assert entries == one_run * 2, [str(entry)[:80] for entry in entries]
    assert caplog.text.count("unreadable ready report") == 2


def test_a_worker_that_closes_its_ready_descriptor_and_runs_on_is_named_once(caplog):
    """End-of-file on the ready pipe without a report, from a worker that does not exit: it will
    never report, so one warning names it; the other worker is served as ever."""
    specs = [fake("good", SERVES),
             fake("mute", "os.close(int(os.environ['XLASERVE_READY_FD'])); time.sleep(60)")]

    async def main():
        supervisor = Supervisor(specs, FAST, write=lambda line: None)
        events = supervisor.subscribe()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(supervisor.run)
            await wait_for(events, 1, WorkerReady)
            with trio.fail_after(10):
                while "closed its XLASERVE_READY_FD descriptor" not in caplog.text:
                    await trio.sleep(0.05)
            status = {s.name: s.state for s in supervisor.status()}
            supervisor.stop()
        return status

    with caplog.at_level(logging.WARNING, logger="xlaserve.supervisor"):
        status = trio.run(main)
    assert status == {"good": WorkerState.RUNNING, "mute": WorkerState.STARTING}
    warnings = [r.getMessage() for r in caplog.records if "READY_FD" in r.getMessage()]
    assert warnings == ["worker mute closed its XLASERVE_READY_FD descriptor without reporting that it "
                        "serves, and runs on; it stays starting"]


def test_a_worker_that_exits_without_a_ready_report_is_not_said_to_have_closed_it(caplog):
    with caplog.at_level(logging.WARNING, logger="xlaserve.supervisor"):
        code = trio.run(Supervisor([fake("w0", "time.sleep(0.05); sys.exit(3)")], FAST,
                                   write=lambda line: None).run)
    assert code == 1
    assert "descriptor without reporting" not in caplog.text


# --- the worker's side: the ready report and the child's command line --------------------------------


def test_a_worker_writes_its_ports_to_the_supervisors_descriptor_once():
    from xlaserve.supervisor import ready_writer
    read, write = os.pipe()
    report = ready_writer(None, str(write))
    report(7001, 7101)
    with os.fdopen(read) as pipe:
        assert json.loads(pipe.read()) == {"grpc_port": 7001, "http_port": 7101, "pid": os.getpid()}
    assert ready_writer(None, None) is None


def test_the_worker_command_accepts_the_count_gpus_auto_detected(tmp_path):
    node = tmp_path / "node.yaml"
    node.write_text(f"model_repo: {tmp_path / 'absent'}\n")      # gpus: auto, so one worker by itself
    base = [sys.executable, "-m", "xlaserve", "worker", str(node), "--worker", "worker2"]
    without = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert without.returncode == 2 and "no such worker (workers: worker0)" in without.stderr
    told = subprocess.run(base + ["--worker-count", "3"], capture_output=True, text=True, timeout=60)
    # it is worker2 of three now, and gets as far as its (absent) model repository
    assert told.returncode == 2 and "model_repo" in told.stderr and "no such worker" not in told.stderr


def test_the_node_files_logging_block_sets_the_level_and_format_unless_the_command_line_does():
    # in a child process: the test's own logging (pytest's capture) stays as it is
    script = """
import argparse, logging
from pathlib import Path
from xlaserve.cli import _logging, _node_logging
from xlaserve.config import parse_node_config
node = parse_node_config({"model_repo": "m", "logging": {"level": "warning", "format": "json"}}, Path("/"))
root = logging.getLogger()
for level, fmt in ((None, None), ("debug", None), ("error", "text")):
    _logging(level or "info", fmt or "text")
    _node_logging(argparse.Namespace(log_level=level, log_format=fmt), node)
    print(logging.getLevelName(root.level), type(root.handlers[0].formatter).__name__)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["WARNING JsonFormatter", "DEBUG JsonFormatter", "ERROR TextFormatter"]
    assert LoggingConfig() == LoggingConfig(level="info", format="text")


def _gone(pid: int) -> bool:
    """The process exited (a zombie not yet reaped by whoever adopted it counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_workers_stop_when_their_supervisor_is_killed(tmp_path):
    """SIGKILL (the OOM killer) leaves the supervisor no time to stop its workers, and they run
    in a session of their own, so no SIGHUP reaches them either: each reads the end of the pipe
    only the supervisor wrote to and stops, freeing its ports for the node's next start."""
    from benchmarks._servers import consecutive_free_pair, free_ports
    from benchmarks.gateway_bench import _child
    from tests.conftest import serve
    repo = tmp_path / "models"
    repo.mkdir()
    grpc0, grpc1 = free_ports(2)
    with serve(tmp_path, repo, wait_ready=False, metrics_base_port=consecutive_free_pair(),
               workers=[{"name": "a", "port": grpc0}, {"name": "b", "port": grpc1}]) as node:
        deadline = time.monotonic() + 60
        while node.log().count("INFO xlaserve.worker: serving:") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = [_child(node.process.pid, ["--worker", name]) for name in "ab"]
        node.process.kill()
        node.process.wait()
        deadline = time.monotonic() + 15
        while not all(map(_gone, workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [pid for pid in workers if not _gone(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert not left, f"workers {left} outlived their supervisor"


def test_a_gateway_address_in_use_is_one_line_naming_its_key_not_a_traceback(tmp_path):
    # the embedded gateway of a two-worker node, and the standalone gateway: as a worker's
    # address in use is (exit status 2, `xlaserve: cannot start: KEY ADDRESS: address already in use`)
    import socket

    from benchmarks._servers import consecutive_free_pair, free_ports
    (tmp_path / "models").mkdir()
    grpc0, grpc1 = free_ports(2)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        node = tmp_path / "node.yaml"
        node.write_text(json.dumps({
            "model_repo": str(tmp_path / "models"), "global": {"runtime": {"backend": "cpu"}},
            "listen": {"grpc": "127.0.0.1:0", "http": f"127.0.0.1:{port}"},
            "workers": [{"name": "a", "port": grpc0}, {"name": "b", "port": grpc1}],
            "metrics_base_port": consecutive_free_pair()}))
        gateway = tmp_path / "gateway.yaml"
        gateway.write_text(json.dumps({"listen": {"grpc": f"127.0.0.1:{port}", "metrics": "127.0.0.1:0"},
                                       "endpoints": ["127.0.0.1:1"]}))
        for command, expected in ((["run", str(node)], f"listen.http 127.0.0.1:{port}"),
                                  (["gateway", str(gateway)], f"listen.grpc 127.0.0.1:{port}")):
            done = subprocess.run([sys.executable, "-m", "xlaserve", *command], capture_output=True, text=True,
                                  timeout=60)
            assert done.returncode == 2, done.stderr
            assert f"xlaserve: cannot start: {expected}: address already in use" in done.stderr
            assert "Traceback" not in done.stderr


def test_a_worker_whose_supervisor_watch_fails_keeps_serving_until_a_signal(caplog):
    """The watch on the supervisor's pipe raising (its descriptor gone bad) ends the watch, not
    the worker: it serves on, and a signal still stops it."""
    from xlaserve.app.server import _stop_requested

    async def broken_watch() -> None:
        raise OSError(9, "Bad file descriptor")

    class Signals:          # what trio.open_signal_receiver gives: a SIGTERM 50 ms in
        def __aiter__(self):
            return self

        async def __anext__(self):
            await trio.sleep(0.05)
            return signal.SIGTERM

    async def main():
        with trio.fail_after(5):
            await _stop_requested(Signals(), broken_watch)
        return trio.current_time()

    assert trio.run(main) >= 0.05       # returned at the signal, not at the watch's failure
    assert any("cannot watch for this worker's supervisor exiting" in r.getMessage() for r in caplog.records)
