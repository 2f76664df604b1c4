"""End to end with the Triton client: a postprocess hook (severity_grader), a meta model
(detect_and_classify) against its NumPy reference, and hooks that fail only their own request."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest
import yaml
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from examples import reference
from examples.export_examples import BytesSpec, export_simple

from tests.conftest import ROOT, infer_input, serve

FLAKY = """
import numpy as np
from xlaserve import NamedTensor, register_model

def postprocess(outputs):
    out = {t.name: t.data for t in outputs}
    marker = out["OUTPUT1"][0, 0]          # INPUT0 - INPUT1 of the first element
    if marker == -100:
        raise ValueError("marker -100 asks me to fail")
    if marker == -200:
        out["OUTPUT0"] = out["OUTPUT0"].astype(np.float64)
    return [NamedTensor(name, data) for name, data in out.items()]

register_model("flaky", postprocess=postprocess)
"""

SIMPLE_STRING = """
import numpy as np
from xlaserve import NamedTensor, register_model

def preprocess(inputs):
    return [NamedTensor(t.name, np.array([int(v) for v in t.data.reshape(-1)], np.int32).reshape(t.data.shape))
            for t in inputs]

def postprocess(outputs):
    return [NamedTensor(t.name, np.array([str(v).encode() for v in t.data.reshape(-1)], object).reshape(t.data.shape))
            for t in outputs]

register_model("simple_string", preprocess=preprocess, postprocess=postprocess)
"""

BROKEN_META = """
from xlaserve import register_model

def run(tensors, ctx):
    x = {t.name: t.data for t in tensors}["x"]
    if x[0] < 0:
        return ctx.infer("no_such_model", tensors)
    raise RuntimeError("boom")

register_model("broken_meta", run=run)
"""

BROKEN_META_MANIFEST = """format_version: "2.0"
kind: meta
client_inputs:
  - {name: x, dtype: f32, shape: n}
client_outputs:
  - {name: y, dtype: f32, shape: n}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("hooks") / "models"
    subprocess.run([sys.executable, str(ROOT / "examples" / "export_examples.py"), "--hooks", str(repo)],
                   check=True, cwd=ROOT, capture_output=True)
    flaky = export_simple(repo, (1, 2, 4, 8))
    flaky = flaky.rename(repo / "flaky")
    manifest = (flaky / "manifest.yaml").read_text().replace("name: simple", "name: flaky")
    (flaky / "manifest.yaml").write_text(manifest)
    (flaky / "model.py").write_text(FLAKY)
    export_simple(repo)
    strings = export_simple(tmp_path_factory.mktemp("strings")).rename(repo / "simple_string")
    manifest = yaml.safe_load((strings / "manifest.yaml").read_text())
    manifest["name"] = "simple_string"
    manifest["client_inputs"] = [BytesSpec(n, "xn", {"x": 16}).to_manifest() for n in ("INPUT0", "INPUT1")]
    manifest["client_outputs"] = [BytesSpec(n, "xn", {"x": 16}).to_manifest() for n in ("OUTPUT0", "OUTPUT1")]
    (strings / "manifest.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    (strings / "model.py").write_text(SIMPLE_STRING)
    broken = repo / "broken_meta"
    broken.mkdir()
    (broken / "manifest.yaml").write_text(BROKEN_META_MANIFEST)
    (broken / "model.py").write_text(BROKEN_META)
    with serve(tmp_path_factory.mktemp("hooks_server"), repo,
               listen={"grpc": "127.0.0.1:0", "http": "127.0.0.1:0", "rest": "127.0.0.1:0"}) as running:
        yield running
    assert running.process.returncode == 0, running.log()


def test_every_bundle_is_ready(server):
    c = grpcclient.InferenceServerClient(server.url)
    index = {m.name: m.state for m in c.get_model_repository_index().models}
    assert index == {n: "READY" for n in ("broken_meta", "classifier", "cnn", "detect_and_classify", "detector",
                                          "flaky", "img_mean", "mlp", "severity_grader", "simple",
                                          "simple_string")}, server.log()


def test_severity_grader_grades_and_labels_with_its_postprocess(server):
    c = grpcclient.InferenceServerClient(server.url)
    flat = np.stack([np.full((224, 224), v, np.uint8) for v in (16, 48, 112, 176, 240)])
    noisy = np.random.default_rng(7).integers(0, 256, (3, 224, 224), dtype=np.uint8)
    for images in (flat, noisy, flat[:1]):
        r = c.infer("severity_grader", [infer_input("INPUT__0", images, "UINT8")])
        grade, label = reference.severity_grader_ref(images)
        np.testing.assert_array_equal(r.as_numpy("grade"), grade)
        assert r.as_numpy("label").tolist() == label.tolist()
    meta = c.get_model_metadata("severity_grader")
    assert [(o.name, o.datatype, list(o.shape)) for o in meta.outputs] == [("grade", "INT64", [-1, 1]),
                                                                          ("label", "BYTES", [-1, 1])]


def _reference_is_unambiguous(image) -> bool:
    """Scores and box corners far enough from the decision points (threshold, ties, integer pixel
    edges) that float rounding between XLA and NumPy cannot change the pipeline's choices."""
    scores, boxes = reference.detector_ref(image[None])
    kept = np.sort(scores[0][scores[0] > reference.DETECTOR_THRESHOLD])
    corners = boxes[0][scores[0] > reference.DETECTOR_THRESHOLD]
    inner = corners[(corners > 0.01) & (corners < 63.99)]
    return (np.abs(scores - reference.DETECTOR_THRESHOLD).min() > 1e-4
            and (len(kept) < 2 or np.diff(kept).min() > 1e-5)
            and (inner.size == 0 or np.abs(inner - np.round(inner)).min() > 1e-4))


def test_detect_and_classify_matches_the_reference_pipeline(server):
    c = grpcclient.InferenceServerClient(server.url)
    images = [im for im in reference.pipeline_images(12) if _reference_is_unambiguous(im)]
    assert len(images) >= 10
    counts = set()
    for image in images:
        r = c.infer("detect_and_classify", [infer_input("image", image, "UINT8")])
        want = reference.detect_and_classify_ref(image)
        counts.add(len(want["scores"]))
        np.testing.assert_allclose(r.as_numpy("boxes"), want["boxes"], atol=1e-3)
        np.testing.assert_allclose(r.as_numpy("scores"), want["scores"], atol=1e-5)
        np.testing.assert_array_equal(r.as_numpy("class_id"), want["class_id"])
        assert r.as_numpy("label").tolist() == want["label"].tolist()
    assert 0 in counts and len(counts) >= 4          # a data-dependent number of crops, none included


def test_meta_model_metadata_and_config_report_client_tensors(server):
    c = grpcclient.InferenceServerClient(server.url)
    meta = c.get_model_metadata("detect_and_classify")
    assert [(i.name, i.datatype, list(i.shape)) for i in meta.inputs] == [("image", "UINT8", [64, 64, 3])]
    assert [(o.name, list(o.shape)) for o in meta.outputs] == [("boxes", [-1, 4]), ("scores", [-1]),
                                                              ("class_id", [-1]), ("label", [-1])]
    config = c.get_model_config("detect_and_classify").config
    assert config.max_batch_size == 0 and list(config.input[0].dims) == [64, 64, 3]


def test_many_meta_requests_proceed_concurrently(server):
    images = reference.pipeline_images(16, seed=11)

    async def main():
        client = aioclient.InferenceServerClient(server.url)
        try:
            async def one(image):
                t = aioclient.InferInput("image", list(image.shape), "UINT8")
                t.set_data_from_numpy(image)
                return await client.infer("detect_and_classify", [t])
            return await asyncio.gather(*(one(im) for im in images))
        finally:
            await client.close()
    results = asyncio.run(main())
    for image, r in zip(images, results):
        assert len(r.as_numpy("scores")) == len(reference.detect_and_classify_ref(image)["scores"])
    c = grpcclient.InferenceServerClient(server.url)
    stats = c.get_inference_statistics("detect_and_classify").model_stats[0]
    assert stats.inference_stats.success.count >= 16


def test_a_raising_hook_fails_only_its_request(server):
    ones = np.ones((2, 16), np.int32)

    async def main():
        client = aioclient.InferenceServerClient(server.url)
        try:
            async def one(i):
                second = np.full((2, 16), 101 if i % 4 == 0 else -i, np.int32)   # marker -100 on every 4th
                inputs = []
                for name, a in (("INPUT0", ones), ("INPUT1", second)):
                    t = aioclient.InferInput(name, list(a.shape), "INT32")
                    t.set_data_from_numpy(a)
                    inputs.append(t)
                try:
                    return await client.infer("flaky", inputs)
                except InferenceServerException as exc:
                    return exc
            return await asyncio.gather(*(one(i) for i in range(24)))
        finally:
            await client.close()
    results = asyncio.run(main())
    for i, r in enumerate(results):
        if i % 4 == 0:
            assert isinstance(r, InferenceServerException), i
            assert r.status() == "StatusCode.INTERNAL"
            assert r.message() == "model 'flaky': postprocess hook raised ValueError: marker -100 asks me to fail"
        else:
            assert not isinstance(r, InferenceServerException), r
            np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), np.full((2, 16), 1 - i, np.int32))
    assert "Traceback" in server.log() and "marker -100" in server.log()


def test_bad_hook_output_is_named(server):
    c = grpcclient.InferenceServerClient(server.url)
    a, b = np.zeros((1, 16), np.int32), np.full((1, 16), 200, np.int32)
    with pytest.raises(InferenceServerException) as info:
        c.infer("flaky", [infer_input("INPUT0", a, "INT32"), infer_input("INPUT1", b, "INT32")])
    assert info.value.status() == "StatusCode.INTERNAL"
    assert info.value.message() == ("model 'flaky': postprocess hook output (checked against client_outputs): "
                                    "tensor 'OUTPUT0': expected dtype INT32 (INT32[1,16]), found FP64[1,16]")


def test_meta_failures_name_the_hook_or_keep_the_sub_call_status(server):
    c = grpcclient.InferenceServerClient(server.url)
    with pytest.raises(InferenceServerException) as info:
        c.infer("broken_meta", [infer_input("x", np.ones(3, np.float32), "FP32")])
    assert info.value.status() == "StatusCode.INTERNAL"
    assert info.value.message() == "model 'broken_meta': run hook raised RuntimeError: boom"
    with pytest.raises(InferenceServerException) as info:
        c.infer("broken_meta", [infer_input("x", -np.ones(3, np.float32), "FP32")])
    assert info.value.status() == "StatusCode.NOT_FOUND"
    assert info.value.message().startswith("model 'broken_meta': run: ctx.infer('no_such_model'): Request for "
                                           "unknown model: 'no_such_model' is not found; model 'no_such_model' is "
                                           "not in the repository")
    r = c.infer("simple", [infer_input("INPUT0", np.ones((1, 16), np.int32), "INT32"),
                           infer_input("INPUT1", np.ones((1, 16), np.int32), "INT32")])
    assert (r.as_numpy("OUTPUT0") == 2).all()


# ---- the same through REST (listen.rest): hooks, BYTES outputs and meta models unchanged ---------

def test_rest_bytes_outputs_of_a_postprocess_hook_as_json_and_as_binary(server):
    c = httpclient.InferenceServerClient(server.rest)
    images = np.random.default_rng(7).integers(0, 256, (3, 224, 224), dtype=np.uint8)
    grade, label = reference.severity_grader_ref(images)
    t = httpclient.InferInput("INPUT__0", list(images.shape), "UINT8")
    t.set_data_from_numpy(images)
    for binary in (False, True):
        r = c.infer("severity_grader", [t], outputs=[httpclient.InferRequestedOutput("grade", binary_data=binary),
                                                     httpclient.InferRequestedOutput("label", binary_data=binary)])
        np.testing.assert_array_equal(r.as_numpy("grade"), grade)
        got = r.as_numpy("label")
        assert [v if isinstance(v, bytes) else v.encode() for v in got.reshape(-1)] == label.reshape(-1).tolist()
        assert ("data" in r.get_output("label")) == (not binary)


def test_rest_meta_model_and_a_raising_hook(server):
    c = httpclient.InferenceServerClient(server.rest)
    image = next(im for im in reference.pipeline_images(12) if _reference_is_unambiguous(im))
    t = httpclient.InferInput("image", list(image.shape), "UINT8")
    t.set_data_from_numpy(image)
    r = c.infer("detect_and_classify", [t])
    want = reference.detect_and_classify_ref(image)
    np.testing.assert_allclose(r.as_numpy("scores"), want["scores"], atol=1e-5)
    np.testing.assert_array_equal(r.as_numpy("class_id"), want["class_id"])
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(np.ones((1, 16), np.int32))
    inputs[1].set_data_from_numpy(np.full((1, 16), 101, np.int32), binary_data=False)
    with pytest.raises(InferenceServerException) as info:
        c.infer("flaky", inputs)
    assert info.value.status() == "500"
    assert info.value.message() == "model 'flaky': postprocess hook raised ValueError: marker -100 asks me to fail"
    assert c.is_model_ready("flaky")


def test_rest_bytes_inputs_binary_and_json_as_simple_http_string_infer_client(server):
    """NVIDIA's simple_http_string_infer_client against a ``simple_string`` made of ``simple``
    and two hooks: BYTES inputs, one binary and one JSON, BYTES outputs likewise."""
    c = httpclient.InferenceServerClient(server.rest)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), -3, dtype=np.int32)
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "BYTES"), httpclient.InferInput("INPUT1", [1, 16], "BYTES")]
    inputs[0].set_data_from_numpy(np.array([str(v).encode() for v in a.reshape(-1)], object).reshape(1, 16),
                                  binary_data=True)
    inputs[1].set_data_from_numpy(np.array([str(v).encode() for v in b.reshape(-1)], object).reshape(1, 16),
                                  binary_data=False)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)]
    r = c.infer("simple_string", inputs, outputs=outputs)
    assert [int(v) for v in r.as_numpy("OUTPUT0").reshape(-1)] == (a + b).reshape(-1).tolist()
    assert [int(v) for v in r.as_numpy("OUTPUT1").reshape(-1)] == (a - b).reshape(-1).tolist()
    assert r.get_output("OUTPUT1")["data"][:2] == ["3", "4"]
