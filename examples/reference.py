"""NumPy reference implementations of the example models, for tests to compare server outputs.

Every function takes and returns row-major arrays with the batch first, as a client sends them.
The weights are generated here from fixed seeds, so this module is the one source of truth that
``export_examples.py`` bundles; ``load_weights`` reads them back from an exported bundle.
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

MLP_HIDDEN = 512
IMG_SHAPE = (224, 224, 3)
CNN_IMAGE = (32, 32, 3)
CNN_CLASSES = 10
# (name, kernel height, kernel width, in channels, out channels, stride)
CNN_CONVS = (("conv1", 3, 3, 3, 8, 1), ("conv2", 3, 3, 8, 16, 2))


@functools.cache
def mlp_weights() -> dict[str, np.ndarray]:
    """``w``: 512x512 float32, the same matrix as the peer servers' ``mlp``."""
    w = (np.random.default_rng(0).standard_normal((MLP_HIDDEN, MLP_HIDDEN)).astype(np.float32)
         / np.float32(np.sqrt(MLP_HIDDEN)))
    w.flags.writeable = False
    return {"w": w}


@functools.cache
def cnn_weights() -> dict[str, np.ndarray]:
    """He-initialised conv (HWIO) and dense weights, small random biases, from ``default_rng(1)``.

    The biases are non-zero so that a test catches a bundle that binds them wrongly.
    """
    rng = np.random.default_rng(1)
    weights: dict[str, np.ndarray] = {}
    for name, kh, kw, cin, cout, _stride in CNN_CONVS:
        fan_in = kh * kw * cin
        weights[f"{name}.w"] = (rng.standard_normal((kh, kw, cin, cout))
                                * np.sqrt(2.0 / fan_in)).astype(np.float32)
        weights[f"{name}.b"] = (0.1 * rng.standard_normal(cout)).astype(np.float32)
    features = CNN_CONVS[-1][4]
    weights["dense.w"] = (rng.standard_normal((features, CNN_CLASSES))
                          * np.sqrt(2.0 / features)).astype(np.float32)
    weights["dense.b"] = (0.1 * rng.standard_normal(CNN_CLASSES)).astype(np.float32)
    for array in weights.values():
        array.flags.writeable = False
    return weights


def load_weights(bundle_dir: str | Path) -> dict[str, np.ndarray]:
    """The weights stored in an exported bundle (empty if it has none)."""
    path = Path(bundle_dir) / "weights.safetensors"
    return load_file(str(path)) if path.exists() else {}


def simple_ref(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Triton's ``simple``: (INPUT0 + INPUT1, INPUT0 - INPUT1) on int32 [B, 16], wrapping."""
    a = np.asarray(a, dtype=np.int32)
    b = np.asarray(b, dtype=np.int32)
    with np.errstate(over="ignore"):
        return a + b, a - b


def mlp_ref(x: np.ndarray) -> np.ndarray:
    """tanh(x @ W) on float32 [B, 512]."""
    x = np.asarray(x, dtype=np.float32).reshape(-1, MLP_HIDDEN)
    return np.tanh(x @ mlp_weights()["w"]).astype(np.float32)


def img_mean_ref(x: np.ndarray) -> np.ndarray:
    """Per-sample mean of all pixels of uint8 [B, 224, 224, 3], as float32 [B, 1]."""
    x = np.asarray(x)
    b = x.shape[0]
    return x.reshape(b, -1).mean(axis=1, dtype=np.float64).astype(np.float32).reshape(b, 1)


def cnn_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The example CNN on uint8 NHWC [B, 32, 32, 3]: (logits float32 [B, 10], label int32 [B])."""
    weights = cnn_weights()
    h = np.asarray(x, dtype=np.uint8).astype(np.float32) / np.float32(255.0)
    for name, _kh, _kw, _cin, _cout, stride in CNN_CONVS:
        h = _conv2d_same(h, weights[f"{name}.w"], stride) + weights[f"{name}.b"]
        h = np.maximum(h, np.float32(0.0))
    pooled = h.mean(axis=(1, 2), dtype=np.float32)
    logits = (pooled @ weights["dense.w"] + weights["dense.b"]).astype(np.float32)
    return logits, np.argmax(logits, axis=1).astype(np.int32)


def _conv2d_same(x: np.ndarray, w: np.ndarray, stride: int) -> np.ndarray:
    """NHWC x HWIO convolution with XLA's SAME padding (the odd pixel goes at the high end)."""
    _, height, width, _ = x.shape
    kh, kw, _, cout = w.shape
    out_h, out_w = -(-height // stride), -(-width // stride)
    pad_h = max((out_h - 1) * stride + kh - height, 0)
    pad_w = max((out_w - 1) * stride + kw - width, 0)
    x = np.pad(x, ((0, 0), (pad_h // 2, pad_h - pad_h // 2), (pad_w // 2, pad_w - pad_w // 2), (0, 0)))
    out = np.zeros((x.shape[0], out_h, out_w, cout), dtype=np.float32)
    for i in range(kh):
        for j in range(kw):
            patch = x[:, i:i + stride * out_h:stride, j:j + stride * out_w:stride, :]
            out += patch @ w[i, j]
    return out
