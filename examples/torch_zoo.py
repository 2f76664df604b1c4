"""Mainstream PyTorch architectures built from code for ``xlaserve export --torch``: small
configurations, random weights from fixed seeds, nothing downloaded.

- ``bert``, ``roberta``, ``distilbert``, ``albert``, ``electra``: the transformers text encoders
  (``BertModel`` ...) from small configs. They keep ``embeddings.position_ids`` (and most of them
  ``token_type_ids``) in non-persistent buffers. input_ids int64 [B, 16] -> last_hidden_state
  [B, 16, 64] (and pooler_output [B, 64] where the model has a pooler).
- ``convnext``: a ConvNeXt laid out as torchvision's ``convnext_tiny`` is (4x4 patchify stem,
  blocks of depthwise 7x7 convolution, channels-last LayerNorm and MLP with layer scale,
  LayerNorm2d and 2x2 downsampling between stages, ``AdaptiveAvgPool2d`` head), written here
  because torchvision does not import beside this project's CPU torch; smaller: widths 32, 64,
  96, 128, one block a stage. Its pooling lowers to the ``dense_resource`` constants XLA refuses
  unless the export rewrites them. image float32 [B, 3, 64, 64] -> logits [B, 10].
- ``hf_convnext``: transformers' ``ConvNextModel`` from a small config (mean-pooling head).
  pixel_values float32 [B, 3, 64, 64] -> last_hidden_state, pooler_output.
- ``efficientnet``: an EfficientNet-like network written here (MBConv blocks: 1x1 expansion,
  depthwise 3x3 and 5x5 convolutions, squeeze-and-excitation, SiLU, BatchNorm), its BatchNorm
  statistics calibrated on random images and its head scaled so that its logits reach about
  30, as a trained EfficientNet-B0's do: float32 rounding then differs from eager PyTorch by
  more than a fixed 1e-5, which the scaled verification tolerance allows.
  image float32 [B, 3, 32, 32] -> logits [B, 10].

``MODELS[name]`` is (factory, inputs); ``sample(name, batch)`` gives seeded inputs and
``eager(name, model, arrays)`` the model's outputs by name. From the command line::

    xlaserve export --torch examples/torch_zoo.py:bert --input input_ids:int64:16 \\
        --batch-sizes 1,4 --out models/bert
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch import nn

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # run as a script from anywhere, without installing xlaserve
    sys.path.insert(0, str(_REPO))

from xlaserve.export import TensorSpec  # noqa: E402

SEQUENCE, VOCAB, IMAGE, SMALL_IMAGE = 16, 256, 64, 32
_TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=128, max_position_embeddings=64)


def _seeded(build: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return build().eval()


def bert() -> nn.Module:
    import transformers
    return _seeded(lambda: transformers.BertModel(transformers.BertConfig(**_TEXT)))


def roberta() -> nn.Module:
    import transformers
    return _seeded(lambda: transformers.RobertaModel(transformers.RobertaConfig(**_TEXT)))


def distilbert() -> nn.Module:
    import transformers
    config = transformers.DistilBertConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                                           max_position_embeddings=64)
    return _seeded(lambda: transformers.DistilBertModel(config))


def albert() -> nn.Module:
    import transformers
    return _seeded(lambda: transformers.AlbertModel(transformers.AlbertConfig(embedding_size=32, **_TEXT)))


def electra() -> nn.Module:
    import transformers
    return _seeded(lambda: transformers.ElectraModel(transformers.ElectraConfig(embedding_size=32, **_TEXT)))


def hf_convnext() -> nn.Module:
    import transformers
    config = transformers.ConvNextConfig(hidden_sizes=[32, 64, 96, 128], depths=[1, 1, 1, 1], image_size=IMAGE)
    return _seeded(lambda: transformers.ConvNextModel(config))


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.layer_scale = nn.Parameter(torch.full((dim, 1, 1), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.depthwise(x).permute(0, 2, 3, 1)
        y = self.down(nn.functional.gelu(self.up(self.norm(y)))).permute(0, 3, 1, 2)
        return x + self.layer_scale * y


class ConvNeXt(nn.Module):
    def __init__(self, widths: Sequence[int] = (32, 64, 96, 128), classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, widths[0], 4, stride=4), LayerNorm2d(widths[0], eps=1e-6)]
        for index, width in enumerate(widths):
            if index:
                layers += [LayerNorm2d(widths[index - 1], eps=1e-6), nn.Conv2d(widths[index - 1], width, 2, stride=2)]
            layers.append(ConvNeXtBlock(width))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Sequential(LayerNorm2d(widths[-1], eps=1e-6), nn.Flatten(1), nn.Linear(widths[-1], classes))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.features(image)))


def convnext() -> nn.Module:
    return _seeded(ConvNeXt)


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.reduce, self.expand = nn.Conv2d(channels, squeezed, 1), nn.Conv2d(squeezed, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.expand(nn.functional.silu(self.reduce(x.mean((2, 3), keepdim=True))))
        return x * torch.sigmoid(scale)


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, act: bool = True) -> nn.Sequential:
    layers = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, nn.SiLU()) if act else nn.Sequential(*layers)


class MBConv(nn.Module):
    """Inverted residual: 1x1 expansion, depthwise convolution, squeeze-and-excitation, 1x1
    projection, with a residual connection where the shape allows."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        layers = [_conv_bn(cin, hidden, 1)] if expand != 1 else []
        layers += [_conv_bn(hidden, hidden, kernel, stride, groups=hidden), SqueezeExcite(hidden, max(1, cin // 4)),
                   _conv_bn(hidden, cout, 1, act=False)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.residual else y


class EfficientNetLike(nn.Module):
    # (expansion, out channels, repeats, stride, kernel): EfficientNet-B0's stages, narrower
    STAGES = ((1, 16, 1, 1, 3), (6, 24, 2, 2, 3), (6, 40, 2, 2, 5), (6, 80, 2, 2, 3), (6, 112, 1, 1, 5))

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [_conv_bn(3, 32, 3, 2)]
        cin = 32
        for expand, cout, repeats, stride, kernel in self.STAGES:
            for index in range(repeats):
                layers.append(MBConv(cin, cout, kernel, stride if index == 0 else 1, expand))
                cin = cout
        layers.append(_conv_bn(cin, 320, 1))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(320, classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pool(self.features(image)).flatten(1))


def calibrate(model: nn.Module, size: int, batches: int = 2, batch: int = 8, seed: int = 1) -> nn.Module:
    """BatchNorm running statistics measured on random images (a cumulative average over
    ``batches``), as training would leave them; then eval mode."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.reset_running_stats()
            module.momentum = None
    generator = torch.Generator().manual_seed(seed)
    model.train()
    with torch.no_grad():
        for _ in range(batches):
            model(torch.randn(batch, 3, size, size, generator=generator))
    return model.eval()


def efficientnet() -> nn.Module:
    torch.manual_seed(0)
    model = calibrate(EfficientNetLike(), SMALL_IMAGE)
    with torch.no_grad():      # logits reaching about 30 on standard normal images
        logits = model(torch.randn(8, 3, SMALL_IMAGE, SMALL_IMAGE, generator=torch.Generator().manual_seed(2)))
        factor = 30.0 / float(logits.abs().max())
        model.classifier.weight.mul_(factor)
        model.classifier.bias.mul_(factor)
    return model


_IDS = [TensorSpec("input_ids", "i64", "tn", {"t": SEQUENCE})]
_IMAGE = [TensorSpec("image", "f32", "whcn", {"c": 3, "h": IMAGE, "w": IMAGE})]
_PIXELS = [TensorSpec("pixel_values", "f32", "whcn", {"c": 3, "h": IMAGE, "w": IMAGE})]
_SMALL_IMAGE = [TensorSpec("image", "f32", "whcn", {"c": 3, "h": SMALL_IMAGE, "w": SMALL_IMAGE})]

MODELS: dict[str, tuple[Callable[[], nn.Module], list[TensorSpec]]] = {
    "bert": (bert, _IDS),
    "roberta": (roberta, _IDS),
    "distilbert": (distilbert, _IDS),
    "albert": (albert, _IDS),
    "electra": (electra, _IDS),
    "convnext": (convnext, _IMAGE),
    "hf_convnext": (hf_convnext, _PIXELS),
    "efficientnet": (efficientnet, _SMALL_IMAGE),
}


def sample(name: str, batch: int, seed: int = 3) -> list[np.ndarray]:
    """Seeded inputs for ``name``: token ids over the whole vocabulary, standard normal images."""
    rng = np.random.default_rng(seed)
    arrays = []
    for spec in MODELS[name][1]:
        shape = spec.row_major(batch)
        arrays.append(rng.integers(0, VOCAB, shape).astype(np.int64) if spec.dtype == "i64"
                      else rng.standard_normal(shape).astype(np.float32))
    return arrays


def eager(model: nn.Module, arrays: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """The model's outputs on ``arrays``, named as the export names them (one tensor is
    ``output``, a dict or model output its keys)."""
    with torch.no_grad():
        result = model(*[torch.from_numpy(a) for a in arrays])
    leaves = pytree.tree_flatten_with_path(result)[0]
    if len(leaves) == 1 and not leaves[0][0]:
        return {"output": leaves[0][1].numpy()}
    return {".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path): leaf.numpy()
            for path, leaf in leaves}
