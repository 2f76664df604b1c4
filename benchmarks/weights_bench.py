"""Weight-cache benchmarks (issue 4). Prints numbers; see docs/benchmarks.md for recorded runs.

  python -m benchmarks.weights_bench cold [--sizes-mb 1 16 128 512]
      In process, real cpu device: per size, cold call (weights evicted) minus warm call,
      against bytes / host-to-device bandwidth measured in the same run.
  python -m benchmarks.weights_bench density [--seconds 60] [--configs ...] [--budget-ratio 10]
          [--discipline fifo] [--rounds N] [--tree before=/path --tree after=/path]
      Real server + Triton client: 100 bundles of mixed sizes totalling 10x the budget, Zipf(1.0)
      over them at concurrency 16; budgeted (prefetch on/off), all resident, all unpinned. Also
      reports the server's RSS against the sum of the weights, misses per request, and (with
      several trees or rounds) medians and ratios to the same tree's all-resident run.
  python -m benchmarks.weights_bench sweep [--seconds 20] [--catalog 1 2 5 10] [--policies lru gdsf]
          [--popularity zipf:0.6 zipf:1.0 zipf:1.2 uniform shift:1.0] [--shift-seconds 30]
      Issue 25's sweep: per popularity and catalog/budget ratio, each policy's throughput and p99
      against all-resident, and its copies per reference against Belady's MIN on the run's own
      recorded references.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import yaml

from benchmarks.weight_bundles import FEATURES, clone_weight_bundle, export_weight_bundle

MB = 1 << 20


# ---- cold call ------------------------------------------------------------------------------

def cold(sizes_mb: list[int], repeats: int) -> None:
    import trio

    from xlaserve.bundle import load_bundle
    from xlaserve.runtime.pjrt import Device
    from xlaserve.runtime.residency import Budget
    from xlaserve.runtime.weights import WeightCache
    from xlaserve.worker.executor import Executor

    device = Device("cpu")
    tmp = _scratch("xlaserve-cold-")
    print(f"{'size':>8} {'warm ms':>9} {'cold ms':>9} {'cold-warm':>10} {'bytes/bw ms':>12} {'bw GB/s':>8} "
          f"{'goal ms':>8} {'ok':>3}")
    for size in sizes_mb:
        big = load_bundle(export_weight_bundle(tmp, f"m{size}", size * MB, mark=1.0, compiled_batch_sizes=(1,)),
                          1, device)
        small = load_bundle(export_weight_bundle(tmp, f"s{size}", MB, mark=2.0, compiled_batch_sizes=(1,)),
                            1, device)
        x = np.ones((1, FEATURES), np.float32)

        async def main():
            limiter = trio.CapacityLimiter(1)
            cache = WeightCache(device, limiter, Budget(big.weight_bytes + MB, 1.0, 0), prefetch=False)
            executor = Executor(device, limiter)
            await cache.admit(big)
            await cache.admit(small)

            async def call(model):
                t = time.perf_counter()
                w = await cache.ensure_resident(model)
                await executor.run(model, 1, w, [{"input": x}], [1])
                return time.perf_counter() - t
            host = big.weights.read()                   # the raw transfer, interleaved with the calls
            colds, warms, bws = [], [], []
            for _ in range(repeats):
                t = time.perf_counter()
                out = device.put_weights(host)
                bws.append(big.weight_bytes / (time.perf_counter() - t))
                del out
                await call(small)                       # evicts big
                colds.append(await call(big))
                warms.append(await call(big))
            return colds, warms, bws
        colds, warms, bws = trio.run(main)
        bw = statistics.median(bws)
        warm, cold_ = statistics.median(warms), statistics.median(colds)
        ideal = big.weight_bytes / bw
        goal = 1.25 * ideal + 1e-3
        print(f"{size:>6}MB {warm * 1e3:>9.2f} {cold_ * 1e3:>9.2f} {(cold_ - warm) * 1e3:>10.2f} "
              f"{ideal * 1e3:>12.2f} {bw / 1e9:>8.2f} {goal * 1e3:>8.2f} {'yes' if cold_ - warm <= goal else 'NO':>3}")
        for p in tmp.iterdir():
            if p.name.endswith(str(size)):
                shutil.rmtree(p)


def _scratch(prefix: str) -> Path:
    """A temporary directory removed when the benchmark exits."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, tmp, True)
    return tmp


# ---- density --------------------------------------------------------------------------------

SIZES_KB = (256, 512, 1024, 2048, 4096)


def build_catalog(repo: Path, count: int) -> dict[str, int]:
    repo.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    templates = {kb: export_weight_bundle(repo, f"t{kb}", kb * 1024, compiled_batch_sizes=(1, 4, 16))
                 for kb in SIZES_KB}
    sizes = {}
    for i in range(count):
        kb = int(rng.choice(SIZES_KB))
        clone_weight_bundle(templates[kb], f"m{i:03d}", float(i))
        sizes[f"m{i:03d}"] = kb * 1024
    for t in templates.values():
        shutil.rmtree(t)
    return sizes


def build_variant_catalog(repo: Path, archs: int, variants: int, hidden: int) -> tuple[dict[str, int], dict[str, int]]:
    """``archs`` MLP architectures x ``variants`` bundles each that differ only in their weights
    (benchmarks/catalog_bench.py: fine-tuned variants sharing one executable per architecture).
    Returns each bundle's weight bytes and input width."""
    from benchmarks.catalog_bench import bundle_name, export_catalog, width_of
    export_catalog(repo, archs, variants, hidden, (1, 4, 16))
    sizes, features = {}, {}
    for arch in range(archs):
        for variant in range(variants):
            name = bundle_name(arch, variant)
            sizes[name] = 2 * width_of(arch) * hidden * 4
            features[name] = width_of(arch)
    return sizes, features


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def warm(url: str, names: list[str], features: dict[str, int] | None = None, threads: int = 8) -> None:
    """One request to every model, so that each has been loaded once before the clock starts:
    without it the all-resident reference pays a first load per model inside the measurement
    (about 800 of them in 8 s over a catalog of 1,000)."""
    import tritonclient.grpc as grpcclient

    def work(part: list[str]) -> None:
        client = grpcclient.InferenceServerClient(url)
        for name in part:
            width = (features or {}).get(name, FEATURES)
            inp = grpcclient.InferInput("input", [1, width], "FP32")
            inp.set_data_from_numpy(np.ones((1, width), np.float32))
            client.infer(name, [inp])
    pool = [threading.Thread(target=work, args=(names[i::threads],)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()


def popularity_weights(popularity: str, n: int) -> np.ndarray:
    """``zipf:<s>``, ``uniform`` or ``shift:<s>`` (Zipf(s) whose ranking changes every
    ``shift_seconds``): the probability of each rank."""
    kind, _, s = popularity.partition(":")
    if kind == "uniform":
        p = np.ones(n)
    elif kind in ("zipf", "shift"):
        p = 1.0 / np.arange(1, n + 1) ** float(s or 1.0)
    else:
        raise SystemExit(f"unknown popularity {popularity!r}; expected zipf:<s>, uniform or shift:<s>")
    return p / p.sum()


def drive(url: str, names: list[str], seconds: float, concurrency: int, *, popularity: str = "zipf:1.0",
          shift_seconds: float = 30.0, features: dict[str, int] | None = None) -> dict:
    """``concurrency`` closed-loop clients for ``seconds``, each request's model drawn from
    ``popularity`` over ``names``. Under ``shift:<s>`` the ranking is redrawn every
    ``shift_seconds`` (the same rankings, at the same times, for every server driven).
    ``features``: each model's input width (default :data:`FEATURES` for all)."""
    import tritonclient.grpc as grpcclient
    p = popularity_weights(popularity, len(names))
    shifting = popularity.startswith("shift")
    rankings = [np.random.default_rng(7 + k).permutation(len(names))     # popularity not tied to size
                for k in range(1 + (int(seconds // shift_seconds) if shifting else 0))]
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    start = time.perf_counter()
    stop = start + seconds

    def worker(seed: int) -> None:
        client = grpcclient.InferenceServerClient(url)
        rng = np.random.default_rng(seed)
        inputs: dict[int, object] = {}

        def input_for(name: str):
            width = (features or {}).get(name, FEATURES)
            inp = inputs.get(width)
            if inp is None:
                inp = inputs[width] = grpcclient.InferInput("input", [1, width], "FP32")
                inp.set_data_from_numpy(np.ones((1, width), np.float32))
            return inp
        mine = []
        while (now := time.perf_counter()) < stop:
            order = rankings[int((now - start) // shift_seconds)] if shifting else rankings[0]
            name = names[order[rng.choice(len(names), p=p)]]
            inp = input_for(name)
            t = time.perf_counter()
            try:
                client.infer(name, [inp])
            except Exception as exc:
                with lock:
                    errors[0] += 1
                    if errors[0] == 1:
                        print(f"first error: {exc}", flush=True)
                continue
            mine.append(time.perf_counter() - t)
        with lock:
            latencies.extend(mine)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lat = np.array(latencies)
    return {"rps": len(lat) / seconds, "requests": len(lat), "p50": float(np.percentile(lat, 50)) * 1e3,
            "p99": float(np.percentile(lat, 99)) * 1e3, "errors": errors[0]}


def density(seconds: float, configs: list[str], count: int, concurrency: int, *, budget_ratio: float = 10.0,
            discipline: str = "fifo", trees: dict[str, Path] | None = None, rounds: int = 1,
            sched: dict[str, dict] | None = None, archs: tuple[int, int, int] | None = None) -> None:
    """Each round runs every config on every tree (checkout) in turn, so that a before/after
    comparison on a shared machine sees the same background load; the summary gives medians
    over the rounds and, per round, each config's throughput and p99 against the same tree's
    all-resident run of that round. ``sched``: extra ``scheduler:`` keys per tree name."""
    from tests.conftest import ROOT, serve

    trees = trees or {"this": ROOT}
    tmp = _scratch("xlaserve-density-")
    features = None
    if archs is None:
        sizes = build_catalog(tmp / "models", count)
    else:
        sizes, features = build_variant_catalog(tmp / "models", *archs)
        count = len(sizes)
    total = sum(sizes.values())
    budget = int(total / budget_ratio)
    wiggle = 0.1
    arena = int(budget / (1 - wiggle))
    print(f"catalog: {count} bundles, {total / MB:.1f} MiB of weights; budget {budget / MB:.1f} MiB "
          f"(1/{budget_ratio:g}); discipline {discipline}; Zipf(1.0), {concurrency} closed-loop clients, "
          f"{seconds:g} s per run; trees: {', '.join(f'{k}={v}' for k, v in trees.items())}")
    settings = {
        "budgeted": ({"device_memory_bytes": arena}, {}, {}),
        "budgeted-noprefetch": ({"device_memory_bytes": arena}, {}, {"XLASERVE_WEIGHT_PREFETCH": "0"}),
        "budgeted-prefetch": ({"device_memory_bytes": arena}, {}, {"XLASERVE_WEIGHT_PREFETCH": "1"}),
        "all-resident": ({}, {}, {}),
        "unpinned-warm": ({"device_memory_bytes": arena},
                          {"models": {n: {"residency": "unpinned"} for n in sizes}}, {}),
    }
    settings["unpinned-cold"] = settings["unpinned-warm"]
    results: dict[tuple[str, str], list[dict]] = {}
    copy_time = memcpy_seconds(sizes, budget)
    print("memcpy of one model's bytes (host copy -> budget-sized area), median us by size: "
          + ", ".join(f"{n >> 10} KiB {t * 1e6:.0f}" for n, t in sorted(copy_time.items())), flush=True)
    for r in range(rounds):
        for tree_name, tree in trees.items():
            for name in configs:
                runtime, models, env = settings[name]
                glob = {"runtime": {"backend": "cpu", "weight_cache_wiggle_fraction": wiggle, **runtime},
                        "scheduler": {"discipline": discipline, **(sched or {}).get(tree_name, {}), **models}}
                with serve(tmp / f"{tree_name}-{name}", tmp / "models", glob, env=env, timeout=600,
                           root=tree) as server:
                    warm(server.url, sorted(sizes), features)
                    rss = rss_bytes(server.process.pid)
                    before = _counters(server)
                    with page_cache_dropped(name.endswith("-cold")):
                        result = drive(server.url, sorted(sizes), seconds, concurrency, features=features)
                    after = _counters(server)
                counters = {k: after[k] - before.get(k, 0.0) for k in after}
                result["misses_per_request"] = counters["misses"] / max(1, result["requests"])
                result["loads_per_request"] = counters["loads"] / max(1, result["requests"])
                result["miss_us"], result["miss_over_memcpy"], result["load_over_memcpy"] = miss_over_memcpy(
                    counters, sizes, copy_time)
                results.setdefault((tree_name, name), []).append(result)
                print(f"round {r + 1} {tree_name:>8} {name:>20}: {result['rps']:8.1f} req/s  "
                      f"p50 {result['p50']:7.2f} ms  p99 {result['p99']:7.2f} ms  errors {result['errors']}  "
                      f"RSS after load {rss / MB:.0f} MiB  misses/req {result['misses_per_request']:.3f}  "
                      f"loads/req {result['loads_per_request']:.3f}  "
                      f"miss {result['miss_us'] * 1e6:.0f} us = {result['miss_over_memcpy']:.2f}x memcpy "
                      f"(its copy {result['load_over_memcpy']:.2f}x)  "
                      + "  ".join(f"{k} {int(v)}" for k, v in counters.items() if ":" not in k), flush=True)
    print("\nmedians over rounds (ratios: per round against the same tree's all-resident, then the median)")
    for (tree_name, name), runs in results.items():
        line = (f"{tree_name:>8} {name:>20}: {statistics.median(x['rps'] for x in runs):8.1f} req/s  "
                f"p99 {statistics.median(x['p99'] for x in runs):7.2f} ms  "
                f"misses/req {statistics.median(x['misses_per_request'] for x in runs):.3f}  "
                f"loads/req {statistics.median(x['loads_per_request'] for x in runs):.3f}  "
                f"miss {statistics.median(x['miss_us'] for x in runs) * 1e6:.0f} us "
                f"= {statistics.median(x['miss_over_memcpy'] for x in runs):.2f}x memcpy "
                f"(its copy {statistics.median(x['load_over_memcpy'] for x in runs):.2f}x)")
        base = results.get((tree_name, "all-resident"))
        if base and name != "all-resident":
            line += (f"  throughput/all-resident {statistics.median(x['rps'] / b['rps'] for x, b in zip(runs, base)):.2f}"
                     f"  p99/all-resident {statistics.median(x['p99'] / b['p99'] for x, b in zip(runs, base)):.2f}")
        print(line)


def sweep(seconds: float, count: int, concurrency: int, *, popularities: list[str], catalogs: list[float],
          policies: list[str], discipline: str, shift_seconds: float, rounds: int) -> None:
    """Issue 25's sweep on a live server: per popularity, the catalog all resident, then at each
    catalog/budget ratio each replacement policy with the weight trace on. Per run: throughput
    and p99 against the all-resident run of the same popularity and round, and the copies per
    request (misses plus prefetches: every load) against Belady's MIN replayed over the run's
    own recorded references with its budget (benchmarks/cache_sim.py)."""
    from benchmarks.cache_sim import compare, recorded
    from tests.conftest import serve

    tmp = _scratch("xlaserve-sweep-")
    sizes = build_catalog(tmp / "models", count)
    total = sum(sizes.values())
    wiggle = 0.1
    print(f"catalog: {count} bundles, {total / MB:.1f} MiB of weights; discipline {discipline}; "
          f"{concurrency} closed-loop clients, {seconds:g} s per run; shift every {shift_seconds:g} s; "
          f"{rounds} round(s)", flush=True)
    rows: dict[tuple[str, float, str], list[dict]] = {}
    for r in range(rounds):
        for pop in popularities:
            runs = [("all-resident", None, None)] + [(policy, x, policy) for x in catalogs for policy in policies]
            base = None
            for label, x, policy in runs:
                runtime = {"backend": "cpu", "weight_cache_wiggle_fraction": wiggle}
                trace = tmp / f"trace-{r}-{pop.replace(':', '')}-{x}-{label}.jsonl"
                if policy is not None:
                    budget = int(total / x)
                    runtime |= {"device_memory_bytes": int(budget / (1 - wiggle)), "weight_eviction": policy,
                                "weight_trace": str(trace)}
                glob = {"runtime": runtime, "scheduler": {"discipline": discipline}}
                with serve(tmp / f"run-{label}", tmp / "models", glob, timeout=600) as server:
                    initial = _counters(server)
                    warm(server.url, sorted(sizes))
                    before = _counters(server)
                    result = drive(server.url, sorted(sizes), seconds, concurrency, popularity=pop,
                                   shift_seconds=shift_seconds)
                    after = _counters(server)
                result["loads_per_request"] = (after["loads"] - before["loads"]) / max(1, result["requests"])
                # against MIN, every load the trace saw: the warm-up's references are in it too
                loads = after["loads"] - initial["loads"]
                if policy is None:
                    base = result
                    print(f"round {r + 1} {pop:>9} {'all-resident':>12}: {result['rps']:8.1f} req/s  "
                          f"p99 {result['p99']:7.2f} ms  errors {result['errors']}", flush=True)
                    continue
                sim = compare(recorded(str(trace)), [])["min"]
                refs = sim.requests
                result["throughput_ratio"] = result["rps"] / base["rps"]
                result["p99_ratio"] = result["p99"] / base["p99"]
                result["copies_per_ref"] = loads / max(1, refs)
                result["min_per_ref"] = sim.misses / max(1, refs)
                result["vs_min"] = loads / sim.misses if sim.misses else (1.0 if loads == 0 else float("inf"))
                rows.setdefault((pop, x, policy), []).append(result)
                trace.unlink(missing_ok=True)
                print(f"round {r + 1} {pop:>9} {x:>4g}x {policy:>6}: {result['rps']:8.1f} req/s "
                      f"({result['throughput_ratio']:.2f} of all-resident)  p99 {result['p99']:7.2f} ms "
                      f"({result['p99_ratio']:.2f})  copies/ref {result['copies_per_ref']:.3f}  "
                      f"MIN {result['min_per_ref']:.3f}  vs MIN {result['vs_min']:.2f}  "
                      f"({refs} refs, errors {result['errors']})", flush=True)
    print("\nmedians over rounds: throughput / all-resident, p99 / all-resident, copies per reference / "
          "Belady's MIN on the run's own references")
    print(f"{'popularity':>10} {'catalog':>8} | " + " | ".join(f"{p:^26}" for p in policies))
    for pop in popularities:
        for x in catalogs:
            cells = []
            for policy in policies:
                runs = rows[(pop, x, policy)]
                cells.append(f"{statistics.median(v['throughput_ratio'] for v in runs):5.2f} "
                             f"{statistics.median(v['p99_ratio'] for v in runs):6.2f} "
                             f"{statistics.median(v['vs_min'] for v in runs):6.2f}x MIN")
            print(f"{pop:>10} {x:>7g}x | " + " | ".join(f"{c:^26}" for c in cells))


def _counters(server) -> dict[str, float]:
    _, text = server.get("/metrics")
    out = {k: _metric(text, f"xlaserve_weight_cache_{k}") for k in ("hits", "misses", "evictions", "prefetch_hits")}
    out["loads"] = _metric(text, "xlaserve_weight_cache_load_seconds_count")    # on demand and prefetch
    out["load_seconds"] = _metric(text, "xlaserve_weight_cache_load_seconds_sum")
    out["miss_seconds"] = _metric(text, "xlaserve_weight_cache_miss_seconds")
    prefix = 'xlaserve_weight_cache_model_misses_total{model="'
    for line in text.splitlines():                  # per model: how many misses
        if line.startswith(prefix):
            name, _, value = line[len(prefix):].partition('"} ')
            out[f"missed:{name}"] = float(value)
    return out


def memcpy_seconds(sizes: dict[str, int], budget: int, passes: int = 5) -> dict[int, float]:
    """Per model size, the median time of one ``numpy.copyto`` of a model's bytes in this process,
    as the server's loads copy them: from one of the catalog's host copies (one buffer per model,
    visited in a shuffled order, so the source is rarely in the CPU's caches) into the next free
    part of an area of the budget's size."""
    rng = np.random.default_rng(2)
    sources = {name: np.ones(n, np.uint8) for name, n in sizes.items()}
    area = np.zeros(budget + max(sizes.values()), np.uint8)
    at = 0
    times: dict[int, list[float]] = {}
    for _ in range(passes):
        for name in rng.permutation(sorted(sources)):
            src = sources[name]
            if at + src.nbytes > budget:
                at = 0
            t = time.perf_counter()
            np.copyto(area[at:at + src.nbytes], src)
            times.setdefault(src.nbytes, []).append(time.perf_counter() - t)
            at += src.nbytes
    return {n: statistics.median(ts) for n, ts in times.items()}


def miss_over_memcpy(counters: dict[str, float], sizes: dict[str, int],
                     copy_time: dict[int, float]) -> tuple[float, float, float]:
    """The server's time per miss (``miss_seconds`` over ``misses``: the whole miss, evictions
    and bookkeeping included), its ratio to memcpys of the missed models' bytes, and the same
    ratio for its load histogram alone (lease, copy and wrap)."""
    misses = counters["misses"]
    memcpy = sum(v * copy_time[sizes[k[7:]]] for k, v in counters.items() if k.startswith("missed:") and k[7:] in sizes)
    if misses <= 0 or memcpy <= 0:
        return 0.0, 0.0, 0.0
    copies = counters["load_seconds"] / memcpy if counters["loads"] == misses else float("nan")   # prefetches too
    return counters["miss_seconds"] / misses, counters["miss_seconds"] / memcpy, copies


@contextlib.contextmanager
def page_cache_dropped(enabled: bool, every: float = 0.05):
    """While enabled, drop the kernel's page cache every ``every`` seconds (needs root), so that
    ``unpinned`` loads read from the disk rather than from memory."""
    if not enabled:
        yield
        return
    done = threading.Event()

    def dropper() -> None:
        while not done.wait(every):
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
    thread = threading.Thread(target=dropper, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "_total ") or line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def rss(count: int) -> None:
    from tests.conftest import serve
    tmp = _scratch("xlaserve-rss-")
    (tmp / "empty").mkdir()
    sizes = build_catalog(tmp / "models", count)
    with serve(tmp / "base", tmp / "empty", {"runtime": {"backend": "cpu"}}) as server:
        base = rss_bytes(server.process.pid)
    with serve(tmp / "full", tmp / "models", {"runtime": {"backend": "cpu"}}, timeout=600) as server:
        full = rss_bytes(server.process.pid)
    weights = sum(sizes.values())
    print(f"RSS empty repo {base / MB:.0f} MiB; with {count} bundles {full / MB:.0f} MiB; weights {weights / MB:.1f} MiB; "
          f"(RSS - base) / weights = {(full - base) / weights:.2f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cold")
    c.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 16, 128, 512])
    c.add_argument("--repeats", type=int, default=7)
    d = sub.add_parser("density")
    d.add_argument("--seconds", type=float, default=60.0)
    d.add_argument("--count", type=int, default=100)
    d.add_argument("--concurrency", type=int, default=16)
    d.add_argument("--configs", nargs="+", default=["budgeted", "budgeted-noprefetch", "all-resident",
                                                   "unpinned-warm"])
    d.add_argument("--budget-ratio", type=float, default=10.0, help="catalog bytes / weight budget")
    d.add_argument("--discipline", default="fifo", choices=("fair", "fifo", "edf"))
    d.add_argument("--rounds", type=int, default=1, help="interleaved rounds (medians reported)")
    d.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                   help="run the server from this checkout (repeat to compare; default: this one)")
    d.add_argument("--archs", default=None, metavar="ARCHSxVARIANTSxHIDDEN",
                   help="the catalog: ARCHS MLP architectures x VARIANTS bundles each that differ only in "
                        "their weights, hidden width HIDDEN (e.g. 10x100x512: 1,000 bundles); default: "
                        "--count bundles of 256 KiB to 4 MiB")
    d.add_argument("--sched", action="append", default=[], metavar="TREE:KEY=VALUE",
                   help="a scheduler key for one tree's runs, e.g. after:cold_defer_dispatches=0 (the same "
                        "checkout may be given twice under two names)")
    w = sub.add_parser("sweep")
    w.add_argument("--seconds", type=float, default=20.0)
    w.add_argument("--count", type=int, default=100)
    w.add_argument("--concurrency", type=int, default=16)
    w.add_argument("--popularity", nargs="+", default=["zipf:0.6", "zipf:1.0", "zipf:1.2", "uniform", "shift:1.0"])
    w.add_argument("--catalog", nargs="+", type=float, default=[1, 2, 5, 10], help="catalog bytes / budget")
    w.add_argument("--policies", nargs="+", default=["lru", "gdsf"])
    w.add_argument("--discipline", default="fair", choices=("fair", "fifo", "edf"))
    w.add_argument("--shift-seconds", type=float, default=30.0, help="shift:<s>: the ranking changes this often")
    w.add_argument("--rounds", type=int, default=1)
    r = sub.add_parser("rss")
    r.add_argument("--count", type=int, default=100)
    args = parser.parse_args(argv)
    if args.cmd == "cold":
        cold(args.sizes_mb, args.repeats)
    elif args.cmd == "density":
        trees = {k: Path(v).resolve() for k, v in (t.split("=", 1) for t in args.tree)} or None
        sched: dict[str, dict] = {}
        for item in args.sched:
            tree, _, kv = item.partition(":")
            key, _, value = kv.partition("=")
            sched.setdefault(tree, {})[key] = yaml.safe_load(value)
        density(args.seconds, args.configs, args.count, args.concurrency, budget_ratio=args.budget_ratio,
                discipline=args.discipline, trees=trees, rounds=args.rounds, sched=sched,
                archs=tuple(int(v) for v in args.archs.split("x")) if args.archs else None)
    elif args.cmd == "sweep":
        sweep(args.seconds, args.count, args.concurrency, popularities=args.popularity, catalogs=args.catalog,
              policies=args.policies, discipline=args.discipline, shift_seconds=args.shift_seconds,
              rounds=args.rounds)
    else:
        rss(args.count)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
