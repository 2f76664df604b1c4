"""Flax example models for the zoo benchmark (benchmarks/torch_zoo_export_bench.py), exported
through the JAX path (:func:`xlaserve.export.export_flax`): random weights, nothing
downloaded.

- ``flax_classifier``: examples/flax_classifier.py's NNX residual classifier (convolutions,
  BatchNorm with moved statistics, dropout off in inference mode). image uint8 [B, 32, 32, 3]
  -> logits f32 [B, 10], label i32 [B].
- ``flax_mnist_cnn``: the Linen CNN of Flax's MNIST example (two 3x3 convolutions with ReLU and
  2x2 average pooling, dense 256, dense 10), its last layer scaled so that its logits reach
  about 10. image float32 [B, 28, 28, 1] -> logits [B, 10].

``MODELS[name]`` is (factory, inputs); a factory returns ``(model, variables)`` (variables None
for NNX), as :func:`xlaserve.export.export_flax` takes them.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from examples import flax_classifier  # noqa: E402
from xlaserve.export import TensorSpec  # noqa: E402


class MnistCNN(linen.Module):
    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = linen.avg_pool(linen.relu(linen.Conv(32, (3, 3))(x)), (2, 2), (2, 2))
        x = linen.avg_pool(linen.relu(linen.Conv(64, (3, 3))(x)), (2, 2), (2, 2))
        x = linen.relu(linen.Dense(256)(x.reshape((x.shape[0], -1))))
        return linen.Dense(10)(x)


def flax_mnist_cnn() -> tuple[Any, Any]:
    model = MnistCNN()
    variables = model.init(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))
    logits = model.apply(variables, jax.random.normal(jax.random.key(2), (8, 28, 28, 1)))
    factor = 10.0 / float(jnp.abs(logits).max())
    last = variables["params"]["Dense_1"]
    variables = {"params": {**variables["params"],
                            "Dense_1": {"kernel": last["kernel"] * factor, "bias": last["bias"] * factor}}}
    return model, variables


def flax_classifier_model() -> tuple[Any, Any]:
    return flax_classifier.create_model(), None


MODELS: dict[str, tuple[Callable[[], tuple[Any, Any]], list[TensorSpec]]] = {
    "flax_classifier": (flax_classifier_model, [TensorSpec("image", "u8", "cwhn", {"c": 3, "w": 32, "h": 32})]),
    "flax_mnist_cnn": (flax_mnist_cnn, [TensorSpec("image", "f32", "cwhn", {"c": 1, "w": 28, "h": 28})]),
}
