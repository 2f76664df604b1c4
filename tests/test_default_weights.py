"""Weights by default, as the seeds do (issue 13, part 1).

A bundle whose manifest has no ``weights:`` key uses ``weights.safetensors`` beside it when the file
exists: every tensor, bound first to each module's ``@main`` in sorted-name order, the order
``jax.jit`` flattens a dict of parameters. No file and no key: no weights. An explicit
``weights: {file, order}`` wins; without ``order`` its tensors bind in sorted-name order.

The modules here are lowered with plain ``jax.jit(...).lower(...)``, as a bundle author outside
xlaserve would write them, not with ``xlaserve.export``.
"""
from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from safetensors.numpy import save_file

from examples import reference
from examples.export_examples import severity_grader
from tests.conftest import infer_input, serve
from xlaserve.bundle import load_bundle
from xlaserve.errors import BundleError
from xlaserve.runtime.pjrt import Device

# The severity_grader manifest exactly as ../shared/seeds/announcement.txt shows it: the same keys,
# no weights: key, the weights file beside it.
SEED_MANIFEST = """\
# manifest.yaml
format_version: "2.0"
name: "severity_grader"
executable_inputs:
  - name: "INPUT__0"
    dtype: "u8"
    shape: "whn"            # w width, h height; n is the batch axis (Julia column-major)
    dims: { w: 224, h: 224 }
executable_outputs:        # the model's raw outputs
  - name: "OUTPUT__0"
    dtype: "f32"
    shape: "zn"             # z logits, n batch
    dims: { z: 9 }
client_outputs:            # what the caller sees after model.jl post-processing
  - name: "grade"
    dtype: "i64"
    shape: "yn"             # y is the ordinal class, one per sample
    dims: { y: 1 }
batching:
  compiled_batch_sizes: [1, 3, 6]
"""

# The seed's model.jl in Python: the same postprocess hook, the same loop with its early break.
SEED_MODEL_PY = """\
import numpy as np
from xlaserve import NamedTensor, register_model

def postprocess(out):
    logits = out[0].data                  # OUTPUT__0 logits, row-major [batch, z]
    batch, levels = logits.shape
    grade = np.zeros((batch, 1), dtype=np.int64)
    for b in range(batch):
        n = 0
        for i in range(levels):
            if logits[b, i] > 0:
                n = i + 1
            else:
                break
        grade[b, 0] = n
    return [NamedTensor("grade", grade)]

register_model("severity_grader", postprocess=postprocess)
"""

IMAGE = reference.GRADER_IMAGE


def _spec(array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(array.shape, array.dtype)


def _images(batch: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((batch, *IMAGE), np.uint8)


def lower_params_dict(batch: int) -> str:
    """``@main(t, w, INPUT__0)``: jit flattens the params dict in sorted-key order, whatever order
    the dict was built in (here ``w`` first)."""
    weights = reference.grader_weights()
    params = {"w": _spec(weights["w"]), "t": _spec(weights["t"])}

    def grader(params, x):
        return severity_grader(params["t"], params["w"], x)[0]

    return jax.jit(grader).lower(params, _images(batch)).as_text()


def lower_positional(batch: int) -> str:
    """``@main(w, t, INPUT__0)``: an order only an explicit ``weights.order`` can describe."""
    weights = reference.grader_weights()

    def grader(w, t, x):
        return severity_grader(t, w, x)[0]

    return jax.jit(grader).lower(_spec(weights["w"]), _spec(weights["t"]), _images(batch)).as_text()


def lower_weightless(batch: int) -> str:
    """``@main(INPUT__0)``: the grader with its weights folded in as constants."""
    weights = reference.grader_weights()

    def grader(x):
        return severity_grader(weights["t"], weights["w"], x)[0]

    return jax.jit(grader).lower(_images(batch)).as_text()


@pytest.fixture(scope="module")
def device():
    return Device("cpu")


@pytest.fixture(scope="module")
def modules() -> dict[str, str]:
    """The modules the tests share, lowered once: batch 1, 3 and 6 of the seed form, and batch 2
    of each form for the smaller cases."""
    out = {f"dict.b{n}": lower_params_dict(n) for n in (1, 2, 3, 6)}
    out["positional.b2"] = lower_positional(2)
    out["weightless.b2"] = lower_weightless(2)
    return out


def seed_bundle(repo: Path, modules: dict[str, str]) -> Path:
    """The seed's severity_grader, as the announcement lays it out."""
    bundle = repo / "severity_grader"
    bundle.mkdir(parents=True)
    (bundle / "manifest.yaml").write_text(SEED_MANIFEST)
    for n in (1, 3, 6):
        (bundle / f"model.b{n}.mlir").write_text(modules[f"dict.b{n}"])
    save_file(dict(reference.grader_weights()), str(bundle / "weights.safetensors"))
    (bundle / "model.py").write_text(SEED_MODEL_PY)
    return bundle


def small_bundle(repo: Path, name: str, module: str, weights_key: dict | None = None, **files) -> Path:
    """The seed's tensors at one compiled batch size (2), with ``module`` as ``model.b2.mlir``;
    ``files`` maps file names to the tensors to save as safetensors."""
    bundle = repo / name
    bundle.mkdir(parents=True)
    manifest = yaml.safe_load(SEED_MANIFEST)
    manifest["name"] = name
    del manifest["client_outputs"]
    manifest["batching"]["compiled_batch_sizes"] = [2]
    if weights_key is not None:
        manifest["weights"] = weights_key
    (bundle / "manifest.yaml").write_text(yaml.safe_dump(manifest))
    (bundle / "model.b2.mlir").write_text(module)
    for file_name, tensors in files.items():
        save_file(tensors, str(bundle / file_name))
    return bundle


def grader_images() -> np.ndarray:
    """Six images whose reference grades cover several levels, none of their logits near 0."""
    flat = [np.full(IMAGE, v, np.uint8) for v in (16, 48, 112, 176, 240)]
    noisy = np.random.default_rng(7).integers(0, 256, (1, *IMAGE), dtype=np.uint8)
    images = np.concatenate([np.stack(flat), noisy])
    assert np.abs(reference.grader_logits_ref(images)).min() > 1e-3
    assert len(set(reference.coral_grade_ref(reference.grader_logits_ref(images))[:, 0])) >= 4
    return images


def load_error(bundle, device) -> str:
    with pytest.raises(BundleError) as info:
        load_bundle(bundle, 1, device)
    return str(info.value)


# ---- the seed's own bundle ------------------------------------------------------------------

def test_seed_bundle_binds_the_weights_file_beside_it_in_sorted_name_order(tmp_path, device, modules):
    bundle = seed_bundle(tmp_path, modules)
    model = load_bundle(bundle, 1, device)
    assert model.manifest.weights_file is None          # the manifest names no weights
    assert model.weights.names == ("t", "w") and not model.weights.declared
    assert model.weights.file == (bundle / "weights.safetensors").resolve()
    assert model.weight_bytes == sum(a.nbytes for a in reference.grader_weights().values())
    x = grader_images()[:3]
    (logits,) = device.execute(model.modules[3].executable, [*model.weights.arrays, x])
    np.testing.assert_allclose(logits, reference.grader_logits_ref(x), rtol=0, atol=5e-3)


def test_seed_bundle_serves_grades_to_the_triton_client(tmp_path, modules):
    repo = tmp_path / "repo"
    seed_bundle(repo, modules)
    images = grader_images()
    with serve(tmp_path / "srv", repo) as server:
        c = grpcclient.InferenceServerClient(server.url)
        index = {m.name: m for m in c.get_model_repository_index().models}
        assert index["severity_grader"].state == "READY", index["severity_grader"].reason
        for batch in (images[:5], images[3:6], images[5:]):     # padded to 6, exactly 3, 1
            r = c.infer("severity_grader", [infer_input("INPUT__0", batch, "UINT8")])
            expected = reference.coral_grade_ref(reference.grader_logits_ref(batch))
            np.testing.assert_array_equal(r.as_numpy("grade"), expected)
        meta = c.get_model_metadata("severity_grader")
        assert [(o.name, o.datatype, list(o.shape)) for o in meta.outputs] == [("grade", "INT64", [-1, 1])]
        assert [(i.name, i.datatype, list(i.shape)) for i in meta.inputs] == [("INPUT__0", "UINT8", [-1, 224, 224])]


# ---- the other cases ------------------------------------------------------------------------

def test_no_weights_key_and_no_file_means_no_weights(tmp_path, device, modules):
    bundle = small_bundle(tmp_path, "folded", modules["weightless.b2"])
    model = load_bundle(bundle, 1, device)
    assert model.weights is None and model.weight_bytes == 0
    x = grader_images()[:2]
    (logits,) = device.execute(model.modules[2].executable, [x])
    np.testing.assert_allclose(logits, reference.grader_logits_ref(x), rtol=0, atol=5e-3)


def test_a_module_that_wants_weights_but_has_none_says_where_weights_come_from(tmp_path, device, modules):
    # The issue's own failure: @main takes weights, and neither a key nor a file provides them.
    bundle = small_bundle(tmp_path, "bare", modules["dict.b2"])
    msg = load_error(bundle, device)
    assert msg.startswith("bundle 'bare': model.b2.mlir: @main takes 3 argument(s) but the manifest gives 1 "
                          "(0 weight(s): no weights: key and no weights.safetensors beside manifest.yaml; "
                          "then 1 executable input(s))")
    assert ("they first differ at argument 0: the manifest gives input 'INPUT__0' tensor<2x224x224xui8>, "
            "@main takes tensor<9xf32>") in msg
    assert "@main takes: tensor<9xf32>, tensor<784x9xf32>, tensor<2x224x224xui8>" in msg


def test_explicit_weights_key_wins_over_the_default_file(tmp_path, device, modules):
    weights = dict(reference.grader_weights())
    # A weights.safetensors the module cannot take (one tensor of another shape) is ignored: the
    # manifest names its own file and order.
    bundle = small_bundle(tmp_path, "explicit", modules["positional.b2"],
                          {"file": "grader.safetensors", "order": ["w", "t"]},
                          **{"grader.safetensors": weights,
                             "weights.safetensors": {"decoy": np.zeros(5, np.float32)}})
    model = load_bundle(bundle, 1, device)
    assert model.weights.names == ("w", "t") and model.weights.declared
    assert model.weights.file.name == "grader.safetensors"
    x = grader_images()[2:4]
    (logits,) = device.execute(model.modules[2].executable, [*model.weights.arrays, x])
    np.testing.assert_allclose(logits, reference.grader_logits_ref(x), rtol=0, atol=5e-3)


def test_explicit_weights_file_without_order_binds_sorted_names(tmp_path, device, modules):
    weights = reference.grader_weights()
    bundle = small_bundle(tmp_path, "named", modules["dict.b2"], {"file": "grader.safetensors"},
                          **{"grader.safetensors": {"w": weights["w"], "t": weights["t"]},
                             "weights.safetensors": {"decoy": np.zeros(5, np.float32)}})
    model = load_bundle(bundle, 1, device)
    assert model.manifest.weights_order is None
    assert model.weights.names == ("t", "w") and model.weights.file.name == "grader.safetensors"
    x = grader_images()[4:6]
    (logits,) = device.execute(model.modules[2].executable, [*model.weights.arrays, x])
    np.testing.assert_allclose(logits, reference.grader_logits_ref(x), rtol=0, atol=5e-3)


def test_explicit_weights_file_that_is_missing_is_an_error_even_with_the_default_file(tmp_path, device, modules):
    bundle = small_bundle(tmp_path, "gone", modules["dict.b2"], {"file": "grader.safetensors"},
                          **{"weights.safetensors": dict(reference.grader_weights())})
    assert load_error(bundle, device) == ("bundle 'gone': weights file grader.safetensors is missing "
                                          "(the manifest's weights: key asks for it)")


def test_default_weights_of_the_wrong_shape_name_the_tensor_and_argument(tmp_path, device, modules):
    weights = reference.grader_weights()
    bundle = small_bundle(tmp_path, "narrow", modules["dict.b2"],
                          **{"weights.safetensors": {"t": weights["t"], "w": weights["w"][:, :4].copy()}})
    msg = load_error(bundle, device)
    assert msg == ("bundle 'narrow': model.b2.mlir: weight 'w' (argument 1 of @main): expected tensor<784x4xf32> "
                   "(FP32[784,4]), found tensor<784x9xf32> (FP32[784,9])")


def test_default_weights_with_a_surplus_tensor_name_every_weight_and_the_file(tmp_path, device, modules):
    weights = reference.grader_weights()
    bundle = small_bundle(tmp_path, "surplus", modules["dict.b2"],
                          **{"weights.safetensors": {**weights, "u": np.zeros(3, np.float32)}})
    msg = load_error(bundle, device)
    assert msg.startswith("bundle 'surplus': model.b2.mlir: @main takes 3 argument(s) but the manifest gives 4 "
                          "(3 weight(s) from weights.safetensors (beside manifest.yaml, which has no weights: "
                          "key, so all its tensors, names sorted); then 1 executable input(s))")
    assert ("they first differ at argument 1: the manifest gives weight 'u' tensor<3xf32>, "
            "@main takes tensor<784x9xf32>") in msg
    assert ("Expected, in order: weight 't' tensor<9xf32>, weight 'u' tensor<3xf32>, "
            "weight 'w' tensor<784x9xf32>, input 'INPUT__0' tensor<2x224x224xui8>;") in msg


def test_a_long_argument_mismatch_lists_only_the_first_arguments(tmp_path, device, modules):
    # Hundreds of weights must not make one error pages long: each list stops after eight.
    weights = {f"p{i:03d}": np.zeros(1, np.float32) for i in range(300)}
    bundle = small_bundle(tmp_path, "many", modules["dict.b2"], **{"weights.safetensors": weights})
    msg = load_error(bundle, device)
    assert "@main takes 3 argument(s) but the manifest gives 301 (300 weight(s) from weights.safetensors" in msg
    assert "weight 'p007' tensor<1xf32>, and 293 more;" in msg and "p008" not in msg
    assert len(msg) < 1500


def test_a_stray_weights_file_beside_a_weightless_module_is_an_error_naming_it(tmp_path, device, modules):
    bundle = small_bundle(tmp_path, "stray", modules["weightless.b2"],
                          **{"weights.safetensors": dict(reference.grader_weights())})
    msg = load_error(bundle, device)
    assert "@main takes 1 argument(s) but the manifest gives 3 (2 weight(s) from weights.safetensors (beside " \
           "manifest.yaml, which has no weights: key" in msg
    assert ("they first differ at argument 0: the manifest gives weight 't' tensor<9xf32>, "
            "@main takes tensor<2x224x224xui8>") in msg
    assert msg.endswith("@main takes: tensor<2x224x224xui8>")
