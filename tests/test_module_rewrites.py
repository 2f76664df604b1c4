"""Rewrites of StableHLO modules: convolution kernels handed to the cpu pre-permuted
(pjrt.kernel_permutations, relayout, and load_bundle's use of them: the weights transposed once at
read, the modules rewritten), common-subexpression elimination of exported text modules, and
torch-mlir's dense_resource constants made inline constants or arguments (dense_resources,
resolve_dense_resources)."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from xlaserve.bundle import load_bundle
from xlaserve.export import TensorSpec, export_bundle
from xlaserve.runtime.pjrt import (Device, ModuleError, dense_resources, kernel_permutations, read_signature,
                                   relayout, resolve_dense_resources)
from xlaserve.runtime.pool import packed_offsets, packed_span

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



def _linear(d, e, x):
    """PyTorch's Linear as torch-mlir writes it, x @ W.T; ``e`` is also read untransposed."""
    return (jnp.dot(jnp.tanh(jnp.dot(x, d.T)), e.T) + e.sum(),)


def test_a_weight_read_only_transposed_is_stored_transposed(tmp_path, device):
    weights = {"d": RNG.standard_normal((16, 8)).astype(np.float32),
               "e": RNG.standard_normal((4, 16)).astype(np.float32)}
    bundle = export_bundle(tmp_path / "linear", _linear, inputs=[TensorSpec("x", "f32", "cn", {"c": 8})],
                           outputs=[TensorSpec("y", "f32", "cn", {"c": 4})], weights=weights,
                           compiled_batch_sizes=[1])
    # d is read only as d.T: held transposed; e is read both ways: left as it is
    assert kernel_permutations((bundle / "model.b1.mlir").read_bytes()) == {0: (1, 0)}
    model_version = load_bundle(bundle, 1, device)
    assert model_version.weights.permutations == ((1, 0), None)
    host = model_version.weights.read()
    np.testing.assert_array_equal(host[0], weights["d"].T)
    x = RNG.standard_normal((1, 8)).astype(np.float32)
    (found,) = device.execute(model_version.modules[1].executable, [*device.put_weights(list(host)), x])
    np.testing.assert_allclose(found, np.asarray(_linear(weights["d"], weights["e"], x)[0]), rtol=1e-5, atol=1e-5)
    # and XLA no longer transposes it on every call: fewer layout changes than loaded as it is

    class AsItIs(Device):
        permutes_kernels = False

    def layout_changes(version) -> int:
        optimized = version.modules[1].executable.hlo_modules()[0].to_string()
        return optimized.count(" transpose(") + optimized.count(" copy(")
    assert layout_changes(model_version) < layout_changes(load_bundle(bundle, 1, AsItIs("cpu")))

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
    # transposed in place: the host copy is still one buffer in the pool's layout, each weight
    # byte held once
    assert [a.ctypes.data - host[0].ctypes.data for a in host] == packed_offsets([t.nbytes for t in weights.tensors])
    assert packed_span(host) is not None
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


# A module as torch-mlir prints one: literal tensors as dense_resource constants (stablehlo and
# arith), their bytes in blobs after the module, each behind a 4-byte alignment; one key quoted.
SCALE = np.arange(6, dtype=np.float32).reshape(2, 3) * 0.5
STEPS = np.array([3, -1, 7], np.int64)
MASK = np.array([True, False, True])
HALVES = np.array([1.5, -2.0], ml_dtypes.bfloat16)


def _blob(array: np.ndarray) -> str:
    return "0x" + (np.uint32(array.dtype.itemsize).tobytes() + array.tobytes()).hex()


RESOURCES = f"""module {{
  func.func @main(%arg0: tensor<2x3xf32>, %arg1: tensor<3xi64>) -> (tensor<2x3xf32>, tensor<3xi64>, tensor<3xi1>, tensor<2xbf16>) {{
    %c = stablehlo.constant dense_resource<torch_tensor_2_3_torch.float32> : tensor<2x3xf32>
    %d = arith.constant dense_resource<torch_tensor_3_torch.int64> : tensor<3xi64>
    %e = stablehlo.constant dense_resource<torch_tensor_3_torch.bool> : tensor<3xi1>
    %h = stablehlo.constant dense_resource<"a key-with.odd characters"> : tensor<2xbf16>
    %0 = stablehlo.add %arg0, %c : tensor<2x3xf32>
    %1 = stablehlo.multiply %arg1, %d : tensor<3xi64>
    return %0, %1, %e, %h : tensor<2x3xf32>, tensor<3xi64>, tensor<3xi1>, tensor<2xbf16>
  }}
}}
{{-#
  dialect_resources: {{
    builtin: {{
      torch_tensor_2_3_torch.float32: "{_blob(SCALE)}",
      torch_tensor_3_torch.int64: "{_blob(STEPS)}",
      torch_tensor_3_torch.bool: "{_blob(MASK)}",
      "a key-with.odd characters": "{_blob(HALVES)}"
    }}
  }}
#-}}
"""
X = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
Y = np.array([1, 2, 3], np.int64)


def test_dense_resources_reads_every_constant_with_its_type():
    found = dense_resources(RESOURCES)
    assert list(found) == ["torch_tensor_2_3_torch.float32", "torch_tensor_3_torch.int64",
                           "torch_tensor_3_torch.bool", "a key-with.odd characters"]
    for got, want in zip(found.values(), (SCALE, STEPS, MASK, HALVES)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_xla_refuses_dense_resource_and_takes_the_inlined_module(device):
    with pytest.raises(Exception, match="Only dense elements attr are supported"):
        device.compile(RESOURCES.encode())
    inlined = resolve_dense_resources(RESOURCES)
    assert "dense_resource" not in inlined and "dialect_resources" not in inlined
    assert read_signature(inlined.encode()) == read_signature(RESOURCES.encode())
    out = device.execute(device.compile(inlined.encode()), [X, Y])
    for got, want in zip(out, (X + SCALE, Y * STEPS, MASK, HALVES)):
        np.testing.assert_array_equal(got, want)
    assert resolve_dense_resources(inlined) is inlined          # nothing left to do


def test_a_large_constant_becomes_an_argument_after_the_weights(device):
    unused = np.zeros((4,), np.int32)
    rewritten = resolve_dense_resources(RESOURCES, [SCALE, unused], at=1)
    assert "dense_resource" not in rewritten
    sig = read_signature(rewritten.encode())
    assert [(t.shape, t.element) for t in sig.inputs] == [
        ((2, 3), "f32"), ((2, 3), "f32"), ((4,), "i32"), ((3,), "i64")]
    assert rewritten.count(" = stablehlo.constant") + rewritten.count(" = arith.constant") == 3   # read, not inlined
    other = SCALE * 10
    out = device.execute(device.compile(rewritten.encode()), [X, other, unused, Y])
    np.testing.assert_array_equal(out[0], X + other)              # the argument, not the old blob
    np.testing.assert_array_equal(out[1], Y * STEPS)
    with pytest.raises(ModuleError, match="cannot insert at 5"):
        resolve_dense_resources(RESOURCES, [SCALE], at=5)


def test_a_constant_without_its_blob_is_named():
    broken = RESOURCES.replace("torch_tensor_3_torch.int64: ", "something_else: ")
    with pytest.raises(ModuleError, match="dense_resource 'torch_tensor_3_torch.int64' is used but"):
        resolve_dense_resources(broken)
