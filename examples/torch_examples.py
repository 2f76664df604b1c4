"""PyTorch models exported with ``xlaserve export --torch``, served, and checked through the server.

    python examples/torch_examples.py [OUT_DIR] [--models encoder,resnet18] [--serve]

Needs ``pip install -e ".[examples-torch]"`` (torchvision, for ResNet-18; the encoder alone needs
only the ``export-torch`` extra). Nothing is downloaded: both models are randomly initialised
from fixed seeds.

- ``resnet18``: ``torchvision.models.resnet18(weights=None)``, seed 0. image float32 NCHW
  [B, 3, 224, 224] -> output float32 [B, 1000] (logits). Compiled sizes 1, 2, 4, 8.
- ``encoder``: :class:`TinyEncoder`, a two-layer transformer encoder written here, seed 0.
  tokens int32 [B, 16] -> {"logits": float32 [B, 4], "embedding": float32 [B, 64]}.
  Compiled sizes 1, 4, 8.

Each is exported (and verified against eager PyTorch) to OUT_DIR (default ``examples/models``).
With ``--serve`` the script then starts ``xlaserve run`` over OUT_DIR, sends each model a batch of
3 with the Triton client, and compares the answers with the model in eager PyTorch, printing the
largest errors; it exits 1 if any element is outside the verification's default f32 tolerance.

The same exports from the command line::

    xlaserve export --torch examples/torch_examples.py:encoder --input tokens:int32:16 \\
        --batch-sizes 1,4,8 --out examples/models/encoder
    xlaserve export --torch examples/torch_examples.py:resnet18 --input image:float32:3,224,224:whcn \\
        --batch-sizes 1,2,4,8 --out examples/models/resnet18
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # run as a script from anywhere, without installing xlaserve
    sys.path.insert(0, str(_REPO))

from xlaserve.export import TensorSpec  # noqa: E402

DEFAULT_OUT_DIR = _REPO / "examples" / "models"

#: The encoder's sizes: tokens per sequence, vocabulary, model width, heads, layers, classes.
SEQUENCE, VOCAB, WIDTH, HEADS, LAYERS, CLASSES = 16, 128, 64, 4, 2, 4


class EncoderLayer(nn.Module):
    """Pre-norm self-attention and MLP blocks, each with a residual connection."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        # [B, T, W] -> [B, heads, T, W / heads]
        q, k, v = (z.reshape(b, t, self.heads, width // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(width // self.heads)
        attended = (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, width)
        x = x + self.proj(attended)
        return x + self.mlp(self.norm2(x))


class TinyEncoder(nn.Module):
    """Token and position embeddings, :data:`LAYERS` encoder layers, a final norm, mean pooling
    and a linear classifier. ``forward(tokens)`` takes int32 or int64 ids [B, SEQUENCE] and
    returns ``{"logits": [B, CLASSES], "embedding": [B, WIDTH]}``."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Parameter(torch.randn(1, SEQUENCE, WIDTH) * 0.02)
        self.layers = nn.ModuleList(EncoderLayer(WIDTH, HEADS) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.classifier = nn.Linear(WIDTH, CLASSES)

    def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.tokens(tokens) + self.positions
        for layer in self.layers:
            x = layer(x)
        pooled = self.norm(x).mean(dim=1)
        return {"logits": self.classifier(pooled), "embedding": pooled}


def encoder() -> TinyEncoder:
    """The example encoder, seed 0, in eval mode."""
    torch.manual_seed(0)
    return TinyEncoder().eval()


def resnet18() -> nn.Module:
    """torchvision's ResNet-18 with random weights (seed 0), in eval mode."""
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None).eval()


#: name -> (factory, inputs, compiled batch sizes)
MODELS = {
    "encoder": (encoder, [TensorSpec("tokens", "int32", "xn", {"x": SEQUENCE})], (1, 4, 8)),
    "resnet18": (resnet18, [TensorSpec("image", "float32", "whcn", {"c": 3, "h": 224, "w": 224})],
                 (1, 2, 4, 8)),
}


def export(name: str, out_dir: Path, sizes=None, progress=None) -> Path:
    """Export model ``name`` to ``out_dir / name`` (verified); returns the bundle directory."""
    from xlaserve.export import export_torch

    factory, inputs, default_sizes = MODELS[name]
    result = export_torch(out_dir / name, factory(), inputs=inputs,
                          compiled_batch_sizes=sizes or default_sizes, progress=progress)
    return result.bundle


def sample(name: str, batch: int, seed: int = 3) -> np.ndarray:
    """A request's input for model ``name``: random token ids or a standard normal image."""
    rng = np.random.default_rng(seed)
    if name == "encoder":
        return rng.integers(0, VOCAB, (batch, SEQUENCE)).astype(np.int32)
    return rng.standard_normal((batch, 3, 224, 224)).astype(np.float32)


def eager(name: str, model: nn.Module, x: np.ndarray) -> dict[str, np.ndarray]:
    """The model's outputs in eager PyTorch, by the names the bundle gives them."""
    with torch.no_grad():
        out = model(torch.from_numpy(x))
    return {k: v.numpy() for k, v in out.items()} if isinstance(out, dict) else {"output": out.numpy()}


def check_through_server(url: str, names, batch: int = 3) -> int:
    """Query each model at ``url`` with the Triton client, compare every output with eager
    PyTorch under the verification's default f32 tolerance, print one line per output and
    return how many elements fell outside it."""
    import tritonclient.grpc as grpcclient

    from xlaserve.export import DEFAULT_TOLERANCES, compare

    atol, rtol = DEFAULT_TOLERANCES["f32"]
    outside = 0
    client = grpcclient.InferenceServerClient(url)
    try:
        for name in names:
            factory, inputs, _ = MODELS[name]
            x = sample(name, batch)
            tensor = grpcclient.InferInput(inputs[0].name, list(x.shape),
                                           "INT32" if x.dtype == np.int32 else "FP32")
            tensor.set_data_from_numpy(x)
            result = client.infer(name, [tensor])
            for output, want in eager(name, factory(), x).items():
                got = result.as_numpy(output)
                abs_err, rel_err, bad = compare(want, got, atol, rtol)
                outside += bad
                print(f"{name} {output} {list(got.shape)} through the server: max abs error {abs_err:.3g},"
                      f" max rel error {rel_err:.3g}, {bad} elements outside atol {atol:g} x scale + rtol {rtol:g}")
    finally:
        client.close()
    return outside


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--models", default="encoder,resnet18")
    p.add_argument("--serve", action="store_true", help="serve OUT_DIR and compare through the server")
    args = p.parse_args()
    names = args.models.split(",")
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        p.error(f"--models: unknown {unknown}; expected some of {sorted(MODELS)}")
    for name in names:
        print(f"wrote {export(name, args.out, progress=print)}")
    if not args.serve:
        return 0
    from benchmarks._servers import xlaserve

    with xlaserve(args.out) as (url, _):
        outside = check_through_server(url, names)
    return 0 if outside == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
