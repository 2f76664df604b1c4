"""One module for every batch size: exported once with a symbolic batch (``model.mlir``),
specialized by the loader to each compiled batch size, validated and compiled like per-size
modules, and computing exactly what they compute."""
from __future__ import annotations

import io
import logging
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from xlaserve.bundle import load_bundle
from xlaserve.cli import main
from xlaserve.errors import BundleError
from xlaserve.export import TensorSpec, TracingError, export_jax
from xlaserve.progress import ProgressReport, Step, bar
from xlaserve.runtime.excache import ExecutableCache
from xlaserve.runtime.pjrt import Device, ModuleError, TensorType, read_signature, specialize

SIZES = [1, 2, 3, 8]
X = TensorSpec("x", "f32", "xn", {"x": 5})


@pytest.fixture(scope="module")
def device() -> Device:
    return Device("cpu")


def params() -> dict:
    rng = np.random.default_rng(3)
    return {"dense": [{"kernel": rng.standard_normal((5, 7)).astype(np.float32),
                       "bias": rng.standard_normal(7).astype(np.float32)},
                      {"kernel": rng.standard_normal((7, 4)).astype(np.float32),
                       "bias": rng.standard_normal(4).astype(np.float32)}]}


def forward(p, x):
    h = jnp.tanh(x @ p["dense"][0]["kernel"] + p["dense"][0]["bias"])
    logits = h @ p["dense"][1]["kernel"] + p["dense"][1]["bias"]
    return {"logits": logits, "label": jnp.argmax(logits, axis=1).astype(jnp.int32),
            "norm": jnp.sum(logits * logits, axis=1, keepdims=True)}


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """The same model as per-size modules, as one dynamic text module and as one dynamic
    portable artifact."""
    repo = tmp_path_factory.mktemp("dynamic")
    export_jax(repo / "per_size", forward, params(), inputs=[X], compiled_batch_sizes=SIZES)
    export_jax(repo / "dynamic", forward, params(), inputs=[X], compiled_batch_sizes=SIZES, dynamic_batch=True)
    export_jax(repo / "dynamic_bc", forward, params(), inputs=[X], compiled_batch_sizes=SIZES,
               dynamic_batch=True, bytecode=True)
    return repo


@pytest.fixture
def repo(tmp_path, bundles):
    shutil.copytree(bundles, tmp_path / "repo")
    return tmp_path / "repo"


def load_error(bundle, device) -> str:
    with pytest.raises(BundleError) as info:
        load_bundle(bundle, 1, device)
    return str(info.value)


def run(device, model, batch, x):
    return device.execute(model.modules[batch].executable, [*model.weights.read(), x])


# --- export -------------------------------------------------------------------------------------

def test_export_writes_one_module_with_dynamic_batch_axes(bundles):
    assert sorted(p.name for p in (bundles / "dynamic").iterdir()) == [
        "manifest.yaml", "model.mlir", "weights.safetensors"]
    assert sorted(p.name for p in (bundles / "dynamic_bc").iterdir()) == [
        "manifest.yaml", "model.mlirbc", "weights.safetensors"]
    per = yaml.safe_load((bundles / "per_size" / "manifest.yaml").read_text())
    assert yaml.safe_load((bundles / "dynamic" / "manifest.yaml").read_text()) == {**per, "name": "dynamic"}
    sig = read_signature((bundles / "dynamic" / "model.mlir").read_bytes())
    assert sig.inputs[-1] == TensorType((None, 5), "f32")          # the input, after 4 weights
    assert [t.shape for t in sig.outputs] == [(None,), (None, 4), (None, 1)]
    per_size = sum(p.stat().st_size for p in (bundles / "per_size").glob("model.b*.mlir"))
    assert (bundles / "dynamic" / "model.mlir").stat().st_size < per_size / 2


def test_both_forms_give_bit_identical_outputs_at_every_size(bundles, device):
    per = load_bundle(bundles / "per_size", 1, device)
    for name in ("dynamic", "dynamic_bc"):
        dyn = load_bundle(bundles / name, 1, device)
        assert dyn.compiled_batch_sizes == tuple(SIZES)
        for batch in SIZES:
            module = dyn.modules[batch]
            assert module.dynamic and module.label == f"{module.path.name}@b{batch}"
            x = np.random.default_rng(batch).standard_normal((batch, 5)).astype(np.float32)
            expected = run(device, per, batch, x)
            found = run(device, dyn, batch, x)
            assert [a.shape for a in found] == [(batch,), (batch, 4), (batch, 1)]
            for a, b in zip(found, expected):
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_verification_runs_each_specialization(bundles, tmp_path):
    result = export_jax(tmp_path / "again", forward, params(), inputs=[X], compiled_batch_sizes=[2, 5],
                        dynamic_batch=True)
    assert [(c.module, c.output) for c in result.verification.checks] == [
        (f"model.mlir@b{b}", o) for b in (2, 5) for o in ("label", "logits", "norm")]


def test_a_function_that_needs_a_concrete_batch_fails_to_trace_naming_the_symbolic_batch(tmp_path):
    def per_row(p, x):
        return jnp.stack([x[i] * 2 for i in range(x.shape[0])])
    with pytest.raises(TracingError, match=r"while being traced at the symbolic batch size b: .*\n"
                                           r"  it was called as fn\(params=None, x=f32\[b,5\]\)"):
        export_jax(tmp_path / "m", per_row, None, inputs=[X], compiled_batch_sizes=[1, 2],
                   outputs=[TensorSpec("y", "f32", "xn", {"x": 5})], dynamic_batch=True)
    assert not (tmp_path / "m").exists()


# --- specialization -----------------------------------------------------------------------------

def test_specialize_is_deterministic_and_refuses_what_does_not_fit(bundles):
    module = (bundles / "dynamic" / "model.mlir").read_bytes()
    weights = list(read_signature(module).inputs[:-1])
    at4 = specialize(module, [*weights, TensorType((4, 5), "f32")])
    assert at4 == specialize(module, [*weights, TensorType((4, 5), "f32")])
    assert read_signature(at4).outputs == (TensorType((4,), "i32"), TensorType((4, 4), "f32"),
                                           TensorType((4, 1), "f32"))
    with pytest.raises(ModuleError, match=r"argument 4 of @main is tensor<\?x5xf32>, which tensor<4x6xf32> does not"):
        specialize(module, [*weights, TensorType((4, 6), "f32")])
    with pytest.raises(ModuleError, match=r"argument 4 of @main is tensor<\?x5xf32>, which tensor<4x5xi32> does not"):
        specialize(module, [*weights, TensorType((4, 5), "i32")])
    with pytest.raises(ModuleError, match="@main takes 5 argument"):
        specialize(module, [TensorType((4, 5), "f32")])


def test_the_executable_cache_keys_on_each_specialized_module(bundles, device, tmp_path):
    cache = ExecutableCache(tmp_path / "cache", device)
    first = load_bundle(bundles / "dynamic", 1, device, cache.compile_module)
    assert not any(m.cache_hit for m in first.modules.values())
    assert len(list((tmp_path / "cache").rglob("*.xlaexe"))) == len(SIZES)     # one entry per size
    second = load_bundle(bundles / "dynamic", 2, device, ExecutableCache(tmp_path / "cache", device).compile_module)
    assert all(m.cache_hit for m in second.modules.values())
    x = np.ones((3, 5), np.float32)
    assert [a.tobytes() for a in run(device, second, 3, x)] == [a.tobytes() for a in run(device, first, 3, x)]


def test_compile_progress_counts_the_sizes(bundles, device):
    lines: list[str] = []
    load_bundle(bundles / "dynamic", 1, device, progress=lines.append)
    assert [(s.stage, s.done, s.total) for s in lines] == [("compile", i, 4) for i in range(1, 5)]
    assert lines[1].startswith("dynamic: model.mlir@b2 compiled in ") and lines[1].endswith("s (2/4)")


# --- validation ---------------------------------------------------------------------------------

def test_both_forms_in_one_bundle_are_refused(repo, device):
    shutil.copy(repo / "per_size" / "model.b2.mlir", repo / "dynamic" / "model.b2.mlir")
    assert load_error(repo / "dynamic", device) == (
        "bundle 'dynamic': model.mlir (one module for every batch size) and model.b2.mlir (one per size) are"
        " both present; keep one form")


def test_two_dynamic_modules_are_refused(repo, device):
    shutil.copy(repo / "dynamic_bc" / "model.mlirbc", repo / "dynamic" / "model.mlirbc")
    assert "two dynamic-batch modules, model.mlir and model.mlirbc; keep one" in load_error(repo / "dynamic", device)


def test_a_static_module_named_as_the_dynamic_one_is_refused(repo, device):
    (repo / "dynamic" / "model.mlir").write_bytes((repo / "per_size" / "model.b2.mlir").read_bytes())
    assert load_error(repo / "dynamic", device) == (
        "bundle 'dynamic': model.mlir (the dynamic-batch module): input 'x' (argument 4 of @main): expected"
        " tensor<?x5xf32> (FP32[?,5]), found tensor<2x5xf32> (FP32[2,5])")


def test_a_manifest_that_disagrees_with_the_dynamic_module_names_the_tensor(repo, device):
    path = repo / "dynamic" / "manifest.yaml"
    manifest = yaml.safe_load(path.read_text())
    manifest["executable_outputs"][1]["dims"]["x"] = 3
    path.write_text(yaml.safe_dump(manifest))
    assert load_error(repo / "dynamic", device) == (
        "bundle 'dynamic': model.mlir (the dynamic-batch module): output 'logits' (result 1 of @main): expected"
        " tensor<?x3xf32> (FP32[?,3]), found tensor<?x4xf32> (FP32[?,4])")


def test_a_module_whose_constraint_excludes_a_size_does_not_specialize(tmp_path, device):
    """A module exported by hand with ``b <= 4``, listed for batch 8: its shape assertion fails."""
    bundle = tmp_path / "capped"
    export_jax(bundle, forward, params(), inputs=[X], compiled_batch_sizes=[1, 8], verify=False)
    (b,) = jax.export.symbolic_shape("b", constraints=["b <= 4"])
    flat = [np.zeros((7,), np.float32), np.zeros((5, 7), np.float32), np.zeros((4,), np.float32),
            np.zeros((7, 4), np.float32)]

    def flat_forward(b0, k0, b1, k1, x):
        out = forward({"dense": [{"kernel": k0, "bias": b0}, {"kernel": k1, "bias": b1}]}, x)
        return out["label"], out["logits"], out["norm"]
    exported = jax.export.export(jax.jit(flat_forward))(
        *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in flat], jax.ShapeDtypeStruct((b, 5), np.float32))
    for file in bundle.glob("model.b*.mlir"):
        file.unlink()
    (bundle / "model.mlir").write_text(exported.mlir_module())
    message = load_error(bundle, device)
    assert message.startswith("bundle 'capped': model.mlir cannot be specialized to batch size 8: its shapes do not"
                              " all resolve: ")
    assert "b <= 4" in message


def test_a_module_with_a_shape_computed_from_data_does_not_specialize(tmp_path, device):
    bundle = tmp_path / "ragged"
    bundle.mkdir()
    (bundle / "manifest.yaml").write_text(yaml.safe_dump({
        "format_version": "2.0",
        "executable_inputs": [{"name": "x", "dtype": "f32", "shape": "xn", "dims": {"x": 4}}],
        "executable_outputs": [{"name": "y", "dtype": "f32", "shape": "n"}],
        "batching": {"compiled_batch_sizes": [2]}}))
    (bundle / "model.mlir").write_text("""
func.func public @main(%arg0: tensor<?x4xf32>) -> tensor<?xf32> {
  %0 = stablehlo.slice %arg0 [0:1, 0:1] : (tensor<?x4xf32>) -> tensor<1x1xf32>
  %1 = stablehlo.reshape %0 : (tensor<1x1xf32>) -> tensor<1xf32>
  %2 = stablehlo.convert %1 : (tensor<1xf32>) -> tensor<1xi32>
  %3 = stablehlo.dynamic_iota %2, dim = 0 : (tensor<1xi32>) -> tensor<?xf32>
  return %3 : tensor<?xf32>
}
""")
    message = load_error(bundle, device)
    assert message.startswith("bundle 'ragged': model.mlir cannot be specialized to batch size 2: its shapes do not"
                              " all resolve: ")
    assert "dynamic_iota" in message


# --- the command line and its progress ----------------------------------------------------------

MODEL = '''
import jax.numpy as jnp
import numpy as np

def init_params():
    return {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)}

def forward(params, x):
    return jnp.tanh(x @ params["w"])
'''


def test_cli_dynamic_batch_end_to_end(tmp_path, capsys, caplog, device):
    caplog.set_level("INFO", logger="xlaserve.export")
    source = tmp_path / "dyn_cli_model.py"
    source.write_text(MODEL)
    out = tmp_path / "models" / "tiny"
    rc = main(["export", f"{source}:forward", "--params", "init_params", "--input", "x:float32:3",
               "--batch-sizes", "4,1,2", "--dynamic-batch", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert captured.out == (f"wrote {out}: 1 dynamic-batch module for sizes 1,2,4, 1 weights, verified: 1 output"
                            f" of each module within tolerance of {source}:forward\n")
    assert "tiny: traced with a symbolic batch size for compiled batch sizes [1, 2, 4] in " in caplog.text
    assert "tiny: model.mlir@b4 compiled in " in caplog.text and "(3/3)" in caplog.text
    assert sorted(p.name for p in out.iterdir()) == ["manifest.yaml", "model.mlir", "weights.safetensors"]
    model = load_bundle(out, 1, device)
    x = np.ones((2, 3), np.float32)
    (y,) = device.execute(model.modules[2].executable, [*model.weights.read(), x])
    np.testing.assert_allclose(y, np.tanh(x @ np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)), rtol=1e-6)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal_lines_elsewhere(caplog):
    caplog.set_level("INFO", logger="test.progress")
    log = logging.getLogger("test.progress")
    assert bar(Step("compile", 2, 6, "")) == "compile [########................] 2/6"
    assert bar(Step("verify", 3, 3, ""), width=4) == "verify [####] 3/3"
    terminal, pipe = Terminal(), io.StringIO()
    for stream in (terminal, pipe):
        report = ProgressReport(log, stream)
        report("note: a note")
        report(Step("trace", 1, 2, "m: traced 1"))
        report(Step("trace", 2, 2, "m: traced 2"))
        report.close()
    assert terminal.getvalue() == ("trace [############............] 1/2\r\x1b[K"
                                   "trace [########################] 2/2\r\x1b[K")
    assert pipe.getvalue() == ""                     # not a terminal: the log lines only
    assert caplog.messages == ["note: a note", "m: traced 1", "m: traced 2"] * 2


def test_a_specialization_whose_batch_comes_out_wrong_is_refused_naming_it(tmp_path, device):
    """Valid with '?' batch axes, but the output's batch is twice the input's once refined."""
    bundle = tmp_path / "doubled"
    bundle.mkdir()
    (bundle / "manifest.yaml").write_text(yaml.safe_dump({
        "format_version": "2.0",
        "executable_inputs": [{"name": "x", "dtype": "f32", "shape": "xn", "dims": {"x": 4}}],
        "executable_outputs": [{"name": "y", "dtype": "f32", "shape": "xn", "dims": {"x": 4}}],
        "batching": {"compiled_batch_sizes": [2]}}))
    (bundle / "model.mlir").write_text("""
func.func public @main(%arg0: tensor<?x4xf32>) -> tensor<?x4xf32> {
  %0 = stablehlo.concatenate %arg0, %arg0, dim = 0 : (tensor<?x4xf32>, tensor<?x4xf32>) -> tensor<?x4xf32>
  return %0 : tensor<?x4xf32>
}
""")
    assert load_error(bundle, device) == (
        "bundle 'doubled': model.mlir@b2: output 'y' (result 0 of @main): expected tensor<2x4xf32> (FP32[2,4]),"
        " found tensor<4x4xf32> (FP32[4,4])")
