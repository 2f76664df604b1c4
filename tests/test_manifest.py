"""Manifest parsing and the named-axis notation."""
from __future__ import annotations

import pytest

from xlaserve.errors import BundleError
from xlaserve.manifest import parse_manifest


def manifest(**over):
    base = {
        "format_version": "2.0",
        "executable_inputs": [{"name": "x", "dtype": "u8", "shape": "cwhn", "dims": {"c": 3, "w": 224, "h": 224}}],
        "executable_outputs": [{"name": "y", "dtype": "f32", "shape": "zn", "dims": {"z": 9}}],
        "batching": {"compiled_batch_sizes": [8, 1, 3]},
    }
    base.update(over)
    return base


def test_named_axes_reverse_into_row_major():
    m = parse_manifest(manifest(), "grader")
    x = m.executable_inputs[0]
    assert x.row_major_shape(8) == (8, 224, 224, 3)
    assert x.wire_dims() == (-1, 224, 224, 3)
    assert x.batch_axis == 0
    assert x.dtype.kserve == "UINT8"
    assert m.compiled_batch_sizes == (1, 3, 8)
    assert m.client_inputs == m.executable_inputs  # default: the executable ones
    assert m.weights_file is None and m.kind == "model"


def test_batch_axis_need_not_be_slowest():
    m = parse_manifest(manifest(executable_inputs=[
        {"name": "x", "dtype": "f32", "shape": "nw", "dims": {"w": 4}}]), "b")
    assert m.executable_inputs[0].row_major_shape(2) == (4, 2)
    assert m.executable_inputs[0].batch_axis == 1


def test_seed_manifest_with_client_outputs_and_weights():
    m = parse_manifest(manifest(
        name="severity_grader",
        client_outputs=[{"name": "grade", "dtype": "i64", "shape": "yn", "dims": {"y": 1}},
                        {"name": "label", "dtype": "bytes", "shape": "n"}],
        weights={"file": "weights.safetensors", "order": ["b", "a"]}), "severity_grader")
    assert [t.name for t in m.client_outputs] == ["grade", "label"]
    assert m.client_outputs[1].dtype.kserve == "BYTES"
    assert m.weights_order == ("b", "a")


def test_weights_key_forms():
    """No key: weights_file None (the loader then looks for weights.safetensors beside the
    manifest). A key without order: names sorted (None). A key without file: weights.safetensors."""
    assert parse_manifest(manifest(), "g").weights_file is None
    named = parse_manifest(manifest(weights={"file": "trained.safetensors"}), "g")
    assert (named.weights_file, named.weights_order) == ("trained.safetensors", None)
    empty = parse_manifest(manifest(weights={}), "g")
    assert (empty.weights_file, empty.weights_order) == ("weights.safetensors", None)


@pytest.mark.parametrize("change, fragment", [
    ({"extra": 1}, "unknown key(s) extra"),
    ({"format_version": "1.0"}, "format_version: expected \"2.0\""),
    ({"name": "other"}, "name: 'other' must equal the bundle's directory name 'grader'"),
    ({"kind": "ensemble"}, "kind: expected 'model' or 'meta'"),
    ({"batching": {"compiled_batch_sizes": []}}, "compiled_batch_sizes: expected a non-empty list"),
    ({"batching": {"compiled_batch_sizes": [1, 1]}}, "sizes repeat"),
    ({"batching": {"sizes": [1]}}, "batching: unknown key(s) sizes"),
    ({"executable_inputs": [{"name": "x", "dtype": "f128", "shape": "n"}]}, "dtype: expected one of b1 u8"),
    ({"executable_inputs": [{"name": "x", "dtype": "f32", "shape": "wn"}]}, "dims: no size for axis w"),
    ({"executable_inputs": [{"name": "x", "dtype": "f32", "shape": "n", "dims": {"q": 2}}]},
     "axis q is not in shape \"n\""),
    ({"executable_inputs": [{"name": "x", "dtype": "f32", "shape": "wh", "dims": {"w": 2, "h": 2}}]},
     "executable tensors need the batch axis 'n'"),
    ({"executable_inputs": [{"name": "x", "dtype": "f32", "shape": "nn"}]}, "axis letters repeat"),
    ({"executable_inputs": [{"name": "x", "dtype": "f32", "shape": "wn", "dims": {"w": 0}}]},
     "dims.w: expected a positive integer"),
    ({"executable_inputs": [{"name": "x", "dtype": "bytes", "shape": "n"}]}, "dtype: expected one of"),
    ({"executable_inputs": [{"name": "x", "dtype": "f32", "shape": "n", "size": 3}]}, "unknown key(s) size"),
    ({"weights": {"file": "../w.safetensors"}}, "weights.file: expected a file name inside the bundle"),
])
def test_errors_name_the_bundle_and_key(change, fragment):
    with pytest.raises(BundleError) as info:
        parse_manifest(manifest(**change), "grader")
    assert str(info.value).startswith("bundle 'grader': manifest.yaml: ")
    assert fragment in str(info.value)


def test_meta_takes_client_tensors_only():
    meta = {"format_version": "2.0", "kind": "meta",
            "client_inputs": [{"name": "image", "dtype": "u8", "shape": "cwhn", "dims": {"c": 3, "w": 8, "h": 8}}],
            "client_outputs": [{"name": "labels", "dtype": "bytes", "shape": "n"}]}
    m = parse_manifest(meta, "pipeline")
    assert m.kind == "meta" and m.compiled_batch_sizes == ()
    with pytest.raises(BundleError, match="takes no batching"):
        parse_manifest({**meta, "batching": {"compiled_batch_sizes": [1]}}, "pipeline")
