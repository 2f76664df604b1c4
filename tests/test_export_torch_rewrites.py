"""The op rewrites of the second lowering route (xlaserve.export.torch_rewrites): each computes what the
op it replaces computes, in eager PyTorch, and leaves no trace of that op in a decomposed
program; slices of a traced graph are clamped to their axes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from xlaserve.export import torch_rewrites
from xlaserve.export.torch_rewrites import attention, clamp_slices, upsample_nearest

aten = torch.ops.aten
# torch 2.13's torch.export makes a pytree check that torch itself deprecates; not this test's subject
pytestmark = pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning")


@pytest.mark.parametrize("options", [
    {}, {"is_causal": True}, {"scale": 0.3}, {"mask": "bool"}, {"mask": "float"}, {"enable_gqa": True},
])
def test_attention_matches_fused_attention(options):
    generator = torch.Generator().manual_seed(0)
    heads_kv = 2 if options.get("enable_gqa") else 4
    query = torch.randn(3, 4, 5, 8, generator=generator)
    key = torch.randn(3, heads_kv, 6, 8, generator=generator)
    value = torch.randn(3, heads_kv, 6, 8, generator=generator)
    kwargs = {k: v for k, v in options.items() if k != "mask"}
    if options.get("is_causal"):
        key, value = key[:, :, :5], value[:, :, :5]
    if options.get("mask") == "bool":
        kwargs["attn_mask"] = torch.rand(3, 1, 5, 6, generator=generator) > 0.3
        kwargs["attn_mask"][..., 0] = True                  # no row fully masked
    elif options.get("mask") == "float":
        kwargs["attn_mask"] = torch.randn(5, 6, generator=generator)
    want = nn.functional.scaled_dot_product_attention(query, key, value, **kwargs)
    got = attention(query, key, value, **kwargs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("size, scale", [((8, 12), None), ((7, 5), None), ((3, 9), None), (None, 2.0), (None, 1.5)])
def test_upsample_nearest_matches_interpolate(size, scale):
    x = torch.randn(2, 3, 4, 6, generator=torch.Generator().manual_seed(1))
    want = nn.functional.interpolate(x, size=size, scale_factor=scale, mode="nearest")
    got = (upsample_nearest(x, size) if size is not None
           else upsample_nearest(x, None, [scale, scale]))
    assert got.shape == want.shape
    assert torch.equal(got, want)


class Both(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = nn.functional.interpolate(x, scale_factor=2, mode="nearest")
        flat = up.flatten(2).transpose(1, 2).unsqueeze(1)         # [B, 1, 64, 3]
        return nn.functional.scaled_dot_product_attention(flat, flat, flat, is_causal=True)


def test_decomposed_program_has_neither_op_and_computes_the_same():
    x = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(2))
    program = torch.export.export(Both(), (x,), strict=False)
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert {"aten.upsample_nearest2d.vec", "aten.scaled_dot_product_attention.default"} <= targets
    decomposed = program.run_decompositions(torch_rewrites.DECOMPOSITIONS)
    left = {str(n.target) for n in decomposed.graph.nodes if n.op == "call_function"}
    assert not [t for t in left if "upsample" in t or "attention" in t], left
    torch.testing.assert_close(decomposed.module()(x), Both()(x), atol=1e-5, rtol=1e-5)


class Mask(nn.Module):
    """A shifted-window attention mask built as torchvision's Swin builds it: slice assignment
    with negative starts and open ends."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(8, 8)
        count = 0
        for rows in ((0, -4), (-4, -2), (-2, None)):
            for columns in ((0, -4), (-4, -2), (-2, None)):
                mask[rows[0]:rows[1], columns[0]:columns[1]] = count
                count += 1
        return x + mask


def test_clamp_slices_bounds_open_and_negative_ends():
    x = torch.randn(2, 8, 8)
    program = torch.export.export(Mask(), (x,), strict=False).run_decompositions({})
    graph = program.graph_module.graph
    slices = [n for n in graph.nodes if n.target in (aten.slice.Tensor, aten.slice_scatter.default)]
    assert any(max(a for a in n.args[1:] if isinstance(a, int)) > 8 for n in slices)   # open ends traced huge
    changed = clamp_slices(graph)
    program.graph_module.recompile()
    assert changed > 0
    for node in slices:
        first = 2 if node.target is aten.slice_scatter.default else 1
        _, start, end, _ = node.args[first:first + 4]
        assert 0 <= start <= end <= 8, node.args
    assert clamp_slices(graph) == 0                                     # already within bounds
    torch.testing.assert_close(program.module()(x), Mask()(x))


@pytest.mark.parametrize("size, kernel, stride, padding, ceil_mode, count_include_pad", [
    ((7, 7), 1280, None, 0, True, True),        # EfficientNet's pooler: a kernel larger than the map
    ((7, 6), 3, 2, 1, True, True), ((7, 6), 3, 2, 1, True, False), ((8, 5), 2, None, 0, True, True),
    ((5, 7), 3, 3, 1, False, False), ((7, 7), 7, None, 0, False, True),
])
def test_avg_pool_matches_avg_pool2d(size, kernel, stride, padding, ceil_mode, count_include_pad):
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(4))
    want = nn.functional.avg_pool2d(x, kernel, stride, padding, ceil_mode, count_include_pad)
    got = torch_rewrites.avg_pool(x, [kernel], [] if stride is None else [stride], [padding], ceil_mode,
                                  count_include_pad)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_avg_pool_divisor_override():
    x = torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(torch_rewrites.avg_pool(x, [3], [2], [1], True, True, 7),
                               nn.functional.avg_pool2d(x, 3, 2, 1, True, True, 7), atol=1e-6, rtol=1e-6)


class Pooling(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.avg_pool2d(x, 2) + 1.0


def test_avg_pool_leaves_pooling_layers_with_many_outputs_to_torch_mlir():
    x = torch.randn(1, 2, 20, 20)
    assert torch_rewrites.avg_pool(x, [2], [2], [0]) is NotImplemented       # 100 outputs per map
    # and the decomposition table then keeps the op itself
    decomposed = torch.export.export(Pooling(), (x,), strict=False).run_decompositions(torch_rewrites.DECOMPOSITIONS)
    assert "aten.avg_pool2d.default" in {str(n.target) for n in decomposed.graph.nodes if n.op == "call_function"}
    torch.testing.assert_close(decomposed.module()(x), Pooling()(x))


class Pooler(nn.Module):
    """transformers' EfficientNet pooler: AvgPool2d over the whole map with ceil_mode, its kernel
    (the hidden size) larger than the map; torch-mlir lowers it to an empty window."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, 2, 1)
        self.pool = nn.AvgPool2d(16, ceil_mode=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.conv(x)).flatten(1)


def test_a_pooler_with_a_kernel_larger_than_the_map_exports_by_the_rewrites_route(tmp_path):
    from xlaserve.export import TensorSpec, export_torch

    torch.manual_seed(0)
    result = export_torch(tmp_path / "pooler", Pooler().eval(),
                          inputs=[TensorSpec("x", "f32", "whcn", {"c": 3, "h": 14, "w": 14})],
                          compiled_batch_sizes=[1, 2])
    assert result.route == "torch-mlir+rewrites"
    # verified against eager PyTorch at both sizes (a failure would have raised)
    assert result.verification is not None and all(check.ok for check in result.verification.checks)
