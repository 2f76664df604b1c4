"""Bundle loading: the manifest and weights validated against each module's @main signature."""
from __future__ import annotations

import json
import shutil
import os
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import yaml
from safetensors.numpy import save_file

from examples.export_examples import export_mlp, export_simple
from tests.conftest import ROOT
from xlaserve.bundle import load_bundle
from xlaserve.errors import BundleError
from xlaserve.manifest import FORMAT_VERSION
from xlaserve.runtime.pjrt import Device


@pytest.fixture(scope="module")
def device():
    return Device("cpu")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    repo = tmp_path_factory.mktemp("pristine")
    export_mlp(repo, (1, 4))
    export_simple(repo, (2,))
    return repo


@pytest.fixture
def repo(tmp_path, pristine):
    shutil.copytree(pristine, tmp_path / "repo")
    return tmp_path / "repo"


def edit_manifest(bundle, fn):
    path = bundle / "manifest.yaml"
    data = yaml.safe_load(path.read_text())
    fn(data)
    path.write_text(yaml.safe_dump(data))


def load_error(bundle, device) -> str:
    with pytest.raises(BundleError) as info:
        load_bundle(bundle, 1, device)
    return str(info.value)


def test_valid_bundle_loads_and_runs(repo, device):
    model = load_bundle(repo / "mlp", 1, device)
    assert model.compiled_batch_sizes == (1, 4)
    assert model.weights.names == ("w",) and model.weight_bytes == 512 * 512 * 4
    x = np.ones((4, 512), np.float32)
    (out,) = device.execute(model.modules[4].executable, [*model.weights.arrays, x])
    assert out.shape == (4, 512)


def test_input_shape_mismatch_names_bundle_tensor_expected_and_found(repo, device):
    edit_manifest(repo / "mlp", lambda d: d["executable_inputs"][0]["dims"].update(f=256))
    msg = load_error(repo / "mlp", device)
    assert msg.startswith("bundle 'mlp': model.b1.mlir: input 'input' (argument 1 of @main): ")
    assert "expected tensor<1x256xf32>" in msg and "found tensor<1x512xf32>" in msg


def test_dtype_mismatch(repo, device):
    edit_manifest(repo / "simple", lambda d: d["executable_outputs"][1].update(dtype="i64"))
    msg = load_error(repo / "simple", device)
    assert "output 'OUTPUT1' (result 1 of @main): expected tensor<2x16xi64> (INT64[2,16]), found " \
           "tensor<2x16xi32> (INT32[2,16])" in msg


def test_wrong_batch_size_in_module_name(repo, device):
    (repo / "simple" / "model.b2.mlir").rename(repo / "simple" / "model.b3.mlir")
    edit_manifest(repo / "simple", lambda d: d["batching"].update(compiled_batch_sizes=[3]))
    assert "input 'INPUT0' (argument 0 of @main): expected tensor<3x16xi32>" in load_error(repo / "simple", device)


def test_argument_count_mismatch(repo, device):
    edit_manifest(repo / "simple", lambda d: d["executable_inputs"].pop())
    msg = load_error(repo / "simple", device)
    assert "@main takes 2 argument(s) but the manifest gives 1" in msg
    assert "they first differ at argument 1: the manifest gives nothing more, @main takes tensor<2x16xi32>" in msg


def test_weight_shape_mismatch(repo, device):
    save_file({"w": np.zeros((512, 256), np.float32)}, str(repo / "mlp" / "weights.safetensors"))
    msg = load_error(repo / "mlp", device)
    assert "weight 'w' (argument 0 of @main): expected tensor<512x256xf32>" in msg
    assert "found tensor<512x512xf32>" in msg


def _safetensors(header, data: bytes = b"\0" * 64) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


@pytest.mark.parametrize("header,message", [
    ([1, 2], "the header is not a JSON object of tensors (it is list)"),
    ({"w": "x"}, "tensor 'w' is not described by a JSON object"),
    ({"w": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}, "tensor 'w' has dtype ['F32']"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [-20, -12]}}, "'data_offsets' must be two integers"),
    ({"w": {"dtype": "F32", "shape": [-1, -2], "data_offsets": [0, 8]}}, "'shape' must be a list of integers >= 0"),
    ({"w": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}}, "'shape' must be a list of integers >= 0"),
    ({"w": {"dtype": "F32", "shape": [True, True], "data_offsets": [0, 4]}}, "'shape' must be a list"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0.5, 8.5]}}, "'data_offsets' must be two integers"),
    ({"w": {"dtype": "F32", "shape": [2 ** 62, 2 ** 62], "data_offsets": [0, 0]}}, "spans bytes 0..0 of the data"),
    (b"[" * 100_000 + b"]" * 100_000, "nests JSON arrays or objects too deeply"),
])
def test_a_hostile_safetensors_header_is_refused_naming_what_is_wrong(repo, device, header, message):
    # before: a list header or a non-object entry escaped as AttributeError, negative offsets
    # pointed into the header (or before the file), and a shape whose int64 product wrapped to 0
    # matched an empty span
    (repo / "mlp" / "weights.safetensors").write_bytes(_safetensors(header))
    error = load_error(repo / "mlp", device)
    assert "cannot read weights.safetensors" in error and message in error, error


def test_a_header_of_many_tensors_is_read_in_linear_time_and_named_briefly(repo, device):
    # before: each name the order picks was looked up in a list of the header's names, so a
    # header of a million empty tensors (well inside the 100 MB header limit) held the load for
    # hours; 150,000 took over two minutes. And a weights.order naming a missing tensor
    # printed every name in the header.
    header = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(150_000)}
    (repo / "mlp" / "weights.safetensors").write_bytes(_safetensors(header))
    error = load_error(repo / "mlp", device)      # the mlp bundle's weights.order is ['w']
    assert "weights.order names 'w' but weights.safetensors holds 150000 tensor(s): 't0', 't1', 't10'," in error
    assert "and 149992 more" in error and len(error) < 1000, error
    edit_manifest(repo / "mlp", lambda d: d["weights"].pop("order"))    # every tensor of the file
    started = time.perf_counter()
    error = load_error(repo / "mlp", device)
    assert time.perf_counter() - started < 10, "quadratic"
    assert "150000 weight(s) from weights.safetensors" in error and len(error) < 2000, error


def test_missing_and_truncated_weights(repo, device):
    data = (repo / "mlp" / "weights.safetensors").read_bytes()
    (repo / "mlp" / "weights.safetensors").write_bytes(data[: len(data) // 2])
    assert "cannot read weights.safetensors" in load_error(repo / "mlp", device)
    (repo / "mlp" / "weights.safetensors").unlink()
    assert "weights file weights.safetensors is missing" in load_error(repo / "mlp", device)


def test_missing_module_and_unlisted_module(repo, device):
    (repo / "mlp" / "model.b4.mlir").unlink()
    assert "no module for compiled batch size(s) [4]" in load_error(repo / "mlp", device)
    shutil.copy(repo / "mlp" / "model.b1.mlir", repo / "mlp" / "model.b4.mlir")
    shutil.copy(repo / "mlp" / "model.b1.mlir", repo / "mlp" / "model.b9.mlir")
    assert "model.b9.mlir for batch size(s) [9] not listed" in load_error(repo / "mlp", device)


def test_garbage_module(repo, device):
    (repo / "simple" / "model.b2.mlir").write_text("this is not mlir")
    assert "model.b2.mlir: not a parsable StableHLO module" in load_error(repo / "simple", device)


def _fifo(path):
    os.mkfifo(path)


def _dev_null(path):
    os.symlink("/dev/null", path)   # the same as /dev/zero, which was read until memory ran out


@pytest.mark.parametrize("bundle, name, make, found", [
    ("simple", "model.b2.mlir", _fifo, "a FIFO (named pipe)"),           # blocked the load for good
    ("simple", "model.b2.mlir", _dev_null, "a character device"),
    ("mlp", "weights.safetensors", _fifo, "a FIFO (named pipe)"),        # "is missing"
    ("simple", "model.py", _fifo, "a FIFO (named pipe)"),                # skipped: loaded without hooks
    ("simple", "model.py", os.mkdir, "a directory"),                     # skipped likewise
], ids=["fifo-module", "device-module", "fifo-weights", "fifo-model.py", "directory-model.py"])
def test_a_bundle_file_that_is_not_a_regular_file_is_refused_without_reading_it(repo, device, bundle, name,
                                                                               make, found):
    path = repo / bundle / name
    path.unlink(missing_ok=True)
    make(path)
    outcome = []

    def load():
        try:
            load_bundle(repo / bundle, 1, device)
            outcome.append("loaded")
        except BundleError as exc:
            outcome.append(str(exc))

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(30)
    if thread.is_alive():           # blocked opening the FIFO: a writer that comes and goes ends it
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(30)
        pytest.fail(f"load_bundle blocked on {name}, {found}")
    assert outcome == [f"bundle '{bundle}': {name} is {found}; expected a regular file (or a link to one)"]


def test_a_manifest_that_is_not_utf8_is_refused_naming_the_byte_and_line(repo, device):
    # its UnicodeDecodeError escaped the loader and ended the worker
    manifest = repo / "simple" / "manifest.yaml"
    lines = manifest.read_bytes().count(b"\n")
    manifest.write_bytes(manifest.read_bytes() + b"# caf\xe9\n")
    assert load_error(repo / "simple", device) == (
        f"bundle 'simple': manifest.yaml is not UTF-8 text: byte 0xe9 on line {lines + 1} (invalid continuation "
        "byte); expected a YAML document in UTF-8")


def test_model_py_registering_another_name(repo, device):
    (repo / "simple" / "model.py").write_text(
        "from xlaserve import register_model\nregister_model('other', postprocess=lambda t: t)\n")
    assert "model.py registers ['other']" in load_error(repo / "simple", device)


def test_failing_bundle_is_unavailable_and_others_serve(repo, tmp_path):
    import tritonclient.grpc as grpcclient
    from tests.conftest import serve
    edit_manifest(repo / "mlp", lambda d: d["executable_inputs"][0]["dims"].update(f=256))
    with serve(tmp_path / "srv", repo) as server:
        c = grpcclient.InferenceServerClient(server.url)
        index = {m.name: m for m in c.get_model_repository_index().models}
        assert index["mlp"].state == "UNAVAILABLE"
        assert "input 'input' (argument 1 of @main)" in index["mlp"].reason
        assert not c.is_model_ready("mlp")
        assert c.is_model_ready("simple")
        a = np.ones((2, 16), np.int32)
        ins = []
        for name in ("INPUT0", "INPUT1"):
            t = grpcclient.InferInput(name, [2, 16], "INT32")
            t.set_data_from_numpy(a)
            ins.append(t)
        assert (c.infer("simple", ins).as_numpy("OUTPUT0") == 2).all()
        with pytest.raises(Exception, match="model 'mlp' is UNAVAILABLE"):
            x = grpcclient.InferInput("input", [1, 512], "FP32")
            x.set_data_from_numpy(np.zeros((1, 512), np.float32))
            c.infer("mlp", [x])


def test_reading_a_bundle_imports_no_jax(tmp_path):
    """The bundle format is read without JAX: a tool that lists a repository (or checks its
    manifests and weights) pays no JAX import; only load_bundle, which compiles, brings it in."""
    bundle = tmp_path / "tiny"
    bundle.mkdir()
    tensor = {"dtype": "f32", "shape": "fn", "dims": {"f": 4}}
    (bundle / "manifest.yaml").write_text(yaml.safe_dump({
        "format_version": FORMAT_VERSION, "name": "tiny",
        "executable_inputs": [{"name": "x", **tensor}], "executable_outputs": [{"name": "y", **tensor}],
        "weights": {"file": "weights.safetensors", "order": ["w"]},
        "batching": {"compiled_batch_sizes": [1, 2]}}))
    save_file({"w": np.zeros((4, 4), np.float32)}, str(bundle / "weights.safetensors"))
    for size in (1, 2):
        (bundle / f"model.b{size}.mlir").write_text("module {}\n")
    code = ("import sys; from pathlib import Path; import xlaserve.bundle as b; path = Path(sys.argv[1]); "
            "m = b.read_manifest(path); w = b.read_weights(path, m); "
            "print(m.bundle, m.compiled_batch_sizes, sorted(b.find_modules(path, m)), w.names, "
            "sorted(n for n in sys.modules if n.split('.')[0] in ('jax', 'jaxlib')))")
    found = subprocess.run([sys.executable, "-c", code, str(bundle)], capture_output=True, text=True,
                           cwd=ROOT)
    assert found.returncode == 0, found.stderr
    assert found.stdout.split() == ["tiny", "(1,", "2)", "[1,", "2]", "('w',)", "[]"]
