"""Build the example bundles: ``python examples/export_examples.py [OUT_DIR]``.

OUT_DIR defaults to ``examples/models`` (the repository ``examples/node.yaml`` serves). Everything is
generated from code and fixed seeds, nothing is downloaded, and the output is byte-identical from
run to run. ``examples/reference.py`` holds a NumPy implementation of each model. The first four
are written by default; ``--hooks`` adds the bundles with Python hooks (their ``model.py`` sources
are ``examples/hooks/*.py``) and the meta model:

- ``simple``:   Triton's ``simple``: INPUT0, INPUT1 int32 [B, 16] -> OUTPUT0 = sum, OUTPUT1 = difference
- ``mlp``:      input float32 [B, 512] -> output = tanh(input @ w)
- ``img_mean``: input uint8 [B, 224, 224, 3] -> output float32 [B, 1], per-sample pixel mean
- ``cnn``:      input uint8 NHWC [B, 32, 32, 3] -> logits float32 [B, 10], label int32 [B]
- ``severity_grader``: INPUT__0 uint8 [B, 224, 224] -> CORAL logits; its model.py postprocess gives
                grade int64 [B, 1] and label BYTES [B, 1] (the seed's bundle, Python hook instead of Julia)
- ``detector``: image uint8 [B, 64, 64, 3] -> scores float32 [B, 16], boxes float32 [B, 16, 4]
- ``classifier``: crop uint8 [K, 16, 16, 3] -> logits float32 [K, 5]
- ``detect_and_classify``: kind: meta; image uint8 [64, 64, 3] -> boxes [N, 4], scores [N],
                class_id [N], label BYTES [N]: detector, then Python crops, then classifier
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import yaml

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # run as a script from anywhere, without installing xlaserve
    sys.path.insert(0, str(_REPO))

from examples import reference
from xlaserve.export import MANIFEST_FILE, TensorSpec, export_bundle
from xlaserve.manifest import FORMAT_VERSION

DEFAULT_OUT_DIR = _REPO / "examples" / "models"
HOOKS_DIR = _REPO / "examples" / "hooks"

# Full f32 precision on every backend: without it a GPU may use TF32 for matmuls and convolutions
# and drift from the NumPy references.
_HIGHEST = jax.lax.Precision.HIGHEST


def simple(input0, input1):
    return input0 + input1, input0 - input1


def mlp(w, x):
    return (jnp.tanh(jnp.matmul(x, w, precision=_HIGHEST)),)


def img_mean(x):
    # Sum exactly in integers, divide once in f32: a float32 running sum over 150k pixels would
    # drift from the float64 reference. Each image is 256 rows of 588 pixels (224 * 224 * 3 = 256 *
    # 588); the rows are added pairwise in uint16 (the first level widens the uint8 halves; at most
    # 256 * 255 = 65,280 < 2**16: exact), halving eight times to one row of 588 partial sums, which
    # are added in int32 (255 * 224 * 224 * 3 < 2**31). XLA's cpu code runs these elementwise adds
    # vectorized at about 3x the speed of a reduce over the rows (``jnp.sum(rows, axis=1)``) with the
    # same result (docs/benchmarks.md, "img_mean: the sum as a tree of adds").
    b = x.shape[0]
    pixels = x[0].size
    rows = x.reshape(b, 256, pixels // 256)
    sums = rows[:, :128].astype(jnp.uint16) + rows[:, 128:].astype(jnp.uint16)
    while sums.shape[1] > 1:
        half = sums.shape[1] // 2
        sums = sums[:, :half] + sums[:, half:]
    total = jnp.sum(sums[:, 0].astype(jnp.int32), axis=1)
    mean = total.astype(jnp.float32) / jnp.float32(pixels)
    return (mean.reshape(b, 1),)


CNN_WEIGHTS_ORDER = ["conv1.w", "conv1.b", "conv2.w", "conv2.b", "dense.w", "dense.b"]


def cnn(conv1_w, conv1_b, conv2_w, conv2_b, dense_w, dense_b, x):
    """Weights in ``CNN_WEIGHTS_ORDER``, then uint8 NHWC images."""
    strides = [stride for *_, stride in reference.CNN_CONVS]
    h = x.astype(jnp.float32) / jnp.float32(255.0)
    for w, b, stride in ((conv1_w, conv1_b, strides[0]), (conv2_w, conv2_b, strides[1])):
        h = _conv(h, w, b, stride)
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


@dataclass(frozen=True)
class BytesSpec:
    """A client-side BYTES tensor (``TensorSpec`` covers what a module can take or give)."""

    name: str
    shape: str
    dims: dict[str, int] = field(default_factory=dict)

    def to_manifest(self) -> dict:
        return {"name": self.name, "dtype": "bytes", "shape": self.shape,
                "dims": {a: self.dims[a] for a in self.shape if a != "n"}}


def _hook_source(name: str) -> str:
    return (HOOKS_DIR / f"{name}.py").read_text()


def _conv(h, w, b, stride):
    h = jax.lax.conv_general_dilated(h, w, window_strides=(stride, stride), padding="SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=_HIGHEST)
    return jax.nn.relu(h + b)


def severity_grader(t, w, x):
    """Weights ``t`` (thresholds), ``w`` (texture term), then uint8 [B, 224, 224]: CORAL logits."""
    b, height, width = x.shape
    p = reference.GRADER_POOL
    f = x.astype(jnp.float32) / jnp.float32(255.0)
    pooled = f.reshape(b, height // p, p, width // p, p).mean(axis=(2, 4))
    mean = pooled.mean(axis=(1, 2), keepdims=True)
    texture = jnp.matmul((pooled - mean).reshape(b, -1), w, precision=_HIGHEST)
    return (jnp.float32(reference.GRADER_GAIN) * (mean.reshape(b, 1) - t) + texture,)


DETECTOR_WEIGHTS_ORDER = ["conv1.w", "conv1.b", "conv2.w", "conv2.b", "head.w", "head.b"]


def detector(conv1_w, conv1_b, conv2_w, conv2_b, head_w, head_b, x):
    strides = [stride for *_, stride in reference.DETECTOR_CONVS]
    h = x.astype(jnp.float32) / jnp.float32(255.0)
    h = _conv(h, conv1_w, conv1_b, strides[0])
    h = _conv(h, conv2_w, conv2_b, strides[1])
    b, hh, ww, c = h.shape
    g = reference.DETECTOR_GRID
    pooled = h.reshape(b, g, hh // g, g, ww // g, c).mean(axis=(2, 4)).reshape(b, g * g, c)
    head = jnp.matmul(pooled, head_w, precision=_HIGHEST) + head_b
    scores = jax.nn.sigmoid(head[..., 0])
    return scores, reference._boxes(head[..., 1:], jnp)


CLASSIFIER_WEIGHTS_ORDER = ["conv.w", "conv.b", "dense.w", "dense.b"]


def classifier(conv_w, conv_b, dense_w, dense_b, x):
    h = _conv(x.astype(jnp.float32) / jnp.float32(255.0), conv_w, conv_b, 2)
    return (jnp.matmul(h.mean(axis=(1, 2)), dense_w, precision=_HIGHEST) + dense_b,)


def export_severity_grader(model_repo: Path, compiled_batch_sizes: Sequence[int] = (1, 3, 6)) -> Path:
    height, width = reference.GRADER_IMAGE
    return export_bundle(
        model_repo / "severity_grader",
        severity_grader,
        inputs=[TensorSpec("INPUT__0", "u8", "whn", {"w": width, "h": height})],
        outputs=[TensorSpec("OUTPUT__0", "f32", "zn", {"z": reference.GRADER_LEVELS})],
        client_outputs=[TensorSpec("grade", "i64", "yn", {"y": 1}), BytesSpec("label", "yn", {"y": 1})],
        weights=reference.grader_weights(),
        weights_order=["t", "w"],
        compiled_batch_sizes=compiled_batch_sizes,
        extra_files={"model.py": _hook_source("severity_grader")},
    )


def export_detector(model_repo: Path, compiled_batch_sizes: Sequence[int] = (1, 4, 8)) -> Path:
    height, width, channels = reference.DETECTOR_IMAGE
    cells = reference.DETECTOR_GRID ** 2
    return export_bundle(
        model_repo / "detector",
        detector,
        inputs=[TensorSpec("image", "u8", "cwhn", {"c": channels, "w": width, "h": height})],
        outputs=[TensorSpec("scores", "f32", "gn", {"g": cells}),
                 TensorSpec("boxes", "f32", "kgn", {"k": 4, "g": cells})],
        weights=reference.detector_weights(),
        weights_order=DETECTOR_WEIGHTS_ORDER,
        compiled_batch_sizes=compiled_batch_sizes,
    )


def export_classifier(model_repo: Path, compiled_batch_sizes: Sequence[int] = (1, 2, 4, 8, 16)) -> Path:
    height, width, channels = reference.CLASSIFIER_CROP
    return export_bundle(
        model_repo / "classifier",
        classifier,
        inputs=[TensorSpec("crop", "u8", "cwhn", {"c": channels, "w": width, "h": height})],
        outputs=[TensorSpec("logits", "f32", "zn", {"z": reference.CLASSIFIER_CLASSES})],
        weights=reference.classifier_weights(),
        weights_order=CLASSIFIER_WEIGHTS_ORDER,
        compiled_batch_sizes=compiled_batch_sizes,
    )


def export_detect_and_classify(model_repo: Path) -> Path:
    """A kind: meta bundle: a manifest of client tensors and the model.py whose run() calls
    ``detector`` and ``classifier``. No modules, no weights."""
    height, width, channels = reference.DETECTOR_IMAGE
    manifest = {
        "format_version": FORMAT_VERSION,
        "name": "detect_and_classify",
        "kind": "meta",
        "client_inputs": [TensorSpec("image", "u8", "cwh", {"c": channels, "w": width, "h": height}).to_manifest()],
        "client_outputs": [TensorSpec("boxes", "f32", "kn", {"k": 4}).to_manifest(),
                           TensorSpec("scores", "f32", "n").to_manifest(),
                           TensorSpec("class_id", "i32", "n").to_manifest(),
                           BytesSpec("label", "n").to_manifest()],
    }
    bundle = model_repo / "detect_and_classify"
    bundle.mkdir(parents=True, exist_ok=True)
    (bundle / "model.py").write_text(_hook_source("detect_and_classify"))
    (bundle / MANIFEST_FILE).write_text(yaml.safe_dump(manifest, sort_keys=False, default_flow_style=None,
                                                         width=100))
    return bundle


EXPORTERS: dict[str, Callable[[Path], Path]] = {
    "simple": export_simple,
    "mlp": export_mlp,
    "img_mean": export_img_mean,
    "cnn": export_cnn,
}

#: Bundles with Python hooks and a meta model (``--hooks``); kept apart so that the default
#: repository stays the four plain models that other tests and benchmarks count on.
HOOK_EXPORTERS: dict[str, Callable[[Path], Path]] = {
    "severity_grader": export_severity_grader,
    "detector": export_detector,
    "classifier": export_classifier,
    "detect_and_classify": export_detect_and_classify,
}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=DEFAULT_OUT_DIR,
                        help=f"model repository to write into (default: {DEFAULT_OUT_DIR})")
    parser.add_argument("--if-missing", action="store_true",
                        help="skip bundles that already exist (what the README's run command uses)")
    parser.add_argument("--hooks", action="store_true",
                        help="also write the bundles with Python hooks: " + ", ".join(HOOK_EXPORTERS))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    exporters = {**EXPORTERS, **(HOOK_EXPORTERS if args.hooks else {})}
    for name, export in exporters.items():
        if args.if_missing and (args.out_dir / name / MANIFEST_FILE).is_file():
            continue
        t0 = time.perf_counter()
        bundle = export(args.out_dir)
        print(f"{name:20s} {time.perf_counter() - t0:6.2f}s  {bundle}")
    print(f"{'total':20s} {time.perf_counter() - started:6.2f}s")


if __name__ == "__main__":
    main()
