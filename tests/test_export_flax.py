"""xlaserve.export.from_flax: NNX and Linen models exported under Flax's own names, loaded as the
server loads them and matching the model run by Flax; the command line's Flax source."""
from __future__ import annotations

import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from xlaserve.bundle import load_bundle
from xlaserve.cli import main
from xlaserve.export import ExportError, TensorSpec, export_flax, flax_function, flax_kind
from xlaserve.runtime.pjrt import Device

X = TensorSpec("x", "f32", "xn", {"x": 4})


@pytest.fixture(scope="module")
def device() -> Device:
    return Device("cpu")


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear1 = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(3)])
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        h = self.drop(jax.nn.relu(self.bn(self.linear1(x))))
        for layer in self.layers:
            h = jnp.tanh(layer(h))
        return self.head(h)


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dense(8)(x)
        h = nn.BatchNorm(use_running_average=not train)(h)
        return nn.Dense(3)(jax.nn.relu(h))


def run(device, bundle, x):
    model = load_bundle(bundle, 1, device)
    return device.execute(model.modules[len(x)].executable, [*model.weights.read(), x])


def nnx_model() -> Net:
    model = Net(nnx.Rngs(0))
    model.bn.mean[...] = jnp.linspace(-1, 1, 8)       # running statistics that change the output
    model.bn.var[...] = jnp.linspace(0.5, 2, 8)
    return model


def test_nnx_model_exports_under_its_attribute_names_and_runs_in_inference_mode(tmp_path, device):
    model = nnx_model()
    result = export_flax(tmp_path / "net", model, inputs=[X], compiled_batch_sizes=[1, 3])
    names = {"linear1.kernel", "linear1.bias", "bn.mean", "bn.var", "bn.scale", "bn.bias", "head.kernel",
             "head.bias", *(f"layers.{i}.{leaf}" for i in range(3) for leaf in ("kernel", "bias"))}
    assert set(result.weights_order) == names            # no rng keys or counters among them
    assert result.verification.ok
    assert model.drop.deterministic is False and model.bn.use_running_average is False   # untouched
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    (found,) = run(device, tmp_path / "net", x)
    model.eval()
    np.testing.assert_allclose(found, np.asarray(model(x)), rtol=1e-5, atol=1e-5)


def test_linen_model_exports_collections_first(tmp_path, device):
    model = LinenNet()
    variables = model.init(jax.random.key(0), jnp.ones((1, 4)))
    variables = jax.tree_util.tree_map(lambda a: a + 0.25, variables)   # batch_stats off their init
    result = export_flax(tmp_path / "linen", model, variables, inputs=[X], compiled_batch_sizes=[2],
                         dynamic_batch=True)
    assert list(result.weights_order) == [
        "batch_stats.BatchNorm_0.mean", "batch_stats.BatchNorm_0.var", "params.BatchNorm_0.bias",
        "params.BatchNorm_0.scale", "params.Dense_0.bias", "params.Dense_0.kernel", "params.Dense_1.bias",
        "params.Dense_1.kernel"]
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    (found,) = run(device, tmp_path / "linen", x)
    np.testing.assert_allclose(found, np.asarray(model.apply(variables, x)), rtol=1e-5, atol=1e-5)


def test_flax_kind_and_refusals():
    linen = LinenNet()
    variables = linen.init(jax.random.key(0), jnp.ones((1, 4)))
    assert flax_kind(nnx_model()) == "nnx" and flax_kind(linen) == "linen" and flax_kind(len) is None
    with pytest.raises(ExportError, match="an NNX model carries its own state"):
        flax_function(nnx_model(), variables)
    with pytest.raises(ExportError, match=r"a Linen model needs its variables \({'params': \.\.\.}"):
        flax_function(linen)
    with pytest.raises(ExportError, match=r"found \['BatchNorm_0', 'Dense_0', 'Dense_1'\]: wrap bare parameters"):
        flax_function(linen, variables["params"])
    with pytest.raises(ExportError, match="builtins.builtin_function_or_method is not a Flax model"):
        flax_function(len)


MODEL = '''
import jax.numpy as jnp
import flax.linen as nn
from flax import nnx

class Tiny(nnx.Module):
    def __init__(self):
        self.dense = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    def __call__(self, x):
        return {"y": self.dense(x), "top": jnp.argmax(x, axis=1).astype(jnp.int32)}

tiny = Tiny()

def make_tiny():
    return Tiny()

class Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(x)

dense = Dense()

def dense_variables():
    import jax
    return dense.init(jax.random.key(1), jnp.ones((1, 3)))

def not_a_model():
    return 42
'''


@pytest.fixture
def source(tmp_path, request):
    path = tmp_path / f"flax_{request.node.name.replace('[', '_').replace(']', '').replace('-', '_')}.py"
    path.write_text(textwrap.dedent(MODEL))
    return path


@pytest.mark.parametrize(("target", "extra", "weights"), [
    ("tiny", [], "2 weights"),                       # an NNX object, recognised
    ("make_tiny", ["--flax"], "2 weights"),          # a factory
    ("dense", ["--params", "dense_variables"], "2 weights"),   # Linen with its variables
], ids=["nnx-object", "nnx-factory", "linen"])
def test_cli_flax_sources(tmp_path, source, capsys, target, extra, weights):
    out = tmp_path / "models" / "m"
    output = ["--output", "y"] if target == "dense" else []
    rc = main(["export", f"{source}:{target}", *extra, "--input", "x:float32:3", "--batch-sizes", "1,2",
               *output, "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert captured.out.startswith(f"wrote {out}: 2 modules, {weights}, verified:")


@pytest.mark.parametrize(("target", "extra", "message"), [
    ("not_a_model", ["--flax"], "--flax: {source}:not_a_model() returned int, not a Flax model"),
    ("dense", [], "{source}:dense: a Linen model needs its variables"),
    ("tiny", ["--params", "dense_variables"], "{source}:tiny: an NNX model carries its own state"),
], ids=["factory-returns-no-model", "linen-without-variables", "nnx-with-variables"])
def test_cli_flax_mistakes_exit_2_naming_them(tmp_path, source, capsys, target, extra, message):
    out = tmp_path / "m"
    rc = main(["export", f"{source}:{target}", *extra, "--input", "x:float32:3", "--batch-sizes", "1",
               "--out", str(out)])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith(f"xlaserve export: {message.format(source=source)}") and err.count("\n") == 1
    assert not out.exists()
