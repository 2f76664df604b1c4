"""The example ``img_mean`` sums pixels exactly (rows added pairwise in uint16, then int32) before
its one float32 division, whatever the pixels: all 255 is the largest each partial sum gets."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from examples import reference
from examples.export_examples import img_mean


@pytest.mark.parametrize("fill", ["zeros", "max", "random"])
def test_img_mean_is_the_exact_integer_mean(fill):
    shape = (3, *reference.IMG_SHAPE)
    x = {"zeros": np.zeros(shape, np.uint8), "max": np.full(shape, 255, np.uint8),
         "random": np.random.default_rng(1).integers(0, 256, shape, dtype=np.uint8)}[fill]
    [out] = jax.jit(img_mean)(x)
    exact = x.reshape(3, -1).sum(axis=1, dtype=np.int64) / x[0].size
    assert out.shape == (3, 1) and out.dtype == np.float32
    np.testing.assert_allclose(np.asarray(out)[:, 0], exact, rtol=2 ** -23)
    np.testing.assert_allclose(out, reference.img_mean_ref(x), rtol=2 ** -23)
    if fill == "max":
        assert (np.asarray(out) == 255).all()
