"""``xlaserve top`` pointed at a gateway: the gateway's WorkerControl service
(xlaserve/gateway/control.py) streams every worker's status from discovery's own subscription,
paced per dashboard, and routes the control calls to the worker named; the dashboard shows both
workers' models, labelled, and its actions reach the worker of the chosen row."""
from __future__ import annotations

import asyncio
import json
from contextlib import ExitStack

import pytest
import trio
import trio.testing
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from tests.conftest import serve
from tests.test_gateway_e2e import config, gateway_over
from tests.test_top import _until
from tui import connection
from tui.app import ConfirmScreen, TopApp
from tui.connection import Address
from xlaserve._proto import xlaserve_control_pb2 as pb
from xlaserve.cli import main
from xlaserve.gateway.control import GatewayControlService, StatusBoard


# ---- the service, on a board fed by hand (no sockets)

class _Stream:
    """A grpclib-shaped stream in memory: one request in, the replies collected."""

    def __init__(self, request) -> None:
        self._request = request
        self.sent: list[pb.ModelControlStatusResponse] = []

    async def recv_message(self):
        return self._request

    async def send_message(self, message) -> None:
        self.sent.append(pb.ModelControlStatusResponse.FromString(message.SerializeToString()))


def _worker_status(name: str, requests: int) -> pb.ModelControlStatusResponse:
    # the worker's own name, which the gateway replaces with its name for the worker
    return pb.ModelControlStatusResponse(worker="its-own-name", backend="cpu",
                                         models=[pb.ModelControl(name=f"m-{name}", requests=requests)])


def test_watch_status_sends_each_workers_latest_at_most_once_an_interval_and_ends_on_drain():
    async def main_():
        board, draining = StatusBoard(), trio.Event()
        service = GatewayControlService({}, board, draining)
        board.publish("w1", _worker_status("w1", 0))
        stream = _Stream(pb.WatchStatusRequest(interval_seconds=2.0))
        ended = trio.Event()

        async def watch():
            await service.__mapping__()["/xlaserve.control.WorkerControl/WatchStatus"].func(stream)
            ended.set()

        async def discovery():
            # what the gateway's discovery does: each worker's snapshot every 0.5 s (snapshot k
            # at 0.5k - 0.25 s, between the stream's rounds); w2's stream ends at 4.75 s
            await trio.sleep(0.25)
            for tick in range(1, 41):
                if tick > 1:
                    await trio.sleep(0.5)
                board.publish("w1", _worker_status("w1", tick))
                if tick < 10:
                    board.publish("w2", _worker_status("w2", tick))
                elif tick == 10:
                    board.forget("w2")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            nursery.start_soon(discovery)
            await trio.sleep(20.25)
            draining.set()
            with trio.fail_after(0.1):
                await ended.wait()          # at once, not at the next interval
        sent = stream.sent
        assert all(len(m.workers) == 1 and not m.models for m in sent)   # one worker's per message
        by_worker: dict[str, list[int]] = {}
        for m in sent:
            (one,) = m.workers
            by_worker.setdefault(one.worker, []).append(one.models[0].requests)
        # w1: its latest at once, then one every 2 s (the latest then), never faster: 11 in 20 s
        assert by_worker["w1"] == [0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40]
        # w2: until its stream ended, never again after
        assert by_worker["w2"] == [4, 8]
        # the board's status of a worker carries the gateway's name for it
        assert {m.workers[0].worker for m in sent} == {"w1", "w2"}
    trio.run(main_, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_change_names_an_unknown_worker_or_model_precisely():
    async def main_():
        board = StatusBoard()
        board.publish("w1", _worker_status("w1", 0))
        service = GatewayControlService({"w1": None}, board, trio.Event())    # no call reaches a worker
        handlers = service.__mapping__()
        residency = handlers["/xlaserve.control.WorkerControl/SetModelResidency"].func
        with pytest.raises(GRPCError) as unknown_worker:
            await residency(_Stream(pb.SetModelResidencyRequest(model="m-w1", residency="device", worker="w9")))
        assert unknown_worker.value.status is Status.NOT_FOUND
        assert unknown_worker.value.message == "the gateway fronts no worker 'w9' (its workers: w1)"
        with pytest.raises(GRPCError) as unknown_model:
            await residency(_Stream(pb.SetModelResidencyRequest(model="nope", residency="device")))
        assert unknown_model.value.status is Status.NOT_FOUND
        assert unknown_model.value.message == "no worker reports model 'nope' (known models: m-w1)"
        status = _Stream(pb.ModelControlStatusRequest())
        await handlers["/xlaserve.control.WorkerControl/ModelControlStatus"].func(status)
        (reply,) = status.sent
        assert [w.worker for w in reply.workers] == ["w1"] and not reply.models
    trio.run(main_)


# ---- the dashboard against a real gateway over two real workers

def test_top_against_a_two_worker_gateway(example_server, examples_repo, tmp_path, capsys):
    with ExitStack() as stack:
        # worker0: the session's shared example server (only read); worker1: this test's own
        second = stack.enter_context(serve(tmp_path / "w1", examples_repo))
        gateway = gateway_over(stack, [example_server, second], config("round_robin"))
        gateway.wait_ready(models=4)
        host, port = gateway.url.rsplit(":", 1)
        address = Address(host, int(port))
        asyncio.run(_dashboard(address, example_server, second))

        # --once through the gateway: every worker's snapshot
        assert main(["top", "--once", "--json", gateway.url]) == 0
        snapshot = json.loads(capsys.readouterr().out)
        assert [w["worker"] for w in snapshot["workers"]] == ["worker0", "worker1"]
        assert all({m["name"] for m in w["models"]} == {"simple", "mlp", "img_mean", "cnn"}
                   for w in snapshot["workers"])
        assert main(["top", "--once", gateway.url]) == 0
        text = capsys.readouterr().out
        assert text.startswith("worker0 at ") and "\nworker1 at " in text


async def _dashboard(address: Address, first, second) -> None:
    app = TopApp(address, interval=0.2, max_backoff=0.2)
    async with app.run_test(size=(160, 48)) as pilot:
        # both workers' models, each row labelled by its worker
        await _until(app, lambda: app.gateway and len(app.rows) == 8)
        assert sorted(app.worker_views) == ["worker0", "worker1"]
        table = app._table
        assert [str(cell) for cell in table.get_row("worker1/mlp")[:3]] == ["worker1", "mlp", "READY"]
        assert [str(cell) for cell in table.get_row("worker0/mlp")[:3]] == ["worker0", "mlp", "READY"]
        assert "gateway" in app.status_line and "worker1 cpu fair" in app.status_line

        # pin mlp on worker1 (the row chosen): worker1 pins it, worker0 does not
        await pilot.press("slash", *"worker1", "enter")      # the filter matches worker names too
        assert table.row_count == 4
        keys = [table.coordinate_to_cell_key((i, 0)).row_key.value for i in range(table.row_count)]
        table.move_cursor(row=keys.index("worker1/mlp"))
        await pilot.pause()
        assert app.chosen().worker == "worker1" and app.chosen().name == "mlp"
        await pilot.press("p")
        assert isinstance(app.screen, ConfirmScreen)
        assert "on worker1" in app.screen.question
        await pilot.press("y")
        await _until(app, lambda: app.last_answer == "SetModelResidency: mlp on worker1 pinned (device)")
        # each worker asked directly (the gateway's status is discovery's, up to 0.5 s old)
        for server, expected in ((second, "device"), (first, "system")):
            status = await connection.fetch_status(Address("127.0.0.1", server.grpc_port))
            assert next(m.residency for m in status.models if m.name == "mlp") == expected
        await _until(app, lambda: next(r for r in app.rows if r.worker == "worker1" and r.name == "mlp")
                     .residency == "device")

        # compact through the gateway: worker1's answer, named
        await pilot.press("c", "y")
        await _until(app, lambda: app.last_answer.startswith("CompactMemory: done: worker1: "))
