"""pjrt.channels_last_activations: a channels-first (NCHW) module's convolutions and the ops
between them run on NHWC values, and the module computes what it did."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from xlaserve.runtime.pjrt import (Device, channels_last_activations, read_signature,
                                   rewrite_depthwise_convolutions)

RNG = np.random.default_rng(5)
NCHW = ("NCHW", "OIHW", "NCHW")


@pytest.fixture(scope="module")
def device() -> Device:
    return Device("cpu")


def _module(fn, *arrays) -> bytes:
    return jax.jit(fn).lower(*arrays).as_text().encode()


def _block(x, w1, w_dw, w_se1, w_se2, w2, scale, shift):
    """An EfficientNet-like block in NCHW, with something of every kind the pass converts: a 1x1
    convolution, BatchNorm (per-channel broadcasts), SiLU, a depthwise 3x3 stride-2 convolution
    with padding, squeeze-and-excitation (a mean over the image, a sigmoid, a broadcast
    multiply), a compare and select, a slice, a pad, a concatenation, average pooling, a
    residual add; then a reshape (a reader left channels-first)."""
    y = lax.conv_general_dilated(x, w1, (1, 1), "VALID", dimension_numbers=NCHW)
    y = y * scale[None, :, None, None] + shift[None, :, None, None]
    y = y * jax.nn.sigmoid(y)
    d = lax.conv_general_dilated(y, w_dw, (2, 2), [(1, 1), (1, 1)], dimension_numbers=NCHW,
                                 feature_group_count=y.shape[1])
    squeezed = d.mean((2, 3))
    gate = jax.nn.sigmoid(jax.nn.relu(squeezed @ w_se1) @ w_se2)
    d = d * gate[:, :, None, None]
    d = jnp.where(d > 0, d, 0.1 * d)
    d = jnp.pad(d[:, :, 1:, :], ((0, 0), (0, 0), (0, 1), (0, 0)))
    z = lax.conv_general_dilated(d, w2, (1, 1), "SAME", dimension_numbers=NCHW)
    z = jnp.concatenate([z, d[:, :z.shape[1]]], axis=1)[:, :z.shape[1]] + z
    pooled = lax.reduce_window(z, 0.0, lax.add, (1, 1, 2, 2), (1, 1, 2, 2), "VALID") / 4.0
    return pooled, pooled.reshape(pooled.shape[0], -1), z


def _arrays(batch: int):
    c_in, c, c_se, c_out = 3, 8, 2, 6
    shapes = [(batch, c_in, 12, 12), (c, c_in, 1, 1), (c, 1, 3, 3), (c, c_se), (c_se, c), (c_out, c, 3, 3), (c,), (c,)]
    return [RNG.standard_normal(s).astype(np.float32) for s in shapes]


def _optimized(device: Device, module: bytes) -> str:
    return device.compile(module).hlo_modules()[0].to_string()


@pytest.mark.parametrize("batch", [1, 3])
def test_the_block_computes_the_same_with_fewer_layout_changes(device, batch):
    arrays = _arrays(batch)
    module = rewrite_depthwise_convolutions(_module(_block, *arrays))
    converted = channels_last_activations(module)
    assert converted != module and channels_last_activations(module) == converted     # deterministic
    assert read_signature(converted) == read_signature(module)
    before = device.execute(device.compile(module), arrays)
    after = device.execute(device.compile(converted), arrays)
    for a, b in zip(after, before):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(b).max())))
    # XLA's cpu convolutions are NHWC: fewer transposes and layout copies are left once the
    # values between them are NHWC too
    def layout_changes(hlo: str) -> int:
        return hlo.count(" transpose(") + hlo.count(" copy(")
    assert layout_changes(_optimized(device, converted)) < layout_changes(_optimized(device, module))


def _parsed(module: bytes) -> str:
    from jax._src.interpreters import mlir as jax_mlir_internal
    from jax._src.lib.mlir import ir
    with jax_mlir_internal.make_ir_context() as ctx:
        return str(ir.Module.parse(module, context=ctx))


def test_every_channels_first_convolution_is_made_channels_last():
    module = channels_last_activations(_module(_block, *_arrays(2)))
    text = _parsed(module)
    assert text.count("stablehlo.convolution") == 3
    assert "[b, f, 0, 1]x" not in text and text.count("[b, 0, 1, f]x[o, i, 0, 1]->[b, 0, 1, f]") == 3


def test_a_concatenation_of_convolutions_runs_channels_last(device):
    """Two branches joined along the channels (as U-Nets and FPNs do) and a convolution after:
    the concatenation takes the NHWC values along dimension 3."""
    def fn(x, w1, w2, w3):
        # (jnp.maximum, not jax.nn.relu: jax lowers that as a call of a private function, which
        # the rewrite does not enter; exported PyTorch modules have everything in @main)
        a = jnp.maximum(lax.conv_general_dilated(x, w1, (1, 1), "SAME", dimension_numbers=NCHW), 0.0)
        b = jnp.maximum(lax.conv_general_dilated(x, w2, (1, 1), "SAME", dimension_numbers=NCHW), 0.0)
        return (lax.conv_general_dilated(jnp.concatenate([a, b], axis=1), w3, (1, 1), "SAME",
                                         dimension_numbers=NCHW),)
    arrays = [RNG.standard_normal(s).astype(np.float32) for s in ((2, 3, 8, 8), (4, 3, 3, 3), (5, 3, 1, 1),
                                                                  (6, 9, 3, 3))]
    module = _module(fn, *arrays)
    converted = channels_last_activations(module)
    text = _parsed(converted)
    concat = next(line for line in text.splitlines() if "stablehlo.concatenate" in line)
    assert "dim = 3" in concat and "tensor<2x8x8x4xf32>" in concat, concat
    (before,), (after,) = (device.execute(device.compile(m), arrays) for m in (module, converted))
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5 * float(np.abs(before).max()))


def test_modules_without_channels_first_convolutions_are_left_as_they_are():
    x = RNG.standard_normal((2, 9, 9, 3)).astype(np.float32)
    w = RNG.standard_normal((3, 3, 3, 4)).astype(np.float32)
    nhwc = _module(lambda x, w: (jax.nn.relu(lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))),), x, w)
    assert channels_last_activations(nhwc) == nhwc
    mlp = _module(lambda a, b: (jnp.tanh(a @ b).reshape(2, 2, 2, 2) * 2.0,), np.ones((4, 4), np.float32),
                  np.ones((4, 4), np.float32))
    assert channels_last_activations(mlp) == mlp
