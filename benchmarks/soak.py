"""Soak (issue 14): ``python -m benchmarks.soak [--duration 600] [--concurrency 128] [--models 20]
[--reload-every 30] [--client-processes 2]``.

Goal: c=128 over 20 models with a hot reload every 30 s for 10 minutes: requests sent ==
answered, 0 INTERNAL, RSS growth < 5%.

- ``--models`` small MLP bundles (``output = tanh(input @ w)``, widths 64, 72, ... so no two
  share a module; :func:`benchmarks.lifecycle_bench.export_bundles`) in a temporary repository,
  served by a real ``xlaserve run`` in ``dynamic`` mode with an executable cache.
- ``--concurrency`` closed-loop clients (the Triton aio gRPC client), spread over
  ``--client-processes`` processes so that one Python process does not cap the load. Each request
  picks its model from the traffic mix (``uniform`` by default, or ``zipf``), sends one row that
  belongs to that client and model, and checks the answer against NumPy: ``tanh(x @ w)`` with the
  ``w`` of the version the reply names in ``model_version``. An answer from a version older than
  the one the soak had already seen serving when the request was sent is *stale*. Requests carry
  no deadline to the server; one it never answers ends, client-side, as DEADLINE_EXCEEDED after
  ``--request-timeout`` seconds (30).
- Every ``--reload-every`` seconds one model (in turn) gets new weights: a new
  ``weights.safetensors`` is written outside the repository and renamed over the old one. Version
  ``v >= 2`` of model ``i`` holds weights drawn from ``default_rng([i, v])``, so every reply can
  be checked whichever version computed it. A reload is *confirmed* when the worker's
  ``WatchStatus`` stream shows the model READY at the new version.
- The server's RSS (``VmRSS`` in ``/proc/PID/status``) is sampled every ``--rss-every`` seconds;
  the baseline is the first sample taken after the first reload was confirmed (the end of
  warm-up), the end is the last sample taken under load.

The run passes (exit status 0) when every request sent was answered OK with a correct, non-stale
answer (so: no request lost, no error status, no INTERNAL), every reload was confirmed and no
model was ever seen other than READY without a reason, the server logged no ERROR, and RSS grew
less than ``--max-rss-growth`` percent (5). Otherwise it prints what failed and exits 1. A
summary goes to stderr, and one JSON line with every count to stdout.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import queue
import re
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks._servers import tree_cpu_seconds
from benchmarks.lifecycle_bench import Server, export_bundles
from xlaserve.bench.loadgen import model_mix

#: Clients that share one gRPC channel (HTTP/2 connection), as ``xlaserve bench`` does.
CLIENTS_PER_CHANNEL = 16
#: Tolerance of an answer against NumPy's ``tanh(x @ w)``; two versions' answers differ by O(1).
ATOL = 1e-4
#: Problem examples each client process keeps (the counts are complete; these are for reading).
MAX_EXAMPLES = 5
#: Seconds between tally snapshots a client process sends to the soak.
SNAPSHOT_EVERY = 2.0


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    index: int
    width: int


def reload_weights(model: ModelSpec, version: int) -> np.ndarray:
    """The ``w`` the soak writes for ``version`` (>= 2) of ``model``."""
    rng = np.random.default_rng([model.index, version])
    return (rng.standard_normal((model.width, model.width)) / np.sqrt(model.width)).astype(np.float32)


@dataclass
class Tally:
    """What one client process saw. ``statuses`` counts non-OK gRPC statuses by name."""

    sent: int = 0
    ok: int = 0
    wrong: int = 0
    stale: int = 0
    statuses: Counter = field(default_factory=Counter)
    client_errors: Counter = field(default_factory=Counter)
    versions_seen: dict[str, set[int]] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    cpu_seconds: float = 0.0

    def note(self, problem: str) -> None:
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(problem)

    def merge(self, other: Tally) -> None:
        self.sent += other.sent
        self.ok += other.ok
        self.wrong += other.wrong
        self.stale += other.stale
        self.statuses.update(other.statuses)
        self.client_errors.update(other.client_errors)
        for model, versions in other.versions_seen.items():
            self.versions_seen.setdefault(model, set()).update(versions)
        self.examples += other.examples[: max(0, 4 * MAX_EXAMPLES - len(self.examples))]
        self.latencies += other.latencies
        self.cpu_seconds += other.cpu_seconds


@dataclass(frozen=True, slots=True)
class ClientsReady:
    process: int


@dataclass(frozen=True, slots=True)
class TallySnapshot:
    """A running tally (``final`` False, without latencies) or the last one."""

    process: int
    tally: Tally
    final: bool


@dataclass(frozen=True, slots=True)
class Go:
    """Start sending to ``url``; stop sending at ``stop_at`` (``time.monotonic()``)."""

    url: str
    stop_at: float


@dataclass(frozen=True, slots=True)
class Shared:
    """What the soak shares with its client processes: the version of each model confirmed
    serving (a shared int array, by model index), a queue of one :class:`Go` per process, and the
    queue of their reports."""

    confirmed: object
    go: object
    reports: object


# --- client processes ------------------------------------------------------------------------

def client_process(index: int, clients: int, first_client: int, models: list[ModelSpec],
                   initial_weights: dict[str, np.ndarray], mix: str, zipf_s: float, request_timeout: float,
                   shared: Shared) -> None:
    """Entry point of one client process: says it is ready, waits for its :class:`Go`, runs
    ``clients`` closed-loop clients until then and sends its final tally."""
    import tritonclient.grpc.aio  # noqa: F401 - import before saying ready: it takes a second

    shared.reports.put(ClientsReady(index))
    go = shared.go.get()
    cpu_before = time.process_time()
    tally = asyncio.run(_drive(index, go, clients, first_client, models, initial_weights, mix, zipf_s,
                               request_timeout, shared))
    tally.cpu_seconds = time.process_time() - cpu_before
    shared.reports.put(TallySnapshot(index, tally, final=True))


async def _drive(index: int, go: Go, clients, first_client, models, initial_weights, mix, zipf_s,
                 request_timeout, shared: Shared) -> Tally:
    import tritonclient.grpc.aio as aio
    from tritonclient.utils import InferenceServerException

    from xlaserve.bench.loadgen import status_name

    by_name = {m.name: m for m in models}
    names = [m.name for m in models]
    weights: dict[tuple[str, int], np.ndarray] = {(n, 1): w for n, w in initial_weights.items()}
    tally = Tally()
    confirmed, stop_at = shared.confirmed, go.stop_at

    def weights_of(model: ModelSpec, version: int) -> np.ndarray:
        key = (model.name, version)
        if key not in weights:
            weights[key] = reload_weights(model, version)
        return weights[key]

    async def client(number: int, channel) -> None:
        choose = model_mix(names, mix, zipf_s, seed=number)
        rng = np.random.default_rng(10_000 + number)
        inputs: dict[str, tuple[np.ndarray, object]] = {}
        while time.monotonic() < stop_at:
            model = by_name[choose()]
            if model.name not in inputs:
                x = rng.standard_normal((1, model.width)).astype(np.float32)
                tensor = aio.InferInput("input", [1, model.width], "FP32")
                tensor.set_data_from_numpy(x)
                inputs[model.name] = (x, tensor)
            x, tensor = inputs[model.name]
            serving = confirmed[model.index]
            tally.sent += 1
            t0 = time.monotonic()
            try:
                result = await channel.infer(model.name, [tensor], client_timeout=request_timeout)
            except InferenceServerException as exc:
                status = status_name(exc)
                tally.statuses[status] += 1
                tally.note(f"{model.name}: {status}: {exc.message()}")
                if status in ("UNAVAILABLE", "UNKNOWN"):
                    await asyncio.sleep(0.01)       # the server is gone or restarting: do not spin
                continue
            except Exception as exc:  # noqa: BLE001 - counted and reported; any one fails the soak
                tally.client_errors[type(exc).__name__] += 1
                tally.note(f"{model.name}: client error {type(exc).__name__}: {exc}")
                continue
            tally.latencies.append(time.monotonic() - t0)
            version = result.get_response().model_version
            problem = check_answer(model, x, version, result.as_numpy("output"), serving, weights_of)
            if problem is None:
                tally.ok += 1
                tally.versions_seen.setdefault(model.name, set()).add(int(version))
            elif problem.startswith("stale"):
                tally.stale += 1
                tally.note(problem)
            else:
                tally.wrong += 1
                tally.note(problem)

    async def snapshots() -> None:
        while True:
            await asyncio.sleep(SNAPSHOT_EVERY)
            running = Tally(tally.sent, tally.ok, tally.wrong, tally.stale, Counter(tally.statuses),
                            Counter(tally.client_errors), examples=list(tally.examples))
            shared.reports.put(TallySnapshot(index, running, final=False))

    channels = [aio.InferenceServerClient(go.url) for _ in range((clients + CLIENTS_PER_CHANNEL - 1)
                                                             // CLIENTS_PER_CHANNEL)]
    reporter = asyncio.ensure_future(snapshots())
    try:
        await asyncio.gather(*[client(first_client + k, channels[k % len(channels)]) for k in range(clients)])
    finally:
        reporter.cancel()
        for c in channels:
            await c.close()
    return tally


def check_answer(model: ModelSpec, x: np.ndarray, raw_version: str, out: np.ndarray | None, serving: int,
                 weights_of) -> str | None:
    """None when ``out`` is ``tanh(x @ w)`` for the ``w`` of the version the reply names
    (``weights_of(model, version)``); else what is wrong with it: ``stale ...`` for a correct
    answer of a version older than ``serving``, the version confirmed before the request was sent."""
    try:
        version = int(raw_version)
    except ValueError:
        return f"{model.name}: model_version {raw_version!r} is not a number"
    if version < 1:
        return f"{model.name}: model_version {version}"
    if out is None or out.shape != (1, model.width) or out.dtype != np.float32:
        got = None if out is None else (out.shape, out.dtype)
        return f"{model.name} v{version}: output {got}, expected ({(1, model.width)}, float32)"
    expected = np.tanh(x.astype(np.float64) @ weights_of(model, version).astype(np.float64))
    error = float(np.max(np.abs(out - expected)))
    if error > ATOL:
        return f"{model.name} v{version}: max |answer - reference| = {error:.3g} (> {ATOL})"
    if version < serving:
        return f"stale: {model.name} answered by v{version} after v{serving} was serving"
    return None


# --- the soak --------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Reload:
    model: str
    version: int
    at_s: float                   # seconds after the load started
    confirmed_after_s: float | None  # file renamed -> WatchStatus shows the version READY; None: never


@dataclass
class SoakResult:
    tally: Tally
    reloads: list[Reload]
    rss_samples: list[tuple[float, int]]     # (seconds after start, kB)
    rss_warm_kb: int | None
    rss_end_kb: int | None
    status_problems: list[str]
    server_errors: list[str]                 # ERROR and Traceback lines of the server's log
    server_warnings: list[str]
    elapsed_s: float
    server_cores: float                      # the server's CPU seconds per second of load
    client_cpu_s: list[float]                # per client process
    unreported_processes: list[int]

    warm_from_s: float = 0.0

    @property
    def rss_growth_pct(self) -> float | None:
        if not self.rss_warm_kb or self.rss_end_kb is None:
            return None
        return 100.0 * (self.rss_end_kb - self.rss_warm_kb) / self.rss_warm_kb

    @property
    def rss_trend_mib_per_min(self) -> float | None:
        """Least-squares slope of the RSS samples after warm-up: a leak shows as a steady climb."""
        after = [(s, kb) for s, kb in self.rss_samples if s >= self.warm_from_s]
        if len(after) < 3:
            return None
        seconds, kb = np.array(after, dtype=np.float64).T
        return float(np.polyfit(seconds, kb, 1)[0]) * 60 / 1024


def read_rss_kb(pid: int) -> int | None:
    """VmRSS of ``pid`` in kB; None once the process has exited (a zombie has no VmRSS)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), None)


def split_clients(concurrency: int, processes: int) -> list[int]:
    """``concurrency`` clients over ``processes`` processes, as evenly as possible."""
    return [concurrency // processes + (1 if k < concurrency % processes else 0) for k in range(processes)]


async def _watch_versions(host: str, port: int, versions: dict[str, tuple[str, int, str]],
                          changed: asyncio.Condition, problems: list[str]) -> None:
    """Keep ``versions`` (model -> (state, version, reason)) from the worker's WatchStatus stream;
    note every model seen not READY or with a reason (a failed reload says so there)."""
    from grpclib.client import Channel
    from grpclib.exceptions import GRPCError, StreamTerminatedError

    from xlaserve._proto import xlaserve_control_pb2 as pb
    from xlaserve._proto.xlaserve_control_grpc import WorkerControlStub

    try:
        async with Channel(host, port) as channel:
            async with WorkerControlStub(channel).WatchStatus.open() as stream:
                await stream.send_message(pb.WatchStatusRequest(interval_seconds=0.25), end=True)
                async for status in stream:
                    async with changed:
                        for m in status.models:
                            if (m.state != "READY" or m.reason) and len(problems) < 20:
                                problems.append(f"{m.name} v{m.version} {m.state}: {m.reason}")
                            versions[m.name] = (m.state, m.version, m.reason)
                        changed.notify_all()
    except (OSError, GRPCError, StreamTerminatedError) as exc:
        problems.append(f"the WatchStatus stream failed: {type(exc).__name__}: {exc}")
    else:
        problems.append("the WatchStatus stream ended before the soak did")


@contextmanager
def client_processes(args, models: list[ModelSpec], initial_weights: dict[str, np.ndarray]):
    """Start ``--client-processes`` processes (they import while the server starts); yields
    (their count, :class:`Shared`). On the way out they get 10 s to exit before they are killed."""
    ctx = multiprocessing.get_context("spawn")     # the soak process has imported jax: no fork
    shared = Shared(ctx.Array("i", [1] * len(models), lock=False), ctx.Queue(), ctx.Queue())
    counts = split_clients(args.concurrency, args.client_processes)
    processes = [ctx.Process(target=client_process, name=f"soak-clients-{k}",
                             args=(k, n, sum(counts[:k]), models, initial_weights, args.mix, args.zipf_s,
                                   args.request_timeout, shared))
                 for k, n in enumerate(counts)]
    for p in processes:
        p.start()
    try:
        yield len(processes), shared
    finally:
        deadline = time.monotonic() + 10
        for p in processes:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()


async def soak(args, root: Path, repo: Path, server: Server, models: list[ModelSpec], processes: int,
               shared: Shared) -> SoakResult:
    """Wait for the client processes, let them go, reload and sample until they are done."""
    from safetensors.numpy import save_file

    ready = 0
    deadline = time.monotonic() + 120
    while ready < processes:
        message = await asyncio.to_thread(shared.reports.get, True, max(0.1, deadline - time.monotonic()))
        match message:
            case ClientsReady():
                ready += 1
    host, port = server.grpc.rsplit(":", 1)
    pid = server.process.pid
    confirmed = shared.confirmed
    staging = root / "staging"
    staging.mkdir()
    cpu_before = tree_cpu_seconds(pid)
    t0 = time.monotonic()
    stop_at = t0 + args.duration
    for _ in range(processes):
        shared.go.put(Go(server.grpc, stop_at))

    versions: dict[str, tuple[str, int, str]] = {}
    changed = asyncio.Condition()
    status_problems: list[str] = []
    reloads: list[Reload] = []
    rss_samples: list[tuple[float, int]] = []
    server_cpu = [0.0, 0.0]   # CPU seconds, over seconds of load, at the last sample (the server may die)
    first_reload_done: list[float] = []
    latest: dict[int, Tally] = {}
    finals: dict[int, Tally] = {}

    async def reload_loop() -> None:
        k = 1
        while (due := t0 + k * args.reload_every) < stop_at:
            await asyncio.sleep(due - time.monotonic())
            model = models[(k - 1) % len(models)]
            version = confirmed[model.index] + 1
            target = repo / model.name / "weights.safetensors"
            staged = staging / f"{model.name}.v{version}.safetensors"
            save_file({"w": reload_weights(model, version)}, str(staged))
            renamed = time.monotonic()
            os.replace(staged, target)
            after = None
            try:
                async with asyncio.timeout(max(1.0, min(args.reload_every - 1.0, 60.0))):
                    async with changed:
                        await changed.wait_for(lambda: versions.get(model.name) == ("READY", version, ""))
                after = time.monotonic() - renamed
                confirmed[model.index] = version
                if not first_reload_done:
                    first_reload_done.append(time.monotonic())
            except TimeoutError:
                pass
            reloads.append(Reload(model.name, version, renamed - t0, after))
            k += 1

    async def rss_loop() -> None:
        while (now := time.monotonic()) < stop_at:
            kb = read_rss_kb(pid)
            if kb is None:
                status_problems.append(f"the server exited during the soak (status {server.process.poll()})")
                return
            rss_samples.append((now - t0, kb))
            server_cpu[:] = [tree_cpu_seconds(pid) - cpu_before, now - t0]
            await asyncio.sleep(min(args.rss_every, stop_at - now))

    async def progress_loop() -> None:
        while time.monotonic() < stop_at:
            await asyncio.sleep(args.progress_every)
            total = Tally()
            for t in latest.values():
                total.merge(t)
            elapsed = time.monotonic() - t0
            errors = sum(total.statuses.values()) + sum(total.client_errors.values())
            rss = f"{rss_samples[-1][1] / 1024:.0f} MiB" if rss_samples else "?"
            print(f"  {elapsed:5.0f}s  sent {total.sent}  ok {total.ok} ({total.ok / elapsed:.0f}/s)  "
                  f"errors {errors}  wrong {total.wrong}  stale {total.stale}  reloads {len(reloads)}  "
                  f"server RSS {rss}", file=sys.stderr, flush=True)

    async def collect() -> None:
        """Tally snapshots until every process sent its final one (or the drain bound passes)."""
        deadline = stop_at + args.request_timeout + 30
        while len(finals) < processes and time.monotonic() < deadline:
            try:
                message = await asyncio.to_thread(shared.reports.get, True, 0.5)
            except queue.Empty:
                continue
            match message:
                case TallySnapshot(process=k, tally=tally, final=final):
                    latest[k] = tally
                    if final:
                        finals[k] = tally

    async with asyncio.TaskGroup() as tasks:
        watcher = tasks.create_task(_watch_versions(host, int(port), versions, changed, status_problems))
        tasks.create_task(reload_loop())
        tasks.create_task(rss_loop())
        reporter = tasks.create_task(progress_loop())
        await collect()
        watcher.cancel()
        reporter.cancel()
    elapsed = time.monotonic() - t0

    total = Tally()
    for t in finals.values():
        total.merge(t)
    warm_from = first_reload_done[0] - t0 if first_reload_done else 0.0
    warm = next((kb for s, kb in rss_samples if s >= warm_from), None)
    end = rss_samples[-1][1] if rss_samples else None
    return SoakResult(total, reloads, rss_samples, warm, end, status_problems, [], [], elapsed,
                      server_cpu[0] / max(server_cpu[1], 1e-9),
                      [finals[k].cpu_seconds for k in sorted(finals)],
                      [k for k in range(processes) if k not in finals], warm_from)


def failures(result: SoakResult, max_rss_growth: float) -> list[str]:
    """Why the soak failed; empty when it passed."""
    t = result.tally
    out = []
    if result.unreported_processes:
        out.append(f"client processes {result.unreported_processes} never sent their final tally")
    if t.sent != t.ok:
        out.append(f"sent {t.sent} != answered OK {t.ok}")
    if t.statuses["INTERNAL"]:
        out.append(f"{t.statuses['INTERNAL']} INTERNAL")
    if t.wrong:
        out.append(f"{t.wrong} wrong answers")
    if t.stale:
        out.append(f"{t.stale} stale answers")
    if sum(t.client_errors.values()):
        out.append(f"client-side errors: {dict(t.client_errors)}")
    unconfirmed = [f"{r.model} v{r.version}" for r in result.reloads if r.confirmed_after_s is None]
    if unconfirmed:
        out.append(f"reloads never confirmed: {', '.join(unconfirmed)}")
    if result.status_problems:
        out.append(f"WatchStatus: {result.status_problems[0]}"
                   + (f" (and {len(result.status_problems) - 1} more)" if len(result.status_problems) > 1 else ""))
    if result.server_errors:
        out.append(f"server logged {len(result.server_errors)} ERROR line(s)")
    growth = result.rss_growth_pct
    if growth is None:
        out.append("no RSS baseline (no sample after the first reload)")
    elif growth >= max_rss_growth:
        out.append(f"RSS grew {growth:.1f}% (limit {max_rss_growth}%)")
    return out


def summarize(result: SoakResult, args, failed: list[str]) -> str:
    t = result.tally
    answered = t.ok + t.wrong + t.stale + sum(t.statuses.values())
    lost = t.sent - answered - sum(t.client_errors.values())
    lat = np.asarray(t.latencies) * 1e3
    pct = "/".join(f"{np.percentile(lat, q):.1f}" for q in (50, 99)) if len(lat) else "-"
    lines = [
        f"soak: c={args.concurrency} over {args.models} models ({args.mix}), {args.client_processes} client "
        f"process(es), reload every {args.reload_every:g}s, {result.elapsed_s:.0f}s",
        f"requests: sent {t.sent}, answered {answered} (OK and correct {t.ok}, wrong {t.wrong}, stale {t.stale}), "
        f"lost {lost}, {t.ok / args.duration:.0f} OK/s; latency ms p50/p99: {pct}",
        f"non-OK statuses: {dict(t.statuses) or 0}; INTERNAL {t.statuses['INTERNAL']}; "
        f"client-side errors: {dict(t.client_errors) or 0}",
        f"reloads: {len(result.reloads)} ("
        + ", ".join(f"{r.model}->v{r.version} "
                    + (f"{r.confirmed_after_s:.2f}s" if r.confirmed_after_s is not None else "UNCONFIRMED")
                    for r in result.reloads) + ")",
        "versions answered: " + ", ".join(f"{m}:{sorted(v)}" for m, v in sorted(t.versions_seen.items())
                                          if len(v) > 1 or max(v) > 1),
        f"CPU: server {result.server_cores:.2f} cores, client processes "
        + " + ".join(f"{c / result.elapsed_s:.2f}" for c in result.client_cpu_s)
        + f" = {t.cpu_seconds / result.elapsed_s:.2f} cores (machine: {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f})",
    ]
    unanswered = [f"{r.model} v{r.version}" for r in result.reloads
                  if r.confirmed_after_s is not None and r.version not in t.versions_seen.get(r.model, ())]
    if unanswered:
        lines.append(f"confirmed reloads no answer came from: {', '.join(unanswered)}")
    if result.rss_samples:
        minute = [f"{s:.0f}s {kb / 1024:.0f}" for s, kb in result.rss_samples[:: max(1, int(60 / args.rss_every))]]
        peak = max(kb for _, kb in result.rss_samples)
        growth = result.rss_growth_pct
        lines.append(f"server RSS MiB: warm {_mib(result.rss_warm_kb)} (first sample from {result.warm_from_s:.0f}s), "
                     f"end {_mib(result.rss_end_kb)}, "
                     f"growth {'-' if growth is None else f'{growth:+.2f}%'}, peak {peak / 1024:.0f}, "
                     f"trend after warm-up {_signed(result.rss_trend_mib_per_min)} MiB/min; "
                     f"samples: {', '.join(minute)}")
    for problem in result.status_problems[:5]:
        lines.append(f"  WatchStatus: {problem}")
    for problem in (result.server_errors + result.server_warnings)[:5]:
        lines.append(f"  server log: {problem}")
    for problem in t.examples[:10]:
        lines.append(f"  example: {problem}")
    lines.append("PASS" if not failed else "FAIL: " + "; ".join(failed))
    return "\n".join(lines)


def _signed(x: float | None) -> str:
    return "-" if x is None else f"{x:+.2f}"


def _mib(kb: int | None) -> str:
    return "-" if kb is None else f"{kb / 1024:.0f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--concurrency", type=int, default=128, help="closed-loop clients (default 128)")
    parser.add_argument("--models", type=int, default=20, help="bundles (default 20)")
    parser.add_argument("--reload-every", type=float, default=30.0,
                        help="seconds between hot reloads, one model each, in turn (default 30)")
    parser.add_argument("--client-processes", type=int, default=2,
                        help="processes the clients are spread over (default 2)")
    parser.add_argument("--mix", choices=("uniform", "zipf"), default="uniform", help="traffic mix over the models")
    parser.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent s (default 1.0)")
    parser.add_argument("--request-timeout", type=float, default=30.0,
                        help="client-side deadline per request, in seconds (default 30)")
    parser.add_argument("--rss-every", type=float, default=2.0, help="seconds between RSS samples (default 2)")
    parser.add_argument("--progress-every", type=float, default=10.0, help="seconds between progress lines (default 10)")
    parser.add_argument("--max-rss-growth", type=float, default=5.0, help="RSS growth limit, percent (default 5)")
    parser.add_argument("--server-log", type=Path, help="copy the server's log here at the end")
    args = parser.parse_args(argv)
    if args.concurrency < 1 or args.models < 1 or not 1 <= args.client_processes <= args.concurrency:
        parser.error("need --concurrency >= 1, --models >= 1 and 1 <= --client-processes <= --concurrency")

    from safetensors.numpy import load_file

    with tempfile.TemporaryDirectory(prefix="xlaserve-soak-") as tmp:
        root = Path(tmp)
        os.chmod(root, 0o700)
        repo = root / "models"
        started = time.perf_counter()
        names = export_bundles(repo, args.models)
        models = [ModelSpec(name, i, 64 + 8 * i) for i, name in enumerate(names)]
        initial = {m.name: load_file(str(repo / m.name / "weights.safetensors"))["w"] for m in models}
        assert all(initial[m.name].shape == (m.width, m.width) for m in models)
        print(f"exported {args.models} bundles in {time.perf_counter() - started:.1f}s", file=sys.stderr)
        with client_processes(args, models, initial) as (processes, shared):
            server = Server(root / "server", repo, {"model_control_mode": "dynamic",
                                                    "cache_dir": str(root / "cache")})
            try:
                print(f"server ready in {server.wait_ready():.1f}s (pid {server.process.pid}); "
                      f"RSS {read_rss_kb(server.process.pid) / 1024:.0f} MiB before load", file=sys.stderr)
                result = asyncio.run(soak(args, root, repo, server, models, processes, shared))
            finally:
                server.stop()
                log = server.log()
                if args.server_log:
                    args.server_log.write_text(log)
    result.server_errors = [line for line in log.splitlines() if re.search(r"\bERROR\b|Traceback", line)]
    result.server_warnings = [line for line in log.splitlines() if re.search(r"\bWARNING\b", line)]
    failed = failures(result, args.max_rss_growth)
    print(summarize(result, args, failed), file=sys.stderr)
    t = result.tally
    print(json.dumps({
        "duration_s": args.duration, "concurrency": args.concurrency, "models": args.models,
        "reload_every_s": args.reload_every, "client_processes": args.client_processes, "mix": args.mix,
        "sent": t.sent, "ok": t.ok, "wrong": t.wrong, "stale": t.stale, "statuses": dict(t.statuses),
        "internal": t.statuses["INTERNAL"], "client_errors": dict(t.client_errors),
        "reloads": [[r.model, r.version, r.confirmed_after_s] for r in result.reloads],
        "rss_warm_kb": result.rss_warm_kb, "rss_end_kb": result.rss_end_kb,
        "rss_growth_pct": result.rss_growth_pct, "rss_warm_from_s": round(result.warm_from_s, 1),
        "rss_trend_mib_per_min": result.rss_trend_mib_per_min, "server_cores": round(result.server_cores, 2),
        "client_cpu_s": [round(c, 1) for c in result.client_cpu_s], "server_error_lines": len(result.server_errors),
        "server_warning_lines": len(result.server_warnings),
        "rss_samples": [[round(s, 1), kb] for s, kb in result.rss_samples],
        "passed": not failed}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
