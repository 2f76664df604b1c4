"""PyTorch export (xlaserve.export.from_torch, ``xlaserve export --torch``): weights under their
state_dict names, outputs named as PyTorch flattens them, verification against eager PyTorch
(passing, and failing on a module whose export differs), tracing errors naming the call, the
command end to end, the example transformer encoder served and queried with the Triton client,
and the server never importing torch."""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.numpy import load_file
from torch import nn

from xlaserve.cli import main
from xlaserve.export import (ExportError, TensorSpec, TracingError, VerificationError, export_torch,
                             state_weights, to_numpy, to_torch)

ROOT = Path(__file__).resolve().parent.parent
X = TensorSpec("x", "float32", "xn", {"x": 6})


class Small(nn.Module):
    """Linear, BatchNorm (its running statistics are buffers), and a dict of two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(6, 5)
        self.norm = nn.BatchNorm1d(5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = torch.tanh(self.norm(self.dense(x)))
        return {"scores": self.head(hidden), "hidden": hidden}


def small() -> Small:
    torch.manual_seed(0)
    model = Small()
    with torch.no_grad():                 # statistics that are not the defaults, so they matter
        model.norm.running_mean.uniform_(-1, 1)
        model.norm.running_var.uniform_(0.5, 2)
    return model.eval()


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)     # the verification samples ids in [0, 16)
        self.out = nn.Linear(4, 16, bias=False)
        self.out.weight = self.embed.weight          # one tensor under two names

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(tokens).mean(dim=1))


class Drifting(nn.Module):
    """Reads Python state that changes on every call: the export bakes in one value."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * float(self.calls)


class Branchy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:                   # data-dependent control flow: torch.export refuses it
            return x
        return -x


def test_state_weights_are_the_state_dict_names_buffers_included_tied_once():
    model = small()
    weights = state_weights(model)
    assert list(weights) == list(model.state_dict())
    assert {"norm.running_mean", "norm.running_var", "norm.num_batches_tracked"} <= set(weights)
    tied = state_weights(Tied())
    assert list(tied) == ["embed.weight"]


class Positions(nn.Module):
    """Keeps position ids and a scale in non-persistent buffers, as BERT's embeddings do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)
        self.register_buffer("position_ids", torch.arange(6).unsqueeze(0), persistent=False)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 4), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return (self.embed(tokens) + self.embed(self.position_ids)) * self.scale


def test_non_persistent_buffers_are_weights_named_after_their_attributes(tmp_path):
    torch.manual_seed(2)
    model = Positions()
    assert list(state_weights(model)) == ["embed.weight", "position_ids", "scale"]
    tokens = TensorSpec("tokens", "int64", "xn", {"x": 6})
    result = export_torch(tmp_path / "pos", model, inputs=[tokens], compiled_batch_sizes=[1, 3])
    assert result.weights_order == ("embed.weight", "position_ids", "scale") and result.verification.ok
    stored = load_file(str(tmp_path / "pos" / "weights.safetensors"))
    np.testing.assert_array_equal(stored["position_ids"], np.arange(6)[None])
    assert stored["position_ids"].dtype == np.int64
    # they are arguments, not constants: other values in the file change the answer
    from xlaserve.bundle import load_bundle
    from xlaserve.runtime.pjrt import Device
    device = Device("cpu")
    bundle = load_bundle(tmp_path / "pos", 1, device)
    weights = list(bundle.weights.read())
    ids = np.array([[1, 2, 3, 4, 5, 6]])
    (before,) = device.execute(bundle.modules[1].executable, [*weights, ids])
    weights[2] = weights[2] * 2
    (after,) = device.execute(bundle.modules[1].executable, [*weights, ids])
    np.testing.assert_allclose(after, before * 2, rtol=1e-6)


class PooledBlock(nn.Module):
    """A ConvNeXt block as torchvision writes one (depthwise 7x7, channels-last LayerNorm and MLP,
    layer scale) and its adaptive average pooling head: torch-mlir lowers the pooling with
    index tensors it writes as dense_resource constants, which XLA refuses."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.layer_scale = nn.Parameter(torch.full((dim, 1, 1), 0.5))
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.depthwise(x).permute(0, 2, 3, 1)
        y = self.down(nn.functional.gelu(self.up(self.norm(y)))).permute(0, 3, 1, 2)
        return self.pool(self.layer_scale * y + x).flatten(1)


IMAGE = TensorSpec("image", "float32", "whcn", {"c": 16, "h": 7, "w": 7})


@pytest.mark.parametrize("inline_bytes", [64 * 1024, 0], ids=["inline", "as-weights"])
def test_dense_resource_constants_are_inlined_or_passed_as_weights(tmp_path, monkeypatch, inline_bytes):
    from xlaserve.export import from_torch as module

    monkeypatch.setattr(module, "INLINE_CONSTANT_BYTES", inline_bytes)
    torch.manual_seed(3)
    model = PooledBlock().eval()
    result = export_torch(tmp_path / "block", model, inputs=[IMAGE], compiled_batch_sizes=[1, 2])
    assert result.verification.ok
    texts = [(tmp_path / "block" / f"model.b{b}.mlir").read_text() for b in (1, 2)]
    assert all("dense_resource" not in text for text in texts)
    constants = [w for w in result.weights_order if w.startswith("constant.")]
    assert list(result.weights_order) == [*model.state_dict(), *constants]
    if inline_bytes:
        assert not constants and all("dense<" in text for text in texts)
    else:
        # the index tensors of both sizes, each value once; both modules take all of them
        assert constants and any("passed as weights" in n for n in result.notes)
        stored = load_file(str(tmp_path / "block" / "weights.safetensors"))
        assert all(stored[c].dtype == np.int64 for c in constants)
        from xlaserve.runtime.pjrt import read_signature
        assert all(len(read_signature(t.encode()).inputs) == len(result.weights_order) + 1 for t in texts)


def test_bfloat16_round_trips_between_torch_and_numpy():
    t = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)
    array = to_numpy(t)
    assert array.dtype.name == "bfloat16" and array.tolist() == [1.5, -2.25, 3.0]
    assert torch.equal(to_torch(array), t)


def test_export_writes_state_dict_weights_named_outputs_and_verifies(tmp_path):
    model = small()
    lines: list[str] = []
    result = export_torch(tmp_path / "small", model, inputs=[X], compiled_batch_sizes=[1, 4],
                          progress=lines.append)
    manifest = yaml.safe_load((tmp_path / "small" / "manifest.yaml").read_text())
    assert manifest["weights"]["order"] == list(model.state_dict()) == list(result.weights_order)
    assert [o["name"] for o in manifest["executable_outputs"]] == ["scores", "hidden"]   # dict order
    assert [o["dims"] for o in manifest["executable_outputs"]] == [{"x": 3}, {"x": 5}]
    assert sorted(p.name for p in (tmp_path / "small").iterdir()) == [
        "manifest.yaml", "model.b1.mlir", "model.b4.mlir", "weights.safetensors"]
    # The weights file is the state_dict: PyTorch reads it back as it is.
    stored = load_file(str(tmp_path / "small" / "weights.safetensors"))
    fresh = Small()
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in stored.items()})
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    checks = result.verification.checks
    assert {(c.batch, c.output) for c in checks} == {(b, o) for b in (1, 4) for o in ("scores", "hidden")}
    assert all(c.ok and c.max_abs_error < 1e-5 for c in checks)
    assert any("verify model.b4.mlir scores (f32)" in line for line in lines)


def test_outputs_renamed_and_training_mode_noted(tmp_path):
    model = small().train()
    result = export_torch(tmp_path / "m", model, inputs=[X], compiled_batch_sizes=[2],
                          output_names=["logits", "features"])
    assert [o.name for o in result.outputs] == ["logits", "features"]
    assert any("was in training mode; exported and verified in eval mode" in n for n in result.notes)
    assert not model.training


def test_tied_weights_are_stored_once_and_still_shared(tmp_path):
    torch.manual_seed(1)
    tokens = TensorSpec("tokens", "torch.int32", "xn", {"x": 3})
    result = export_torch(tmp_path / "tied", Tied(), inputs=[tokens], compiled_batch_sizes=[1, 2])
    assert result.weights_order == ("embed.weight",) and result.verification.ok


def test_verification_fails_when_the_export_differs_from_eager(tmp_path):
    with pytest.raises(VerificationError, match="does not match its source function") as caught:
        export_torch(tmp_path / "drift", Drifting(), inputs=[X], compiled_batch_sizes=[1, 2])
    assert not caught.value.verification.ok
    assert (tmp_path / "drift" / "manifest.yaml").exists()          # left for inspection


def test_a_module_that_does_not_export_names_the_call(tmp_path):
    with pytest.raises(TracingError) as caught:
        export_torch(tmp_path / "b", Branchy(), inputs=[X], compiled_batch_sizes=[1])
    assert "compiled batch size 1" in str(caught.value)
    assert "Branchy.forward(x=f32[1,6])" in str(caught.value)
    assert not (tmp_path / "b").exists()


class Upsampled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(nn.functional.interpolate(x, scale_factor=2, mode="nearest"))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = Upsampled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x)


def test_a_lowering_failure_names_the_op_and_the_module_path(tmp_path):
    """torch-mlir 20261001 does not lower nearest-neighbour upsampling (issue 26): with only the
    plain torch-mlir route, the error says it was the lowering, not the tracing, which op was left
    and which submodule calls it, and MLIR's first error instead of torch-mlir's generic one."""
    image = TensorSpec("x", "f32", "whcn", {"c": 4, "h": 4, "w": 4})
    with pytest.raises(TracingError) as caught:
        export_torch(tmp_path / "dec", Decoder(), inputs=[image], compiled_batch_sizes=[1], routes=["torch-mlir"])
    message = str(caught.value)
    assert "raised LoweringError while being lowered by torch-mlir at compiled batch size 1" in message
    assert "(left unlowered: aten.__interpolate.size_list_scale_list in up (Upsampled))" in message
    assert "failed to legalize operation 'torch.constant." in message
    assert "Decoder.forward(x=f32[1,4,4,4])" in message and not (tmp_path / "dec").exists()



def test_a_failed_lowering_falls_back_to_the_rewrites_route_and_says_so(tmp_path):
    """By default the same module is lowered by the second route (nearest upsampling rewritten
    into a broadcast), verified against eager PyTorch; the note names the first route's error."""
    image = TensorSpec("x", "f32", "whcn", {"c": 4, "h": 4, "w": 4})
    heard: list[str] = []
    result = export_torch(tmp_path / "dec", Decoder(), inputs=[image], compiled_batch_sizes=[1, 2],
                          progress=heard.append)
    assert result.route == "torch-mlir+rewrites" and result.verification.ok
    notes = [n for n in result.notes if n.startswith("lowered by route torch-mlir+rewrites at batch size 1")]
    assert len(notes) == 1 and "route torch-mlir: torch-mlir could not lower" in notes[0]
    assert "aten.__interpolate.size_list_scale_list in up (Upsampled)" in notes[0]
    assert f"note: {notes[0]}" in heard
    assert not any("batch size 2" in n for n in result.notes)     # size 2 went straight to the route that worked


def test_unknown_lowering_route_is_refused(tmp_path):
    image = TensorSpec("x", "f32", "whcn", {"c": 4, "h": 4, "w": 4})
    with pytest.raises(ExportError, match="expected one or more of torch-mlir, torch-mlir\\+rewrites"):
        export_torch(tmp_path / "dec", Decoder(), inputs=[image], compiled_batch_sizes=[1], routes=["torchax"])


MODEL = '''
import torch
from torch import nn


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).eval()


not_a_module = 3


def broken():
    return nn.Linear(3, 4, bais=False)       # a wrong keyword


class Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x
        return -x
'''


def _line(text: str) -> int:
    """The line of MODEL's file that holds ``text``."""
    return next(i for i, line in enumerate(textwrap.dedent(MODEL).splitlines(), 1) if text in line)


@pytest.fixture
def model_file(tmp_path) -> Path:
    path = tmp_path / "torch_model_e17.py"
    path.write_text(textwrap.dedent(MODEL))
    return path


def test_the_command_exports_a_torch_module(tmp_path, model_file, capsys):
    rc = main(["export", "--torch", f"{model_file}:build", "--input", "x:float32:3", "--output", "y",
               "--batch-sizes", "1,4", "--out", str(tmp_path / "m"), "--hooks"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert f"wrote {tmp_path / 'm'}: 2 modules, 4 weights, lowered by route torch-mlir, verified: 1 output of each module" in out
    assert (tmp_path / "m" / "model.py").exists()
    manifest = yaml.safe_load((tmp_path / "m" / "manifest.yaml").read_text())
    assert manifest["weights"]["order"] == ["0.weight", "0.bias", "2.weight", "2.bias"]


@pytest.mark.parametrize(("argv", "message"), [
    (["{m}:build", "--torch", "{m}:build"], "give either MODULE:FUNCTION"),
    (["--torch", "{m}:build", "--params", "p"], "--params does not apply to --torch"),
    (["--torch", "{m}:build", "--dynamic-batch"], "--dynamic-batch does not apply to --torch"),
    (["--torch", "{m}:build", "--flax"], "--flax does not apply to --torch"),
    (["--torch", "{m}:not_a_module"], "expected a torch.nn.Module or a function returning one, found int"),
    (["--torch", "{m}:missing"], "has no attribute 'missing'"),
    (["--torch", "{m}:broken"], "--torch {m}:broken: calling it raised TypeError: Linear.__init__() got an"
                                " unexpected keyword argument 'bais' (at {m}:{bais} in broken)"),
    (["--torch", "{m}:Branchy"], "bundle 'm': the function raised "),
])
def test_torch_usage_errors_exit_2(tmp_path, model_file, capsys, argv, message):
    argv = [a.replace("{m}", str(model_file)) for a in argv]
    rc = main(["export", *argv, "--input", "x:f32:3", "--batch-sizes", "1", "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err
    message = message.replace("{m}", str(model_file)).replace("{bais}", str(_line("bais=False")))
    assert rc == 2 and message in err and err.startswith("xlaserve export: ")
    assert err.count("\n") == 1 and "Traceback" not in err          # one line, no traceback
    assert not (tmp_path / "m").exists()


def test_a_module_that_does_not_export_names_the_users_line(tmp_path, model_file, capsys):
    rc = main(["export", "--torch", f"{model_file}:Branchy", "--input", "x:f32:3", "--batch-sizes", "1",
               "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "called as Branchy.forward(x=f32[1,3])" in err
    assert err.endswith(f"(raised at {model_file}:{_line('if x.sum() > 0:')} in forward)"), err


def test_the_example_encoder_serves_and_matches_eager_pytorch(tmp_path):
    """The transformer encoder of examples/torch_examples.py exported, served by `xlaserve run`
    and queried with the Triton client: a batch of 3 (padded to the compiled 4) answers both
    outputs within the f32 tolerance of the model in eager PyTorch."""
    import tritonclient.grpc as grpcclient

    from examples import torch_examples
    from tests.conftest import infer_input, serve

    repo = tmp_path / "models"
    torch_examples.export("encoder", repo)
    tokens = torch_examples.sample("encoder", 3)
    expected = torch_examples.eager("encoder", torch_examples.encoder(), tokens)
    with serve(tmp_path / "server", repo) as server:
        client = grpcclient.InferenceServerClient(server.url)
        result = client.infer("encoder", [infer_input("tokens", tokens, "INT32")])
        for name in ("logits", "embedding"):
            np.testing.assert_allclose(result.as_numpy(name), expected[name], rtol=1e-5, atol=1e-5)
        client.close()
    assert server.process.returncode == 0, server.log()


def test_only_export_torch_imports_torch():
    """The server never imports torch: no module of the package but export/from_torch.py (and
    the op rewrites only it imports, export/torch_rewrites.py) names it, and importing the
    command line, the server's node, the export package's face and its command loads none of it."""
    for path in (ROOT / "xlaserve").rglob("*.py"):
        if path.name in ("from_torch.py", "torch_rewrites.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("torch", "torch_mlir", "torchvision") for n in names), path
    code = ("import sys, xlaserve.cli, xlaserve.node, xlaserve.export.cli, xlaserve.bundle; "
            "from xlaserve.export import TensorSpec, export_jax; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'torch_mlir'}))")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert found.stdout.strip() == "[]"


def test_the_lowering_memory_guard_fails_an_allocation_past_its_budget_and_restores_the_limit():
    """What bounds a lowering that would take the machine's memory (torch-mlir on an open-ended
    slice_scatter): inside the guard an allocation past the budget fails, after it the old limit
    is back and the same allocation succeeds."""
    import resource

    from xlaserve.export.from_torch import _memory_guard

    before = resource.getrlimit(resource.RLIMIT_AS)
    with _memory_guard(64 * 1024 * 1024):
        with pytest.raises(MemoryError):
            np.ones(512 * 1024 * 1024, dtype=np.uint8)
    assert resource.getrlimit(resource.RLIMIT_AS) == before
    assert np.ones(512 * 1024 * 1024, dtype=np.uint8)[-1] == 1


def test_an_error_inside_the_memory_guard_passes_through_as_it_is():
    """A lowering's ValueError ("Cannot view a tensor ...") is the route's failure, whether the
    guard set a limit or found a tighter one already set (it used to become the context
    manager's own RuntimeError then)."""
    import resource

    from xlaserve.export.from_torch import _memory_guard

    before = resource.getrlimit(resource.RLIMIT_AS)
    try:
        with pytest.raises(ValueError, match="inner"):
            with _memory_guard(1 << 30):
                raise ValueError("inner")
        assert resource.getrlimit(resource.RLIMIT_AS) == before
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, before[1]))     # tighter than the guard's
        with pytest.raises(ValueError, match="inner"):
            with _memory_guard(64 << 30):
                raise ValueError("inner")
        assert resource.getrlimit(resource.RLIMIT_AS)[0] == 8 << 30
    finally:
        resource.setrlimit(resource.RLIMIT_AS, before)
