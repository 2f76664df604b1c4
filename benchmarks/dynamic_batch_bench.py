"""Dynamic-batch bundle against per-size modules: ``python -m benchmarks.dynamic_batch_bench``.

The Flax example (examples/flax_classifier.py, an NNX CNN on uint8 [B,32,32,3]) is exported
twice with the same six compiled batch sizes: once as six per-size modules, once as one
``model.mlir`` with a symbolic batch that the loader specializes to each size. Printed:

1. bundle size: the module files, and the whole bundle directory (weights and manifest included),
   for StableHLO text (``model.mlir``, the default) and portable artifacts (``--bytecode``);
2. load time of the text bundles with a cold executable cache, measured two ways, the forms
   alternating round by round: ``load_bundle`` in this process (read, validate, specialize,
   compile: the load itself; wall time and this process's CPU time, which other work on a
   shared machine disturbs less), and the real server from process start to /readyz 200 on a
   repository holding just that bundle, with a fresh ``cache_dir`` each time.

Goals (issue 17): dynamic load time at most 1.1x the per-size one, dynamic bundle at most 1/4
of the per-size bundle's size.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SIZES = (1, 2, 4, 8, 16, 32)
FORMS = ("per_size", "dynamic")


def export_both(repo: Path, blocks: int) -> None:
    """Both forms as text (``per_size``, ``dynamic``) and as bytecode (``per_size_bc``, ...) of
    the example with ``blocks`` residual blocks (the example has 2)."""
    from flax import nnx

    from examples.flax_classifier import Classifier
    from xlaserve.export import TensorSpec, export_flax

    image = TensorSpec("image", "u8", "cwhn", {"c": 3, "w": 32, "h": 32})
    for suffix in ("", "_bc"):
        for form in FORMS:
            started = time.perf_counter()
            model = Classifier(nnx.Rngs(0), blocks=blocks)
            export_flax(repo / f"{form}{suffix}", model, inputs=[image], compiled_batch_sizes=SIZES,
                        output_names=["logits", "label"], dynamic_batch=form == "dynamic", verify=False,
                        bytecode=bool(suffix))
            print(f"exported {form}{suffix}: {time.perf_counter() - started:.2f}s")


def sizes(bundle: Path) -> tuple[int, int]:
    files = [p for p in bundle.iterdir() if p.is_file()]
    return (sum(p.stat().st_size for p in files if ".mlir" in p.name), sum(p.stat().st_size for p in files))


def load_in_process(bundle: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one load with no executable cache."""
    from xlaserve.bundle import load_bundle
    from xlaserve.runtime.pjrt import Device

    device = Device("cpu")
    started, cpu = time.perf_counter(), time.process_time()
    load_bundle(bundle, 1, device)          # no executable cache: every size compiled
    return time.perf_counter() - started, time.process_time() - cpu


def load_in_server(bundle: Path, work: Path) -> float:
    from benchmarks.lifecycle_bench import Server

    repo = work / "repo"
    repo.mkdir(parents=True)
    (repo / bundle.name).symlink_to(bundle, target_is_directory=True)
    server = Server(work, repo, {"model_control_mode": "static", "cache_dir": str(work / "cache")})
    try:
        return server.wait_ready()
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each measurement (default 5)")
    parser.add_argument("--blocks", type=int, default=2, help="residual blocks of the model (default 2, the example's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="xlaserve-dynamic-bench-") as tmp:
        root = Path(tmp)
        export_both(root / "models", args.blocks)
        for suffix, what in (("", "text"), ("_bc", "bytecode")):
            found = {form: sizes(root / "models" / f"{form}{suffix}") for form in FORMS}
            for form in FORMS:
                print(f"{form} ({what}): modules {found[form][0]} bytes, bundle {found[form][1]} bytes")
            (per_modules, per_total), (dyn_modules, dyn_total) = found["per_size"], found["dynamic"]
            print(f"size dynamic/per-size ({what}): modules {dyn_modules / per_modules:.3f},"
                  f" whole bundle {dyn_total / per_total:.3f} (goal: at most 0.25)")

        timings: dict[str, dict[str, list[float]]] = {how: {f: [] for f in FORMS}
                                                      for how in ("load_bundle wall", "load_bundle cpu", "server")}
        for round_ in range(args.rounds):
            order = FORMS if round_ % 2 == 0 else FORMS[::-1]
            for form in order:
                wall, cpu = load_in_process(root / "models" / form)
                timings["load_bundle wall"][form].append(wall)
                timings["load_bundle cpu"][form].append(cpu)
                timings["server"][form].append(load_in_server(root / "models" / form, root / f"s{round_}{form}"))
        for how, by_form in timings.items():
            medians = {form: statistics.median(values) for form, values in by_form.items()}
            shown = ", ".join(f"{form} median {medians[form]:.2f}s ({' '.join(f'{v:.2f}' for v in by_form[form])})"
                              for form in FORMS)
            print(f"cold load, {how}: {shown}; dynamic/per-size {medians['dynamic'] / medians['per_size']:.3f}"
                  " (goal: at most 1.1)")


if __name__ == "__main__":
    main()
