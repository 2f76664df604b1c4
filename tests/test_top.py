"""``xlaserve top``: the status arithmetic (rates, events, sorting) as pure functions, and the
Textual app driven by its pilot against a real worker: it shows "disconnected" until the worker
listens, then fills; its actions reach the worker; it shows the worker going away."""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from benchmarks._servers import free_port
from tests.conftest import infer_input, serve
from tui import connection
from tui.app import ConfirmScreen, HelpScreen, TopApp, ValueScreen, _number
from tui.connection import Address, next_backoff, parse_address
from tui.status import (COLUMNS, cells, changes, derive, human_bytes, json_ready, once_text, percentile, snapshot_dict,
                        spark, visible)
from xlaserve._proto import xlaserve_control_pb2 as pb
from xlaserve.cli import main

COLUMN_KEYS = [key for key, _ in COLUMNS]
# Every wait on the app or the worker is bounded: a broken dashboard fails, never hangs.
WAIT = 20.0


def _status(*models: pb.ModelControl, budget: int = 100, resident: int = 0) -> pb.ModelControlStatusResponse:
    return pb.ModelControlStatusResponse(models=models, worker="w0", backend="cpu",
                                         budget_bytes=budget, resident_bytes=resident)


def _model(name: str, **fields) -> pb.ModelControl:
    fields.setdefault("state", "READY")
    fields.setdefault("version", 1)
    return pb.ModelControl(name=name, **fields)


# ---- pure logic

def test_rates_come_from_counter_deltas_over_the_interval():
    before = _status(_model("a", requests=100, executions=10), _model("b", requests=5, executions=5))
    after = _status(_model("a", requests=160, executions=25, learned_cost_seconds={1: 0.001, 8: 0.004}),
                    _model("b", requests=5, executions=5), _model("c", requests=7, executions=1))
    worker, rows = derive(after, before, 2.0)
    a, b, c = rows
    assert (a.rows_per_second, a.rows_per_execution) == (30.0, 4.0)
    assert (a.cost_batch_size, a.cost_seconds) == (8, 0.004)
    assert (b.rows_per_second, b.rows_per_execution) == (0.0, None)   # idle: no executions to divide by
    assert (c.rows_per_second, c.rows_per_execution) == (None, None)  # new: no previous count
    assert worker.rows_per_second == 30.0
    assert a.latency_seconds is None and a.batch_mix == ()       # no answered-request counters moved


def test_latency_failures_and_batch_mix_come_from_counter_deltas():
    before = _status(_model("a", successes=10, success_seconds=1.0, queue_seconds=0.5, failures=1,
                            executions_by_batch_size={1: 4, 8: 2}))
    after = _status(_model("a", successes=30, success_seconds=1.6, queue_seconds=0.7, failures=5,
                           executions_by_batch_size={1: 4, 8: 4, 4: 3}))
    _, (row,) = derive(after, before, 2.0)
    assert row.latency_seconds == pytest.approx(0.03) and row.queue_wait_seconds == pytest.approx(0.01)
    assert row.failures_per_second == 2.0
    assert row.batch_mix == ((4, 3), (8, 2))
    assert (row.successes, row.failures) == (30, 5)
    first_worker, first = derive(after, None, None)
    assert first_worker.rows_per_second is None and all(r.rows_per_second is None for r in first)


def test_percentiles_interpolate_within_the_bucket_the_rank_falls_in():
    bounds = (0.001, 0.002, 0.005)
    assert percentile(bounds, [0, 10, 0, 0], 0.5) == pytest.approx(0.0015)   # halfway into (1, 2] ms
    assert percentile(bounds, [90, 0, 10, 0], 0.99) == pytest.approx(0.0047)  # 9 of 10 into (2, 5] ms
    assert percentile(bounds, [0, 0, 0, 3], 0.5) == 0.005                    # above the largest: at least it
    assert percentile(bounds, [0, 0, 0, 0], 0.5) is None                     # nothing answered
    assert percentile(bounds, [1, 2], 0.5) is None                           # a shape that does not fit


def test_p50_p99_share_and_thrashing_come_from_the_changes_over_the_interval():
    bounds = (0.001, 0.002, 0.005)
    before = pb.ModelControlStatusResponse(worker="w0", discipline="fair", latency_bucket_bounds=bounds, models=[
        _model("a", latency_bucket_counts=[5, 0, 0, 0], device_seconds=1.0, weight=3.0, weight_loads=4, evictions=3,
               rejections={"queue_full": 1}),
        _model("b", device_seconds=1.0, weight=1.0, weight_loads=1),
        _model("idle", device_seconds=0.5, weight=4.0)])
    after = pb.ModelControlStatusResponse(worker="w0", discipline="fair", latency_bucket_bounds=bounds, models=[
        _model("a", latency_bucket_counts=[5, 100, 0, 0], device_seconds=1.3, weight=3.0, weight_loads=6, evictions=5,
               rejections={"queue_full": 3, "deadline_expired": 2}),
        _model("b", device_seconds=1.1, weight=1.0, weight_loads=1, queue_depth=2),
        _model("idle", device_seconds=0.5, weight=4.0)])
    _, (a, b, idle) = derive(after, before, 2.0)
    # only the 100 answered in the interval count: all in (1, 2] ms
    assert (a.p50_seconds, a.p99_seconds) == (pytest.approx(0.0015), pytest.approx(0.00199))
    # 0.3 s of the device's 0.4 s; weight 3 of the busy models' 4 (idle neither ran nor waited)
    assert (a.device_share, a.weight_share) == (pytest.approx(0.75), pytest.approx(0.75))
    assert (b.device_share, b.weight_share) == (pytest.approx(0.25), pytest.approx(0.25))
    assert (idle.device_share, idle.weight_share) == (0.0, None)
    assert a.thrashing and not b.thrashing and (a.loads_delta, a.evictions_delta) == (2, 2)
    assert a.rejected_per_second == 2.0 and a.rejections == (("deadline_expired", 2), ("queue_full", 3))
    assert cells(a)[COLUMN_KEYS.index("weight_loads")] == "6/5!"
    assert cells(a)[COLUMN_KEYS.index("device_share")] == "75%/75%"
    # under fifo or edf weights do not share the device: no figure to compare with
    fifo = pb.ModelControlStatusResponse()
    fifo.CopyFrom(after)
    fifo.discipline = "fifo"
    _, (a, _, _) = derive(fifo, before, 2.0)
    assert (a.device_share, a.weight_share) == (pytest.approx(0.75), None)
    # the event log: the loads and evictions, and the rejections by reason
    texts = [e.text for e in changes(after, before)]
    assert texts == ["a: weights loaded onto the device 2x, evicted 2x", "a: rejected 2 deadline_expired, 2 queue_full"]


def test_spark_scales_to_the_largest_and_draws_nothing_for_an_idle_model():
    assert spark([0.0, 4.0, 8.0, 1.0]) == " ▄█▁"
    assert spark([0.0, 0.0]) == spark([]) == ""


def test_a_counter_going_down_gives_no_rate():
    # the worker restarted between two snapshots: its counters started again from 0
    _, (row,) = derive(_status(_model("a", requests=3, executions=1)),
                       _status(_model("a", requests=50, executions=9)), 1.0)
    assert row.rows_per_second is None and row.rows_per_execution is None


def test_events_are_appearances_state_changes_and_departures():
    first = _status(_model("a"), _model("b"))
    assert [e.text for e in changes(first, None)] == ["a: READY v1", "b: READY v1"]
    second = _status(_model("a", state="LOADING", version=2), _model("b", queue_depth=9, requests=40))
    assert [e.text for e in changes(second, first)] == ["a: READY v1 -> LOADING v2"]
    third = _status(_model("a", version=2, reason="reload failed, still serving version 2: bad"))
    assert [e.text for e in changes(third, second)] == [
        "a: LOADING v2 -> READY v2: reload failed, still serving version 2: bad", "b: gone"]


def test_visible_filters_by_name_and_sorts_with_missing_figures_last():
    before = _status(_model("alpha", requests=0), _model("beta", requests=0), _model("gamma"))
    after = _status(_model("alpha", requests=10, queue_depth=3), _model("beta", requests=30),
                    _model("gamma"), _model("Alps", queue_depth=1))
    _, rows = derive(after, before, 1.0)
    assert [r.name for r in visible(rows, "", "rows_per_second", True)] == ["beta", "alpha", "gamma", "Alps"]
    assert [r.name for r in visible(rows, "", "rows_per_second", False)] == ["gamma", "alpha", "beta", "Alps"]
    assert [r.name for r in visible(rows, "AL", "queue_depth", True)] == ["alpha", "Alps"]
    assert [r.name for r in visible(rows, "zzz", "name", False)] == []
    with pytest.raises(ValueError, match="unknown sort column 'nope'; expected one of worker, name, "):
        visible(rows, "", "nope", False)


def test_addresses():
    assert parse_address("localhost:8001") == Address("localhost", 8001)
    assert parse_address("example.org") == Address("example.org", 8001)
    assert parse_address("[::1]:9000") == Address("::1", 9000)
    assert str(parse_address("[::1]")) == "[::1]:8001"
    for bad, why in [("host:0", "the port must be 1-65535"), ("host:http", "the port must be 1-65535"),
                     (":8001", "no host"), ("::1", "an IPv6 address goes in brackets"),
                     ("[::1", "bad address"), ("[::1]x", "bad address"), ("", "no host")]:
        with pytest.raises(ValueError, match=why):
            parse_address(bad)


def test_backoff_doubles_up_to_its_cap():
    waits = [connection.INITIAL_BACKOFF_SECONDS]
    for _ in range(8):
        waits.append(next_backoff(waits[-1]))
    assert waits[:4] == [0.5, 1.0, 2.0, 4.0]
    assert waits[-1] == connection.MAX_BACKOFF_SECONDS


def test_policy_values_are_checked_before_they_are_sent():
    weight = _number(float, 0.0, positive=True)
    assert weight(" 2.5 ") == 2.5
    with pytest.raises(ValueError, match="must be > 0, got 0"):
        weight("0")
    with pytest.raises(ValueError, match="'x' is not a number"):
        weight("x")
    size = _number(int, 0)
    assert size("0") == 0
    with pytest.raises(ValueError, match="'1.5' is not an integer"):
        size("1.5")
    with pytest.raises(ValueError, match="must be >= 0, got -1"):
        size("-1")


def test_hook_failures_show_in_the_row_the_event_log_and_the_json():
    before = _status(_model("a", hook_failures={"postprocess": 2}))
    after = _status(_model("a", hook_failures={"postprocess": 5, "preprocess": 1}))
    _, (row,) = derive(after, before, 1.0)
    assert row.hook_failures == (("postprocess", 5), ("preprocess", 1))
    assert [e.text for e in changes(after, before)] == ["a: hook failures 3 postprocess, 1 preprocess"]
    assert changes(after, after) == ()
    assert snapshot_dict(after)["models"][0]["hook_failures"] == {"postprocess": 5, "preprocess": 1}


def test_snapshot_json_keeps_integers_as_numbers():
    data = snapshot_dict(_status(_model("a", weight_bytes=2**40, learned_cost_seconds={4: 0.5}), budget=2**41))
    assert data["budget_bytes"] == 2**41 and data["models"][0]["weight_bytes"] == 2**40
    assert data["models"][0]["learned_cost_seconds"] == {"4": 0.5}
    assert human_bytes(1536) == "1.5 KiB" and human_bytes(12) == "12 B"


# ---- the app against a real worker

@contextlib.asynccontextmanager
async def _serving(*args, **kwargs):
    """conftest's ``serve``, entered and left in a thread so the app's event loop keeps running."""
    context = serve(*args, **kwargs)
    server = await asyncio.to_thread(context.__enter__)
    try:
        yield server
    finally:
        await asyncio.to_thread(context.__exit__, None, None, None)


async def _until(app: TopApp, predicate) -> None:
    async with asyncio.timeout(WAIT):
        await app.wait_until(predicate)


def _row(app: TopApp, name: str):
    return next((r for r in app.rows if r.name == name), None)


async def _server_model(address: Address, name: str) -> pb.ModelControl:
    status = await connection.fetch_status(address)
    return {m.name: m for m in status.models}[name]


def _infer(url: str, count: int) -> None:
    client = grpcclient.InferenceServerClient(url)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    for _ in range(count):
        client.infer("simple", [infer_input("INPUT0", a, "INT32"), infer_input("INPUT1", a, "INT32")])
    client.close()


def _infer_at_once(url: str, count: int) -> None:
    """``count`` requests to ``simple`` sent together; returns once all are answered."""
    client = grpcclient.InferenceServerClient(url)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    answered = threading.Semaphore(0)
    errors: list = []

    def done(result, error) -> None:
        if error is not None:
            errors.append(error)
        answered.release()
    for _ in range(count):
        client.async_infer("simple", [infer_input("INPUT0", a, "INT32"), infer_input("INPUT1", a, "INT32")], done)
    for _ in range(count):
        assert answered.acquire(timeout=WAIT)
    client.close()
    assert not errors, errors


def test_dashboard_against_a_worker(examples_repo, tmp_path):
    asyncio.run(_dashboard(examples_repo, tmp_path))


async def _dashboard(repo, tmp_path) -> None:
    port = free_port()
    address = Address("127.0.0.1", port)
    app = TopApp(address, interval=0.1, max_backoff=0.2)
    async with app.run_test(size=(80, 24)) as pilot:
        # nothing listens there yet: the dashboard says so and keeps trying
        await _until(app, lambda: app.status_line.startswith("disconnected from 127.0.0.1:"))
        assert not app.connected and app.rows == ()
        async with _serving(tmp_path / "srv", repo, listen={"grpc": f"127.0.0.1:{port}",
                                                            "http": "127.0.0.1:0"}) as server:
            # ... until the worker comes up: the table fills
            # (every bundle is listed, LOADING, from the worker's first moment: wait for all ready)
            await _until(app, lambda: app.connected and len(app.rows) == 4
                         and all(row.state == "READY" for row in app.rows))
            table = app._table
            assert table.row_count == 4
            assert [str(cell) for cell in table.get_row("mlp")[:2]] == ["mlp", "READY"]
            assert app.status_line.startswith("connected worker0 cpu")
            assert "connected to 127.0.0.1:" in "\n".join(app.events)
            # 80x24: every model's row is on screen; a larger terminal gives the table the room
            small = table.size
            assert small.height >= 1 + 4
            await pilot.resize_terminal(160, 48)
            await pilot.pause()
            # the table takes the width; of the height, all but the 5 lines more that the detail
            # pane and the event log get at 40 lines and more
            assert (table.size.width, table.size.height) == (small.width + 80, small.height + 24 - 5)
            await pilot.resize_terminal(80, 24)
            await pilot.pause()

            # load: the rate of the model that ran moves
            await asyncio.to_thread(_infer, server.url, 20)
            await _until(app, lambda: (_row(app, "simple").rows_per_second or 0) > 0
                         and (_row(app, "simple").latency_seconds or 0) > 0
                         and _row(app, "simple").batch_mix != ())
            await _until(app, lambda: _row(app, "simple").requests == 20)
            assert _row(app, "simple").successes == 20 and _row(app, "simple").failures == 0
            await _until(app, lambda: _row(app, "simple").p99_seconds is not None)
            assert 0 < _row(app, "simple").p50_seconds <= _row(app, "simple").p99_seconds

            # the queue moves: with a batch hold of 1.5 s, 5 requests sent at once (fewer than its
            # largest batch, 8, which would end the hold) wait in the queue and are in flight,
            # then are answered together and the queue empties
            await connection.call(address, "SetModelPolicy", pb.SetModelPolicyRequest(
                model="simple", batch_delay_seconds=1.5))
            load = asyncio.create_task(asyncio.to_thread(_infer_at_once, server.url, 5))
            await _until(app, lambda: _row(app, "simple").queue_depth > 0 and _row(app, "simple").in_flight > 0)
            await load
            await _until(app, lambda: _row(app, "simple").queue_depth == 0 and _row(app, "simple").in_flight == 0)
            await connection.call(address, "SetModelPolicy", pb.SetModelPolicyRequest(
                model="simple", batch_delay_seconds=0.0))
            # the worker's new counters: 25 answered, their executions by batch size add up
            simple = await _server_model(address, "simple")
            assert simple.successes == 25 and simple.success_seconds > simple.queue_seconds >= 0
            assert sum(simple.executions_by_batch_size.values()) == simple.executions > 0

            # sort: reversed by name, simple comes first
            await pilot.press("S")
            assert table.coordinate_to_cell_key((0, 0)).row_key.value == "simple"

            # filter to mlp: it is the only row, and the model the actions apply to
            await pilot.press("slash", "m", "l", "enter")
            assert table.row_count == 1 and app.chosen().name == "mlp"

            # pin, confirmed: the worker pins it, and the table shows it
            await pilot.press("p")
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("y")
            await _until(app, lambda: app.last_answer == "SetModelResidency: mlp pinned (device)")
            assert (await _server_model(address, "mlp")).residency == "device"
            await _until(app, lambda: _row(app, "mlp").residency == "device")

            # unpin, declined: nothing is sent
            await pilot.press("u", "n")
            assert not isinstance(app.screen, ConfirmScreen)
            assert (await _server_model(address, "mlp")).residency == "device"
            # ... confirmed: unpinned
            await pilot.press("u", "y")
            await _until(app, lambda: app.last_answer == "SetModelResidency: mlp unpinned (system)")
            assert (await _server_model(address, "mlp")).residency == "system"

            # a weight: a bad value is refused in the dialog; a good one, confirmed, is set
            await pilot.press("w")
            dialog = app.screen
            assert isinstance(dialog, ValueScreen)
            dialog.query_one("Input").value = "-2"
            await pilot.press("enter")
            assert app.screen is dialog and "must be > 0" in str(dialog.query_one("#problem").render())
            dialog.query_one("Input").value = "3"
            await pilot.press("enter", "y")
            await _until(app, lambda: app.last_answer == "SetModelPolicy: mlp weight = 3")
            assert (await _server_model(address, "mlp")).weight == 3.0

            await pilot.press("c", "enter")      # enter confirms too
            await _until(app, lambda: app.last_answer.startswith("CompactMemory: done: "))

            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            help_text = str(app.screen.query_one("#help").render())
            for binding in app.BINDINGS:       # every key is on the help screen
                key = {"question_mark": "?", "slash": "/"}.get(binding.key, binding.key)
                assert f"\n{key} " in help_text or f" {key} " in help_text, binding.key
            await pilot.press("x")             # any key closes it, and does only that
            assert app.screen is app.screen_stack[0]
        # the worker drained and stopped: the dashboard says so, and keeps the last figures
        await _until(app, lambda: app.status_line.startswith("disconnected from 127.0.0.1:"))
        assert not app.connected and len(app.rows) == 4
        # (the stream ends with OK as the worker drains, or the connection closes first)
        assert any(" disconnected: " in e for e in app.events), list(app.events)
        assert server.process.returncode == 0, server.log()

        # the worker restarts on the same port (in explicit mode, nothing loaded): the
        # dashboard reconnects by itself and shows what changed while it was away
        async with _serving(tmp_path / "srv2", repo, {"model_control_mode": "explicit"}, wait_ready=False,
                            listen={"grpc": f"127.0.0.1:{port}", "http": "127.0.0.1:0"}):
            await _until(app, lambda: app.connected and app.rows == ())
            assert "mlp: gone" in "\n".join(app.events)
            # load, by name, confirmed: the worker loads it and the table shows it
            await pilot.press("l")
            dialog = app.screen
            assert isinstance(dialog, ValueScreen)
            dialog.query_one("Input").value = "mlp"
            await pilot.press("enter")
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("y")
            await _until(app, lambda: app.last_answer == "RepositoryModelLoad: mlp loaded")
            await _until(app, lambda: _row(app, "mlp") is not None and _row(app, "mlp").state == "READY")
            # unload the chosen model, confirmed
            await pilot.press("x", "y")
            await _until(app, lambda: app.last_answer == "RepositoryModelUnload: mlp unloaded")
            await _until(app, lambda: _row(app, "mlp") is None or _row(app, "mlp").state != "READY")
            # a load the worker refuses: its answer, shown
            await pilot.press("l")
            app.screen.query_one("Input").value = "no_such_model"
            await pilot.press("enter", "y")
            await _until(app, lambda: app.last_answer.startswith("RepositoryModelLoad refused: "))


def test_once_prints_one_snapshot(example_server, capsys):
    assert main(["top", "--once", "--json", example_server.url]) == 0
    snapshot = json.loads(capsys.readouterr().out)
    assert snapshot["worker"] == "worker0" and snapshot["backend"] == "cpu"
    models = {m["name"]: m for m in snapshot["models"]}
    assert set(models) == {"simple", "mlp", "img_mean", "cnn"}
    assert models["mlp"]["state"] == "READY" and models["mlp"]["weight_bytes"] > 0
    # the figures beyond ModelStatistics': one latency count per bucket and one above them
    assert len(models["mlp"]["latency_bucket_counts"]) == len(snapshot["latency_bucket_bounds"]) + 1
    assert snapshot["discipline"] == "fair" and snapshot["uptime_seconds"] > 0
    assert models["mlp"]["rejections"] == {} and models["mlp"]["in_flight"] == 0
    assert main(["top", "--once", example_server.url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("worker0 at 127.0.0.1:") and lines[1].split()[:3] == ["model", "state", "queue"]
    assert sorted(line.split()[0] for line in lines[2:]) == ["cnn", "img_mean", "mlp", "simple"]


def test_once_reports_an_unreachable_worker_and_bad_arguments(capsys, monkeypatch):
    port = free_port()      # nothing listens on it
    assert main(["top", "--once", "--json", f"127.0.0.1:{port}"]) == 1
    assert f"xlaserve top: cannot reach 127.0.0.1:{port}: " in capsys.readouterr().err

    async def refusing(address):
        from grpclib.const import Status
        from grpclib.exceptions import GRPCError
        raise GRPCError(Status.UNAVAILABLE, "draining\x1b[2J\x9b")

    monkeypatch.setattr(connection, "fetch_status", refusing)
    assert main(["top", "--once", "localhost:1"]) == 1
    # the peer's message is printed as text: an ESC in it never reaches the terminal
    assert capsys.readouterr().err == "xlaserve top: localhost:1 answered UNAVAILABLE: draining\\x1b[2J\\x9b\n"
    assert main(["top", "--once", "host:99999"]) == 2
    assert "bad address 'host:99999': the port must be 1-65535" in capsys.readouterr().err
    assert main(["top", "--json", "localhost:1"]) == 2
    assert "--json prints one snapshot; use it with --once" in capsys.readouterr().err
    assert main(["top", "--interval", "0.01", "localhost:1"]) == 2
    assert "--interval must be >= 0.05 s" in capsys.readouterr().err
    # a terminal that cannot draw a dashboard: refused with what to do instead
    monkeypatch.setenv("TERM", "dumb")
    assert main(["top", "localhost:1"]) == 2
    assert "TERM=dumb cannot draw a full-screen dashboard; use --once" in capsys.readouterr().err


@contextlib.contextmanager
def _not_a_worker():
    """A TCP port whose peer writes junk at every connection and hangs up: not HTTP/2."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        with contextlib.suppress(OSError):      # the listener closed: the test is over
            while True:
                peer, _ = listener.accept()
                with peer:
                    peer.sendall(b"SSH-2.0-not-grpc\r\n" * 64)
    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield Address("127.0.0.1", listener.getsockname()[1])
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(5)


def test_a_peer_that_is_not_a_worker(capsys):
    with _not_a_worker() as address:
        assert main(["top", "--once", "--json", str(address)]) == 1
        assert f"xlaserve top: cannot reach {address}: " in capsys.readouterr().err

        async def dashboard() -> None:
            app = TopApp(address, interval=0.1, max_backoff=0.1)
            async with app.run_test(size=(80, 24)):
                # it keeps trying, and says why it cannot watch: no crash, no traceback
                await _until(app, lambda: app.status_line.startswith(f"disconnected from {address}: ")
                             and "retrying in 0.1 s" in app.status_line)
                assert not app.connected and app.rows == ()
        asyncio.run(dashboard())


# ---- the layout, from fixed data (no server): a changed layout fails

SNAPSHOTS = Path(__file__).parent / "snapshots"
BOUNDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


def _fixed_worker(name: str, step: int) -> pb.ModelControlStatusResponse:
    """A worker's snapshot number ``step`` (0 or 1), one second apart: mlp busy and thrashing,
    cnn queued and rejecting, simple idle, img_mean failed to load."""
    buckets = [0] * (len(BOUNDS) + 1)
    buckets[2], buckets[3], buckets[6] = 400 * step, 90 * step, 10 * step
    mlp = _model("mlp", queue_depth=3 + step, in_flight=35, requests=1000 + 6400 * step,
                 executions=100 + 800 * step, successes=1000 + 500 * step, success_seconds=2.0 + 1.5 * step,
                 queue_seconds=0.5 + 0.4 * step, executions_by_batch_size={8: 90 + 790 * step, 1: 10 + 10 * step},
                 latency_bucket_counts=buckets, device_seconds=4.0 + 0.6 * step, weight=2.0,
                 learned_cost_seconds={1: 0.0004, 8: 0.0012}, residency="system", resident_bytes=1 << 20,
                 weight_bytes=1 << 20, weight_loads=10 + 3 * step, evictions=9 + 3 * step,
                 weight_misses=8 + 3 * step, eviction_rank=1)
    cnn = _model("cnn", queue_depth=12, in_flight=12, requests=50 + 10 * step, executions=50 + 10 * step,
                 successes=50 + 10 * step, success_seconds=5.0, device_seconds=1.0 + 0.2 * step, weight=1.0,
                 rejections={"queue_full": 4 + 6 * step}, residency="device", resident_bytes=5 << 20,
                 weight_bytes=5 << 20, weight_loads=1, max_batch_size=4)
    simple = _model("simple", residency="system", weight_bytes=128, weight=1.0)
    failed = _model("img_mean", state="UNAVAILABLE", version=0, reason="weights.safetensors is missing",
                    weight=1.0)
    return pb.ModelControlStatusResponse(
        models=[mlp, cnn, simple, failed], worker=name, backend="cpu", discipline="fair",
        budget_bytes=64 << 20, resident_bytes=6 << 20, latency_bucket_bounds=BOUNDS, in_flight=47,
        eviction_policy="gdsf",
        uptime_seconds=3725.0 + step, executable_cache={"hit": 7, "miss": 1, "rejected": 0})


def _fixed_source(gateway: bool):
    """A status stream of two snapshots a second apart (through a gateway: two workers'), then
    nothing more, as a quiet stream."""
    async def source(address, interval):
        for step in (0, 1):
            if gateway:
                for name in ("worker0", "worker1"):
                    yield pb.ModelControlStatusResponse(workers=[_fixed_worker(name, step)])
            else:
                yield _fixed_worker("worker0", step)
        await asyncio.Event().wait()
    return source


def _screen_text(app: TopApp) -> str:
    """What the terminal shows, as text: the layout without its colours (which follow the
    terminal; see docs/top.md)."""
    return "\n".join(strip.text.rstrip() for strip in app.screen._compositor.render_strips()) + "\n"


async def _fixed_app(size: tuple[int, int], gateway: bool, svg: Path | None = None) -> str:
    # the clock is read once per worker snapshot: a round of them is one second on
    ticks = iter([0.0, 0.0, 1.0, 1.0] if gateway else [0.0, 1.0])
    app = TopApp(Address("10.0.0.7", 8001), interval=1.0, source=_fixed_source(gateway),
                 clock=lambda: next(ticks), stamp=lambda: "12:00:00")
    async with app.run_test(size=size) as pilot:
        await _until(app, lambda: len(app.rows) == (8 if gateway else 4)
                     and all(r.rows_per_second is not None for r in app.rows))
        # the rows are in; their paint may lag on a loaded machine: wait for the screen to show
        # the second snapshot's figures and to stop changing
        async with asyncio.timeout(WAIT):
            before, shown = None, _screen_text(app)
            while "75%/67%" not in shown or shown != before:
                await pilot.pause()
                before, shown = shown, _screen_text(app)
        if svg is not None:
            svg.write_text(app.export_screenshot(title="xlaserve top"))
        return _screen_text(app)


@pytest.mark.parametrize("size, gateway", [((80, 24), False), ((160, 48), False), ((160, 48), True)])
def test_layout_matches_its_reference(size, gateway):
    """The screen at 80x24 and 160x48 (and a gateway's two workers at 160x48) against the text
    committed under tests/snapshots/. After a deliberate layout change, regenerate them with
    ``XLASERVE_UPDATE_SNAPSHOTS=1 pytest tests/test_top.py -k layout`` and review the diff."""
    name = f"top-{'gateway-' if gateway else ''}{size[0]}x{size[1]}.txt"
    text = asyncio.run(_fixed_app(size, gateway))
    reference = SNAPSHOTS / name
    if os.environ.get("XLASERVE_UPDATE_SNAPSHOTS"):
        reference.write_text(text)
    assert text == reference.read_text(), f"the layout changed; compare with {reference}"
    # what any layout must show: mlp's device share over the update against its weight's due
    # (0.6 s of 0.8 s; weight 2 of the busy models' 3), loads/evictions marked as thrashing
    assert "75%/67%" in text and "13/12!" in text
    if gateway:
        assert text.count("worker0") >= 5 and text.count("worker1") >= 5    # each row labelled


def test_a_gateway_worker_that_goes_quiet_is_marked_silent_and_keeps_its_rows():
    async def source(address, interval):
        for step in range(6):
            names = ("worker0", "worker1") if step < 2 else ("worker0",)     # worker1 stops at 1 s
            for name in names:
                yield pb.ModelControlStatusResponse(workers=[_fixed_worker(name, min(step, 1))])
        await asyncio.Event().wait()
    ticks = iter([0.0, 0.0, 1.0, 1.0, 2.0, 3.0, 4.0, 5.0])

    async def run() -> None:
        app = TopApp(Address("10.0.0.7", 8001), interval=1.0, source=source, clock=lambda: next(ticks),
                     stamp=lambda: "12:00:00")
        async with app.run_test(size=(160, 48)):
            await _until(app, lambda: "silent 4 s" in app.status_line)
            lines = app.status_line.splitlines()
            assert lines[1].startswith("worker0 cpu fair  budget") and "silent" not in lines[1]
            assert lines[2].startswith("worker1 cpu fair  silent 4 s  budget")
            assert len(app.rows) == 8          # its rows stay, with their last figures
    asyncio.run(run())


def test_a_status_whose_uptime_is_no_number_is_shown_not_a_crash():
    """NaN or an infinite uptime from a hostile or broken peer: int() of it raised, ending
    ``xlaserve top --once`` with a traceback and the dashboard with its watch worker."""
    for uptime in (math.nan, math.inf, -math.inf):
        status = _status(_model("a"))
        status.uptime_seconds = uptime
        assert ", up -" in once_text(status, "w:1")

        async def run() -> None:
            app = TopApp(Address("10.0.0.7", 8001), interval=1.0, source=_fixed_statuses(status))
            async with app.run_test(size=(120, 30)):
                await _until(app, lambda: "up -" in app.status_line)
                assert [r.name for r in app.rows] == ["a"]
        asyncio.run(run())


def test_a_status_naming_a_model_twice_is_shown_not_a_crash():
    """Two models of one name (in one worker's status, or through a gateway 'a/b' + 'c' and 'a' +
    'b/c'): the table's second row of one key raised DuplicateKey and ended the dashboard."""
    twice = _status(_model("a"), _model("a", state="LOADING"), _model("b"))
    through_gateway = (pb.ModelControlStatusResponse(workers=[pb.ModelControlStatusResponse(
                           worker="a/b", models=[_model("c")])]),
                       pb.ModelControlStatusResponse(workers=[pb.ModelControlStatusResponse(
                           worker="a", models=[_model("b/c")])]))
    for statuses, shown in (((twice,), 2), (through_gateway, 1)):
        async def run() -> None:
            app = TopApp(Address("10.0.0.7", 8001), interval=1.0, source=_fixed_statuses(*statuses))
            async with app.run_test(size=(120, 30)) as pilot:
                await _until(app, lambda: len(app.rows) == 3 if len(statuses) == 1 else len(app.worker_views) == 2)
                await pilot.pause()
                assert app.query_one("#models").row_count == shown and app.return_code is None
        asyncio.run(run())


def _fixed_statuses(*statuses: pb.ModelControlStatusResponse):
    async def source(address, interval):
        for status in statuses:
            yield status
        await asyncio.Event().wait()
    return source


def test_misses_per_request_and_eviction_rank_show_in_the_row_and_the_json():
    before = _status(_model("a", successes=100, failures=0, weight_misses=10, eviction_rank=2),
                     _model("pinned", successes=5, weight_misses=0))
    after = _status(_model("a", successes=130, failures=10, weight_misses=20, eviction_rank=1),
                    _model("pinned", successes=5, weight_misses=0), _model("new", weight_misses=4, eviction_rank=3))
    after.eviction_policy = "gdsf"
    _, (a, pinned, new) = derive(after, before, 1.0)
    # 10 misses over the 40 requests answered (30 OK, 10 failed) in the update
    assert (a.weight_misses, a.misses_per_request, a.eviction_rank, a.eviction_policy) == (20, 0.25, 1, "gdsf")
    assert (pinned.misses_per_request, pinned.eviction_rank) == (None, None)    # nothing answered; not evictable
    assert (new.misses_per_request, new.eviction_rank) == (None, 3)             # no previous snapshot
    assert cells(a)[COLUMN_KEYS.index("misses_per_request")] == "0.25"
    assert cells(a)[COLUMN_KEYS.index("eviction_rank")] == "1"
    assert cells(pinned)[COLUMN_KEYS.index("eviction_rank")] == "-"
    # sorting by rank puts the next victim first and the models that cannot be evicted last
    assert [r.name for r in visible((a, pinned, new), "", "eviction_rank", False)] == ["a", "new", "pinned"]
    data = snapshot_dict(after)
    assert data["eviction_policy"] == "gdsf"
    assert [(m["weight_misses"], m["eviction_rank"]) for m in data["models"]] == [(20, 1), (0, 0), (4, 3)]


def test_a_peers_control_characters_are_shown_as_text_never_sent_to_the_terminal():
    """Names, reasons and map keys come from the worker or gateway at the other end: an ESC in
    one was printed raw by ``--once`` and the dashboard (a peer could move the cursor, clear the
    screen or retitle the window). Every status received is made displayable first."""
    from tui.connection import displayable
    status = displayable(pb.ModelControlStatusResponse(
        worker="w\x1b]0;owned\x07", models=[_model("m\x1b[2J", reason="bad\r\nline", rejections={"q\x1bx": 3})],
        workers=[pb.ModelControlStatusResponse(worker="\x9bz")]))
    assert status.worker == "w\\x1b]0;owned\\x07" and status.workers[0].worker == "\\x9bz"
    assert (status.models[0].name, status.models[0].reason) == ("m\\x1b[2J", "bad\\x0d\\x0aline")
    assert dict(status.models[0].rejections) == {"q\\x1bx": 3}
    text = once_text(displayable(pb.ModelControlStatusResponse(worker="w\x1b[2J", models=[_model("m\x1b[2J")])),
                     "host:1")
    assert "m\\x1b[2J" in text and not any(ord(c) < 32 and c != "\n" for c in text)


def test_a_peers_error_messages_and_answers_are_shown_without_their_control_characters(monkeypatch):
    """A refusal's message (a gRPC status message), the reason a stream ended and CompactMemory's
    answer come from the peer too, outside the statuses displayable() cleans: an ESC in one went
    to the header, the event log and the notification as it was."""
    from grpclib.const import Status
    from grpclib.exceptions import GRPCError
    fail = asyncio.Event()

    async def source(address, interval):
        yield pb.ModelControlStatusResponse(worker="w", models=[_model("m")])
        await fail.wait()
        raise GRPCError(Status.UNAVAILABLE, "gone\x1b[2J\x07")

    async def refuse(address, method, request):
        raise GRPCError(Status.INTERNAL, "no\x1b]0;owned\x07")

    monkeypatch.setattr(connection, "call", refuse)

    async def run() -> None:
        app = TopApp(Address("10.0.0.7", 8001), interval=1.0, source=source, max_backoff=60.0)
        async with app.run_test(size=(200, 50)) as pilot:
            await _until(app, lambda: len(app.rows) == 1)
            app._send("CompactMemory", pb.CompactMemoryRequest(), "done")
            await _until(app, lambda: app.last_answer != "")
            assert app.last_answer == "CompactMemory refused: INTERNAL: no\\x1b]0;owned\\x07"
            fail.set()
            await _until(app, lambda: not app.connected)
            await pilot.pause()
            assert "UNAVAILABLE: gone\\x1b[2J\\x07; " in app.status_line
            logged = "\n".join(app.events)
            assert "no\\x1b]0;owned" in logged and "gone\\x1b[2J" in logged
            assert not any(c in logged + app.status_line for c in "\x1b\x07")
    asyncio.run(run())


# Peer text that Textual or Rich would read as markup: a style, the auto-closing tag, a link
# (whose value Textual's parser rejects), an unbalanced bracket, a Textual variable and a tag
# that textual.markup.escape leaves alone, and a trailing backslash (which escaping doubled).
MARKUP = ["[bold]x[/bold]", "[/]", "[link=http://evil]", "[", "[$accent]", "[B]y[/B]", "z\\"]


@pytest.mark.parametrize("text", MARKUP)
@pytest.mark.parametrize("gateway", [False, True])
def test_a_peers_markup_is_shown_as_text_never_read_as_markup(text, gateway):
    """Model, worker and backend names, states, reasons, rejection reasons and hook names come
    from the worker or gateway at the other end. Put into the header, the detail pane and the
    table as markup, '[/]', a link or a lone '[' raised MarkupError and ended the dashboard, and
    '[bold]x[/bold]' or '[$accent]' restyled the pane and vanished from it (the rejection reasons
    and hook names were not escaped at all; Textual's escape misses '[$accent]' and '[B]')."""
    from grpclib.const import Status
    from grpclib.exceptions import GRPCError
    from textual.widgets import Label, Static
    worker = pb.ModelControlStatusResponse(
        worker=f"w{text}", backend=f"cpu{text}", discipline=f"fair{text}", eviction_policy=f"gdsf{text}",
        budget_bytes=100, models=[_model(f"m{text}", state=f"READY{text}", reason=f"r{text}",
                                         residency=f"system{text}", eviction_rank=1, rejections={f"q{text}": 3},
                                         hook_failures={f"h{text}": 2})])
    fail = asyncio.Event()

    async def source(address, interval):
        yield pb.ModelControlStatusResponse(workers=[worker]) if gateway else worker
        await fail.wait()
        raise GRPCError(Status.UNAVAILABLE, f"gone{text}")

    async def run() -> None:
        app = TopApp(Address("10.0.0.7", 8001), interval=1.0, source=source, max_backoff=60.0)
        async with app.run_test(size=(200, 50)) as pilot:
            await _until(app, lambda: len(app.rows) == 1)
            await pilot.pause()
            assert app.return_code is None
            detail = app.query_one("#detail", Static).visual
            on = f" on w{text}" if gateway else ""
            assert detail.plain.splitlines()[:3] == [
                f"m{text}{on} READY{text} v1", f"reason: r{text}",
                f"residency system{text}: 0 B of 0 B on the device; loads/evictions 0/0"]
            assert f"eviction rank 1 (gdsf{text}): next to go" in detail.plain
            assert detail.plain.endswith(f"rejected: 3 q{text}; hook failures: 2 h{text}")
            # the styles are the dashboard's own: the name in bold, the warning in red, nothing else
            assert {str(span.style) for span in detail.spans} == {"b", "b red"}
            assert detail.plain[slice(*next((s.start, s.end) for s in detail.spans if str(s.style) == "b"))] \
                == f"m{text}"
            assert f"w{text} cpu{text} fair{text}  budget" in app.status_line
            cells = [str(cell) for cell in app.query_one("#models").get_row_at(0)]
            assert cells[:2] == [f"m{text}", f"READY{text}"]
            assert f"m{text}" in _screen_text(app)
            fail.set()
            await _until(app, lambda: not app.connected)
            await pilot.pause()
            assert app.status_line.startswith(f"disconnected from 10.0.0.7:8001: UNAVAILABLE: gone{text}; ")
            assert app.return_code is None
            # what an operator types comes back in the dialog's complaint, as typed
            app.push_screen(ValueScreen("weight", "", _number(float, 0.0)))
            await pilot.pause()
            app.screen.query_one("#value").value = text
            await pilot.press("enter")
            await pilot.pause()
            assert app.screen.query_one("#problem", Label).visual.plain == f"{text!r} is not a number"
    asyncio.run(run())


def test_once_json_is_strict_json_whatever_numbers_a_peer_sent():
    import json
    data = json_ready(snapshot_dict(pb.ModelControlStatusResponse(uptime_seconds=math.nan,
                                                                  models=[_model("a", device_seconds=math.inf)])))
    assert data["uptime_seconds"] is None and data["models"][0]["device_seconds"] is None
    json.loads(json.dumps(data, allow_nan=False))       # NaN and Infinity were written bare


def test_hook_threads_held_by_user_code_are_named_on_the_workers_line_red_once_they_starve_the_rest():
    """The worker's status says how many hook and meta threads run user code and how many
    requests wait for one: the worker's line names a pool with a thread busy, and in the
    dashboard turns it red when every thread is held and requests wait (hung hooks starving
    every hooked model). An idle pool says nothing."""
    idle = pb.ModelControlStatusResponse(worker="w", hook_threads=16, meta_threads=64, models=[_model("m")])
    assert "threads" not in once_text(idle, "host:1")
    busy = pb.ModelControlStatusResponse(worker="w", hook_threads=16, hook_threads_busy=16, hook_requests_waiting=3,
                                         meta_threads=64, meta_threads_busy=2, models=[_model("m")])
    assert "hook threads 16/16 busy, 3 waiting; meta threads 2/64 busy" in once_text(busy, "host:1")
    fail = asyncio.Event()

    async def source(address, interval):
        yield busy
        await fail.wait()

    async def run() -> None:
        app = TopApp(Address("10.0.0.7", 8001), interval=1.0, source=source, max_backoff=60.0)
        async with app.run_test(size=(200, 50)):
            await _until(app, lambda: len(app.rows) == 1)
            assert "hook threads 16/16 busy, 3 waiting; meta threads 2/64 busy" in app.status_line
            header = app._header.visual
            red = [header.plain[span.start:span.end] for span in header.spans if str(span.style) == "b red"]
            assert red == ["hook threads 16/16 busy, 3 waiting; meta threads 2/64 busy"], red
            fail.set()
    asyncio.run(run())
