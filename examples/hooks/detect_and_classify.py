"""detect_and_classify's model.py: a two-stage pipeline as a meta model.

The detector proposes one box per cell of a 4x4 grid with an objectness score; Python keeps the
boxes scoring above THRESHOLD (a data-dependent number, zero included), crops and resamples each
to 16x16, and the classifier labels all crops of the image in one batch. Both sub-calls go
through the scheduler, so they are coalesced with other traffic for those models.
"""
import numpy as np

from xlaserve import NamedTensor, register_model

THRESHOLD = 0.5
CROP = 16
LABELS = (b"ant", b"bee", b"cat", b"dog", b"eel")


def crop(image: np.ndarray, box: np.ndarray) -> np.ndarray:
    """Nearest-neighbour resample of ``box`` (y0, x0, y1, x1 in pixels) of ``image`` [H, W, C]."""
    height, width = image.shape[:2]
    y0 = min(max(int(np.floor(box[0])), 0), height - 1)
    x0 = min(max(int(np.floor(box[1])), 0), width - 1)
    y1 = max(min(int(np.ceil(box[2])), height), y0 + 1)
    x1 = max(min(int(np.ceil(box[3])), width), x0 + 1)
    ys = y0 + ((np.arange(CROP) + 0.5) * (y1 - y0) / CROP).astype(np.int64)
    xs = x0 + ((np.arange(CROP) + 0.5) * (x1 - x0) / CROP).astype(np.int64)
    return image[ys[:, None], xs[None, :]]


def run(tensors, ctx):
    image = {t.name: t.data for t in tensors}["image"]              # uint8 [64, 64, 3]
    found = ctx.infer("detector", [NamedTensor("image", image[np.newaxis])])
    scores, boxes = found["scores"][0], found["boxes"][0]            # [16], [16, 4]
    keep = np.array([i for i in np.argsort(-scores, kind="stable") if scores[i] > THRESHOLD], dtype=np.int64)
    class_id = np.zeros(0, dtype=np.int32)
    if len(keep):
        crops = np.stack([crop(image, boxes[i]) for i in keep])
        logits = ctx.infer("classifier", [NamedTensor("crop", crops)])["logits"]
        class_id = np.argmax(logits, axis=1).astype(np.int32)
    return [
        NamedTensor("boxes", boxes[keep]),
        NamedTensor("scores", scores[keep]),
        NamedTensor("class_id", class_id),
        NamedTensor("label", np.array([LABELS[c] for c in class_id], dtype=object)),
    ]


register_model("detect_and_classify", run=run)
