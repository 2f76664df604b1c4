"""How an xlaserve worker fares against issue 14's denial-of-service attacks.

    python scripts/attack_probe.py [ATTACK ...] [--time-limit SECONDS] [--list]

Exports the ``simple`` and ``mlp`` example bundles to a temporary repository, then, for each attack
named (all of them by default, in the issue table's order), starts a fresh worker
(``python -m xlaserve run NODE --ready-file F`` with the default node settings on loopback), runs
the attack from ``tests/h2attacks.py`` while a well-behaved Triton client keeps calling ``simple``
on its own connection, stops the worker, and prints one row per attack with the verdict against
the issue's three goals:

- rss:    the worker's RSS grows by at most 64 MB during the attack and is back within 16 MB after
- close:  the attacking connection is closed within 1 s of crossing the limit (n/a where the
          attack crosses no limit; for empty_header_name the stream must be reset or GOAWAY sent)
- legit:  the well-behaved client gets every answer, with p99 at most 3x its quiet p99

The well-behaved client's verdict compares two windows a few seconds apart, so run the probe on an
otherwise idle machine: other processes' load shows up as latency. The header line gives the
load average. Each attack is bounded (about 20 s with the worker's start and stop); --time-limit bounds the run:
attacks that would start after it are reported as not run. Exit status 0 if every attack run was
withstood, 1 otherwise.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples.export_examples import export_mlp, export_simple  # noqa: E402
from tests import h2attacks  # noqa: E402
from tests.conftest import serve  # noqa: E402

PER_ATTACK_S = 25.0     # the most one attack takes, with its worker's start and stop


def _executed_rows(server, model: str) -> float:
    """Rows the worker has executed for ``model`` (its xlaserve_batch_rows histogram's sum)."""
    status, text = server.get("/metrics")
    match = re.search(rf'^xlaserve_batch_rows_sum{{model="{model}"}} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if status == 200 and match else 0.0


def probe(name: str, repo: Path, workdir: Path) -> tuple[h2attacks.Measurement, h2attacks.Verdict, str]:
    attack = h2attacks.ATTACKS[name]
    with serve(workdir / name, repo) as server:
        rows_before = _executed_rows(server, "mlp")
        m = h2attacks.measure(attack, ("127.0.0.1", server.grpc_port), server.process.pid)
        extra = ""
        if name == "rapid_reset":
            executed = _executed_rows(server, "mlp") - rows_before
            extra = f"; {executed:,.0f} of the reset requests executed"
        tracebacks = server.log().count("Traceback")
        if tracebacks:
            extra += f"; {tracebacks} traceback(s) in the worker's log"
    return m, h2attacks.judge(m), extra


def _mark(ok: bool | None) -> str:
    return "n/a" if ok is None else ("ok" if ok else "FAIL")


def row(name: str, m: h2attacks.Measurement, v: h2attacks.Verdict, extra: str) -> str:
    o = m.outcome
    if o.closed is None:
        closed = "not closed" + (", stopped reading" if o.stalled else "")
    else:
        closed = f"{o.closed} {o.close_delay:.2f} s after limit"
        if o.goaway_code is not None:
            closed += f" ({h2attacks.error_name(o.goaway_code)})"
    if m.close_goal == "reject":
        closed = "RST_STREAM" if o.first_rst_after is not None else closed
    legit = f"{m.quiet_p99_ms:.1f} → {m.attack_p99_ms:.1f} ms"
    if m.legit_failures:
        legit += f", {m.legit_failures}/{m.legit_requests} failed ({m.legit_errors[0][:60]})"
    verdict = "withstood" if v.withstood else "FAILS " + ", ".join(
        goal for goal, ok in (("rss", v.rss), ("close", v.close), ("legit", v.legit)) if ok is False)
    return (f"| {name} | {verdict} | {_mark(v.rss)} +{m.rss_peak_growth_mb:.0f} / +{m.rss_after_growth_mb:.0f} MB "
            f"| {_mark(v.close)} {closed} | {_mark(v.legit)} {legit} "
            f"| {o.bytes_sent / 2**20:,.1f} MiB, {o.frames_sent:,} frames, {o.seconds:.1f} s | {o.note}{extra} |")


HEADER = ("| attack | verdict | rss: peak / after | close | legit p99: quiet → attack | sent | what happened |\n"
          "|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("attacks", nargs="*", metavar="ATTACK", help="attacks to run (default: all)")
    parser.add_argument("--time-limit", type=float, default=600.0, metavar="SECONDS",
                        help="no attack starts once this would be exceeded (default 600)")
    parser.add_argument("--list", action="store_true", help="list the attacks and exit")
    args = parser.parse_args(argv)
    if args.list:
        for attack in h2attacks.ATTACKS.values():
            print(f"{attack.name:24} {attack.table_row}")
        return 0
    unknown = [a for a in args.attacks if a not in h2attacks.ATTACKS]
    if unknown:
        parser.error(f"unknown attack(s) {', '.join(unknown)}; --list shows them")
    names = args.attacks or list(h2attacks.ATTACKS)
    started = time.monotonic()
    print(f"attack probe, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC: goals rss <= "
          f"{h2attacks.RSS_BUDGET_MB:.0f} MB growth (back within {h2attacks.RSS_RETURN_MB:.0f} MB), close within "
          f"{h2attacks.CLOSE_WITHIN_S:.0f} s of the limit, legit p99 <= {h2attacks.P99_FACTOR:.0f}x quiet; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (the legit verdict needs a quiet machine)\n")
    print(HEADER, flush=True)
    failed = 0
    with tempfile.TemporaryDirectory(prefix="attack-probe-") as tmp:
        repo = Path(tmp) / "models"
        export_simple(repo, compiled_batch_sizes=(1, 8))
        export_mlp(repo, compiled_batch_sizes=(1, 8))
        for name in names:
            if time.monotonic() - started + PER_ATTACK_S > args.time_limit:
                print(f"| {name} | not run (--time-limit {args.time_limit:.0f} s) | | | | | |", flush=True)
                failed += 1
                continue
            try:
                m, v, extra = probe(name, repo, Path(tmp))
            except Exception as exc:     # one attack's failure to run is its row, not the end of the probe
                failed += 1
                print(f"| {name} | could not run: {type(exc).__name__}: {str(exc).splitlines()[0][:200]} "
                      f"| | | | | |", flush=True)
                continue
            failed += not v.withstood
            print(row(name, m, v, extra), flush=True)
    print(f"\n{len(names) - failed} of {len(names)} withstood, in {time.monotonic() - started:.0f} s; "
          f"load average {os.getloadavg()[0]:.1f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
