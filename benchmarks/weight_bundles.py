"""Bundles whose weights have a chosen size, for weight-cache tests and benchmarks.

The model is ``output = input + w[0]`` over ``input: f32[B, 256]`` and ``w: f32[rows, 256]``: the
whole ``w`` is an argument (so it must be on the device) but an execution reads one row, so a
cold call costs the weight copy and almost nothing else. ``w[0]`` is filled with ``mark``, so a
response shows which model's weights ran.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import yaml
from safetensors.numpy import save_file

FEATURES = 256
ROW_BYTES = FEATURES * 4


def _add_first_row(w, x):
    return (x + w[0],)


def export_weight_bundle(repo: Path, name: str, weight_bytes: int, mark: float = 0.0,
                         compiled_batch_sizes=(1, 4)) -> Path:
    """Write bundle ``repo/name`` with ``weight_bytes`` (rounded to 1 KiB rows) of weights."""
    from xlaserve.export import TensorSpec, export_bundle  # jax: only when exporting
    rows = max(1, weight_bytes // ROW_BYTES)
    return export_bundle(repo / name, _add_first_row,
                         inputs=[TensorSpec("input", "f32", "fn", {"f": FEATURES})],
                         outputs=[TensorSpec("output", "f32", "fn", {"f": FEATURES})],
                         weights={"w": _weights(rows, mark)}, compiled_batch_sizes=compiled_batch_sizes)


def clone_weight_bundle(source: Path, name: str, mark: float) -> Path:
    """A copy of ``source`` named ``name`` whose ``w[0]`` is ``mark`` (no re-export)."""
    target = source.parent / name
    shutil.copytree(source, target)
    manifest_path = target / "manifest.yaml"
    manifest = yaml.safe_load(manifest_path.read_text())
    manifest["name"] = name
    manifest_path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    from safetensors import safe_open
    with safe_open(str(source / "weights.safetensors"), framework="numpy") as f:
        rows = f.get_slice("w").get_shape()[0]
    save_file({"w": _weights(rows, mark)}, str(target / "weights.safetensors"))
    return target


def _weights(rows: int, mark: float) -> np.ndarray:
    w = np.zeros((rows, FEATURES), np.float32)
    w[0] = mark
    return w
