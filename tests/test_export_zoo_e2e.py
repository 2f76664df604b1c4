"""End to end, the fast subset of the mainstream architectures (examples/torch_zoo.py): a text
encoder with non-persistent buffers (transformers' BertModel), a ConvNeXt whose pooling torch-mlir
lowers to dense_resource constants, and an EfficientNet-like depthwise network whose logits reach
tens, and a decoder-only text model (transformers' GPT2LMHeadModel with its fused SDPA attention)
at compiled batch 4, which plain torch-mlir fails on and the second lowering route exports, each
exported by ``xlaserve export --torch`` with the default verification, served by the real server
and queried with the Triton client, the answers compared with eager PyTorch under the same scaled
tolerance. (A Flax model is done the same way in tests/test_export_flax_e2e.py.)"""
from __future__ import annotations

import numpy as np
import tritonclient.grpc as grpcclient
import yaml

from examples import torch_zoo
from tests.conftest import ROOT, infer_input, serve
from xlaserve.cli import main
from xlaserve.export import compare, tolerance


MODELS = ("bert", "convnext", "efficientnet", "gpt2")
ROUTES = {"gpt2": "torch-mlir+rewrites"}
SIZES = "4"      # one compiled size keeps the test short; 3 rows are padded to it
DATATYPES = {np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32"}


def _flag(spec) -> str:
    shape = ",".join(str(d) for d in spec.row_major(1)[1:])
    return f"{spec.name}:{spec.dtype}:{shape}:{spec.shape}"


def test_mainstream_models_export_serve_and_match_eager_pytorch(tmp_path, capsys):
    repo = tmp_path / "models"
    for name in MODELS:
        _, inputs = torch_zoo.MODELS[name]
        argv = ["export", "--torch", f"{ROOT / 'examples' / 'torch_zoo.py'}:{name}",
                *[a for spec in inputs for a in ("--input", _flag(spec))],
                "--batch-sizes", SIZES, "--out", str(repo / name)]
        rc = main(argv)
        out, err = capsys.readouterr()
        assert rc == 0, err
        assert "within tolerance" in out
        assert f"lowered by route {ROUTES.get(name, 'torch-mlir')}," in out, out

    # what each needed: BERT's non-persistent buffers are weights; ConvNeXt's constants are inline
    bert = yaml.safe_load((repo / "bert" / "manifest.yaml").read_text())
    assert bert["weights"]["order"][-2:] == ["embeddings.position_ids", "embeddings.token_type_ids"]
    convnext = (repo / "convnext" / "model.b4.mlir").read_text()
    assert "dense_resource" not in convnext and "dense<" in convnext

    with serve(tmp_path / "server", repo, {"cache_dir": str(tmp_path / "cache")}) as server:
        client = grpcclient.InferenceServerClient(server.url)
        try:
            for name in MODELS:
                factory, inputs = torch_zoo.MODELS[name]
                model = factory()
                arrays = torch_zoo.sample(name, 3)           # 3 rows run at compiled size 4
                expected = torch_zoo.eager(model, arrays)
                result = client.infer(name, [infer_input(spec.name, a, DATATYPES[a.dtype])
                                             for spec, a in zip(inputs, arrays)],
                                      outputs=[grpcclient.InferRequestedOutput(o) for o in expected])
                for output, want in expected.items():
                    got = result.as_numpy(output)
                    assert got.shape == want.shape, (name, output)
                    _, _, outside = compare(want, got, *tolerance("f32"))
                    assert outside == 0, (name, output, float(np.abs(got - want).max()))
                    assert float(np.abs(want).max()) > 0.1, (name, output)       # not near-zero outputs
            logits = torch_zoo.eager(torch_zoo.efficientnet(), torch_zoo.sample("efficientnet", 8))["output"]
            assert float(np.abs(logits).max()) > 10          # the scale the tolerance has to allow for
        finally:
            client.close()
    assert server.process.returncode == 0, server.log()
