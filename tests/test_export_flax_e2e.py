"""End to end: the Flax example exported by ``xlaserve export --flax --dynamic-batch``, served by
the real server (which specializes its one module to every compiled batch size) and queried with
the Triton client, matching the model run by Flax."""
from __future__ import annotations

import numpy as np
import tritonclient.grpc as grpcclient

from examples.flax_classifier import create_model
from tests.conftest import ROOT, infer_input, serve
from xlaserve.cli import main

SIZES = (1, 2, 4, 8)


def test_flax_example_exported_with_a_dynamic_batch_and_served(tmp_path, capsys):
    repo = tmp_path / "models"
    rc = main(["export", f"{ROOT / 'examples' / 'flax_classifier.py'}:create_model", "--flax",
               "--input", "image:uint8:32,32,3:cwhn", "--output", "logits", "--output", "label",
               "--batch-sizes", ",".join(map(str, SIZES)), "--dynamic-batch", "--out", str(repo / "flax_classifier")])
    assert rc == 0, capsys.readouterr().err
    assert sorted(p.name for p in (repo / "flax_classifier").iterdir()) == [
        "manifest.yaml", "model.mlir", "weights.safetensors"]

    model = create_model()
    images = np.random.default_rng(7).integers(0, 256, (8, 32, 32, 3), dtype=np.uint8)
    with serve(tmp_path / "server", repo, {"cache_dir": str(tmp_path / "cache")}) as server:
        client = grpcclient.InferenceServerClient(server.url)
        for rows in (images[:3], images[3:4], images):       # 3 runs at compiled size 4
            result = client.infer("flax_classifier", [infer_input("image", rows, "UINT8")],
                                  outputs=[grpcclient.InferRequestedOutput("logits"),
                                           grpcclient.InferRequestedOutput("label")])
            logits, label = model(rows)
            np.testing.assert_allclose(result.as_numpy("logits"), np.asarray(logits), rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(result.as_numpy("label"), np.asarray(label))
        log = server.log()
    for index, size in enumerate(SIZES, 1):      # the first compile logs each size, counted
        assert f"flax_classifier: model.mlir@b{size} compiled in " in log
        assert f"s ({index}/{len(SIZES)})" in log
