"""What does writing a log line cost the serving loop, and what does a fast producer lose?

    python -m benchmarks.log_relay_bench [--lines 200000] [--bytes 120] [--repeat 5]

The supervisor writes every worker line through a :class:`~xlaserve.logrelay.LineRelay`; before,
it wrote each line to stdout itself (``sys.stdout.write`` and ``flush``: one ``write`` a line).
Three cases, each writing ``--lines`` lines of ``--bytes`` bytes as fast as one thread can:

- ``direct``: the old way, to a pipe that a thread reads as fast as it can;
- ``relay, read``: ``LineRelay.put`` to the same kind of pipe, read the same way; the lines the
  relay dropped because the producer outran its writer thread are counted;
- ``relay, stalled``: ``put`` to a pipe nobody reads (after 64 KiB + the buffer, all dropped);
- ``supervisor``: a real :class:`~xlaserve.supervisor.Supervisor` relaying two worker processes
  that print half the lines each as fast as they can, to a pipe read as fast as it can: what the
  producer does per line is the whole relay path (read the worker's pipe, cut lines, format).

Reported: the median over ``--repeat`` runs of the producer's microseconds per line (the time the
loop spends), and for the relay the lines dropped.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import threading
import time

import trio

from xlaserve.config import SupervisorConfig
from xlaserve.logrelay import LineRelay
from xlaserve.supervisor import Supervisor, WorkerExited, WorkerSpec


def _drain(fd: int) -> threading.Thread:
    def read() -> None:
        while os.read(fd, 1 << 16):
            pass
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def direct(lines: list[str]) -> tuple[float, int]:
    read, write = os.pipe()
    reader = _drain(read)
    out = open(write, "w", closefd=True)
    start = time.perf_counter()
    for line in lines:
        out.write(line + "\n")
        out.flush()
    elapsed = time.perf_counter() - start
    out.close()
    reader.join()
    os.close(read)
    return elapsed, 0


def relayed(lines: list[str], *, stalled: bool) -> tuple[float, int]:
    read, write = os.pipe()
    reader = None if stalled else _drain(read)
    relay = LineRelay(write)
    start = time.perf_counter()
    for line in lines:
        relay.put(line)
    elapsed = time.perf_counter() - start
    if reader is None:
        dropped = relay.statistics().dropped_lines
        os.close(read)          # the writer's blocked write fails (EPIPE) and it ends
        relay.close()
    else:
        relay.close(timeout=60)
        dropped = relay.statistics().dropped_lines
        os.close(write)
        reader.join()
        os.close(read)
        return elapsed, dropped
    os.close(write)
    return elapsed, dropped


def supervised(count: int, size: int) -> tuple[float, int]:
    code = f"import sys\nfor i in range({count // 2}): print('w', i, 'x' * {max(0, size - 20)})\nsys.stdout.flush()"
    specs = [WorkerSpec(f"w{n}", (sys.executable, "-c", code)) for n in range(2)]
    read, write = os.pipe()
    reader = _drain(read)
    relay = LineRelay(write)
    # an exit is restarted only after a minute: the run ends when both exited, all output relayed
    config = SupervisorConfig(restart_backoff_initial_seconds=60, restart_backoff_max_seconds=60)
    supervisor = Supervisor(specs, config, write=relay.put)

    async def run() -> float:
        events = supervisor.subscribe()
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(supervisor.run)
            exits = 0
            async for event in events:
                exits += isinstance(event, WorkerExited)
                if exits == len(specs):
                    break
            elapsed = time.perf_counter() - start
            supervisor.stop()
        return elapsed
    elapsed = trio.run(run)
    relay.close(timeout=60)
    os.close(write)
    reader.join()
    os.close(read)
    stats = relay.statistics()
    assert stats.written_lines + stats.dropped_lines == count, stats
    return elapsed, stats.dropped_lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--bytes", type=int, default=120)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    logging.getLogger("xlaserve.supervisor").setLevel(logging.ERROR)   # its restart notices
    lines = [f"[worker{i % 4}] {i:08d} " + "x" * max(0, args.bytes - 19) for i in range(args.lines)]
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; {args.lines} lines of {args.bytes} bytes, "
          f"median of {args.repeat}")
    cases = {"direct": lambda: direct(lines),
             "relay, read": lambda: relayed(lines, stalled=False),
             "relay, stalled": lambda: relayed(lines, stalled=True),
             "supervisor": lambda: supervised(args.lines, args.bytes)}
    for name, case in cases.items():
        runs = [case() for _ in range(args.repeat)]
        per_line = statistics.median(elapsed for elapsed, _ in runs) / args.lines * 1e6
        dropped = statistics.median(d for _, d in runs)
        print(f"{name:16s} {per_line:7.2f} us/line on the producer   dropped: {dropped:.0f} "
              f"({dropped / args.lines:.1%})")


if __name__ == "__main__":
    main()
