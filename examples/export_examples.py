"""Build the example bundles: ``python examples/export_examples.py [OUT_DIR]``.

OUT_DIR defaults to ``examples/models`` (the repository ``examples/node.yaml`` serves). Everything is
generated from code and fixed seeds, nothing is downloaded, and the output is byte-identical from
run to run. ``examples/reference.py`` holds a NumPy implementation of each model.

- ``simple``:   Triton's ``simple``: INPUT0, INPUT1 int32 [B, 16] -> OUTPUT0 = sum, OUTPUT1 = difference
- ``mlp``:      input float32 [B, 512] -> output = tanh(input @ w)
- ``img_mean``: input uint8 [B, 224, 224, 3] -> output float32 [B, 1], per-sample pixel mean
- ``cnn``:      input uint8 NHWC [B, 32, 32, 3] -> logits float32 [B, 10], label int32 [B]
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # run as a script from anywhere, without installing xlaserve
    sys.path.insert(0, str(_REPO))

from examples import reference
from xlaserve.export import TensorSpec, export_bundle

DEFAULT_OUT_DIR = _REPO / "examples" / "models"

# Full f32 precision on every backend: without it a GPU may use TF32 for matmuls and convolutions
# and drift from the NumPy references.
_HIGHEST = jax.lax.Precision.HIGHEST


def simple(input0, input1):
    return input0 + input1, input0 - input1


def mlp(w, x):
    return (jnp.tanh(jnp.matmul(x, w, precision=_HIGHEST)),)


def img_mean(x):
    # Sum exactly in int32 (255 * 224 * 224 * 3 < 2**31), divide once in f32: a float32 running
    # sum over 150k pixels would drift from the float64 reference.
    b = x.shape[0]
    total = jnp.sum(x.reshape(b, -1).astype(jnp.int32), axis=1)
    mean = total.astype(jnp.float32) / jnp.float32(x[0].size)
    return (mean.reshape(b, 1),)


CNN_WEIGHTS_ORDER = ["conv1.w", "conv1.b", "conv2.w", "conv2.b", "dense.w", "dense.b"]


def cnn(conv1_w, conv1_b, conv2_w, conv2_b, dense_w, dense_b, x):
    """Weights in ``CNN_WEIGHTS_ORDER``, then uint8 NHWC images."""
    strides = [stride for *_, stride in reference.CNN_CONVS]
    h = x.astype(jnp.float32) / jnp.float32(255.0)
    for w, b, stride in ((conv1_w, conv1_b, strides[0]), (conv2_w, conv2_b, strides[1])):
        h = jax.lax.conv_general_dilated(
            h, w, window_strides=(stride, stride), padding="SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=_HIGHEST,
        )
        h = jax.nn.relu(h + b)
    pooled = jnp.mean(h, axis=(1, 2))
    logits = jnp.matmul(pooled, dense_w, precision=_HIGHEST) + dense_b
    return logits, jnp.argmax(logits, axis=1).astype(jnp.int32)


def export_simple(model_repo: Path, compiled_batch_sizes: Sequence[int] = (1, 2, 4, 8)) -> Path:
    row = {"x": 16}
    return export_bundle(
        model_repo / "simple",
        simple,
        inputs=[TensorSpec("INPUT0", "i32", "xn", row), TensorSpec("INPUT1", "i32", "xn", row)],
        outputs=[TensorSpec("OUTPUT0", "i32", "xn", row), TensorSpec("OUTPUT1", "i32", "xn", row)],
        weights=None,
        compiled_batch_sizes=compiled_batch_sizes,
    )


def export_mlp(
    model_repo: Path, compiled_batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32)
) -> Path:
    features = {"f": reference.MLP_HIDDEN}
    return export_bundle(
        model_repo / "mlp",
        mlp,
        inputs=[TensorSpec("input", "f32", "fn", features)],
        outputs=[TensorSpec("output", "f32", "fn", features)],
        weights=reference.mlp_weights(),
        compiled_batch_sizes=compiled_batch_sizes,
    )


def export_img_mean(
    model_repo: Path, compiled_batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32)
) -> Path:
    height, width, channels = reference.IMG_SHAPE
    return export_bundle(
        model_repo / "img_mean",
        img_mean,
        inputs=[TensorSpec("input", "u8", "cwhn", {"c": channels, "w": width, "h": height})],
        outputs=[TensorSpec("output", "f32", "yn", {"y": 1})],
        weights=None,
        compiled_batch_sizes=compiled_batch_sizes,
    )


def export_cnn(model_repo: Path, compiled_batch_sizes: Sequence[int] = (1, 4, 16)) -> Path:
    height, width, channels = reference.CNN_IMAGE
    return export_bundle(
        model_repo / "cnn",
        cnn,
        inputs=[TensorSpec("input", "u8", "cwhn", {"c": channels, "w": width, "h": height})],
        outputs=[
            TensorSpec("logits", "f32", "zn", {"z": reference.CNN_CLASSES}),
            TensorSpec("label", "i32", "n", {}),
        ],
        weights=reference.cnn_weights(),
        weights_order=CNN_WEIGHTS_ORDER,
        compiled_batch_sizes=compiled_batch_sizes,
    )


EXPORTERS: dict[str, Callable[[Path], Path]] = {
    "simple": export_simple,
    "mlp": export_mlp,
    "img_mean": export_img_mean,
    "cnn": export_cnn,
}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=DEFAULT_OUT_DIR,
                        help=f"model repository to write into (default: {DEFAULT_OUT_DIR})")
    parser.add_argument("--if-missing", action="store_true",
                        help="skip bundles that already exist (what the README's run command uses)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    for name, export in EXPORTERS.items():
        if args.if_missing and (args.out_dir / name / "manifest.yaml").is_file():
            continue
        t0 = time.perf_counter()
        bundle = export(args.out_dir)
        print(f"{name:10s} {time.perf_counter() - t0:6.2f}s  {bundle}")
    print(f"{'total':10s} {time.perf_counter() - started:6.2f}s")


if __name__ == "__main__":
    main()
