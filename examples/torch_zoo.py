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
- ``bert_classifier``: transformers' ``BertForSequenceClassification`` (3 labels, logits scaled
  to reach about 10). input_ids int64 [B, 16] -> logits [B, 3].
- ``vit``, ``deit``: transformers' ``ViTModel`` and ``DeiTModel`` (8x8 patches of a 32x32 image,
  width 64, 2 layers). pixel_values float32 [B, 3, 32, 32] -> last_hidden_state, pooler_output.
- ``swin``: transformers' ``SwinModel``, a shifted-window vision transformer (4x4 patches of a
  64x64 image, windows of 4, two stages of two blocks, every second block shifted).
  pixel_values float32 [B, 3, 64, 64] -> last_hidden_state [B, 64, 64], pooler_output [B, 64].
- ``hf_resnet``, ``mobilenet_v2``, ``regnet``: transformers' ``ResNetModel`` (bottleneck
  blocks), ``MobileNetV2Model`` (depth multiplier 0.35: inverted residuals, depthwise
  convolutions, ReLU6) and ``RegNetModel`` (grouped convolutions, squeeze-and-excitation), their
  BatchNorm statistics calibrated on random images. pixel_values float32 [B, 3, 32, 32] ->
  last_hidden_state, pooler_output.
- ``segformer``: a segmentation model, transformers' ``SegformerForSemanticSegmentation`` (two
  stages of efficient attention with spatial reduction, an all-MLP decoder that upsamples each
  stage bilinearly; 5 classes, logits scaled to reach about 10). pixel_values float32
  [B, 3, 64, 64] -> logits [B, 5, 16, 16].
- ``fpn``: an FPN detection backbone laid out as torchvision's ``resnet_fpn_backbone``
  (:class:`ResNetFPN`: nearest-neighbour upsampling in its top-down path), BatchNorm calibrated.
  image float32 [B, 3, 64, 64] -> feature maps "0", "1", "2", "pool".
- ``gpt2``, ``llama``: decoder-only text models, transformers' ``GPT2LMHeadModel`` and
  ``LlamaForCausalLM`` (grouped-query attention, rotary positions) from tiny configs, with the
  fused SDPA attention transformers uses by default and no cache. input_ids int64 [B, 16] ->
  logits [B, 16, 256].

examples/flax_zoo.py has the Flax models of the zoo.

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


def bert_classifier() -> nn.Module:
    """transformers' BertForSequenceClassification (3 labels), its classifier scaled so that the
    logits reach about 10: input_ids int64 [B, 16] -> logits [B, 3]."""
    import transformers
    model = _seeded(lambda: transformers.BertForSequenceClassification(transformers.BertConfig(num_labels=3, **_TEXT)))
    with torch.no_grad():
        ids = torch.from_numpy(np.random.default_rng(2).integers(0, VOCAB, (8, SEQUENCE)))
        factor = 10.0 / float(model(ids).logits.abs().max())
        model.classifier.weight.mul_(factor)
        model.classifier.bias.mul_(factor)
    return model


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


def _scale_head(model: nn.Module, head: nn.Module, size: int, output: str | None = None,
                reach: float = 30.0) -> nn.Module:
    """``head``'s weight and bias scaled so that the model's logits (its ``output``) reach about
    ``reach`` on standard normal images, as a trained classifier's do."""
    with torch.no_grad():
        result = model(torch.randn(8, 3, size, size, generator=torch.Generator().manual_seed(2)))
        logits = result if output is None else result[output]
        factor = reach / float(logits.abs().max())
        head.weight.mul_(factor)
        head.bias.mul_(factor)
    return model


def efficientnet() -> nn.Module:
    torch.manual_seed(0)
    model = calibrate(EfficientNetLike(), SMALL_IMAGE)
    return _scale_head(model, model.classifier, SMALL_IMAGE)


def _vision_config(cls, **extra):
    return cls(image_size=SMALL_IMAGE, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=128, **extra)


def vit() -> nn.Module:
    import transformers
    return _seeded(lambda: transformers.ViTModel(_vision_config(transformers.ViTConfig)))


def deit() -> nn.Module:
    import transformers
    return _seeded(lambda: transformers.DeiTModel(_vision_config(transformers.DeiTConfig)))


def swin() -> nn.Module:
    """transformers' SwinModel: two stages of two blocks each, the second of every pair on
    shifted windows (its attention mask built by slice assignment, ``img_mask[:, h, w, :] = n``)."""
    import transformers
    config = transformers.SwinConfig(image_size=IMAGE, patch_size=4, embed_dim=32, depths=[2, 2], num_heads=[2, 4],
                                     window_size=4, drop_path_rate=0.0)
    return _seeded(lambda: transformers.SwinModel(config))


def _calibrated(build: Callable[[], nn.Module], size: int = SMALL_IMAGE) -> nn.Module:
    torch.manual_seed(0)
    return calibrate(build(), size)


def hf_resnet() -> nn.Module:
    import transformers
    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                                       layer_type="bottleneck")
    return _calibrated(lambda: transformers.ResNetModel(config))


def mobilenet_v2() -> nn.Module:
    import transformers
    config = transformers.MobileNetV2Config(image_size=SMALL_IMAGE, depth_multiplier=0.35)
    return _calibrated(lambda: transformers.MobileNetV2Model(config))


def regnet() -> nn.Module:
    import transformers
    config = transformers.RegNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                                       groups_width=8)
    return _calibrated(lambda: transformers.RegNetModel(config))


def segformer() -> nn.Module:
    """transformers' SegformerForSemanticSegmentation: a segmentation model (logits per class at
    a quarter of the image's resolution, the decoder head upsampling every stage bilinearly)."""
    import transformers
    config = transformers.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[4, 2], hidden_sizes=[16, 32],
                                          num_attention_heads=[1, 2], decoder_hidden_size=32, num_labels=5)
    model = _calibrated(lambda: transformers.SegformerForSemanticSegmentation(config), IMAGE)
    return _scale_head(model, model.decode_head.classifier, IMAGE, "logits", reach=10.0)


def gpt2() -> nn.Module:
    """transformers' GPT2LMHeadModel, fused SDPA attention (transformers' default), no cache:
    input_ids int64 [B, 16] -> logits [B, 16, 256]."""
    import transformers
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    return _seeded(lambda: transformers.GPT2LMHeadModel(config))


def llama() -> nn.Module:
    """transformers' LlamaForCausalLM (rotary positions, RMSNorm, SwiGLU, grouped-query attention
    through fused SDPA), no cache: input_ids int64 [B, 16] -> logits [B, 16, 256]."""
    import transformers
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      use_cache=False)
    return _seeded(lambda: transformers.LlamaForCausalLM(config))


class Bottleneck(nn.Module):
    """torchvision's ResNet bottleneck: 1x1, 3x3 (the stride), 1x1 with 4x expansion, BatchNorm."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return torch.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNetFPN(nn.Module):
    """A detection backbone laid out as torchvision's ``resnet_fpn_backbone`` (a bottleneck ResNet
    whose stages 2-4 feed a FeaturePyramidNetwork: 1x1 lateral convolutions, a top-down path that
    upsamples each coarser map by nearest neighbour, ``F.interpolate(size=..., mode="nearest")``,
    3x3 output convolutions, and a max-pooled extra level), one block a stage.
    image float32 [B, 3, 64, 64] -> feature maps "0" [B, 32, 8, 8], "1" [B, 32, 4, 4],
    "2" [B, 32, 2, 2], "pool" [B, 32, 1, 1]."""

    def __init__(self, widths: Sequence[int] = (8, 16, 32, 64), channels: int = 32) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 7, 2, 3, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        stages, cin = [], widths[0]
        for index, width in enumerate(widths):
            stages.append(Bottleneck(cin, width, 1 if index == 0 else 2))
            cin = 4 * width
        self.stages = nn.ModuleList(stages)
        fed = [4 * w for w in widths[1:]]
        self.inner = nn.ModuleList(nn.Conv2d(c, channels, 1) for c in fed)
        self.layer = nn.ModuleList(nn.Conv2d(channels, channels, 3, padding=1) for _ in fed)

    def forward(self, image: torch.Tensor) -> dict[str, torch.Tensor]:
        x, features = self.stem(image), []
        for index, stage in enumerate(self.stages):
            x = stage(x)
            if index:
                features.append(x)
        last = self.inner[-1](features[-1])
        results = [self.layer[-1](last)]
        for index in range(len(features) - 2, -1, -1):
            lateral = self.inner[index](features[index])
            last = lateral + nn.functional.interpolate(last, size=lateral.shape[-2:], mode="nearest")
            results.insert(0, self.layer[index](last))
        names = [str(i) for i in range(len(results))]
        out = dict(zip(names, results))
        out["pool"] = nn.functional.max_pool2d(results[-1], 1, 2, 0)
        return out


def fpn() -> nn.Module:
    torch.manual_seed(0)
    return calibrate(ResNetFPN(), IMAGE)


_IDS = [TensorSpec("input_ids", "i64", "tn", {"t": SEQUENCE})]
_IMAGE = [TensorSpec("image", "f32", "whcn", {"c": 3, "h": IMAGE, "w": IMAGE})]
_PIXELS = [TensorSpec("pixel_values", "f32", "whcn", {"c": 3, "h": IMAGE, "w": IMAGE})]
_SMALL_PIXELS = [TensorSpec("pixel_values", "f32", "whcn", {"c": 3, "h": SMALL_IMAGE, "w": SMALL_IMAGE})]
_SMALL_IMAGE = [TensorSpec("image", "f32", "whcn", {"c": 3, "h": SMALL_IMAGE, "w": SMALL_IMAGE})]

MODELS: dict[str, tuple[Callable[[], nn.Module], list[TensorSpec]]] = {
    "bert": (bert, _IDS),
    "bert_classifier": (bert_classifier, _IDS),
    "roberta": (roberta, _IDS),
    "distilbert": (distilbert, _IDS),
    "albert": (albert, _IDS),
    "electra": (electra, _IDS),
    "convnext": (convnext, _IMAGE),
    "hf_convnext": (hf_convnext, _PIXELS),
    "efficientnet": (efficientnet, _SMALL_IMAGE),
    "vit": (vit, _SMALL_PIXELS),
    "deit": (deit, _SMALL_PIXELS),
    "swin": (swin, _PIXELS),
    "hf_resnet": (hf_resnet, _SMALL_PIXELS),
    "mobilenet_v2": (mobilenet_v2, _SMALL_PIXELS),
    "regnet": (regnet, _SMALL_PIXELS),
    "segformer": (segformer, _PIXELS),
    "fpn": (fpn, _IMAGE),
    "gpt2": (gpt2, _IDS),
    "llama": (llama, _IDS),
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
