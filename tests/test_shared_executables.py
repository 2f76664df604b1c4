"""One loaded executable per distinct module (issue 25, part 4): bundles whose modules are
identical share it, counted by the versions that hold it; identical modules are parsed once and
still validated per bundle."""
from __future__ import annotations

import gc
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from benchmarks.catalog_bench import bundle_name, clone_variant, export_architecture, reference, variant_weights
from xlaserve.bundle import load_bundle, read_manifest
from xlaserve.errors import BundleError
from xlaserve.runtime import executables as executables_module
from xlaserve.runtime.executables import ExecutableTable
from xlaserve.runtime.pjrt import Device

HIDDEN = 16
SIZES = (1, 4)


@pytest.fixture(scope="module")
def device() -> Device:
    return Device("cpu")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[int, Path]:
    """Variant 0 of architectures 0 and 1, exported once."""
    repo = tmp_path_factory.mktemp("sources")
    return {arch: export_architecture(repo, arch, HIDDEN, SIZES) for arch in (0, 1)}


def _variant(repo: Path, sources, arch: int, variant: int) -> Path:
    """Bundle ``variant`` of ``arch`` in ``repo``: the exported modules, its own weights."""
    repo.mkdir(exist_ok=True)
    first = repo / bundle_name(arch, 0)
    if not first.exists():
        shutil.copytree(sources[arch], first)
    return first if variant == 0 else clone_variant(first, arch, variant, HIDDEN)


class _CountingCompile:
    def __init__(self, device: Device, fail_on: int | None = None) -> None:
        self.device = device
        self.calls = 0
        self.fail_on = fail_on

    def __call__(self, path: Path, module: bytes):
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError("injected compile failure")
        return self.device.compile(module), False


def _run(device: Device, model, x: np.ndarray) -> np.ndarray:
    module = model.modules[x.shape[0]]
    return device.execute(module.executable, [*model.weights.read(), x])[0]


def test_identical_modules_share_one_executable_and_different_ones_do_not(tmp_path, device, sources):
    compile_ = _CountingCompile(device)
    table = ExecutableTable(device, compile_)
    a = load_bundle(_variant(tmp_path, sources, 0, 0), 1, device, executables=table)
    b = load_bundle(_variant(tmp_path, sources, 0, 1), 1, device, executables=table)
    c = load_bundle(_variant(tmp_path, sources, 1, 0), 1, device, executables=table)
    for size in SIZES:
        assert b.modules[size].executable is a.modules[size].executable
        assert c.modules[size].executable is not a.modules[size].executable
        assert not a.modules[size].shared and b.modules[size].shared and not c.modules[size].shared
        assert table.references(a.modules[size].key) == 2
        assert table.references(c.modules[size].key) == 1
    assert compile_.calls == 2 * len(SIZES)            # per architecture and batch size, not per bundle
    assert len(table) == 2 * len(SIZES)
    stats = table.statistics()
    assert (stats.executables, stats.references, stats.shared, stats.compiled) == (4, 6, 2, 4)
    # the shared executable runs each bundle on its own weights
    x = np.linspace(-1, 1, 4 * 64, dtype=np.float32).reshape(4, 64)
    for model, variant in ((a, 0), (b, 1)):
        np.testing.assert_allclose(_run(device, model, x), reference(variant_weights(0, variant, HIDDEN), x),
                                   rtol=1e-5, atol=1e-5)
    assert not np.allclose(_run(device, a, x), _run(device, b, x))


def test_without_a_table_nothing_is_shared(tmp_path, device, sources):
    a = load_bundle(_variant(tmp_path, sources, 0, 0), 1, device)
    b = load_bundle(_variant(tmp_path, sources, 0, 1), 1, device)
    assert a.modules[1].executable is not b.modules[1].executable
    assert not b.modules[1].shared


def test_an_entry_lives_while_a_version_holds_it(tmp_path, device, sources):
    compile_ = _CountingCompile(device)
    table = ExecutableTable(device, compile_)
    a = load_bundle(_variant(tmp_path, sources, 0, 0), 1, device, executables=table)
    b = load_bundle(_variant(tmp_path, sources, 0, 1), 1, device, executables=table)
    key, executable = a.modules[1].key, a.modules[1].executable
    del a                     # unloaded (or replaced, its last request answered)
    # released by reference counting alone: the worker freezes its start-up objects out of the
    # cyclic collector's sight, so a version must not need it to give its executables back
    assert table.references(key) == 1
    assert b.modules[1].executable is executable
    # a reload of the same files finds the executable b holds: nothing is compiled
    a2 = load_bundle(tmp_path / bundle_name(0, 0), 2, device, executables=table)
    assert a2.modules[1].executable is executable and a2.modules[1].shared
    assert table.references(key) == 2 and compile_.calls == len(SIZES)
    del b, a2
    gc.collect()
    assert table.references(key) == 0 and len(table) == 0
    assert table.statistics().references == 0
    # with nothing holding it, the next load compiles again
    load_bundle(tmp_path / bundle_name(0, 0), 3, device, executables=table)
    assert compile_.calls == 2 * len(SIZES)


def test_a_reload_that_changes_the_module_gets_its_own(tmp_path, device, sources):
    table = ExecutableTable(device)
    path = _variant(tmp_path, sources, 0, 0)
    other = load_bundle(_variant(tmp_path, sources, 0, 1), 1, device, executables=table)
    old = load_bundle(path, 1, device, executables=table)
    # the bundle is rewritten with the other architecture's modules and weights
    shutil.rmtree(path)
    shutil.copytree(sources[1], path)
    manifest = yaml.safe_load((path / "manifest.yaml").read_text())
    manifest["name"] = path.name
    (path / "manifest.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    new = load_bundle(path, 2, device, executables=table)
    assert new.modules[1].key != old.modules[1].key
    assert new.modules[1].executable is not old.modules[1].executable and not new.modules[1].shared
    assert table.references(old.modules[1].key) == 2 and table.references(new.modules[1].key) == 1
    old_key = old.modules[1].key
    del old                   # the old version retires; its variant sibling keeps the executable
    gc.collect()
    assert table.references(old_key) == 1 and other.modules[1].executable is not None
    assert len(table) == 2 * len(SIZES)


def test_a_failed_load_leaves_no_reference(tmp_path, device, sources):
    compile_ = _CountingCompile(device, fail_on=2)     # the second batch size fails to compile
    table = ExecutableTable(device, compile_)
    with pytest.raises(BundleError, match=r"bundle 'a00v000'.*model\.b4\.mlir: XLA could not compile it: "
                                          "injected compile failure"):
        load_bundle(_variant(tmp_path, sources, 0, 0), 1, device, executables=table)
    assert len(table) == 0 and table.statistics().references == 0


def test_an_identical_module_is_parsed_once_and_validated_per_bundle(tmp_path, device, sources, monkeypatch):
    parsed = []
    real = executables_module.read_signature
    monkeypatch.setattr(executables_module, "read_signature", lambda module: parsed.append(1) or real(module))
    table = ExecutableTable(device)
    good = load_bundle(_variant(tmp_path, sources, 0, 0), 1, device, executables=table)
    assert len(parsed) == len(SIZES)
    second = load_bundle(_variant(tmp_path, sources, 0, 1), 1, device, executables=table)
    assert len(parsed) == len(SIZES)                  # the second bundle's modules were not re-parsed
    # a third bundle with the same modules but a manifest that disagrees with them: the error
    # names that bundle and its own file, though the module was parsed for another bundle
    bad = _variant(tmp_path, sources, 0, 2)
    manifest = yaml.safe_load((bad / "manifest.yaml").read_text())
    manifest["executable_inputs"][0]["dims"]["f"] = 65
    (bad / "manifest.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    with pytest.raises(BundleError) as err:
        load_bundle(bad, 1, device, executables=table)
    assert "bundle 'a00v002'" in str(err.value) and "model.b1.mlir" in str(err.value)
    assert "input 'input'" in str(err.value) and "65" in str(err.value)
    assert len(parsed) == len(SIZES)
    # nothing is held for the failed bundle: the two loaded versions' references only
    assert table.references(good.modules[1].key) == 2 and second.modules[1].shared


def test_compile_module_and_a_table_are_not_both_taken(tmp_path, device, sources):
    with pytest.raises(TypeError, match="not both"):
        load_bundle(_variant(tmp_path, sources, 0, 0), 1, device, _CountingCompile(device),
                    executables=ExecutableTable(device))


def test_dynamic_batch_specializations_are_shared(tmp_path, device, monkeypatch):
    from safetensors.numpy import save_file

    from xlaserve.export import TensorSpec, export_bundle

    def fn(w, x):
        return (x @ w,)

    first = export_bundle(tmp_path / "d0", fn, inputs=[TensorSpec("input", "f32", "fn", {"f": 8})],
                          outputs=[TensorSpec("output", "f32", "fn", {"f": 8})],
                          weights={"w": np.eye(8, dtype=np.float32)}, compiled_batch_sizes=(1, 4),
                          dynamic_batch=True)
    second = tmp_path / "d1"
    shutil.copytree(first, second)
    manifest = yaml.safe_load((second / "manifest.yaml").read_text())
    manifest["name"] = "d1"
    (second / "manifest.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    save_file({"w": 2 * np.eye(8, dtype=np.float32)}, str(second / "weights.safetensors"))
    specialized = []
    real = executables_module.specialize
    monkeypatch.setattr(executables_module, "specialize",
                        lambda module, arguments: specialized.append(1) or real(module, arguments))
    table = ExecutableTable(device)
    a = load_bundle(first, 1, device, executables=table)
    b = load_bundle(second, 1, device, executables=table)
    assert len(specialized) == 2                      # once per batch size, not per bundle
    assert all(b.modules[s].executable is a.modules[s].executable and b.modules[s].shared for s in (1, 4))
    x = np.ones((4, 8), np.float32)
    assert np.array_equal(_run(device, b, x), 2 * x) and np.array_equal(_run(device, a, x), x)


def test_an_invalid_manifest_is_reported_as_the_python_loader_reports_it(tmp_path):
    # manifests are parsed by libyaml where PyYAML has it; a broken one still gets the message
    # (and line and column) of the pure-Python loader
    bundle = tmp_path / "broken"
    bundle.mkdir()
    text = "name: broken\nexecutable_inputs: [\n  {name: input, dtype: f32\n"
    (bundle / "manifest.yaml").write_text(text)
    with pytest.raises(yaml.YAMLError) as expected:
        yaml.safe_load(text)
    with pytest.raises(BundleError) as err:
        read_manifest(bundle)
    assert str(err.value).endswith(f"manifest.yaml is not valid YAML: {expected.value}")
    assert "bundle 'broken'" in str(err.value) and "line 4" in str(err.value)
