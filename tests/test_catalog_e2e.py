"""End to end: 20 bundles over 2 architectures (fine-tuned variants) on one executable per
architecture and batch size, each answering with its own weights; unloading one variant leaves
its siblings serving, and loading it again compiles nothing."""
from __future__ import annotations

import re

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from benchmarks.catalog_bench import (bundle_name, clone_variant, export_architecture, reference, variant_weights,
                                      width_of)
from tests.conftest import infer_input, serve

HIDDEN = 32
SIZES = (1, 4)
ARCHS = 2
VARIANTS = 10


@pytest.fixture(scope="module")
def catalog(tmp_path_factory):
    repo = tmp_path_factory.mktemp("catalog") / "models"
    for arch in range(ARCHS):
        source = export_architecture(repo, arch, HIDDEN, SIZES)
        for variant in range(1, VARIANTS):
            clone_variant(source, arch, variant, HIDDEN)
    return repo


def _check(client, arch: int, variant: int, rows: int) -> None:
    x = np.random.default_rng(rows * 7 + variant).standard_normal((rows, width_of(arch))).astype(np.float32)
    got = client.infer(bundle_name(arch, variant), [infer_input("input", x, "FP32")]).as_numpy("output")
    np.testing.assert_allclose(got, reference(variant_weights(arch, variant, HIDDEN), x), rtol=1e-4, atol=1e-4)


def test_twenty_bundles_over_two_architectures(tmp_path, catalog):
    with serve(tmp_path, catalog, {"cache_dir": None, "model_control_mode": "dynamic"}) as server:
        client = grpcclient.InferenceServerClient(server.url)
        log = server.log()
        bundles = ARCHS * VARIANTS
        modules = bundles * len(SIZES)
        distinct = ARCHS * len(SIZES)
        assert (f"start-up: {bundles} of {bundles} bundle(s) ready, 0 failed" in log), log
        assert (f"(0 module(s) from the executable cache, {distinct} compiled, {modules - distinct} shared with "
                f"another bundle's identical module; {distinct} distinct executable(s))") in log
        assert len(re.findall(r"model\.b\d+\.mlir compiled in", log)) == distinct
        metrics = server.get("/metrics")[1]
        assert re.search(rf"^xlaserve_executables {distinct}\.0$", metrics, re.M)
        assert re.search(rf"^xlaserve_executable_references {modules}\.0$", metrics, re.M)
        # every variant answers with its own weights, at both compiled sizes and a padded one
        for arch in range(ARCHS):
            for variant in range(VARIANTS):
                for rows in (1, 3, 4):
                    _check(client, arch, variant, rows)

        # unloading one variant keeps the executable its siblings use; loading it again shares it
        client.unload_model(bundle_name(0, 3))
        assert not client.is_model_ready(bundle_name(0, 3))
        _check(client, 0, 4, 4)
        client.load_model(bundle_name(0, 3))
        assert re.search(rf"{bundle_name(0, 3)} version 2 ready in \S+ \(0 of {len(SIZES)} module\(s\) from the "
                         rf"executable cache, {len(SIZES)} shared\)", server.log())
        assert len(re.findall(r"model\.b\d+\.mlir compiled in", server.log())) == distinct
        for variant in (3, 4):
            _check(client, 0, variant, 4)
        metrics = server.get("/metrics")[1]
        assert re.search(rf"^xlaserve_executables {distinct}\.0$", metrics, re.M)
        assert re.search(rf"^xlaserve_executable_references {modules}\.0$", metrics, re.M)
        _check(client, 1, 3, 1)
