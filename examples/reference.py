"""NumPy reference implementations of the example models, for tests to compare server outputs.

Every function takes and returns row-major arrays with the batch first, as a client sends them.
The weights are generated here from fixed seeds, so this module is the one source of truth that
``export_examples.py`` bundles.
"""
from __future__ import annotations

import functools

import numpy as np

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
    return _frozen({"w": w})


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
    return _frozen(weights)


def _frozen(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``weights`` with every array made read-only (the cached values are shared)."""
    for array in weights.values():
        array.flags.writeable = False
    return weights


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


# ---- hooks and meta models ------------------------------------------------------------------
GRADER_IMAGE = (224, 224)        # row-major [B, 224, 224] uint8 (manifest "whn")
GRADER_POOL = 8                  # 8x8 average pooling -> 28x28 features
GRADER_LEVELS = 9                # CORAL logits: one per grade threshold
GRADER_LABELS = (b"none", b"trace", b"minimal", b"mild", b"moderate", b"marked", b"severe", b"grave",
                 b"extreme", b"critical")
GRADER_GAIN = 12.0


@functools.cache
def grader_weights() -> dict[str, np.ndarray]:
    """``t``: increasing thresholds on mean brightness; ``w``: a small texture term per threshold
    (it can make the logits non-monotone, which is where the early stop matters)."""
    rng = np.random.default_rng(2)
    features = (GRADER_IMAGE[0] // GRADER_POOL) * (GRADER_IMAGE[1] // GRADER_POOL)
    weights = {
        "t": np.linspace(0.1, 0.9, GRADER_LEVELS, dtype=np.float32),
        "w": (rng.standard_normal((features, GRADER_LEVELS)) * 2.0).astype(np.float32),
    }
    return _frozen(weights)


def grader_logits_ref(x: np.ndarray) -> np.ndarray:
    """CORAL logits float32 [B, 9] of uint8 [B, 224, 224]."""
    w = grader_weights()
    f = np.asarray(x, dtype=np.uint8).astype(np.float32) / np.float32(255.0)
    b, h, wd = f.shape
    pooled = f.reshape(b, h // GRADER_POOL, GRADER_POOL, wd // GRADER_POOL, GRADER_POOL).mean(axis=(2, 4))
    mean = pooled.mean(axis=(1, 2), keepdims=True)
    texture = (pooled - mean).reshape(b, -1) @ w["w"]
    return (np.float32(GRADER_GAIN) * (mean.reshape(b, 1) - w["t"]) + texture).astype(np.float32)


def coral_grade_ref(logits: np.ndarray) -> np.ndarray:
    """Leading positive logits per row, int64 [B, 1] (vectorised, independent of the hook's loop)."""
    return np.cumprod(np.asarray(logits) > 0, axis=1).sum(axis=1, dtype=np.int64).reshape(-1, 1)


def severity_grader_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(grade int64 [B, 1], label object [B, 1]) as the bundle with its postprocess gives them."""
    grade = coral_grade_ref(grader_logits_ref(x))
    return grade, np.array([[GRADER_LABELS[g]] for g in grade[:, 0]], dtype=object)


DETECTOR_IMAGE = (64, 64, 3)
DETECTOR_GRID = 4                # 4x4 cells of 16x16 pixels, one box proposal each
DETECTOR_CONVS = (("conv1", 3, 3, 3, 8, 2), ("conv2", 3, 3, 8, 8, 2))
DETECTOR_THRESHOLD = 0.5
CLASSIFIER_CROP = (16, 16, 3)
CLASSIFIER_CLASSES = 5
CLASSIFIER_LABELS = (b"ant", b"bee", b"cat", b"dog", b"eel")


@functools.cache
def detector_weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    weights: dict[str, np.ndarray] = {}
    for name, kh, kw, cin, cout, _stride in DETECTOR_CONVS:
        weights[f"{name}.w"] = (rng.standard_normal((kh, kw, cin, cout)) * np.sqrt(2.0 / (kh * kw * cin))).astype(np.float32)
        weights[f"{name}.b"] = (0.1 * rng.standard_normal(cout)).astype(np.float32)
    head = rng.standard_normal((8, 5)) * 2.0
    head[:, 0] *= -2.0  # objectness: bright, textured cells score high
    weights["head.w"] = head.astype(np.float32)
    weights["head.b"] = np.array([-2.4, 0.0, 0.0, 0.0, 0.0], np.float32)
    return _frozen(weights)


def _cell_boxes() -> np.ndarray:
    cell = DETECTOR_IMAGE[0] // DETECTOR_GRID
    ys, xs = np.meshgrid(np.arange(DETECTOR_GRID), np.arange(DETECTOR_GRID), indexing="ij")
    y0, x0 = (ys * cell).reshape(-1), (xs * cell).reshape(-1)
    return np.stack([y0, x0, y0 + cell, x0 + cell], axis=1).astype(np.float32)


def detector_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [B, 64, 64, 3] -> (scores float32 [B, 16], boxes float32 [B, 16, 4] as y0, x0, y1, x1)."""
    w = detector_weights()
    h = np.asarray(x, dtype=np.uint8).astype(np.float32) / np.float32(255.0)
    for name, _kh, _kw, _cin, _cout, stride in DETECTOR_CONVS:
        h = np.maximum(_conv2d_same(h, w[f"{name}.w"], stride) + w[f"{name}.b"], np.float32(0.0))
    b, hh, ww, c = h.shape
    g = DETECTOR_GRID
    pooled = h.reshape(b, g, hh // g, g, ww // g, c).mean(axis=(2, 4)).reshape(b, g * g, c)
    head = pooled @ w["head.w"] + w["head.b"]
    scores = (1.0 / (1.0 + np.exp(-head[..., 0]))).astype(np.float32)
    return scores, _boxes(head[..., 1:], np)


def _boxes(offsets, xp):
    """Box (y0, x0, y1, x1) per cell from 4 head outputs: the centre moves up to 6 pixels from the
    cell's, each half-size is 4 to 10 pixels; clipped to the image. ``xp``: numpy or jax.numpy."""
    cell = DETECTOR_IMAGE[0] // DETECTOR_GRID
    o = offsets * xp.float32(0.25)
    centre = xp.asarray(_cell_boxes()[:, :2] + cell / 2) + xp.float32(6.0) * xp.tanh(o[..., :2])
    half = xp.float32(4.0) + xp.float32(6.0) / (xp.float32(1.0) + xp.exp(-o[..., 2:]))
    boxes = xp.concatenate([centre - half, centre + half], axis=-1)
    return xp.clip(boxes, xp.float32(0.0), xp.float32(DETECTOR_IMAGE[0])).astype(xp.float32)


@functools.cache
def classifier_weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(4)
    weights = {
        "conv.w": (rng.standard_normal((3, 3, 3, 8)) * np.sqrt(2.0 / 27)).astype(np.float32),
        "conv.b": (0.1 * rng.standard_normal(8)).astype(np.float32),
        "dense.w": (rng.standard_normal((8, CLASSIFIER_CLASSES)) * 2.0).astype(np.float32),
        "dense.b": (0.1 * rng.standard_normal(CLASSIFIER_CLASSES)).astype(np.float32),
    }
    return _frozen(weights)


def classifier_ref(crops: np.ndarray) -> np.ndarray:
    """uint8 [K, 16, 16, 3] -> logits float32 [K, 5]."""
    w = classifier_weights()
    h = np.asarray(crops, dtype=np.uint8).astype(np.float32) / np.float32(255.0)
    h = np.maximum(_conv2d_same(h, w["conv.w"], 2) + w["conv.b"], np.float32(0.0))
    return (h.mean(axis=(1, 2)) @ w["dense.w"] + w["dense.b"]).astype(np.float32)


def crop_ref(image: np.ndarray, box: np.ndarray) -> np.ndarray:
    """Nearest-neighbour 16x16 resample of ``box`` (pixels, y0 x0 y1 x1) of ``image`` [H, W, C]."""
    height, width = image.shape[:2]
    lo = np.floor(box[:2]).astype(np.int64)
    hi = np.ceil(box[2:]).astype(np.int64)
    y0, x0 = np.clip(lo, 0, [height - 1, width - 1])
    y1, x1 = max(min(hi[0], height), y0 + 1), max(min(hi[1], width), x0 + 1)
    n = CLASSIFIER_CROP[0]
    ys = y0 + ((np.arange(n) + 0.5) * (y1 - y0) / n).astype(np.int64)
    xs = x0 + ((np.arange(n) + 0.5) * (x1 - x0) / n).astype(np.int64)
    return image[np.ix_(ys, xs)]


def select_and_crop(image: np.ndarray, scores: np.ndarray, boxes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The pipeline's Python step: indices of boxes above the threshold, best first, and their crops."""
    order = np.argsort(-scores, kind="stable")
    keep = order[scores[order] > DETECTOR_THRESHOLD]
    crops = (np.stack([crop_ref(image, boxes[i]) for i in keep]) if len(keep)
             else np.zeros((0, *CLASSIFIER_CROP), np.uint8))
    return keep, crops


def detect_and_classify_ref(image: np.ndarray) -> dict[str, np.ndarray]:
    """The meta model on one uint8 [64, 64, 3] image: boxes [N, 4], scores [N], class_id [N], label [N]."""
    scores, boxes = detector_ref(image[np.newaxis])
    keep, crops = select_and_crop(image, scores[0], boxes[0])
    class_id = (np.argmax(classifier_ref(crops), axis=1).astype(np.int32) if len(keep)
                else np.zeros(0, np.int32))
    return {"boxes": boxes[0][keep], "scores": scores[0][keep], "class_id": class_id,
            "label": np.array([CLASSIFIER_LABELS[c] for c in class_id], dtype=object)}


def pipeline_images(count: int, seed: int = 5) -> np.ndarray:
    """Test images for the two-stage example: dark noise with a few bright rectangles."""
    rng = np.random.default_rng(seed)
    h, w, c = DETECTOR_IMAGE
    images = rng.integers(0, 60, size=(count, h, w, c), dtype=np.uint8)
    for image in images:
        for _ in range(rng.integers(0, 5)):
            y, x = rng.integers(0, h - 8, size=2)
            dy, dx = rng.integers(6, 24, size=2)
            image[y:y + dy, x:x + dx] = rng.integers(120, 256, size=c, dtype=np.uint8)
    return images
