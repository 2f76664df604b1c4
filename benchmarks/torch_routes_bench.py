"""Each lowering route of ``export --torch`` (:data:`xlaserve.export.ROUTES`) alone on each
model of examples/torch_zoo.py: whether it lowers the model, and how long ``torch.export`` plus
that route's decomposition and lowering take at one batch size (no compile, no verification;
the zoo benchmark verifies what the default export makes).

    python -m benchmarks.torch_routes_bench [--models gpt2,fpn] [--batch 2]

One more row, ``shifted_window_mask``, is the attention mask of torchvision's Swin built as it
builds it (slice assignment with negative starts and open ends, ``mask[-k:, -k:] = n``), added to
the input: transformers' SwinModel (in the zoo) builds its mask without slice assignment. Rows as
each model finishes, then the table as Markdown.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from examples import torch_zoo  # noqa: E402
from xlaserve.export import TensorSpec, sample_inputs  # noqa: E402
from xlaserve.export.from_torch import ROUTES, Functional, lower_module, state_weights  # noqa: E402


class ShiftedWindowMask(nn.Module):
    """``x + mask``, the mask of a 16x16 window grid shifted by 2 as torchvision's
    ``shifted_window_attention`` writes it (window 8, shift 4: nine regions)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(16, 16)
        count = 0
        for rows in ((0, -8), (-8, -4), (-4, None)):
            for columns in ((0, -8), (-8, -4), (-4, None)):
                mask[rows[0]:rows[1], columns[0]:columns[1]] = count
                count += 1
        return x + mask


MODELS = {**torch_zoo.MODELS,
          "shifted_window_mask": (ShiftedWindowMask, [TensorSpec("x", "f32", "whn", {"h": 16, "w": 16})])}


def measure(name: str, batch: int) -> dict:
    factory, inputs = MODELS[name]
    module = factory().eval()
    weights = state_weights(module)
    wrapper = Functional(module, list(weights))
    row = {"model": name}
    for route in ROUTES:
        started = time.perf_counter()
        try:
            lower_module(wrapper, list(weights.values()), sample_inputs(inputs, batch, 0), (route,))
            row[route] = ("ok", time.perf_counter() - started, "")
        except Exception as exc:
            row[route] = ("fail", time.perf_counter() - started, " ".join(f"{type(exc).__name__}: {exc}".split())[:160])
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args(argv)
    rows = []
    for name in args.models.split(","):
        rows.append(measure(name, args.batch))
        print(rows[-1], flush=True)
    print("\n| model | " + " | ".join(f"{r} (s)" for r in ROUTES) + " | first failure |")
    print("|---|" + "---|" * len(ROUTES) + "---|")
    for row in rows:
        cells = " | ".join(f"{row[r][0]} ({row[r][1]:.1f})" for r in ROUTES)
        failure = next((row[r][2] for r in ROUTES if row[r][2]), "")
        print(f"| {row['model']} | {cells} | {failure} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
