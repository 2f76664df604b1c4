"""The gateway against a worker whose status stream (WatchStatus) lies: byte counts below 0, a
catalog of new model names in every message. Each case runs the real :class:`Gateway`, in each
routing mode, in front of a well-behaved fake worker and the hostile one, and checks that the
gateway keeps running and serving the other worker's model, and that what it keeps per model stays
bounded by what the workers report now.

On Trio's autojump clock: discovery's and placement's intervals pass at once."""
from __future__ import annotations

import functools

import pytest
import trio
import trio.testing
from grpclib.const import Status

from tests.test_gateway_e2e import config as gateway_config
from tests.test_gateway_hostile_worker import WATCH_STATUS, WorkerConn, _fake_worker_serving_mlp, _infer_reply
from xlaserve._proto import xlaserve_control_pb2 as cpb
from xlaserve.frontend.grpc_protocol import RESPONSE_HEADERS, framed, trailers
from xlaserve.gateway.router import MODES
from xlaserve.gateway.run import Gateway, WorkerAddress
from xlaserve.http2.frames import DATA, END_HEADERS, END_STREAM, HEADERS, frame


def _reporting(statuses):
    """A fake worker's script: its n-th status message is ``statuses(n)``, one every 0.2 s;
    ModelInfer is answered, every other call UNIMPLEMENTED."""
    async def answer(conn: WorkerConn, req) -> None:
        await conn.reply(req.sid, _infer_reply("worker0"))
    return _fake_worker_serving_mlp("worker0", answer, statuses=statuses)


def _good(n: int) -> cpb.ModelControlStatusResponse:
    return cpb.ModelControlStatusResponse(worker="good", discipline="fifo", budget_bytes=1000, models=[
        cpb.ModelControl(name="mlp", state="READY", version=1, weight_bytes=10, residency="system")])


async def _gateway_over(nursery: trio.Nursery, mode: str, hostile) -> Gateway:
    """The gateway (``mode``) over worker0 (well-behaved, serving mlp) and worker1 (``hostile``)."""
    workers = []
    for i, statuses in enumerate((_good, hostile)):
        async def handler(stream: trio.SocketStream, script=_reporting(statuses)) -> None:
            try:
                await script(WorkerConn(stream))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
        workers.append(WorkerAddress(f"worker{i}", "127.0.0.1", listeners[0].socket.getsockname()[1]))
    gateway = Gateway(workers, gateway_config(mode))
    await nursery.start(gateway.run)
    return gateway


def _negative_budget(n: int) -> cpb.ModelControlStatusResponse:
    return cpb.ModelControlStatusResponse(worker="bad", discipline="fifo", budget_bytes=-1, models=[
        cpb.ModelControl(name="other", state="READY", version=1, weight_bytes=10, residency="system")])


def _negative_weights(n: int) -> cpb.ModelControlStatusResponse:
    return cpb.ModelControlStatusResponse(worker="bad", discipline="fifo", budget_bytes=1000, models=[
        cpb.ModelControl(name="mlp", state="READY", version=1, weight_bytes=-10, residency="system")])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("hostile", [_negative_budget, _negative_weights], ids=["budget", "weight_bytes"])
def test_a_worker_reporting_byte_counts_below_0_does_not_end_the_gateway(mode, hostile, caplog):
    # lpt_packing's packer refuses a size below 0, and its ValueError ended the whole gateway
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            gateway = await _gateway_over(nursery, mode, hostile)
            await trio.sleep(10)
            assert gateway.router.pick("mlp") in ("worker0", "worker1")
            assert gateway.ready_reason()[0], gateway.ready_reason()
            if mode == "lpt_packing":
                assert gateway.placement is not None and "mlp" in gateway.placement.workers_of
                assert all(b >= 0 for b in gateway._budgets.values())
                assert all(b >= 0 for b in gateway._weight_bytes.values())
            nursery.cancel_scope.cancel()
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    warned = [r.getMessage() for r in caplog.records if "below 0" in r.getMessage()]
    assert len(warned) == 1 and "worker1" in warned[0], warned


CATALOG = 200


def _new_names_every_time(n: int) -> cpb.ModelControlStatusResponse:
    return cpb.ModelControlStatusResponse(worker="bad", discipline="fifo", budget_bytes=1000, models=[
        cpb.ModelControl(name=f"m{n}-{i}", state="READY", version=1, weight_bytes=10, residency="system")
        for i in range(CATALOG)])


@pytest.mark.parametrize("mode", MODES)
def test_a_worker_reporting_new_model_names_in_every_status_does_not_grow_the_gateway(mode):
    # each status named 200 models never seen before: the gateway kept each one's size,
    # residency, capacity and replicas gauge for good (10 000 entries in 10 s)
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            gateway = await _gateway_over(nursery, mode, _new_names_every_time)
            for _ in range(4):
                await trio.sleep(5)
                for model in gateway.router.ready_models():
                    gateway.router.pick(model)          # a client calls each model it is shown
                gateway.routes()["/metrics"]()       # scraped now and then, as Prometheus does
            bound = CATALOG + 1          # one catalog of the hostile worker's, and mlp
            assert len(gateway.router.models()) <= bound
            assert len(gateway._weight_bytes) <= bound
            assert len(gateway._residency) <= bound
            assert len(gateway._capacity_asked) <= bound
            assert len(gateway.router._turn) <= bound
            _, _, page = gateway.routes()["/metrics"]()
            gauges = [line for line in page.decode().splitlines() if line.startswith("xlaserve_gateway_replicas{")]
            assert 1 <= len(gauges) <= bound, len(gauges)
            assert gateway.router.pick("mlp") == "worker0"
            nursery.cancel_scope.cancel()
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def _flooding(conn_statuses):
    """A fake worker's script that sends ``conn_statuses`` (serialized) as fast as the gateway reads."""
    async def script(conn: WorkerConn) -> None:
        await conn.handshake()
        while (req := await conn.request()) is not None:
            if req.path == WATCH_STATUS:
                await conn.send(frame(HEADERS, END_HEADERS, req.sid, RESPONSE_HEADERS))
                message = frame(DATA, 0, req.sid, framed(conn_statuses.SerializeToString()))
                while True:
                    await conn.send(message)
                    await trio.sleep(0.0001)
            else:
                await conn.send(frame(HEADERS, END_HEADERS | END_STREAM, req.sid,
                                      trailers(Status.UNIMPLEMENTED, f"{req.path} is not faked")))
    return script


def test_a_worker_sending_statuses_far_faster_than_asked_has_them_applied_at_most_every_status_gap():
    # 10 000 statuses a second: each was applied (the board re-serialized, the router rebuilt),
    # which held up the gateway's other work by the catalog's size each time
    from xlaserve.gateway import run as gateway_run

    status = _new_names_every_time(0)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, lambda s: _flooding(status)(WorkerConn(s)),
                                                              0, host="127.0.0.1"))
            gateway = Gateway([WorkerAddress("worker0", "127.0.0.1", listeners[0].socket.getsockname()[1])],
                              gateway_config("round_robin"))
            await nursery.start(gateway.run)
            await trio.sleep(1)
            start = gateway.board.generation
            await trio.sleep(5)
            applied = gateway.board.generation - start
            assert 5 / gateway_run.STATUS_GAP / 2 <= applied <= 5 / gateway_run.STATUS_GAP + 1, applied
            assert len(gateway.router.ready_models()) == CATALOG
            nursery.cancel_scope.cancel()
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def _names_no_bundle_has(n: int) -> cpb.ModelControlStatusResponse:
    return cpb.ModelControlStatusResponse(worker="bad", discipline="fifo", budget_bytes=1000, models=[
        cpb.ModelControl(name=name, state="READY", version=1, weight_bytes=10, residency="system")
        for name in ("fine", "two\nlines", "esc\x1b[2J", "../up", "x" * 300)])


def test_model_names_no_bundle_can_have_are_not_routed_to_and_warned_of_once(caplog):
    # a newline in a name faked a line in the gateway's log (the placement line lists names),
    # an ESC reached the terminal of whoever read it, and 64 KiB names made lines without end
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            gateway = await _gateway_over(nursery, "round_robin", _names_no_bundle_has)
            await trio.sleep(5)
            assert set(gateway.router.ready_models()) == {"mlp", "fine"}
            assert {m.name for m in gateway.board.latest()["worker1"].status.models} == {"fine"}
            nursery.cancel_scope.cancel()
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    warned = [r.getMessage() for r in caplog.records if "no bundle can have" in r.getMessage()]
    assert len(warned) == 1 and "worker1 reports 4 model name(s)" in warned[0], warned
    assert "\n" not in warned[0] and "\x1b" not in warned[0]


def test_a_model_config_that_fails_is_asked_again_after_a_pause_not_at_every_status():
    # the gateway learns each READY model's batch capacity from ModelConfig; one that failed was
    # asked again at the next status: a worker failing it for a catalog drew a call per model
    # per status (every 0.2 s here)
    from xlaserve.gateway import run as gateway_run
    asked: list[str] = []

    async def on_other(conn: WorkerConn, req) -> None:
        if req.path.endswith("/ModelConfig"):
            asked.append(req.path)
        await conn.send(frame(HEADERS, END_HEADERS | END_STREAM, req.sid, trailers(Status.INTERNAL, "no config")))

    async def answer(conn: WorkerConn, req) -> None:
        await conn.reply(req.sid, _infer_reply("worker0"))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            script = _fake_worker_serving_mlp("worker0", answer, on_other)

            async def handler(stream: trio.SocketStream) -> None:
                try:
                    await script(WorkerConn(stream))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
            gateway = Gateway([WorkerAddress("worker0", "127.0.0.1", listeners[0].socket.getsockname()[1])],
                              gateway_config("round_robin"))
            await nursery.start(gateway.run)
            await trio.sleep(2 * gateway_run.CAPACITY_RETRY_SECONDS + 1)
            assert gateway.router.pick("mlp") == "worker0"          # served all the same
            nursery.cancel_scope.cancel()
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert 2 <= len(asked) <= 3, len(asked)
