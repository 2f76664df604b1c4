"""Export a JAX function ``fn(params, *inputs)`` with a nested parameter pytree, and verify it.

This is the path ``xlaserve export`` takes. :func:`export_jax` flattens ``params`` (dicts, lists,
tuples, any registered pytree) to dotted names (``dense1.kernel``, ``layers.0.bias``) in
``weights.safetensors``, records the order ``fn`` takes them in as the manifest's
``weights.order`` (the order ``jax.jit`` flattens the pytree, whatever the names sort to), infers
the outputs from a trace when they are not given, writes the bundle with
:func:`xlaserve.export.writer.export_bundle`, and then verifies it (:mod:`xlaserve.export.verify`):
every module, loaded as the server loads it, against ``fn`` itself.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from xlaserve.export.spec import (DTYPES, ExportError, TensorSpec, TracingError, abstract_shape,
                                  check_batch_sizes, dtype_code)
from xlaserve.export.verify import Verification, verify_bundle
from xlaserve.export.writer import check_64_bit_types, export_bundle
from xlaserve.manifest import BATCH_AXIS

__all__ = [
    "JaxExport",
    "default_axes",
    "export_jax",
    "flatten_params",
    "hooks_skeleton",
    "infer_outputs",
    "output_specs",
]

#: Axis letters given to the non-batch axes of a tensor whose axes are not named, fastest-varying
#: (last row-major) axis first: a row-major ``[B, 16]`` is ``xn``, ``[B, 224, 224, 3]`` is ``xyzn``.
DEFAULT_AXIS_LETTERS = "xyzwvutsrqpomlkjihgfedcba"


def default_axes(rank: int, batched: bool = True) -> str:
    """The default shape string of a tensor with ``rank`` non-batch axes: letters from
    :data:`DEFAULT_AXIS_LETTERS`, fastest first, then ``n`` (the batch, row-major axis 0)."""
    if rank > len(DEFAULT_AXIS_LETTERS):
        raise ExportError(f"{rank} axes is more than the {len(DEFAULT_AXIS_LETTERS)} letters axes can be named with")
    return DEFAULT_AXIS_LETTERS[:rank] + (BATCH_AXIS if batched else "")


def _key_name(key: Any) -> str:
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def flatten_params(params: Any) -> dict[str, np.ndarray]:
    """``params`` as ``{dotted name: array}``, in the order ``jax.jit`` passes its leaves.

    A dict key or attribute gives its name, a list or tuple element its index:
    ``{"dense1": {"kernel": k}, "layers": [{"bias": b}]}`` gives ``dense1.kernel`` and
    ``layers.0.bias``. A bare array is named ``params``. The order is JAX's flattening order
    (each dict's keys sorted, sequences in index order), the order the traced module takes the
    leaves in; it is not the names sorted (``layers.10`` comes after ``layers.9``). Two leaves with
    one name, or an array dtype with no manifest code, are an :class:`ExportError` naming them.
    """
    flat: dict[str, np.ndarray] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = ".".join(_key_name(key) for key in path) or "params"
        if name in flat:
            raise ExportError(
                f"parameters: two leaves are both named {name!r} once flattened to dotted names;"
                " rename one (a key holding '.' collides with a nested key)"
            )
        array = np.asarray(leaf, order="C")   # a 0-d leaf stays 0-d
        try:
            dtype_code(array.dtype)
        except ValueError:
            raise ExportError(
                f"parameter {name!r}: dtype {array.dtype} cannot be stored in a bundle;"
                f" expected one of {', '.join(d.name for d in DTYPES.values())}"
            ) from None
        flat[name] = array
    return flat


class _Shown:
    """A leaf shown as its abstract value, unquoted, when its container is printed."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _abstract_tree(tree: Any) -> str:
    """A pytree of arrays as its abstract values: ``{'dense': {'kernel': f32[4,8]}}``."""
    def leaf(x: Any) -> _Shown:
        dtype = getattr(x, "dtype", None)
        return _Shown(abstract_shape(np.shape(x), np.asarray(x).dtype if dtype is None else dtype))
    return repr(jax.tree_util.tree_map(leaf, tree))


def _signature(params: Any, inputs: Sequence[TensorSpec], batch: int) -> str:
    shown = ", ".join(
        f"{spec.name}={abstract_shape(spec.row_major(batch), DTYPES[spec.dtype])}" for spec in inputs
    )
    return f"fn(params={_abstract_tree(params)}, {shown})"


def _output_leaves(fn: Callable[..., Any], params: Any, inputs: Sequence[TensorSpec],
                   batch: int, bundle: str) -> list[tuple[str, jax.ShapeDtypeStruct]]:
    """Trace ``fn`` abstractly at ``batch``: its outputs as (default name, abstract value)."""
    args = [jax.ShapeDtypeStruct(spec.row_major(batch), DTYPES[spec.dtype]) for spec in inputs]
    abstract_params = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), params)
    try:
        result = jax.eval_shape(fn, abstract_params, *args)
    except Exception as exc:
        raise TracingError(bundle, batch, exc, _signature(params, inputs, batch)) from exc
    leaves = jax.tree_util.tree_flatten_with_path(result)[0]
    if len(leaves) == 1 and not leaves[0][0]:
        return [("output", leaves[0][1])]
    named = []
    for path, value in leaves:
        name = ".".join(_key_name(key) for key in path)
        if isinstance(path[0], jax.tree_util.SequenceKey):
            name = "output" + name       # a tuple of outputs: output0, output1, ...
        named.append((name, value))
    return named


def infer_outputs(
    fn: Callable[..., Any],
    params: Any,
    inputs: Sequence[TensorSpec],
    compiled_batch_sizes: Sequence[int],
    *,
    names: Sequence[str] | None = None,
    axes: Mapping[str, str] | None = None,
    bundle: str = "model",
) -> tuple[list[TensorSpec], list[str]]:
    """The output specs of ``fn(params, *inputs)``, found by tracing it at two batch sizes.

    ``names`` renames the outputs in order (default: ``output`` for a single array, the keys of a
    returned dict, ``output0``, ``output1``... for a tuple). ``axes`` maps an output name to its
    shape string; an output without one gets :func:`default_axes`, which needs the batch on
    row-major axis 0. Returns the specs and one note per defaulted output, saying which axes it
    got. An output whose batch axis cannot be placed is an :class:`ExportError` naming it.
    """
    sizes = check_batch_sizes(compiled_batch_sizes)
    # Two different sizes tell the batch axis from the others; the second need not be compiled.
    first, second = sizes[0], (sizes[1] if len(sizes) > 1 else sizes[0] + 1)
    at_first = _output_leaves(fn, params, inputs, first, bundle)
    at_second = _output_leaves(fn, params, inputs, second, bundle)
    return output_specs([name for name, _ in at_first], [v for _, v in at_first],
                        [v for _, v in at_second], first, second, names=names, axes=axes)


def output_specs(
    found_names: Sequence[str],
    at_first: Sequence[Any],
    at_second: Sequence[Any],
    first: int,
    second: int,
    *,
    names: Sequence[str] | None = None,
    axes: Mapping[str, str] | None = None,
) -> tuple[list[TensorSpec], list[str]]:
    """Output specs from what a source returned at batch sizes ``first`` and ``second`` (two
    different sizes): ``at_first``/``at_second`` hold one value with ``shape`` and ``dtype`` per
    output, in order, named ``found_names``. ``names`` and ``axes`` and the result are as
    :func:`infer_outputs` says; every source (JAX, PyTorch) names its outputs this one way.
    """
    found_names = list(found_names)
    if names is not None:
        if len(names) != len(at_first):
            raise ExportError(
                f"{len(names)} output names given ({', '.join(names)}), but the function returns"
                f" {len(at_first)} outputs ({', '.join(found_names)})"
            )
        found_names = list(names)
    if len(set(found_names)) != len(found_names):
        raise ExportError(f"output names {found_names} are not unique")
    axes = dict(axes or {})
    unknown = sorted(set(axes) - set(found_names))
    if unknown:
        raise ExportError(f"axes given for {unknown}, which are not outputs; the outputs are {found_names}")
    specs, notes = [], []
    for name, a, b in zip(found_names, at_first, at_second):
        shape_a, shape_b = tuple(a.shape), tuple(b.shape)
        try:
            code = dtype_code(a.dtype)
        except ValueError:
            raise ExportError(f"output {name!r}: dtype {a.dtype} cannot be served") from None
        where = (f"output {name!r} is {abstract_shape(shape_a, a.dtype)} at batch {first} and"
                 f" {abstract_shape(shape_b, b.dtype)} at batch {second}")
        given = axes.get(name)
        if given is None:
            if not shape_a or shape_a[0] != first or shape_b[0] != second or shape_a[1:] != shape_b[1:]:
                raise ExportError(
                    f"{where}: without named axes the batch must be its first (row-major) axis;"
                    " name its axes (Python: output_axes; command line: --output NAME:AXES)"
                )
            letters = default_axes(len(shape_a) - 1)
            notes.append(f"output {name!r}: axes not given, named {letters!r} (fastest first) for"
                         f" row-major [B,{','.join(str(d) for d in shape_a[1:])}]".replace("[B,]", "[B]"))
        else:
            letters = given
            if len(letters) != len(shape_a):
                raise ExportError(f"{where}: axes {letters!r} name {len(letters)} axes, it has {len(shape_a)}")
            expected_a = tuple(first if c == BATCH_AXIS else d for c, d in zip(reversed(letters), shape_a))
            expected_b = tuple(second if c == BATCH_AXIS else d for c, d in zip(reversed(letters), shape_a))
            if shape_a != expected_a or shape_b != expected_b:
                raise ExportError(f"{where}, which does not fit axes {letters!r} ('n' is the batch)")
        dims = {c: int(d) for c, d in zip(reversed(letters), shape_a) if c != BATCH_AXIS}
        try:
            specs.append(TensorSpec(name, code, letters, dims))
        except ValueError as exc:
            raise ExportError(str(exc)) from None
    return specs, notes


def hooks_skeleton(name: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> str:
    """A ``model.py`` for bundle ``name`` whose hooks pass every tensor through unchanged: a
    starting point for the Python that does not belong in the module (docs/hooks-and-meta.md)."""
    def listing(specs: Sequence[TensorSpec]) -> str:
        return "\n".join(
            f"    #   {spec.name}: {spec.dtype}"
            f"[{','.join('B' if d == BATCH_AXIS else str(spec.dims[d]) for d in reversed(spec.shape))}]"
            for spec in specs
        )
    return f'''"""{name}'s model.py: Python around the compiled module (docs/hooks-and-meta.md).

Written by `xlaserve export --hooks`; both hooks return the tensors unchanged. When a hook changes
what clients send or receive, declare that as client_inputs / client_outputs in manifest.yaml.
"""
from xlaserve import NamedTensor, register_model


def preprocess(tensors: list[NamedTensor]) -> list[NamedTensor]:
    # What a client sends, row-major, one request's rows; return the module's inputs:
{listing(inputs)}
    return tensors


def postprocess(tensors: list[NamedTensor]) -> list[NamedTensor]:
    # The module's outputs, row-major, one request's rows; return what the client receives:
{listing(outputs)}
    return tensors


register_model({name!r}, preprocess=preprocess, postprocess=postprocess)
'''


@dataclasses.dataclass(frozen=True, slots=True)
class JaxExport:
    """What :func:`export_jax` wrote and found: the bundle directory, the output specs, the
    weights in binding order, notes on defaults it chose, and the verification (None when
    ``verify=False``)."""

    bundle: Path
    outputs: tuple[TensorSpec, ...]
    weights_order: tuple[str, ...]
    notes: tuple[str, ...]
    verification: Verification | None


def export_jax(
    out_dir: str | os.PathLike[str],
    fn: Callable[..., Any],
    params: Any,
    *,
    inputs: Sequence[TensorSpec],
    compiled_batch_sizes: Sequence[int],
    outputs: Sequence[TensorSpec] | None = None,
    output_names: Sequence[str] | None = None,
    output_axes: Mapping[str, str] | None = None,
    bytecode: bool = False,
    extra_files: Mapping[str, str] | None = None,
    hooks: bool = False,
    verify: bool = True,
    atol: float | None = None,
    rtol: float | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    dynamic_batch: bool = False,
) -> JaxExport:
    """Export ``fn(params, *inputs)`` as a bundle at ``out_dir`` and verify it against ``fn``.

    ``params`` is any pytree of arrays (None for none); it is stored under dotted names
    (:func:`flatten_params`) and passed to each module in the order ``fn`` takes it. ``inputs``
    are the executable inputs, in ``fn``'s argument order. ``outputs`` may be given in full (in
    the order of ``fn``'s flattened result: a dict's keys sorted);
    otherwise they are inferred (:func:`infer_outputs` with ``output_names`` and
    ``output_axes``), and what was defaulted is in the result's ``notes``. ``hooks`` adds a
    pass-through ``model.py`` (:func:`hooks_skeleton`) to ``extra_files``.

    With ``verify`` (the default) every module is then loaded the way the server loads it and
    run on seeded random inputs next to ``jax.jit(fn)`` with the in-memory ``params``, both on
    the ``cpu`` backend; above the tolerance (``atol``/``rtol``, default per dtype, see
    :mod:`xlaserve.export.verify`) it raises
    :class:`xlaserve.export.verify.VerificationError` and the bundle stays written for
    inspection. ``progress`` hears the notes, then one line per module traced, compiled and
    verified (each a :class:`~xlaserve.progress.Step` but the notes).

    ``dynamic_batch=True`` writes one module with a symbolic batch size, ``model.mlir``, instead
    of one per size (see :func:`xlaserve.export.writer.export_bundle`); the verification then runs it
    specialized to each compiled batch size, as the server will.
    """
    out_dir = Path(out_dir)
    inputs = list(inputs)
    weights = flatten_params(params) if params is not None else {}
    check_64_bit_types(inputs, weights)
    treedef = jax.tree_util.tree_structure(params)
    notes: list[str] = []
    if outputs is None:
        outputs, notes = infer_outputs(fn, params, inputs, compiled_batch_sizes,
                                       names=output_names, axes=output_axes, bundle=out_dir.name)
        for note in notes if progress is not None else ():
            progress(f"note: {note}")
    outputs = list(outputs)
    count = len(weights)
    if hooks:
        extra_files = {**(extra_files or {}), "model.py": hooks_skeleton(out_dir.name, inputs, outputs)}

    def flat_fn(*args: Any) -> tuple[Any, ...]:
        tree = jax.tree_util.tree_unflatten(treedef, args[:count]) if params is not None else None
        return tuple(jax.tree_util.tree_leaves(fn(tree, *args[count:])))

    try:
        export_bundle(out_dir, flat_fn, inputs=inputs, outputs=outputs, weights=weights or None,
                      compiled_batch_sizes=compiled_batch_sizes, weights_order=list(weights),
                      bytecode=bytecode, extra_files=extra_files, progress=progress,
                      dynamic_batch=dynamic_batch)
    except TracingError as exc:
        # Name the call as the user wrote it (a params pytree), not as the flattened module.
        raise TracingError(exc.bundle, exc.batch, exc.cause,
                           _signature(params, inputs, exc.batch)) from exc.cause
    verification = None
    if verify:
        def reference(*arrays: np.ndarray) -> list[np.ndarray]:
            # On the cpu, like the modules under test: on a GPU, jax's default f32 matmul may
            # use TF32 and differ from the modules by far more than the f32 tolerance.
            with jax.default_device(jax.devices("cpu")[0]):
                result = jax.jit(fn)(params, *arrays)
            return [np.asarray(x) for x in jax.tree_util.tree_leaves(result)]
        verification = verify_bundle(out_dir, reference, atol=atol, rtol=rtol, seed=seed,
                                     progress=progress)
    return JaxExport(out_dir, tuple(outputs), tuple(weights), tuple(notes), verification)
