"""Depthwise convolutions written out for the cpu (pjrt.rewrite_depthwise_convolutions and
load_bundle's use of it): the rewritten module computes what the convolution did, in every
layout torch-mlir and jax write; other grouped convolutions are left alone."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from jax import lax

from xlaserve.bundle import load_bundle
from xlaserve.export import TensorSpec, export_bundle
from xlaserve.runtime.pjrt import (Device, has_grouped_convolutions, read_signature,
                                   rewrite_depthwise_convolutions)

RNG = np.random.default_rng(11)


@pytest.fixture(scope="module")
def device() -> Device:
    return Device("cpu")


def _module(fn, *arrays) -> bytes:
    return jax.jit(fn).lower(*arrays).as_text().encode()


# (dimension numbers, strides, padding, kernel dilation, input shape, kernel shape)
CASES = {
    "nchw-stride-uneven-pad-dilated": (("NCHW", "OIHW", "NCHW"), (2, 1), [(1, 2), (0, 1)], (1, 2),
                                       (2, 6, 9, 8), (6, 1, 3, 3)),
    "nhwc-hwio-same": (("NHWC", "HWIO", "NHWC"), (1, 1), "SAME", (1, 1), (1, 7, 7, 5), (5, 5, 1, 5)),
    "nchw-5x5-stride-2": (("NCHW", "OIHW", "NCHW"), (2, 2), [(2, 2), (2, 2)], (1, 1), (3, 4, 11, 11), (4, 1, 5, 5)),
    "1d": (("NCH", "OIH", "NCH"), (1,), [(1, 1)], (1,), (2, 3, 10), (3, 1, 3)),
    "negative-pad": (("NCHW", "OIHW", "NCHW"), (1, 1), [(-1, 0), (1, 1)], (1, 1), (1, 3, 6, 6), (3, 1, 3, 3)),
}


@pytest.mark.parametrize("channels_last", [False, True], ids=["channels-first", "channels-last"])
@pytest.mark.parametrize("case", list(CASES))
def test_rewritten_depthwise_convolution_computes_the_same(device, case, channels_last):
    numbers, strides, padding, dilation, x_shape, w_shape = CASES[case]
    channels = x_shape[numbers[0].index("C")]

    def fn(x, w):
        y = lax.conv_general_dilated(x, w, strides, padding, rhs_dilation=dilation, dimension_numbers=numbers,
                                     feature_group_count=channels)
        return (y * 2.0 + 1.0,)

    x = RNG.standard_normal(x_shape).astype(np.float32)
    w = RNG.standard_normal(w_shape).astype(np.float32)
    module = _module(fn, x, w)
    rewritten = rewrite_depthwise_convolutions(module, channels_last=channels_last)
    assert has_grouped_convolutions(module) and not has_grouped_convolutions(rewritten)
    assert b"stablehlo.convolution" in module
    assert read_signature(rewritten) == read_signature(module)
    assert rewrite_depthwise_convolutions(module, channels_last=channels_last) == rewritten   # deterministic
    (before,) = device.execute(device.compile(module), [x, w])
    (after,) = device.execute(device.compile(rewritten), [x, w])
    assert after.shape == before.shape
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(before).max())))


def _layer_norm_block(x, w):
    """A depthwise 7x7 convolution read by a LayerNorm over the channels, as ConvNeXt's block
    is (torch-mlir's NCHW to NHWC permute around it): the convolution's result has three
    consumers, the mean, the variance and the normalization."""
    y = lax.conv_general_dilated(x, w, (1, 1), [(3, 3), (3, 3)], dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                 feature_group_count=x.shape[1])
    y = y.transpose(0, 2, 3, 1)
    mean = y.mean(-1, keepdims=True)
    variance = ((y - mean) ** 2).mean(-1, keepdims=True)
    return ((y - mean) * lax.rsqrt(variance + 1e-6),)


def _optimized(device: Device, module: bytes) -> str:
    return device.compile(module).hlo_modules()[0].to_string()


def _optimized_slices(device: Device, module: bytes) -> int:
    """How many slices XLA's optimized module has: the written-out sum's taps are slices, so
    this counts how many times the sum is computed."""
    return _optimized(device, module).count(" slice(")


@pytest.mark.parametrize("batch", [1, 4])
def test_a_depthwise_sum_with_several_consumers_is_computed_once(device, batch):
    x = RNG.standard_normal((batch, 8, 10, 10)).astype(np.float32)
    w = RNG.standard_normal((8, 1, 7, 7)).astype(np.float32)
    module = _module(_layer_norm_block, x, w)
    once = rewrite_depthwise_convolutions(module)
    copied = rewrite_depthwise_convolutions(module, computed_once=False)
    # one identity gather for the sum, one for the kernel in [7, 7, channels] order
    assert _text(once).count("#stablehlo.gather<") == 2 and "stablehlo.gather" not in _text(copied)
    # XLA copies the plain sum into each consumer's fusion; the identity gather stops that
    slices_once, slices_copied = _optimized_slices(device, once), _optimized_slices(device, copied)
    assert 49 <= slices_once < 2 * 49 + 2 <= slices_copied
    # and the taps' weights are read from the kernel made once in [7, 7, channels] order
    assert "f32[7,7,8]" in _optimized(device, once) and "f32[7,7,8]" not in _optimized(device, copied)
    (before,) = device.execute(device.compile(module), [x, w])
    for rewritten in (once, copied):
        (after,) = device.execute(device.compile(rewritten), [x, w])
        np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("channels_last", [False, True], ids=["channels-first", "channels-last"])
def test_the_identity_gathers_change_nothing(device, channels_last):
    """Each gather takes every index of the first dimension longer than 1, in order (the batch,
    else the first spatial one, else the channels), so the result is bit for bit the sum's."""
    for x_shape in ((3, 4, 6, 6), (1, 4, 6, 6), (1, 4, 1, 1)):
        x = RNG.standard_normal(x_shape).astype(np.float32)
        w = RNG.standard_normal((4, 1, 3, 3)).astype(np.float32)

        def fn(x, w):
            return (lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                             feature_group_count=4),)
        module = _module(fn, x, w)
        once, copied = (rewrite_depthwise_convolutions(module, channels_last, computed_once=flag)
                        for flag in (True, False))
        # the kernel is made tap-major only where the sum runs over channels-last vectors
        assert _text(once).count("#stablehlo.gather<") == (2 if channels_last else 1)
        assert "stablehlo.gather" not in _text(copied)
        (a,) = device.execute(device.compile(once), [x, w])
        (b,) = device.execute(device.compile(copied), [x, w])
        np.testing.assert_array_equal(a, b)


def _text(module: bytes) -> str:
    from jax._src.interpreters import mlir as jax_mlir_internal
    from jax._src.lib.mlir import ir
    with jax_mlir_internal.make_ir_context() as ctx:
        return str(ir.Module.parse(module, context=ctx))


def test_other_grouped_convolutions_and_modules_without_are_left_alone():
    x = RNG.standard_normal((1, 8, 6, 6)).astype(np.float32)

    def grouped(x, w):          # 4 groups of 2 channels: not depthwise
        return (lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                         feature_group_count=4),)

    def multiplier(x, w):       # depthwise with 2 outputs per channel: not rewritten either
        return (lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                         feature_group_count=8),)

    def dense(x, w):
        return (lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW")),)

    for fn, w_shape, grouped_too in ((grouped, (8, 2, 3, 3), True), (multiplier, (16, 1, 3, 3), True),
                                     (dense, (4, 8, 3, 3), False)):
        module = _module(fn, x, np.zeros(w_shape, np.float32))
        assert rewrite_depthwise_convolutions(module) is module
        assert has_grouped_convolutions(module) is grouped_too


def test_large_kernels_are_left_to_xla():
    x = RNG.standard_normal((1, 4, 12, 12)).astype(np.float32)

    def big(x, w):
        return (lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                         feature_group_count=4),)
    module = _module(big, x, np.zeros((4, 1, 9, 9), np.float32))           # 81 taps
    assert rewrite_depthwise_convolutions(module) is module


WEIGHTS = {"dw": RNG.standard_normal((6, 1, 3, 3)).astype(np.float32),
           "pw": RNG.standard_normal((4, 6, 1, 1)).astype(np.float32)}


def network(dw, pw, x):
    y = lax.conv_general_dilated(x, dw, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                 feature_group_count=6)
    return (lax.conv_general_dilated(jax.nn.relu(y), pw, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW")),)


@pytest.mark.parametrize("dynamic", [False, True], ids=["per-size", "dynamic"])
def test_load_bundle_rewrites_depthwise_convolutions_and_answers_the_same(tmp_path, device, dynamic):
    bundle = export_bundle(tmp_path / "dw", network, inputs=[TensorSpec("x", "f32", "whcn", {"c": 6, "h": 7, "w": 5})],
                           outputs=[TensorSpec("y", "f32", "whcn", {"c": 4, "h": 7, "w": 5})], weights=WEIGHTS,
                           compiled_batch_sizes=[1, 3], dynamic_batch=dynamic)
    model_version = load_bundle(bundle, 1, device)
    # the depthwise kernel is no convolution's any more, so only the pointwise one is permuted
    assert model_version.weights.permutations == (None, (2, 3, 1, 0))
    on_device = list(device.put_weights(list(model_version.weights.read())))
    for batch in (1, 3):
        x = RNG.standard_normal((batch, 6, 7, 5)).astype(np.float32)
        (found,) = device.execute(model_version.modules[batch].executable, [*on_device, x])
        (want,) = network(WEIGHTS["dw"], WEIGHTS["pw"], x)
        np.testing.assert_allclose(found, np.asarray(want), rtol=1e-5, atol=1e-5)


def test_a_channels_last_rewrite_that_fails_leaves_the_bundle_loading(tmp_path, device, monkeypatch, caplog):
    """The channels-last rewrite is an optimization: a module it fails on is compiled without it."""
    from xlaserve.runtime import executables

    def broken(module: bytes) -> bytes:
        raise RuntimeError("an op the rewrite did not expect")
    monkeypatch.setattr(executables, "channels_last_activations", broken)
    bundle = export_bundle(tmp_path / "dw", network, inputs=[TensorSpec("x", "f32", "whcn", {"c": 6, "h": 7, "w": 5})],
                           outputs=[TensorSpec("y", "f32", "whcn", {"c": 4, "h": 7, "w": 5})], weights=WEIGHTS,
                           compiled_batch_sizes=[2])
    model_version = load_bundle(bundle, 1, device)
    assert "channels-last rewrite failed" in caplog.text and "did not expect" in caplog.text
    x = RNG.standard_normal((2, 6, 7, 5)).astype(np.float32)
    (found,) = device.execute(model_version.modules[2].executable,
                              [*device.put_weights(list(model_version.weights.read())), x])
    np.testing.assert_allclose(found, np.asarray(network(WEIGHTS["dw"], WEIGHTS["pw"], x)[0]), rtol=1e-5, atol=1e-5)
