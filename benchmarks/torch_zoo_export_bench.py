"""Export the models of examples/torch_zoo.py with ``xlaserve export --torch``'s defaults and
print, for each, whether it exported and verified, its worst error against eager PyTorch as a
fraction of the output's scale, and how long the export took.

    python -m benchmarks.torch_zoo_export_bench [--models bert,convnext] [--batch-sizes 1,4]

Each model is built (seed 0), then :func:`xlaserve.export_torch.export_torch` exports it to a
temporary directory at the given compiled sizes with the default verification (seed 0): export
time is that call's wall time (torch.export, lowering, writing, loading, compiling and verifying
every module). The error columns are the verification's worst output: its largest absolute
error, the output's scale (``max(1, max |reference|)``) and their ratio, which the default f32
tolerance holds to 1e-5. One row per model, then the table as Markdown.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from examples import torch_zoo  # noqa: E402
from xlaserve.export_torch import export_torch  # noqa: E402


def measure(name: str, sizes: list[int], out: Path) -> dict:
    factory, inputs = torch_zoo.MODELS[name]
    model = factory()
    started = time.perf_counter()
    try:
        result = export_torch(out / name, model, inputs=inputs, compiled_batch_sizes=sizes)
    except Exception as exc:                    # reported as a row: the table is what failed
        return {"model": name, "ok": False, "error": " ".join(f"{type(exc).__name__}: {exc}".split())[:200],
                "seconds": time.perf_counter() - started}
    seconds = time.perf_counter() - started
    worst = max(result.verification.checks, key=lambda c: c.max_abs_error / c.scale)
    constants = sum(1 for w in result.weights_order if w.startswith("constant."))
    return {"model": name, "ok": result.verification.ok, "seconds": seconds, "output": worst.output,
            "max_abs_error": worst.max_abs_error, "scale": worst.scale,
            "ratio": worst.max_abs_error / worst.scale, "weights": len(result.weights_order),
            "constant_weights": constants}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(torch_zoo.MODELS))
    parser.add_argument("--batch-sizes", default="1,4")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="zoo-") as tmp:
        for name in args.models.split(","):
            row = measure(name, sizes, Path(tmp))
            rows.append(row)
            print(row, flush=True)
    print(f"\n| model | exported and verified | worst output | max abs error | scale | error / scale |"
          f" export s (sizes {args.batch_sizes}) |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        if "output" not in row:
            print(f"| {row['model']} | **no**: {row['error']} | | | | | {row['seconds']:.1f} |")
            continue
        print(f"| {row['model']} | {'yes' if row['ok'] else '**no**'} | {row['output']} | {row['max_abs_error']:.2g} |"
              f" {row['scale']:.3g} | {row['ratio']:.2g} | {row['seconds']:.1f} |")
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
