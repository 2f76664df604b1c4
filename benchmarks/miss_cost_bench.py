"""Time per weight-cache miss against one memcpy of the model's bytes (issue 25, part 1).

  python -m benchmarks.miss_cost_bench [--backend cpu|cuda] [--sizes-kb 256 1024 4096 16384]
                                       [--tensors 8] [--rounds 7] [--misses 30]
  python -m benchmarks.miss_cost_bench stages [--backend cuda]   # where the time of a load goes
                                                                 # (and of a pinned_host transfer)
  python -m benchmarks.miss_cost_bench profile --sizes-kb 1024    # cProfile of a run of misses
  python -m benchmarks.miss_cost_bench catalog [--catalog-mb 96] [--budget-ratio 5]
                                       # misses of a catalog's models, cold in the CPU's caches

Per size, two models of that many bytes (``--tensors`` f32 tensors each) and a budget that
holds one: every ``ensure_resident`` alternates between them, so each is a miss that evicts the
other. Measured in process with the real device, the real ``WeightCache`` and its own thread
and lock; no server, no execution. "memcpy" is ``numpy.copyto`` of the same number of bytes
into a buffer already written (pages mapped), interleaved with the misses, alternating between
two pairs of buffers as the misses alternate between two models ("hot memcpy": the same pair
every time, so small sizes copy within the CPU's caches). Each round gives a
median; the table shows the median of the rounds and its ratio; the machine may be shared, so
look at the spread (min..max of the rounds' ratios) too.

``catalog``: what a miss is in a server whose catalog is larger than its budget. Per size, as
many models as make ``--catalog-mb`` (at least 16), a budget that holds one in
``--budget-ratio`` of them, and each call asks for a model chosen at random among those not
resident, so every call is a miss and the model's host copy was last read many misses ago (the
catalog is many times the CPU's L2 cache, and ``--catalog-mb`` is meant to exceed its share of
the L3). "memcpy" is then ``numpy.copyto`` of the same bytes from one of as many host buffers,
chosen at random, into a random model-sized part of a budget-sized area: the same cold copy a
miss makes, without the cache. The two-model table above is the other end: both copies hot in
the CPU's caches, where the fixed cost of a miss weighs most.

Uses only APIs that predate issue 25, so the same script measures an older checkout
(``git worktree add /tmp/before <commit>``; run it from there) for a before/after.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from types import MappingProxyType, SimpleNamespace

import numpy as np

KB = 1024
VERBOSE = False
FEATURES = 256


def make_model(tmp: Path, name: str, nbytes: int, tensors: int, fill: float):
    """A ModelVersion with ``tensors`` f32 weights totalling ``nbytes`` (no modules: the cache
    needs none)."""
    from safetensors.numpy import save_file

    from xlaserve.bundle import ModelVersion, read_weights
    bundle = tmp / name
    bundle.mkdir()
    rows = max(1, nbytes // (4 * FEATURES * tensors))
    arrays = {f"w{i:02d}": np.full((rows, FEATURES), fill + i, np.float32) for i in range(tensors)}
    save_file(arrays, str(bundle / "weights.safetensors"))
    manifest = SimpleNamespace(bundle=bundle.name, weights_file="weights.safetensors", weights_order=None)
    weights = read_weights(bundle, manifest)
    return ModelVersion(name, 1, bundle, None, "f", weights, weights.nbytes, MappingProxyType({}), None, 0.0)


def _open_device(backend: str):
    from xlaserve.runtime import pjrt
    if hasattr(pjrt, "configure_client"):
        pjrt.configure_client(backend)
    return pjrt.Device(backend)


def _metrics():
    """The weight cache's Prometheus metrics as a worker has them."""
    from prometheus_client import CollectorRegistry

    from xlaserve.metrics import WeightCacheMetrics
    return WeightCacheMetrics(CollectorRegistry())


def measure(device, tmp: Path, nbytes: int, tensors: int, misses: int,
            metrics: bool = False) -> tuple[float, float, float]:
    """One round: median seconds per miss, per memcpy of the same bytes (alternating buffers,
    as the misses alternate), per memcpy repeated on the same (hot) buffers. ``metrics``: with
    the worker's weight-cache metrics updated on every miss, as in a server."""
    import trio

    from xlaserve.runtime.residency import Budget
    from xlaserve.runtime.weights import WeightCache

    tag = f"{nbytes}-{time.perf_counter_ns()}"
    a = make_model(tmp, f"a{tag}", nbytes, tensors, 1.0)
    b = make_model(tmp, f"b{tag}", nbytes, tensors, 100.0)
    # memcpy like the misses: two sources and two destinations used in turn, so each copy
    # reads and writes bytes last touched two copies ago, as a miss does (its host copy, its
    # extent of the pool); and the hot memcpy (the same buffers every time) for reference
    srcs = [np.ones(a.weight_bytes, np.uint8) for _ in range(2)]
    dsts = [np.zeros(a.weight_bytes, np.uint8) for _ in range(2)]

    async def main():
        extra = {"metrics": _metrics()} if metrics else {}   # without --metrics the call is an older checkout's
        cache = WeightCache(device, trio.CapacityLimiter(1), Budget(a.weight_bytes + a.weight_bytes // 2, 1.0, 0),
                            prefetch=False, **extra)
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run)
            assert await cache.admit(a) == "" and await cache.admit(b) == ""
            await cache.ensure_resident(a)
            await cache.ensure_resident(b)               # warm: both have loaded once
            miss, copy, hot = [], [], []
            for i in range(misses):
                model, mark = (a, 1.0) if i % 2 == 0 else (b, 100.0)
                t = time.perf_counter()
                arrays = await cache.ensure_resident(model)
                miss.append(time.perf_counter() - t)
                t = time.perf_counter()
                np.copyto(dsts[i % 2], srcs[i % 2])
                copy.append(time.perf_counter() - t)
                t = time.perf_counter()
                np.copyto(dsts[i % 2], srcs[i % 2])
                hot.append(time.perf_counter() - t)
                if i < 2:                                # the weights that came back are the model's
                    assert float(np.asarray(arrays[0]).reshape(-1)[0]) == mark
                del arrays
            snap = cache.snapshot()
            if getattr(snap, "pool", None) is not None and VERBOSE:
                print(f"  {nbytes >> 10} KiB: {snap.pool}")
            loads = sum(r.loads for r in snap)
            assert loads >= misses, f"{loads} loads for {misses} misses: not every call missed"
            nursery.cancel_scope.cancel()
        return statistics.median(miss), statistics.median(copy), statistics.median(hot)
    return trio.run(main)


def measure_catalog(device, tmp: Path, nbytes: int, tensors: int, misses: int, catalog_bytes: int,
                    budget_ratio: float, metrics: bool, rng) -> tuple[float, float, int]:
    """One round of ``catalog``: median seconds per miss and per cold memcpy, and the number of
    models."""
    import trio

    from xlaserve.runtime.residency import Budget
    from xlaserve.runtime.weights import WeightCache

    count = max(16, -(-catalog_bytes // nbytes))
    tag = f"{nbytes}-{time.perf_counter_ns()}"
    models = [make_model(tmp, f"m{i}-{tag}", nbytes, tensors, float(i)) for i in range(count)]
    size = models[0].weight_bytes
    budget = int(count * size / budget_ratio)
    sources = [np.full(size, i % 251, np.uint8) for i in range(count)]
    area = np.zeros(budget // size * size, np.uint8)
    slots = len(area) // size

    async def main():
        cache = WeightCache(device, trio.CapacityLimiter(1), Budget(budget, 1.0, 0), prefetch=False,
                            **({"metrics": _metrics()} if metrics else {}))
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run)
            for m in models:
                assert await cache.admit(m) == ""
            for m in models:                              # every one loaded once (slots made, pages mapped)
                await cache.ensure_resident(m)
            miss, copy = [], []
            for i in range(misses):
                cold = [m for m in models if cache.load_estimate(m) > 0]
                model = cold[rng.randrange(len(cold))]
                t = time.perf_counter()
                arrays = await cache.ensure_resident(model)
                miss.append(time.perf_counter() - t)
                if i < 2:                                 # the weights that came back are the model's
                    assert float(np.asarray(arrays[0]).reshape(-1)[0]) == float(models.index(model))
                del arrays
                src, at = sources[rng.randrange(count)], rng.randrange(slots) * size
                t = time.perf_counter()
                np.copyto(area[at:at + size], src)
                copy.append(time.perf_counter() - t)
            assert not cache.last_hit
            nursery.cancel_scope.cancel()
        return statistics.median(miss), statistics.median(copy)
    got = trio.run(main)
    for m in models:
        for f in m.path.iterdir():
            f.unlink()
        m.path.rmdir()
    return got[0], got[1], count


def catalog(args) -> None:
    import random
    device = _open_device(args.backend)
    tmp = Path(tempfile.mkdtemp(prefix="xlaserve-miss-"))
    rng = random.Random(25)
    rounds = _rounds(args, lambda nbytes: measure_catalog(device, tmp, nbytes, args.tensors, args.misses,
                                                          args.catalog_mb << 20, args.budget_ratio, args.metrics, rng))
    _title(args, device, f"catalog {args.catalog_mb} MiB a size, {args.budget_ratio}x the budget, ")
    print(f"{'size':>9} {'models':>7} {'miss us':>9} {'cold memcpy us':>15} {'miss/memcpy':>12} {'rounds min..max':>16} "
          f"{'goal<=2':>8}")
    for kb, got in rounds.items():
        miss, copy, spread = _miss_and_copy(got)
        print(f"{kb:>6}KiB {got[0][2]:>7} {miss * 1e6:>9.1f} {copy * 1e6:>15.1f} {spread}")


def _title(args, device, setting: str = "") -> None:
    print(f"backend {args.backend} ({device.kind}), {args.tensors} tensors per model, {setting}{args.rounds} rounds "
          f"x {args.misses} misses; medians of the rounds' medians; weight-cache metrics "
          f"{'on (as a worker)' if args.metrics else 'off'}")


def _rounds(args, one) -> dict[int, list[tuple]]:
    """``one(nbytes)`` for every size of ``--sizes-kb`` in each of ``--rounds`` rounds, the sizes
    interleaved round by round; by size in KiB, the rounds' results."""
    rounds: dict[int, list[tuple]] = {kb: [] for kb in args.sizes_kb}
    for _ in range(args.rounds):
        for kb in args.sizes_kb:
            rounds[kb].append(one(kb * KB))
    return rounds


def _miss_and_copy(got: list[tuple]) -> tuple[float, float, str]:
    """The rounds' median miss and memcpy (the first two of each round's tuple), and the ratio
    columns: median, the rounds' min..max, whether within the goal."""
    miss = statistics.median(r[0] for r in got)
    copy = statistics.median(r[1] for r in got)
    ratios = sorted(r[0] / r[1] for r in got)
    return miss, copy, (f"{miss / copy:>12.2f} {ratios[0]:>7.2f}..{ratios[-1]:<7.2f} "
                        f"{'yes' if miss / copy <= 2 else 'no':>8}")


def table(args) -> None:
    device = _open_device(args.backend)
    tmp = Path(tempfile.mkdtemp(prefix="xlaserve-miss-"))
    rounds = _rounds(args, lambda nbytes: measure(device, tmp, nbytes, args.tensors, args.misses, args.metrics))
    _title(args, device)
    print(f"{'size':>9} {'miss us':>9} {'memcpy us':>10} {'miss/memcpy':>12} {'rounds min..max':>16} {'goal<=2':>8} "
          f"{'hot memcpy us':>14} {'miss/hot':>9}")
    for kb, got in rounds.items():
        miss, copy, spread = _miss_and_copy(got)
        hot = statistics.median(h for _, _, h in got)
        print(f"{kb:>6}KiB {miss * 1e6:>9.1f} {copy * 1e6:>10.1f} {spread} {hot * 1e6:>14.1f} {miss / hot:>9.2f}")
    if len(rounds) > 1:
        # a catalog drawing its models' sizes evenly from these (weights_bench's density catalog
        # uses 256 KiB .. 4 MiB): the time its misses take over the time of memcpys of their bytes
        misses = sum(statistics.median(m for m, _, _ in got) for got in rounds.values())
        copies = sum(statistics.median(c for _, c, _ in got) for got in rounds.values())
        print(f"a catalog of these sizes in equal numbers: {misses * 1e6:.0f} us of misses for {copies * 1e6:.0f} us "
              f"of memcpy, {misses / copies:.2f}x")


def _median_us(fn, n=200) -> float:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e6


def stages(args) -> None:
    """The pieces of a load, each timed alone (medians of 200): what the old path paid for, and
    the pieces of a transfer from page-locked host memory (the cuda path)."""
    import jax
    import trio
    device = _open_device(args.backend)
    med = _median_us

    async def hop():
        await trio.to_thread.run_sync(lambda: None)
    hops = []

    async def hops_main():
        for _ in range(200):
            t = time.perf_counter()
            await hop()
            hops.append(time.perf_counter() - t)
    trio.run(hops_main)
    print(f"backend {args.backend} ({device.kind}), {args.tensors} tensors per model, jax {jax.__version__}")
    print(f"trio.to_thread.run_sync of nothing: {statistics.median(hops) * 1e6:.1f} us")
    print(f"{'size':>9} {'memcpy':>8} {'alloc+copy':>11} {'device_put':>11} {'put_weights':>12}   (us)")
    for kb in args.sizes_kb:
        per = kb * KB // args.tensors // 4
        host = [np.ones(per, np.float32) for _ in range(args.tensors)]
        dst = [np.zeros_like(h) for h in host]
        memcpy = med(lambda: [np.copyto(d, h) for d, h in zip(dst, host)])
        fresh = med(lambda: [np.copyto(np.empty_like(h), h) for h in host])

        def put():
            jax.block_until_ready(jax.device_put(dst, jax.devices(args.backend)[0]))
        print(f"{kb:>6}KiB {memcpy:>8.1f} {fresh:>11.1f} {med(put):>11.1f} {med(lambda: device.put_weights(host)):>12.1f}")
    transfer_stages(device, args)


def transfer_stages(device, args) -> None:
    """A load from page-locked host memory (``pinned_host``: what ``Device.host_store`` keeps on
    cuda; the cpu client has one too), piece by piece. Columns (us, medians):

    * start: ``Device.start_weights`` returning (the batched copy enqueued, not waited for);
    * start+block: start, then ``block_until_ready`` (``Device.load_weights``' cuda path);
    * start+poll: start, then ``is_ready`` polled in a loop (the cache's cuda path, less Trio):
      the transfer's own time, without a blocking wait's wake-up;
    * block(ready): ``block_until_ready`` of arrays already done (the wait's fixed cost);
    * device_put: the path before this change, ``jax.device_put(list, memory_kind="device",
      may_alias=False)`` under x64, then blocked for;
    * pageable: a plain NumPy list (not page-locked) put with ``jax.device_put`` and blocked for;
    * in thread: start+block in ``trio.to_thread.run_sync`` (the old cache path, hop included);
    * GB/s: the bytes over start+poll.
    """
    import jax
    import trio
    dev = device._device
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    target = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    print(f"transfer from pinned_host ({'the cache path' if device.transfers_async else 'not the cache path here'})")
    print(f"{'size':>9} {'start':>8} {'start+block':>12} {'start+poll':>11} {'block(ready)':>13} {'device_put':>11} "
          f"{'pageable':>9} {'in thread':>10} {'GB/s':>6}   (us)")
    for kb in args.sizes_kb:
        per = kb * KB // args.tensors // 4
        numpy_host = [np.full(per, float(i), np.float32) for i in range(args.tensors)]
        with jax.enable_x64(True):
            host = tuple(jax.device_put(numpy_host, pinned))
        jax.block_until_ready(host)
        held = []

        def start():
            held.append(device.start_weights(host))

        def start_block():
            device.wait_weights(device.start_weights(host))

        def start_poll():
            arrays = device.start_weights(host)
            while not device.weights_ready(arrays):
                pass
            device.wait_weights(arrays)

        done = device.wait_weights(device.start_weights(host))

        def old_put():
            with jax.enable_x64(True):
                jax.block_until_ready(jax.device_put(list(host), target, may_alias=False))

        def pageable():
            jax.block_until_ready(jax.device_put(numpy_host, dev))

        t_start = _median_us(start, 100)
        jax.block_until_ready(held)
        held.clear()
        t_block = _median_us(start_block)
        t_poll = _median_us(start_poll)
        t_ready = _median_us(lambda: device.wait_weights(done))
        t_old = _median_us(old_put)
        t_page = _median_us(pageable)
        hops = []

        async def threaded():
            for _ in range(100):
                t = time.perf_counter()
                await trio.to_thread.run_sync(start_block)
                hops.append(time.perf_counter() - t)
        trio.run(threaded)
        t_thread = statistics.median(hops) * 1e6
        got = device.wait_weights(device.start_weights(host))
        assert float(np.asarray(got[-1])[0]) == float(args.tensors - 1), "the transfer gave other bytes"
        print(f"{kb:>6}KiB {t_start:>8.1f} {t_block:>12.1f} {t_poll:>11.1f} {t_ready:>13.1f} {t_old:>11.1f} "
              f"{t_page:>9.1f} {t_thread:>10.1f} {kb * KB / t_poll / 1e3:>6.1f}")


def profile(args) -> None:
    device = _open_device(args.backend)
    tmp = Path(tempfile.mkdtemp(prefix="xlaserve-miss-"))
    prof = cProfile.Profile()
    prof.enable()
    for kb in args.sizes_kb:
        measure(device, tmp, kb * KB, args.tensors, args.misses * 10, args.metrics)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", default="table", choices=("table", "stages", "profile", "catalog"))
    parser.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--sizes-kb", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--misses", type=int, default=30)
    parser.add_argument("--metrics", action="store_true",
                        help="update the worker's weight-cache metrics on every miss, as a server does")
    parser.add_argument("--catalog-mb", type=int, default=96, help="catalog: MiB of models per size")
    parser.add_argument("--budget-ratio", type=float, default=5.0, help="catalog: the catalog over the budget")
    args = parser.parse_args()
    {"table": table, "stages": stages, "profile": profile, "catalog": catalog}[args.what](args)


if __name__ == "__main__":
    main()
