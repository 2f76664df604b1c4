"""Write an xlaserve bundle: trace a JAX function into its modules (:func:`export_bundle`), or take
modules already made (:func:`write_bundle`, the PyTorch route's way), and put them in place.

A bundle is a directory ``<model_repo>/<name>/`` holding ``manifest.yaml``, one StableHLO module
per compiled batch size (``model.b{N}.mlir`` text or ``model.b{N}.mlirbc`` bytecode) or one
dynamic-batch module for them all (``model.mlir``, ``dynamic_batch=True``) and, when the model has
weights, ``weights.safetensors``. ``docs/bundles.md`` is the full contract.

The function to export works on row-major arrays, exactly as the server's executable will::

    def fn(*weights_in_order, *inputs_in_manifest_order) -> tuple_of_outputs_in_manifest_order

Output is deterministic: exporting the same code twice gives byte-identical files, wherever the
repository is checked out (source locations are left out of the modules; see ``_module_locations``).
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml
from safetensors.numpy import save_file

from xlaserve.bundle import MANIFEST
from xlaserve.export.spec import (DTYPES, ExportError, TensorSpec, TracingError, abstract_shape,
                                  check_batch_sizes, dtype_code, module_file_name)
from xlaserve.manifest import DEFAULT_WEIGHTS_FILE, FORMAT_VERSION
from xlaserve.progress import Step
from xlaserve.runtime.pjrt import eliminate_common_subexpressions

__all__ = [
    "MANIFEST_FILE",
    "SYMBOLIC_BATCH",
    "WEIGHTS_FILE",
    "check_64_bit_types",
    "export_bundle",
    "write_bundle",
]

MANIFEST_FILE = MANIFEST
WEIGHTS_FILE = DEFAULT_WEIGHTS_FILE


def export_bundle(
    out_dir: str | os.PathLike[str],
    fn: Callable[..., Any],
    *,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    weights: Mapping[str, np.ndarray] | None,
    compiled_batch_sizes: Sequence[int],
    weights_order: Sequence[str] | None = None,
    bytecode: bool = False,
    client_inputs: Sequence[TensorSpec] | None = None,
    client_outputs: Sequence[TensorSpec] | None = None,
    extra_files: Mapping[str, str] | None = None,
    progress: Callable[[str], None] | None = None,
    dynamic_batch: bool = False,
) -> Path:
    """Trace ``fn`` once per compiled batch size and write a complete bundle to ``out_dir``.

    ``fn(*weights, *inputs)`` takes the weights in ``weights_order`` (default: names sorted), then
    the ``inputs`` in order, all as row-major arrays, and returns the ``outputs`` in order as a
    tuple (a single array is accepted for one output). The basename of ``out_dir`` is the model
    name. Every traced output is checked against ``outputs`` (dtype and row-major shape).

    ``bytecode=False`` writes StableHLO text, ``model.b{N}.mlir`` (``Exported.mlir_module()``
    after common-subexpression elimination, which keeps the program and its debug locations and
    makes a dynamic-batch module about a sixth smaller:
    :func:`~xlaserve.runtime.pjrt.eliminate_common_subexpressions`).
    ``bytecode=True`` writes ``model.b{N}.mlirbc``: the StableHLO *portable artifact*
    (``Exported.mlir_module_serialized``, VHLO bytecode with StableHLO's compatibility window),
    which PJRT compiles directly. If in doubt, use text: it is diffable and reviewable.

    ``dynamic_batch=True`` traces ``fn`` once instead, with a symbolic batch size ``b``
    (``jax.export.symbolic_shape``, ``b >= 1``), and writes that one module as ``model.mlir``
    (``model.mlirbc``); the loader specializes it to each of ``compiled_batch_sizes``
    (docs/export.md, "One module for every batch size"). ``fn`` must then work at any batch
    size: an operation that needs the batch as a number (a Python ``range`` over it, a reshape
    that folds it into another axis) is a :class:`TracingError` here.

    ``extra_files`` maps file names to text written beside the modules (a bundle's ``model.py``).
    ``progress`` hears one :class:`~xlaserve.progress.Step` per module traced.

    An exception raised by ``fn`` while it is traced becomes a :class:`TracingError` naming the
    batch size and the abstract signature ``fn`` was called with.

    With weights, the manifest always gets an explicit ``weights: {file, order}`` key recording
    the order ``fn`` takes them in (with the default order it is what the loader would pick
    without the key: every tensor of ``weights.safetensors``, names sorted). Without weights no
    weights file is written, so the bundle has none: no key and no file.

    The bundle is staged in a hidden sibling directory (``.<name>.*.tmp``) and renamed into place,
    so a repository watcher sees either no bundle, the old one, or the complete new one. On Linux an
    existing bundle is swapped atomically; elsewhere it is moved aside first.

    Returns the bundle directory.
    """
    out_dir = Path(out_dir)
    name = out_dir.name
    if not name or name.startswith("."):
        raise ValueError(f"bundle directory name {name!r} must be non-empty and not start with '.'")
    sizes = check_batch_sizes(compiled_batch_sizes)
    inputs, outputs = list(inputs), list(outputs)
    _check_unique("executable_inputs", inputs)
    _check_unique("executable_outputs", outputs)
    # np.asarray keeps a 0-d weight 0-d (np.ascontiguousarray would make it [1]).
    weights = {k: np.asarray(v, order="C") for k, v in (weights or {}).items()}
    order = _weights_order(weights, weights_order)
    check_64_bit_types(inputs, weights)
    files: dict[str, bytes] = {}

    traced: list[int | None] = [None] if dynamic_batch else list(sizes)
    for index, batch in enumerate(traced, 1):
        started = time.perf_counter()
        exported = _export_one(name, fn, weights, order, inputs, outputs, batch)
        if progress is not None:
            what = (f"traced with a symbolic batch size for compiled batch sizes {sizes}" if batch is None
                    else f"traced compiled batch size {batch} ({index}/{len(traced)})")
            progress(Step("trace", index, len(traced),
                          f"{name}: {what} in {time.perf_counter() - started:.2f}s"))
        if bytecode:
            files[module_file_name(batch, bytecode=True)] = exported.mlir_module_serialized
        else:
            files[module_file_name(batch)] = eliminate_common_subexpressions(exported.mlir_module()).encode()

    return write_bundle(out_dir, files, inputs=inputs, outputs=outputs, weights=weights,
                        weights_order=order, compiled_batch_sizes=sizes,
                        client_inputs=client_inputs, client_outputs=client_outputs,
                        extra_files=extra_files)


def write_bundle(
    out_dir: str | os.PathLike[str],
    modules: Mapping[str, bytes],
    *,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    weights: Mapping[str, np.ndarray] | None,
    weights_order: Sequence[str] | None,
    compiled_batch_sizes: Sequence[int],
    client_inputs: Sequence[TensorSpec] | None = None,
    client_outputs: Sequence[TensorSpec] | None = None,
    extra_files: Mapping[str, str] | None = None,
) -> Path:
    """Write a bundle whose modules are already made: ``modules`` maps each module's file name
    (:func:`module_file_name`) to its bytes, whatever produced them (:func:`export_bundle` from
    JAX, :mod:`xlaserve.export.from_torch` from torch-mlir). The manifest, weights file,
    ``extra_files`` and the staged, atomic move into place are as :func:`export_bundle` says.
    The modules are not checked against the manifest here; loading the bundle does that.
    """
    out_dir = Path(out_dir)
    name = out_dir.name
    if not name or name.startswith("."):
        raise ValueError(f"bundle directory name {name!r} must be non-empty and not start with '.'")
    sizes = check_batch_sizes(compiled_batch_sizes)
    _check_unique("executable_inputs", inputs)
    _check_unique("executable_outputs", outputs)
    # np.asarray keeps a 0-d weight 0-d (np.ascontiguousarray would make it [1]).
    weights = {k: np.asarray(v, order="C") for k, v in (weights or {}).items()}
    order = _weights_order(weights, weights_order)
    files = dict(modules)
    manifest = _manifest(
        name, inputs, outputs, client_inputs, client_outputs, order if weights else None, sizes
    )
    files[MANIFEST_FILE] = yaml.safe_dump(
        manifest, sort_keys=False, default_flow_style=None, width=100
    ).encode()

    for file_name, text in (extra_files or {}).items():
        if Path(file_name).name != file_name or file_name.startswith("."):
            raise ValueError(f"extra file {file_name!r} must be a plain file name")
        if file_name in files or file_name == WEIGHTS_FILE:
            raise ValueError(f"extra file {file_name!r} would overwrite a generated file")
        files[file_name] = text.encode()

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        staging.chmod(0o755)
        for file_name, data in files.items():
            (staging / file_name).write_bytes(data)
        if weights:
            save_file(weights, str(staging / WEIGHTS_FILE))
        for path in staging.iterdir():
            path.chmod(0o644)  # as readable as any file the operator writes by hand
        _move_into_place(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


_64_BIT = {"i64", "u64", "f64"}


def check_64_bit_types(inputs: Sequence[TensorSpec], weights: Mapping[str, np.ndarray]) -> None:
    """Refuse 64-bit inputs and weights while JAX runs with 64-bit types off (its default): JAX
    would trace them as their 32-bit kin, and the module would not take what the manifest and
    the weights file say. The error names the tensor and both ways out."""
    if jax.config.jax_enable_x64:
        return
    found = [f"input {spec.name!r} ({spec.dtype})" for spec in inputs if spec.dtype in _64_BIT]
    found += [f"weight {name!r} ({dtype_code(a.dtype)})" for name, a in weights.items()
              if dtype_code(a.dtype) in _64_BIT]
    if found:
        raise ExportError(
            f"{', '.join(found)}: 64-bit, but JAX has 64-bit types off (jax_enable_x64), so it"
            " would trace them as 32-bit; set JAX_ENABLE_X64=1 (or jax.config.update("
            "'jax_enable_x64', True)) or give them a 32-bit dtype"
        )


def _check_unique(field: str, specs: Sequence[TensorSpec]) -> None:
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"{field}: tensor names {names} are not unique")


def _weights_order(weights: Mapping[str, np.ndarray], weights_order: Sequence[str] | None) -> list[str]:
    for weight_name, array in weights.items():
        if array.dtype not in DTYPES.values():
            raise ValueError(f"weight {weight_name!r}: dtype {array.dtype} has no manifest code")
    if weights_order is None:
        return sorted(weights)
    order = list(weights_order)
    if sorted(order) != sorted(weights) or len(set(order)) != len(order):
        raise ValueError(
            f"weights_order {order} must list every weight exactly once: {sorted(weights)}"
        )
    return order


def _manifest(
    name: str,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    client_inputs: Sequence[TensorSpec] | None,
    client_outputs: Sequence[TensorSpec] | None,
    order: list[str] | None,
    sizes: list[int],
) -> dict[str, Any]:
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "name": name,
        "executable_inputs": [spec.to_manifest() for spec in inputs],
        "executable_outputs": [spec.to_manifest() for spec in outputs],
    }
    if client_inputs is not None:
        manifest["client_inputs"] = [spec.to_manifest() for spec in client_inputs]
    if client_outputs is not None:
        manifest["client_outputs"] = [spec.to_manifest() for spec in client_outputs]
    if order is not None:
        manifest["weights"] = {"file": WEIGHTS_FILE, "order": list(order)}
    manifest["batching"] = {"compiled_batch_sizes": list(sizes)}
    return manifest


@jax.tree_util.register_pytree_with_keys_class
class _Named:
    """An ordered group of named arguments.

    Its pytree keys become the argument locations in the module, so ``@main`` reads
    ``%arg0: tensor<512x512xf32> loc("weights['w']")`` instead of ``loc("args[0]")``.
    """

    def __init__(self, names: Sequence[str], values: Sequence[Any]) -> None:
        self.names = tuple(names)
        self.values = tuple(values)

    def tree_flatten_with_keys(self):
        keys = [jax.tree_util.DictKey(n) for n in self.names]
        return list(zip(keys, self.values)), self.names

    @classmethod
    def tree_unflatten(cls, names, values):
        return cls(names, values)


#: The symbolic batch size of a dynamic-batch module, as messages show it.
SYMBOLIC_BATCH = "b"


def _export_one(
    name: str,
    fn: Callable[..., Any],
    weights: Mapping[str, np.ndarray],
    order: list[str],
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    batch: int | None,
) -> jax.export.Exported:
    """One module at ``batch``, or with a symbolic batch size (``batch`` None)."""
    if batch is None:
        (batch,) = jax.export.symbolic_shape(SYMBOLIC_BATCH)
    def main(weights: _Named, inputs: _Named):
        result = fn(*weights.values, *inputs.values)
        results = tuple(result) if isinstance(result, (tuple, list)) else (result,)
        if len(results) != len(outputs):  # checked properly below, with a better message
            return results
        return _Named([spec.name for spec in outputs], results)

    # The module is named after the bundle (`module @jit_<name>`), never after fn.
    main.__name__ = main.__qualname__ = name if name.isidentifier() else "main"
    weight_args = _Named(
        order, [jax.ShapeDtypeStruct(weights[w].shape, weights[w].dtype) for w in order]
    )
    input_args = _Named(
        [spec.name for spec in inputs],
        [jax.ShapeDtypeStruct(spec.row_major(batch), DTYPES[spec.dtype]) for spec in inputs],
    )
    with _module_locations():
        try:
            exported = jax.export.export(jax.jit(main))(weight_args, input_args)
        except Exception as exc:
            arguments = [f"{w}: {abstract_shape(weights[w].shape, weights[w].dtype)}" for w in order]
            arguments += [
                f"{spec.name}: {abstract_shape(spec.row_major(batch), DTYPES[spec.dtype])}"
                for spec in inputs
            ]
            raise TracingError(
                name, batch, exc, f"fn({', '.join(arguments)})  [weights, then inputs]"
            ) from exc

    found = exported.out_avals
    if len(found) != len(outputs):
        raise ValueError(
            f"bundle {name!r} b{batch}: fn returned {len(found)} outputs,"
            f" executable_outputs lists {len(outputs)}"
        )
    for spec, aval in zip(outputs, found):
        expected = (spec.row_major(batch), DTYPES[spec.dtype])
        if (tuple(aval.shape), np.dtype(aval.dtype)) != expected:
            raise ValueError(
                f"bundle {name!r} b{batch}: output {spec.name!r} expected"
                f" {expected[1]}{list(expected[0])}, fn returned {np.dtype(aval.dtype)}{list(aval.shape)}"
            )
    return exported


_config_lock = threading.Lock()


@contextlib.contextmanager
def _module_locations() -> Iterator[None]:
    """Keep op names in module locations, leave Python source locations out.

    By default JAX records a Python traceback (file path, line, column) in every op's location, so
    a module would depend on where the repository is checked out and on who called export. With a
    traceback limit of 0, an op's location is only its name (``loc("jit(mlp)/tanh")``).
    These are process-global settings, so they are set and restored under a lock.
    """
    settings = {
        "jax_include_full_tracebacks_in_locations": True,
        "jax_traceback_in_locations_limit": 0,
    }
    with _config_lock:
        previous = {key: getattr(jax.config, key) for key in settings}
        try:
            for key, value in settings.items():
                jax.config.update(key, value)
            yield
        finally:
            for key, value in previous.items():
                jax.config.update(key, value)


def _move_into_place(staging: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        os.rename(staging, out_dir)
        return
    if _exchange(staging, out_dir):
        # staging now holds the previous bundle.
        shutil.rmtree(staging)
        return
    previous = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
    os.rename(out_dir, previous / out_dir.name)
    os.rename(staging, out_dir)
    shutil.rmtree(previous)


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux ``renameat2(RENAME_EXCHANGE)``; False if unsupported."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd = -100
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0
