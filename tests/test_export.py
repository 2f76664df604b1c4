"""xlaserve.export and the example bundles: manifests, module signatures, determinism."""
from __future__ import annotations

import re
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from examples import export_examples, reference
from xlaserve.export import TensorSpec, export_bundle, row_major_shape

# Few, small batch sizes keep the whole file well under a few seconds.
SMALL_EXPORTS = {
    "simple": (export_examples.export_simple, [1, 2]),
    "mlp": (export_examples.export_mlp, [1, 4]),
    "img_mean": (export_examples.export_img_mean, [2]),
    "cnn": (export_examples.export_cnn, [1, 4]),
}

MAIN_SIGNATURE = re.compile(r"func\.func public @main\((?P<args>.*?)\) -> \((?P<results>.*?)\) \{")


def export_small(model_repo: Path) -> dict[str, Path]:
    return {name: export(model_repo, sizes) for name, (export, sizes) in SMALL_EXPORTS.items()}


def main_types(module_text: str) -> tuple[list[str], list[str]]:
    """The tensor types of @main's arguments and results, in order."""
    match = MAIN_SIGNATURE.search(module_text)
    assert match, "no @main in module"
    return (re.findall(r"tensor<[^>]*>", match["args"]),
            re.findall(r"tensor<[^>]*>", match["results"]))


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    model_repo = tmp_path_factory.mktemp("models")
    export_small(model_repo)
    return model_repo


@pytest.mark.parametrize(
    ("shape", "dims", "batch", "expected"),
    [
        ("cwhn", {"c": 3, "w": 224, "h": 224}, 8, (8, 224, 224, 3)),
        ("whn", {"w": 640, "h": 480}, 2, (2, 480, 640)),
        ("xn", {"x": 16}, 1, (1, 16)),
        ("n", {}, 4, (4,)),
        ("zy", {"z": 10, "y": 3}, 5, (3, 10)),
    ],
)
def test_row_major_shape_reverses_letters(shape, dims, batch, expected):
    assert row_major_shape(shape, dims, batch) == expected


def test_row_major_shape_missing_dim():
    with pytest.raises(ValueError, match="'w'"):
        row_major_shape("whn", {"h": 2}, 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "float33"}, "unknown dtype 'float33'"),
        ({"shape": "xxn"}, "distinct"),
        ({"dims": {"x": 16, "y": 2}}, "non-batch axes"),
        ({"dims": {}}, "non-batch axes"),
        ({"dims": {"x": -1}}, "non-negative"),
    ],
)
def test_tensor_spec_rejects(kwargs, message):
    fields = {"name": "t", "dtype": "f32", "shape": "xn", "dims": {"x": 16}} | kwargs
    with pytest.raises(ValueError, match=message):
        TensorSpec(**fields)


def test_tensor_spec_is_a_value():
    dims = {"x": 16}
    spec = TensorSpec("t", "f32", "xn", dims)
    dims["x"] = 3
    assert spec == TensorSpec("t", "f32", "xn", {"x": 16})
    assert hash(spec) == hash(TensorSpec("t", "f32", "xn", {"x": 16}))
    with pytest.raises(TypeError):
        spec.dims["x"] = 4  # type: ignore[index]


def test_bundle_files(repo):
    for name, (_export, sizes) in SMALL_EXPORTS.items():
        modules = {f"model.b{n}.mlir" for n in sizes}
        has_weights = name in {"mlp", "cnn"}
        expected = {"manifest.yaml"} | modules | ({"weights.safetensors"} if has_weights else set())
        assert {p.name for p in (repo / name).iterdir()} == expected, name
    # Staging directories are hidden siblings and must be gone.
    assert sorted(p.name for p in repo.iterdir()) == sorted(SMALL_EXPORTS)


def test_manifests(repo):
    simple = yaml.safe_load((repo / "simple" / "manifest.yaml").read_text())
    assert simple == {
        "format_version": "2.0",
        "name": "simple",
        "executable_inputs": [
            {"name": "INPUT0", "dtype": "i32", "shape": "xn", "dims": {"x": 16}},
            {"name": "INPUT1", "dtype": "i32", "shape": "xn", "dims": {"x": 16}},
        ],
        "executable_outputs": [
            {"name": "OUTPUT0", "dtype": "i32", "shape": "xn", "dims": {"x": 16}},
            {"name": "OUTPUT1", "dtype": "i32", "shape": "xn", "dims": {"x": 16}},
        ],
        "batching": {"compiled_batch_sizes": [1, 2]},
    }
    mlp = yaml.safe_load((repo / "mlp" / "manifest.yaml").read_text())
    assert list(mlp) == ["format_version", "name", "executable_inputs", "executable_outputs",
                         "weights", "batching"]
    assert mlp["weights"] == {"file": "weights.safetensors", "order": ["w"]}
    assert mlp["executable_inputs"] == [
        {"name": "input", "dtype": "f32", "shape": "fn", "dims": {"f": 512}}]
    img_mean = yaml.safe_load((repo / "img_mean" / "manifest.yaml").read_text())
    assert img_mean["executable_inputs"] == [
        {"name": "input", "dtype": "u8", "shape": "cwhn", "dims": {"c": 3, "w": 224, "h": 224}}]
    assert img_mean["executable_outputs"] == [
        {"name": "output", "dtype": "f32", "shape": "yn", "dims": {"y": 1}}]
    cnn = yaml.safe_load((repo / "cnn" / "manifest.yaml").read_text())
    assert cnn["weights"]["order"] == export_examples.CNN_WEIGHTS_ORDER
    assert [t["name"] for t in cnn["executable_outputs"]] == ["logits", "label"]
    assert cnn["batching"] == {"compiled_batch_sizes": [1, 4]}


def test_main_signatures(repo):
    args, results = main_types((repo / "mlp" / "model.b4.mlir").read_text())
    assert args == ["tensor<512x512xf32>", "tensor<4x512xf32>"]  # weights first
    assert results == ["tensor<4x512xf32>"]

    args, results = main_types((repo / "simple" / "model.b2.mlir").read_text())
    assert args == ["tensor<2x16xi32>"] * 2
    assert results == ["tensor<2x16xi32>"] * 2

    args, results = main_types((repo / "img_mean" / "model.b2.mlir").read_text())
    assert args == ["tensor<2x224x224x3xui8>"]
    assert results == ["tensor<2x1xf32>"]

    args, results = main_types((repo / "cnn" / "model.b4.mlir").read_text())
    assert args == ["tensor<3x3x3x8xf32>", "tensor<8xf32>", "tensor<3x3x8x16xf32>",
                    "tensor<16xf32>", "tensor<16x10xf32>", "tensor<10xf32>",
                    "tensor<4x32x32x3xui8>"]
    assert results == ["tensor<4x10xf32>", "tensor<4xi32>"]


def test_main_arguments_are_named(repo):
    text = (repo / "cnn" / "model.b1.mlir").read_text()
    assert "loc(\"weights['conv1.w']\")" in text
    assert "loc(\"inputs['input']\")" in text
    assert "jax.result_info = \"result['label']\"" in text


def test_weights_match_reference(repo):
    for name, expected in (("mlp", reference.mlp_weights()), ("cnn", reference.cnn_weights())):
        stored = load_file(str(repo / name / "weights.safetensors"))
        assert stored.keys() == expected.keys()
        for key, array in expected.items():
            np.testing.assert_array_equal(stored[key], array)
            assert stored[key].dtype == array.dtype


def test_export_is_deterministic_across_directories(tmp_path, repo):
    # A different, deeper path: nothing in a bundle may depend on where it was written.
    other = export_small(tmp_path / "elsewhere" / "deeper" / "models")
    for name, bundle in other.items():
        files = sorted(p.name for p in bundle.iterdir())
        assert files == sorted(p.name for p in (repo / name).iterdir())
        for file_name in files:
            assert (bundle / file_name).read_bytes() == (repo / name / file_name).read_bytes(), (
                f"{name}/{file_name} differs")


def test_modules_carry_no_source_paths(repo):
    for module in repo.glob("*/model.b*.mlir"):
        text = module.read_text()
        assert ".py" not in text, module
        assert str(Path(__file__).resolve().parent.parent) not in text, module
        assert not re.search(r'loc\("[^"]*":\d+', text), module  # no file:line locations


def test_bytecode_is_portable_artifact_and_deterministic(tmp_path):
    spec = TensorSpec("x", "f32", "xn", {"x": 3})
    paths = []
    for where in ("a", "b/c"):
        bundle = export_bundle(tmp_path / where / "double", lambda x: (x * 2,), inputs=[spec],
                               outputs=[spec], weights=None, compiled_batch_sizes=[4],
                               bytecode=True)
        assert sorted(p.name for p in bundle.iterdir()) == ["manifest.yaml", "model.b4.mlirbc"]
        paths.append(bundle / "model.b4.mlirbc")
    data = paths[0].read_bytes()
    assert data.startswith(b"ML\xefR")  # MLIR bytecode magic
    assert data == paths[1].read_bytes()


def test_reexport_replaces_bundle(tmp_path):
    spec = TensorSpec("x", "f32", "xn", {"x": 3})
    bundle = tmp_path / "m"
    export_bundle(bundle, lambda x: x + 1, inputs=[spec], outputs=[spec], weights=None,
                  compiled_batch_sizes=[1, 2], extra_files={"model.py": "# v1\n"})
    export_bundle(bundle, lambda x: x - 1, inputs=[spec], outputs=[spec], weights=None,
                  compiled_batch_sizes=[4], extra_files={"model.py": "# v2\n"})
    assert sorted(p.name for p in bundle.iterdir()) == ["manifest.yaml", "model.b4.mlir",
                                                         "model.py"]
    assert (bundle / "model.py").read_text() == "# v2\n"
    assert "stablehlo.subtract" in (bundle / "model.b4.mlir").read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_client_tensors_and_default_weights_order(tmp_path):
    x = TensorSpec("x", "f32", "xn", {"x": 2})
    grade = TensorSpec("grade", "i64", "yn", {"y": 1})
    weights = {"b": np.zeros(2, np.float32), "a": np.ones(2, np.float32)}
    bundle = export_bundle(tmp_path / "graded", lambda a, b, v: (v * a + b,), inputs=[x],
                           outputs=[x], weights=weights, compiled_batch_sizes=[1],
                           client_outputs=[grade])
    manifest = yaml.safe_load((bundle / "manifest.yaml").read_text())
    assert manifest["weights"]["order"] == ["a", "b"]
    assert "client_inputs" not in manifest
    assert manifest["client_outputs"] == [
        {"name": "grade", "dtype": "i64", "shape": "yn", "dims": {"y": 1}}]


def test_exported_weights_key_agrees_with_the_no_key_default(tmp_path):
    """export_bundle writes an explicit weights: key; with the default order it binds exactly what
    the loader binds for the same bundle without the key (the seed form). Weightless exports
    write neither key nor file, so they load with no weights."""
    from xlaserve.bundle import load_bundle
    from xlaserve.runtime.pjrt import Device

    x = TensorSpec("x", "f32", "xn", {"x": 2})
    weights = {"scale": np.full(2, 3, np.float32), "bias": np.array([1, -1], np.float32)}
    keyed = export_bundle(tmp_path / "keyed", lambda bias, scale, v: (v * scale + bias,), inputs=[x],
                          outputs=[x], weights=weights, compiled_batch_sizes=[2])
    seed_form = tmp_path / "seed_form"
    seed_form.mkdir()
    for f in keyed.iterdir():
        (seed_form / f.name).write_bytes(f.read_bytes())
    manifest = yaml.safe_load((seed_form / "manifest.yaml").read_text())
    assert manifest.pop("weights") == {"file": "weights.safetensors", "order": ["bias", "scale"]}
    manifest["name"] = "seed_form"
    (seed_form / "manifest.yaml").write_text(yaml.safe_dump(manifest))

    device = Device("cpu")
    v = np.array([[1, 2], [3, 4]], np.float32)
    for bundle in (keyed, seed_form):
        model = load_bundle(bundle, 1, device)
        assert model.weights.names == ("bias", "scale")
        (out,) = device.execute(model.modules[2].executable, [*model.weights.arrays, v])
        np.testing.assert_array_equal(out, v * 3 + np.array([1, -1], np.float32))

    plain = export_bundle(tmp_path / "plain", lambda v: (v + 1,), inputs=[x], outputs=[x], weights=None,
                          compiled_batch_sizes=[2])
    assert "weights" not in yaml.safe_load((plain / "manifest.yaml").read_text())
    assert not (plain / "weights.safetensors").exists()
    assert load_bundle(plain, 1, device).weights is None


def test_output_mismatch_names_tensor(tmp_path):
    x = TensorSpec("x", "f32", "xn", {"x": 3})
    wrong = TensorSpec("y", "f32", "xn", {"x": 4})
    with pytest.raises(ValueError, match=r"output 'y' expected float32\[2, 4\].*float32\[2, 3\]"):
        export_bundle(tmp_path / "bad", lambda v: (v,), inputs=[x], outputs=[wrong],
                      weights=None, compiled_batch_sizes=[2])
    with pytest.raises(ValueError, match="returned 2 outputs"):
        export_bundle(tmp_path / "bad", lambda v: (v, v), inputs=[x], outputs=[x],
                      weights=None, compiled_batch_sizes=[2])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"compiled_batch_sizes": []}, "must not be empty"),
        ({"compiled_batch_sizes": [2, 2]}, "duplicates"),
        ({"compiled_batch_sizes": [0]}, "positive"),
        ({"weights_order": ["w", "w"]}, "exactly once"),
        ({"extra_files": {"manifest.yaml": ""}}, "overwrite"),
        ({"extra_files": {"../x.py": ""}}, "plain file name"),
    ],
)
def test_export_rejects(tmp_path, kwargs, message):
    x = TensorSpec("x", "f32", "xn", {"x": 3})
    args = {"inputs": [x], "outputs": [x], "weights": {"w": np.ones(3, np.float32)},
            "compiled_batch_sizes": [1]} | kwargs
    with pytest.raises(ValueError, match=message):
        export_bundle(tmp_path / "bad", lambda w, v: (v * w,), **args)


def test_reference_models_are_consistent():
    # The peer servers' mlp and img_mean, restated; the exported modules compute the same.
    x = np.random.default_rng(3).integers(0, 256, (2, 224, 224, 3), dtype=np.uint8)
    np.testing.assert_allclose(reference.img_mean_ref(x)[:, 0],
                               x.reshape(2, -1).mean(axis=1), rtol=1e-6)
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    total, diff = reference.simple_ref(a, a)
    np.testing.assert_array_equal(total, 2 * a)
    np.testing.assert_array_equal(diff, 0)
    logits, label = reference.cnn_ref(np.zeros((3, 32, 32, 3), np.uint8))
    assert logits.shape == (3, 10) and logits.dtype == np.float32
    assert label.shape == (3,) and label.dtype == np.int32


def test_example_functions_match_reference():
    """The functions the examples export, run through jax (not the server), against NumPy."""
    rng = np.random.default_rng(4)
    x = rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    weights = reference.cnn_weights()
    logits, label = jax.jit(export_examples.cnn)(
        *(weights[k] for k in export_examples.CNN_WEIGHTS_ORDER), x)
    ref_logits, ref_label = reference.cnn_ref(x)
    np.testing.assert_allclose(np.asarray(logits), ref_logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(label), ref_label)

    x = rng.integers(0, 256, (2, 224, 224, 3), dtype=np.uint8)
    (mean,) = jax.jit(export_examples.img_mean)(x)
    np.testing.assert_allclose(np.asarray(mean), reference.img_mean_ref(x), rtol=1e-5)

    x = rng.standard_normal((2, 512)).astype(np.float32)
    (y,) = jax.jit(export_examples.mlp)(reference.mlp_weights()["w"], x)
    np.testing.assert_allclose(np.asarray(y), reference.mlp_ref(x), rtol=1e-5, atol=1e-5)

    a, b = (rng.integers(-1000, 1000, (2, 16), dtype=np.int32) for _ in range(2))
    for got, want in zip(jax.jit(export_examples.simple)(a, b), reference.simple_ref(a, b)):
        np.testing.assert_array_equal(np.asarray(got), want)
