"""Rewrites of a ``torch.export`` program into ops torch-mlir lowers, for the second lowering
route of :func:`xlaserve.export.from_torch.export_torch` (``torch-mlir+rewrites``): each replaces an op
that mainstream models call and torch-mlir 20261001 fails on with an equivalent of plain ops.

- :func:`attention`: ``aten.scaled_dot_product_attention`` (the fused attention transformers uses
  by default) as matmul, scale, mask and softmax. The stock decomposition goes through
  ``_scaled_dot_product_flash_attention_for_cpu``, whose own decomposition fails at batch > 1 on
  the transposed views decoder-only models pass it (``Cannot view a tensor with shape ... and
  strides ...``).
- :func:`upsample_nearest`: ``aten.upsample_nearest2d`` (``F.interpolate(mode="nearest")``, as FPN
  detection backbones upsample) as a broadcast and reshape where the output is a whole multiple
  of the input, else as ``index_select`` with PyTorch's source indices; torch-mlir's own op
  (``aten.__interpolate``) fails to legalize.
- :func:`clamp_slices`: every ``aten.slice`` and ``aten.slice_scatter`` of the graph given start and
  end within the sliced axis. An open end (``mask[-k:, -k:] = v``, as shifted-window transformers
  build their attention masks) is traced as ``end=2**63-1``, on which torch-mlir's lowering of
  ``slice_scatter`` runs out of memory (``std::bad_alloc`` after gigabytes).
- :func:`avg_pool`: ``aten.avg_pool2d`` with few outputs (a pooler) as sums of slices divided
  as PyTorch divides: EfficientNet's pooler (``AvgPool2d`` over the whole map, ``ceil_mode``,
  a kernel larger than the map) lowers through torch-mlir to an empty window
  (``tensor<1x1280x0x0xf32>``).

:data:`DECOMPOSITIONS` holds :func:`attention`, :func:`upsample_nearest` and :func:`avg_pool` as a
decomposition table for ``ExportedProgram.run_decompositions``; :func:`clamp_slices` edits a graph
in place.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

aten = torch.ops.aten

__all__ = ["AVG_POOL_MAX_OUTPUTS", "DECOMPOSITIONS", "attention", "avg_pool", "clamp_slices", "upsample_nearest"]


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` in eval mode (``dropout_p`` is ignored: exports run in
    eval mode) as ``softmax(q @ k^T * scale + mask) @ v``; grouped-query attention
    (``enable_gqa``) repeats each key and value head over its group of query heads."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if is_causal:
        allowed = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    return torch.matmul(torch.softmax(scores, dim=-1), value)


def _source_indices(size: int, out: int, scale: float | None, device: torch.device) -> torch.Tensor:
    # PyTorch's nearest: source = floor(destination * in / out), or / scale where one was given
    step = (1.0 / scale) if scale else size / out
    indices = (torch.arange(out, dtype=torch.float32, device=device) * step).floor().to(torch.int64)
    return indices.clamp(max=size - 1)


def upsample_nearest(x: torch.Tensor, output_size: Sequence[int] | None,
                     scales: Sequence[float | None] | None = None) -> torch.Tensor:
    """Nearest-neighbour resize of the last two axes of an NCHW tensor to ``output_size`` (or by
    ``scales``), as ``aten.upsample_nearest2d`` computes it."""
    height, width = x.shape[-2:]
    factors = list(scales) if scales is not None else [None, None]
    if output_size is None:
        output_size = [math.floor(height * factors[0]), math.floor(width * factors[1])]
    out_h, out_w = int(output_size[0]), int(output_size[1])
    exact = [f is None or float(f) == o / s for f, o, s in zip(factors, (out_h, out_w), (height, width))]
    if out_h % height == 0 and out_w % width == 0 and all(exact):
        ry, rx = out_h // height, out_w // width
        grown = x[..., :, None, :, None].expand(*x.shape[:-2], height, ry, width, rx)
        return grown.reshape(*x.shape[:-2], out_h, out_w)
    rows = _source_indices(height, out_h, factors[0], x.device)
    columns = _source_indices(width, out_w, factors[1], x.device)
    return x.index_select(-2, rows).index_select(-1, columns)


def _upsample_vec(x: torch.Tensor, output_size: Sequence[int] | None,
                  scale_factors: Sequence[float] | None) -> torch.Tensor:
    return upsample_nearest(x, output_size, scale_factors)


def _upsample_default(x: torch.Tensor, output_size: Sequence[int], scales_h: float | None = None,
                      scales_w: float | None = None) -> torch.Tensor:
    return upsample_nearest(x, output_size, [scales_h, scales_w])


#: avg_pool2d is written out only when it has this few outputs per map (a pooler); a pooling
#: layer with more is left to torch-mlir, which lowers the usual ones
AVG_POOL_MAX_OUTPUTS = 64


def _pool_windows(size: int, kernel: int, stride: int, pad: int, ceil_mode: bool,
                  count_include_pad: bool) -> list[tuple[int, int, int]]:
    """Along one axis of ``aten.avg_pool2d``: each output's window in the input, ``(start, end,
    divisor)``, as PyTorch computes them (its output size rule and its divisor: the window
    clipped to the padded input, or to the input without ``count_include_pad``)."""
    out = (size + 2 * pad - kernel + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= size + pad:
        out -= 1                        # the last window must start inside the input or left padding
    windows = []
    for index in range(out):
        start = index * stride - pad
        end = min(start + kernel, size + pad)
        divisor = end - start
        start, end = max(start, 0), min(end, size)
        windows.append((start, end, divisor if count_include_pad else end - start))
    return windows


def _pair(values: Sequence[int], default: Sequence[int]) -> list[int]:
    values = list(values) or list(default)
    return [int(values[0])] * 2 if len(values) == 1 else [int(v) for v in values]


def avg_pool(x: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int] = (),
             padding: Sequence[int] = (0,), ceil_mode: bool = False, count_include_pad: bool = True,
             divisor_override: int | None = None) -> torch.Tensor:
    """``aten.avg_pool2d`` as sums of slices, one per output position and axis: for the few
    outputs of a pooler (EfficientNet's ``AvgPool2d`` over the whole map with ``ceil_mode``,
    whose kernel is larger than the map and which torch-mlir lowers to an empty window)."""
    kernel = _pair(kernel_size, ())
    strides = _pair(stride, kernel)         # no stride: the kernel's
    pads = _pair(padding, (0,))
    rows = _pool_windows(x.shape[-2], kernel[0], strides[0], pads[0], ceil_mode, count_include_pad)
    columns = _pool_windows(x.shape[-1], kernel[1], strides[1], pads[1], ceil_mode, count_include_pad)
    if len(rows) * len(columns) > AVG_POOL_MAX_OUTPUTS:
        return NotImplemented               # a pooling layer: torch-mlir's own lowering
    # each divisor a Python number (a tensor made here would be a constant the graph must lift)
    return torch.stack([torch.stack([x[..., r0:r1, c0:c1].sum((-2, -1)) / float(divisor_override or rd * cd)
                                     for c0, c1, cd in columns], dim=-1) for r0, r1, rd in rows], dim=-2)


DECOMPOSITIONS = {
    aten.scaled_dot_product_attention.default: attention,
    aten.upsample_nearest2d.vec: _upsample_vec,
    aten.upsample_nearest2d.default: _upsample_default,
    aten.avg_pool2d.default: avg_pool,          # aten.avg_pool2d's own arguments and defaults
}


def _bound(index: int | None, size: int, default: int) -> int:
    if index is None:
        return default
    if index < 0:
        index += size
    return min(max(index, 0), size)


def clamp_slices(graph: torch.fx.Graph) -> int:
    """Give every ``aten.slice.Tensor`` and ``aten.slice_scatter.default`` of ``graph`` a start
    and end within ``[0, size]`` of the axis it slices (Python's slicing rules: a negative index
    counts from the end, an open or overlong end is the size), where the axis has a static size;
    returns how many were changed."""
    changed = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in (aten.slice.Tensor, aten.slice_scatter.default):
            continue
        scatter = node.target is aten.slice_scatter.default
        names = ("dim", "start", "end", "step")
        first = 2 if scatter else 1
        values = dict(zip(names, (0, None, None, 1)))
        values.update(zip(names, node.args[first:]))
        values.update({k: v for k, v in node.kwargs.items() if k in names})
        source = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if source is None or not all(isinstance(v, int) or v is None for v in values.values()):
            continue
        dim = values["dim"] % source.dim()
        size = source.shape[dim]
        if not isinstance(size, int):
            continue                       # a dynamic axis: left as traced
        start, end = _bound(values["start"], size, 0), _bound(values["end"], size, size)
        end = max(end, start)
        if (start, end) == (values["start"], values["end"]):
            continue
        node.args = (*node.args[:first], dim, start, end, values["step"])
        node.kwargs = {}
        changed += 1
    return changed
