"""xlaserve.export.from_jax and xlaserve.export.verify: a JAX function with a nested parameter pytree
exported, loaded as the server loads it, and verified against the function."""
from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file, save_file

from xlaserve.bundle import load_bundle
from xlaserve.export import (TensorSpec, TracingError, VerificationError, compare, default_axes,
                             dtype_code, export_bundle, export_jax, flatten_params, hooks_skeleton,
                             infer_outputs, output_scale, sample_inputs, tolerance, verify_bundle)
from xlaserve.runtime.pjrt import Device

HIGHEST = jax.lax.Precision.HIGHEST
X = TensorSpec("x", "f32", "xn", {"x": 3})


@pytest.fixture(scope="module")
def device() -> Device:
    return Device("cpu")


def mlp_params(layers: int = 11) -> dict:
    """Layer i maps width 3+i to 3+i+1, so binding the weights in any other order than the
    function's fails at load: the names sort layers.0, layers.1, layers.10, layers.2, ..."""
    rng = np.random.default_rng(0)
    return {
        "layers": [{"kernel": rng.standard_normal((3 + i, 4 + i)).astype(np.float32),
                    "bias": rng.standard_normal(4 + i).astype(np.float32)} for i in range(layers)],
        "head": (rng.standard_normal((3 + layers, 2)).astype(np.float32),),
    }


def mlp(params, x):
    h = x
    for layer in params["layers"]:
        h = jnp.tanh(jnp.matmul(h, layer["kernel"], precision=HIGHEST) + layer["bias"])
    logits = jnp.matmul(h, params["head"][0], precision=HIGHEST)
    return {"logits": logits, "label": jnp.argmax(logits, axis=1).astype(jnp.int32)}


# --- dtype names ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("given", "code"), [
    ("f32", "f32"), ("float32", "f32"), ("np.float32", "f32"), ("jnp.bfloat16", "bf16"),
    ("float16", "f16"), ("bfloat16", "bf16"), ("uint8", "u8"), ("bool", "b1"), (" int64 ", "i64"),
    (np.float32, "f32"), (jnp.bfloat16, "bf16"), (ml_dtypes.bfloat16, "bf16"), (np.dtype("int8"), "i8"),
    (jnp.float16, "f16"), (np.bool_, "b1"), ("torch.float32", "f32"), ("torch.bfloat16", "bf16"),
])
def test_dtype_code_accepts_what_users_write(given, code):
    assert dtype_code(given) == code


@pytest.mark.parametrize("given", ["float33", "fp32", "torch.float33", np.complex64, "", None, "bytes"])
def test_dtype_code_rejects_with_the_accepted_list(given):
    with pytest.raises(ValueError, match=r"unknown dtype .*: b1 \(bool\), .*bf16 \(bfloat16\), f32 \(float32\)"):
        dtype_code(given)


def test_tensor_spec_stores_the_code():
    assert TensorSpec("x", np.float32, "xn", {"x": 3}) == TensorSpec("x", "float32", "xn", {"x": 3}) == X
    assert TensorSpec("x", jnp.bfloat16, "n").dtype == "bf16"
    with pytest.raises(ValueError, match="tensor 'x': unknown dtype 'float33'"):
        TensorSpec("x", "float33", "n")


# --- parameters ----------------------------------------------------------------------------------

def test_flatten_params_names_and_binding_order():
    params = mlp_params(layers=11)
    flat = flatten_params(params)
    expected = ["head.0"] + [f"layers.{i}.{leaf}" for i in range(11) for leaf in ("bias", "kernel")]
    assert list(flat) == expected                       # jit's order: not the names sorted
    assert sorted(flat) != expected
    np.testing.assert_array_equal(flat["layers.10.kernel"], params["layers"][10]["kernel"])
    leaves = jax.tree_util.tree_leaves(params)
    assert all(a is b or np.array_equal(a, b) for a, b in zip(flat.values(), leaves))


def test_flatten_params_other_shapes():
    assert list(flatten_params(np.ones(2, np.float32))) == ["params"]
    flat = flatten_params({"b": [np.int8(1), (np.zeros(2), np.ones(1))], "a": {3: jnp.ones(1)}})
    assert list(flat) == ["a.3", "b.0", "b.1.0", "b.1.1"]
    assert flat["b.0"].dtype == np.int8 and flat["a.3"].dtype == np.float32


def test_flatten_params_rejects():
    with pytest.raises(ValueError, match="two leaves are both named 'a.b'"):
        flatten_params({"a": {"b": np.ones(1)}, "a.b": np.ones(1)})
    with pytest.raises(ValueError, match="parameter 'w': dtype complex64 cannot be stored"):
        flatten_params({"w": np.ones(2, np.complex64)})


# --- export and verification ---------------------------------------------------------------------

def test_export_round_trip_nested_params(tmp_path, device):
    params = mlp_params()
    lines = []
    result = export_jax(tmp_path / "deep", mlp, params, inputs=[X], compiled_batch_sizes=[1, 4],
                        progress=lines.append)
    flat = flatten_params(params)
    manifest = yaml.safe_load((tmp_path / "deep" / "manifest.yaml").read_text())
    assert manifest["weights"]["order"] == list(flat) == list(result.weights_order)
    assert [t["name"] for t in manifest["executable_outputs"]] == ["label", "logits"]   # dict keys, jit's order
    assert manifest["executable_outputs"][1] == {"name": "logits", "dtype": "f32", "shape": "xn", "dims": {"x": 2}}
    stored = load_file(str(tmp_path / "deep" / "weights.safetensors"))
    assert stored.keys() == flat.keys()
    for name, array in flat.items():
        np.testing.assert_array_equal(stored[name], array)
    # The verification ran every output of every module, the way the server loads the bundle.
    checks = result.verification.checks
    assert [(c.module, c.output) for c in checks] == [
        ("model.b1.mlir", "label"), ("model.b1.mlir", "logits"),
        ("model.b4.mlir", "label"), ("model.b4.mlir", "logits")]
    assert all(c.ok and c.max_abs_error <= 1e-5 for c in checks)
    assert (checks[1].atol, checks[1].rtol, checks[0].atol) == (5e-5, 1e-5, 0.0)
    assert any("traced compiled batch size 4 (2/2)" in line for line in lines)
    assert any("verify model.b4.mlir logits (f32): max abs error" in line for line in lines)
    assert any("note: output 'logits': axes not given, named 'xn'" in line for line in lines)
    # And independently of the verifier: the module on new data equals the function.
    model = load_bundle(tmp_path / "deep", 1, device)
    x = np.random.default_rng(7).standard_normal((4, 3)).astype(np.float32)
    label, logits = device.execute(model.modules[4].executable, [*model.weights.read(), x])
    want = mlp(params, x)
    np.testing.assert_allclose(logits, want["logits"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(label, want["label"])


def test_export_without_params_and_with_bf16(tmp_path):
    spec = TensorSpec("x", "bfloat16", "xn", {"x": 8})
    result = export_jax(tmp_path / "half", lambda _, x: (x * 3, jnp.sum(x, axis=1)), None,
                        inputs=[spec], compiled_batch_sizes=[2])
    assert not (tmp_path / "half" / "weights.safetensors").exists()
    assert [s.name for s in result.outputs] == ["output0", "output1"]
    assert [c.dtype for c in result.verification.checks] == ["bf16", "bf16"]
    assert result.verification.checks[0].atol == tolerance("bf16")[0] > tolerance("f32")[0]


def test_tracing_error_names_the_signature_and_batch(tmp_path):
    params = {"w": np.ones((3, 4), np.float32)}
    x = TensorSpec("x", "f32", "xn", {"x": 5})

    def wrong(params, x):
        return x @ params["w"]          # [B, 5] @ [3, 4]

    with pytest.raises(TracingError) as caught:
        export_jax(tmp_path / "bad", wrong, params, inputs=[x], compiled_batch_sizes=[2, 8])
    message = str(caught.value)
    assert "traced at compiled batch size 2: dot_general" in message
    assert "fn(params={'w': f32[3,4]}, x=f32[2,5])" in message
    assert isinstance(caught.value.__cause__, TypeError)
    assert not (tmp_path / "bad").exists()
    # With the outputs given, the failure is in export_bundle's trace: the same signature.
    out = TensorSpec("y", "f32", "xn", {"x": 4})
    with pytest.raises(TracingError, match=r"(?s)batch size 2: .*fn\(params=\{'w': f32\[3,4\]\}, x=f32\[2,5\]\)"):
        export_jax(tmp_path / "bad", wrong, params, inputs=[x], outputs=[out], compiled_batch_sizes=[2])
    # Any leaf dtype shows as its code, unquoted.
    mixed = {"ids": np.arange(3, dtype=np.int32), "scale": (np.ones(2, ml_dtypes.bfloat16),)}
    with pytest.raises(TracingError, match=r"fn\(params=\{'ids': i32\[3\], 'scale': \(bf16\[2\],\)\}, x=f32\[1,5\]\)"):
        export_jax(tmp_path / "bad", lambda p, v: v @ p["ids"], mixed, inputs=[x], compiled_batch_sizes=[1])
    # The flat API names weights and inputs in the module's argument order.
    with pytest.raises(TracingError, match=r"fn\(w: f32\[3,4\], x: f32\[8,5\]\)"):
        export_bundle(tmp_path / "bad", lambda w, v: (v @ w,), inputs=[x], outputs=[out],
                      weights=params, compiled_batch_sizes=[8])


def test_infer_outputs_names_and_axes():
    def fn(_, x):
        return x.T, x[:, 0]                          # [3, B] and [B]
    specs, notes = infer_outputs(fn, None, [X], [1, 4], names=["t", "first"], axes={"t": "nx"})
    assert specs == [TensorSpec("t", "f32", "nx", {"x": 3}), TensorSpec("first", "f32", "n")]
    assert notes == ["output 'first': axes not given, named 'n' (fastest first) for row-major [B]"]
    with pytest.raises(ValueError, match=r"output 'output0' is f32\[3,1\] at batch 1 and f32\[3,2\] at batch 2:"
                                         " without named axes the batch must be its first"):
        infer_outputs(fn, None, [X], [1])
    with pytest.raises(ValueError, match=r"3 output names given \(a, b, c\), but the function returns 2"):
        infer_outputs(fn, None, [X], [1], names=["a", "b", "c"])
    with pytest.raises(ValueError, match=r"output names \['a', 'a'\] are not unique"):
        infer_outputs(fn, None, [X], [1, 2], names=["a", "a"], axes={"a": "nx"})
    with pytest.raises(ValueError, match=r"does not fit axes 'xn'"):
        infer_outputs(fn, None, [X], [1], axes={"output0": "xn"})
    with pytest.raises(ValueError, match=r"axes given for \['nope'\]"):
        infer_outputs(fn, None, [X], [1], axes={"nope": "xn"})
    assert default_axes(3) == "xyzn" and default_axes(0) == "n"


def test_transposed_output_exports_and_verifies(tmp_path):
    result = export_jax(tmp_path / "t", lambda _, x: x.T * 2, None, inputs=[X], compiled_batch_sizes=[2, 3],
                        output_axes={"output": "nx"})
    assert result.outputs == (TensorSpec("output", "f32", "nx", {"x": 3}),)
    assert result.verification.ok


def _export_affine(path, params, verify=True):
    def affine(p, x):
        return jnp.matmul(x, p["w"], precision=HIGHEST) + p["b"]
    return affine, export_jax(path, affine, params, inputs=[X], compiled_batch_sizes=[1, 2], verify=verify)


def test_verification_fails_on_tampered_weights(tmp_path):
    params = {"w": np.eye(3, dtype=np.float32), "b": np.zeros(3, np.float32)}
    affine, _ = _export_affine(tmp_path / "affine", params, verify=False)
    tampered = dict(load_file(str(tmp_path / "affine" / "weights.safetensors")))
    tampered["b"] = tampered["b"] + np.float32(1e-3)     # far above f32's 1e-5, far below "obviously broken"
    save_file(tampered, str(tmp_path / "affine" / "weights.safetensors"))

    def reference(x):
        return [np.asarray(affine(params, x))]
    with pytest.raises(VerificationError) as caught:
        verify_bundle(tmp_path / "affine", reference)
    message = str(caught.value)
    assert "bundle 'affine' does not match its source function" in message
    assert "model.b1.mlir output (f32): max abs error 0.001" in message
    assert "model.b2.mlir output (f32)" in message and "FAILED: 6 of 6 elements outside" in message
    assert not caught.value.verification.ok
    # A looser tolerance accepts the same bundle, with the error reported.
    verification = verify_bundle(tmp_path / "affine", reference, atol=2e-3)
    assert verification.ok and all(abs(c.max_abs_error - 1e-3) < 1e-6 for c in verification.checks)


def test_verification_fails_on_a_module_that_differs(tmp_path):
    export_jax(tmp_path / "twice", lambda _, x: x * 2, None, inputs=[X], compiled_batch_sizes=[1, 2])
    export_jax(tmp_path / "thrice", lambda _, x: x * 3, None, inputs=[X], compiled_batch_sizes=[2])
    shutil.copy(tmp_path / "thrice" / "model.b2.mlir", tmp_path / "twice" / "model.b2.mlir")
    with pytest.raises(VerificationError) as caught:
        verify_bundle(tmp_path / "twice", lambda x: [x * 2])
    assert [c.ok for c in caught.value.verification.checks] == [True, False]    # b1 still right
    assert "model.b2.mlir output (f32)" in str(caught.value)
    assert "model.b1.mlir" not in str(caught.value)


def test_integer_outputs_must_match_exactly(tmp_path):
    i32 = TensorSpec("x", "i32", "xn", {"x": 4})
    export_jax(tmp_path / "ints", lambda _, x: x + 1, None, inputs=[i32], compiled_batch_sizes=[2])
    with pytest.raises(VerificationError, match=r"\(i32\): max abs error 1, .*\(atol 0 x scale, rtol 0\) FAILED: 8 of 8"):
        verify_bundle(tmp_path / "ints", lambda x: [x + 2])


def test_compare_and_tolerance_rules():
    nan = np.float32("nan")
    assert compare(np.array([1.0, nan]), np.array([1.0, nan]), 0, 0) == (0.0, 0.0, 0)
    assert compare(np.array([1.0, 2.0]), np.array([1.0, nan]), 1, 1)[2] == 1
    abs_err, rel_err, bad = compare(np.array([0.0, 2.0]), np.array([0.5, 2.5]), 0.1, 0.1)
    assert (abs_err, rel_err, bad) == (0.5, 0.25, 2)
    assert compare(np.array([0.0, 2.0]), np.array([0.5, 2.5]), 0.5, 0.0)[2] == 0
    assert tolerance("f32") == (5e-5, 1e-5) and tolerance("i64") == (0.0, 0.0)
    assert tolerance("f16")[0] > tolerance("f32")[0] and tolerance("bf16")[1] > tolerance("f16")[1]
    assert tolerance("f32", atol=0.5) == (0.5, 1e-5)


def test_the_absolute_tolerance_scales_with_the_output():
    """float32 noise of a deep network whose logits reach 29 (efficientnet_b0's 9.8e-5, 3.4e-6 of
    its scale) passes the default; the same noise on numbers near 1 does not, nor does a wrong
    answer at any scale."""
    rng = np.random.default_rng(26)
    logits = np.clip(rng.standard_normal(1000) * 8, -28, 28)
    logits[17] = 29.0
    noisy = logits + rng.uniform(-9.8e-5, 9.8e-5, logits.shape)
    atol, rtol = tolerance("f32")
    assert output_scale(logits) == 29.0
    assert compare(logits, noisy, atol, rtol)[2] == 0
    near_one = np.clip(logits / 29, -1, 1)
    assert compare(near_one, near_one + (noisy - logits), atol, rtol)[2] > 0     # unscaled: too much
    wrong = logits.copy()
    wrong[3] += 0.01                          # one logit off by 3.4e-4 of the scale
    assert compare(logits, wrong, atol, rtol)[2] == 1
    assert compare(logits, logits * 1.001, atol, rtol)[2] > 800         # all but those within 1.5 of 0
    # the scale is never below 1, and ignores what is not finite
    assert output_scale(np.array([0.25, -0.5])) == 1.0
    assert output_scale(np.array([np.inf, -3.0, np.nan])) == 3.0
    assert output_scale(np.zeros(0)) == 1.0


def test_a_failed_verification_reports_the_scale(tmp_path):
    export_jax(tmp_path / "big", lambda _, x: x * 100, None, inputs=[X], compiled_batch_sizes=[2])
    with pytest.raises(VerificationError) as caught:
        verify_bundle(tmp_path / "big", lambda x: [x * 100 + 0.5])
    (check,) = caught.value.verification.checks
    assert check.scale == float(np.abs(sample_inputs([X], 2, 2)[0] * 100 + 0.5).max())   # of the reference
    assert f"scale {check.scale:.3g} (error {0.5 / check.scale:.3g} of it)" in check.line()
    assert caught.value.summary().startswith("bundle 'big' does not match its source function: model.b2.mlir")
    assert "\n" not in caught.value.summary()
    assert verify_bundle(tmp_path / "big", lambda x: [x * 100 + 1e-4]).ok     # 1e-4 < 1e-5 x scale


def test_sample_inputs_are_seeded_and_typed():
    specs = [TensorSpec("img", "u8", "cwhn", {"c": 3, "w": 4, "h": 2}), TensorSpec("i", "i64", "n"),
             TensorSpec("m", "b1", "xn", {"x": 5}), TensorSpec("h", "bf16", "n")]
    a, b = sample_inputs(specs, 3, seed=1), sample_inputs(specs, 3, seed=1)
    assert [x.shape for x in a] == [(3, 2, 4, 3), (3,), (3, 5), (3,)]
    assert [x.dtype for x in a] == [np.uint8, np.int64, np.bool_, ml_dtypes.bfloat16]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], sample_inputs(specs, 3, seed=2)[0])
    assert 0 <= a[1].min() and a[1].max() < 16


def test_hooks_skeleton_loads_and_passes_through(tmp_path, device):
    export_jax(tmp_path / "hooked", lambda _, x: x + 1, None, inputs=[X], compiled_batch_sizes=[1], hooks=True)
    text = (tmp_path / "hooked" / "model.py").read_text()
    assert "register_model('hooked', preprocess=preprocess, postprocess=postprocess)" in text
    assert "#   x: f32[B,3]" in text and "#   output: f32[B,3]" in text
    model = load_bundle(tmp_path / "hooked", 1, device)
    assert model.hooks is not None
    tensors = [object()]
    assert model.hooks.preprocess(tensors) is tensors and model.hooks.postprocess(tensors) is tensors
    assert hooks_skeleton("m", [], []).count("return tensors") == 2


def test_64_bit_types_need_jax_x64(tmp_path):
    i64 = TensorSpec("ids", "int64", "xn", {"x": 2})
    with pytest.raises(ValueError, match=r"input 'ids' \(i64\): 64-bit, but JAX has 64-bit types off"):
        export_jax(tmp_path / "ids", lambda _, x: x + 1, None, inputs=[i64], compiled_batch_sizes=[1])
    with pytest.raises(ValueError, match=r"weight 's' \(f64\): 64-bit.*JAX_ENABLE_X64=1"):
        export_bundle(tmp_path / "s", lambda s, x: (x * s[0],), inputs=[X], outputs=[X],
                      weights={"s": np.ones(1)}, compiled_batch_sizes=[1])
    assert list(tmp_path.iterdir()) == []
    with jax.enable_x64(True):
        result = export_jax(tmp_path / "ids", lambda p, x: x * p["k"], {"k": np.int64(3)}, inputs=[i64],
                            compiled_batch_sizes=[2])
    assert [(c.dtype, c.ok) for c in result.verification.checks] == [("i64", True)]
