"""Rewrites of StableHLO modules: convolution kernels handed to the cpu pre-permuted
(pjrt.kernel_permutations, relayout, and load_bundle's use of them: the weights transposed once at
read, the modules rewritten), and common-subexpression elimination of exported text modules."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.bundle import load_bundle
from xlaserve.export import TensorSpec, export_bundle
from xlaserve.runtime.pjrt import Device, ModuleError, kernel_permutations, read_signature, relayout

RNG = np.random.default_rng(7)
# PyTorch's kernel order, OIHW, and one weight that is a kernel and also read directly.
WEIGHTS = {
    "a.w": RNG.standard_normal((8, 3, 3, 3)).astype(np.float32),
    "b.w": RNG.standard_normal((4, 8, 1, 1)).astype(np.float32),
    "c.w": RNG.standard_normal((4, 4, 1, 1)).astype(np.float32),
}


def _conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"))


def model(a, b, c, x):
    y = jax.nn.relu(_conv(x, a)) * 0.5 + 1.0      # scalars broadcast to the batch's shape
    y = _conv(y, b) * 2.0 - 1.0
    return (_conv(y, c) + c.sum(),)      # c is also used outside a convolution: left as it is


def expected(x: np.ndarray) -> np.ndarray:
    return np.asarray(model(*(jnp.asarray(WEIGHTS[k]) for k in sorted(WEIGHTS)), jnp.asarray(x))[0])


def _export(tmp_path, dynamic: bool):
    return export_bundle(tmp_path / ("dyn" if dynamic else "static"), model,
                         inputs=[TensorSpec("x", "f32", "whcn", {"c": 3, "h": 6, "w": 5})],
                         outputs=[TensorSpec("y", "f32", "whcn", {"c": 4, "h": 6, "w": 5})],
                         weights=WEIGHTS, compiled_batch_sizes=[1, 3], dynamic_batch=dynamic)


@pytest.fixture(scope="module")
def device() -> Device:
    return Device("cpu")


def test_kernel_permutations_finds_oihw_kernels_only(tmp_path):
    bundle = _export(tmp_path, dynamic=False)
    module = (bundle / "model.b1.mlir").read_bytes()
    # a.w and b.w are OIHW kernels only: spatial dims, then input, then output features (HWIO)
    assert kernel_permutations(module) == {0: (2, 3, 1, 0), 1: (2, 3, 1, 0)}


def test_relayout_takes_the_permuted_arguments(tmp_path):
    module = (_export(tmp_path, dynamic=False) / "model.b1.mlir").read_bytes()
    sig = read_signature(relayout(module, {0: (2, 3, 1, 0)}))
    assert sig.inputs[0].shape == (3, 3, 3, 8)
    assert sig.inputs[1].shape == (4, 8, 1, 1)
    assert relayout(module, {}) is module
    assert relayout(module, {0: (2, 3, 1, 0)}) == relayout(module, {0: (2, 3, 1, 0)})   # deterministic
    with pytest.raises(ModuleError, match="does not permute"):
        relayout(module, {0: (0, 1, 2)})


@pytest.mark.parametrize("dynamic", [False, True], ids=["per-size", "dynamic"])
def test_load_bundle_permutes_kernels_once_and_answers_the_same(tmp_path, device, dynamic):
    model_version = load_bundle(_export(tmp_path, dynamic), 1, device)
    weights = model_version.weights
    assert weights.permutations == ((2, 3, 1, 0), (2, 3, 1, 0), None)
    host = weights.read()
    assert host[0].shape == (3, 3, 3, 8) and host[0].flags.c_contiguous and not host[0].flags.writeable
    # transposed in place: the host copy is still one buffer, each weight byte held once
    first = weights.tensors[0].offset
    assert [a.ctypes.data - host[0].ctypes.data for a in host] == [t.offset - first for t in weights.tensors]
    np.testing.assert_array_equal(host[0], WEIGHTS["a.w"].transpose(2, 3, 1, 0))
    np.testing.assert_array_equal(host[2], WEIGHTS["c.w"])
    assert [t.shape for t in weights.tensors][0] == (8, 3, 3, 3)       # the file's own shape
    assert weights.nbytes == sum(w.nbytes for w in WEIGHTS.values())
    on_device = list(device.put_weights(list(host)))
    for batch in (1, 3):
        x = RNG.standard_normal((batch, 3, 6, 5)).astype(np.float32)
        (found,) = device.execute(model_version.modules[batch].executable, [*on_device, x])
        np.testing.assert_allclose(found, expected(x), rtol=1e-5, atol=1e-5)


def test_common_subexpressions_are_merged_and_locations_kept(tmp_path, device):
    from xlaserve.runtime.pjrt import eliminate_common_subexpressions

    bundle = _export(tmp_path, dynamic=True)
    text = (bundle / "model.mlir").read_text()
    # jax rebuilds the batch's shape before every dynamic broadcast; exported, it is built once
    # per distinct shape
    shapes = re.findall(r"stablehlo\.concatenate ([^\n]*?), dim = ", text)
    assert shapes and len(shapes) == len(set(shapes))
    assert "loc(\"weights['a.w']\")" in text and "conv_general_dilated" in text
    assert eliminate_common_subexpressions(text) == text          # already merged: a fixed point
    model_version = load_bundle(bundle, 1, device)
    host = list(device.put_weights(list(model_version.weights.read())))
    x = RNG.standard_normal((3, 3, 6, 5)).astype(np.float32)
    (found,) = device.execute(model_version.modules[3].executable, [*host, x])
    np.testing.assert_allclose(found, expected(x), rtol=1e-5, atol=1e-5)


def test_compile_overrides_are_part_of_the_executable_cache_key(device, monkeypatch):
    from xlaserve.runtime import pjrt

    with_overrides = device.cache_key_parts()["compile_options"]
    monkeypatch.setattr(pjrt, "COMPILE_OVERRIDES", {})
    assert device.cache_key_parts()["compile_options"] != with_overrides
    monkeypatch.setattr(pjrt, "COMPILE_OVERRIDES", {"cpu": (("xla_cpu_experimental_ynn_fusion_type", "bogus"),)})
    with pytest.raises(Exception, match="xla_cpu_experimental_ynn_fusion_type"):    # they reach XLA
        device.compile(b"func.func public @main(%a: tensor<2xf32>) -> tensor<2xf32> { return %a : tensor<2xf32> }")
