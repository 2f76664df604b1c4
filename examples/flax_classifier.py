"""A Flax NNX image classifier, randomly initialised (no downloads), to export with xlaserve:

    xlaserve export examples/flax_classifier.py:create_model --flax \\
        --input image:uint8:32,32,3:cwhn --output logits --output label \\
        --batch-sizes 1,2,4,8,16,32 --dynamic-batch --out models/flax_classifier

``create_model()`` builds the model; its parameters are stored under the names its attributes
give them (``conv1.kernel``, ``bn1.mean``, ``blocks.0.conv.kernel``, ``head.bias``, ...).
``__call__`` takes a batch of uint8 NHWC images and returns ``(logits f32[B, 10], label i32[B])``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

CLASSES = 10


class Block(nnx.Module):
    """conv 3x3 -> batch norm -> relu, with a residual connection."""

    def __init__(self, channels: int, rngs: nnx.Rngs) -> None:
        self.conv = nnx.Conv(channels, channels, (3, 3), padding="SAME", rngs=rngs)
        self.bn = nnx.BatchNorm(channels, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jax.nn.relu(self.bn(self.conv(x)))


class Classifier(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, width: int = 16, blocks: int = 2) -> None:
        self.conv1 = nnx.Conv(3, width, (3, 3), strides=(2, 2), padding="SAME", rngs=rngs)
        self.bn1 = nnx.BatchNorm(width, rngs=rngs)
        self.blocks = nnx.List([Block(width, rngs) for _ in range(blocks)])
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.head = nnx.Linear(width, CLASSES, rngs=rngs)

    def __call__(self, image: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = image.astype(jnp.float32) / 255.0
        x = jax.nn.relu(self.bn1(self.conv1(x)))
        for block in self.blocks:
            x = block(x)
        x = self.dropout(jnp.mean(x, axis=(1, 2)))
        logits = self.head(x)
        return logits, jnp.argmax(logits, axis=1).astype(jnp.int32)


def create_model(seed: int = 0) -> Classifier:
    """The classifier with random weights from ``seed``, its batch statistics moved off their
    initial values (so that exporting them is visible in the outputs), in inference mode."""
    model = Classifier(nnx.Rngs(seed))
    stats = [(path, variable) for path, variable in nnx.iter_graph(model) if isinstance(variable, nnx.BatchStat)]
    for index, (path, variable) in enumerate(stats):
        value = variable[...]
        shift = jax.random.uniform(jax.random.key(seed + 1 + index), value.shape, minval=0.5, maxval=1.5)
        variable[...] = value * shift if path[-1] == "var" else value - 0.1 * shift
    model.eval()
    return model
