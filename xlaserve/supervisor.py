"""The supervisor of a multi-worker node: one child process per worker, their output on one
stream, restarts with a capped back-off, and an orderly stop.

:class:`Supervisor` runs the processes a sequence of :class:`WorkerSpec` describes (for a node
file, :func:`worker_specs`: ``python -m xlaserve worker NODE --worker NAME`` per worker);
:func:`supervise` is the entry point that also runs the gateway beside it. What the supervisor
decides about a worker that exited is :class:`~xlaserve.supervision.RestartPolicy`'s, a pure
object; how a child's output is cut into bounded lines is
:class:`~xlaserve.supervision.LineSplitter`'s (both in :mod:`xlaserve.supervision`).

A worker reports that it serves by writing one JSON line (``{"grpc_port": ..., "http_port":
..., "pid": ...}``) to the file descriptor named by the ``XLASERVE_READY_FD`` variable the
supervisor sets; the supervisor reads the other end of that pipe, so readiness costs no
polling. A worker that never writes it stays ``starting``.

Who learns what: :meth:`Supervisor.subscribe` gives a channel of :data:`SupervisorEvent`
(started, ready, exited), which the gateway follows to re-discover a restarted worker and to
stop routing to one that exited; :meth:`Supervisor.status` gives snapshots for ``/readyz``,
``/metrics`` and logs.
"""
from __future__ import annotations

import collections
import enum
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import trio

from xlaserve.config import ConfigError, NodeConfig, resolve_worker, worker_count
from xlaserve.config.schema import SupervisorConfig
from xlaserve.logformat import process_line, worker_line
from xlaserve.logrelay import LineRelay, RelayedLogging, drop_notice
from xlaserve.supervision import (MAX_LINE_BYTES, GiveUp, LineSplitter, RestartPolicy, describe_exit,
                                  line_text, ordinal_suffix, parse_ready)

log = logging.getLogger("xlaserve.supervisor")

READY_FD_ENV = "XLASERVE_READY_FD"
# The read end of a pipe whose only write end the supervisor holds: it reads end-of-file once the
# supervisor has exited, however it ended (SIGKILL, the OOM killer), and the worker then stops.
# Workers run in a session of their own, so nothing else would tell them.
SUPERVISOR_FD_ENV = "XLASERVE_SUPERVISOR_FD"
# Set for a worker whose device the supervisor made the only one it sees (CUDA_VISIBLE_DEVICES):
# the worker then opens ordinal 0, whatever ordinal its node-file entry names.
DEVICE_ISOLATED_ENV = "XLASERVE_DEVICE_ISOLATED"

# Lines of each worker kept for the report when it crashes too often (at most this many times
# MAX_LINE_BYTES per worker).
TAIL_LINES = 50
# After a worker exits, how long its output may still arrive (a process it started may hold the
# pipe open) before the supervisor stops reading it.
OUTPUT_DRAIN_SECONDS = 1.0
# The ready report is one short JSON line; a child that writes more is not believed.
MAX_READY_BYTES = 4096
# End-of-file on the ready pipe is how an exiting worker's report ends; a worker still running this
# long after it closed the descriptor without a report never will report, and is named once.
READY_CLOSED_GRACE_SECONDS = 1.0
_READ_CHUNK = 64 * 1024
# Lines relayed between two turns of the other tasks: a chunk of 64 KiB of empty lines is 65,536
# lines (about 0.2 s of relaying), which must not hold the gateway's requests all that time.
LINES_PER_TURN = 256
# Events a subscriber may leave unread. A worker causes at most three per start and starts are
# limited by the restart policy, so a subscriber this far behind has stopped reading: its channel
# is closed rather than letting it hold the supervisor's memory.
MAX_PENDING_EVENTS = 1024
_CANNOT_START = 127     # the returncode given to a worker whose program could not be run (as sh's)


def ready_writer(path: str | None, fd: str | None = None):
    """The ready callback of a worker or a gateway: the bound ports as JSON, written atomically
    to the file ``path`` and as one line to the inherited descriptor ``fd`` (a supervisor's pipe,
    ``READY_FD_ENV``; closed after)."""
    if not path and not fd:
        return None

    def write(grpc_port: int, http_port: int, rest_port: int | None = None) -> None:
        nonlocal fd
        report = {"grpc_port": grpc_port, "http_port": http_port, "pid": os.getpid()}
        if rest_port is not None:
            report["rest_port"] = rest_port
        if path:
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                json.dump(report, f)
            os.replace(tmp, path)
        if fd:
            try:
                with open(int(fd), "w", closefd=True) as pipe:
                    pipe.write(json.dumps(report) + "\n")
            except (OSError, ValueError) as exc:
                log.warning("cannot write the ready report to %s=%s: %s", READY_FD_ENV, fd, exc)
            fd = None   # the descriptor is closed now; its number may be reused by another file
    return write


def _end_leftovers(pid: int) -> None:
    """SIGKILL what is left of an exited worker's process group (it ran in a session of its own,
    so the group is its ``pid``): processes a hook started, which would otherwise outlive the
    worker and the node. Nothing left is the usual case."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    log.warning("worker process %d left processes of its own running; they were killed (SIGKILL)", pid)


async def supervisor_exited(fd: int) -> None:
    """Return once the supervisor that started this worker has exited: ``fd`` (from
    ``SUPERVISOR_FD_ENV``) is the read end of a pipe whose write end only the supervisor holds,
    so it reads end-of-file then. Raises OSError when ``fd`` is not an open descriptor."""
    while True:
        await trio.lowlevel.wait_readable(fd)
        if not os.read(fd, 4096):   # readable, so it does not block; the supervisor never writes
            return


# --- what to run ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One worker process: its ``name`` (the prefix of its log lines, the name in events), the
    command line ``argv`` (``argv[0]`` is the program) and ``env``, variables set on top of the
    supervisor's own environment."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))


def visible_device(ordinal: int, visible: str | None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value that shows a worker only the device at ``ordinal`` of
    the supervisor's own view: the ``ordinal``-th entry of the supervisor's ``visible`` (its
    ``CUDA_VISIBLE_DEVICES``, a container-level filter), or the ordinal itself when that is
    unset. ConfigError when the filter shows fewer devices."""
    if visible is None or not visible.strip():
        return str(ordinal)
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if ordinal >= len(entries):
        raise ConfigError(f"device ordinal {ordinal}: CUDA_VISIBLE_DEVICES={visible!r} shows "
                          f"{len(entries)} device{'s' if len(entries) != 1 else ''} (ordinals 0.."
                          f"{len(entries) - 1})")
    return entries[ordinal]


def worker_specs(node_path: str | Path, node: NodeConfig, count: int | None = None, *,
                 log_level: str | None = None, log_format: str | None = None,
                 python: str = sys.executable,
                 environ: Mapping[str, str] = os.environ) -> tuple[WorkerSpec, ...]:
    """The worker processes of a node: ``python -m xlaserve --log-level L --log-format F worker
    NODE --worker NAME`` for each of its ``count`` workers (default: :func:`worker_count`; pass
    the count ``gpus: auto`` detected, which each child is told with ``--worker-count``).

    ``log_level``/``log_format`` default to the node's ``logging:`` block. On ``cuda`` each
    worker sees only its device: ``CUDA_VISIBLE_DEVICES`` is set to its ordinal (its ``gpu:``,
    else its index) as :func:`visible_device` maps it through ``environ``'s filter, and the
    worker opens ordinal 0 of that view. On ``cpu`` nothing is set. ConfigError when a worker
    cannot be resolved, its device is not visible, or two workers would see the same device
    (distinct ordinals that the filter maps onto one entry, as ``CUDA_VISIBLE_DEVICES=3,3``
    does; the node file itself never names one GPU twice, see
    :func:`~xlaserve.config.resolve.parse_node_config`)."""
    explicit_count = node.workers_explicit or count is None
    count = worker_count(node) if count is None else count
    level = log_level or node.logging.level
    fmt = log_format or node.logging.format
    specs = []
    devices: dict[str, str] = {}    # CUDA_VISIBLE_DEVICES value -> the worker given it
    for index in range(count):
        config = resolve_worker(node, index, None if node.workers_explicit else count)
        argv = [python, "-m", "xlaserve", "--log-level", level, "--log-format", fmt,
                "worker", str(node_path), "--worker", config.name]
        if not explicit_count:
            argv += ["--worker-count", str(count)]
        env = {}
        if config.runtime.backend == "cuda":
            ordinal = config.device_ordinal
            try:
                env["CUDA_VISIBLE_DEVICES"] = visible_device(ordinal, environ.get("CUDA_VISIBLE_DEVICES"))
            except ConfigError as exc:
                raise ConfigError(f"worker {config.name}: {exc}") from None
            device = env["CUDA_VISIBLE_DEVICES"]
            if device in devices:
                raise ConfigError(
                    f"worker {config.name}: device ordinal {ordinal} is CUDA_VISIBLE_DEVICES entry "
                    f"{device!r}, which worker {devices[device]} already has (CUDA_VISIBLE_DEVICES="
                    f"{environ.get('CUDA_VISIBLE_DEVICES')!r}); two cuda workers on one GPU would each "
                    "claim its memory: list each device once")
            devices[device] = config.name
            env[DEVICE_ISOLATED_ENV] = "1"
        specs.append(WorkerSpec(config.name, tuple(argv), MappingProxyType(env)))
    return tuple(specs)


# --- events and status ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class WorkerStarted:
    """A worker process was started: ``attempt`` 0 is its first start, n its n-th restart."""

    name: str
    pid: int
    attempt: int


@dataclass(frozen=True, slots=True)
class WorkerReady:
    """A worker reported that it serves, on these (bound) ports."""

    name: str
    pid: int
    grpc_port: int
    http_port: int


@dataclass(frozen=True, slots=True)
class WorkerExited:
    """A worker process ended with ``returncode`` (negative: killed by that signal; 127 with
    ``pid`` 0 when its program could not be started at all). ``restarting_in`` is the back-off before it is started again, or None when it is not (the
    node is stopping, or the worker crashed too often)."""

    name: str
    pid: int
    returncode: int
    restarting_in: float | None


SupervisorEvent = WorkerStarted | WorkerReady | WorkerExited


class WorkerState(enum.Enum):
    STARTING = "starting"       # its process runs; it has not reported that it serves
    RUNNING = "running"         # it reported its ports
    RESTARTING = "restarting"   # it exited; waiting out the back-off
    STOPPING = "stopping"       # sent SIGTERM by the node's stop
    STOPPED = "stopped"         # no process, and none will be started


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """A snapshot of one worker: its state, the pid of its process (None without one), how many
    times it was restarted, its ports once it reported them, and how its last process ended."""

    name: str
    state: WorkerState
    pid: int | None
    restarts: int
    grpc_port: int | None
    http_port: int | None
    last_returncode: int | None


class _Worker:
    """The supervisor's record of one worker; owned by that worker's task."""

    __slots__ = ("spec", "policy", "state", "process", "restarts", "ports", "last_returncode",
                 "tail", "done")

    def __init__(self, spec: WorkerSpec, policy: RestartPolicy) -> None:
        self.spec = spec
        self.policy = policy
        self.state = WorkerState.STARTING
        self.process: trio.Process | None = None
        self.restarts = 0
        self.ports: tuple[int, int] | None = None
        self.last_returncode: int | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.done = trio.Event()

    def status(self) -> WorkerStatus:
        pid = self.process.pid if self.process is not None else None
        grpc_port, http_port = self.ports if self.ports is not None else (None, None)
        return WorkerStatus(self.spec.name, self.state, pid, self.restarts, grpc_port, http_port,
                            self.last_returncode)


# --- the supervisor ------------------------------------------------------------------------------

class Supervisor:
    """Runs one process per :class:`WorkerSpec` until :meth:`stop` (or a worker crashing too
    often, which stops the node with exit status 1).

    Each line a worker prints (stdout and stderr, one pipe) goes to ``write`` as
    :func:`~xlaserve.logformat.worker_line` formats it for ``log_format``; ``write`` must not
    wait (it is called on the Trio loop). By default the lines go to this process's stdout
    through a :class:`~xlaserve.logrelay.LineRelay`, written by a thread of its own: a stdout
    that nobody reads costs dropped lines (counted, and one line says how many once it is read
    again), never a stalled loop. The workers' pipes are always read, whatever ``write`` does.
    Its last :data:`TAIL_LINES` lines are kept for the crash report. Workers run in their own
    process group, so a Ctrl-C at a terminal reaches the supervisor alone and the stop order
    below holds.

    Stop order: the ``before_stop`` hooks (the gateway stops accepting and drains) are awaited,
    at most ``stop_timeout_seconds`` in all; then every worker is sent SIGTERM (it drains
    itself) and given ``stop_timeout_seconds`` to exit, then sent SIGKILL. No worker is
    restarted once the stop has begun.
    """

    def __init__(self, workers: Sequence[WorkerSpec], config: SupervisorConfig | None = None, *,
                 log_format: str = "text", write: Callable[[str], None] | None = None,
                 before_stop: Callable[[], Awaitable[None]] | None = None) -> None:
        names = [spec.name for spec in workers]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"supervisor: expected workers with distinct names, got {names}")
        self.config = config or SupervisorConfig()
        self.log_format = log_format
        self._write = write
        self._out: Callable[[str], None] = write or (lambda line: None)
        self._workers = [_Worker(spec, RestartPolicy.from_config(self.config)) for spec in workers]
        self._before_stop: list[Callable[[], Awaitable[None]]] = [before_stop] if before_stop else []
        self._subscribers: list[trio.MemorySendChannel[SupervisorEvent]] = []
        self._stop_requested = trio.Event()
        self._exit_code = 0
        self._lifeline: int | None = None   # SUPERVISOR_FD_ENV's descriptor, while run() runs

    # -- what others may ask --

    def subscribe(self) -> trio.MemoryReceiveChannel[SupervisorEvent]:
        """A channel of every event from now on; it ends when the supervisor has stopped. Sending
        never waits for the subscriber: one that leaves :data:`MAX_PENDING_EVENTS` events unread
        has its channel closed (one error is logged), so keep reading it."""
        send, receive = trio.open_memory_channel[SupervisorEvent](MAX_PENDING_EVENTS)
        self._subscribers.append(send)
        return receive

    def add_before_stop(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Await ``hook()`` first when the node stops, before any worker is signalled (hooks run
        one after another, in the order added, within ``stop_timeout_seconds`` in all)."""
        self._before_stop.append(hook)

    def status(self) -> tuple[WorkerStatus, ...]:
        """A snapshot of every worker, in the node's order."""
        return tuple(worker.status() for worker in self._workers)

    @property
    def stopping(self) -> bool:
        return self._stop_requested.is_set()

    def stop(self) -> None:
        """Begin the node's stop (see the class docstring); :meth:`run` returns once it is
        over. Calling it again does nothing more."""
        self._stop_requested.set()

    # -- running --

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> int:
        """Start every worker and keep them running until the node stops; then 0, or 1 when a
        worker crashed too often. Call it once. ``task_status.started()`` once every first process has been
        asked to start. If this task is cancelled, the workers still get SIGTERM, then SIGKILL
        after ``stop_timeout_seconds``."""
        relay = None
        if self._write is None:
            relay = LineRelay(1, notice=lambda count, stream: process_line(drop_notice(count, stream),
                                                                           self.log_format))
            self._out = relay.put
        # Its write end stays in this process only (not inheritable): when the process ends, by
        # any means, every worker reads end-of-file on its copy of the read end and stops.
        self._lifeline, lifeline_write = os.pipe()
        try:
            async with trio.open_nursery() as nursery:
                for worker in self._workers:
                    nursery.start_soon(self._keep_running, worker)
                task_status.started()
                await self._stop_requested.wait()
                await self._shut_down()
        finally:
            os.close(self._lifeline)
            os.close(lifeline_write)
            self._lifeline = None
            for send in self._subscribers:
                send.close()
            if relay is not None:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(relay.close)
        return self._exit_code

    async def _shut_down(self) -> None:
        timeout = self.config.stop_timeout_seconds
        if self._before_stop:
            with trio.move_on_after(timeout) as scope:
                for hook in self._before_stop:
                    try:
                        await hook()
                    except Exception:
                        # the workers must be stopped whatever a hook does; its bug is reported once
                        log.exception("a before-stop hook failed; stopping the workers anyway")
            if scope.cancelled_caught:
                log.warning("the before-stop hooks did not finish within supervisor.stop_timeout_seconds "
                            "(%g s); stopping the workers anyway", timeout)
        for worker in self._workers:
            self._terminate(worker)
        with trio.move_on_after(timeout):
            for worker in self._workers:
                await worker.done.wait()
        for worker in self._workers:
            if worker.process is not None and worker.process.returncode is None:
                log.warning("worker %s did not exit within supervisor.stop_timeout_seconds (%g s) of "
                            "SIGTERM; sending SIGKILL", worker.spec.name, timeout,
                            extra={"worker": worker.spec.name})
                worker.process.kill()

    def _terminate(self, worker: _Worker) -> None:
        if worker.process is not None and worker.process.returncode is None:
            worker.state = WorkerState.STOPPING
            worker.process.terminate()

    def _emit(self, event: SupervisorEvent) -> None:
        for send in list(self._subscribers):
            try:
                send.send_nowait(event)
            except trio.BrokenResourceError:     # that subscriber closed its end
                self._subscribers.remove(send)
            except trio.WouldBlock:
                log.error("a subscriber to the supervisor's events left %d unread; closing its channel",
                          MAX_PENDING_EVENTS)
                send.close()
                self._subscribers.remove(send)

    async def _keep_running(self, worker: _Worker) -> None:
        name = worker.spec.name
        attempt = 0
        try:
            while not self._stop_requested.is_set():
                worker.state = WorkerState.STARTING
                pid, returncode = await self._run_once(worker, attempt)
                worker.last_returncode = returncode
                worker.ports = None
                if self._stop_requested.is_set():
                    self._emit(WorkerExited(name, pid, returncode, None))
                    break
                decision = worker.policy.exited(trio.current_time())
                if isinstance(decision, GiveUp):
                    self._give_up(worker, returncode, decision)
                    self._emit(WorkerExited(name, pid, returncode, None))
                    break
                worker.state = WorkerState.RESTARTING
                log.warning("worker %s exited (%s); restarting it in %.3g s (restart %d of at most %d "
                            "within %g s)", name, describe_exit(returncode), decision.delay,
                            decision.restarts_in_window, worker.policy.max_restarts,
                            worker.policy.window, extra={"worker": name})
                self._emit(WorkerExited(name, pid, returncode, decision.delay))
                with trio.move_on_after(decision.delay):
                    await self._stop_requested.wait()
                if self._stop_requested.is_set():
                    break
                worker.restarts += 1
                attempt += 1
        finally:
            worker.state = WorkerState.STOPPED
            worker.done.set()

    def _give_up(self, worker: _Worker, returncode: int, decision: GiveUp) -> None:
        name = worker.spec.name
        lines = "\n".join(f"  {line}" for line in worker.tail) or "  (it printed nothing)"
        log.error("worker %s exited (%s), its %d%s exit within %g s (supervisor.max_restarts: %d); "
                  "stopping the node. Its last %d lines:\n%s", name, describe_exit(returncode),
                  decision.exits_in_window, ordinal_suffix(decision.exits_in_window),
                  worker.policy.window, worker.policy.max_restarts, len(worker.tail), lines,
                  extra={"worker": name})
        self._exit_code = 1
        self.stop()

    async def _run_once(self, worker: _Worker, attempt: int) -> tuple[int, int]:
        """Run the worker's process once, relaying its output; its ``(pid, returncode)``."""
        spec = worker.spec
        ready_read, ready_write = os.pipe()
        try:
            env = {**os.environ, **spec.env, READY_FD_ENV: str(ready_write),
                   SUPERVISOR_FD_ENV: str(self._lifeline)}
            try:
                process = await trio.lowlevel.open_process(
                    list(spec.argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, env=env, pass_fds=(ready_write, self._lifeline),
                    start_new_session=True)
            except OSError as exc:
                os.close(ready_read)
                self._line(worker, f"cannot start {spec.argv[0]!r}: {exc}")
                return 0, _CANNOT_START
        finally:
            os.close(ready_write)   # the child has its copy; EOF once it closes that
        ready = trio.lowlevel.FdStream(ready_read)
        worker.process = process
        self._emit(WorkerStarted(spec.name, process.pid, attempt))
        if self._stop_requested.is_set():
            self._terminate(worker)   # the stop's SIGTERM to every worker came before this start
        try:
            async with trio.open_nursery() as nursery:
                output_done = trio.Event()
                nursery.start_soon(self._relay_output, worker, process.stdout, output_done)
                nursery.start_soon(self._read_ready, worker, process, ready)
                returncode = await process.wait()
                with trio.move_on_after(OUTPUT_DRAIN_SECONDS):
                    await output_done.wait()
                nursery.cancel_scope.cancel()
            return process.pid, returncode
        finally:
            with trio.CancelScope(shield=True):
                if process.returncode is None:
                    # cancelled from outside (the supervisor's caller is going away): still stop
                    # the worker the same way, never leave it running
                    process.terminate()
                    with trio.move_on_after(self.config.stop_timeout_seconds):
                        await process.wait()
                    if process.returncode is None:
                        process.kill()
                        await process.wait()
                _end_leftovers(process.pid)
                await process.stdout.aclose()
                await ready.aclose()
            worker.process = None

    def _line(self, worker: _Worker, text: str) -> None:
        worker.tail.append(text)
        self._out(worker_line(worker.spec.name, text, self.log_format))

    async def _relay_output(self, worker: _Worker, stream: trio.abc.ReceiveStream,
                            done: trio.Event) -> None:
        splitter = LineSplitter(MAX_LINE_BYTES)
        try:
            while data := await stream.receive_some(_READ_CHUNK):
                for count, (line, cut) in enumerate(splitter.feed(data), 1):
                    self._line(worker, line_text(line, cut))
                    if count % LINES_PER_TURN == 0:
                        await trio.lowlevel.checkpoint()
            last = splitter.finish()
            if last is not None:
                self._line(worker, line_text(last, False))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass    # closed at the end of the run, or the pipe failed: the worker's output ends here
        finally:
            done.set()

    async def _read_ready(self, worker: _Worker, process: trio.Process,
                          stream: trio.lowlevel.FdStream) -> None:
        report = b""
        while len(report) < MAX_READY_BYTES and b"\n" not in report:
            try:
                chunk = await stream.receive_some(MAX_READY_BYTES)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                chunk = b""
            if not chunk:
                break
            report += chunk
        if not report:
            # it exited without saying it serves (this task is then cancelled within the grace),
            # or it closed the descriptor and runs on, staying `starting` for good: say so once
            await trio.sleep(READY_CLOSED_GRACE_SECONDS)
            if process.returncode is None:
                log.warning("worker %s closed its %s descriptor without reporting that it serves, and "
                            "runs on; it stays %s", worker.spec.name, READY_FD_ENV,
                            WorkerState.STARTING.value, extra={"worker": worker.spec.name})
            return
        ports = parse_ready(report.split(b"\n", 1)[0])
        if ports is None:
            log.warning("worker %s wrote an unreadable ready report to %s (%r); it stays %s",
                        worker.spec.name, READY_FD_ENV, report[:200], WorkerState.STARTING.value,
                        extra={"worker": worker.spec.name})
            return
        worker.ports = ports
        if worker.state is WorkerState.STARTING:
            worker.state = WorkerState.RUNNING
        self._emit(WorkerReady(worker.spec.name, process.pid, *ports))


# --- the entry point -----------------------------------------------------------------------------

async def supervise(node_path: str | Path, node: NodeConfig, *,
                    gateway: Callable[[Supervisor], Awaitable[object]] | None = None,
                    count: int | None = None, specs: Sequence[WorkerSpec] | None = None,
                    write: Callable[[str], None] | None = None, handle_signals: bool = True) -> int:
    """Run a node's workers under a :class:`Supervisor` (configured by the node's
    ``supervisor:`` and ``logging:`` blocks) until SIGTERM or SIGINT, or until a worker crashes
    too often; the exit status (0, or 1 after a crash report).

    ``gateway``, when given, is started beside the supervisor with it as its argument, and is
    cancelled once every worker has stopped; it drains first by registering a hook with
    :meth:`Supervisor.add_before_stop` and follows the workers through
    :meth:`Supervisor.subscribe`. Without it, the workers are only supervised. ``count`` is the
    node's worker count (see :func:`worker_specs`); ``specs`` replaces the node's worker
    processes (tests run stand-ins). ``handle_signals=False`` leaves SIGTERM/SIGINT alone (the
    caller then calls :meth:`Supervisor.stop`).

    Nothing this process logs waits for a reader: the workers' lines go through a relay (see
    :class:`Supervisor`; ``write`` replaces it), and while the node runs, the root logger's
    handlers that write to stderr or stdout (the supervisor's and the gateway's own records)
    write through a :class:`~xlaserve.logrelay.RelayedLogging` relay too."""
    if specs is None:
        specs = worker_specs(node_path, node, count)
    supervisor = Supervisor(specs, node.supervisor, log_format=node.logging.format, write=write)
    logs = RelayedLogging(notice=lambda count, stream: process_line(drop_notice(count, stream),
                                                                   node.logging.format))
    logs.start()
    try:
        async with trio.open_nursery() as nursery:
            if handle_signals:
                await nursery.start(_stop_on_signal, supervisor)
            if gateway is not None:
                nursery.start_soon(gateway, supervisor)
            code = await supervisor.run()
            nursery.cancel_scope.cancel()
    finally:
        logs.restore()
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(logs.close)
    return code


async def _stop_on_signal(supervisor: Supervisor, *,
                          task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        async for signum in signals:
            log.info("%s: stopping the node", signal.Signals(signum).name)
            supervisor.stop()
