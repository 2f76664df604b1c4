"""``xlaserve export`` end to end on a tiny model written to a file, and its argument parsing."""
from __future__ import annotations

import re
import textwrap

import numpy as np
import pytest
import yaml

from xlaserve.bundle import load_bundle
from xlaserve.cli import main
from xlaserve.export import TensorSpec
from xlaserve.export.cli import UsageError, parse_batch_sizes, parse_input, parse_output
from xlaserve.runtime.pjrt import Device

MODEL = '''
import jax.numpy as jnp
import numpy as np

def init_params():
    rng = np.random.default_rng(1)
    return {"dense1": {"kernel": rng.standard_normal((3, 8)).astype(np.float32),
                       "bias": np.zeros(8, np.float32)},
            "dense2": {"kernel": rng.standard_normal((8, 2)).astype(np.float32),
                       "bias": np.ones(2, np.float32)}}

def forward(params, x):
    h = jnp.tanh(x @ params["dense1"]["kernel"] + params["dense1"]["bias"])
    return h @ params["dense2"]["kernel"] + params["dense2"]["bias"]

def pixels(_, image):
    return {"mean": jnp.mean(image.astype(jnp.float32), axis=(1, 2, 3))}

traces = [0]

def drifting(_, x):
    traces[0] += 1                   # Python state read while tracing: each trace differs
    return x + traces[0]
'''


@pytest.fixture
def model_file(tmp_path, request):
    # a module name per test: the file is imported under its stem
    path = tmp_path / f"tiny_{request.node.name.replace('[', '_').replace(']', '').replace('-', '_')}.py"
    path.write_text(textwrap.dedent(MODEL))
    return path


def test_export_end_to_end(tmp_path, model_file, capsys, caplog):
    caplog.set_level("INFO", logger="xlaserve.export")
    out = tmp_path / "models" / "tiny"
    rc = main(["export", f"{model_file}:forward", "--params", "init_params", "--input", "x:float32:3",
               "--batch-sizes", "4,1", "--out", str(out), "--hooks"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert captured.out.startswith(f"wrote {out}: 2 modules, 4 weights, verified: 1 output of each module within tolerance")
    log = caplog.text
    assert "note: input 'x': axes not given, named 'xn'" in log
    assert "note: output 'output': axes not given, named 'xn'" in log
    assert "tiny: traced compiled batch size 4 (2/2)" in log
    assert "tiny: verify model.b1.mlir output (f32): max abs error" in log
    assert sorted(p.name for p in out.iterdir()) == ["manifest.yaml", "model.b1.mlir", "model.b4.mlir",
                                                      "model.py", "weights.safetensors"]
    manifest = yaml.safe_load((out / "manifest.yaml").read_text())
    assert manifest["weights"]["order"] == ["dense1.bias", "dense1.kernel", "dense2.bias", "dense2.kernel"]
    assert manifest["executable_inputs"] == [{"name": "x", "dtype": "f32", "shape": "xn", "dims": {"x": 3}}]
    # Loaded as the server loads it, hooks included, the module computes the function.
    device = Device("cpu")
    model = load_bundle(out, 1, device)
    assert model.hooks is not None and model.compiled_batch_sizes == (1, 4)
    namespace: dict = {}
    exec(compile(textwrap.dedent(MODEL), "model", "exec"), namespace)
    params = namespace["init_params"]()
    x = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
    (y,) = device.execute(model.modules[4].executable, [*model.weights.read(), x])
    np.testing.assert_allclose(y, np.asarray(namespace["forward"](params, x)), rtol=1e-5, atol=1e-5)


def test_a_model_file_does_not_shadow_an_imported_module(tmp_path, capsys):
    # A file named like a module already imported (json) is imported under a private name.
    (tmp_path / "json.py").write_text(textwrap.dedent(MODEL))
    rc = main(["export", f"{tmp_path / 'json.py'}:forward", "--params", "init_params", "--input", "x:f32:3",
               "--batch-sizes", "1", "--out", str(tmp_path / "j"), "--no-verify"])
    assert rc == 0, capsys.readouterr().err
    import json
    assert json.dumps([1]) == "[1]" and hasattr(json, "JSONDecoder")


def test_export_named_axes_and_outputs(tmp_path, model_file, capsys):
    out = tmp_path / "pix"
    rc = main(["export", f"{model_file}:pixels", "--input", "image:np.uint8:2x4x3:cwhn",
               "--output", "avg:n", "--batch-sizes", "2", "--out", str(out), "--no-verify"])
    assert rc == 0, capsys.readouterr().err
    assert "not verified (--no-verify)" in capsys.readouterr().out
    manifest = yaml.safe_load((out / "manifest.yaml").read_text())
    assert manifest["executable_inputs"] == [
        {"name": "image", "dtype": "u8", "shape": "cwhn", "dims": {"c": 3, "w": 4, "h": 2}}]
    assert manifest["executable_outputs"] == [{"name": "avg", "dtype": "f32", "shape": "n", "dims": {}}]
    assert "weights" not in manifest


def test_export_tracing_error_exits_2_with_the_signature(tmp_path, model_file, capsys):
    rc = main(["export", f"{model_file}:forward", "--params", f"{model_file}:init_params",
               "--input", "x:f32:5", "--batch-sizes", "2", "--out", str(tmp_path / "bad")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "traced at compiled batch size 2" in err
    assert "x=f32[2,5]" in err and "'dense1': {'bias': f32[8], 'kernel': f32[3,8]}" in err
    assert err.count("\n") == 1 and "Traceback" not in err           # one line, no traceback
    assert re.search(rf"\(raised at {re.escape(str(model_file))}:\d+ in forward\)$", err.strip())   # the user's line
    assert not (tmp_path / "bad").exists()


def test_export_verification_failure_exits_1(tmp_path, model_file, capsys):
    rc = main(["export", f"{model_file}:drifting", "--input", "x:f32:3", "--batch-sizes", "1,2",
               "--out", str(tmp_path / "drift")])
    err = capsys.readouterr().err
    assert rc == 1
    assert "bundle 'drift' does not match its source function" in err
    assert "model.b1.mlir output (f32)" in err and "FAILED" in err
    assert f"the bundle is left at {tmp_path / 'drift'} for inspection" in err
    assert err.count("\n") == 1 and "; 1 other output(s) fail too;" in err     # b1 and b2, one line


FAULTY = '''
import numpy as np

def build(width=3):
    return {"w": np.ones((width,), np.float32)}

def forward(params, x):
    return x * params["w"]

def broken_params():
    return build(widht=4)            # a wrong keyword
'''


@pytest.mark.parametrize(("source", "argv", "message"), [
    (FAULTY, ["{m}:forward", "--params", "broken_params"],
     r"--params broken_params: calling it raised TypeError: build\(\) got an unexpected keyword argument 'widht'"
     r" \(at {m}:\d+ in broken_params\)$"),
    ("import numpy as np\nraise RuntimeError('no GPU here')\n", ["{m}:forward"],
     r"MODULE:FUNCTION: importing {m} raised RuntimeError: no GPU here \(at {m}:2 in <module>\)$"),
], ids=["params-factory-raises", "module-raises-on-import"])
def test_a_function_that_raises_before_the_export_exits_2_in_one_line(tmp_path, capsys, source, argv, message):
    path = tmp_path / "faulty_e26.py"
    path.write_text(textwrap.dedent(source))
    argv = [a.replace("{m}", str(path)) for a in argv]
    rc = main(["export", *argv, "--input", "x:f32:3", "--batch-sizes", "1", "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert re.fullmatch("xlaserve export: " + message.replace("{m}", re.escape(str(path))), err.strip()), err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["{m}:nothing", "--input", "x:f32:3"], "has no attribute 'nothing'"),
    (["{m}:forward", "--input", "x:float33:3"], "--input 'x:float33:3': tensor 'x': unknown dtype 'float33'"),
    (["{m}:forward", "--input", "x:f32"], "expected NAME:DTYPE:SHAPE[:AXES]"),
    (["no_such_module_e17:forward", "--input", "x:f32:3"], "cannot import 'no_such_module_e17'"),
    (["{m}:forward", "--params", "missing", "--input", "x:f32:3"], "--params 'missing'"),
    (["{m}:forward", "--input", "x:f32:3", "--atol", "-1"], "expected a number >= 0"),
])
def test_export_usage_errors_exit_2(tmp_path, model_file, capsys, argv, message):
    argv = [a.replace("{m}", str(model_file)) for a in argv]
    rc = main(["export", *argv, "--batch-sizes", "1", "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and err.startswith("xlaserve export: ")
    assert not (tmp_path / "m").exists()


def test_parse_input():
    spec, note = parse_input("image:uint8:224,224,3:cwhn")
    assert spec == TensorSpec("image", "u8", "cwhn", {"c": 3, "w": 224, "h": 224})
    assert spec.row_major(8) == (8, 224, 224, 3) and note is None
    spec, note = parse_input("image:u8:3x224x224:whcn")           # NCHW
    assert spec.row_major(2) == (2, 3, 224, 224)
    spec, note = parse_input("seq:i32:7,5")
    assert spec == TensorSpec("seq", "i32", "xyn", {"x": 5, "y": 7}) and "named 'xyn'" in note
    assert parse_input("label:i64:")[0] == TensorSpec("label", "i64", "n")
    assert parse_input("table:f32:2,3:xy")[0].row_major(9) == (2, 3)     # no batch axis
    for bad, message in [("x:f32:3,a", "must be sizes"), ("x:f32:3:cwhn", "names 3 non-batch axes"),
                         ("x:f32:3:XN", "lowercase letters"), ("x:f32:3,4:xx", "distinct"),
                         (":f32:3", "expected NAME"), ("x:f32:-3", "negative")]:
        with pytest.raises(UsageError, match=message):
            parse_input(bad)


def test_parse_output_and_batch_sizes():
    assert parse_output("logits") == ("logits", None)
    assert parse_output("logits:zn") == ("logits", "zn")
    with pytest.raises(UsageError, match="NAME or NAME:AXES"):
        parse_output("logits:Z")
    assert parse_batch_sizes("1,4,16") == [1, 4, 16]
    for bad in ("1,,2", "0", "2,2", "a"):
        with pytest.raises(UsageError, match="--batch-sizes"):
            parse_batch_sizes(bad)


def test_an_exported_bundle_serves(tmp_path, model_file, capsys):
    """Exported with the hooks skeleton, served by `xlaserve run`, queried with the Triton client:
    a batch of 3 (padded to the compiled 4) answers what the function computes."""
    import tritonclient.grpc as grpcclient

    from tests.conftest import infer_input, serve

    repo = tmp_path / "models"
    rc = main(["export", f"{model_file}:forward", "--params", "init_params", "--input", "x:float32:3",
               "--output", "y", "--batch-sizes", "1,4", "--out", str(repo / "tiny"), "--hooks"])
    assert rc == 0, capsys.readouterr().err
    namespace: dict = {}
    exec(compile(textwrap.dedent(MODEL), "model", "exec"), namespace)
    x = np.random.default_rng(5).standard_normal((3, 3)).astype(np.float32)
    expected = np.asarray(namespace["forward"](namespace["init_params"](), x))
    with serve(tmp_path / "server", repo) as server:
        client = grpcclient.InferenceServerClient(server.url)
        result = client.infer("tiny", [infer_input("x", x, "FP32")], outputs=[grpcclient.InferRequestedOutput("y")])
        np.testing.assert_allclose(result.as_numpy("y"), expected, rtol=1e-5, atol=1e-5)
        client.close()
    assert server.process.returncode == 0, server.log()
